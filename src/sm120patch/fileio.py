"""Reading the files of a user's environment: regular files only, and never a wait.

A FIFO, a socket or a device in place of a patched file (or of a ledger, an original, a
journal) would block ``read()`` forever, or never end: every command would hang. The file is
opened without blocking, checked to be a regular file, and only then read."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from sm120patch.errors import RefusedError

KINDS = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
         stat.S_IFBLK: "a block device"}


class NotRegularFile(RefusedError):
    """A path sm120patch reads holds something other than a regular file."""


def read_regular(path: Path) -> bytes:
    """The bytes of the regular file at ``path`` (following a symlink). A directory raises
    IsADirectoryError, a missing path FileNotFoundError, anything else NotRegularFile."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO opens at once, unread
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(21, "Is a directory", str(path))
        if not stat.S_ISREG(mode):
            raise NotRegularFile(f"{path} is {KINDS.get(stat.S_IFMT(mode), 'not a regular file')}, not a regular "
                                 "file; sm120patch reads and writes regular files only", hint="put the release's file "
                                 "back (reinstall the package), then run sm120patch again")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
