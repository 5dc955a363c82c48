"""What the target interpreter has: its torch, its GPUs, the kernels' distribution."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from sm120patch import runas
from sm120patch.distributions import load_registry
from sm120patch.errors import TargetError

_PROBE = r"""
import json, sys
out = {"torch": None, "flashinfer": None, "numpy": False}
try:
    from importlib import metadata
    out["flashinfer"] = metadata.version(sys.argv[1])
except Exception:
    pass
try:
    import numpy  # noqa: F401
    out["numpy"] = True
except Exception:
    pass
try:
    import torch
except Exception as exc:
    out["torch_error"] = "%s: %s" % (type(exc).__name__, exc)
else:
    out["torch"] = torch.__version__
    out["torch_cuda"] = torch.version.cuda
    out["cuda"] = bool(torch.cuda.is_available())
    out["nccl"] = bool(torch.distributed.is_available() and torch.distributed.is_nccl_available())
    out["devices"] = []
    if out["cuda"]:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out["devices"].append({"name": p.name, "capability": [p.major, p.minor]})
print(json.dumps(out))
"""



@dataclass(frozen=True)
class TargetInfo:
    """What the target interpreter said about its torch, GPUs and FlashInfer."""

    torch: str | None
    flashinfer: str | None
    cuda: bool
    nccl: bool
    devices: tuple[tuple[str, int, int], ...]  # (name, major, minor)
    torch_error: str | None = None
    numpy: bool = True



def probe_target(python: Path, kernels: str) -> TargetInfo:
    """``kernels``: the distribution whose fused allreduce bench runs, as the patch data names it."""
    try:
        user = runas.environment_owner(python)  # as root on another user's environment: as that user
        proc = subprocess.run([str(python), "-c", _PROBE, kernels], capture_output=True, text=True, cwd="/", timeout=120,
                              env=user.environ(), **user.popen_args())
    except subprocess.TimeoutExpired:
        raise TargetError(f"--python {python}: importing torch took over 120 s") from None
    try:
        data = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise TargetError(f"--python {python}: the GPU probe failed ({tail})") from None
    return TargetInfo(
        torch=data["torch"], flashinfer=data["flashinfer"], cuda=bool(data.get("cuda")),
        nccl=bool(data.get("nccl")),
        devices=tuple((d["name"], d["capability"][0], d["capability"][1]) for d in data.get("devices", ())),
        torch_error=data.get("torch_error"), numpy=bool(data.get("numpy")),
    )



def kernels_distribution() -> str:
    """The distribution whose JIT module bench runs (FlashInfer's), as the patch data names it."""
    return next(d.name for d in load_registry(full=False) if d.jit_module)
