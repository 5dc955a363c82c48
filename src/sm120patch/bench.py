"""`sm120patch bench`: the self-test a user runs on their own GPUs before turning fusion on.

It runs in the *target* interpreter (the server's torch and FlashInfer), one process per GPU
(``_bench_worker.py``). First it checks, for every shape, FlashInfer's fused allreduce +
residual add + RMSNorm (called exactly as SGLang calls it) against an NCCL allreduce followed
by a float32 reference RMSNorm; then it times the fused call against the unfused pair (NCCL
allreduce + FlashInfer's fused_add_rmsnorm) and turns the timings into a recommendation for
SGLang's flag and vLLM's size threshold.

Nothing here writes to the environment; FlashInfer builds ``trtllm_comm`` (and ``norm``) in
its JIT cache on first use, exactly as the server's first start would.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from sm120patch.errors import CheckFailedError, RefusedError, Sm120PatchError, TargetError, UsageError
from sm120patch.fusionpath import FusionVerdict
from sm120patch.invocation import command

# trtllm_allreduce_fusion refuses any other world size ("Supported ranks: 2, 4, 8, 16").
SUPPORTED_WORLD_SIZES = (2, 4, 8, 16)
# SGLang uses the fused path for batches of up to this many tokens (FUSE_ALLREDUCE_MAX_BATCH_SIZE).
SGLANG_MAX_FUSED_TOKENS = 2048
STRATEGIES = ("auto", "oneshot", "twoshot", "both")
# |fused - reference| <= ATOL + RTOL * |reference|: a few units in the last place of the
# output format at the magnitudes these inputs produce (the reference is float32).
TOLERANCE = {"bf16": (2.0 ** -5, 2.0 ** -5), "fp16": (2.0 ** -8, 2.0 ** -8)}
RMS_EPS = 1e-6
BUILD_TIMEOUT_S = 1800.0  # a cold JIT cache compiles trtllm_comm: minutes on a small machine
CASE_TIMEOUT_S = 120.0  # one shape, checked and timed; a lamport kernel that waits forever hangs
EXIT_GRACE_S = 15.0
WORKER = Path(__file__).with_name("_bench_worker.py")  # runs in the target, one process per GPU

_PROBE = r"""
import json, sys
out = {"torch": None, "flashinfer": None, "numpy": False}
try:
    from importlib import metadata
    out["flashinfer"] = metadata.version("flashinfer-python")
except Exception:
    pass
try:
    import numpy  # noqa: F401
    out["numpy"] = True
except Exception:
    pass
try:
    import torch
except Exception as exc:
    out["torch_error"] = "%s: %s" % (type(exc).__name__, exc)
else:
    out["torch"] = torch.__version__
    out["torch_cuda"] = torch.version.cuda
    out["cuda"] = bool(torch.cuda.is_available())
    out["nccl"] = bool(torch.distributed.is_available() and torch.distributed.is_nccl_available())
    out["devices"] = []
    if out["cuda"]:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out["devices"].append({"name": p.name, "capability": [p.major, p.minor]})
