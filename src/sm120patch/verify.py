"""`sm120patch verify`: prove the patched state, three ways.

- static (always): each patched file's sha256 against the vendor manifest, and a semantic
  check per patch that depends on neither hashes nor rewriters (see semantics.py);
- runtime: FlashInfer's own ``gen_trtllm_comm_module()`` in the target interpreter with
  ``FLASHINFER_CUDA_ARCH_LIST=12.0a``: pristine raises the ``[9, 10]`` error, patched targets
  ``sm_120a``;
- compile: the lamport kernel from the installed headers compiled to PTX (see ptx.py):
  ``sm_120a`` must contain ``griddepcontrol``; ``sm_90a`` and ``sm_100a`` must be identical to
  the PTX from the release's header (kept by sm120patch as the original);
- tuned: where the opt-in patch tuned-limits is applied, the server's own decision code, imported
  in the target interpreter as the server imports it, asked at the profile's boundary sizes (and
  1..TP) what it does: fused or not, one-shot or two-shot (see _decision_probe.py). Its own flag,
  not part of --runtime: it imports the whole server (seconds, and the server's dependencies),
  and `apply --with tuned-limits` runs it after writing, rolling back where the code raises.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from sm120patch import ptx, runas, signals, tunedlimits
from sm120patch.assess import State
from sm120patch.errors import ExitCode, Sm120PatchError
from sm120patch.jitbuild import end_group, missing_for_build, start_build
from sm120patch.reports import StatusReport, TreeStatus
from sm120patch.semantics import evaluate
from sm120patch.words import counted

PTX_ARCHS = ("120a", "90a", "100a")


@dataclass(frozen=True)
class CheckResult:
    kind: str  # static / semantic / runtime / compile / build
    subject: str
    ok: bool | None  # None: it could not run (the detail says what it needs)
    detail: str
    required: bool = True  # a check that could not run fails verify, unless it is only informative
    broken: bool = False  # the server's patched code raised or did not import: a server would crash


def verify_exit_code(results) -> ExitCode:
    """0 only when every check ran and passed: a check the user asked for that could not run
    does not pass."""
    counted = [r for r in results if r.required or r.ok is False]
    return ExitCode.OK if counted and all(r.ok for r in counted) else ExitCode.NOT_OK


def static_checks(item: TreeStatus) -> list[CheckResult]:
    a = item.assessment
    if a.patch_set is None:
        return [CheckResult("static", a.name, a.nothing_needed, a.reason)]
    results = []
    for patch in a.patch_set.patches:
        state = a.patch_state(patch)
        if not patch.required and state is State.PRISTINE:
            continue  # an opt-in patch nobody asked for
        fa = a.files[patch.file]
        results.append(CheckResult(
            "static", f"{a.name} {patch.id}", state is State.APPLIED,
            f"{patch.file}: {state.value}" + (f" (sha256 {fa.sha256[:12]} = manifest)" if state is State.APPLIED else ""),
        ))
        if fa.state is not State.MISSING and fa.read.data is not None:
            # An older form (an earlier sm120patch's) is checked as that form; status says to update it.
            checks = [f.check for f in patch.formers] if patch.id in fa.former else [patch.check]
            found = [evaluate(c, fa.read.data) for c in checks]
            ok, detail = next((r for r in found if r[0]), found[0])
            if patch.id in fa.former:
                detail = f"older form: {detail}"
            if ok is None:
                ok, detail = False, f"cannot parse {patch.file} ({detail})"
            results.append(CheckResult("semantic", f"{a.name} {patch.id}", ok, detail))
    return results


def runtime_checks(python: Path, items: list[TreeStatus]) -> list[CheckResult]:
    """Each distribution's own JIT spec (asked for SM120) and an import of each of its patched
    Python modules, in the target interpreter, in a temporary JIT workspace: a check leaves no
    trace in the cache it checks (importing FlashInfer writes a log there)."""
    script = Path(__file__).with_name("_runtime_probe.py").read_text(encoding="utf-8")
    results = []
    for item in items:
        spec = item.distribution.verify
        a = item.assessment
        files = a.patch_set.files if a.patch_set else ()
        modules = [f[:-3].replace("/", ".").removesuffix(".__init__") for f in files if f.endswith(".py")
                   and not (spec.jit_spec and f[:-3].replace("/", ".") == spec.jit_spec.split(":")[0])]
        request = {"jit_spec": spec.jit_spec, "modules": modules}
        with tempfile.TemporaryDirectory(prefix="sm120patch-runtime-") as workspace:
            user = runas.environment_owner(python)  # as root on another user's environment: as that user
            user.give(Path(workspace))
            env = user.environ(dict(os.environ, FLASHINFER_WORKSPACE_BASE=workspace))
            if spec.arch_list:
                env["FLASHINFER_CUDA_ARCH_LIST"] = spec.arch_list
            proc = subprocess.run([str(python), "-c", script, json.dumps(request)],
                                  capture_output=True, text=True, env=env, cwd="/", timeout=600, **user.popen_args())
        try:
            out = json.loads(proc.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            results.append(CheckResult("runtime", a.name, False, f"the runtime probe failed: {tail}"))
            continue
        if spec.jit_spec:
            found = out["jit_spec"]
            subject = f"{spec.jit_spec}() with FLASHINFER_CUDA_ARCH_LIST={spec.arch_list}"
            if "skipped" in found:
                results.append(CheckResult("runtime", subject, None, found["skipped"] + "; install torch (and "
                                           f"{a.name}'s dependencies) in that environment to run this check"))
            elif "error" in found:
                results.append(CheckResult("runtime", subject, False, f"raises {found['error']}"))
            else:
                targets = [f for f in found["flags"] if f.startswith("-gencode=")]
                results.append(CheckResult("runtime", subject, any(spec.expect_target in f for f in targets),
                                           "nvcc targets: " + " ".join(targets)))
        for module, found in out["modules"].items():
            subject = f"import {module}"
            if "skipped" in found:
                # Informative: a server's full dependency tree is rarely in the environment checked.
                results.append(CheckResult("runtime", subject, None, found["skipped"], required=False))
            else:
                results.append(CheckResult("runtime", subject, "error" not in found,
                                           "imports" if "error" not in found else found["error"], required=False))
    return results


def _pristine_include_tree(include: Path, header: Path, original_header: bytes, into: Path) -> Path:
    """A mirror of the ``include`` directory (symlinks) whose ``header`` (a file under it) holds
    the release's bytes. Relative includes resolve against the directory a file was named
    through, so the mirror behaves exactly like the tree's own."""
    for directory, _, files in os.walk(include):
        target_dir = into / Path(directory).relative_to(include)
        target_dir.mkdir(parents=True, exist_ok=True)
        for name in files:
            (target_dir / name).symlink_to(Path(directory) / name)
    mirrored = into / header.relative_to(include)
    mirrored.unlink()
    mirrored.write_bytes(original_header)
    return into


