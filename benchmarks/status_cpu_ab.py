"""CPU time (user + system) of `sm120patch status` from two source trees, alternating runs: a
comparison that a loaded machine disturbs far less than wall time does (the time a process waits
for a core is not counted).

    python benchmarks/status_cpu_ab.py --python VENV/bin/python3 --before OLD_TREE/src [--runs 31] [--columns 80]

The sm120patch on PATH beside this interpreter runs both: this tree as installed, the other
through PYTHONPATH. Prints the median, min and max per tree, in milliseconds.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
from pathlib import Path


def cpu(argv: list[str], env: dict) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", required=True, help="the serving environment's interpreter")
    parser.add_argument("--before", required=True, help="the other tree's src directory")
    parser.add_argument("--runs", type=int, default=31)
    parser.add_argument("--columns", default=None, help="also time this tree with COLUMNS set (the text wrapped)")
    args = parser.parse_args()
    sm120patch = shutil.which("sm120patch", path=str(Path(sys.executable).parent)) or "sm120patch"
    argv = [sm120patch, "status", "--python", args.python]
    this = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "COLUMNS")}  # from bytecode
    trees = {"this tree": this, "before": dict(this, PYTHONPATH=args.before)}
    if args.columns:
        trees[f"this tree, COLUMNS={args.columns}"] = dict(this, COLUMNS=args.columns)
    for env in trees.values():  # warm the page cache and the .pyc files
        cpu(argv, env)
    times: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(args.runs):
        for name, env in trees.items():
            times[name].append(cpu(argv, env))
    for name, values in times.items():
        print(f"{name}: median {statistics.median(values) * 1000:.1f} ms CPU "
              f"(min {min(values) * 1000:.1f}, max {max(values) * 1000:.1f}, {args.runs} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
