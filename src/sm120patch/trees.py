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
from pathlib import Path
from typing import Mapping, NamedTuple

from packaging.version import Version

from sm120patch.distributions import Distribution, Registry
from sm120patch.environment import Environment, InstalledDistribution, version_or_none
from sm120patch.errors import TargetError
from sm120patch.fileio import read_regular
from sm120patch.patchsets import normalize_relpath
from sm120patch.state import InstallState, Owner


class FileRead(NamedTuple):
    """A tree's file as sm120patch found it."""

    relpath: str
    path: Path
    data: bytes | None  # None: missing (or unreadable, see problem)
    link: str | None = None  # the entry is a symbolic link to this target (data: the target's bytes)
    problem: str | None = None  # why sm120patch will not touch it, whatever its bytes


class InstalledTree:
    kind = "environment"

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


def _read(path: Path) -> bytes | None:
    try:
        return read_regular(path)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None


class CheckoutTree:
    kind = "checkout"

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