def compile_checks(item: TreeStatus, *, progress: Callable[[str], None] | None = None) -> list[CheckResult]:
    a = item.assessment
    nvcc = ptx.find_nvcc()
    if nvcc is None:
        return [CheckResult("compile", "nvcc PTX", None, "nvcc not found ($CUDA_HOME/bin when set, else PATH, else /usr/local/cuda/bin): install the CUDA toolkit (>= 12.8) or set CUDA_HOME")]
    relpath = item.distribution.verify.compile_header
    header = a.files.get(relpath) if relpath else None
    if header is None:
        return [CheckResult("compile", "nvcc PTX", None, f"this release's patch set does not touch {relpath}")]
    if not item.distribution.verify.compile_includes:
        # Data from before the include path was data (SM120PATCH_DATA_DIR can point at it).
        return [CheckResult("compile", "nvcc PTX", None, "the patch data names no include path ([verify] compile_includes)")]
    # The include directories as the wheel names them, wherever this tree keeps them (an install:
    # under flashinfer/data; a checkout: include/ and 3rdparty/): the tree's read() says where.
    includes = [a.tree.read(relpath).path for relpath in item.distribution.verify.compile_includes]
    expected = a.manifest.files[relpath].pristine if a.manifest else None
    reference = a.tree.saved_original(relpath, expected) if header.state is State.APPLIED and expected else None

    def build(arch: str, tree: Sequence[Path], label: str) -> str:
        if progress:
            progress(f"compiling sm_{arch} PTX from the {label} header with {nvcc} ...")
        start = time.monotonic()
        text = ptx.compile_ptx(tree, arch, nvcc=nvcc)
        if progress:
            progress(f"  sm_{arch} ({label}): {time.monotonic() - start:.1f} s, {ptx.griddepcontrol_count(text)} griddepcontrol")
        return text

    results = []
    try:
        # The other architectures' PTX is compiled only where there is a release header to compare
        # it with: without one it could show nothing (an unpatched header is the release's).
        others = PTX_ARCHS[1:] if reference is not None else ()
        installed = {arch: build(arch, includes, "installed") for arch in (PTX_ARCHS[0], *others)}
        count = ptx.griddepcontrol_count(installed["120a"])
        detail = counted(count, "griddepcontrol instruction") + ("" if count else ": the kernel body is compiled out")
        if others and count:  # what the same kernel holds where it was never gated, to compare with
            detail += f" (sm_{others[0]}: {ptx.griddepcontrol_count(installed[others[0]])})"
        results.append(CheckResult("compile", "sm_120a lamport kernel PTX", count > 0, detail))
        if reference is None:
            detail = "installed header is the release's" if header.state is State.PRISTINE else "no saved original to compare with"
            for arch in PTX_ARCHS[1:]:
                results.append(CheckResult("compile", f"sm_{arch} PTX unchanged", None if header.state is not State.PRISTINE else True, detail))
            return results
        with tempfile.TemporaryDirectory(prefix="sm120patch-pristine-") as tmp:
            tree = [_pristine_include_tree(includes[0], header.path, reference, Path(tmp)), *includes[1:]]
            for arch in PTX_ARCHS[1:]:
                same = build(arch, tree, "release") == installed[arch]
                results.append(CheckResult("compile", f"sm_{arch} PTX unchanged", same,
                                           "byte-identical to the release header's PTX" if same else "PTX differs from the release header's"))
    except Sm120PatchError as exc:
        results.append(CheckResult("compile", "nvcc PTX", False, exc.message))
    return results


