"""`sm120patch bench`: the self-test a user runs on their own GPUs before turning fusion on.

It runs in the *target* interpreter (the server's torch and FlashInfer), one process per GPU
(``_bench_worker.py``, run there by path). First it checks, for every shape, FlashInfer's fused
allreduce + residual add + RMSNorm (called exactly as SGLang calls it) against an NCCL allreduce
followed by a float32 reference RMSNorm; then it times the fused call against the unfused pair
(NCCL allreduce + FlashInfer's fused_add_rmsnorm) and turns the timings into a recommendation
for SGLang's flag and vLLM's size threshold.

Nothing here writes to the environment; FlashInfer builds ``trtllm_comm`` (and ``norm``) in
its JIT cache on first use, exactly as the server's first start would.

- ``target``: what the target interpreter has; ``preflight``: the options and every reason the
  run cannot start; ``runner``: the workers; ``report``: the measurements and the recommendation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from dataclasses import replace

from sm120patch import driver, pipeline
from sm120patch.bench.preflight import SUPPORTED_WORLD_SIZES, BenchRequest, parse_int_list, preflight
from sm120patch.bench.report import BenchReport, Case, Recommendation, Series, failure
from sm120patch.bench.runner import WORKER, _classify, follow, run
from sm120patch.bench.target import TargetInfo, probe_target
from sm120patch.distributions import load_registry
from sm120patch.errors import UsageError
from sm120patch.words import spec_words

__all__ = ["SUPPORTED_WORLD_SIZES", "WORKER", "BenchReport", "BenchRequest", "Case", "Recommendation", "Series",
           "TargetInfo", "_classify", "_sglang_flag", "bench", "failure", "follow", "parse_int_list", "preflight",
           "probe_target", "run"]


def bench(request: BenchRequest, *, on_event: Callable[[dict], None] | None = None) -> BenchReport:
    """The whole command: ask the target what it has, refuse what cannot run, run the workers."""
    registry = load_registry(full=False)
    # Every installed distribution: the one whose kernels bench runs, and the servers whose
    # workspace path it follows.
    # The driver is read first, so that each server's fusion chain is judged for these GPUs.
    device = driver.query()
    status = pipeline.status(pipeline.Request(python=str(request.python) if request.python else None,
                                              jit_base=str(request.jit_base) if request.jit_base else None), registry,
                             device=device)
    kernels = next((d.name for d in registry if d.jit_module), None)
    tree = next((t for t in status.trees if t.distribution.name == kernels), None)
    if tree is None:
        raise UsageError(f"{kernels} is not installed in {status.target}")
    target = probe_target(Path(status.target), kernels)
    request = replace(request, python=Path(status.target), given_python=request.python is not None, kernels=kernels)
    chains = [t.chain for t in status.trees if t.chain is not None]
    world_size = preflight(request, target, flashinfer_verdict=tree.assessment.verdict.value,
                           aot_shadows=[s.path for s in status.aot], servers=chains)
    paths = [c.fusion for c in chains if c.fusion is not None and c.fusion.path is not None]
    report = run(request, world_size=world_size, on_event=on_event, servers=paths)
    report.sglang_flag = _sglang_flag(registry, status)
    report.advice = [(t.assessment.name, level, text) for t in status.trees for level, text in t.advice_lines(bench=True)]
    return report


def _sglang_flag(registry, status) -> str:
    """The installed SGLang's own fusion option; without SGLang, each release range's."""
    sglang = registry.get("sglang")
    installed = next((t for t in status.trees if t.distribution.name == sglang.name), None)
    flag = installed and sglang.fusion_flag(installed.tree.version)
    if flag:
        return flag
    return "fusion (SGLang " + "; ".join(f"{spec_words(f.versions)}: {f.flag}" for f in sglang.fusion_flags) + ")"
