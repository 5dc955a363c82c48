"""What targeted cache invalidation saves on the next server start.

Populates a FlashInfer JIT cache with trtllm_comm and the modules a small SGLang-like decode
workload builds (norm, rope, SiLU-and-mul, paged KV append, sampling, bf16 batch decode with
head dim 128), then measures the next start's JIT time after
  (a) sm120patch's targeted invalidation (only cached_ops/trtllm_comm, every arch dir), and
  (b) the field practice `rm -rf ~/.cache/flashinfer`,
in the same run. A "start" is a fresh process that builds and loads every module in turn, as a
server does on first use. Needs FlashInfer, torch, nvcc and a CUDA driver:

    python benchmarks/jit_restart_cost.py --arch-list 9.0a --workspace /tmp/jitws [--jobs 8]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# Each entry: name -> Python that returns the module's JitSpec (run in the target interpreter).
MODULES = {
    "trtllm_comm": "import flashinfer.jit.comm as m; spec = m.gen_trtllm_comm_module()",
    "norm": "import flashinfer.jit.norm as m; spec = m.gen_norm_module()",
    "rope": "import flashinfer.jit.rope as m; spec = m.gen_rope_module()",
    "silu_and_mul": "import flashinfer.jit.activation as m; spec = m.gen_act_and_mul_module('silu')",
    "page": "import flashinfer.jit.page as m; spec = m.gen_page_module()",
    "sampling": "import flashinfer.jit.sampling as m; spec = m.gen_sampling_module()",
    "batch_decode_bf16_hd128": (
        "import torch; from flashinfer.jit.attention.modules import gen_batch_decode_module as g; "
        "spec = g(torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32, 128, 128, 0, False, False)"
    ),
}

START = """
import json, sys, time
names = sys.argv[1:]
snippets = json.loads(sys.stdin.read())
times = {}
for name in names:
    scope = {}
    exec(snippets[name], scope)
    t = time.monotonic()
    scope["spec"].build_and_load()
    times[name] = time.monotonic() - t
print(json.dumps(times))
"""


def start(python: str, names: list[str], env: dict) -> tuple[float, dict]:
    """One fresh process that builds/loads ``names`` in order; returns (wall seconds, per module)."""
    t = time.monotonic()
    proc = subprocess.run([python, "-c", START, *names], input=json.dumps(MODULES), capture_output=True,
                          text=True, env=env)
    wall = time.monotonic() - t
    if proc.returncode != 0:
        sys.exit(f"start failed:\n{proc.stderr[-3000:]}")
    return wall, json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable, help="interpreter of the serving environment")
    parser.add_argument("--arch-list", default="9.0a")
    parser.add_argument("--workspace", required=True, help="FLASHINFER_WORKSPACE_BASE for the run (emptied first)")
    parser.add_argument("--jobs", type=int, default=len(MODULES), help="parallel builds while populating")
    parser.add_argument("--modules", default=",".join(MODULES))
    args = parser.parse_args()
    names = args.modules.split(",")
    base = Path(args.workspace)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    env = dict(os.environ, FLASHINFER_WORKSPACE_BASE=str(base), FLASHINFER_CUDA_ARCH_LIST=args.arch_list)

    t = time.monotonic()
    with ThreadPoolExecutor(args.jobs) as pool:
        populate = dict(zip(names, pool.map(lambda n: start(args.python, [n], env)[1][n], names)))
    print(f"populated {len(names)} modules in {time.monotonic() - t:.0f} s wall ({args.jobs} parallel builds):")
    for name, seconds in populate.items():
        print(f"  {name:<26} {seconds:7.1f} s")

    from sm120patch import jitcache  # the code `sm120patch apply` runs

    version = subprocess.run([args.python, "-c", "import flashinfer; print(flashinfer.__version__)"],
                             capture_output=True, text=True, env=env).stdout.strip()
    removed = jitcache.invalidate(version, base)
    targeted_wall, targeted = start(args.python, names, env)

    shutil.rmtree(base / ".cache" / "flashinfer")  # the field practice
    full_wall, full = start(args.python, names, env)

    print(f"\nflashinfer {version}, FLASHINFER_CUDA_ARCH_LIST={args.arch_list}; next start = one process that builds/loads all {len(names)} modules")
    print("| module | (a) after sm120patch's invalidation (s) | (b) after rm -rf ~/.cache/flashinfer (s) |")
    print("| --- | --- | --- |")
    for name in names:
        print(f"| {name} | {targeted[name]:.1f} | {full[name]:.1f} |")
    print(f"| **whole start (wall)** | **{targeted_wall:.1f}** | **{full_wall:.1f}** |")
    print(f"\nremoved by (a): {', '.join(str(p.relative_to(base)) for p in removed)}")
    print(f"ratio (b)/(a): {full_wall / targeted_wall:.2f}; (b) costs {full_wall - targeted_wall:.0f} s more")
    return 0


if __name__ == "__main__":
    sys.exit(main())
