"""FlashInfer's JIT cache and AOT modules, as far as ``trtllm_comm`` is concerned.

JIT modules live in ``<base>/.cache/flashinfer/<version>/<archs>/cached_ops/<module>/`` with
``<base>`` = ``$FLASHINFER_WORKSPACE_BASE`` or ``$HOME`` (of the user the server runs as).
Up to 0.6.11 FlashInfer writes ``build.ninja`` only when it is missing, so a patched gate
(a new nvcc flag list) is not picked up by an existing entry: after apply and revert the
``trtllm_comm`` entry of *every* arch directory of that version is removed, and nothing else
(the rest is minutes of compilation the user keeps).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from sm120patch.environment import FLASHINFER_JIT_CACHE, TargetEnvironment

MODULE = "trtllm_comm"


def cache_base(override: str | os.PathLike | None = None) -> Path:
    if override:
        return Path(override).expanduser()
    return Path(os.environ.get("FLASHINFER_WORKSPACE_BASE") or Path.home())


def entries(version: str, base: Path) -> list[Path]:
    """Every ``cached_ops/trtllm_comm`` directory of FlashInfer ``version`` under ``base``."""
    version_dir = base / ".cache" / "flashinfer" / version
    if not version_dir.is_dir():
        return []
    return sorted(
        arch_dir / "cached_ops" / MODULE
        for arch_dir in version_dir.iterdir()
        if (arch_dir / "cached_ops" / MODULE).is_dir() and not (arch_dir / "cached_ops" / MODULE).is_symlink()
    )


def is_stale(entry: Path, sources: list[Path]) -> bool:
    """An entry is stale when some file in it predates the newest of FlashInfer's patched
    sources (sm120patch removes entries when it changes sources, so this finds entries built
    under another cache base, or restored from a backup)."""
    newest = max((s.stat().st_mtime for s in sources if s.exists()), default=0.0)
    mtimes = [p.stat().st_mtime for p in entry.rglob("*") if p.is_file()]
    return bool(mtimes) and min(mtimes) < newest


def invalidate(version: str, base: Path, *, only: Callable[[Path], bool] | None = None) -> list[Path]:
    removed = []
    for entry in entries(version, base):
        if only is None or only(entry):
            shutil.rmtree(entry)
            removed.append(entry)
    return removed


@dataclass(frozen=True)
class AotShadow:
    """A prebuilt trtllm_comm that FlashInfer loads instead of compiling the patched sources."""

    path: str
    source: str  # "flashinfer-jit-cache" or "flashinfer/data/aot"


def aot_shadows(env: TargetEnvironment) -> list[AotShadow]:
    found = []
    jit_cache = env.get(FLASHINFER_JIT_CACHE)
    if jit_cache is not None:
        for relpath in jit_cache.record:
            if relpath.endswith(f"/{MODULE}/{MODULE}.so"):
                found.append(AotShadow(str(jit_cache.location / relpath), f"{FLASHINFER_JIT_CACHE} {jit_cache.raw_version}"))
    flashinfer = env.get("flashinfer-python")
    if flashinfer is not None:
        aot = flashinfer.location / "flashinfer" / "data" / "aot" / MODULE / f"{MODULE}.so"
        if aot.exists():
            found.append(AotShadow(str(aot), "flashinfer/data/aot"))
    return found
