"""Changing a path that another user may be able to change at the same moment.

Root runs sm120patch on a service user's environment: every directory below the environment's
root is that user's, who can rename, replace or symlink any entry in it while sm120patch works.
A path is a name looked up anew at every call, so a chmod, a chown or an open by path acts on
whatever that user put there a microsecond earlier (``/etc/shadow`` behind a symlink). Here no
call names a path another user can swap:

- the directory a change happens in is opened from ``/`` down, one component at a time, with
  ``O_NOFOLLOW|O_DIRECTORY`` (:func:`open_dir`); as root, a symbolic link on the way is
  followed only where no one but root can have put it there (a directory owned by root, not
  writable by a group or by others, or sticky and the link root's); in a directory another
  user can change, a link is refused (:class:`UnsafePathError`), never followed (a process of
  another user follows every link: it leads that process only where its user can write);
- everything below is relative to that descriptor: a new file is created with
  ``O_CREAT|O_EXCL|O_NOFOLLOW`` under a random name, given its mode and owner on the
  descriptor (``fchown``/``fchmod``) and fsynced before it is renamed over the old name
  (``rename`` with ``src_dir_fd``/``dst_dir_fd``); links, unlinks, renames, mkdirs, removals of
  trees and lock files alike.

So the worst another user can do is change what sm120patch finds in the directories it already
owns; the read-back before the commit point then sees it and the run is rolled back.
"""

from __future__ import annotations

import errno
import itertools
import os
import stat
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Callable, Iterator

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_LINKS = 40  # as the kernel's own path walk (ELOOP past it)
TEMPORARY_MARK = ".sm120patch-"  # .<name>.sm120patch-<pid>-<random>.<suffix>


class UnsafePathError(OSError):
    """A path whose lookup another user could redirect: a symbolic link in a directory that
    user can change. An OSError (ELOOP), so that every caller reports it as it reports a
    failed write: one line, with the path."""

    def __init__(self, path: str, link: str, owner: int):
        super().__init__(errno.ELOOP, f"{link} is a symbolic link in a directory uid {owner} can change: "
                                      "not followed, another user could point it anywhere", path)


def others_can_change(info: os.stat_result) -> bool:
    """Whether a user other than root and this process's own can add, rename or replace
    entries of the directory ``info`` describes (a sticky directory: only their own entries)."""
    if info.st_uid not in (0, os.geteuid()):
        return True
    if info.st_mode & stat.S_ISVTX:
        return False  # each entry is then judged by its own owner (may_follow)
    if info.st_mode & stat.S_IWOTH:
        return True
    return bool(info.st_mode & stat.S_IWGRP) and info.st_gid not in (0, os.getegid())


def _may_follow(directory: os.stat_result, link: os.stat_result) -> bool:
    if os.geteuid() != 0:  # a link can lead a user's process only where that user can write anyway
        return True
    if others_can_change(directory):
        return False
    return not directory.st_mode & stat.S_ISVTX or link.st_uid in (0, os.geteuid())


def open_dir(path: str | os.PathLike) -> int:
    """A descriptor (``O_DIRECTORY``) of the directory ``path``, looked up from ``/`` one
    component at a time without following a link another user could have planted. The caller
    closes it."""
    wanted = os.path.abspath(os.fspath(path))
    todo = wanted.split(os.sep)[1:]
    fd, here, links = os.open("/", DIR_FLAGS), "/", 0
    try:
        while todo:
            name = todo.pop(0)
            if name in ("", "."):
                continue
            try:
                following = os.open(name, DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    exc.filename = exc.filename or os.path.join(here, name)
                    raise
                try:
                    target = os.readlink(name, dir_fd=fd)
                except OSError:  # not a link: a file where a directory was expected
                    raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), os.path.join(here, name)) from None
                directory = os.fstat(fd)
                if not _may_follow(directory, os.stat(name, dir_fd=fd, follow_symlinks=False)):
                    raise UnsafePathError(wanted, os.path.join(here, name), directory.st_uid) from None
                links += 1
                if links > MAX_LINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), wanted) from None
                # The walk so far holds no link, so ".." in the target is resolved by its text.
                resolved = os.path.normpath(os.path.join(here, target))
                todo = resolved.split(os.sep)[1:] + todo
                os.close(fd)
                fd, here = os.open("/", DIR_FLAGS), "/"
                continue
            os.close(fd)
            fd, here = following, os.path.join(here, name)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextmanager
