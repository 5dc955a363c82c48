"""Many ranks on one GPU: every rank a process of its own on GPU 0 (``CUDA_VISIBLE_DEVICES=0``),
a gloo process group for the host side (NCCL refuses two ranks on one device), CUDA IPC and
POSIX file descriptors between the processes for the device side. What the lent single H200
allows: correctness of the fused kernels at 2, 4 and 8 ranks. The ranks are time-sliced (each
spins on flags its peers write), so no timing from this mode means anything, and none is
reported. Test-only: nothing of it is in sm120patch, whose ``bench`` still refuses one GPU.

Two halves:

- :func:`launch` (the parent): starts ``world`` copies of a command, one per rank, with the
  rendezvous variables, the variables that keep multicast off in every library
  (:data:`SAFE_ENV`) and GPU 0 alone; waits for them up to a timeout; a rank still running
  then is killed, and the result names it (``hung``), with each rank's exit code and the end of
  its output. benchmarks/lamport_stride_demo.py, cluster_clamp_gpu.py and one_gpu_ranks.py
  start their ranks with it.
- :func:`start_rank` (each rank): optionally the device-index shim (tests/standin_driver.py:
  multicast reported absent, every cuMulticast* refused before the driver, every device index
  FlashInfer passes mapped to 0), then GPU 0, its primary context and the gloo group.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

# Multicast stays off in NCCL, PyTorch and NVSHMEM in every process: on the lent machines a
# program that uses NVLink multicast can take the host's shared GPUs out of service.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
RANK_VARIABLE = "ONE_GPU_RANK"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(command: list[str], world: int, timeout: float, log_dir: Path, env: dict | None = None,
           visible: str = "0") -> dict:
    """Run ``command`` once per rank (rank r's output in ``log_dir/rank{r}.log``), all bounded
    together by ``timeout`` seconds. ``visible``: CUDA_VISIBLE_DEVICES of every rank ("0": all
    on one GPU; None leaves the caller's). Returns the world, the elapsed time, each rank's exit
    code (None for a rank killed at the timeout), ``hung`` (those ranks) and each rank's last
    output lines."""
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs, logs = [], []
    start = time.monotonic()
    for rank in range(world):
        environ = dict(os.environ, **(env or {}), **SAFE_ENV, RANK=str(rank), WORLD_SIZE=str(world),
                       LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
        environ[RANK_VARIABLE] = str(rank)
        if visible is not None:
            environ["CUDA_VISIBLE_DEVICES"] = visible
        log = open(log_dir / f"rank{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen(command, env=environ, stdout=log, stderr=subprocess.STDOUT))
    codes: list[int | None] = [None] * world
    deadline = start + timeout
    while time.monotonic() < deadline and None in codes:
        for rank, proc in enumerate(procs):
            if codes[rank] is None:
                codes[rank] = proc.poll()
        time.sleep(0.2)
    hung = [rank for rank, code in enumerate(codes) if code is None]
    for rank in hung:  # one that hangs holds its peers' flags: the whole set is ended
        procs[rank].kill()
    for proc in procs:
        proc.wait()
    for log in logs:
        log.close()
    tails = {}
    for rank in range(world):
        lines = [line for line in (log_dir / f"rank{rank}.log").read_text(errors="replace").splitlines() if line.strip()]
        tails[rank] = lines[-6:]
    return {"world": world, "elapsed_s": round(time.monotonic() - start, 1), "exit_codes": codes, "hung": hung,
            "timeout_s": timeout, "tails": tails}


def launch_and_collect(command: list[str], world: int, timeout: float, prefix: str) -> tuple[dict, list[dict]]:
    """:func:`launch` with a fresh output directory in ``ONE_GPU_OUT`` (``prefix``: its name's
    start), then every JSON line the ranks wrote to ``rank<r>.jsonl`` there: (result, records)."""
    import json
    import tempfile

    out_dir = Path(tempfile.mkdtemp(prefix=prefix))
    result = launch(command, world, timeout, out_dir, env={"ONE_GPU_OUT": str(out_dir)})
    records = []
    for rank in range(world):
        path = out_dir / f"rank{rank}.jsonl"
        if path.exists():
            records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return result, records


def describe(result: dict) -> str:
    """One line: how the ranks ended, naming every rank that hung or failed."""
    parts = [f"{result['world']} ranks in {result['elapsed_s']} s"]
    if result["hung"]:
        parts.append(f"rank(s) {', '.join(map(str, result['hung']))} still running after {result['timeout_s']:.0f} s "
                     "and killed (hung)")
    failed = [r for r, c in enumerate(result["exit_codes"]) if c not in (0, None)]
    if failed:
        parts.append("exit codes " + ", ".join(f"rank {r}: {result['exit_codes'][r]}" for r in failed))
    return "; ".join(parts)


def rank_and_world() -> tuple[int, int] | None:
    """In a process :func:`launch` started: (rank, world); elsewhere None."""
    if RANK_VARIABLE not in os.environ:
        return None
    return int(os.environ[RANK_VARIABLE]), int(os.environ["WORLD_SIZE"])


def start_rank(shim: bool = True):
    """In each rank, before FlashInfer or a server's module is imported: the shim (``shim``),
    GPU 0 with its primary context (as a server has it), the gloo group. Returns the
    stand-in module (its CALLS record what the shim answered)."""
    missing = [k for k, v in SAFE_ENV.items() if os.environ.get(k) != v]
    if missing:  # never run a rank that could reach multicast
        raise SystemExit(f"one_gpu: {', '.join(missing)} not set as {SAFE_ENV}")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import standin_driver as sd

    if shim:
        sd.install(real=True)
        sd.map_devices_to_zero()
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    torch.empty(1, device="cuda")
    dist.init_process_group("gloo")
    return sd
