"""FlashInfer's JIT cache and AOT modules, as far as one JIT module (``trtllm_comm``) goes.

JIT modules live in ``<base>/.cache/flashinfer/<version>/<archs>/cached_ops/<module>/`` with
``<base>`` = ``$FLASHINFER_WORKSPACE_BASE`` or ``$HOME`` *of the user the server runs as*.
Up to 0.6.11 FlashInfer writes ``build.ninja`` only when it is missing, so a patched gate
(a new nvcc flag list) is not picked up by an existing entry: when the module's sources change,
its entry in *every* arch directory of that version goes, and nothing else (the rest of the
cache is minutes of compilation the user keeps).

FlashInfer guards each module's build and load with a file lock,
``cached_ops/tmp/<module>.lock`` (filelock: an flock). sm120patch takes the same lock before
it touches the entry, so it never pulls an entry from under a server that is building it.
"""

from __future__ import annotations

import os
import pwd
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

from sm120patch.environment import FLASHINFER_JIT_CACHE, Environment, InstalledDistribution
from sm120patch.records import AotShadow, CacheBase, JitStatus
from sm120patch.state import Owner
from sm120patch.fileops import ASIDE_TAG
from sm120patch.locks import flock, someone_holds


def status(version: str, module: str, base: CacheBase, site_dir: Path, sources: list[Path]) -> JitStatus:
    """The entries of ``module`` built for release ``version`` in ``base``, judged against the
    install at ``site_dir`` whose ``sources`` they were built from."""
    found = entries(version, base.path, module)
    foreign = {}
    for entry in found:
        other = foreign_entry(entry, site_dir)
        if other is not None:
            foreign[entry] = other
    # An entry built from another environment's files is that environment's: its age says
    # nothing against this environment's sources (installed or patched later, say), so it is
    # reported as foreign, never as stale here.
    stale = [e for e in found if e not in foreign and is_stale(e, sources)]
    incomplete = [e for e in found if not is_built(e, module)]
    return JitStatus(base, found, stale=stale, foreign=foreign, asides=asides(version, base.path, module),
                     incomplete=incomplete, building=[e for e in incomplete if someone_holds(lock_path(e, module))])


def lock_path(entry: Path, module: str) -> Path:
    """FlashInfer's build and load lock of ``module``'s entry."""
    return entry.parent / "tmp" / f"{module}.lock"


def cache_base(override: str | os.PathLike | None = None, *, owner: Owner | None = None) -> CacheBase:
    """The base the server's FlashInfer uses. Run as root on an environment another user owns
    (sudo, where ``$HOME`` is root's), that user's home is the likelier base: it is used, and
    the report says so."""
    if override:
        return CacheBase(Path(override).expanduser(), "--jit-cache-base")
    if os.environ.get("FLASHINFER_WORKSPACE_BASE"):
        return CacheBase(Path(os.environ["FLASHINFER_WORKSPACE_BASE"]), "$FLASHINFER_WORKSPACE_BASE")
    if owner is not None and os.geteuid() == 0 and owner.uid != 0:
        try:
            home = pwd.getpwuid(owner.uid).pw_dir
        except KeyError:
            home = None
        if home:
            return CacheBase(Path(home), f"the home of {owner.user}, who owns the environment (sm120patch runs as root)")
        # No passwd entry (a container's numeric uid): the server's home is not known here, and
        # root's own is surely not it. Said, so that a wrong base is never cleaned silently.
        return CacheBase(Path.home(), f"$HOME, root's: uid {owner.uid}, who owns the environment, has no home in "
                                      "the passwd database (pass --jit-cache-base with the server's base)")
    return CacheBase(Path.home(), "$HOME")


def entries(version: str, base: Path, module: str) -> list[Path]:
    """Every ``cached_ops/<module>`` directory of FlashInfer ``version`` under ``base``."""
    version_dir = base / ".cache" / "flashinfer" / version
    if not version_dir.is_dir():
        return []
    return sorted(arch / "cached_ops" / module for arch in version_dir.iterdir()
                  if (arch / "cached_ops" / module).is_dir() and not (arch / "cached_ops" / module).is_symlink())


