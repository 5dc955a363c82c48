"""A stand-in for the CUDA driver and torch's view of the GPUs, answering as a PCIe SM120 box
does: N GPUs of compute capability 12.0, CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED = 0, no
fabric handles, every cuMulticast* call answering CUDA_ERROR_NOT_SUPPORTED, unicast cuMem*
calls succeeding (``multicast=True``: an NVSwitch box, which also answers the multicast
granularity; every other multicast call is still refused). Installed into the *real* driver
binding (``cuda.bindings.driver``) of the process that runs the server's own code, before that
code is imported, so SGLang's and FlashInfer's functions run unchanged and call it. Every call
is recorded.

``stop_at``: the name of a call at which the stand-in raises :class:`Reached` instead of
answering (after answering its first ``answer_first`` calls): the server's decision has been
made by then (every check passed, the unicast allocation begins), and past it real memory
would be needed.

Used by tests/test_fusion_paths.py in a subprocess (``python standin_driver.py -c CODE``), and
with ``real=True`` by benchmarks/unicast_workspace_gpu.py on a real GPU: there only the multicast
answers are replaced (the attribute reads 0, every cuMulticast* is refused without reaching
the driver: never send one to a shared host) and everything else is the real driver."""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import types

CALLS: list[str] = []
MIB = 1 << 20


class Reached(BaseException):
    """The code under test got as far as ``stop_at`` (not an Exception: the server's own
    ``except Exception`` fall-backs must not swallow it)."""


