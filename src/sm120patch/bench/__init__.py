"""`sm120patch bench`: the self-test a user runs on their own GPUs before turning fusion on.

It runs in the *target* interpreter (the server's torch and FlashInfer), one process per GPU
(``_bench_worker.py``, run there by path). First it checks, for every shape, FlashInfer's fused
allreduce + residual add + RMSNorm (called exactly as SGLang calls it) against an NCCL allreduce
followed by a float32 reference RMSNorm; then it times the fused call against the unfused pair
(NCCL allreduce + FlashInfer's fused_add_rmsnorm) and turns the timings into a recommendation
for SGLang's flag and vLLM's size threshold.

Nothing here writes to the environment; FlashInfer builds ``trtllm_comm`` (and ``norm``) in
its JIT cache on first use, exactly as the server's first start would.

With ``--tune`` it measures instead where fusion wins on this box at this TP size: every pair
of ranks completes one small fused call first (a pair that fails or hangs is named), then at
each size one-shot, two-shot, NCCL + norm and each installed server's PCIe-IPC allreduce + norm
(``pcie_ipc_paths``, where its server sends that size) are checked against the reference and
timed in several interleaved repetitions; ``limits`` turns the medians into the one-shot and fused limits,
the workers measure the sizes it asks for between two measured ones in the same run (rank 0 sends the
rows, ``ask`` answers) until each limit is within 10 % of its crossover, and ``profile`` writes them,
with the whole table, into the profile the patched servers read. What would stop that write (a file
there that is no profile it can merge into, a path it cannot write) is refused before anything runs.

- ``target``: what the target interpreter has; ``preflight``: the options and every reason the
  run cannot start; ``runner``: the workers; ``report``: the measurements and the recommendation;
  ``limits``: the tuned limits from a table; ``profile``: the profile file.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Callable, NamedTuple

from dataclasses import replace

from sm120patch import _tuned_runtime as runtime
from sm120patch import driver, pipeline, tunedlimits
from sm120patch.bench import profile
from sm120patch.bench.limits import MAX_PROBES, UNFUSED_PATHS, Row, derive, next_probe, release_oneshot_max_bytes
from sm120patch.bench.preflight import SUPPORTED_WORLD_SIZES, BenchRequest, parse_int_list, preflight
from sm120patch.bench.report import BenchReport, Case, Recommendation, Series, TuneReport, failure
from sm120patch.bench.runner import WORKER, _classify, follow, run
from sm120patch.bench.target import TargetInfo, probe_target
from sm120patch.distributions import load_registry
from sm120patch.environment import version_or_none
from sm120patch.errors import CheckFailedError, RefusedError, Sm120PatchError, UsageError
from sm120patch.fileio import NotRegularFile, read_regular
from sm120patch.words import spec_words

__all__ = ["SUPPORTED_WORLD_SIZES", "WORKER", "BenchReport", "BenchRequest", "Case", "Recommendation", "Series",
           "TargetInfo", "TuneReport", "_classify", "_sglang_flag", "bench", "tune", "failure", "follow", "parse_int_list",
           "pcie_ipc_paths", "preflight", "probe_target", "run"]


def bench(request: BenchRequest, *, on_event: Callable[[dict], None] | None = None) -> BenchReport:
    """The whole command: ask the target what it has, refuse what cannot run, run the workers."""
    prepared = _prepare(request)
    report = run(prepared.request, world_size=prepared.world_size, on_event=on_event, servers=prepared.paths)
    report.sglang_flag = _sglang_flag(prepared.registry, prepared.status)
    report.advice = [(t.assessment.name, level, text) for t in prepared.status.trees
                     for level, text in t.advice_lines(bench=True)]
    return report


def tune(request: BenchRequest, *, profile_path: Path, model: Path | None = None,
         on_event: Callable[[dict], None] | None = None) -> TuneReport:
    """`bench --tune`: every pair of ranks first, then every path checked and timed at each
    size, the limits derived, and the profile written for this box and TP size."""
    prepared = _prepare(request)
    world = prepared.world_size
    check_profile_path(profile_path)  # before minutes of measuring, not after
    hidden = request.hidden[0]

    def ask(rows: list) -> int | None:
        """The next size to measure in this run: the middle of a limit's crossover still wider than
        10 % (limits.next_probe), None when there is none (or the probes' bound is reached)."""
        if sum(1 for row in rows if row.get("probe")) >= MAX_PROBES:
            return None
        try:
            return next_probe(derive([Row.from_table(row) for row in rows], world=world, hidden=hidden))
        except Sm120PatchError:  # nothing to derive from: the derivation after the run says why
            return None

    settings = {"repeats": request.repeats, "oneshot_max_bytes": release_oneshot_max_bytes(world),
                "runtime": Path(runtime.__file__).read_text(encoding="utf-8"),
                "distributions": [d.name for d in prepared.registry] + ["torch"], "pcie_ipc": list(prepared.pcie_ipc)}
    report = run(prepared.request, world_size=world, on_event=on_event, servers=prepared.paths, tune=settings, ask=ask)
    facts = report.meta["tune"]
    facts["rows"] = sorted(facts["rows"], key=lambda row: row["tokens"])  # the probes among the sizes asked for
    limits = derive([Row.from_table(row) for row in facts["rows"]], world=world, hidden=hidden)
    entry = profile.entry(limits, rows=facts["rows"], software=facts["software"], nccl_env=facts["nccl_env"],
                          dtype=request.dtype, hidden=hidden, model=model, gpus=facts["gpus"])
    result = TuneReport(prepared.request, world, report.meta, limits, entry)
    try:
        profile.refuse_shared_gpus(facts["gpus"])
        # The server judges the profile with this same code on this box: write only what it will take.
        document = {"kind": profile.KIND, "format": runtime._SM120PATCH_PROFILE_FORMAT, "box": facts["box"],
                    "entries": {str(world): entry}}
        _, why = runtime._sm120patch_judge(document, world, runtime._sm120patch_box(), runtime._sm120patch_nccl_env(),
                                           facts["software"])
        if why:
            raise CheckFailedError(f"the measured profile would not hold here ({why}); nothing was written")
        check_profile_path(profile_path, measured=True)  # changed while the tuner measured?
        result.profile = profile.write(profile_path, box=facts["box"], tp=world, new_entry=entry)
    except Sm120PatchError as error:
        result.errors.append(error)
    return result


def check_profile_path(path: Path, *, measured: bool = False) -> None:
    """Refuse now what the profile's write would refuse at the end: a file at ``path`` that is not
    a profile sm120patch can merge into (whatever it holds: tunedlimits.problem, one line, never a
    traceback), or a path this user cannot create a file at (the nearest existing directory)."""
    done = "nothing was written" if measured else "nothing was measured"
    way_out = "move it away, or pass --profile with another path"
    try:
        data = read_regular(path)
    except (FileNotFoundError, NotADirectoryError):  # nothing there yet (a parent that is a file: below)
        data = None
    except (IsADirectoryError, NotRegularFile) as exc:
        raise RefusedError(f"{path} holds something that is not a tuned-limits profile ({exc.__class__.__name__}); "
                           f"{done}", hint=way_out) from None
    except OSError as exc:
        raise profile._cannot_write(path, exc) from None
    if data is not None:
        document, why = tunedlimits.parse(data)
        if why:
            raise RefusedError(f"{path} holds something that is not a tuned-limits profile ({why}); {done}",
                               hint=way_out)
        wrong = tunedlimits.problem(document)
        if wrong:
            raise RefusedError(f"{path}: {wrong}; {done}", hint=way_out)
    directory = path.absolute().parent
    while not os.path.lexists(directory) and directory != directory.parent:
        directory = directory.parent
    if not directory.is_dir():
        raise profile._cannot_write(path, NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR)))
    if not os.access(directory, os.W_OK | os.X_OK):
        raise profile._cannot_write(path, PermissionError(errno.EACCES, os.strerror(errno.EACCES)))


