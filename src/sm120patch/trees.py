"""The two kinds of tree sm120patch patches, behind one small interface.

- :class:`InstalledTree`: one install of a distribution in an environment: its files are
  where its ``RECORD`` says, and the ``RECORD`` gives the release's hash of each.
- :class:`CheckoutTree`: a git checkout of the project: the wheel's paths map onto the
  repository's layout (data), and the vendor manifest gives the release's hash of each.

Assessment, planning, the dry run, drift refusal and rendering are written once, above this
interface; only the writer at the bottom knows the kind (a transaction, or a commit).
"""

from __future__ import annotations

import os
import re
import shlex
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, NamedTuple, Protocol

from packaging.version import Version

from sm120patch.distributions import Distribution, Registry
from sm120patch.environment import Environment, InstalledDistribution, version_or_none
from sm120patch.errors import TargetError
from sm120patch.fileio import read_regular
from sm120patch.patchsets import normalize_relpath
from sm120patch.state import InstallState, Ledger, Owner

if TYPE_CHECKING:  # the writers are imported by the commands that change things, not by status
    from sm120patch.assess import Assessment
    from sm120patch.jitcache import AotShadow
    from sm120patch.reports import JitStatus
    from sm120patch.checkout import Commit, Undo
    from sm120patch.plan import Plan


class FileRead(NamedTuple):
    """A tree's file as sm120patch found it."""

    relpath: str
    path: Path
    data: bytes | None  # None: missing (or unreadable, see problem)
    link: str | None = None  # the entry is a symbolic link to this target (data: the target's bytes)
    problem: str | None = None  # why sm120patch will not touch it, whatever its bytes


class Writes:
    """One write step, gathered from every tree: the plans that join the one transaction
    (installs), and how to undo what was committed already (checkouts) when it fails."""

    def __init__(self) -> None:
        self.transaction: list[tuple[InstalledTree, Plan]] = []
        self.undo: list[Callable[[], object]] = []


class Tree(Protocol):
    """What the pipeline, the planner and the renderer know of a tree; each kind answers for
    itself, so nothing above asks which kind it holds."""

    distribution: Distribution
    raw_version: str
    root: Path
    kind: str  # the word the --json documents use ("environment", "checkout"); nothing branches on it
    shared_with: str | None
    judged_by_meaning: bool  # its files are judged by each patch's semantic check, not by the release's hashes

    @property
    def version(self) -> Version | None: ...
    @property
    def label(self) -> str: ...
    @property
    def heading(self) -> str: ...  # status's head line, before the verdict
    @property
    def where(self) -> str: ...  # status's head line, after the verdict
    @property
    def dist_info(self) -> Path | None: ...
    @property
    def reinstall_hint(self) -> str: ...  # how to get the release's files back without sm120patch

    def read(self, relpath: str) -> FileRead: ...
    def release_sha256(self, relpath: str) -> str | None: ...
    def release_bytes(self, relpath: str, expected: str, *, wheel_dir: Path | None,
                      download: bool) -> tuple[bytes, str] | None: ...
    def saved_original(self, relpath: str, expected: str | None) -> bytes | None: ...
    def read_ledger(self) -> Ledger | None: ...
    def diff_path(self, relpath: str) -> str: ...
    def copy_reinstall_command(self, spec: str) -> str | None: ...
    def presence_word(self, present: bool) -> str: ...
    def branch(self) -> str | None: ...
    def refuse_unwritable(self, plan: Plan) -> None: ...
    def write(self, plan: Plan, writes: Writes) -> Commit | None: ...
    def revert_by_record(self) -> Undo | None: ...
    def pending(self, revert_command: str) -> tuple[str | None, bool]: ...
    def pin_mismatch(self) -> str | None: ...
    def jit_status(self, jit_base: str | None, assessment: Assessment) -> JitStatus | None: ...
    def aot_shadows(self) -> list[AotShadow]: ...


