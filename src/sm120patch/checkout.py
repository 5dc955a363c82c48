"""A git checkout of a project, as a tree, and writing a plan into it: one reviewable commit on a
branch of its own (gitpython), never an edit of the user's branch; and undoing it.

The wheel's paths map onto the repository's layout (data), and the vendor manifest gives the
release's hash of each file; HEAD is judged by each patch's semantic check.

The commit message lists every patch with its upstream reference and the first release that
fixes it (DEP-3-like trailers), and whether the checkout's files were the release's bytes.
sm120patch's own note of what it did is ``.git/sm120patch.json``: never part of the tree.
"""

from __future__ import annotations

import json
import os
import pwd
import stat
import re
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from packaging.version import Version

from sm120patch import __version__, terminal
from sm120patch.distributions import Distribution, Registry
from sm120patch.environment import version_or_none
from sm120patch.errors import RefusedError, TargetError
from sm120patch.invocation import command
from sm120patch.locks import flock
from sm120patch.manifests import load_manifest
from sm120patch.patchsets import Patch, PatchSet
from sm120patch.records import Commit, Undo
from sm120patch.trees import FileRead, TreeWords, read_or_none

if TYPE_CHECKING:  # a plan is only handed in: status, which opens checkouts, never plans
    from sm120patch.plan import Plan, Writes


class CheckoutTree:
    judged_by_meaning = True  # HEAD is not a release's bytes: each patch's semantic check says
    keeps_ledger = False  # the commit is the record
    dist_info = None

    def __init__(self, root: Path, distribution: Distribution, raw_version: str, repo,
                 pristine: Mapping[str, str] | None = None) -> None:
        self.root = root
        self.distribution = distribution
        self.raw_version = raw_version
        self.repo = repo  # git.Repo
        self.pristine = dict(pristine or {})  # relpath -> the release's sha256, from the manifest

    # -- the tree's files (trees.Tree) ---------------------------------------------------------

    @property
    def version(self) -> Version | None:
        return version_or_none(self.raw_version)

    @property
    def words(self) -> TreeWords:
        label = f"{self.distribution.name} {self.raw_version} checkout at {self.root}"
        return TreeWords(kind="checkout", label=label, heading=label, where="",  # the heading names the checkout
                         reinstall_hint=f"`git checkout -- {self.root}` restores the checkout's files",
                         present="in HEAD", absent="not in HEAD")

    def repo_path(self, relpath: str) -> str:
        mapped = self.distribution.checkout.repo_path(relpath) if self.distribution.checkout else None
        if mapped is None:
            raise TargetError(f"{relpath} has no place in a {self.distribution.name} checkout")
        return mapped

    def release_sha256(self, relpath: str) -> str | None:
        return self.pristine.get(relpath)

    def read(self, relpath: str) -> FileRead:
        path = self.root / self.repo_path(relpath)
        return FileRead(relpath, path, read_or_none(path))

    def read_ledger(self) -> None:
        return None  # the commit is the record

    def saved_original(self, relpath: str, expected: str | None) -> None:
        return None

    def release_bytes(self, relpath: str, expected: str, *, wheel_dir: Path | None, download: bool) -> None:
        return None

    # -- what the commands ask of a checkout (write.Worktree) --------------------------------------

    @property
    def state_path(self) -> Path:
        return Path(self.repo.git_dir) / "sm120patch.json"  # inside .git: never part of the tree

    def branch(self) -> str | None:
        """sm120patch's branch here, from its note (None: it made none)."""
        note = read_note(self)
        return note["branch"] if note else None

    def lock(self, on_wait: Callable[[str], None] | None) -> AbstractContextManager:
        return flock(Path(self.repo.git_dir), what="checkout", timeout=None, on_wait=on_wait,
                     busy=f"another sm120patch is changing {self.root}", hint="run again when it has finished")

    def refuse_unwritable(self, plan: Plan) -> None:
        if plan.files:
            refuse_dirty(self)

    def write(self, plan: Plan, writes: Writes) -> Commit | None:
        """One commit on a branch of its own, made now; undone when the transaction fails."""
        if not plan.files:
            return None
        commit = commit_plan(self, plan)
        writes.undo.append(lambda: revert_checkout(self))
        return commit

    def revert_by_record(self, *, dry_run: bool = False) -> Undo:
        """Back to the user's branch: the commit is the record of what sm120patch did (a dry
        run says what that would do, and refuses what it would refuse)."""
        return revert_checkout(self, dry_run=dry_run)

    def pending(self, revert_command: str) -> tuple[None, bool]:
        return None, False  # a commit is made or not: nothing is left half done

    def pin_mismatch(self) -> None:
        return None

    def jit_status(self, jit_base: str | None, sources: list[Path]) -> None:
        return None  # no server loads a checkout's JIT cache entries as such

    def aot_shadows(self) -> list:
        return []


