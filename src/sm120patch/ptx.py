"""Compile a lamport one-shot kernel from an installed FlashInfer's own headers to PTX.

No GPU is needed: the PTX shows whether the kernel body survives for an architecture. With
the pristine 0.6.4 header, ``sm_120a`` PTX has no ``griddepcontrol`` instruction (the body is
compiled out by ``__CUDA_ARCH__ < 1200``); patched, it has them; ``sm_90a``/``sm_100a`` PTX is
byte-identical before and after (no regression).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Sequence

from sm120patch.errors import Sm120PatchError

# One instantiation of the kernel whose whole body the gate removes on SM120.
KERNEL_TU = """\
#include "flashinfer/comm/trtllm_allreduce.cuh"
namespace rf = flashinfer::trtllm_allreduce::reduce_fusion;
template __global__ void rf::lamport_style_one_shot_all_reduce_norm_kernel<
    8, __nv_bfloat16, 2, false, true, true>(flashinfer::trtllm_allreduce::AllReduceParams<__nv_bfloat16>);
"""


def find_nvcc() -> Path | None:
    """nvcc exactly where FlashInfer's JIT looks: ``$CUDA_HOME`` (or ``$CUDA_PATH``) when set,
    else the nvcc on PATH, else /usr/local/cuda."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home:
        candidate = Path(cuda_home) / "bin" / "nvcc"
    else:
        on_path = shutil.which("nvcc")
        candidate = Path(on_path) if on_path else Path("/usr/local/cuda/bin/nvcc")
    return candidate if candidate.is_file() and os.access(candidate, os.X_OK) else None


def compile_ptx(includes: Sequence[Path], arch: str, *, nvcc: Path | None = None) -> str:
    """PTX of the kernel for ``arch`` (e.g. ``120a``), built with ``includes`` on the include
    path (FlashInfer's include, spdlog and cutlass headers, wherever the tree keeps them)."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise Sm120PatchError("nvcc not found ($CUDA_HOME/bin when set, else PATH, else /usr/local/cuda/bin)")
    with tempfile.TemporaryDirectory(prefix="sm120patch-ptx-") as tmp:
        source, output = Path(tmp) / "kernel.cu", Path(tmp) / "kernel.ptx"
        source.write_text(KERNEL_TU)
        proc = subprocess.run(
            [str(nvcc), "--ptx", "-std=c++17", f"-gencode=arch=compute_{arch},code=compute_{arch}",
             *(f"-I{include}" for include in includes), str(source), "-o", str(output)],
            capture_output=True, text=True,
        )
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
            raise Sm120PatchError(f"nvcc failed for {arch}:\n{tail}")
        return normalize(output.read_text())


_TU_HASH = re.compile(r"_INTERNAL_[0-9a-f]{8}_")


def normalize(ptx: str) -> str:
    """nvcc names internal symbols after a hash of the translation unit's (temporary) path;
    drop that hash so that two compiles of the same code compare equal."""
    return _TU_HASH.sub("_INTERNAL_", ptx)


def griddepcontrol_count(ptx: str) -> int:
    return ptx.count("griddepcontrol.")
