"""Wall time of `sm120patch status` against `pip show flashinfer-python` on the same environment.

Target (issue: core): status takes at most half the wall time of pip show. Both commands run
alternately, `--runs` times each, on a venv holding the real flashinfer-python 0.6.4 and
sglang 0.5.9 wheels (and the pip that `python -m venv` brings). Prints a Markdown table.

    python benchmarks/status_vs_pip_show.py [--runs 21]
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sm120patch.wheels import fetch_wheel


def timed(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="sm120patch-bench-") as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        python = venv / "bin" / "python"
        wheels = [fetch_wheel("flashinfer-python", "0.6.4"), fetch_wheel("sglang", "0.5.9")]
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
                        *map(str, wheels)], check=True)
        sm120patch = shutil.which("sm120patch", path=str(Path(sys.executable).parent)) or "sm120patch"
        commands = {
            "sm120patch status": [sm120patch, "status", "--python", str(python)],
            "pip show flashinfer-python": [str(python), "-m", "pip", "show", "flashinfer-python"],
        }
        for argv in commands.values():  # warm the page cache and .pyc files
            timed(argv)
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.runs):
            for name, argv in commands.items():
                times[name].append(timed(argv))
        pip_version = subprocess.run([str(python), "-m", "pip", "--version"], capture_output=True, text=True).stdout.split()[1]

    status_median = statistics.median(times["sm120patch status"])
    pip_median = statistics.median(times["pip show flashinfer-python"])
    ratio = status_median / pip_median
    print(f"machine: {platform.machine()}, {platform.python_implementation()} {platform.python_version()}, "
          f"pip {pip_version}, {args.runs} alternating runs each\n")
    print("| command | median (s) | min (s) | max (s) |")
    print("| --- | --- | --- | --- |")
    for name, values in times.items():
        print(f"| `{name}` | {statistics.median(values):.3f} | {min(values):.3f} | {max(values):.3f} |")
    print(f"\nratio status / pip show (medians): {ratio:.2f} (target <= 0.50): {'PASS' if ratio <= 0.5 else 'FAIL'}")
    return 0 if ratio <= 0.5 else 1


if __name__ == "__main__":
    sys.exit(main())