def cudart_paths() -> list[str]:
    """The toolkit's libcudart (under $CUDA_HOME, else /usr/local/cuda): FlashInfer's comm package
    looks for it among the process's loaded libraries, and a CPU torch loads none."""
    roots = [root for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda") if root]
    return [path for root in roots for path in sorted(glob.glob(os.path.join(root, "lib64", "libcudart.so*")))]


def _load_cudart() -> None:
    for path in cudart_paths():  # no GPU is needed to load it
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return
        except OSError:
            continue
    raise SystemExit("stand-in driver: no libcudart under $CUDA_HOME or /usr/local/cuda")


def install(*, devices: int = 2, multicast: bool = False, stop_at: str | None = None, answer_first: int = 0,
            real: bool = False) -> None:
    from cuda.bindings import driver

    ok = driver.CUresult.CUDA_SUCCESS
    not_supported = driver.CUresult.CUDA_ERROR_NOT_SUPPORTED
    attr = driver.CUdevice_attribute
    answers = {
        attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: 12,
        attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: 0,
        attr.CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED: int(multicast),
        attr.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED: 0,
        attr.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: 1,
    }

    def record(name, result):
        def call(*args, **kwargs):
            CALLS.append(name)
            if name == stop_at and CALLS.count(name) > answer_first:
                raise Reached(name)
            return result(*args, **kwargs) if callable(result) else result
        call.__name__ = name
        return call

    real_attribute = driver.cuDeviceGetAttribute

    def attribute(which, device):
        if real and which != attr.CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED:
            return real_attribute(which, device)
        return ok, answers.get(which, 0)

    def refuse_multicast(*args, **kwargs):
        return (not_supported, None)

    replaced = {"cuDeviceGetAttribute": attribute}
    for name in dir(driver):
        if name.startswith("cuMulticast"):
            replaced[name] = refuse_multicast
    if multicast and not real:  # an NVSwitch box: its granularity is a fact like any other
        replaced["cuMulticastGetGranularity"] = (ok, 2 * MIB)
    if real:
        for name, result in replaced.items():
            setattr(driver, name, record(name, result))
        return
    handle = iter(range(0x1000, 0x10000))
    replaced.update({
        "cuInit": (ok,),
        "cuDeviceGet": lambda ordinal: (ok, ordinal),
        "cuDeviceGetCount": (ok, devices),
        "cuCtxGetCurrent": (ok, 1),
        "cuCtxSetCurrent": (ok,),
        "cuDevicePrimaryCtxRetain": (ok, 1),
        "cuCtxGetDevice": (ok, 0),
        "cuMemGetAllocationGranularity": (ok, 2 * MIB),
        "cuMemCreate": lambda size, prop, flags: (ok, next(handle)),
        "cuMemRelease": (ok,),
    })
    for name, result in replaced.items():
        setattr(driver, name, record(name, result))

    from cuda.bindings import runtime

    runtime.cudaSetDevice = record("cudaSetDevice", (runtime.cudaError_t.cudaSuccess,))

    import torch

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: devices
    torch.cuda.current_device = lambda: 0
    torch.cuda.set_device = lambda device: None
    torch.cuda.get_device_capability = lambda device=None: (12, 0)
    _load_cudart()

def stop_at_runtime_allocations() -> None:
    """Past the driver, the two other ways FlashInfer allocates a workspace: CUDA IPC buffers
    through the runtime (its ``cuda_ipc.cudart.cudaMalloc``) and torch symmetric memory
    (``torch.distributed._symmetric_memory.empty``). Each raises :class:`Reached` when called (the
    decision is made by then), after FlashInfer is imported."""
    import torch.distributed._symmetric_memory as symm_mem
    from flashinfer.comm import cuda_ipc

    def stop(name):
        def call(*args, **kwargs):
            CALLS.append(name)
            raise Reached(name)
        return call

    cuda_ipc.cudart.cudaMalloc = stop("cudaMalloc")
    symm_mem.empty = stop("torch symmetric memory")


def load_plain_functions(path: str, name: str, log: list, names: dict | None = None) -> types.ModuleType:
    """A module ``name`` (in sys.modules) holding the functions and classes of the Python file at
    ``path``, as written (those without decorators, or only contextlib's), and its module-level
    literals (``_workspace = None``): a server's
    module whose imports pull in the whole server (SGLang's flashinfer_comm_fusion.py, vLLM's
    flashinfer_all_reduce.py), which the functions under test do not use. The few names they do
    use are given: the driver binding (with the stand-in in it), the real ``flashinfer.comm``
    where it imports, SGLang's ``envs`` with no SGLANG_* variable set, and then ``names`` (after
    the file's own literals, which they may replace); what they log (vLLM's ``*_once`` calls
    too) is appended to ``log``."""
    import ast
    import contextlib
    import inspect
    import logging
    import platform
    import random
    from typing import Optional

    import torch
    import torch.distributed as dist
    from cuda.bindings import driver

    class Handler(logging.Handler):
        def emit(self, record):
            log.append(record.getMessage())

    class Logger(logging.Logger):
        def warning_once(self, *args, **kwargs):
            self.warning(*args, **kwargs)

        def info_once(self, *args, **kwargs):
            self.info(*args, **kwargs)

        def debug_once(self, *args, **kwargs):
            self.debug(*args, **kwargs)

    class Unset:
        def __getattr__(self, variable):
            return type("Var", (), {"get": lambda self: None})()

    logger = Logger(name, level=logging.INFO)
    logger.addHandler(Handler())
    tree = ast.parse(open(path).read())
    literal = (ast.Constant, ast.Dict, ast.List)
    plain_decorators = {"contextlib.contextmanager", "contextmanager"}
    body = ast.Module([n for n in tree.body
                       if (isinstance(n, (ast.FunctionDef, ast.ClassDef))
                           and all(ast.unparse(d) in plain_decorators for d in n.decorator_list))
                       or (isinstance(n, (ast.Assign, ast.AnnAssign)) and isinstance(n.value, literal)
                           and not getattr(n.value, "keys", getattr(n.value, "elts", None)))], [])
    module = types.ModuleType(name)
    module.__dict__.update(envs=Unset(), torch=torch, dist=dist, logger=logger, Optional=Optional,
                           contextlib=contextlib, inspect=inspect, platform=platform, os=os, random=random,
                           get_cuda_driver_bindings=lambda: driver, ceil_align=lambda x, y: (x + y - 1) // y * y)
    try:
        import flashinfer.comm as flashinfer_comm
        from flashinfer.comm.mnnvl import TorchDistBackend
    except ImportError:
        pass
    else:
        module.__dict__.update(flashinfer_comm=flashinfer_comm, TorchDistBackend=TorchDistBackend)
    exec(compile(body, path, "exec"), module.__dict__)
    module.__dict__.update(names or {})
    sys.modules[name] = module
    return module

if __name__ == "__main__":  # python standin_driver.py -c CODE [ARGS...]: run CODE, which installs the stand-in
    code = sys.argv[2]
    sys.argv = ["-c", *sys.argv[3:]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    exec(compile(code, "<stand-in script>", "exec"), {"__name__": "__main__"})
