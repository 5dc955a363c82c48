"""The write step: every plan of one run written as one unit. Each tree writes its own plan
(a checkout commits it on a branch of its own; an install adds its changes to the one
transaction); the transaction also moves FlashInfer's stale JIT entries aside (under
FlashInfer's own lock) and removes the state of installs that are gone. When the transaction
fails after a commit, the commit is undone."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Callable, NamedTuple, Protocol, Sequence

from sm120patch import jitcache
from sm120patch.checkout import Commit, Undo
from sm120patch.fileops import check_writable
from sm120patch.hashing import sha256
from sm120patch.installed import InstalledTree
from sm120patch.jitcache import AotShadow, JitStatus
from sm120patch.plan import Plan, Writes
from sm120patch.reports import ChangeReport
from sm120patch.state import Owner, orphans, state_root
from sm120patch.transaction import Change, Transaction
from sm120patch.trees import Tree


class Worktree(Tree, Protocol):
    """A tree as the commands act on it: its files (trees.Tree), and what each kind answers for
    itself (installed.InstalledTree, checkout.CheckoutTree), so that nothing above asks which kind
    it holds. Writing: an install joins the one transaction, a checkout commits on a branch."""

    # Whether it keeps sm120patch's ledger: an install does; a checkout's record is the commit, so
    # a hand edit equal to the patch there has nothing to be recorded in (apply leaves it, unchanged).
    keeps_ledger: bool

    def write(self, plan: Plan, writes: Writes) -> Commit | None: ...
    def refuse_unwritable(self, plan: Plan) -> None: ...
    def revert_by_record(self, *, dry_run: bool = False) -> Undo | None: ...
    def branch(self) -> str | None: ...
    def pending(self, revert_command: str) -> tuple[str | None, bool]: ...
    def pin_mismatch(self) -> str | None: ...
    def jit_status(self, jit_base: str | None, sources: list[Path]) -> JitStatus | None: ...
    def aot_shadows(self) -> list[AotShadow]: ...


class WriteTarget(NamedTuple):
    """What the write step is told of the run's target."""

    installed: Sequence[InstalledTree]  # the installs (one transaction, one JIT cache base)
    state_dirs: Sequence[Path]  # the install locations whose sm120patch state this run may clean
    revert_command: str  # the command that rolls an interrupted run back, for this target
    jit_base: str | None = None  # --jit-cache-base
    on_wait: Callable[[str], None] | None = None  # told when a lock makes the run wait
    check: Callable[[], None] | None = None  # run before the commit point; what it raises rolls the run back


def write(report: ChangeReport, target: WriteTarget, plans: list[Plan], *, operation: str) -> None:
    writes = Writes()
    for plan in plans:
        commit = plan.assessment.tree.write(plan, writes)
        if commit is not None:
            next(r for r in report.results if r.plan is plan).commit = commit
    if not target.state_dirs:
        return
    try:
        with ExitStack() as locks:
            roots, owners = [], {}
            for site_dir in target.state_dirs:  # the installs' locations (or, none installed, the orphans')
                root = state_root(site_dir)
                if root not in roots:
                    roots.append(root)
                    owners[root] = Owner.of(site_dir)
            # Stale JIT entries first: moved aside before any source changes, so no server
            # can load an entry built from sources that are about to change.
            changes, jit_locks = [], []
            for tree in target.installed:
                changes += _jit_changes(tree, plans, target, report, jit_locks, roots[0])
            for tree, plan in writes.transaction:
                changes += install_changes(tree, plan, operation)
            changes += _orphan_changes(target, report)
            if not changes:
                return
            # The pre-flight before any lock is taken: taking FlashInfer's lock may create its
            # lock file (and cached_ops/tmp/) in the JIT cache, and a run refused for
            # permissions must have changed nothing anywhere. (begin() checks again, under the locks.)
            check_writable([change.path for change in changes])
            for lock in jit_locks:
                locks.enter_context(lock())
            Transaction(operation, roots, owners, changes,
                        revert_command=target.revert_command, check=target.check).run_all()
    except BaseException:
        for undo in writes.undo:
            undo()
        raise


def preview(report: ChangeReport, target: WriteTarget, plans: list[Plan], *, operation: str) -> None:
    """A dry run of :func:`write` for the installs: the same changes (the JIT entries it would
    move aside land in ``report.jit_removed``) and the same pre-flight, so a dry run refuses
    what the real run would refuse (exit 4 for want of permission). Nothing is written, no lock
    is taken, and a checkout gets no branch."""
    if not target.state_dirs:
        return
    root = state_root(target.state_dirs[0])
    changes = []
    for tree in target.installed:
        changes += _jit_changes(tree, plans, target, report, [], root)
    for plan in plans:
        if plan.assessment.tree in target.installed:
            changes += install_changes(plan.assessment.tree, plan, operation)
    changes += _orphan_changes(target, report)  # named in the report: the run removes them too
    check_writable([change.path for change in changes])


