"""Writing a plan into a git checkout: one reviewable commit on a branch of its own
(gitpython), never an edit of the user's branch; and undoing it.

The commit message lists every patch with its upstream reference and the first release that
fixes it (DEP-3-like trailers), and whether the checkout's files were the release's bytes.
sm120patch's own note of what it did is ``.git/sm120patch.json``: never part of the tree.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from sm120patch import __version__
from sm120patch.errors import RefusedError
from sm120patch.invocation import command
from sm120patch.patchsets import Patch, PatchSet
from sm120patch.plan import Plan
from sm120patch.trees import CheckoutTree


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


@dataclass(frozen=True)
class Commit:
    branch: str
    sha: str
    files: tuple[str, ...]  # repository paths


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


@dataclass(frozen=True)
class Undo:
    message: str
    changed: bool


def revert_checkout(tree: CheckoutTree) -> Undo:
    """Back to the branch the user was on; sm120patch's branch is deleted only when nobody
    committed to it."""
    repo = tree.repo
    note = read_note(tree)
    if not note:
        return Undo(f"{tree.distribution.name} {tree.raw_version}: sm120patch made no commit in {tree.root}; nothing to revert", False)
    branch = note["branch"]
    if branch not in repo.heads:
        tree.state_path.unlink()
        return Undo(f"{branch} is gone already; nothing to revert", True)
    if repo.heads[branch].commit.hexsha != note["commit"]:
        raise RefusedError(f"{branch} has commits sm120patch did not make; refusing to delete it",
                           hint=f"`git checkout {shlex.quote(note['original'])}` and delete the branch yourself when you are done with it")
    refuse_dirty(tree)
    repo.git.checkout(note["original"])
    repo.delete_head(branch, force=True)
    tree.state_path.unlink()
    return Undo(f"back on {note['original']}; deleted {branch}", True)


def export(tree: CheckoutTree, out: Path) -> list[Path]:
    note = read_note(tree)
    if not note:
        raise RefusedError(f"sm120patch has made no commit in {tree.root}",
                           hint=f"run `{command('apply', ('--source', str(tree.root)))}` first")
    out.mkdir(parents=True, exist_ok=True)
    names = tree.repo.git.format_patch("-1", note["commit"], "-o", str(out)).splitlines()
    return [Path(name) for name in names if name.strip()]
