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

def map_devices_to_zero() -> None:
    """Every rank a process on GPU 0 (tests/one_gpu.py): FlashInfer's unified workspace takes its
    device index from the rank (``SymmDeviceMemory(..., device_idx=rank)``), so in rank 3's
    process it would ask for a GPU 3 that one lent GPU does not have. After ``install(real=True)``
    (multicast absent, every cuMulticast* refused before the driver), each call FlashInfer and
    the servers make with a device index is sent to the real function with index 0: the driver's
    cuDeviceGet and cuDeviceGetAttribute, the runtime's cudaSetDevice, NVML's handle by index,
    and the ``location.id`` of the allocation properties and access descriptors of cuMemCreate,
    cuMemGetAllocationGranularity and cuMemSetAccess. Test-only: nothing of it is in sm120patch.
    Each mapped call is recorded in CALLS with the index it was given (``cuDeviceGet(3->0)``)."""
    from cuda.bindings import driver, runtime

    def mapped(module, name, fix):
        real = getattr(module, name)

        def call(*args, **kwargs):
            args, given = fix(*args)
            CALLS.append(f"{name}({given}->0)")
            return real(*args, **kwargs)
        call.__name__ = name
        setattr(module, name, call)

    def location_of(prop):
        given = int(prop.location.id)
        prop.location.id = 0
        return given

    def access(ptr, size, descs, count):
        given = [location_of(d) for d in (descs if isinstance(descs, (list, tuple)) else [descs])]
        return (ptr, size, descs, count), ",".join(map(str, given))

    mapped(driver, "cuDeviceGet", lambda ordinal: ((0,), int(ordinal)))
    mapped(driver, "cuDeviceGetAttribute", lambda which, device: ((which, 0), int(device)))
    mapped(driver, "cuMemCreate", lambda size, prop, flags: ((size, prop, flags), location_of(prop)))
    mapped(driver, "cuMemGetAllocationGranularity", lambda prop, option: ((prop, option), location_of(prop)))
    mapped(driver, "cuMemSetAccess", access)
    mapped(runtime, "cudaSetDevice", lambda device: ((0,), int(device)))
    try:
        import pynvml
    except ImportError:  # FlashInfer imports it (nvidia-ml-py); a process without it asks NVML nothing
        return
    mapped(pynvml, "nvmlDeviceGetHandleByIndex", lambda index: ((0,), int(index)))


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