def parent(path: str | os.PathLike) -> Iterator[tuple[int, str]]:
    """(descriptor of ``path``'s directory, ``path``'s name in it)."""
    path = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(path)
    fd = open_dir(directory)
    try:
        yield fd, os.path.basename(path)
    except OSError as exc:  # a call by a name in the directory: the error names the whole path
        if isinstance(exc.filename, str) and not os.path.isabs(exc.filename):
            exc.filename = os.path.join(directory, exc.filename)
        raise
    finally:
        os.close(fd)


def temporary_name(name: str, suffix: str = "tmp") -> str:
    """A new file's name beside ``name`` until it is renamed over it: this process's id (the
    journal records it: a next run removes what a killed one left) and a random part (nobody
    can create it first)."""
    return f".{name}{TEMPORARY_MARK}{os.getpid()}-{unique()}.{suffix}"


_MADE = itertools.count()


def unique() -> str:
    """8 hex digits: random; a count where ``SM120PATCH_RUN_ID`` fixes the run's id (the
    fault-injection tests aim at paths known before the run; that variable is the caller's own,
    no other user sets it for root)."""
    given = os.environ.get("SM120PATCH_RUN_ID", "")
    if len(given) == 12 and all(c in "0123456789abcdef" for c in given):
        return f"{next(_MADE):08x}"
    return os.urandom(4).hex()


def lstat(path: str | os.PathLike) -> os.stat_result:
    """The entry itself (a link is not followed), found through its directory's descriptor."""
    with parent(path) as (fd, name):
        return os.stat(name, dir_fd=fd, follow_symlinks=False)


def write_file(path: str | os.PathLike, data: bytes, *, mode: int, owner: tuple[int, int] | None = None,
               committing: Callable[[], AbstractContextManager] | None = None) -> None:
    """``path`` holds ``data``, atomically: a new file (O_EXCL|O_NOFOLLOW, a random name) given
    ``owner`` (as root) and ``mode`` on its descriptor, fsynced, renamed over ``path``
    (inside ``committing()``, where the rename is a caller's commit point)."""
    with parent(path) as (dfd, name):
        tmp = temporary_name(name)
        try:  # from the moment the file exists: an exception (a signal too) takes it away again
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                _own(fd, mode, owner)
                os.fsync(fd)
            finally:
                os.close(fd)
            with committing() if committing is not None else nullcontext():
                os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            _unlink_quietly(tmp, dfd)
            raise
        os.fsync(dfd)


def _own(fd: int, mode: int, owner: tuple[int, int] | None) -> None:
    # Owner first: a chown clears the set-id bits a chmod would have set. Never a set-id bit on
    # a file root writes for another user.
    if owner is not None and os.geteuid() == 0 and tuple(owner) != (os.geteuid(), os.getegid()):
        os.fchown(fd, owner[0], owner[1])
    os.fchmod(fd, mode & 0o1777 & ~(stat.S_ISUID | stat.S_ISGID))


def _unlink_quietly(name: str, dfd: int) -> None:
    try:
        os.unlink(name, dir_fd=dfd)
    except OSError:
        pass


def symlink(path: str | os.PathLike, target: str) -> None:
    """``path`` becomes a symbolic link to ``target``, atomically (a new link renamed over it)."""
    with parent(path) as (dfd, name):
        tmp = temporary_name(name, "link")
        try:
            os.symlink(target, tmp, dir_fd=dfd)
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            _unlink_quietly(tmp, dfd)
            raise
        os.fsync(dfd)