def arch_dirs(version: str, base: Path) -> list[Path]:
    version_dir = base / ".cache" / "flashinfer" / version
    return sorted(p for p in version_dir.iterdir() if p.is_dir()) if version_dir.is_dir() else []


def asides(version: str, base: Path, module: str) -> list[Path]:
    """Entries sm120patch moved aside that no run is about to restore (a run killed after its
    commit point, before it deleted them)."""
    return sorted(p for arch in arch_dirs(version, base) for p in (arch / "cached_ops").glob(f".{module}{ASIDE_TAG}*"))


def is_built(entry: Path, module: str) -> bool:
    """Whether the entry has its library (``<module>.so``): without it, it is what a build that
    did not finish leaves, which FlashInfer completes at its next start."""
    return (entry / f"{module}.so").is_file()


def is_stale(entry: Path, sources: list[Path]) -> bool:
    """An entry is stale when some file in it predates the newest of the module's patched
    sources (sm120patch removes entries when it changes sources, so this finds entries built
    under another cache base, copied, or restored from a backup)."""
    newest = max((s.stat().st_mtime for s in sources if s.exists()), default=0.0)
    mtimes = [p.stat().st_mtime for p in entry.rglob("*") if p.is_file()]
    return bool(mtimes) and min(mtimes) < newest


_NINJA_SOURCE = re.compile(r"^build \S+: \S+ (\S+)$", re.M)


def built_from(entry: Path) -> list[Path]:
    """The source files the entry's build.ninja compiled (absolute paths: they name the
    environment whose FlashInfer built it)."""
    try:
        text = (entry / "build.ninja").read_text(errors="replace")
    except OSError:
        return []
    return [Path(m) for m in _NINJA_SOURCE.findall(text) if m.endswith((".cu", ".cpp", ".cc"))]


def foreign_entry(entry: Path, site_dir: Path) -> Path | None:
    """When ``entry`` was built from another environment's sources (two environments sharing
    one JIT cache), one of those sources."""
    for source in built_from(entry):
        if not source.is_relative_to(site_dir):
            return source
    return None


def module_locks(entries_: list[Path], module: str, *, owner: Owner | None,
                 on_wait: Callable[[str], None] | None, timeout: float | None = None) -> ExitStack:
    """FlashInfer's own build lock of ``module`` in the arch directory of each entry. FlashInfer
    made the lock file when it built the entry; it is created only where it is missing (an
    entry copied in from elsewhere)."""
    stack = ExitStack()
    try:
        for entry in entries_:
            arch = entry.parent.parent
            lock = lock_path(entry, module)
            stack.enter_context(flock(
                lock, what="FlashInfer's lock", timeout=timeout, on_wait=on_wait, create=True, owner=owner,
                busy=f"a FlashInfer process is building or loading {module} in {arch} (it holds {lock})",
                hint="run again once the server has started (its build finishes), or stop it first"))
    except BaseException:
        stack.close()
        raise
    return stack


def aot_shadows(env: Environment, flashinfer: InstalledDistribution | None, module: str) -> list[AotShadow]:
    found = []
    jit_cache = env.get(FLASHINFER_JIT_CACHE)
    if jit_cache is not None:
        for relpath in jit_cache.record:
            if relpath.endswith(f"/{module}/{module}.so"):
                found.append(AotShadow(str(jit_cache.site_dir / relpath), f"{FLASHINFER_JIT_CACHE} {jit_cache.raw_version}"))
    if flashinfer is not None:
        aot = flashinfer.site_dir / "flashinfer" / "data" / "aot" / module / f"{module}.so"
        if aot.exists():
            found.append(AotShadow(str(aot), "flashinfer/data/aot"))
    return found