def load_plain_functions(path: str, name: str, log: list, names: dict | None = None, *,
                         whole: bool = False) -> types.ModuleType:
    """A module ``name`` (in sys.modules) holding the functions and classes of the Python file at
    ``path``, as written (those without decorators, or only contextlib's), and its module-level
    literals (``_workspace = None``): a server's
    module whose imports pull in the whole server (SGLang's flashinfer_comm_fusion.py, vLLM's
    flashinfer_all_reduce.py), which the functions under test do not use. The few names they do
    use are given: the driver binding (with the stand-in in it), the real ``flashinfer.comm``
    where it imports, SGLang's ``envs`` with no SGLANG_* variable set, and then ``names`` (after
    the file's own literals, which they may replace); what they log (vLLM's ``*_once`` calls
    too) is appended to ``log``.

    ``whole``: also what a fused call through the module needs, as the file has it: functions
    under ``register_custom_op`` (the decorator only registers a torch op; the function is
    kept as written), the ``if is_flashinfer_available():`` block that binds FlashInfer's comm
    package at import (run as written, with ``names`` given before it runs), and module-level
    instances of the file's own classes (``_workspace_manager = FlashInferWorkspaceManager()``).
    tests/one_gpu.py uses it to run SGLang's fused layer on a GPU."""
    import ast
    import contextlib
    import inspect
    import logging
    import platform
    import random
    from typing import Any, Dict, List, Optional, Tuple, Union

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
    if whole:
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                node.decorator_list = [d for d in node.decorator_list
                                       if not ast.unparse(d).startswith("register_custom_op(")]
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}

    def kept(n) -> bool:
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            return all(ast.unparse(d) in plain_decorators for d in n.decorator_list)
        if isinstance(n, (ast.Assign, ast.AnnAssign)) and isinstance(n.value, literal):
            return not getattr(n.value, "keys", getattr(n.value, "elts", None))
        if whole and isinstance(n, ast.If):
            return ast.unparse(n.test) == "is_flashinfer_available()"
        if whole and isinstance(n, ast.Assign) and isinstance(n.value, ast.Call):
            return isinstance(n.value.func, ast.Name) and n.value.func.id in classes
        return False

    body = ast.Module([n for n in tree.body if kept(n)], [])
    module = types.ModuleType(name)
    # The typing names and ProcessGroup: signatures written with them are evaluated when the
    # file's classes and functions are defined (Python < 3.14).
    module.__dict__.update(envs=Unset(), torch=torch, dist=dist, logger=logger, Optional=Optional, Tuple=Tuple,
                           List=List, Dict=Dict, Any=Any, Union=Union, ProcessGroup=dist.ProcessGroup,
                           contextlib=contextlib, inspect=inspect, platform=platform, os=os, random=random,
                           get_cuda_driver_bindings=lambda: driver, ceil_align=lambda x, y: (x + y - 1) // y * y)
    try:
        import flashinfer.comm as flashinfer_comm
        from flashinfer.comm.mnnvl import TorchDistBackend
    except ImportError:
        pass
    else:
        module.__dict__.update(flashinfer_comm=flashinfer_comm, TorchDistBackend=TorchDistBackend)
    if whole:  # the import-time block and the class instances run now and need them
        module.__dict__.update(names or {})
    exec(compile(body, path, "exec"), module.__dict__)
    module.__dict__.update(names or {})
    sys.modules[name] = module
    return module

# The module-level names SGLang's fusion predicates read (communicator.py to 0.5.20,
# layer_boundary/residual/add_norm.py from 0.5.21), besides the predicate itself.
PREDICATE_FLAGS = ("_is_cuda", "_is_flashinfer_available", "_is_sm90_supported", "_is_sm100_supported",
                   "_is_sm120_supported", "FUSE_ALLREDUCE_MAX_BATCH_SIZE")


def sglang_predicate_names(torch) -> dict:
    """What an SGLang fusion predicate asks of the rest of the server, answered as a single-node
    server with fusion on (--enable-flashinfer-allreduce-fusion, backend trtllm, no DP attention)
    answers on an SM120 GPU."""
    ns = types.SimpleNamespace
    return dict(
        torch=torch, is_cuda=lambda: True, is_flashinfer_available=lambda: True,
        is_sm90_supported=lambda device=None: False, is_sm100_supported=lambda device=None: False,
        is_sm120_supported=lambda device=None: True,
        get_platform=lambda: ns(is_sm90=False, is_sm100=False, is_sm120=True),
        is_dp_attention_enabled=lambda: False, is_flashinfer_allreduce_unavailable=lambda: False,
        uses_cutedsl_ar_fusion=lambda: False,
        get_global_server_args=lambda: ns(enable_flashinfer_allreduce_fusion=True,
                                          flashinfer_allreduce_fusion_backend="trtllm"),
        get_exec=lambda: ns(comm=ns(flashinfer_allreduce_fusion_backend="trtllm")))


def load_predicate(path: str, predicate: str, names: dict, name: str = "sglang_predicate") -> types.ModuleType:
    """A module ``name`` holding, from the server file at ``path`` as written, the fusion
    predicate ``predicate``, the module-level flags it reads (PREDICATE_FLAGS) and every name
    sm120patch's patches inserted (``_sm120patch*``), run with ``names`` given first."""
    import ast

    def bound(node) -> list:
        if isinstance(node, ast.FunctionDef):
            return [node.name]
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        return [t.id for t in targets if isinstance(t, ast.Name)]

    def wanted(node) -> bool:
        return any(n == predicate or n in PREDICATE_FLAGS or n.lower().startswith("_sm120patch") for n in bound(node))

    tree = ast.parse(open(path).read())
    module = types.ModuleType(name)
    module.__dict__.update(names)
    exec(compile(ast.Module([n for n in tree.body if wanted(n)], []), path, "exec"), module.__dict__)
    return module

if __name__ == "__main__":  # python standin_driver.py -c CODE [ARGS...]: run CODE, which installs the stand-in
    code = sys.argv[2]
    sys.argv = ["-c", *sys.argv[3:]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        exec(compile(code, "<stand-in script>", "exec"), {"__name__": "__main__"})
    finally:
        # The script's process group goes here, not to interpreter teardown, where gloo's threads
        # can abort the process (SIGABRT, "terminate called without an active exception"; pytorch#190489).
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