class InstalledTree:
    kind = "environment"
    judged_by_meaning = False  # the RECORD gives the release's hash of every file

    def __init__(self, env: Environment, dist: InstalledDistribution, distribution: Distribution) -> None:
        self.env = env
        self.dist = dist
        self.distribution = distribution
        self.raw_version = dist.raw_version

    @property
    def version(self) -> Version | None:
        return self.dist.version

    @property
    def root(self) -> Path:
        return self.dist.site_dir

    @property
    def label(self) -> str:
        return f"{self.dist.name} {self.raw_version} in {self.dist.site_dir}"

    @property
    def state(self) -> InstallState:
        return InstallState.for_install(self.dist.site_dir, self.dist.dist_info)

    @property
    def owner(self) -> Owner:
        return Owner.of(self.dist.site_dir)

    @property
    def shared_with(self) -> str | None:
        """Who else sees these files, when it is not this environment alone: a venv made with
        --system-site-packages reads its base interpreter's packages."""
        if self.env.shares_base(self.dist):
            return (f"the base interpreter's packages ({self.env.base_prefix}), which this environment reads through "
                    "--system-site-packages: a change there is a change for every environment on that base")
        return None

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
            return FileRead(relpath, path, _read(path), problem=f"{path.parent} leads outside {self.root} "
                                                                "(a symbolic link in the package's directories)")
        link = os.readlink(path) if path.is_symlink() else None
        return FileRead(relpath, path, _read(path), link=link)

    def editable_checkout(self) -> Path | None:
        return self.dist.editable_source

    @property
    def heading(self) -> str:
        return f"{self.distribution.name} {self.raw_version}"

    @property
    def where(self) -> str:
        return f"  ({self.root})"

    @property
    def dist_info(self) -> Path:
        return self.dist.dist_info

    @property
    def reinstall_hint(self) -> str:
        return f"reinstall with `{self.env.reinstall_command(self.dist)}`"

    def copy_reinstall_command(self, spec: str) -> str:
        return shlex.join(["uv", "pip", "install", "--python", str(self.env.executable), "--reinstall",
                           "--link-mode=copy", "--no-deps", spec])

    def diff_path(self, relpath: str) -> str:
        return relpath  # from the package root (site-packages): `patch -p1` there

    def presence_word(self, present: bool) -> str:
        return "present" if present else "absent"

    def branch(self) -> None:
        return None

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
        from sm120patch import wheels
        from sm120patch.errors import Sm120PatchError
        from sm120patch.hashing import sha256

        wheel = wheels.find_wheel(self.dist.name, self.raw_version, wheel_dir, download=download)
        if wheel is None:
            return None
        try:
            data, listed = wheels.wheel_file(wheel, relpath)
        except Sm120PatchError:
            return None
        return (data, f"release wheel {wheel.name}") if sha256(data) == expected == listed else None

    def refuse_unwritable(self, plan: Plan) -> None:
        return None  # the transaction checks every file as it writes it

    def write(self, plan: Plan, writes: Writes) -> None:
        """Joins the one transaction over every install, which the write step runs."""
        writes.transaction.append((self, plan))
        return None

    def revert_by_record(self) -> None:
        return None  # revert plans the release's bytes back, from the ledger

    def pending(self, revert_command: str) -> tuple[str | None, bool]:
        """An interrupted run (blocks: status exits 3), or one in progress, in words."""
        from sm120patch.errors import Sm120PatchError
        from sm120patch.journal import journal_at, read_journal
        from sm120patch.locks import someone_holds

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

    def jit_status(self, jit_base: str | None, assessment: Assessment) -> JitStatus | None:
        """The module's JIT cache entries of this release, in the cache base the server reads."""
        module = self.distribution.jit_module
        if not module:
            return None
        from sm120patch import jitcache
        from sm120patch.reports import JitStatus

        base = jitcache.cache_base(jit_base, owner=self.owner)
        entries = jitcache.entries(self.raw_version, base.path, module)
        sources = [fa.path for fa in assessment.files.values()]
        foreign = {}
        for entry in entries:
            other = jitcache.foreign_entry(entry, self.dist.site_dir)
            if other is not None:
                foreign[entry] = other
        # An entry built from another environment's files is that environment's: its age says
        # nothing against this environment's sources (installed or patched later, say), so it is
        # reported as foreign, never as stale here.
        stale = [e for e in entries if e not in foreign and jitcache.is_stale(e, sources)]
        return JitStatus(base, entries, stale=stale, foreign=foreign,
                         asides=jitcache.asides(self.raw_version, base.path, module),
                         incomplete=[e for e in entries if not jitcache.is_built(e, module)])

    def aot_shadows(self) -> list[AotShadow]:
        module = self.distribution.jit_module
        if not module:
            return []
        from sm120patch import jitcache

        return jitcache.aot_shadows(self.env, self.dist, module)


def _read(path: Path) -> bytes | None:
    try:
        return read_regular(path)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None