def open_checkout(path: str | Path, registry: Registry) -> CheckoutTree:
    """Detect which project a checkout holds (its layout's markers) and its version
    (the layout's version file, else the newest release tag reachable from HEAD)."""
    import git  # gitpython is slow to import: only when a checkout is named

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
    _refuse_untrusted(repo, root)
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
        manifest = load_manifest(distribution.name, version)
        pristine = {rel: hashes.pristine for rel, hashes in manifest.files.items()} if manifest else {}
        return CheckoutTree(root, distribution, version, repo, pristine)
    names = ", ".join(d.name for d in registry if d.checkout)
    raise TargetError(f"--source {path}: a git checkout, but of none of {names}")


def _refuse_untrusted(repo, root: Path) -> None:
    """git refuses every command in a checkout another user owns (root on a service user's
    clone: "detected dubious ownership", CVE-2022-24765) unless safe.directory names it; every
    later git answer (the release tag, the branch) would then be an error read as "none". Said
    here once, in git's words, with the two ways out."""
    import git

    try:
        repo.git.rev_parse("--git-dir")
    except git.GitCommandError as exc:
        said = str(exc.stderr or "")
        if "dubious ownership" not in said:
            return  # a checkout git reads: what is asked of it next says what is wrong
        line = next((part.strip() for part in said.replace("'", "").splitlines() if "dubious ownership" in part),
                    said.strip())
        line = line.removeprefix("stderr:").strip().removeprefix("fatal:").strip()
        try:
            uid = root.stat().st_uid
        except OSError:
            uid = None
        try:
            name = pwd.getpwuid(uid).pw_name if uid is not None else None
        except KeyError:  # an owner with no passwd entry: named by number
            name = f"uid {uid}"
        owner = f"run sm120patch as {name}, who owns it, or " if name else ""
        raise TargetError(f"--source {root}: git refuses to read it: {line} (this user, uid {os.geteuid()}, does not "
                          "own it)", hint=f"{owner}trust it for this user: `git config --global --add safe.directory "
                          f"{terminal.quote(str(root))}`") from None


def _describe(repo) -> str | None:
    import git

    try:
        tag = repo.git.describe("--tags", "--abbrev=0")
    except git.GitCommandError:
        return None
    return re.sub(r"^v", "", tag.strip())


def branch_name(tree: CheckoutTree) -> str:
    return f"sm120patch/{tree.distribution.name}-{tree.raw_version}"


def refuse_dirty(tree: CheckoutTree) -> None:
    if tree.repo.is_dirty(untracked_files=True):
        raise RefusedError(f"{tree.root} has uncommitted changes or untracked files",
                           hint="commit or stash them first: sm120patch commits its patch on a branch of its own")


def commit_message(tree: CheckoutTree, patch_set: PatchSet, patches: Sequence[Patch], pinned: bool) -> str:
    lines = [f"sm120patch: enable SM120 fused allreduce in {tree.distribution.name} {tree.raw_version}", "",
             f"Applied by sm120patch {__version__} from patches/{patch_set.name}"
             + ("" if pinned else " (unpinned: these files are not the release's bytes; rewriters applied by meaning)")
             + ".", ""]
    for patch in patches:
        lines.append(f"- {patch.id}: {patch.summary}")
        lines.append(f"  File: {tree.repo_path(patch.file)}")
        lines.append(f"  Forwarded: {patch.upstream or 'not yet'}")
        lines.append(f"  Applied-Upstream: {patch.fixed_in or 'no release yet'}")
    lines += ["", f"Sm120patch-Patch-Set: {patch_set.name}", f"Sm120patch-Pinned: {'yes' if pinned else 'no'}"]
    return "\n".join(lines) + "\n"