def _orphan_changes(target: WriteTarget, report: ChangeReport) -> list[Change]:
    """The state of installs that are gone (uninstalled, or another version now), removed in the
    same transaction: a full revert then leaves no .sm120patch/ behind."""
    changes = []
    for site_dir in target.state_dirs:
        for orphan in orphans(site_dir):
            report.orphans_removed.append(orphan)
            changes += [Change("remove", path, state_root(site_dir), label=f"state of {orphan.name}")
                        for path in orphan.files]
    return changes


def install_changes(tree: InstalledTree, plan: Plan, operation: str) -> list[Change]:
    """One install's plan as the transaction's changes: the originals saved on the first patch
    of a file, the files, the ledger (and, with the ledger gone, every original it kept)."""
    state, owner = tree.state, tree.owner
    root = state.root.parent
    changes = []
    for planned in plan.files:
        if operation == "apply" and planned.original is not None and state.saved_original(
                planned.relpath, sha256(planned.original)) is None:
            if planned.replaces_link is None and planned.current == planned.original:
                # The file being replaced is the original: keep its inode (a hard link, no new space).
                changes.append(Change("restore", state.original(planned.relpath), root, source=planned.path,
                                      owner=owner, label=f"original of {planned.relpath}"))
            else:
                changes.append(Change("write", state.original(planned.relpath), root, data=planned.original,
                                      owner=owner, label=f"original of {planned.relpath}"))
        if planned.relink is not None:
            changes.append(Change("symlink", planned.path, root, target=planned.relink, label=planned.relpath))
        elif planned.restore_from == "saved original":
            changes.append(Change("restore", planned.path, root, source=state.original(planned.relpath),
                                  label=planned.relpath))
        else:
            changes.append(Change("write", planned.path, root, data=planned.data, owner=owner, label=planned.relpath))
        if operation == "revert" and state.original(planned.relpath).exists():
            # Journaled like every other change: a kill never leaves a ledger-less original.
            changes.append(Change("remove", state.original(planned.relpath), root,
                                  label=f"original of {planned.relpath}"))
    if plan.ledger_changes:
        if plan.ledger is not None:
            changes.append(Change("write", state.ledger_path, root, data=plan.ledger.to_bytes(), owner=owner,
                                  label=f"{plan.assessment.name} ledger"))
        elif state.ledger_path.exists():
            changes.append(Change("remove", state.ledger_path, root, label=f"{plan.assessment.name} ledger"))
            # With the ledger, every original it kept goes (a reinstall put the release's bytes back
            # without sm120patch: nothing to restore, but the state is still there).
            removed = {c.path for c in changes}
            changes += [Change("remove", path, root, label=_state_label(path, state.root))
                        for path in state.files() if path != state.ledger_path and path not in removed]
    return changes


def _state_label(path: Path, root: Path) -> str:
    """What a file of an install's state is, for messages: a saved original, or (a file that
    should not be there, which the owner of the environment can put there) a state file."""
    originals = root / "originals"
    return f"original {path.relative_to(originals)}" if path.is_relative_to(originals) else f"state file {path.name}"


def move_aside(version: str, base: Path, module: str, sources: list[Path], *, sources_change: bool,
               root: Path) -> list[Change]:
    """The changes that move this version's JIT entries aside in a transaction whose state root
    is ``root`` (its rollback puts them back): every entry when its sources change, else those
    older than the sources (a run killed after its files changed, an entry built under another
    base and copied). Here, not in jitcache, which status reads: a Change is the transaction's."""
    found = jitcache.entries(version, base, module)
    if not sources_change:
        found = [e for e in found if jitcache.is_stale(e, sources)]
    return [Change("aside", entry, root, label=f"JIT entry {entry}") for entry in found]


def _jit_changes(tree: InstalledTree, plans: list[Plan], target: WriteTarget, report: ChangeReport,
                 locks: list, root: Path) -> list[Change]:
    """Move aside the module's entries of this version (jitcache says which), under its lock
    (added to ``locks``, to be taken once the pre-flight has passed)."""
    module = tree.distribution.jit_module
    plan = next((p for p in plans if p.assessment.tree is tree), None)
    if not module or plan is None:
        return []
    base = jitcache.cache_base(target.jit_base, owner=tree.owner)
    report.jit_base = base
    report.jit_sources_changed = report.jit_sources_changed or bool(plan.files)
    changes = move_aside(tree.raw_version, base.path, module,
                         [fa.path for fa in plan.assessment.files.values()],
                         sources_change=bool(plan.files), root=root)
    if not changes:
        return []
    entries = [change.path for change in changes]
    owner = Owner.of(base.path)
    locks.append(lambda: jitcache.module_locks(entries, module, owner=owner, on_wait=target.on_wait))
    report.jit_removed += entries
    return changes
