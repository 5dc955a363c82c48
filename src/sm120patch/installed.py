"""One install of a distribution in an environment, as a tree: its files are where its ``RECORD``
says, the ``RECORD`` gives the release's hash of each, and sm120patch's state beside it keeps
the originals and the ledger. Its plans join the one transaction over every install of the run
(``write``); its JIT cache entries are judged by ``jitcache``."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from packaging.version import Version

from sm120patch import jitcache, wheels
from sm120patch.distributions import Distribution
from sm120patch.environment import Environment, InstalledDistribution
from sm120patch.errors import Sm120PatchError
from sm120patch.hashing import sha256
from sm120patch.invocation import command
from sm120patch.jitcache import AotShadow, JitStatus
from sm120patch.journal import journal_at, read_journal
from sm120patch.locks import someone_holds
from sm120patch.patchsets import normalize_relpath
from sm120patch.state import InstallState, Ledger, Owner
from sm120patch.trees import FileRead, TreeWords, read_or_none

if TYPE_CHECKING:  # a plan is only handed in: status, which makes installs, never plans
    from sm120patch.plan import Plan, Writes


def _canonical(name: str) -> str:
    """A distribution's name as PEP 503 compares it (a .dist-info directory spells it with _)."""
    return re.sub(r"[-_.]+", "-", name).lower()


