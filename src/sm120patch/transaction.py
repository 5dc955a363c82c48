"""Every write to a user's environment goes through one :class:`Transaction` per run, in pip's
shape: ``begin`` (write-ahead journal) -> changes, each with its before-state stashed ->
read-back check -> ``commit`` (the journal's removal is the commit point) | ``rollback``.

- A file is never written in place: new bytes go to a temporary file beside it (fsynced,
  given the old file's mode and owner) that is renamed over it. A uv hardlink shares its
  inode with uv's cache; the rename gives the environment a new inode and leaves the cache's
  untouched. A symbolic link is replaced, never written through.
- The before-state is stashed as a hard link (no new disk space, same inode, mode and owner),
  so rolling back is a rename: it works on a full disk. Where a hard link cannot be made
  (another file system), a copy is stashed instead.
- FlashInfer's stale JIT entries are moved aside (a rename), restored on rollback, deleted
  only after the commit point.
- The journal lists every change before the first one; a run killed at any point is rolled
  back by the next run (or finished, when every change had already been made). One run is one
  transaction across every distribution it touches; when those live in several install
  locations, one journal is primary and the others point to it.

The journal's format is :mod:`sm120patch.journal`; the writes themselves are
:mod:`sm120patch.fileops`. Stashing and placing a stashed file back are this module's own.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

from sm120patch import dirfd, fileops, signals
from sm120patch.errors import TransactionError
from sm120patch.fileio import read_regular
from sm120patch.fileops import aside_path, check_writable, describe, prune
from sm120patch.hashing import sha256
from sm120patch.records import Recovery
from sm120patch.journal import REVERT_FORCE, Journal, journal_at, journal_in, read_journal
from sm120patch.state import Owner, ensure_dir, stash_root, temporaries_of
from sm120patch.words import counted

# shutil is imported inside the functions that copy or remove: `status` imports this module
# (through the pipeline), and shutil's own imports (the archive modules) would cost it 3 ms.

# -- changes ------------------------------------------------------------------------------------

class Change(NamedTuple):
    """One journaled change.

    - ``write``: ``path`` gets ``data`` (mode and owner of the file it replaces, else ``owner``);
    - ``restore``: ``path`` gets the file at ``source`` (a saved original: hard-linked, so no
      new space is needed, else copied);
    - ``symlink``: ``path`` becomes a symbolic link to ``target`` (a uv link put back);
    - ``remove``: ``path`` goes;
    - ``aside``: the directory ``path`` (a JIT entry) is moved aside, deleted after commit.
    """

    op: str
    path: Path
    root: Path  # the state root of the install location it belongs to (its stash goes there)
    data: bytes | None = None
    source: Path | None = None
    target: str | None = None
    owner: Owner | None = None
    label: str = ""  # what the change is, for messages (a RECORD path, "ledger", ...)

    def after(self) -> dict:
        if self.op == "write":
            return {"type": "file", "sha256": sha256(self.data)}
        if self.op == "restore":
            return {"type": "file", "sha256": sha256(read_regular(self.source))}
        if self.op == "symlink":
            return {"type": "link", "target": self.target}
        return {"type": "missing"}


def new_run() -> str:
    """A run's id, which names its stash directory and its JIT entries set aside: random, or
    the one ``SM120PATCH_RUN_ID`` gives (12 hex digits). The fault-injection tests give it so
    that every path a run will write is known before it starts, and a fault is aimed at a path
    rather than at the n-th system call of a kind (whose count the interpreter's own calls move)."""
    given = os.environ.get("SM120PATCH_RUN_ID", "")
    return given if re.fullmatch(r"[0-9a-f]{12}", given) else uuid.uuid4().hex[:12]


@dataclass
class Transaction:
    """The changes of one run, over the install locations they touch."""

    operation: str
    roots: list[Path]  # state roots, one per install location; roots[0] holds the journal
    owners: dict[Path, Owner]
    changes: list[Change] = field(default_factory=list)
    run: str = field(default_factory=new_run)
    entries: list[dict] = field(default_factory=list)
    revert_command: str = REVERT_FORCE
    # Run once every change is made and read back, before the commit point: whatever it raises
    # rolls the whole run back (apply --with tuned-limits runs the server's decision code here).
    check: Callable[[], None] | None = None

    @property
    def journal(self) -> Path:
        return journal_in(self.roots[0])

    def stash_dir(self, root: Path) -> Path:
        return stash_root(root) / self.run

    # -- begin ---------------------------------------------------------------------------------
    def begin(self) -> None:
        """Pre-flight, then the write-ahead journal: nothing in the environment has changed
        until this returns."""
        check_writable([c.path for c in self.changes])
        for root in self.roots:
            ensure_dir(root, self.owners[root])
        for change in self.changes:
            if change.op in ("write", "restore", "symlink") and change.path.is_relative_to(change.root):
                ensure_dir(change.path.parent, self.owners[change.root])
        self.entries = []
        for index, change in enumerate(self.changes):
            root = change.root
            entry = {"op": change.op, "path": str(change.path), "label": change.label,
                     "before": describe(change.path), "after": change.after()}
            if change.op == "aside":
                entry["aside"] = str(aside_path(change.path, self.run))
            elif entry["before"]["type"] != "missing":
                entry["stash"] = str(self.stash_dir(root) / str(index))
            self.entries.append(entry)
        journal = Journal(self.journal, self.operation, self.run, [str(r) for r in self.roots], self.entries,
                          pid=os.getpid(), started=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        fileops.atomic_write(self.journal, journal.to_bytes(), owner=self.owners[self.roots[0]])
        for root in self.roots[1:]:
            fileops.atomic_write(journal_in(root), journal.pointer_bytes(), owner=self.owners[root])

    # -- the changes ---------------------------------------------------------------------------
    def apply(self) -> None:
        for change, entry in zip(self.changes, self.entries):
            if change.op == "aside":
                dirfd.rename(change.path, entry["aside"])
                continue
            if "stash" in entry:
                stash = Path(entry["stash"])
                ensure_dir(stash.parent, self.owners[change.root])
                _stash(change.path, stash)
            if change.op == "write":
                # The mode and owner of the file it replaces (the entry itself: a link is
                # replaced, never written through, and gives nothing), read by descriptor.
                try:
                    like = dirfd.lstat(change.path)
                except FileNotFoundError:
                    like = None
                if like is not None and not stat.S_ISREG(like.st_mode):
                    like = None
                fileops.atomic_write(change.path, change.data, like=like, owner=change.owner)
            elif change.op == "restore":
                _place(change.source, change.path)
            elif change.op == "symlink":
                dirfd.symlink(change.path, change.target)
            elif change.op == "remove":
                dirfd.unlink(change.path, missing_ok=True)

    def verify(self) -> None:
        """Read every changed path back before the commit point."""
        for change, entry in zip(self.changes, self.entries):
            now = describe(change.path)
            if change.op == "aside":
                ok = now["type"] == "missing" and Path(entry["aside"]).is_dir()
            else:
                ok = now == entry["after"]
            if not ok:
                raise TransactionError(f"{change.path} does not hold what sm120patch wrote to it")

    # -- commit ----------------------------------------------------------------------------------
    def commit(self) -> None:
        signals.commit_point(self.operation)  # from here the change stands: a signal is only noted
        dirfd.unlink(self.journal)  # the commit point
        for root in self.roots[1:]:
            dirfd.unlink(journal_in(root), missing_ok=True)
        self._cleanup()
        for root in self.roots:
            prune(root)

    def _cleanup(self) -> None:
        # Asides first, stash last: a run killed here leaves its stash/<run> directory, which
        # is how the next run finds (by the run id in their names) the asides still to delete.
        for entry in self.entries:
            if entry["op"] == "aside":
                dirfd.rmtree(entry["aside"])
        for root in self.roots:
            dirfd.rmtree(self.stash_dir(root))

    def run_all(self) -> None:
        """begin -> changes -> read-back -> commit; on any failure (Ctrl-C too) roll back."""
        try:
            self.begin()
        except BaseException as exc:
            # Nothing in the environment changed yet; take back what begin made for itself
            # (a journal already written, the state directories it created).
            if self.journal.exists():
                rollback(self.journal, revert_command=self.revert_command)
            for root in self.roots:
                prune(root)
            if isinstance(exc, OSError):
                raise TransactionError(f"{self.operation} failed before changing anything: {_what(exc)}; "
                                       "nothing was changed") from exc
            raise
        try:
            self.apply()
            self.verify()
            if self.check is not None:
                self.check()
        except BaseException as exc:
            try:
                restored = rollback(self.journal, revert_command=self.revert_command)
            except TransactionError as failed:
                raise TransactionError(f"{self.operation} failed ({_what(exc)}), and rolling back failed too: "
                                       f"{failed.message}", hint=failed.hint) from exc
            if isinstance(exc, (OSError, TransactionError)):
                raise TransactionError(f"{self.operation} failed: {_what(exc)}; rolled back "
                                       f"{counted(len(restored), 'change')}, the environment is as it was") from exc
            raise
        self.commit()


def _what(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{exc.strerror or exc}{where}"
    if isinstance(exc, TransactionError):
        return exc.message
    return type(exc).__name__


def _stash(path: Path, stash: Path) -> None:
    """Keep ``path``'s current entry at ``stash``: a hard link (the same inode: no new space,
    the same mode and owner), else a copy (another file system)."""
    try:
        dirfd.link(path, stash)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
        dirfd.copy(path, stash)


def _place(source: Path, path: Path) -> None:
    """Put the file at ``source`` at ``path``, atomically: a hard link renamed over it (no new
    space), else a copy."""
    dirfd.place(source, path)


def rollback(journal_path: Path, *, revert_command: str = REVERT_FORCE) -> tuple[str, ...]:
    """Undo the journaled transaction, in reverse: each path back to its before-state from its
    stash, each JIT entry back in place; then drop the journal(s). Idempotent. When a path can
    no longer be restored but every change had been made, the run is finished instead (the
    environment is then wholly in its after-state). Returns the labels restored."""
    with signals.held():  # a rollback cut in half would leave the next run less to go on
        return _rollback(journal_path, revert_command)


def _rollback(journal_path: Path, revert_command: str) -> tuple[str, ...]:
    journal = read_journal(journal_path, revert_command=revert_command)
    if journal is None:
        return ()
    entries = journal.entries
    at_after = all(_at_after(entry) for entry in entries)
    # First decide, then act: either every path can go back to its before-state, or (every
    # change having been made) the run is finished as it stands; never half of each.
    stuck = [Path(e["path"]) for e in entries if e["op"] != "aside" and not _restorable(e)]
    if stuck and not at_after:
        raise TransactionError(
            f"cannot roll back the interrupted {journal.operation} of {journal.started}: "
            f"{', '.join(map(str, stuck))} {'is' if len(stuck) == 1 else 'are'} neither what {'it was' if len(stuck) == 1 else 'they were'} "
            "nor what that run wrote, and the copy it stashed is gone",
            hint=f"`{revert_command}` restores every file to the release's bytes (from the saved originals "
                 "or the release wheel) and removes the journal",
        )
    restored = []
    for entry in reversed(entries) if not stuck else ():
        path = Path(entry["path"])
        if entry["op"] == "aside":
            aside = Path(entry["aside"])
            if aside.is_dir() and not path.exists():
                dirfd.rename(aside, path)
                restored.append(entry["label"] or str(path))
            continue
        before = entry["before"]
        if describe(path) == before:
            continue
        if before["type"] == "missing":
            dirfd.unlink(path, missing_ok=True)
        else:
            stash = Path(entry["stash"])
            if _same_fs(stash, path):
                dirfd.rename(stash, path)
            else:
                _place(stash, path)
        restored.append(entry["label"] or str(path))
    _drop_journals(journal)
    return tuple(restored)


def _restorable(entry: dict) -> bool:
    before = entry["before"]
    if before["type"] == "missing" or describe(Path(entry["path"])) == before:
        return True
    return "stash" in entry and describe(Path(entry["stash"])) == before


def _same_fs(a: Path, b: Path) -> bool:
    try:
        return a.stat().st_dev == b.parent.stat().st_dev
    except OSError:
        return False


def _at_after(entry: dict) -> bool:
    if entry["op"] == "aside":
        return not Path(entry["path"]).exists()
    return describe(Path(entry["path"])) == entry["after"]


def _drop_journals(journal: Journal) -> None:
    pid = journal.pid
    for entry in journal.entries if pid is not None else ():  # killed between making a temporary and renaming it
        for tmp in temporaries_of(Path(entry["path"]), pid):
            dirfd.unlink(tmp, missing_ok=True)
    dirfd.unlink(journal.path, missing_ok=True)
    roots = [Path(r) for r in journal.roots]
    for root in roots:
        dirfd.unlink(journal_in(root), missing_ok=True)
        dirfd.rmtree(stash_root(root) / journal.run)
        try:
            dirfd.rmdir(stash_root(root))
        except OSError:
            pass
    for entry in journal.entries:
        if entry["op"] == "aside":
            dirfd.rmtree(entry["aside"])
    for root in roots:  # the directories the rolled-back run made for its state, if now empty
        prune(root)


def recover(site_dirs: Sequence[Path], *, force: bool = False, revert_command: str = REVERT_FORCE) -> Recovery | None:
    """Roll back (or finish) a transaction an earlier run left in any of ``site_dirs``. With
    ``force`` (revert --force), a journal that cannot be rolled back is dropped: the revert
    that follows restores the release's bytes of every file anyway."""
    for site_dir in sorted(set(site_dirs)):
        path = journal_at(site_dir)
        try:
            journal = read_journal(path, revert_command=revert_command)
        except TransactionError:
            if not force:
                raise
            dirfd.unlink(path, missing_ok=True)
            return Recovery("unknown", (), finished=False)
        if journal is None:
            continue
        finished = all(_at_after(entry) for entry in journal.entries)
        try:
            restored = rollback(path, revert_command=revert_command)
        except TransactionError:
            if not force:
                raise
            _drop_journals(journal)
            restored = ()
        return Recovery(journal.operation, restored, finished=finished and not restored)
    return None
