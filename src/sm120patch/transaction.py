"""Every write to a user's environment goes through here: one lock per environment, a
journal written before the first change, the before-bytes stashed and checked, each file
replaced atomically, and on any failure (or on the next run, after a kill) a rollback to the
state before the transaction.

The pattern is pip's uninstall stash: ``stash -> replace -> commit | rollback``, with the
journal on disk so that a process killed mid-way is rolled back by the next one.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import stat
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

from sm120patch.errors import TransactionError
from sm120patch.state import AppliedRecord, DistributionState, applied_document, ensure_private_dir, fsync_dir, read_journal

LOCK_TIMEOUT_S = 10.0
JOURNAL_FORMAT = 1


def sha256_file(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


def atomic_write(path: Path, data: bytes, *, like: os.stat_result | None = None) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync it, give it ``like``'s mode
    and owner, ``os.replace`` it over ``path`` and fsync the directory."""
    tmp = path.with_name(f".{path.name}.sm120patch-{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        if like is not None:
            os.chmod(tmp, stat.S_IMODE(like.st_mode))
            if os.geteuid() == 0:
                os.chown(tmp, like.st_uid, like.st_gid)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextmanager
def environment_lock(state_root: Path, *, timeout: float = LOCK_TIMEOUT_S,
                     on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
    """One sm120patch writer per environment: wait up to ``timeout`` seconds, then fail."""
    ensure_private_dir(state_root)
    lock_path = state_root / "lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + timeout
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            if time.monotonic() >= deadline:
                raise TransactionError(
                    f"another sm120patch (pid {holder}) is changing this environment; "
                    f"gave up after {timeout:.0f} s",
                    hint="run again when it has finished",
                )
            if on_wait and not told:
                on_wait(f"waiting for another sm120patch (pid {holder}) to finish ...")
                told = True
            time.sleep(0.1)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def check_writable(paths: Sequence[Path]) -> None:
    """Refuse before the first change when a file or its directory cannot be written (a
    read-only file system, another user's environment)."""
    for path in paths:
        for target in (path, path.parent):
            if os.access(target, os.W_OK):
                continue
            if os.statvfs(target).f_flag & os.ST_RDONLY:
                reason, hint = "read-only file system", "remount it read-write, or patch the image it is built from"
            else:
                reason = "permission denied"
                hint = f"run sm120patch as the user who owns this environment (uid {target.stat().st_uid}), e.g. with sudo"
            raise TransactionError(f"cannot write {target}: {reason}; nothing was changed", hint=hint)


@dataclass(frozen=True)
class FileChange:
    """Replace ``path`` (``relpath`` in its distribution), whose bytes now hash to ``before``,
    by ``data`` (hashing to ``after``)."""

    relpath: str
    path: Path
    before: str
    after: str
    data: bytes


@dataclass(frozen=True)
class Recovery:
    """What the next run found and did after an interrupted transaction."""

    operation: str
    restored: tuple[str, ...]


def _write_json(path: Path, document: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, (json.dumps(document, indent=2, sort_keys=True) + "\n").encode())


class Transaction:
    """Apply ``changes`` to one distribution and record ``new_record`` as what is applied.

    ``originals`` maps a relpath to the release's bytes, to keep (first patch of a file) or
    ``None`` to drop after commit (revert)."""

    def __init__(
        self,
        state: DistributionState,
        *,
        operation: str,
        changes: Sequence[FileChange],
        new_record: AppliedRecord | None,
        keep_originals: dict[str, bytes] | None = None,
        drop_originals: Sequence[str] = (),
    ) -> None:
        self.state = state
        self.operation = operation
        self.changes = list(changes)
        self.new_record = new_record
        self.keep_originals = keep_originals or {}
        self.drop_originals = list(drop_originals)

    def run(self) -> None:
        check_writable([c.path for c in self.changes])
        ensure_private_dir(self.state.root)
        previous = self.state.applied_path.read_bytes() if self.state.applied_path.exists() else None
        _write_json(
            self.state.journal_path,
            {
                "format": JOURNAL_FORMAT,
                "operation": self.operation,
                "pid": os.getpid(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "applied_before": previous.decode() if previous is not None else None,
                "files": [
                    {"relpath": c.relpath, "path": str(c.path), "before": c.before, "after": c.after}
                    for c in self.changes
                ],
            },
        )
        try:
            for change in self.changes:
                current = change.path.read_bytes()
                if hashlib.sha256(current).hexdigest() != change.before:
                    raise TransactionError(f"{change.path} changed while sm120patch was working; nothing was changed")
                stash = self.state.stash(change.relpath)
                stash.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(stash, current)
            for relpath, data in self.keep_originals.items():
                original = self.state.original(relpath)
                original.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(original, data)
            for change in self.changes:
                atomic_write(change.path, change.data, like=change.path.stat())
            if self.new_record is not None and self.new_record.files:
                _write_json(self.state.applied_path, applied_document(self.new_record))
            else:
                self.state.applied_path.unlink(missing_ok=True)
        except BaseException as exc:
            restored = rollback(self.state)
            if isinstance(exc, OSError):
                raise TransactionError(
                    f"{self.operation} failed: {exc.strerror or exc} ({getattr(exc, 'filename', '') or ''}); "
                    f"rolled back {len(restored)} file(s), the environment is as it was"
                ) from exc
            raise
        # Commit point: once the journal is gone, the new state stands.
        self.state.journal_path.unlink()
        fsync_dir(self.state.root)
        shutil.rmtree(self.state.root / "stash", ignore_errors=True)
        for relpath in self.drop_originals:
            original = self.state.original(relpath)
            original.unlink(missing_ok=True)
            _prune_empty_dirs(original.parent, stop=self.state.root)


def _prune_empty_dirs(directory: Path, *, stop: Path) -> None:
    while directory != stop and directory.is_relative_to(stop):
        try:
            directory.rmdir()
        except OSError:  # not empty (or gone): done
            return
        directory = directory.parent


def rollback(state: DistributionState) -> tuple[str, ...]:
    """Undo the journaled transaction: every file back to its stashed before-bytes, the
    applied record as it was; then drop the journal. Returns the relpaths restored."""
    journal = read_journal(state)
    if journal is None:
        return ()
    restored = []
    for entry in journal["files"]:
        path = Path(entry["path"])
        if sha256_file(path) == entry["before"]:
            continue
        stash = state.stash(entry["relpath"])
        data = stash.read_bytes() if stash.exists() else None
        if data is None or hashlib.sha256(data).hexdigest() != entry["before"]:
            raise TransactionError(
                f"cannot roll back {path}: its stashed copy is missing or corrupt",
                hint="reinstall the package with pip (--force-reinstall --no-deps) to restore it",
            )
        atomic_write(path, data, like=path.stat() if path.exists() else None)
        restored.append(entry["relpath"])
    if journal.get("applied_before") is not None:
        atomic_write(state.applied_path, journal["applied_before"].encode())
    else:
        state.applied_path.unlink(missing_ok=True)
    state.journal_path.unlink()
    fsync_dir(state.root)
    shutil.rmtree(state.root / "stash", ignore_errors=True)
    return tuple(restored)


def recover(state: DistributionState) -> Recovery | None:
    """Roll back a transaction a previous run left behind (killed, power loss)."""
    journal = read_journal(state)
    if journal is None:
        return None
    return Recovery(operation=journal["operation"], restored=rollback(state))
