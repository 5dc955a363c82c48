"""Wall time of `sm120patch status` against `pip show flashinfer-python` on the same environment.

Target: status takes at most half the wall time of pip show, of the *current* pip (the
benchmark upgrades the pip that `python -m venv` brings). Both commands run alternately,
`--runs` times each, on two environments: "small" (the real flashinfer-python 0.6.4 and
sglang 0.5.9 wheels, no dependencies) and "runtime" (the same plus torch CPU and the
dependencies FlashInfer imports at run time: a few dozen distributions, as a server has).
Prints a Markdown table per environment.

    python benchmarks/status_vs_pip_show.py [--runs 21] [--only small|runtime]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sm120patch.wheels import fetch_wheel


# Both commands as users run them: from bytecode. Where PYTHONDONTWRITEBYTECODE is set (some
# CI and sandbox machines set it) every run would compile each module it imports from source
# instead, which measures the compiler: status took 0.14 s that way here, 0.086 s from bytecode.
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def timed(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    return time.perf_counter() - start


# What tests/conftest.py installs for the runtime check: torch CPU and FlashInfer's imports.
RUNTIME = ["torch==2.13.0", "apache-tvm-ffi!=0.1.8,!=0.1.8.post0,<0.2,>=0.1.6", "ninja", "packaging", "numpy", "tqdm",
           "requests", "einops", "tabulate", "click", "nvidia-ml-py", "filelock"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--only", choices=["small", "runtime"], default=None)
    args = parser.parse_args()
    failed = 0
    for kind in ("small", "runtime"):
        if args.only in (None, kind):
            failed += measure(kind, args.runs)
    return 1 if failed else 0


def measure(kind: str, runs: int) -> int:
    with tempfile.TemporaryDirectory(prefix="sm120patch-bench-") as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        python = venv / "bin" / "python"
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        subprocess.run([*pip, "--upgrade", "pip"], check=True)
        if kind == "runtime":
            subprocess.run([*pip, *RUNTIME], check=True)
        wheels = [fetch_wheel("flashinfer-python", "0.6.4"), fetch_wheel("sglang", "0.5.9")]
        subprocess.run([*pip, "--no-deps", *map(str, wheels)], check=True)
        count = len(list(next((venv / "lib").glob("python3*/site-packages")).glob("*.dist-info")))
        sm120patch = shutil.which("sm120patch", path=str(Path(sys.executable).parent)) or "sm120patch"
        commands = {
            "sm120patch status": [sm120patch, "status", "--python", str(python)],
            "pip show flashinfer-python": [str(python), "-m", "pip", "show", "flashinfer-python"],
        }
        for argv in commands.values():  # warm the page cache and .pyc files
            timed(argv)
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(runs):
            for name, argv in commands.items():
                times[name].append(timed(argv))
        pip_version = subprocess.run([str(python), "-m", "pip", "--version"], capture_output=True, text=True).stdout.split()[1]

    status_median = statistics.median(times["sm120patch status"])
    pip_median = statistics.median(times["pip show flashinfer-python"])
    ratio = status_median / pip_median
    print(f"\n{kind} environment ({count} distributions); machine: {platform.machine()}, "
          f"{platform.python_implementation()} {platform.python_version()}, pip {pip_version}, {runs} alternating runs each\n")
    print("| command | median (s) | min (s) | max (s) |")
    print("| --- | --- | --- | --- |")
    for name, values in times.items():
        print(f"| `{name}` | {statistics.median(values):.3f} | {min(values):.3f} | {max(values):.3f} |")
    print(f"\nratio status / pip show (medians): {ratio:.2f} (target <= 0.50): {'PASS' if ratio <= 0.5 else 'FAIL'}")
    return 0 if ratio <= 0.5 else 1


if __name__ == "__main__":
    sys.exit(main())