class _Prepared(NamedTuple):
    request: BenchRequest
    world_size: int
    registry: object
    status: object
    paths: list
    pcie_ipc: tuple = ()  # the servers' PCIe-IPC paths the tuner times (pcie_ipc_paths)


def _prepare(request: BenchRequest) -> _Prepared:
    """Ask the target what it has and refuse what cannot run (both modes)."""
    registry = load_registry(full=False)
    # Every installed distribution: the one whose kernels bench runs, and the servers whose
    # workspace path it follows.
    # The driver is read first, so that each server's fusion chain is judged for these GPUs.
    device = driver.query()
    status = pipeline.status(pipeline.Request(python=str(request.python) if request.python else None,
                                              jit_base=str(request.jit_base) if request.jit_base else None), registry,
                             device=device)
    kernels = next((d.name for d in registry if d.jit_module), None)
    tree = next((t for t in status.trees if t.distribution.name == kernels), None)
    if tree is None:
        raise UsageError(f"{kernels} is not installed in {status.target}")
    target = probe_target(Path(status.target), kernels)
    request = replace(request, python=Path(status.target), given_python=request.python is not None, kernels=kernels)
    chains = [t.chain for t in status.trees if t.chain is not None]
    world_size = preflight(request, target, flashinfer_verdict=tree.assessment.verdict.value,
                           aot_shadows=[s.path for s in status.aot], servers=chains)
    paths = [c.fusion for c in chains if c.fusion is not None and c.fusion.path is not None]
    return _Prepared(request, world_size, registry, status, paths, tuple(pcie_ipc_paths(status)))


def pcie_ipc_paths(status) -> list[dict]:
    """The PCIe-IPC allreduce each installed server release has with the installed FlashInfer
    (its distribution's [[pcie_ipc]] rows): the unfused paths `bench --tune` times beside NCCL,
    as the worker's config ("column": the table's, limits.UNFUSED_PATHS)."""
    found = []
    for item in status.trees:
        with_version = version_or_none(item.with_raw_version) if item.with_raw_version else None
        path = item.distribution.pcie_ipc_path(item.tree.version, with_version)
        if path is not None:
            found.append({"name": path.name, "column": UNFUSED_PATHS[path.name], "code": path.code,
                          "rows": path.rows, "switch": path.switch,
                          "server": f"{item.assessment.name} {item.assessment.raw_version} with "
                                    f"{item.distribution.fusion_with} {item.with_raw_version}"})
    return found


def _sglang_flag(registry, status) -> str:
    """The installed SGLang's own fusion option; without SGLang, each release range's."""
    sglang = registry.get("sglang")
    installed = next((t for t in status.trees if t.distribution.name == sglang.name), None)
    flag = installed and sglang.fusion_flag(installed.tree.version)
    if flag:
        return flag
    return "fusion (SGLang " + "; ".join(f"{spec_words(f.versions)}: {f.flag}" for f in sglang.fusion_flags) + ")"
