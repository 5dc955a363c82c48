"""`sm120patch check-log` over a 200 MB log: wall time, CPU time (user + system, which a loaded
machine disturbs far less than wall time) and peak memory of the process, for one or two trees.

    python benchmarks/check_log_200mb.py [--before OLD_TREE/src] [--runs 3] [--size-mb 200] [--keep DIR]

The log is an SGLang 0.5.9 start at TP2 (settings line, each rank's workspace line, the ready
line) followed by decode-batch lines of both ranks, a prefill line and a request echo every
thousand lines, in the shape configure_logger writes them, until it holds --size-mb MB; the
last lines are a second, fused run. The sm120patch of this interpreter runs it: this tree as
installed, the other (--before) through PYTHONPATH, alternating. Prints per tree the median
wall and CPU seconds and the largest peak RSS, and the verdict's exit code (0 expected).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STAMP = "[2026-11-28 10:03:41"


def line(scope: str, message: str) -> str:
    return f"{STAMP}{scope}] {message}\n"


def start() -> str:
    text = line("", "server_args=ServerArgs(model_path='m', tp_size=2, enable_flashinfer_allreduce_fusion=True)")
    text += "".join(line(f" TP{r}", f"FlashInfer workspace initialized for rank {r}, world_size 2") for r in (0, 1))
    return text + line("", "The server is fired up and ready to roll!")


def write_log(path: Path, size: int) -> None:
    decode = "".join(line(f" TP{r}", "Decode batch. #running-req: 1, #token: 100, token usage: 0.00, "
                                     "gen throughput (token/s): 90.00, #queue-req: 0") for r in (0, 1)) * 499
    block = (decode + line(" TP0", "Prefill batch. #new-seq: 1, #new-token: 12, #cached-token: 0")
             + line("", "Receive: obj=GenerateReqInput(text='Scheduler hit an exception? no.', sampling_params={})"))
    with path.open("w") as f:
        f.write(start())
        while f.tell() < size:
            f.write(block)
        f.write(start())


def measure(argv: list[str], env: dict) -> tuple[float, float, int, int]:
    """Wall seconds, CPU seconds, peak RSS (KiB) and exit code of one run in a fresh process (the
    peak read by the child itself, so earlier runs do not count)."""
    probe = ("import resource, runpy, sys; sys.argv = sys.argv[1:]\n"
             "try:\n    runpy.run_module('sm120patch', run_name='__main__')\n"
             "except SystemExit as e:\n    code = e.code\n"
             "else:\n    code = 0\n"
             "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, code, file=sys.stderr)")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", probe, "sm120patch", *argv], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, env=env)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    rss, code = done.stderr.split()[-2:]
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), int(rss), int(code)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=None, help="another tree's src directory, timed alternately")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--size-mb", type=int, default=200)
    parser.add_argument("--keep", default=None, help="write (or reuse) the log in this directory")
    args = parser.parse_args()
    directory = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="check-log-bench-"))
    log = directory / f"sglang-{args.size_mb}mb.log"
    if not log.exists():
        write_log(log, args.size_mb * 1000 * 1000)
    argv = ["check-log", str(log), "--server", "sglang", "--version", "0.5.9", "--json"]
    this = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    trees = {"this tree": this}
    if args.before:
        trees["before"] = dict(this, PYTHONPATH=args.before)
    results: dict[str, list] = {name: [] for name in trees}
    for _ in range(args.runs):
        for name, env in trees.items():
            results[name].append(measure(argv, env))
    print(f"{log} ({log.stat().st_size / 1e6:.0f} MB, {sum(1 for _ in log.open('rb'))} lines)")
    for name, rows in results.items():
        walls, cpus, rss, codes = zip(*rows)
        print(f"{name}: wall median {statistics.median(walls):.1f} s, CPU median {statistics.median(cpus):.1f} s "
              f"(min {min(cpus):.1f}, max {max(cpus):.1f}), peak RSS {max(rss) / 1024:.0f} MiB, "
              f"exit {sorted(set(codes))}, {args.runs} runs")
    if not args.keep:
        log.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
