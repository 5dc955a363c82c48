"""Running the target's interpreter: as the environment's owner, never as root for them.

Run as root (``sudo sm120patch ...``) on an environment a service user owns, every program of
that environment is that user's code: its ``bin/python`` may be any program, its ``.pth`` files
run at every start, ``sitecustomize`` too. sm120patch runs each of them (the probe, ``verify
--runtime``/``--compile``, ``bench``, the JIT builds) as the owner, with the owner's
``$HOME``/``$USER``/``$LOGNAME`` and no supplementary group of root's (``subprocess``'s
``user=``/``group=``/``extra_groups=[]``), so none of it runs with uid 0.

The interpreter is not run with ``-I`` (or ``-E``): both drop ``PYTHONPATH``, and with it the
``pip install --target`` directories a server reaches that way; ``-I``'s ``-s`` drops the
owner's ``pip --user`` site as well. What makes the owner's code harmless to root is the uid it
runs under, which no flag gives.

Whose environment it is: the owner of the interpreter's path as given (a venv's ``bin/python``
link, not the base interpreter it points to), else of its ``bin/``, else of the prefix above
it, the first that is not root; when all three are root's, nothing changes.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import NamedTuple

from sm120patch.state import Owner

TOKEN_VARIABLE = "SM120PATCH_PROCESS_TOKEN"  # every process a run starts carries it: found and ended by it


class RunAs(NamedTuple):
    """The user the target's processes run as (None: this process's own)."""

    owner: Owner | None
    home: str | None  # the owner's home from the passwd database (None: it has no entry)
    name: str | None

    def popen_args(self) -> dict:
        """``user``/``group``/``extra_groups`` for subprocess (empty: run as this process)."""
        if self.owner is None:
            return {}
        return {"user": self.owner.uid, "group": self.owner.gid, "extra_groups": []}

    def environ(self, env: dict | None = None) -> dict:
        """``env`` (default: this process's) as the owner's process sees it: their home and name.
        Without a passwd entry there is no home to give: HOME is removed rather than left as
        root's (the caller says so where it matters: the JIT cache base)."""
        env = dict(os.environ if env is None else env)
        if self.owner is None:
            return env
        if self.home:
            env["HOME"] = self.home
        else:
            env.pop("HOME", None)
        for key in ("USER", "LOGNAME"):
            if self.name:
                env[key] = self.name
            else:
                env.pop(key, None)
        env.pop("SUDO_COMMAND", None)
        return env

    def give(self, path: Path) -> None:
        """A directory sm120patch made for the process (a temporary workspace, 0700): theirs."""
        if self.owner is not None:
            os.chown(path, self.owner.uid, self.owner.gid, follow_symlinks=False)


ME = RunAs(None, None, None)


def environment_owner(executable: str | os.PathLike) -> RunAs:
    """As root: the user whose environment ``executable`` belongs to (the module docstring
    says how it is found); otherwise, or when it is root's, this process's own."""
    if os.geteuid() != 0:
        return ME
    path = Path(os.path.abspath(executable))
    for place in (path, path.parent, path.parent.parent):
        try:
            info = os.lstat(place)
        except OSError:
            continue
        if info.st_uid != 0:
            return for_uid(info.st_uid, info.st_gid)
    return ME


def for_uid(uid: int, gid: int) -> RunAs:
    import pwd

    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return RunAs(Owner(uid, gid), None, None)
    return RunAs(Owner(uid, entry.pw_gid if gid is None else gid), entry.pw_dir or None, entry.pw_name)


def token() -> str:
    return os.urandom(8).hex()


def popen(argv: list[str], run_as: RunAs, *, env: dict | None = None, **kwargs) -> subprocess.Popen:
    """``argv`` started as ``run_as``, in a session of its own (ended whole by :func:`end`), its
    environment marked with a token that its descendants inherit (found by :func:`end` even
    when they left its session: ``setsid``)."""
    env = run_as.environ(env)
    env[TOKEN_VARIABLE] = token()
    kwargs.setdefault("cwd", "/")  # keep the caller's working directory off the target's sys.path
    proc = subprocess.Popen(argv, env=env, start_new_session=True, **run_as.popen_args(), **kwargs)
    proc._sm120patch_token = env[TOKEN_VARIABLE]  # type: ignore[attr-defined]
    return proc


def end(proc: subprocess.Popen) -> None:
    """Kill ``proc``, its session and every process that carries its token (a child that left
    the session with ``setsid``, a background job of a wrapper script); wait for ``proc``."""
    mark = _token_of(proc)
    for _ in range(3):  # what a dying process started meanwhile is found by the next round
        others = (_carrying(mark) if mark else set()) - {proc.pid}
        for pid in {proc.pid} | others:
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, signal.SIGKILL)
                except OSError:  # gone already, not a group leader, or not ours to signal
                    pass
        if not others:  # (one look at /proc, 1-2 ms, where nothing was left: the usual case)
            break
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _token_of(proc: subprocess.Popen) -> str | None:
    return getattr(proc, "_sm120patch_token", None)


def _carrying(mark: str) -> set[int]:
    """The processes whose environment holds ``TOKEN_VARIABLE=mark``."""
    needle = f"{TOKEN_VARIABLE}={mark}".encode()
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if needle in handle.read().split(b"\0"):
                    found.add(int(entry))
        except OSError:
            continue
    found.discard(os.getpid())
    return found