def link(source: str | os.PathLike, path: str | os.PathLike) -> None:
    """A hard link at ``path`` to the entry ``source`` itself (a link is linked, not followed)."""
    with parent(source) as (sfd, sname), parent(path) as (dfd, name):
        os.link(sname, name, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
        os.fsync(dfd)


def place(source: str | os.PathLike, path: str | os.PathLike) -> None:
    """``path`` gets the entry at ``source`` atomically: a hard link under a temporary name
    renamed over it (no new space), else (another file system) a copy made as write_file makes
    one, with the source's mode and owner."""
    with parent(source) as (sfd, sname), parent(path) as (dfd, name):
        tmp = temporary_name(name)
        try:
            try:
                os.link(sname, tmp, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                    raise
                _copy(sfd, sname, dfd, tmp)
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            _unlink_quietly(tmp, dfd)
            raise
        os.fsync(dfd)


def copy(source: str | os.PathLike, path: str | os.PathLike) -> None:
    """A new entry at ``path`` (which must not exist) holding what ``source`` holds: a link's
    target, or a regular file's bytes with its mode and owner."""
    with parent(source) as (sfd, sname), parent(path) as (dfd, name):
        _copy(sfd, sname, dfd, name)
        os.fsync(dfd)


def _copy(sfd: int, sname: str, dfd: int, name: str) -> None:
    info = os.stat(sname, dir_fd=sfd, follow_symlinks=False)
    if stat.S_ISLNK(info.st_mode):
        os.symlink(os.readlink(sname, dir_fd=sfd), name, dir_fd=dfd)
        return
    src = os.open(sname, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=sfd)
    try:
        info = os.fstat(src)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", sname)
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        try:
            while chunk := os.read(src, 1 << 20):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
            _own(fd, stat.S_IMODE(info.st_mode), (info.st_uid, info.st_gid))
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        os.close(src)


def rename(source: str | os.PathLike, path: str | os.PathLike) -> None:
    """Rename the entry ``source`` to ``path`` (replacing what is there), both looked up safely."""
    with parent(source) as (sfd, sname), parent(path) as (dfd, name):
        os.rename(sname, name, src_dir_fd=sfd, dst_dir_fd=dfd)
        os.fsync(dfd)


def unlink(path: str | os.PathLike, *, missing_ok: bool = False) -> None:
    try:
        with parent(path) as (dfd, name):
            os.unlink(name, dir_fd=dfd)
            os.fsync(dfd)
    except FileNotFoundError:
        if not missing_ok:
            raise


def rmdir(path: str | os.PathLike) -> None:
    with parent(path) as (dfd, name):
        os.rmdir(name, dir_fd=dfd)


def rmtree(path: str | os.PathLike) -> None:
    """Remove the tree at ``path``, quietly (shutil walks below it by descriptors too)."""
    import shutil

    try:
        with parent(path) as (dfd, name):
            shutil.rmtree(name, dir_fd=dfd, ignore_errors=True)
    except OSError:
        pass


def mkdir(path: str | os.PathLike, *, mode: int, owner: tuple[int, int] | None = None) -> None:
    """Create the directory ``path`` (FileExistsError when there is one), given ``owner`` (as
    root) and exactly ``mode`` (whatever the umask), on its descriptor."""
    with parent(path) as (dfd, name):
        os.mkdir(name, 0o700, dir_fd=dfd)
        fd = os.open(name, DIR_FLAGS, dir_fd=dfd)
        try:
            _own(fd, mode, owner)
        finally:
            os.close(fd)


def makedirs(path: str | os.PathLike, *, mode: int, owner: tuple[int, int] | None = None) -> list[Path]:
    """``path`` and its missing parents (each as :func:`mkdir` makes it); the ones made,
    outermost first."""
    missing, probe = [], Path(os.path.abspath(os.fspath(path)))
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    made = []
    for directory in reversed(missing):
        try:
            mkdir(directory, mode=mode, owner=owner)
        except FileExistsError:
            continue
        made.append(directory)
    return made


def open_file(path: str | os.PathLike, flags: int, mode: int = 0o600) -> int:
    """``os.open`` of ``path`` through its directory's descriptor, never following a link at
    the end either (a FIFO is opened without blocking)."""
    with parent(path) as (dfd, name):
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dfd)


def fsync_dir(path: str | os.PathLike) -> None:
    fd = open_dir(path)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def listdir(path: str | os.PathLike) -> list[str]:
    fd = open_dir(path)
    try:
        return os.listdir(fd)
    finally:
        os.close(fd)


def exposure(path: str | os.PathLike) -> tuple[Path, str] | None:
    """As root: the outermost directory on the way to ``path`` (``path`` itself included, links
    resolved) whose entries another user can change, and who (a user's name, a group's, "every
    user"); None when there is none, or this process is not root (what it can be made to do
    there, its user can do anyway)."""
    if os.geteuid() != 0:
        return None
    real = Path(os.path.realpath(os.fspath(path)))
    for directory in [*reversed(real.parents), real]:
        try:
            info = os.stat(directory)
        except OSError:
            return None
        if stat.S_ISDIR(info.st_mode) and others_can_change(info):
            return directory, _who(info)
    return None


def _who(info: os.stat_result) -> str:
    import grp
    import pwd

    if info.st_uid not in (0, os.geteuid()):
        try:
            return pwd.getpwuid(info.st_uid).pw_name
        except KeyError:
            return f"uid {info.st_uid}"
    if info.st_mode & stat.S_IWOTH:
        return "every user"
    try:
        return f"group {grp.getgrgid(info.st_gid).gr_name}"
    except KeyError:
        return f"group {info.st_gid}"
