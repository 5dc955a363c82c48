"""The ``sm120patch`` command (and ``python -m sm120patch``).

The cyclic garbage collector is paused while sm120patch imports itself and click: the tens
of thousands of objects made then (modules, classes, functions) live until exit, and the
collector's passes over them, during the imports and once more at exit, cost a tenth of
``status`` (docs/benchmarks.md). They are frozen, so no later pass looks at them again; the
command itself runs with the collector on.

SIGINT, SIGTERM and SIGHUP are blocked from this module's first line until main()'s handlers
are in place: a signal that comes in between waits and is raised where main() catches it, never
in a line no handler covers. This module is imported only to run sm120patch (``python -m``, the
console script, the container's launcher), so its first line is the earliest sm120patch can
act. From then on one signal ends the start-up (one line, 128 + the signal); a second one, and
one that comes after the command has finished (while the exit unwinds, while the interpreter
finalizes), is only noted.

What comes before that line is Python's own start-up (its site import) and, for the console
script, the script's first lines: a Ctrl-C there (the first ~20 ms) is Python's to report
("Fatal Python error: init_import_site", or a KeyboardInterrupt traceback, exit 1, or a silent
end by the signal); no sm120patch code has run, so nothing was changed (README, "Exit codes").
"""

try:  # SIGINT, SIGTERM and SIGHUP wait, blocked, until main() has its handlers in place
    import _signal

    _MASK = _signal.pthread_sigmask(_signal.SIG_BLOCK, (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP))
except KeyboardInterrupt:  # one that came before the first line, raised there
    import os

    os.write(2, b"sm120patch: interrupted (SIGINT) while starting; nothing was changed\n")
    os._exit(130)

import gc
import os
import signal
import sys

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Starting:
    """main()'s handler until the CLI's (signals.handled) take over, and again after they
    give back: the first signal of the start-up is raised (a KeyboardInterrupt, caught by main);
    any later one, and any after the command has finished, is only noted, so that nothing is
    raised where no one catches it (while the exit unwinds, or the interpreter finalizes)."""

    raising = True
    noted: list = []


def _starting(signum, frame) -> None:  # noqa: ARG001
    signals = sys.modules.get("sm120patch.signals")
    if _Starting.raising and not (signals is not None and signals.STATE.finished):
        _Starting.raising = False
        raise KeyboardInterrupt(signum)
    _Starting.noted.append(signum)


_DROPPED: list = []  # signals a finalizer dropped while sm120patch imported itself


def _dropped(unraisable) -> None:
    # A KeyboardInterrupt raised inside a finalizer or a weakref callback is printed and dropped
    # by Python: note it, and end the start-up as interrupted once the import is over.
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        _DROPPED.append(_signum(unraisable.exc_value))
        return
    sys.__unraisablehook__(unraisable)


def _signum(exc: BaseException) -> int:
    if isinstance(getattr(exc, "signum", None), int):  # signals.Interrupted
        return exc.signum
    return exc.args[0] if exc.args and isinstance(exc.args[0], int) else signal.SIGINT


def _interrupt(exc: BaseException | None) -> BaseException | None:
    """The interrupt behind ``exc`` (a KeyboardInterrupt, or the CLI's signals.Interrupted):
    Python wraps one raised in a class's __set_name__ in a RuntimeError, for instance."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt) or type(exc).__name__ == "Interrupted":
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _interrupted(signum: int) -> None:
    sys.stderr.write(f"sm120patch: interrupted ({signal.Signals(signum).name}) while starting; nothing was changed\n")
    sys.exit(128 + signum)


def main() -> None:
    # Until the CLI installs its own handlers (signals.py), a signal means nothing was begun.
    # They are set while the signals are blocked: one that came meanwhile is raised when they
    # are unblocked, inside the try below.
    for signum in HANDLED:
        signal.signal(signum, _starting)
    sys.unraisablehook = _dropped
    gc.disable()
    try:
        # The mask sm120patch started with, less these three: a launcher that started it with
        # them blocked (to cover Python's own start-up) gets a signal that came meanwhile
        # answered here, and every later one too.
        signal.pthread_sigmask(signal.SIG_SETMASK, set(_MASK) - set(HANDLED))
        from sm120patch.cli import main as run
    except BaseException as exc:  # noqa: BLE001 - only an interrupt is ours to explain
        interrupt = _interrupt(exc)
        if interrupt is None:
            raise
        _interrupted(_signum(interrupt))
    if _DROPPED:
        _interrupted(_DROPPED[0])
    gc.freeze()
    gc.enable()
    try:
        run()  # its handlers (signals.handled) take over from these and put them back at the end
    except BaseException as exc:  # noqa: BLE001 - only an interrupt outside those handlers is ours here
        from sm120patch import signals

        interrupt = None if isinstance(exc, SystemExit) else _interrupt(exc)
        if interrupt is None and not isinstance(exc, SystemExit):
            raise
        if interrupt is not None and not signals.STATE.finished:  # before the command began (no handlers yet)
            _interrupted(_signum(interrupt))
        _exit(exc, interrupt, signals.STATE.committed)


def _exit(exc: BaseException, interrupt: BaseException | None, committed: str | None) -> None:
    """The command has finished (``exc``: its SystemExit, or an interrupt as it unwound): end the
    process with the code it decided. From here the three signals stay blocked until the process
    is gone: Python's finalization puts the default handlers back, and a Ctrl-C there would end
    the process by the signal (the shell's 130, "rolled back") with nothing said, whatever the
    command did. A signal that came meanwhile, or that waits blocked now, is answered in one line:
    after a commit point the change stands and the command's own code is kept; otherwise the
    command had only finished, and 128 + the signal says it was interrupted."""
    signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED)
    code = exc.code if isinstance(exc, SystemExit) else 0
    if not (code is None or isinstance(code, int)):
        raise exc  # sys.exit("text"): Python's own way of printing it
    try:  # the report out first: a signal sent on seeing it is then one the check below sees
        sys.stdout.flush()
    except (OSError, ValueError):  # a closed stdout: the CLI kept its exit code for this
        pass
    came = [_signum(interrupt)] if interrupt is not None else []
    came += _Starting.noted + sorted(signal.sigpending() & set(HANDLED))
    if came and committed:
        sys.stderr.write(f"sm120patch: {signal.Signals(came[0]).name} arrived after the {committed} was committed: "
                         "the change stands and its cleanup finished\n")
    elif came:
        sys.stderr.write(f"sm120patch: interrupted ({signal.Signals(came[0]).name}) as it exited; "
                         "the command had finished\n")
        code = 128 + came[0]
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    # Nothing is left to run: no finalization, where a signal could still slip past the mask
    # check above unreported (it stays blocked and goes with the process).
    os._exit(code or 0)


if __name__ == "__main__":
    main()