BUILD_ARCHS = "12.0a"  # what verify --build compiles for: SM120, as a server on an RTX PRO 6000 or RTX 5090 would


def build_check(python: Path, *, arch_list: str = BUILD_ARCHS, progress: Callable[[str], None] | None = None) -> list[CheckResult]:
    """FlashInfer's own JIT build of trtllm_comm into a temporary workspace; linking and
    loading need libcuda (a driver), so without one the objects are compiled and that is said."""
    script = """
import ctypes.util, json, os
import flashinfer.jit.comm as comm
spec = comm.gen_trtllm_comm_module()
out = {"build_dir": str(spec.build_dir), "sources": len(spec.sources), "libcuda": ctypes.util.find_library("cuda")}
try:
    spec.build_and_load()
    out["loaded"] = True
except Exception as exc:
    out["loaded"] = False
    out["error"] = "%s: %s" % (type(exc).__name__, str(exc).strip().splitlines()[-1] if str(exc).strip() else "")
out["objects"] = sorted(p for p in os.listdir(spec.build_dir) if p.endswith(".o"))
out["library"] = os.path.exists(spec.jit_library_path)
print(json.dumps(out))
"""
    with tempfile.TemporaryDirectory(prefix="sm120patch-build-") as workspace:
        user = runas.environment_owner(python)  # as root on another user's environment: as that user
        user.give(Path(workspace))
        env = user.environ(dict(os.environ, FLASHINFER_CUDA_ARCH_LIST=arch_list, FLASHINFER_WORKSPACE_BASE=workspace))
        if progress:
            progress(f"building trtllm_comm for {arch_list} with FlashInfer's JIT (minutes) ...")
        start = time.monotonic()
        # A process group of its own, ended whole on a signal (jitbuild.end_group) or when
        # sm120patch is killed outright: a killed interpreter alone would leave FlashInfer's
        # ninja and nvcc running.
        proc = start_build(python, script, [], env, user.popen_args(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
        try:
            stdout, stderr = proc.communicate()
        except BaseException:
            with signals.held():
                end_group(proc)
            raise
        proc = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        elapsed = time.monotonic() - start
        try:
            out = json.loads(proc.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            return [CheckResult("build", f"trtllm_comm JIT build ({arch_list})", False, tail)]
    subject = f"trtllm_comm JIT build ({arch_list})"
    objects, sources = len(out["objects"]), out["sources"]
    if out["loaded"]:
        return [CheckResult("build", subject, True, f"built and loaded in {elapsed:.0f} s ({objects} objects)")]
    if objects == sources and not out["libcuda"]:
        # Every source compiled; the link step needs libcuda, which only a machine with a driver has.
        return [CheckResult("build", subject, True,
                            f"compiled all {sources} sources in {elapsed:.0f} s; not linked or loaded: "
                            "no CUDA driver (libcuda) on this machine")]
    return [CheckResult("build", subject, False, f"{out.get('error')} after {elapsed:.0f} s ({objects} of {sources} objects)")]


@dataclass(frozen=True)
class VerifyReport:
    status: StatusReport
    results: list[CheckResult]
    errors = ()  # every failed check is a row of the report

    @property
    def exit_code(self) -> ExitCode:
        return verify_exit_code(self.results)


def verify(status: StatusReport, *, runtime: bool, compile_: bool, build: bool, tuned: bool = False,
           progress: Callable[[str], None] | None = None) -> VerifyReport:
    """``sm120patch verify``: the checks asked for, in the status report's interpreter."""
    return VerifyReport(status, run_verify(status, Path(status.target), runtime=runtime, compile_=compile_, build=build,
                                           tuned=tuned, progress=progress))


def run_verify(report: StatusReport, python: Path, *, runtime: bool, compile_: bool, build: bool, tuned: bool = False,
               progress: Callable[[str], None] | None = None) -> list[CheckResult]:
    """The checks asked for, over every distribution of the status report."""
    results = [r for item in report.trees for r in static_checks(item)]
    if runtime:
        results += runtime_checks(python, [item for item in report.trees if item.assessment.patch_set])
    if compile_:
        results += [r for item in report.trees if item.distribution.verify.compile_header and item.assessment.patch_set
                    for r in compile_checks(item, progress=progress)]
    if tuned:
        if progress:
            progress("running the servers' tuned decision code in the target interpreter ...")
        results += tuned_checks(python, report)
    if build:
        results += _build_or_why_not(report, python, progress)
    return results


def _build_or_why_not(report: StatusReport, python: Path, progress: Callable[[str], None] | None) -> list[CheckResult]:
    """The build check, or NOT RUN with the reason, as --runtime says it (where `build` refuses:
    sources that are not patched; or where the build cannot start: no torch, ninja or nvcc)."""
    subject = f"trtllm_comm JIT build ({BUILD_ARCHS})"
    kernels = [item for item in report.trees if item.distribution.jit_module and item.distribution.verify.jit_spec]
    if not kernels:
        return [CheckResult("build", subject, None, "not run: no distribution with a JIT module sm120patch patches "
                                                    "is installed here")]
    unpatched = [item.assessment for item in kernels if not item.assessment.verdict.done]
    if unpatched:
        a = unpatched[0]
        return [CheckResult("build", subject, None, f"not run: {a.name} {a.raw_version} is {a.verdict.value} (the "
                                                    "build would be of the release's sources; `sm120patch apply` first)")]
    missing = missing_for_build(python)
    if missing:
        return [CheckResult("build", subject, None, f"not run: {'; '.join(missing)}")]
    return build_check(python, arch_list=BUILD_ARCHS, progress=progress)


# -- tuned: the server's own decisions under the profile -------------------------------------------

TUNED_PATCH = "tuned-limits"
UNTUNED_TPS = (2, 4, 8)  # where no profile holds: the TP sizes the servers fuse at, each at 1..TP tokens
UNTUNED_HIDDEN = 4096


def _module_of(relpath: str) -> str:
    return relpath[:-3].replace("/", ".").removesuffix(".__init__")


def tuned_request(distribution, patch_set, cases: list[dict]) -> dict | None:
    """The probe's request, from the patch data: the predicate the tuned-limits patch rewrites, and
    the one-shot argument the patch it requires puts in the fused call (None: this release's
    tuned-limits is not a batch-size predicate the probe drives, e.g. vLLM's table rows)."""
    try:
        tuned = patch_set.patch(TUNED_PATCH)
    except KeyError:
        return None
    function = next((e.params["function"] for e in tuned.edits if e.rewriter == "python.replace-expression"), None)
    if function is None:
        return None
    oneshot = None
    for required in tuned.requires:
        patch = next((p for p in patch_set.patches if p.id == required), None)
        if patch is None:
            continue
        new = next((e.params["new"] for e in patch.edits if e.rewriter == "python.replace-argument"), None)
        if new is not None:
            oneshot = {"module": _module_of(patch.file), "expression": new}
    spec = distribution.verify
    return {"predicate": {"module": _module_of(tuned.file), "function": function, "cap": spec.tuned_cap},
            "oneshot": oneshot, "server_args": dict(spec.tuned_server_args), "device_flags": dict(spec.tuned_device_flags),
            "cases": cases}


def tuned_cases(profile) -> tuple[list[dict], dict[int, object]]:
    """The sizes to ask about: for each TP entry of the profile that holds here, its fused and
    one-shot limits in tokens (limit-1, limit, limit+1) and 1..TP; without one, 1..TP at TP2/4/8."""
    entries = {e.tp: e for e in profile.entries} if profile is not None and profile.usable else {}
    cases = []
    for tp, e in sorted(entries.items()):
        per_token = e.hidden * tunedlimits.ITEMSIZE[e.dtype]
        limits = (e.fused_max_bytes // per_token, e.oneshot_max_bytes // per_token)
        sizes = {*range(1, tp + 1), *(n + d for n in limits for d in (-1, 0, 1))}
        cases.append({"tp": tp, "hidden": e.hidden, "dtype": e.dtype, "sizes": sorted(s for s in sizes if s > 0)})
    if not cases:
        cases = [{"tp": tp, "hidden": UNTUNED_HIDDEN, "dtype": "bf16", "sizes": list(range(1, tp + 1))}
                 for tp in UNTUNED_TPS]
    return cases, entries


def _expected(entry, tp: int, size: int, cap) -> tuple[bool, bool | None]:
    """What the profile says the server does at ``size`` tokens (``entry`` None: the release's own
    rule): fused or not, and the one-shot argument (None: FlashInfer's own rule decides)."""
    within_cap = size >= 1 and (not isinstance(cap, int) or size <= cap)
    if entry is None:
        return within_cap, None
    per_token = entry.hidden * tunedlimits.ITEMSIZE[entry.dtype]
    fused = within_cap and size * per_token <= entry.fused_max_bytes
    rule = tunedlimits.ONESHOT_RULE_MIB.get(tp)
    if rule is None:
        return fused, None
    message = size * per_token
    # One-shot up to the profile's limit where FlashInfer's own rule allows it (its workspace is
    # sized by that rule); two-shot needs more tokens than ranks, so no more than TP is one-shot.
    return fused, (message <= entry.oneshot_max_bytes and message * 2 * tp <= rule * 1024 * 1024) or size <= tp


def _words(fused: bool, oneshot) -> str:
    if not fused:
        return "not fused"
    return {True: "fused one-shot", False: "fused two-shot", None: "fused (FlashInfer's one-shot rule)"}[oneshot]


def _decisions(row: dict) -> str:
    """``1-4, 16: fused one-shot; 17, 64: fused two-shot; 65: not fused``: each size under what the server does."""
    groups: dict[str, list[int]] = {}
    for size in sorted(int(s) for s in row["fused"]):
        groups.setdefault(_words(row["fused"][str(size)], row["oneshot"].get(str(size))), []).append(size)

    def spans(sizes: list[int]) -> str:
        runs, start = [], sizes[0]
        for a, b in zip(sizes, sizes[1:] + [None]):
            if b != a + 1:
                runs.append(str(start) if start == a else f"{start}-{a}")
                start = b
        return ", ".join(runs)

    return "; ".join(f"{spans(sizes)} tokens: {words}" for words, sizes in groups.items())


def run_tuned_probe(python: Path, request: dict) -> dict:
    script = Path(__file__).with_name("_decision_probe.py").read_text(encoding="utf-8")
    with tempfile.TemporaryDirectory(prefix="sm120patch-tuned-") as workspace:
        # The server's code is the environment's: as root on another user's environment it runs as
        # that user. FlashInfer writes its log under its workspace when imported: a check leaves no trace.
        user = runas.environment_owner(python)
        user.give(Path(workspace))
        env = user.environ(dict(os.environ, FLASHINFER_WORKSPACE_BASE=workspace))
        proc = subprocess.run([str(python), "-c", script, json.dumps(request)], capture_output=True, text=True,
                              env=env, cwd="/", timeout=600, **user.popen_args())
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"the decision probe failed: {tail}"}


def tuned_checks_for(python: Path, server: str, distribution, patch_set, profile) -> list[CheckResult]:
    """The tuned check of one server (``server``: "sglang 0.5.9") whose tuned-limits is applied."""
    cases, entries = tuned_cases(profile)
    request = tuned_request(distribution, patch_set, cases)
    subject = f"{server} decisions"
    if request is None:
        return [CheckResult("tuned", subject, None, f"not run: sm120patch does not drive {server}'s tuned-limits "
                                                    "code yet (it rewrites no batch-size predicate)")]
    out = run_tuned_probe(python, request)
    device = out.get("device")
    if "skipped" in out:
        return [CheckResult("tuned", subject, None, f"not run: {out['skipped']}")]
    if "error" in out:
        return [CheckResult("tuned", subject, False, out["error"] + "; a server with this patch fails the same way "
                            "at its first forward", broken=True)]
    results = [CheckResult("tuned", f"{server} device", True, device, required=False)]
    cap = out.get("cap")
    for row in out["cases"]:
        tp = row["tp"]
        subject = f"{server} at TP{tp}"
        if "error" in row:
            results.append(CheckResult("tuned", subject, False, row["error"] + "; a server with this patch fails the "
                                       "same way at its first forward", broken=True))
            continue
        if "skipped" in row:
            results.append(CheckResult("tuned", subject, None, f"not run: {row['skipped']}"))
            continue
        in_force = any(f"in force at TP{tp}:" in line for line in row["log"])
        expected_entry = entries.get(tp)
        entry = expected_entry if in_force else None
        wrong = []
        for size in sorted(int(s) for s in row["fused"]):
            want = _expected(entry, tp, size, cap)
            got = (row["fused"][str(size)], row["oneshot"].get(str(size)))
            if got != want:
                wrong.append(f"{size} tokens: {_words(*got)}, the {'profile' if entry else 'release'} says {_words(*want)}")
        said = row["log"][0] if row["log"] else "the server logged nothing about the profile"
        if expected_entry is not None and not in_force:
            results.append(CheckResult("tuned", subject, False, f"the server does not use the profile: {said}"))
        elif wrong:
            results.append(CheckResult("tuned", subject, False, "decides otherwise: " + "; ".join(wrong[:3])))
        else:
            whose = "as the profile says" if entry else "no profile holds: the release's own limits"
            results.append(CheckResult("tuned", subject, True, f"{_decisions(row)} — {whose}"))
    return results


def tuned_checks(python: Path, report: StatusReport) -> list[CheckResult]:
    """The tuned check of every server of the report whose tuned-limits is applied."""
    profile = None
    results = []
    for item in report.trees:
        a = item.assessment
        if a.patch_set is None or TUNED_PATCH not in (a.applied_ids or ()):
            continue
        if profile is None:
            profile = tunedlimits.read({t.assessment.name: t.assessment.raw_version for t in report.trees})
        results += tuned_checks_for(python, f"{a.name} {a.raw_version}", item.distribution, a.patch_set, profile)
    if not results:
        results.append(CheckResult("tuned", "tuned-limits", None, "not run: no server here has tuned-limits applied "
                                   "(`sm120patch apply --with tuned-limits`)"))
    return results