class CheckoutTree:
    kind = "checkout"
    judged_by_meaning = True  # HEAD is not a release's bytes: each patch's semantic check says

    def __init__(self, root: Path, distribution: Distribution, raw_version: str, repo,
                 pristine: Mapping[str, str] | None = None) -> None:
        self.root = root
        self.distribution = distribution
        self.raw_version = raw_version
        self.repo = repo  # git.Repo
        self.pristine = dict(pristine or {})  # relpath -> the release's sha256, from the manifest

    @property
    def version(self) -> Version | None:
        return version_or_none(self.raw_version)

    @property
    def label(self) -> str:
        return f"{self.distribution.name} {self.raw_version} checkout at {self.root}"

    def repo_path(self, relpath: str) -> str:
        mapped = self.distribution.checkout.repo_path(relpath) if self.distribution.checkout else None
        if mapped is None:
            raise TargetError(f"{relpath} has no place in a {self.distribution.name} checkout")
        return mapped

    def release_sha256(self, relpath: str) -> str | None:
        return self.pristine.get(relpath)

    shared_with = None  # a checkout is its own

    def read(self, relpath: str) -> FileRead:
        path = self.root / self.repo_path(relpath)
        return FileRead(relpath, path, _read(path))

    @property
    def state_path(self) -> Path:
        return Path(self.repo.git_dir) / "sm120patch.json"  # inside .git: never part of the tree

    @property
    def heading(self) -> str:
        return f"{self.distribution.name} {self.raw_version} checkout at {self.root}"

    where = ""  # the heading names the checkout
    dist_info = None

    @property
    def reinstall_hint(self) -> str:
        return f"`git checkout -- {self.root}` restores the checkout's files"

    def copy_reinstall_command(self, spec: str) -> None:
        return None

    def diff_path(self, relpath: str) -> str:
        return self.repo_path(relpath)  # from the repository root: `git apply` there

    def presence_word(self, present: bool) -> str:
        return "in HEAD" if present else "not in HEAD"

    def branch(self) -> str | None:
        """sm120patch's branch here, from its note (None: it made none)."""
        from sm120patch.checkout import read_note

        note = read_note(self)
        return note["branch"] if note else None

    def read_ledger(self) -> None:
        return None  # the commit is the record

    def saved_original(self, relpath: str, expected: str | None) -> None:
        return None

    def release_bytes(self, relpath: str, expected: str, *, wheel_dir: Path | None, download: bool) -> None:
        return None

    def lock(self, on_wait: Callable[[str], None] | None) -> AbstractContextManager:
        from sm120patch.locks import flock

        return flock(Path(self.repo.git_dir), what="checkout", timeout=None, on_wait=on_wait,
                     busy=f"another sm120patch is changing {self.root}", hint="run again when it has finished")

    def refuse_unwritable(self, plan: Plan) -> None:
        if plan.files:
            from sm120patch.checkout import refuse_dirty

            refuse_dirty(self)

    def write(self, plan: Plan, writes: Writes) -> Commit | None:
        """One commit on a branch of its own, made now; undone when the transaction fails."""
        if not plan.files:
            return None
        from sm120patch.checkout import commit_plan, revert_checkout

        commit = commit_plan(self, plan)
        writes.undo.append(lambda: revert_checkout(self))
        return commit

    def revert_by_record(self) -> Undo:
        """Back to the user's branch: the commit is the record of what sm120patch did."""
        from sm120patch.checkout import revert_checkout

        return revert_checkout(self)

    def pending(self, revert_command: str) -> tuple[None, bool]:
        return None, False  # a commit is made or not: nothing is left half done

    def pin_mismatch(self) -> None:
        return None

    def jit_status(self, jit_base: str | None, assessment: Assessment) -> None:
        return None  # no server loads a checkout's JIT cache entries as such

    def aot_shadows(self) -> list[AotShadow]:
        return []


def open_checkout(path: str | Path, registry: Registry) -> CheckoutTree:
    """Detect which project a checkout holds (its layout's markers) and its version
    (the layout's version file, else the newest release tag reachable from HEAD)."""
    import git

    root = Path(path).expanduser()
    if not root.exists():
        raise TargetError(f"--source {path}: no such directory")
    if not root.is_dir():
        raise TargetError(f"--source {path}: not a directory")
    try:
        repo = git.Repo(root.resolve())
    except git.InvalidGitRepositoryError:
        raise TargetError(f"--source {path}: not a git checkout (no .git here)") from None
    except git.NoSuchPathError:
        raise TargetError(f"--source {path}: no such directory") from None
    root = Path(repo.working_tree_dir)
    for distribution in registry:
        layout = distribution.checkout
        if layout is None or not layout.matches(root):
            continue
        version = None
        if layout.version_file and (root / layout.version_file).exists():
            version = (root / layout.version_file).read_text().strip()
        version = version or _describe(repo)
        if not version:
            raise TargetError(f"--source {path}: cannot tell the {distribution.name} version "
                              f"(no {layout.version_file or 'version file'}, no release tag)")
        from sm120patch.manifests import load_manifest

        manifest = load_manifest(distribution.name, version)
        pristine = {rel: hashes.pristine for rel, hashes in manifest.files.items()} if manifest else {}
        return CheckoutTree(root, distribution, version, repo, pristine)
    names = ", ".join(d.name for d in registry if d.checkout)
    raise TargetError(f"--source {path}: a git checkout, but of none of {names}")


def _describe(repo) -> str | None:
    import git

    try:
        tag = repo.git.describe("--tags", "--abbrev=0")
    except git.GitCommandError:
        return None
    return re.sub(r"^v", "", tag.strip())
