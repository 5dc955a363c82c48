"""Ctrl-C (SIGINT), SIGTERM (systemd, Ansible, `kill`) and SIGHUP (a closed terminal) end a run
the same way, and what the run then says is what happened:

- before a transaction's commit point the signal is raised as an exception where the run is
  (:class:`Interrupted`, a BaseException as KeyboardInterrupt is); the transaction rolls back,
  and the CLI exits 130 (SIGINT), 143 (SIGTERM) or 129 (SIGHUP);
- while a rollback runs, or from the commit point until the command has finished (its cleanup
  and its report), a signal is only noted: a rollback cut in half, or a commit reported as a
  rollback, would each make the message false. The command then finishes, says that the change
  stands, and exits as it would have. The one exception is ``apply --build``'s build
  (:func:`interruptible`): a signal ends it (jitbuild ends the build's whole process group and
  removes the entry it had started), and the report says the patch stands.

Only the CLI installs the handlers (:func:`handled`); used as a library, sm120patch leaves the
process's signals alone and these functions do nothing.
"""

from __future__ import annotations

import signal
import sys
from contextlib import contextmanager
from typing import Iterator

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(BaseException):
    """SIGINT, SIGTERM or SIGHUP, raised where the run is (one class for the three: click turns a
    KeyboardInterrupt into an Abort, with a blank line on stderr first)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _State:
    installed = False
    finished = False  # the command's outcome is decided (the CLI sets it before it exits)
    holding = 0  # > 0: signals are noted, not raised
    committed: str | None = None  # the operation whose commit point this process passed
    reading = False  # the command changes nothing (status, check-log, ...): an interrupt has nothing to roll back
    noted: list[int] = []  # signals that arrived while holding (not raised)
    late: list[int] = []  # of those, the ones that arrived after a commit point


STATE = _State()


def exit_code(signum: int) -> int:
    return 128 + signum  # the shell's convention: 130 SIGINT, 143 SIGTERM, 129 SIGHUP


def name(signum: int) -> str:
    return signal.Signals(signum).name


def _raise(signum: int) -> None:
    raise Interrupted(signum)


def _handler(signum: int, frame) -> None:  # noqa: ARG001 - the signal module's signature
    if STATE.holding:
        (STATE.late if STATE.committed else STATE.noted).append(signum)
        return
    _raise(signum)


def dropped(unraisable, previous) -> None:
    """``sys.unraisablehook`` while handlers are installed. A handler runs between any two
    bytecodes, also inside a finalizer or a weakref callback (importlib's module locks have one),
    where Python prints the exception and drops it. Such a signal is noted instead, as one that
    arrived while holding: raised at the commit point, or reported by the CLI when the command
    ends (never lost behind an "Exception ignored" traceback)."""
    if isinstance(unraisable.exc_value, Interrupted):
        (STATE.late if STATE.committed else STATE.noted).append(unraisable.exc_value.signum)
        return
    previous(unraisable)


def pending() -> int | None:
    """A signal noted before any commit point and not raised yet (dropped by a finalizer)."""
    return STATE.noted[0] if STATE.noted and not STATE.committed else None


@contextmanager
def handled() -> Iterator[None]:
    """The handlers, for one command (the CLI)."""
    previous = {s: signal.getsignal(s) for s in HANDLED}
    previous_hook = sys.unraisablehook
    STATE.installed, STATE.holding, STATE.committed, STATE.noted, STATE.late = True, 0, None, [], []
    STATE.finished, STATE.reading = False, False
    for s in HANDLED:
        signal.signal(s, _handler)
    sys.unraisablehook = lambda unraisable: dropped(unraisable, previous_hook)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        sys.unraisablehook = previous_hook
        STATE.installed = False


@contextmanager
def held() -> Iterator[None]:
    """A section no signal may cut (a rollback): one that arrives is raised when it ends."""
    if not STATE.installed:
        yield
        return
    STATE.holding += 1
    try:
        yield
    finally:
        STATE.holding -= 1
    if not STATE.holding and STATE.noted and not STATE.committed:
        _raise(STATE.noted.pop(0))


def commit_point(operation: str) -> None:
    """Called just before the commit point: from here the change stands, and signals are only
    noted until the command has finished (but inside :func:`interruptible`)."""
    if STATE.installed and STATE.committed is None:
        if STATE.noted and not STATE.holding:  # one a finalizer dropped: the change must not stand
            _raise(STATE.noted.pop(0))
        STATE.holding += 1
        STATE.committed = operation


@contextmanager
def interruptible() -> Iterator[None]:
    """After the commit point, a section a signal may end (``apply --build``'s build: minutes):
    inside it a signal is raised as :class:`Interrupted` again; from its end on, signals are only
    noted again, so the report that follows is printed whole and the exit code stays the one
    that says the change stands (a signal there is reported as late, never as a rollback)."""
    resumed = STATE.installed and STATE.committed is not None and STATE.holding > 0
    if resumed:
        STATE.holding -= 1
    try:
        yield
    finally:
        if resumed:
            STATE.holding += 1


def late() -> int | None:
    """The first signal that arrived after the commit point, if any."""
    return STATE.late[0] if STATE.late else None
