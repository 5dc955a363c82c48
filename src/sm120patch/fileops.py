"""Writing a user's files: a file is never written in place (new bytes go to a temporary file
beside it, fsynced, given the old file's mode and owner, and renamed over it, each step through
directory descriptors: :mod:`sm120patch.dirfd`); the pre-flight that refuses, before the first
change, what cannot be written; and what a path holds, as the journal records it.

Reading one is :mod:`sm120patch.fileio`, kept apart because :mod:`sm120patch.state` reads with
it and this module needs ``state``'s owners."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Sequence

from sm120patch import dirfd
from sm120patch.errors import TransactionError
from sm120patch.fileio import read_regular
from sm120patch.hashing import sha256
from sm120patch.state import Owner, permission_hint

ASIDE_TAG = ".sm120patch-aside-"  # a JIT entry moved aside: <cached_ops>/.<module>.sm120patch-aside-<run>


def atomic_write(path: Path, data: bytes, *, like: os.stat_result | None = None, owner: Owner | None = None) -> None:
    """Write ``data`` to a new file beside ``path`` (O_EXCL|O_NOFOLLOW, a random name), give it
    ``like``'s mode and owner (else mode 0600 and ``owner``) on its descriptor, fsync it and
    rename it over ``path`` (:func:`sm120patch.dirfd.write_file`: never a call by a path
    another user could swap in between)."""
    try:
        if like is not None:
            dirfd.write_file(path, data, mode=stat.S_IMODE(like.st_mode), owner=(like.st_uid, like.st_gid))
        else:
            dirfd.write_file(path, data, mode=0o600, owner=tuple(owner) if owner is not None else None)
    except OSError as exc:
        # A write or an fsync (ENOSPC, EIO) names no file, a call by descriptor only the temporary
        # name: the error names the file it was for.
        if exc.filename is None or not os.path.isabs(str(exc.filename)):
            exc.filename = str(path)
        raise


# -- what a path holds: the before- and after-states the journal records ----------------------

def describe(path: Path) -> dict:
    """{"type": "missing"} | {"type": "link", "target": ...} | {"type": "file", "sha256": ...}"""
    if path.is_symlink():
        return {"type": "link", "target": os.readlink(path)}
    try:
        return {"type": "file", "sha256": sha256(read_regular(path))}
    except FileNotFoundError:
        return {"type": "missing"}
    except IsADirectoryError:
        return {"type": "directory"}


def aside_path(entry: Path, run: str) -> Path:
    return entry.with_name(f".{entry.name}{ASIDE_TAG}{run}")


def prune(directory: Path) -> None:
    """Remove empty directories under and including ``directory`` (state left after a revert)."""
    if not directory.is_dir() or directory.is_symlink():
        return
    for child in sorted(directory.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if child.is_dir() and not child.is_symlink():
            try:
                dirfd.rmdir(child)
            except OSError:
                pass
    try:
        dirfd.rmdir(directory)
    except OSError:
        pass


def check_writable(paths: Sequence[Path]) -> None:
    """Refuse before the first change when a file or its directory cannot be written (a
    read-only file system, another user's environment)."""
    for path in paths:
        targets = [path.parent] + ([path] if path.exists() and not path.is_symlink() else [])
        for target in targets:
            probe = target
            while not probe.exists():
                probe = probe.parent
            if os.access(probe, os.W_OK):
                continue
            as_root = False
            if os.statvfs(probe).f_flag & os.ST_RDONLY:
                reason, hint = "read-only file system", "remount it read-write, or patch the image it is built from"
            else:
                reason, hint = "permission denied", permission_hint(probe)
                as_root = probe.stat().st_uid != os.geteuid()
            raise TransactionError(f"cannot write {probe}: {reason}; nothing was changed", hint=hint, as_root=as_root)
