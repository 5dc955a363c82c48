"""Where `check-log`'s lines come from: a file read to its end, a file followed like ``tail -F``,
a pipe or FIFO (``<(...)``, ``mkfifo``, standard input), each as decoded text lines, never the
whole source at once.

What the bytes are is told by their content, not by a file's name: gzip (a rotated
``server.log.1.gz``, read through; zstd too where this Python can read it), and text. Every source
ends in bounded time and bytes: a pipe is read with ``select`` against the deadline (``--timeout``:
a FIFO without a writer, or a writer that keeps it open, ends there), a line is kept for matching
up to :data:`MAX_LINE` and the rest of it skipped (a request logged whole is megabytes long), a
device that is not a log (``/dev/zero``) is refused before a byte is read, and a source that turns
out to be binary is refused once :data:`BINARY_PROBE` bytes say so, or at its end if it is shorter
(``check-log /bin/ls``).

:class:`Unwrap` then takes off what a container runtime wrapped each line in: docker's json-file
records and the CRI format of ``/var/log/pods`` (``TIME stream P|F text``, the partial records of a
long line joined).
"""

from __future__ import annotations

import gzip
import json
import os
import re
import select
import stat
import sys
import time
import zlib
from pathlib import Path
from typing import Iterator

from sm120patch.errors import TransactionError, UsageError

CHUNK = 1 << 16
MAX_LINE = 1 << 16  # the part of a line that is matched; the rest of a longer one is skipped
BINARY_PROBE = 1 << 20  # after this many bytes, mostly NULs or undecodable bytes: not a log
TICK = 0.2  # how often a waiting source yields None (the caller checks its clock)
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


