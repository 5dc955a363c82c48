"""The one sha256 helper: every hash sm120patch compares is lowercase hex sha256."""

from __future__ import annotations

import hashlib
from pathlib import Path

from sm120patch.fileio import read_regular


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str | None:
    """The hash of the file at ``path`` (following a symlink), or None when there is none."""
    try:
        return sha256(read_regular(path))
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
