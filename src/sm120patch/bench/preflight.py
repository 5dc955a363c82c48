"""What bench is asked (its options, parsed) and every reason it cannot run, before any GPU work."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from sm120patch.bench.target import TargetInfo, kernels_distribution
from sm120patch.errors import RefusedError, TargetError, UsageError
from sm120patch.chain import Chain, StepResult
from sm120patch.invocation import command

# trtllm_allreduce_fusion refuses any other world size ("Supported ranks: 2, 4, 8, 16").
SUPPORTED_WORLD_SIZES = (2, 4, 8, 16)
STRATEGIES = ("auto", "oneshot", "twoshot", "both")
# For tests only (the lent single-GPU machine): --tune with every rank a process on GPU 0, over gloo
# (NCCL refuses two ranks on one device) and without CUDA graphs. The ranks take turns on the GPU, so
# their timings mean nothing: the tuner then refuses to write a profile (profile.refuse_shared_gpus)
# unless SM120PATCH_TUNE_ALLOW_SHARED_GPU=1 forces it too.
ONE_GPU = "SM120PATCH_TUNE_ONE_GPU"


@dataclass(frozen=True)
class BenchRequest:
    python: Path | None  # None: the interpreter running sm120patch
    tokens: tuple[int, ...]  # the defaults are the CLI's (`sm120patch bench --help`)
    hidden: tuple[int, ...]
    tp: int | None = None  # None: every visible GPU
    dtype: str = "bf16"
    strategy: str = "auto"
    check_only: bool = False
    jit_base: Path | None = None
    seed: int = 0
    reps: int = 25
    inner: int = 10
    warmup: int = 5
    tune: bool = False  # --tune: measure the limits and write the profile (one hidden size)
    repeats: int = 7  # --tune: independent repetitions per path and size (median, interquartile range)
    given_python: bool = False  # --python was given (python is then what the user named, resolved)
    kernels: str = field(default_factory=kernels_distribution)  # the distribution whose fused allreduce runs



def parse_int_list(text: str, *, option: str, minimum: int, maximum: int, multiple_of: int = 1) -> tuple[int, ...]:
    """``"1,2,16"`` -> (1, 2, 16); one clear error for anything else."""
    values = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit():
            raise UsageError(f"{option} {text}: {part!r} is not a whole number",
                             hint=f"give a comma-separated list, e.g. {option} 1,16,128")
        value = int(part)
        if not minimum <= value <= maximum or value % multiple_of:
            rule = f"between {minimum} and {maximum}" + (f" and a multiple of {multiple_of}" if multiple_of > 1 else "")
            raise UsageError(f"{option} {text}: {value} must be {rule}")
        values.append(value)
    if not values:
        raise UsageError(f"{option}: give at least one value, e.g. {option} 1,16,128")
    return tuple(sorted(set(values)))


def ranks_on_one_gpu(request: BenchRequest) -> bool:
    """Whether this run puts every rank on GPU 0 (the test-only ONE_GPU switch, --tune only)."""
    return request.tune and os.environ.get(ONE_GPU) == "1"


def preflight(request: BenchRequest, target: TargetInfo, *, flashinfer_verdict: str | None,
              aot_shadows: Sequence[str] = (), servers: Sequence[Chain] = ()) -> int:
    """Every reason the run cannot start, as one clear error; returns the world size.
    ``servers``: each installed server's fusion chain, judged for these GPUs."""
    python = request.python
    # With --python given, the environment is the one the user meant: say what it lacks, not
    # to pass the option they passed.
    elsewhere = None if request.given_python else "pass --python with the interpreter your server runs"
    # Every missing piece in one message: a user installing them one run at a time is four runs.
    missing = []
    if target.torch is None:
        missing.append(f"torch is not importable ({target.torch_error}): bench runs in the server's own environment, "
                       "with its torch and FlashInfer")
    if target.flashinfer is None:
        missing.append(f"{request.kernels} is not installed")
    if not target.numpy:
        missing.append("numpy is not importable (FlashInfer needs it)")
    if target.torch is not None and not target.cuda:
        missing.append(f"no CUDA device is visible to torch {target.torch}"
                       + ("" if "+cpu" not in target.torch else " (a CPU-only build)"))
    if target.torch is not None and target.cuda and not target.nccl:
        missing.append(f"torch {target.torch} has no NCCL backend; bench compares against NCCL")
    if missing:
        cuda_only = target.torch is not None and target.flashinfer is not None and target.numpy
        raise TargetError(f"{python}: " + "; ".join(missing),
                          hint="run bench on the GPU server, with the CUDA build of torch the server uses"
                          if cuda_only and not target.cuda else elsewhere)
    visible = len(target.devices)
    one_gpu = ranks_on_one_gpu(request) and visible >= 1
    if visible < 2 and not one_gpu:
        raise UsageError(f"bench needs at least 2 GPUs; {python} sees {visible} ({target.devices[0][0]})"
                         if visible else f"bench needs at least 2 GPUs; {python} sees none",
                         hint="the fused allreduce runs across 2, 4, 8 or 16 GPUs (check CUDA_VISIBLE_DEVICES)")
    tp = request.tp if request.tp is not None else visible
    if tp not in SUPPORTED_WORLD_SIZES:
        sizes = ", ".join(map(str, SUPPORTED_WORLD_SIZES[:-1])) + f" or {SUPPORTED_WORLD_SIZES[-1]}"
        raise UsageError(
            f"--tp {tp}: FlashInfer's fused allreduce runs at {sizes} ranks" + ("" if request.tp else f" ({visible} GPUs are visible)"),
            hint=f"pass --tp {max(s for s in SUPPORTED_WORLD_SIZES if s <= visible)}" if visible >= 2 else None,
        )
    if tp > visible and not one_gpu:
        raise UsageError(f"--tp {tp}: {python} sees only {visible} GPUs")
    used = target.devices[:tp]
    if any(major == 12 for _, major, _ in used):
        if aot_shadows:
            raise RefusedError(f"a prebuilt trtllm_comm without SM120 code shadows the patched sources ({aot_shadows[0]})",
                               hint="uninstall flashinfer-jit-cache (or remove that file), then run bench again")
        if flashinfer_verdict not in ("patched", "fixed upstream"):
            state = flashinfer_verdict or "unknown"
            raise RefusedError(
                f"{request.kernels} {target.flashinfer} is {state}: on SM120 its fused allreduce does not build, "
                "or runs an empty kernel",
                hint=f"run `{command('apply', ('--python', str(python)))}` first",
            )
    # The workers make each server's workspace as it does: where the chain says that falls back on
    # these GPUs, the workers would see the fall-back too; say why before any GPU work.
    for server in servers:
        step = server.step("workspace")
        if step.result is StepResult.BLOCKS:
            raise RefusedError(f"{server.server} would not fuse on these GPUs: {step.text}",
                               hint=f"run `{step.fix}` first" if step.fix else None)
    return tp
