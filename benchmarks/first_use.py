"""The first use of trtllm_comm in a fresh, server-like process: what a server start pays.

Runs in the serving environment's interpreter. Times `gen_trtllm_comm_module().build_and_load()`
(what FlashInfer's comm API does on first use) and says whether anything was compiled (the
library's mtime before and after):

    FLASHINFER_WORKSPACE_BASE=/tmp/ws python benchmarks/first_use.py [--label after-apply]

Prints one JSON line: label, seconds, compiled (bool), library path.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    start = time.perf_counter()
    import flashinfer.jit.comm as comm

    spec = comm.gen_trtllm_comm_module()
    library = spec.jit_library_path
    before = library.stat().st_mtime_ns if library.exists() else None
    spec.build_and_load()
    seconds = time.perf_counter() - start
    compiled = before is None or library.stat().st_mtime_ns != before
    print(json.dumps({"label": args.label, "seconds": round(seconds, 1), "compiled": compiled,
                      "library": str(library)}))


if __name__ == "__main__":
    main()