print(json.dumps(out))
"""


@dataclass(frozen=True)
class BenchRequest:
    python: Path | None  # None: the interpreter running sm120patch
    tokens: tuple[int, ...]  # the defaults are the CLI's (`sm120patch bench --help`)
    hidden: tuple[int, ...]
    tp: int | None = None  # None: every visible GPU
    dtype: str = "bf16"
    strategy: str = "auto"
    check_only: bool = False
    jit_base: Path | None = None
    seed: int = 0
    reps: int = 25
    inner: int = 10
    warmup: int = 5
    given_python: bool = False  # --python was given (python is then what the user named, resolved)


@dataclass(frozen=True)
class TargetInfo:
    """What the target interpreter said about its torch, GPUs and FlashInfer."""

    torch: str | None
    flashinfer: str | None
    cuda: bool
    nccl: bool
    devices: tuple[tuple[str, int, int], ...]  # (name, major, minor)
    torch_error: str | None = None
    numpy: bool = True


def probe_target(python: Path) -> TargetInfo:
    try:
        proc = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True, cwd="/", timeout=120)
    except subprocess.TimeoutExpired:
        raise TargetError(f"--python {python}: importing torch took over 120 s") from None
    try:
        data = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise TargetError(f"--python {python}: the GPU probe failed ({tail})") from None
    return TargetInfo(
        torch=data["torch"], flashinfer=data["flashinfer"], cuda=bool(data.get("cuda")),
        nccl=bool(data.get("nccl")),
        devices=tuple((d["name"], d["capability"][0], d["capability"][1]) for d in data.get("devices", ())),
        torch_error=data.get("torch_error"), numpy=bool(data.get("numpy")),
    )


def parse_int_list(text: str, *, option: str, minimum: int, maximum: int, multiple_of: int = 1) -> tuple[int, ...]:
    """``"1,2,16"`` -> (1, 2, 16); one clear error for anything else."""
    values = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit():
            raise UsageError(f"{option} {text}: {part!r} is not a whole number",
                             hint=f"give a comma-separated list, e.g. {option} 1,16,128")
        value = int(part)
        if not minimum <= value <= maximum or value % multiple_of:
            rule = f"between {minimum} and {maximum}" + (f" and a multiple of {multiple_of}" if multiple_of > 1 else "")
            raise UsageError(f"{option} {text}: {value} must be {rule}")
        values.append(value)
    if not values:
        raise UsageError(f"{option}: give at least one value, e.g. {option} 1,16,128")
    return tuple(sorted(set(values)))


def preflight(request: BenchRequest, target: TargetInfo, *, flashinfer_verdict: str | None,
              aot_shadows: Sequence[str] = (), servers: Sequence[FusionVerdict] = (),
              multicast: bool | None = None) -> int:
    """Every reason the run cannot start, as one clear error; returns the world size.
    ``servers``: each installed server's path past the gate; ``multicast``: whether the GPUs
    report multicast (None: the driver was not read)."""
    python = request.python
    # With --python given, the environment is the one the user meant: say what it lacks, not
    # to pass the option they passed.
    elsewhere = None if request.given_python else "pass --python with the interpreter your server runs"
    if target.torch is None:
        raise TargetError(f"torch is not importable in {python} ({target.torch_error}): bench runs in the "
                          "server's own environment, with its torch and FlashInfer", hint=elsewhere)
    if target.flashinfer is None:
        raise TargetError(f"flashinfer-python is not installed in {python}", hint=elsewhere)
    if not target.numpy:
        raise TargetError(f"numpy is not importable in {python} (FlashInfer needs it)")
    if not target.cuda:
        raise TargetError(f"no CUDA device is visible to torch {target.torch} in {python}"
                          + ("" if target.torch and "+cpu" not in target.torch else " (a CPU-only build)"),
                          hint="run bench on the GPU server, with the CUDA build of torch the server uses")
    if not target.nccl:
        raise TargetError(f"torch {target.torch} in {python} has no NCCL backend; bench compares against NCCL")
    visible = len(target.devices)
    if visible < 2:
        raise UsageError(f"bench needs at least 2 GPUs; {python} sees {visible} ({target.devices[0][0]})"
                         if visible else f"bench needs at least 2 GPUs; {python} sees none",
                         hint="the fused allreduce runs across 2, 4, 8 or 16 GPUs (check CUDA_VISIBLE_DEVICES)")
    tp = request.tp if request.tp is not None else visible
    if tp not in SUPPORTED_WORLD_SIZES:
        sizes = ", ".join(map(str, SUPPORTED_WORLD_SIZES[:-1])) + f" or {SUPPORTED_WORLD_SIZES[-1]}"
        raise UsageError(
            f"--tp {tp}: FlashInfer's fused allreduce runs at {sizes} ranks" + ("" if request.tp else f" ({visible} GPUs are visible)"),
            hint=f"pass --tp {max(s for s in SUPPORTED_WORLD_SIZES if s <= visible)}" if visible >= 2 else None,
        )
    if tp > visible:
        raise UsageError(f"--tp {tp}: {python} sees only {visible} GPUs")
    used = target.devices[:tp]
    if any(major == 12 for _, major, _ in used):
        if aot_shadows:
            raise RefusedError(f"a prebuilt trtllm_comm without SM120 code shadows the patched sources ({aot_shadows[0]})",
                               hint="uninstall flashinfer-jit-cache (or remove that file), then run bench again")
        if flashinfer_verdict not in ("patched", "fixed upstream"):
            state = flashinfer_verdict or "unknown"
            raise RefusedError(
                f"flashinfer-python {target.flashinfer} is {state}: on SM120 its fused allreduce does not build, "
                "or runs an empty kernel",
                hint=f"run `{command('apply', ('--python', str(python)))}` first",
            )
    if multicast is not True:  # the workers would see the fall-back too; say why before any GPU work
        for server in servers:
            if server.enters is False:
                raise RefusedError(f"{server.server} with {server.with_} would not fuse on these GPUs (no multicast): "
                                   f"{server.path.without}", hint=f"run `{server.apply_command}` first")
    return tp


@dataclass
class Case:
    tokens: int
    hidden: int
    strategy: str
    effective_strategy: str
    bytes: int
    ok: bool
    max_err_norm: float
    max_err_residual: float
    worst_ratio: float
    ranks_agree: bool
    digests: dict
    fused_us: float | None = None
    unfused_us: float | None = None
    graphs: bool | None = None

    @property
    def speedup(self) -> float | None:
        if self.fused_us and self.unfused_us:
            return self.unfused_us / self.fused_us
        return None


@dataclass
class Series:
    """One hidden size and strategy, by ascending token count, with where fusion stops winning."""

    hidden: int
    strategy: str
    cases: list[Case]

    @property
    def wins_up_to(self) -> Case | None:
        """The largest case such that the fused call is faster at it and at every smaller one."""
        best = None
        for case in self.cases:
            if case.speedup is None or case.speedup <= 1.0:
                break
            best = case
        return best

    @property
    def first_loss(self) -> Case | None:
        return next((c for c in self.cases if c.speedup is not None and c.speedup <= 1.0), None)


@dataclass
class Recommendation:
    sglang: bool | None  # None: decode-only win; the text says where
    sglang_text: str
    vllm_max_size_mb: float | None
    vllm_text: str


@dataclass
class BenchReport:
    request: BenchRequest
    world_size: int
    meta: dict
    cases: list[Case] = field(default_factory=list)
    atol: float = 0.0
    rtol: float = 0.0
    # SGLang's option that turns fusion on (the installed release's, else each release range's).
    sglang_flag: str = "--enable-flashinfer-allreduce-fusion"
    # (server, level, sentence): the installed servers' advice about running them
    advice: list = field(default_factory=list)

    @property
    def failed(self) -> list[Case]:
        return [c for c in self.cases if not c.ok]

    @property
    def timed(self) -> bool:
        return any(c.fused_us is not None for c in self.cases)

    def series(self) -> list[Series]:
        keys = dict.fromkeys((c.hidden, c.strategy) for c in self.cases)
        return [Series(h, s, sorted((c for c in self.cases if (c.hidden, c.strategy) == (h, s)), key=lambda c: c.tokens))
                for h, s in keys]

    def recommendation(self) -> Recommendation | None:
        """From the series SGLang would run (strategy auto, else what was measured)."""
        if not self.timed or self.failed:
            return None
        series = [s for s in self.series() if s.strategy == "auto"] or self.series()
        loses_at_start = [s for s in series if s.cases and (s.cases[0].speedup or 0) <= 1.0]
        limits = [s.wins_up_to for s in series]
        if loses_at_start:
            s = loses_at_start[0]
            sglang = (False, f"leave {self.sglang_flag} off: unfused is faster already at "
                             f"{_tokens(s.cases[0].tokens)}, hidden {s.hidden}")
        elif all(s.first_loss is None for s in series) and all(
                max(c.tokens for c in s.cases) >= min(SGLANG_MAX_FUSED_TOKENS, max(self.request.tokens)) for s in series):
            sglang = (True, f"turn {self.sglang_flag} on: fused is faster at every measured "
                            f"batch size (SGLang fuses batches of up to {SGLANG_MAX_FUSED_TOKENS} tokens)")
        else:
            cut = min((limit for limit in limits if limit), key=lambda c: c.tokens)
            sglang = (None, f"turn {self.sglang_flag} on only if your batches stay at or below "
                            f"{_tokens(cut.tokens)} (decode, speculative verify): fused wins up to there and loses "
                            f"beyond, and SGLang fuses batches of up to {SGLANG_MAX_FUSED_TOKENS} tokens")
        smallest = min((limit for limit in limits if limit), key=lambda c: c.bytes, default=None)
        if smallest is None or loses_at_start:
            vllm = (None, "leave vLLM's fuse_allreduce_rms pass off on this machine")
        else:
            mb = math.floor(smallest.bytes / 2 ** 20 * 100) / 100
            mb = mb if mb > 0 else round(smallest.bytes / 2 ** 20, 4)
            reach = ("the largest size measured; fused may win beyond it" if all(s.first_loss is None for s in series)
                     else "where fused stops winning")
            vllm = (mb, f"-cc.pass_config.fuse_allreduce_rms=true -cc.pass_config.fi_allreduce_fusion_max_size_mb={mb:g}"
                        f" ({_tokens(smallest.tokens)} at hidden {smallest.hidden}: {reach}; vLLM 0.12+; "
                        f"before: -O.pass_config.enable_fi_allreduce_fusion=true -O.pass_config.fi_allreduce_fusion_max_size_mb={mb:g})")
        return Recommendation(sglang[0], sglang[1], vllm[0], vllm[1])


def bench(request: BenchRequest, *, on_event: Callable[[dict], None] | None = None) -> BenchReport:
    """The whole command: ask the target what it has, refuse what cannot run, run the workers."""
    from dataclasses import replace

    from sm120patch import driver, pipeline
    from sm120patch.distributions import load_registry

    registry = load_registry(full=False)
    # Every installed distribution: the one whose kernels bench runs, and the servers whose
    # workspace path it follows.
    status = pipeline.status(pipeline.Request(python=str(request.python) if request.python else None,
                                              jit_base=str(request.jit_base) if request.jit_base else None), registry)
    kernels = next((d.name for d in registry if d.jit_module), None)
    tree = next((t for t in status.trees if t.distribution.name == kernels), None)
    if tree is None:
        raise UsageError(f"{kernels} is not installed in {status.target}")
    target = probe_target(Path(status.target))
    request = replace(request, python=Path(status.target), given_python=request.python is not None)
    servers = [t.fusion for t in status.trees if t.fusion is not None and t.fusion.path is not None]
    world_size = preflight(request, target, flashinfer_verdict=tree.assessment.verdict.value,
                           aot_shadows=[s.path for s in status.aot], servers=servers,
                           multicast=driver.query().multicast)
    report = run(request, world_size=world_size, on_event=on_event, servers=servers)
    report.sglang_flag = _sglang_flag(registry, status)
    report.advice = [(t.assessment.name, level, text) for t in status.trees for level, text in t.advice_lines(bench=True)]
    return report


def _sglang_flag(registry, status) -> str:
    """The installed SGLang's own fusion option; without SGLang, each release range's."""
    from sm120patch.render import _spec_words

    sglang = registry.get("sglang")
    installed = next((t for t in status.trees if t.distribution.name == sglang.name), None)
    flag = installed and sglang.fusion_flag(installed.tree.version)
    if flag:
        return flag
    return "fusion (SGLang " + "; ".join(f"{_spec_words(f.versions)}: {f.flag}" for f in sglang.fusion_flags) + ")"


def _free_port() -> int:
    import socket  # bench's own needs, imported when it runs: the CLI imports this module for its defaults

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tail(path: Path, lines: int = 1) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    meaningful = [line for line in text if line.strip()]
    return "\n".join(meaningful[-lines:])


def _classify(error: dict, python: Path, world_size: int) -> Sm120PatchError:
    """A worker's failure as the one error the user sees."""
    message, case = error["message"], error.get("case")
    where = f" (tokens {case['tokens']}, hidden {case['hidden']}, {case['strategy']})" if case else ""
    if "No supported CUDA architectures found" in message:
        return RefusedError(f"FlashInfer refuses to build trtllm_comm for these GPUs: {message}",
                            hint=f"run `{command('apply', ('--python', str(python)))}` first")
    if "unsupported ranks number" in message.lower() or "Supported ranks" in message:
        return UsageError(f"FlashInfer's fused allreduce refuses world size {world_size}: {message}")
    if error["phase"] == "import":
        return TargetError(f"flashinfer does not import in {python}: {message}")
    if error["phase"] == "build":
        return CheckFailedError(f"FlashInfer could not build its modules: {message}")
    return CheckFailedError(f"the {error['phase']} step failed{where}: {message}")


