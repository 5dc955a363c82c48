"""The locks that make two sm120patch runs behave as if one ran after the other: an flock on
each install location it changes (the directory itself: nothing to create, nothing left
behind), on a checkout's ``.git``, on FlashInfer's own build lock of a JIT module. Each waits a
bounded time (``SM120PATCH_LOCK_WAIT`` seconds, 10 unless set) and says once that it waits."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

from sm120patch import dirfd
from sm120patch.errors import TransactionError, UsageError
from sm120patch.state import Owner, missing_parents

LOCK_TIMEOUT_S = 10.0
LOCK_WAIT_VARIABLE = "SM120PATCH_LOCK_WAIT"


def lock_wait() -> float:
    """How long a run waits for another one: ``SM120PATCH_LOCK_WAIT`` seconds where it is set
    (an Ansible play or a CI job that starts several runs on one environment may want longer
    than a person at a terminal), else LOCK_TIMEOUT_S."""
    raw = os.environ.get(LOCK_WAIT_VARIABLE, "").strip()
    if not raw:
        return LOCK_TIMEOUT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise UsageError(f"{LOCK_WAIT_VARIABLE}={raw!r} is not a number of seconds (0 or more)",
                         hint=f"unset {LOCK_WAIT_VARIABLE} for the default of {LOCK_TIMEOUT_S:.0f} s")
    return seconds


@contextmanager
def flock(path: Path, *, what: str, timeout: float | None, on_wait: Callable[[str], None] | None,
          busy: str, hint: str, create: bool = False, owner: Owner | None = None) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` (a directory, or a lock file created when
    ``create``); say once that it waits, give up after ``timeout`` seconds (None: lock_wait()).

    A lock file this call created, and the directories it made for it, are removed again when
    the work under the lock fails or is interrupted (a rolled-back run changed nothing, in the
    JIT cache either), while the lock is still held; a run that succeeded leaves the file, as
    FlashInfer itself would."""
    if timeout is None:
        timeout = lock_wait()
    made: list[Path] = []
    try:
        fd = None
        # Every step by descriptor (sm120patch.dirfd): the lock file and its directories sit in
        # a service user's cache, where that user can swap any name for a link meanwhile.
        if create and not path.exists():
            made = _make_dirs(path.parent, owner)
            try:  # O_EXCL: a file another process creates meanwhile is theirs, never removed here
                fd = dirfd.open_file(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                made.append(path)
            except FileExistsError:
                pass
            if fd is not None and owner is not None and os.geteuid() == 0 and owner.uid != 0:
                os.fchown(fd, owner.uid, owner.gid)
        if fd is None:  # an flock needs no write access: a lock file another user made works as well
            fd = _open_existing(path)
    except OSError as exc:
        _remove_made(made)
        raise TransactionError(f"cannot lock {what} {path}: {exc.strerror}; nothing was changed") from None
    try:
        _take(fd, fcntl.LOCK_EX, timeout, on_wait, f"waiting: {busy} ...", 0.1,
              lambda: TransactionError(f"{busy}; gave up after {timeout:g} s; nothing was changed", hint=hint))
    except BaseException:
        os.close(fd)
        raise
    try:
        yield
    except BaseException:
        _remove_made(made)  # (still held: no one else took it in between)
        raise
    finally:
        os.close(fd)  # closing releases the lock


def _take(fd: int, operation: int, timeout: float, on_wait: Callable[[str], None] | None, waiting: str,
          pause: float, gave_up: Callable[[], BaseException]) -> None:
    """flock ``fd`` (``operation``: LOCK_EX or LOCK_SH) within ``timeout`` seconds, trying every
    ``pause``; ``waiting`` is said once through ``on_wait`` while it waits; past the timeout
    ``gave_up()`` is raised."""
    deadline, told = time.monotonic() + timeout, False
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
        if time.monotonic() >= deadline:
            raise gave_up()
        if on_wait and not told:
            on_wait(waiting)
            told = True
        time.sleep(pause)


def _open_existing(path: Path) -> int:
    """A descriptor to flock of the directory or regular file at ``path``: a link at its end is
    not followed (it could lead anywhere), nor is a FIFO waited on."""
    try:
        return dirfd.open_dir(path)
    except NotADirectoryError:
        pass
    fd = dirfd.open_file(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return fd


def _remove_made(made: list[Path]) -> None:
    """What ``flock`` created (a lock file, then its directories, deepest first), as far as
    nothing else has been put there since."""
    for path in reversed(made):
        try:
            try:
                dirfd.rmdir(path)
            except NotADirectoryError:  # the lock file
                dirfd.unlink(path)
        except OSError:  # someone else's file in it now: it stays, and so do its parents
            return


def _make_dirs(directory: Path, owner: Owner | None) -> list[Path]:
    """``directory`` and its missing parents, each given ``owner``: root creating FlashInfer's
    ``cached_ops/tmp/`` in a service user's cache must leave it that user's, or the user could
    no longer create the lock of any module there (the server would fail to build or load)."""
    umask = os.umask(0o022)
    os.umask(umask)
    made = []
    for path in missing_parents(directory):
        try:  # the mode FlashInfer's own makedirs gives it (0777 less the umask)
            dirfd.mkdir(path, mode=0o777 & ~umask, owner=tuple(owner) if owner is not None else None)
        except FileExistsError:
            continue
        made.append(path)
    return made


def install_locks(site_dirs: Sequence[Path], *, on_wait: Callable[[str], None] | None = None,
                  timeout: float | None = None) -> ExitStack:
    """One sm120patch writer per install location at a time: an flock on the directory itself
    (nothing to create, nothing left behind), taken in path order so two runs never deadlock."""
    stack = ExitStack()
    try:
        for site_dir in sorted(set(site_dirs)):
            stack.enter_context(flock(
                site_dir, what="install location", timeout=timeout, on_wait=on_wait,
                busy=f"another sm120patch is changing {site_dir}",
                hint=f"run again when it has finished ({LOCK_WAIT_VARIABLE}=SECONDS waits longer)"))
    except BaseException:
        stack.close()
        raise
    return stack


def read_locks(site_dirs: Sequence[Path], *, on_wait: Callable[[str], None] | None = None,
               timeout: float | None = None, busy: Callable[[Path], str] | None = None) -> ExitStack:
    """What a reader (status, and every command that reads through it) holds while it reads an
    install location's files and sm120patch's state there: a shared flock on the directory, the
    one a writer (:func:`install_locks`) holds exclusively for its whole run. So a reader sees
    the state before a run or after it, never its middle (a journal, a ledger of files not yet
    written, originals a revert is removing); readers never wait for each other. A run that
    holds it past ``timeout`` (None: lock_wait()) is said as such: a run is in progress
    (``busy``: what that run is, in words, from its journal)."""
    if timeout is None:
        timeout = lock_wait()
    stack = ExitStack()
    try:
        for site_dir in sorted(set(site_dirs)):
            try:
                fd = os.open(site_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:  # not there, or not readable: what reads it next says so
                continue
            stack.callback(os.close, fd)  # closing releases the lock

            def gave_up(site_dir=site_dir) -> TransactionError:
                what = busy(site_dir) if busy else f"another sm120patch is changing {site_dir}"
                return TransactionError(
                    f"a run is in progress: {what}; gave up waiting for it after {timeout:g} s; nothing was read",
                    hint=f"run again when it has finished ({LOCK_WAIT_VARIABLE}=SECONDS waits longer)")

            _take(fd, fcntl.LOCK_SH, timeout, on_wait, f"waiting: another sm120patch is changing {site_dir} ...", 0.05,
                  gave_up)
    except BaseException:
        stack.close()
        raise
    return stack


def someone_holds(path: Path) -> bool:
    """Whether someone holds the flock on ``path`` right now: an sm120patch run changing an
    install location (a status must not call its journal an interrupted run), FlashInfer
    building a module under its lock file (nor its half-built entry an abandoned one)."""
    try:
        fd = _open_existing(path)  # never a wait on a FIFO planted there
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)
