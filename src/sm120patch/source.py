"""Source checkouts of FlashInfer or SGLang: the patch becomes one reviewable commit on a
branch of its own (gitpython), not an edit in site-packages.

The installed layout (a wheel's RECORD paths) maps onto the repository layout: FlashInfer's
wheel carries ``flashinfer/data/include`` and ``flashinfer/data/csrc``, which upstream keeps at
the repository root as ``include/`` and ``csrc/``; SGLang's package lives under ``python/``.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from packaging.version import Version

from sm120patch import __version__
from sm120patch.environment import parse_version
from sm120patch.errors import RefusedError, UsageError
from sm120patch.manifests import apply_edits, load_manifest
from sm120patch.patchsets import Catalog, Patch, PatchSet
from sm120patch.semantics import CHECKS

# (installed prefix, repository prefix), most specific first.
LAYOUTS = {
    "flashinfer-python": (("flashinfer/data/include/", "include/"), ("flashinfer/data/csrc/", "csrc/"), ("flashinfer/", "flashinfer/")),
    "sglang": (("sglang/", "python/sglang/"),),
}
STATE_FILE = "sm120patch.json"  # inside .git: never part of the tree


def repo_path(distribution: str, relpath: str) -> str:
    for installed, repository in LAYOUTS[distribution]:
        if relpath.startswith(installed):
            return repository + relpath[len(installed):]
    raise UsageError(f"{relpath} has no place in a {distribution} source tree")


@dataclass
class SourceTree:
    root: Path
    distribution: str
    raw_version: str
    repo: object  # git.Repo

    @property
    def version(self) -> Version | None:
        return parse_version(self.raw_version)

    @property
    def state_path(self) -> Path:
        return Path(self.repo.git_dir) / STATE_FILE

    def read(self, relpath: str) -> bytes | None:
        path = self.root / repo_path(self.distribution, relpath)
        return path.read_bytes() if path.is_file() else None


def open_tree(path: str | Path) -> SourceTree:
    """Detect the project and its version: FlashInfer's version.txt, SGLang's release tag."""
    import git

    root = Path(path).expanduser().resolve()
    try:
        repo = git.Repo(root)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        raise UsageError(f"--source {path}: not a git checkout") from None
    root = Path(repo.working_tree_dir)
    if (root / "flashinfer" / "__init__.py").exists() and (root / "include" / "flashinfer").is_dir():
        distribution = "flashinfer-python"
        version_file = root / "version.txt"
        version = version_file.read_text().strip() if version_file.exists() else _describe(repo)
    elif (root / "python" / "sglang" / "__init__.py").exists():
        distribution, version = "sglang", _describe(repo)
    else:
        raise UsageError(f"--source {path}: neither a FlashInfer nor an SGLang checkout")
    if not version:
        raise UsageError(f"--source {path}: cannot tell the {distribution} version (no version.txt, no release tag)")
    return SourceTree(root, distribution, version, repo)


def _describe(repo) -> str | None:
    import git

    try:
        tag = repo.git.describe("--tags", "--abbrev=0")
    except git.GitCommandError:
        return None
    return re.sub(r"^v", "", tag.strip())


@dataclass
class SourceStatus:
    tree: SourceTree
    patch_set: PatchSet | None
    in_head: dict[str, bool] = field(default_factory=dict)
    branch: str | None = None  # sm120patch's branch, if it made one


def source_status(tree: SourceTree, catalog: Catalog) -> SourceStatus:
    """Which patches HEAD has already (by meaning: a checkout at or past the upstream fix has them)."""
    patch_set = catalog.find(tree.distribution, tree.version) or catalog.closest_set(tree.distribution, tree.version)
    result = SourceStatus(tree, patch_set)
    if patch_set is not None:
        for patch in patch_set.patches:
            data = tree.read(patch.file)
            check = CHECKS.get(patch.id)
            result.in_head[patch.id] = bool(data is not None and check and check(data.decode("utf-8"))[0])
    state = _read_state(tree)
    result.branch = state.get("branch") if state else None
    return result


def branch_name(tree: SourceTree) -> str:
    return f"sm120patch/{tree.distribution}-{tree.raw_version}"


def commit_message(tree: SourceTree, patch_set: PatchSet, patches: Sequence[Patch], pinned: bool) -> str:
    lines = [f"sm120patch: enable SM120 fused allreduce in {tree.distribution} {tree.raw_version}", "",
             f"Applied by sm120patch {__version__} from patches/{patch_set.source.name}"
             + ("" if pinned else " (unpinned: these files are not the release's bytes; rewriters applied by meaning)") + ".", ""]
    for patch in patches:
        lines.append(f"- {patch.id}: {patch.summary}")
        lines.append(f"  File: {repo_path(tree.distribution, patch.file)}")
        lines.append(f"  Forwarded: {patch.upstream or 'not yet'}")
        lines.append(f"  Applied-Upstream: {patch.fixed_in or 'no release yet'}")
    lines += ["", f"Sm120patch-Patch-Set: {patch_set.source.name}", f"Sm120patch-Pinned: {'yes' if pinned else 'no'}"]
    return "\n".join(lines) + "\n"


@dataclass
class SourceApply:
    tree: SourceTree
    branch: str | None
    commit: str | None
    files: list[str]
    message: str


def apply_source(tree: SourceTree, catalog: Catalog, *, with_ids: Sequence[str] = (), force: bool = False) -> SourceApply:
    repo = tree.repo
    if repo.is_dirty(untracked_files=True):
        raise RefusedError(f"{tree.root} has uncommitted changes or untracked files",
                           hint="commit or stash them first: sm120patch commits its patch on a branch of its own")
    patch_set = catalog.find(tree.distribution, tree.version)
    if patch_set is None:
        closest = catalog.closest_set(tree.distribution, tree.version)
        if not force or closest is None:
            raise RefusedError(f"no patch set is pinned to {tree.distribution} {tree.raw_version} "
                               f"({catalog.nearest(tree.distribution, tree.version)})",
                               hint="--force applies the closest set by meaning" if closest else None)
        patch_set = closest
    selected = patch_set.select(with_ids)
    manifest = load_manifest(tree.distribution, tree.raw_version)
    changes: dict[str, bytes] = {}
    pinned = manifest is not None
    applied: list[Patch] = []
    for relpath in dict.fromkeys(p.file for p in selected):
        current = tree.read(relpath)
        if current is None:
            raise RefusedError(f"{tree.root / repo_path(tree.distribution, relpath)} does not exist in this checkout")
        if manifest is None or hashlib.sha256(current).hexdigest() != manifest.files[relpath].pristine:
            pinned = False
        wanted = [p for p in selected if p.file == relpath]
        new = apply_edits(current, wanted, where=repo_path(tree.distribution, relpath), by_meaning=True)
        if new != current:
            changes[relpath] = new
            applied += wanted
    if not changes:
        return SourceApply(tree, None, None, [], f"{tree.distribution} {tree.raw_version}: HEAD has every patch already")
    branch = branch_name(tree)
    if branch in repo.heads:
        raise RefusedError(f"branch {branch} exists already", hint="`sm120patch revert --source` removes it, or delete it yourself")
    original = repo.active_branch.name if not repo.head.is_detached else repo.head.commit.hexsha
    head = repo.create_head(branch)
    head.checkout()
    try:
        paths = []
        for relpath, data in changes.items():
            path = tree.root / repo_path(tree.distribution, relpath)
            path.write_bytes(data)
            paths.append(repo_path(tree.distribution, relpath))
        repo.index.add(paths)
        commit = repo.index.commit(commit_message(tree, patch_set, applied, pinned))
    except BaseException:
        repo.git.checkout("--force", original)
        repo.delete_head(head, force=True)
        raise
    _write_state(tree, {"branch": branch, "commit": commit.hexsha, "original": original})
    return SourceApply(tree, branch, commit.hexsha, paths,
                       f"{tree.distribution} {tree.raw_version}: committed {commit.hexsha[:12]} on {branch} ({len(paths)} file(s))"
                       + ("" if pinned else "; unpinned: the files were not the release's bytes"))


def revert_source(tree: SourceTree) -> str:
    repo = tree.repo
    state = _read_state(tree)
    if not state:
        raise RefusedError(f"sm120patch has no branch recorded in {tree.root}")
    branch = state["branch"]
    if branch not in repo.heads:
        tree.state_path.unlink()
        return f"{branch} is gone already; nothing to revert"
    if repo.heads[branch].commit.hexsha != state["commit"]:
        raise RefusedError(f"{branch} has commits sm120patch did not make; refusing to delete it",
                           hint=f"`git checkout {state['original']}` and delete the branch yourself when you are done with it")
    if repo.is_dirty(untracked_files=True):
        raise RefusedError(f"{tree.root} has uncommitted changes", hint="commit or stash them first")
    repo.git.checkout(state["original"])
    repo.delete_head(branch, force=True)
    tree.state_path.unlink()
    return f"back on {state['original']}; deleted {branch}"


def export_source(tree: SourceTree, out: Path) -> list[Path]:
    state = _read_state(tree)
    if not state:
        raise RefusedError(f"sm120patch has made no commit in {tree.root}", hint="run `sm120patch apply --source` first")
    out.mkdir(parents=True, exist_ok=True)
    names = tree.repo.git.format_patch("-1", state["commit"], "-o", str(out)).splitlines()
    return [Path(name) for name in names if name.strip()]


def _read_state(tree: SourceTree) -> dict | None:
    try:
        return json.loads(tree.state_path.read_text())
    except FileNotFoundError:
        return None
    except ValueError:
        raise RefusedError(f"{tree.state_path} is unreadable", hint="delete it and the sm120patch branch by hand") from None


def _write_state(tree: SourceTree, state: dict) -> None:
    tree.state_path.write_text(json.dumps(state, indent=2) + "\n")