def run(request: BenchRequest, *, world_size: int, on_event: Callable[[dict], None] | None = None,
        servers: Sequence[FusionVerdict] = ()) -> BenchReport:
    """Start one worker per GPU in the target interpreter, follow their progress, and collect
    the result; hangs and crashes become one clear error (every worker is stopped)."""
    atol, rtol = TOLERANCE[request.dtype]
    strategies = ["oneshot", "twoshot"] if request.strategy == "both" else [request.strategy]
    config = {
        "tokens": list(request.tokens), "hidden": list(request.hidden), "dtype": request.dtype,
        "strategies": strategies, "check_only": request.check_only, "seed": request.seed,
        "eps": RMS_EPS, "atol": atol, "rtol": rtol,
        "reps": request.reps, "inner": request.inner, "warmup": request.warmup,
        "server_paths": [{"server": f"{s.server} with {s.with_}", "workspace": s.path.workspace,
                          "preflight": s.path.preflight} for s in servers],
    }
    source = WORKER.read_text(encoding="utf-8")
    import tempfile

    with tempfile.TemporaryDirectory(prefix="sm120patch-bench-") as tmp:
        workdir = Path(tmp)
        read_fd, write_fd = os.pipe()
        port = _free_port()
        procs = []
        try:
            for rank in range(world_size):
                env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                           LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                           SM120PATCH_BENCH_CONFIG=json.dumps(config), SM120PATCH_BENCH_DIR=str(workdir),
                           PYTHONUNBUFFERED="1")
                if request.jit_base is not None:
                    env["FLASHINFER_WORKSPACE_BASE"] = str(request.jit_base)
                if rank == 0:
                    env["SM120PATCH_BENCH_FD"] = str(write_fd)
                log = open(workdir / f"rank-{rank}.log", "wb")
                procs.append(subprocess.Popen([str(request.python), "-c", source], env=env, cwd="/",
                                              stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                              pass_fds=(write_fd,) if rank == 0 else ()))
                log.close()
            os.close(write_fd)
            write_fd = -1
            follow(procs, read_fd, on_event)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            os.close(read_fd)
            if write_fd >= 0:
                os.close(write_fd)
        errors = sorted(workdir.glob("error-*.json"))
        if errors:
            raise _classify(json.loads(errors[0].read_text()), request.python, world_size)
        for rank, proc in enumerate(procs):
            if proc.returncode != 0:
                raise CheckFailedError(f"bench worker {rank} died with exit code {proc.returncode}: "
                                       f"{_tail(workdir / f'rank-{rank}.log') or 'no output'}")
        result_path = workdir / "result.json"
        if not result_path.exists():
            raise CheckFailedError("the bench workers exited without a result")
        document = json.loads(result_path.read_text())
    cases = [Case(**{k: v for k, v in row.items() if k in Case.__dataclass_fields__}) for row in document.pop("cases")]
    return BenchReport(request, world_size, document, cases, atol, rtol)


