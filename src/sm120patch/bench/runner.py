"""Running bench's workers in the target interpreter, one process per GPU, and following them:
progress, time limits, and a worker's failure as the one error the user sees."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Callable, Sequence

from sm120patch.bench.preflight import BenchRequest, ranks_on_one_gpu
from sm120patch.bench.report import BenchReport, Case
from sm120patch.errors import CheckFailedError, RefusedError, Sm120PatchError, TargetError, UsageError
from sm120patch.fusionpath import FusionVerdict
from sm120patch.invocation import command

# |fused - reference| <= ATOL + RTOL * |reference|: a few units in the last place of the
# output format at the magnitudes these inputs produce (the reference is float32).
TOLERANCE = {"bf16": (2.0 ** -5, 2.0 ** -5), "fp16": (2.0 ** -8, 2.0 ** -8)}
RMS_EPS = 1e-6
BUILD_TIMEOUT_S = 1800.0  # a cold JIT cache compiles trtllm_comm: minutes on a small machine
CASE_TIMEOUT_S = 120.0  # one shape, checked and timed; a lamport kernel that waits forever hangs
EXIT_GRACE_S = 15.0
PAIR_TIMEOUT_S = 60.0  # one pair of ranks: a two-rank workspace and one small fused call
# Why two GPUs cannot complete a fused call together, and what to set or change.
PAIR_HINT = ("the fused kernel reads its peers' memory directly (CUDA IPC over PCIe peer-to-peer): "
             "`nvidia-smi topo -p2p r` must say OK between them; on workstation boards turn PCIe ACS off in the firmware "
             "or boot with iommu=pt; in a virtual machine peer-to-peer must be passed through to the guest; where NCCL "
             "itself hangs, NCCL_P2P_DISABLE=1 (or NCCL_P2P_LEVEL=LOC) moves NCCL off P2P, but the fused kernel needs "
             "it: until the pair passes, serve without fusion")
WORKER = Path(__file__).with_name("_bench_worker.py")  # runs in the target, one process per GPU


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
    if error["phase"] == "pair":
        return CheckFailedError(f"{_pair_words(case)} could not complete a fused call together: {message}", hint=PAIR_HINT)
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


def _pair_words(case: dict) -> str:
    (first, second), gpus = case["pair"], case.get("gpus") or (None, None)
    named = f" (GPUs {gpus[0]} and {gpus[1]})" if all(gpus) else ""
    return f"ranks {first} and {second}{named}"


def run(request: BenchRequest, *, world_size: int, on_event: Callable[[dict], None] | None = None,
        servers: Sequence[FusionVerdict] = (), tune: dict | None = None,
        ask: Callable[[list], int | None] | None = None) -> BenchReport:
    """Start one worker per GPU in the target interpreter, follow their progress, and collect
    the result; hangs and crashes become one clear error (every worker is stopped). ``tune``:
    the tuner's settings (its rows and the box's facts then come back in the result); ``ask``:
    given the rows measured so far, the next token count to measure in the same run, or None
    (the tuner's narrowing of the limits: bench.limits.next_probe)."""
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
    if tune is not None:
        config["tune"] = dict(tune, refine=ask is not None)
    config["one_gpu"] = ranks_on_one_gpu(request)
    source = WORKER.read_text(encoding="utf-8")
    import tempfile

    with tempfile.TemporaryDirectory(prefix="sm120patch-bench-") as tmp:
        workdir = Path(tmp)
        read_fd, write_fd = os.pipe()
        # The parent's answers to rank 0's "refine" events: the read end is rank 0's.
        ask_read, ask_write = os.pipe() if ask is not None else (-1, -1)
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
                    if ask_read >= 0:
                        env["SM120PATCH_BENCH_ASK_FD"] = str(ask_read)
                log = open(workdir / f"rank-{rank}.log", "wb")
                procs.append(subprocess.Popen([str(request.python), "-c", source], env=env, cwd="/",
                                              stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                              pass_fds=tuple(fd for fd in (write_fd, ask_read) if fd >= 0)
                                              if rank == 0 else ()))
                log.close()
            os.close(write_fd)
            write_fd = -1
            if ask_read >= 0:
                os.close(ask_read)
                ask_read = -1
            follow(procs, read_fd, on_event, ask=ask, answer_fd=ask_write)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            os.close(read_fd)
            for fd in (write_fd, ask_read, ask_write):
                if fd >= 0:
                    os.close(fd)
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
           build_timeout: float = BUILD_TIMEOUT_S, case_timeout: float = CASE_TIMEOUT_S,
           pair_timeout: float = PAIR_TIMEOUT_S, ask: Callable[[list], int | None] | None = None,
           answer_fd: int = -1) -> None:
    """Relay rank 0's progress and enforce the time limits: a stage (build, one pair of ranks,
    one shape) that makes no progress in time is a hang, and every worker is killed. A "refine"
    event (the tuner's rows so far) is answered on ``answer_fd`` with ``ask``'s next token count
    (null: none), as one JSON line; without ``ask`` the answer is null."""
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
            if current and "pair" in current:
                raise CheckFailedError(f"{_pair_words(current)} did not complete one small fused call in "
                                       f"{pair_timeout:.0f} s: it hangs (every worker was stopped)", hint=PAIR_HINT)
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
            if event.get("event") == "stage":  # a new stage (a build, a workspace) has the build's time
                current = None
                deadline = time.monotonic() + build_timeout
            if event.get("event") in ("case", "pair"):
                current = event
                deadline = time.monotonic() + (case_timeout if event["event"] == "case" else pair_timeout)
            if event.get("event") == "refine":
                tokens = ask(event["rows"]) if ask is not None else None
                if answer_fd >= 0:
                    try:
                        os.write(answer_fd, (json.dumps({"tokens": tokens}) + "\n").encode())
                    except OSError:  # rank 0 is gone: its exit code says why
                        pass
                deadline = time.monotonic() + case_timeout  # the next size's first event, or the exit
                continue  # the rows are the result's, not progress to show
            if on_event:
                on_event(event)