class _Lines:
    """Bytes in, decoded lines out; counts what looks binary and refuses a source that is."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pending = b""
        self.skipping = False  # inside a line longer than MAX_LINE: its rest is dropped
        self.read = self.binary = 0
        self.judged = False
        self.nul = False  # the last line kept had a NUL in it

    def text(self, raw: bytes) -> str:
        text = raw.decode("utf-8", errors="replace")
        self.read += len(raw)
        # A NUL makes the line binary; else only the bytes that are not UTF-8 count (a log with
        # a few Latin-1 names in it is still a log).
        self.nul = "\x00" in text
        if self.nul:
            self.binary += len(raw)
        elif "\ufffd" in text:
            self.binary += text.count("\ufffd")
        if self.read >= BINARY_PROBE and not self.judged:
            self.judge()
        return text.rstrip("\r\n")

    def skip(self, n: int) -> None:
        """``n`` more bytes of a long line, not kept: read all the same (and binary if its start was),
        so that a source without newlines (a pipe of zeros) is still judged at BINARY_PROBE."""
        self.read += n
        if self.nul:
            self.binary += n
        if self.read >= BINARY_PROBE and not self.judged:
            self.judge()

    def judge(self) -> None:
        """Refuses the source if most of what was read is binary."""
        if self.binary * 2 > self.read:
            raise UsageError(f"{self.name} is not a text log: {_size(self.binary)} of the first "
                             f"{_size(self.read)} are NUL bytes or bytes that are not UTF-8",
                             hint="give check-log the server's log file, or its journal as text "
                                  "(journalctl -u UNIT -o cat | sm120patch check-log -)")
        self.judged = True

    def feed(self, data: bytes) -> Iterator[str]:
        if self.skipping:
            cut = data.find(b"\n")
            if cut < 0:
                self.skip(len(data))
                return
            self.skip(cut + 1)
            self.skipping, data = False, data[cut + 1:]
        self.pending += data
        start = 0
        pending = self.pending
        while (cut := pending.find(b"\n", start)) >= 0:
            if cut - start > MAX_LINE:
                line = self.text(pending[start:start + MAX_LINE])
                self.skip(cut + 1 - start - MAX_LINE)
                yield line
            else:
                yield self.text(pending[start:cut + 1])
            start = cut + 1
        self.pending = pending[start:]
        if len(self.pending) > MAX_LINE:  # a long line still being written: match its start, skip the rest
            line, self.pending, self.skipping = self.pending[:MAX_LINE], b"", True
            yield self.text(line)

    def flush(self) -> Iterator[str]:
        if self.pending:
            line, self.pending = self.pending, b""
            yield self.text(line)
        self.skipping = False

    def end(self) -> None:
        """The whole source is read: a short one is judged on all of it."""
        if not self.judged and self.read:
            self.judge()


def _size(n: int) -> str:
    return f"{n >> 10} KiB" if n >= 1 << 10 else f"{n} bytes"


def _stream(handle, name: str) -> Iterator[str]:
    """A regular file (or a decompressed one) read to its end, line by line."""
    lines = _Lines(name)
    with handle:
        while True:
            try:
                raw = handle.readline(MAX_LINE)
                if len(raw) == MAX_LINE and not raw.endswith(b"\n"):
                    text = lines.text(raw)
                    while rest := handle.readline(CHUNK):  # the rest of a long line: not matched, not kept
                        lines.skip(len(rest))
                        if rest.endswith(b"\n"):
                            break
                    yield text
                    continue
            except EOFError:  # a compressed file cut short (still being written): what it holds is read
                raw = b""
            except UsageError:
                raise  # binary data: said as it is
            except gzip.BadGzipFile as exc:
                raise UsageError(f"{name} is not a readable compressed log: {exc}") from None
            except OSError:
                raise  # the file could not be read (exit 4), as a plain one
            except Exception as exc:  # noqa: BLE001 - each decompressor has its own error (gzip, zlib, zstd)
                raise UsageError(f"{name} is not a readable compressed log: {exc}") from None
            if not raw:
                lines.end()
                return
            yield lines.text(raw)


def _decompressed(handle, name: str):
    """``handle`` (a binary reader that can peek), or a reader of its decompressed bytes where its
    first bytes say it is compressed."""
    magic = handle.peek(4)[:4]
    if magic[:2] == GZIP_MAGIC:
        return gzip.GzipFile(fileobj=handle, mode="rb")
    if magic == ZSTD_MAGIC:
        return _zstd(handle, name)
    return handle


def _zstd(handle, name: str):
    try:  # the standard library's from Python 3.14; else the zstandard package where installed
        from compression import zstd  # type: ignore[import-not-found]
        return zstd.ZstdFile(handle, "rb")
    except ImportError:
        pass
    try:
        import zstandard  # type: ignore[import-not-found]
    except ImportError:
        handle.close()
        raise UsageError(f"{name} is compressed with zstd, which this Python reads from 3.14 on (or with the "
                         "zstandard package installed)",
                         hint=f"zstd -dc {name} | sm120patch check-log -") from None
    import io
    return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(handle, closefd=True))


class _Gunzip:
    """A pipe's bytes through gzip where its first bytes say so (several members, as `cat a.gz
    b.gz` gives, one after the other)."""

    def __init__(self) -> None:
        self.decoder = None
        self.decided = False
        self.head = b""

    def __call__(self, data: bytes) -> bytes:
        if not self.decided:
            self.head += data
            if len(self.head) < 2 and data:  # an empty read is the end: what came is all there is
                return b""
            data, self.head, self.decided = self.head, b"", True
            if data[:2] == GZIP_MAGIC:
                self.decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
        if self.decoder is None:
            return data
        out = []
        while data:
            out.append(self.decoder.decompress(data))
            data = self.decoder.unused_data
            if data or self.decoder.eof:
                self.decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
        return b"".join(out)


def _pipe(fd: int, name: str, deadline: float | None) -> Iterator[str | None]:
    """A pipe, a FIFO or a terminal, read as it comes: never blocked past ``deadline`` (None
    while nothing comes: an idle tick), ended by its writer closing it."""
    lines = _Lines(name)
    gunzip = _Gunzip()
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
            try:
                text = gunzip(data)
            except zlib.error as exc:
                raise UsageError(f"{name} is not a readable gzip stream: {exc}") from None
            if not data:  # the writer closed it
                yield from lines.feed(text)
                yield from lines.flush()
                lines.end()
                return
            yield from lines.feed(text)
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
        return _stream(_decompressed(stdin.buffer, "standard input"), "standard input")
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
    try:
        handle = open(path, "rb")  # noqa: SIM115 - closed when the generator is
        readable = _decompressed(handle, source)
    except OSError as exc:
        raise TransactionError(f"cannot read {source}: {exc.strerror or exc}") from None
    if follow and readable is handle:
        handle.close()
        return iter(Follower(path, until=info.st_size if mark_start else None))
    if mark_start:
        readable.close()
        raise UsageError(f"{source} is compressed (a rotated log): no run of the server can begin in it after "
                         "check-log starts", hint="give --new-run the live log the server writes")
    # A compressed file is a rotated one: it never grows, so --follow reads it to its end.
    return _stream(readable, source)


# The CRI log format (kubelet's /var/log/pods/NS_POD_UID/CONTAINER/N.log, containerd and CRI-O
# write it): an RFC 3339 time, the stream, P for a partial record (a line the runtime cut, at 16 KiB
# in containerd) or F for the last part, then the text.
CRI = re.compile(r"^\d{4}-\d\d-\d\dT[\d:.]+(?:Z|[+-]\d\d:\d\d) (?:stdout|stderr) ([PF]) ")
# Docker's json-file driver: one JSON object a record, the text under "log" (a line the daemon cut
# at 16 KiB has no newline at its end: the next record goes on with it).
DOCKER_JSON = '{"log":"'


class Unwrap:
    """A container runtime's own wrapping of the server's lines taken off, one line at a time:
    :meth:`__call__` answers the server's line, or None while a partial record waits for its rest
    (kept up to :data:`MAX_LINE` characters)."""

    def __init__(self) -> None:
        self.partial: list[str] = []
        self.size = 0

    def _joined(self, text: str, last: bool) -> str | None:
        if not last:
            if self.size < MAX_LINE:
                self.partial.append(text)
                self.size += len(text)
            return None
        if self.partial:
            self.partial.append(text)
            text, self.partial, self.size = "".join(self.partial)[:MAX_LINE], [], 0
        return text

    def __call__(self, text: str) -> str | None:
        first = text[:1]
        if first.isdigit():
            match = CRI.match(text)
            if match is not None:
                return self._joined(text[match.end():], match.group(1) == "F")
        elif first == "{" and text.startswith(DOCKER_JSON):
            try:
                log = json.loads(text)["log"]
            except (ValueError, KeyError, TypeError):
                return text  # cut at MAX_LINE, or not docker's: read as it is
            if isinstance(log, str):
                return self._joined(log.rstrip("\r\n"), log.endswith("\n"))
        return text


__all__ = ["Follower", "MAX_LINE", "Unwrap", "open_lines"]