class InstalledTree:
    judged_by_meaning = False  # the RECORD gives the release's hash of every file
    keeps_ledger = True

    def __init__(self, env: Environment, dist: InstalledDistribution, distribution: Distribution) -> None:
        self.env = env
        self.dist = dist
        self.distribution = distribution
        self.raw_version = dist.raw_version

    # -- the tree's files (trees.Tree) ---------------------------------------------------------

    @property
    def version(self) -> Version | None:
        return self.dist.version

    @property
    def root(self) -> Path:
        return self.dist.site_dir

    @property
    def dist_info(self) -> Path:
        return self.dist.dist_info

    @property
    def state(self) -> InstallState:
        return InstallState.for_install(self.dist.site_dir, self.dist.dist_info)

    @property
    def owner(self) -> Owner:
        return Owner.of(self.dist.site_dir)

    def from_pythonpath(self) -> str | None:
        """Where the interpreter found this copy only because PYTHONPATH names its directory (the
        probe runs the interpreter with sm120patch's own environment: the interpreter is the truth
        about what it imports with it): which copy, and what a server started without that
        PYTHONPATH (a systemd unit, a container's entry point) imports instead. None: the
        interpreter's own copy."""
        entries = [Path(p).absolute() for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        site_dir = self.dist.site_dir.absolute()
        if site_dir not in entries or any(site_dir.is_relative_to(p) for p in (self.env.prefix, self.env.base_prefix) if p):
            return None
        wanted = _canonical(self.dist.name)
        behind = None
        for directory in self.env.search_path:
            if directory.absolute() == site_dir or directory.absolute() in entries:
                continue
            try:
                names = os.listdir(directory)
            except OSError:
                continue
            found = sorted(n for n in names if n.endswith(".dist-info")
                           and _canonical(n[:-len(".dist-info")].rpartition("-")[0]) == wanted)
            if found:
                behind = (directory, found[0][:-len(".dist-info")].rpartition("-")[2])
                break
        without = (f"imports the copy in {behind[0]} ({self.dist.name} {behind[1]}), which this run leaves as it is "
                   f"(`env -u PYTHONPATH {command('apply', ('--python', str(self.env.executable)))}` patches that one)" if behind
                   else f"has no {self.dist.name} at all")
        return (f"a directory on PYTHONPATH ({self.dist.site_dir}), which the interpreter imports only while "
                f"PYTHONPATH names it: a server started without it {without}")

    @property
    def words(self) -> TreeWords:
        shared = self.from_pythonpath()
        if self.env.shares_base(self.dist):
            # A venv made with --system-site-packages reads its base interpreter's packages.
            shared = (f"the base interpreter's packages ({self.env.base_prefix}), which this environment reads through "
                      "--system-site-packages: a change there is a change for every environment on that base")
        return TreeWords(
            kind="environment", label=f"{self.dist.name} {self.raw_version} in {self.dist.site_dir}",
            heading=f"{self.distribution.name} {self.raw_version}", where=f"  ({self.root})",
            reinstall_hint=f"reinstall with `{self.env.reinstall_command(self.dist)}`",
            present="present", absent="absent", shared_with=shared,
            copy_reinstall=("uv", "pip", "install", "--python", str(self.env.executable), "--reinstall",
                            "--link-mode=copy", "--no-deps"))

    def release_sha256(self, relpath: str) -> str | None:
        entry = self.dist.record.get(relpath)
        return entry.sha256 if entry else None

    def read(self, relpath: str) -> FileRead:
        """The file at a RECORD path; sm120patch only ever edits files the installed release
        owns, inside its location, never through a symlinked parent directory."""
        try:
            relpath = normalize_relpath(relpath)
        except ValueError as exc:
            return FileRead(relpath, self.root / relpath, None, problem=str(exc))
        path = self.root / relpath
        if self.dist.record_error:
            return FileRead(relpath, path, None, problem=f"{self.dist.dist_info / 'RECORD'} cannot be read "
                                                         f"({self.dist.record_error}); sm120patch checks every file "
                                                         "against it")
        if relpath not in self.dist.record:
            return FileRead(relpath, path, None, problem=f"{relpath} is not listed in {self.dist.name}'s RECORD; "
                                                         "sm120patch only edits files the installed release owns")
        if self.dist.record[relpath].sha256 is None:
            algorithm = self.dist.record[relpath].algorithm
            return FileRead(relpath, path, None, problem=f"{self.dist.name}'s RECORD lists {relpath} with "
                                                         f"{'an ' + algorithm + ' hash' if algorithm else 'no hash'}, "
                                                         "not sha256: sm120patch checks every file it changes against "
                                                         "the release's sha256")
        if not path.parent.resolve().is_relative_to(self.root.resolve()):
            return FileRead(relpath, path, read_or_none(path), problem=f"{path.parent} leads outside {self.root} "
                                                                       "(a symbolic link in the package's directories)")
        link = os.readlink(path) if path.is_symlink() else None
        return FileRead(relpath, path, read_or_none(path), link=link)

    def read_ledger(self) -> Ledger | None:
        return self.state.read_ledger()

    def saved_original(self, relpath: str, expected: str | None) -> bytes | None:
        return self.state.saved_original(relpath, expected)

    def release_bytes(self, relpath: str, expected: str, *, wheel_dir: Path | None,
                      download: bool) -> tuple[bytes, str] | None:
        """Saved originals first, then the release wheel: in --wheel-dir, in sm120patch's wheel
        cache, or (``download``) fetched into that cache. A wheel's file is used only when it
        hashes to what the installed RECORD (or the ledger) expects."""
        data = self.state.saved_original(relpath, expected)
        if data is not None:
            return data, "saved original"
        wheel = wheels.find_wheel(self.dist.name, self.raw_version, wheel_dir, download=download)
        if wheel is None:
            return None
        try:
            data, listed = wheels.wheel_file(wheel, relpath)
        except Sm120PatchError:
            return None
        return (data, f"release wheel {wheel.name}") if sha256(data) == expected == listed else None

    # -- what the commands ask of an install (write.Worktree) --------------------------------------

    def editable_checkout(self) -> Path | None:
        return self.dist.editable_source

    def branch(self) -> None:
        return None

    def refuse_unwritable(self, plan: Plan) -> None:
        return None  # the transaction checks every file as it writes it

    def write(self, plan: Plan, writes: Writes) -> None:
        """Joins the one transaction over every install, which the write step runs."""
        writes.transaction.append((self, plan))
        return None

    def revert_by_record(self, *, dry_run: bool = False) -> None:
        return None  # revert plans the release's bytes back, from the ledger

    def pending(self, revert_command: str) -> tuple[str | None, bool]:
        """An interrupted run (blocks: status exits 3), or one in progress, in words."""
        site_dir = self.dist.site_dir
        try:
            journal = read_journal(journal_at(site_dir), revert_command=revert_command)
        except Sm120PatchError as exc:
            return exc.message, True  # in its own words: unreadable, or not even readable by this user
        if journal is None:
            return None, False
        running = someone_holds(site_dir)
        return journal.describe(running=running), not running

    def pin_mismatch(self) -> str | None:
        other = self.distribution.pins
        if not other or self.env.get(other) is None:
            return None
        pinned = self.dist.pinned_version_of(other)
        installed = self.env.get(other).raw_version
        if pinned and pinned != installed:
            return f"{self.dist.name} {self.raw_version} pins {other}=={pinned}; {installed} is installed"
        return None

    def jit_status(self, jit_base: str | None, sources: list[Path]) -> JitStatus | None:
        """The module's JIT cache entries of this release, in the cache base the server reads."""
        module = self.distribution.jit_module
        if not module:
            return None
        base = jitcache.cache_base(jit_base, owner=self.owner)
        return jitcache.status(self.raw_version, module, base, self.dist.site_dir, sources)

    def aot_shadows(self) -> list[AotShadow]:
        module = self.distribution.jit_module
        return jitcache.aot_shadows(self.env, self.dist, module) if module else []