def commit_plan(tree: CheckoutTree, plan: Plan) -> Commit:
    """Create the branch, write the planned files, commit them; on any failure the user is
    back on their branch with the new one deleted."""
    repo = tree.repo
    refuse_dirty(tree)
    branch = branch_name(tree)
    if branch in repo.heads:
        raise RefusedError(f"branch {branch} exists already",
                           hint=f"`{command('revert', ('--source', str(tree.root)))}` removes it, or delete it yourself")
    original = repo.active_branch.name if not repo.head.is_detached else repo.head.commit.hexsha
    patch_set = plan.assessment.patch_set
    applied_ids = {p for f in plan.files for p in f.patches}
    patches = [p for p in patch_set.patches if p.id in applied_ids]
    # --force over drifted files patches by meaning: the ledger the plan writes says so.
    pinned = not (plan.ledger.unpinned if plan.ledger is not None else plan.assessment.unpinned)
    head = repo.create_head(branch)
    head.checkout()
    try:
        paths = []
        for planned in plan.files:
            planned.path.write_bytes(planned.data)
            paths.append(tree.repo_path(planned.relpath))
        repo.index.add(paths)
        commit = repo.index.commit(commit_message(tree, patch_set, patches, pinned))
    except BaseException:
        repo.git.checkout("--force", original)
        repo.delete_head(head, force=True)
        raise
    tree.state_path.write_text(json.dumps({"branch": branch, "commit": commit.hexsha, "original": original}, indent=2) + "\n")
    return Commit(branch, commit.hexsha, tuple(paths))


def read_note(tree: CheckoutTree) -> dict | None:
    try:
        return json.loads(tree.state_path.read_text())
    except FileNotFoundError:
        return None
    except ValueError:
        raise RefusedError(f"{tree.state_path} is unreadable",
                           hint="delete it, and sm120patch's branch if there is one, by hand") from None


def revert_checkout(tree: CheckoutTree, *, dry_run: bool = False) -> Undo:
    """Back to the branch the user was on; sm120patch's branch is deleted only when nobody
    committed to it. ``dry_run``: what that would do, changing nothing."""
    repo = tree.repo
    note = read_note(tree)
    if not note:
        return Undo(f"sm120patch made no commit in {tree.root}; nothing to revert", False)
    branch = note["branch"]
    if branch not in repo.heads:
        if dry_run:
            return Undo(f"{branch} is gone already; would remove sm120patch's note of it", True)
        tree.state_path.unlink()
        return Undo(f"{branch} is gone already; nothing to revert", True)
    if repo.heads[branch].commit.hexsha != note["commit"]:
        raise RefusedError(f"{branch} has commits sm120patch did not make; refusing to delete it",
                           hint=f"`git checkout {terminal.quote(note['original'])}` and delete the branch yourself when you are done with it")
    refuse_dirty(tree)
    if dry_run:
        return Undo(f"would go back to {note['original']} and delete {branch}", True)
    repo.git.checkout(note["original"])
    repo.delete_head(branch, force=True)
    tree.state_path.unlink()
    return Undo(f"back on {note['original']}; deleted {branch}", True)


def export(tree: CheckoutTree, out: Path, *, force: bool = False) -> list[Path]:
    """sm120patch's commit as `git format-patch` files in ``out``. A file of the same name there
    that is not an export of this commit (the user's own) is never replaced unless ``force``:
    the files are made in a directory of their own inside ``out``, then linked into place, which
    fails rather than replace a file that appeared meanwhile; nothing is written when one is refused."""
    note = read_note(tree)
    if not note:
        raise RefusedError(f"sm120patch has made no commit in {tree.root}",
                           hint=f"run `{command('apply', ('--source', str(tree.root)))}` first")
    import shutil  # here: status imports this module, and neither of these (docs/benchmarks.md)
    import tempfile

    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".sm120patch-export-", dir=out))
    try:
        names = tree.repo.git.format_patch("-1", note["commit"], "-o", str(staging)).splitlines()
        made = [Path(name) for name in names if name.strip()]
        if not force:
            for path in made:
                _refuse_theirs(out / path.name, note["commit"], tree, out)
        written = []
        for path in made:
            target = out / path.name
            if force:
                os.replace(path, target)  # a link in its place is replaced, never written through
            else:
                try:
                    os.link(path, target)
                except FileExistsError:  # there now, made meanwhile: judged again, replaced only if ours
                    _refuse_theirs(target, note["commit"], tree, out)
                    os.replace(path, target)
            written.append(target)
        return written
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _refuse_theirs(target: Path, commit: str, tree: CheckoutTree, out: Path) -> None:
    """Refused: ``target`` exists and is not an export of ``commit`` (format-patch's first line
    names the commit it was made from); a regular file that is one is sm120patch's to replace."""
    try:
        info = target.lstat()
    except FileNotFoundError:
        return
    if stat.S_ISREG(info.st_mode):
        with open(target, "rb") as handle:
            if handle.readline(200).startswith(f"From {commit} ".encode()):
                return
    again = command("export", ("--source", str(tree.root)), ("--out", str(out)), ("--force", None))
    raise RefusedError(f"{target} exists and is not sm120patch's export of this commit; nothing was written",
                       hint=f"choose another --out, or `{again}` replaces it")
