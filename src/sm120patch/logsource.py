"""Where `check-log`'s lines come from: a file read to its end, a file followed like ``tail -F``,
a pipe or FIFO (``<(...)``, ``mkfifo``, standard input), each as decoded text lines, never the
whole source at once.

Every source ends in bounded time and bytes: a pipe is read with ``select`` against the deadline
(``--timeout``: a FIFO without a writer, or a writer that keeps it open, ends there), a line is
cut at :data:`MAX_LINE`, a device that is not a log (``/dev/zero``) is refused before a byte is
read, and a stream that turns out to be binary is refused once :data:`BINARY_PROBE` bytes say so.
"""

from __future__ import annotations

import os
import select
import stat
import sys
import time
from pathlib import Path
from typing import Iterator

from sm120patch.errors import TransactionError, UsageError

CHUNK = 1 << 16
MAX_LINE = 1 << 20  # a longer "line" (a binary blob) is cut into pieces of this size
BINARY_PROBE = 1 << 20  # after this many bytes, mostly NULs, undecodable bytes or cut lines: not a log
TICK = 0.2  # how often a waiting source yields None (the caller checks its clock)


class _Lines:
    """Bytes in, decoded lines out; counts what looks binary and refuses a source that is."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pending = b""
        self.read = self.binary = 0

    def text(self, raw: bytes, cut: bool = False) -> str:
        text = raw.decode("utf-8", errors="replace")
        self.read += len(raw)
        if cut or "\x00" in text or "\ufffd" in text:
            self.binary += len(raw)
            if self.read >= BINARY_PROBE and self.binary * 2 > self.read:
                raise UsageError(f"{self.name} is not a text log: {self.binary >> 10} KiB of the first "
                                 f"{self.read >> 10} KiB are NUL bytes, bytes that are not UTF-8 or lines "
                                 f"longer than {MAX_LINE >> 20} MiB",
                                 hint="give check-log the server's log file, or its journal as text "
                                      "(journalctl -u UNIT -o cat | sm120patch check-log -)")
        return text.rstrip("\r\n")

    def feed(self, data: bytes) -> Iterator[str]:
        self.pending += data
        while (cut := self.pending.find(b"\n")) >= 0:
            line, self.pending = self.pending[:cut + 1], self.pending[cut + 1:]
            yield self.text(line)
        while len(self.pending) >= MAX_LINE:
            line, self.pending = self.pending[:MAX_LINE], self.pending[MAX_LINE:]
            yield self.text(line, cut=True)

    def flush(self) -> Iterator[str]:
        if self.pending:
            line, self.pending = self.pending, b""
            yield self.text(line)


def _stream(handle, name: str) -> Iterator[str]:
    """A regular file read to its end, line by line."""
    lines = _Lines(name)
    with handle:
        while True:
            raw = handle.readline(MAX_LINE)
            if not raw:
                return
            yield lines.text(raw, cut=len(raw) == MAX_LINE and not raw.endswith(b"\n"))


def _pipe(fd: int, name: str, deadline: float | None) -> Iterator[str | None]:
    """A pipe, a FIFO or a terminal, read as it comes: never blocked past ``deadline`` (None
    while nothing comes: an idle tick), ended by its writer closing it."""
    lines = _Lines(name)
    try:
        while True:
            wait = TICK if deadline is None else max(0.0, min(TICK, deadline - time.monotonic()))
            ready, _, _ = select.select([fd], [], [], wait)
            if not ready:
                yield None
                continue
            try:
                data = os.read(fd, CHUNK)
            except BlockingIOError:
                continue
            if not data:
                yield from lines.flush()
                return
            yield from lines.feed(data)
    finally:
        if fd != 0:
            os.close(fd)


class Follower:
    """The lines of a file as they are written, like ``tail -F``: it waits for a file that does
    not exist yet, and starts again from the top when the file is replaced (rotation: another
    inode at the path, after what was left in the old one is read) or truncated (copytruncate).
    Yields None when nothing new came for a while (the caller checks its clock)."""

    def __init__(self, path: Path, poll: float = TICK, until: int | None = None) -> None:
        self.path, self.poll = path, poll
        self.handle = None
        self.inode = None
        # Bytes of the file to read before the first None whatever is appended meanwhile (check-log
        # --new-run: what was there when it started ends exactly there).
        self.until = until

    def _open(self) -> bool:
        try:
            self.handle = open(self.path, "rb")  # noqa: SIM115 - kept open while following
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise TransactionError(f"cannot read {self.path}: {exc.strerror or exc}") from None
        self.inode = os.fstat(self.handle.fileno()).st_ino
        return True

    def __iter__(self) -> Iterator[str | None]:
        lines = _Lines(str(self.path))
        while True:
            if self.handle is None and not self._open():
                yield None
                time.sleep(self.poll)
                continue
            size = CHUNK
            if self.until is not None:
                size = min(CHUNK, self.until - self.handle.tell())
                if size <= 0:
                    self.until = None
                    yield None
                    continue
            data = self.handle.read(size)
            if data:
                yield from lines.feed(data)
                continue
            self.until = None  # shorter than it was (truncated): what was there is read
            # At the end of what is there: replaced, truncated, or just not written yet.
            try:
                now = os.stat(self.path)
            except FileNotFoundError:
                now = None
            position = self.handle.tell()
            if now is not None and now.st_ino != self.inode:
                yield from lines.flush()
                self.handle.close()
                self.handle = None
                continue
            if now is not None and now.st_size < position:
                lines.pending = b""
                self.handle.seek(0)
                continue
            yield None
            time.sleep(self.poll)


def _refuse_device(mode: int, name: str, fd: int | None = None) -> None:
    """A character or block device that is not a terminal never ends (``/dev/zero``,
    ``/dev/urandom``): not a log."""
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        if fd is not None and os.isatty(fd):
            return
        raise UsageError(f"{name} is a device, not a log: check-log reads a file, a pipe, a FIFO or a terminal")


def _stdin(deadline: float | None) -> Iterator[str | None]:
    stdin = sys.stdin
    try:
        fd = stdin.buffer.fileno() if stdin is not None else None
        mode = os.fstat(fd).st_mode if fd is not None else None
    except (AttributeError, OSError, ValueError):
        mode = None
    if mode is None:
        raise UsageError("standard input is closed: there is no log to read from `-`",
                         hint="pipe the log in (journalctl -u UNIT -o cat | sm120patch check-log -) or name the file")
    _refuse_device(mode, "standard input", fd)
    if stat.S_ISREG(mode):
        return _stream(stdin.buffer, "standard input")
    return _pipe(fd, "standard input", deadline)


def open_lines(source: str, *, follow: bool, deadline: float | None, mark_start: bool = False) -> Iterator[str | None]:
    """The decoded lines of ``source`` (a path or ``-``), None for an idle tick of a source that
    can wait (a followed file, a pipe). ``deadline`` bounds the wait of a pipe or FIFO, followed or
    not (--timeout). ``mark_start`` (a followed file): the first None comes once the bytes the file
    held now are read, even if more is written meanwhile."""
    if source == "-":
        return _stdin(deadline)
    path = Path(source)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        if follow:
            return iter(Follower(path))
        raise UsageError(f"no such file: {source}", hint="--follow waits for a log that does not exist yet") from None
    except OSError as exc:
        raise TransactionError(f"cannot read {source}: {exc.strerror or exc}") from None
    mode = info.st_mode
    if stat.S_ISDIR(mode):
        raise UsageError(f"{source} is a directory, not a log file")
    _refuse_device(mode, source)
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        try:  # non-blocking: a FIFO with no writer yet must not hold check-log past its deadline
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            raise TransactionError(f"cannot read {source}: {exc.strerror or exc}") from None
        return _pipe(fd, source, deadline)
    if follow:
        return iter(Follower(path, until=info.st_size if mark_start else None))
    try:
        handle = open(path, "rb")  # noqa: SIM115 - closed when the generator is
    except OSError as exc:
        raise TransactionError(f"cannot read {source}: {exc.strerror or exc}") from None
    return _stream(handle, source)


__all__ = ["Follower", "MAX_LINE", "open_lines"]