def _select(*args):
    import select

    return select.select(*args)


def follow(procs: Sequence[subprocess.Popen], read_fd: int, on_event: Callable[[dict], None] | None, *,
           build_timeout: float = BUILD_TIMEOUT_S, case_timeout: float = CASE_TIMEOUT_S) -> None:
    """Relay rank 0's progress and enforce the time limits: a stage (build, one shape) that
    makes no progress in time is a hang, and every worker is killed."""
    buffer = b""
    deadline = time.monotonic() + build_timeout
    current: dict | None = None
    finished_at: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        if all(code is not None for code in codes):
            return
        if any(code not in (None, 0) for code in codes):
            # One rank died: the others wait for it in NCCL or a lamport spin; give them a moment.
            finished_at = finished_at or time.monotonic()
            if time.monotonic() - finished_at > EXIT_GRACE_S:
                return
        if time.monotonic() > deadline:
            for proc in procs:
                proc.kill()
            what = (f"tokens {current['tokens']}, hidden {current['hidden']}, {current['strategy']}"
                    if current and "tokens" in current else "building or loading FlashInfer's modules")
            limit = case_timeout if current and "tokens" in current else build_timeout
            raise CheckFailedError(
                f"no progress for {limit:.0f} s at {what}: the fused kernel hangs (every worker was stopped)",
                hint="a lamport one-shot kernel that never sees its peers' data spins forever; "
                     "`sm120patch verify` shows whether every patch is in place")
        ready, _, _ = _select([read_fd], [], [], 0.2)
        if not ready:
            continue
        chunk = os.read(read_fd, 65536)
        if not chunk:  # rank 0 closed its end: it is exiting
            deadline = time.monotonic() + EXIT_GRACE_S + case_timeout
            for proc in procs:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
            return
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "case":
                current = event
                deadline = time.monotonic() + case_timeout
            if on_event:
                on_event(event)


