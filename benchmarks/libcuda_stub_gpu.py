"""On a GPU machine: the trtllm_comm entry that `apply --build` linked against sm120patch's own
libcuda stub (a GPU-less image build) is what a server loads and runs, and equals a module
linked against the real driver where it matters.

Runs in the serving environment's interpreter, with sm120patch importable, after
`CUDA_HOME=<toolkit without stubs> CUDA_VISIBLE_DEVICES= sm120patch apply --build --arch 9.0a`
(benchmarks/h200_session.sh stub):

    FLASHINFER_WORKSPACE_BASE=/tmp/ws CUDA_HOME=/tmp/cudaview python benchmarks/libcuda_stub_gpu.py --real /usr/lib/x86_64-linux-gnu/libcuda.so.1

1. First use, as a server starts: FlashInfer's `gen_trtllm_comm_module().build_and_load()` (did it
   compile or link anything: the library's mtime), then one kernel of the module on the GPU
   (`trtllm_lamport_initialize` fills a buffer with -0.0).
2. The same objects linked twice more, with FlashInfer's link command (`c++ objs -shared -L.. -lcudart
   -lcuda`): against the real driver library and against a fresh stub. The three modules (the
   entry's, the real one's, the stub one's) compared: NEEDED and SONAME (readelf -d), undefined
   dynamic symbols (nm -D -u), and the bytes of .text (objcopy).

Prints one JSON document.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path


def dynamic(library: Path) -> dict:
    text = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    return {"needed": re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", text),
            "soname": re.findall(r"\(SONAME\)\s+Library soname: \[(.+?)\]", text)}


def undefined(library: Path) -> list[str]:
    text = subprocess.run(["nm", "-D", "--undefined-only", "--format=just-symbols", str(library)],
                          capture_output=True, text=True, check=True).stdout
    return sorted(set(text.split()))


def text_sha(library: Path, scratch: Path) -> str:
    out = scratch / (library.name + ".text")
    subprocess.run(["objcopy", "-O", "binary", "--only-section=.text", str(library), str(out)], check=True)
    return hashlib.sha256(out.read_bytes()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--real", required=True, help="the real driver library (libcuda.so.1)")
    args = parser.parse_args()

    import torch

    import flashinfer.jit.comm as comm
    from sm120patch.jitbuild import build_stub, cuda_home, driver_symbols

    spec = comm.gen_trtllm_comm_module()
    library = Path(spec.jit_library_path)
    before = library.stat().st_mtime_ns
    start = time.perf_counter()
    spec.build_and_load()
    from flashinfer.comm.trtllm_ar import trtllm_lamport_initialize

    buffer = torch.zeros(4096, dtype=torch.bfloat16, device="cuda")
    trtllm_lamport_initialize(buffer.data_ptr(), buffer.numel(), torch.bfloat16)
    torch.cuda.synchronize()
    first_use = {"seconds": round(time.perf_counter() - start, 2), "compiled_or_linked": library.stat().st_mtime_ns != before,
                 "kernel_ran": bool(torch.signbit(buffer.float()).all().item()), "library": str(library),
                 "device": torch.cuda.get_device_name()}

    objects = sorted(Path(spec.build_dir).rglob("*.o"))
    home = cuda_home()
    cxx = os.environ.get("CXX", "c++")
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        stubs = scratch / "stubs"
        stubs.mkdir()
        build_stub(driver_symbols(objects), stubs)
        linked = {}
        for name, libcuda in (("real driver", [args.real]), ("stub", [f"-L{stubs}", "-lcuda"])):
            out = scratch / f"{name.replace(' ', '_')}.so"
            subprocess.run([cxx, *map(str, objects), "-shared", f"-L{home}/lib64", "-lcudart", *libcuda, "-o", str(out)],
                           check=True)
            linked[name] = out
        linked["entry (apply --build, GPU-less)"] = library
        modules = {name: {**dynamic(path), "undefined": undefined(path), "text_sha256": text_sha(path, scratch)}
                   for name, path in linked.items()}
    reference = modules["real driver"]
    same = {name: {key: module[key] == reference[key] for key in ("needed", "soname", "undefined", "text_sha256")}
            for name, module in modules.items() if name != "real driver"}
    print(json.dumps({"first_use": first_use, "objects": len(objects),
                      "driver_functions_called": len(driver_symbols(objects)),
                      "modules": {n: {k: v for k, v in m.items() if k != "undefined"} | {"undefined": len(m["undefined"])}
                                  for n, m in modules.items()},
                      "same_as_real_driver_link": same}, indent=2))


if __name__ == "__main__":
    main()
