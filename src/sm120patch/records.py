"""Plain records the lower layers make and every layer above reads: what the JIT cache holds,
what a checkout's commit did, what a run recovered. Here, below their makers, so that the
reports import no writer (jitcache moves entries aside, checkout commits, transaction writes)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, NamedTuple, Sequence


# -- the JIT cache (jitcache.py) -------------------------------------------------------------------

class CacheBase(NamedTuple):
    """Where FlashInfer's JIT cache is, and why sm120patch thinks so."""

    path: Path
    reason: str  # --jit-cache-base / $FLASHINFER_WORKSPACE_BASE / $HOME / the owner's home

    @property
    def cache_dir(self) -> Path:
        return self.path / ".cache" / "flashinfer"


class JitStatus(NamedTuple):
    """The module's JIT cache entries of one release, in the cache base the server reads."""

    base: CacheBase
    entries: list[Path]
    stale: list[Path]
    foreign: Mapping[Path, Path]  # entry -> a source of another environment
    asides: list[Path]
    # Entries without the module's library: a build that did not finish (build.ninja, .d and
    # object files). FlashInfer's next start builds the rest; nothing loads one as it is.
    incomplete: Sequence[Path] = ()
    # Those of them whose FlashInfer lock (cached_ops/tmp/<module>.lock) someone holds: a build
    # running now (a server's first start, `sm120patch build`), not one that was abandoned.
    building: Sequence[Path] = ()


class AotShadow(NamedTuple):
    """A prebuilt module that FlashInfer loads instead of compiling the patched sources."""

    path: str
    source: str  # "flashinfer-jit-cache <version>" or "flashinfer/data/aot"


# -- a checkout's commit (checkout.py) -------------------------------------------------------------

class Commit(NamedTuple):
    branch: str
    sha: str
    files: tuple[str, ...]  # repository paths


class Undo(NamedTuple):
    message: str
    changed: bool


# -- a run an earlier one left (transaction.py) ----------------------------------------------------

@dataclass
class Recovery:
    """What a run found and did about a transaction an earlier run left behind."""

    operation: str
    restored: tuple[str, ...]
    finished: bool = False  # every change had been made: the run was completed, not rolled back