def _tokens(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def _size(n: int) -> str:
    for unit, scale in (("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value >= 10 or value == int(value) else f"{value:.1f} {unit}"
    return f"{n} B"


def render(report: BenchReport) -> str:
    meta = report.meta
    lines = [
        f"flashinfer-python {meta.get('flashinfer')} · torch {meta.get('torch')} (CUDA {meta.get('cuda')}) · "
        f"{report.world_size} × {meta.get('device')} (compute capability {meta.get('capability')}) · {report.request.dtype}",
        f"check: fused allreduce + residual + RMSNorm vs NCCL allreduce + float32 RMSNorm, "
        f"|err| <= {report.atol:g} + {report.rtol:g}·|ref| (norm and residual outputs, every rank)",
    ]
    for path in meta.get("server_paths", ()):
        lines.append(f"server path: {path['server']}: " + _server_path_text(path))
    timed = report.timed
    for series in report.series():
        lines.append("")
        lines.append(f"hidden {series.hidden}, {series.strategy}")
        header = f"  {'tokens':>6}  {'size':>8}  {'path':<8}  {'check':<5}  {'max err':>8}"
        if timed:
            header += f"  {'fused µs':>9}  {'NCCL+norm µs':>12}  {'speedup':>7}"
        lines.append(header)
        for c in series.cases:
            row = (f"  {c.tokens:>6}  {_size(c.bytes):>8}  {c.effective_strategy:<8}  {'ok' if c.ok else 'FAIL':<5}"
                   f"  {max(c.max_err_norm, c.max_err_residual):>8.4g}")
            if timed and c.fused_us is not None:
                row += f"  {c.fused_us:>9.1f}  {c.unfused_us:>12.1f}  {c.speedup:>6.2f}×"
            lines.append(row + ("" if c.ranks_agree else "  ranks disagree"))
        if timed:
            win, loss = series.wins_up_to, series.first_loss
            if win is None:
                lines.append("  crossover: unfused is faster from the smallest size")
            elif loss is None:
                lines.append(f"  crossover: none measured; fused is faster up to {_tokens(win.tokens)} ({_size(win.bytes)})")
            else:
                lines.append(f"  crossover: fused is faster up to {_tokens(win.tokens)} ({_size(win.bytes)}), "
                             f"slower from {_tokens(loss.tokens)} ({_size(loss.bytes)})")
    graphs = [c.graphs for c in report.cases if c.graphs is not None]
    if graphs:
        lines.append("")
        lines.append("timing: median of CUDA-graph replays" if all(graphs) else
                     "timing: median of eager launches (some calls could not be captured in a CUDA graph)")
    recommendation = report.recommendation()
    if recommendation:
        lines.append("")
        lines.append("Recommendation for this machine (unfused = NCCL; SGLang's own custom allreduce can beat NCCL "
                     "on small messages, so treat a narrow fused win as a tie):")
        lines.append(f"  SGLang: {recommendation.sglang_text}")
        lines.append(f"  vLLM:   {recommendation.vllm_text}")
    if report.advice:
        lines.append("")
        lines.append("When you run the server:")
        lines.extend(f"  {'!' if level == 'warn' else 'note:'} {text}" for _, level, text in report.advice)
    return "\n".join(lines)


def _server_path_text(path: dict) -> str:
    made = ("FlashInfer's unified workspace created as the server creates it" if path["workspace"] == "unified"
            else "the legacy call (trtllm_create_ipc_workspace_for_all_reduce_fusion), the one bench itself makes")
    return made + (f"; its own preflight: {path['preflight']}" if path.get("preflight") else "")


def to_json(report: BenchReport) -> dict:
    recommendation = report.recommendation()
    return {
        "python": str(report.request.python),
        "world_size": report.world_size,
        "dtype": report.request.dtype,
        **{k: report.meta.get(k) for k in ("flashinfer", "torch", "cuda", "nccl", "device", "capability")},
        "tolerance": {"atol": report.atol, "rtol": report.rtol},
        "server_paths": report.meta.get("server_paths", []),
        "ok": not report.failed,
        "cases": [dict(c.__dict__, speedup=c.speedup) for c in report.cases],
        "advice": [{"distribution": name, "level": level, "text": text} for name, level, text in report.advice],
        "recommendation": None if recommendation is None else {
            "sglang_enable_fusion": recommendation.sglang,
            "sglang": recommendation.sglang_text,
            "vllm_fi_allreduce_fusion_max_size_mb": recommendation.vllm_max_size_mb,
            "vllm": recommendation.vllm_text,
        },
    }


def failure(report: BenchReport) -> CheckFailedError | None:
    """The error to exit with when a check failed (the table has already been printed)."""
    if not report.failed:
        return None
    worst = max(report.failed, key=lambda c: c.worst_ratio)
    reason = ("the ranks computed different results" if not worst.ranks_agree else
              f"max error {max(worst.max_err_norm, worst.max_err_residual):.4g}, over the tolerance "
              f"{report.atol:g} + {report.rtol:g}·|ref| by {worst.worst_ratio:.3g}×")
    return CheckFailedError(
        f"fused allreduce + RMSNorm differs from NCCL + RMSNorm in {len(report.failed)} of {len(report.cases)} "
        f"case(s); worst: tokens {worst.tokens}, hidden {worst.hidden}, {worst.effective_strategy}: {reason}",
        hint="do not turn fusion on; `sm120patch verify --compile` shows whether the lamport kernel body is there",
    )
