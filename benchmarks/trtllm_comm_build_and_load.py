"""Let FlashInfer JIT-build and *load* trtllm_comm, then show what the library holds.

Run with the serving environment's interpreter on a machine with a CUDA driver, after
`sm120patch apply` (or before, to see the pristine failure):

    FLASHINFER_CUDA_ARCH_LIST="9.0a 12.0a" FLASHINFER_WORKSPACE_BASE=/tmp/ws \
        python benchmarks/trtllm_comm_build_and_load.py

Prints the build time, the functions the loaded module exports, and `cuobjdump --list-elf`
of the library (one cubin per source and architecture).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

# The functions trtllm_comm's three sources export (TVM_FFI_DLL_EXPORT_TYPED_FUNC in 0.6.4).
EXPORTS = (
    "trtllm_lamport_initialize",
    "trtllm_lamport_initialize_all",
    "trtllm_custom_all_reduce",
    "trtllm_allreduce_fusion",
    "trtllm_moe_allreduce_fusion",
    "trtllm_moe_finalize_allreduce_fusion",
)


def main() -> int:
    import flashinfer.jit.comm as comm

    print(f"FLASHINFER_CUDA_ARCH_LIST={os.environ.get('FLASHINFER_CUDA_ARCH_LIST', '(unset)')}")
    try:
        spec = comm.gen_trtllm_comm_module()
    except RuntimeError as exc:
        print(f"gen_trtllm_comm_module() raised RuntimeError: {exc}")
        return 1
    print("nvcc targets:", " ".join(f for f in spec.extra_cuda_cflags if f.startswith("-gencode")))
    start = time.monotonic()
    module = spec.build_and_load()
    print(f"built and loaded {spec.jit_library_path} in {time.monotonic() - start:.1f} s")
    missing = [name for name in EXPORTS if not callable(getattr(module, name, None))]
    print(f"exported functions: {len(EXPORTS) - len(missing)} of {len(EXPORTS)} callable"
          + (f"; missing: {', '.join(missing)}" if missing else f" ({', '.join(EXPORTS)})"))
    cuobjdump = shutil.which("cuobjdump")
    if cuobjdump:
        listing = subprocess.run([cuobjdump, "--list-elf", str(spec.jit_library_path)], capture_output=True, text=True)
        print("cuobjdump --list-elf:")
        print(listing.stdout.strip() or listing.stderr.strip())
    else:
        print("cuobjdump not on PATH: no ELF listing")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
