"""The ``sm120patch`` command (and ``python -m sm120patch``).

The cyclic garbage collector is paused while sm120patch imports itself and click: the tens
of thousands of objects made then (modules, classes, functions) live until exit, and the
collector's passes over them, during the imports and once more at exit, cost a tenth of
``status`` (docs/benchmarks.md). They are frozen, so no later pass looks at them again; the
command itself runs with the collector on.
"""

try:  # a Ctrl-C this early lands in these imports: one line, as later
    import gc
    import signal
    import sys
except KeyboardInterrupt:
    import os

    os.write(2, b"sm120patch: interrupted (SIGINT) while starting; nothing was changed\n")
    os._exit(130)


def _before_start(signum, frame) -> None:  # noqa: ARG001
    raise KeyboardInterrupt(signum)


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
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _before_start)
    sys.unraisablehook = _dropped
    gc.disable()
    try:
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
        if interrupt is None:
            raise
        if not signals.STATE.finished:  # before the command began (its handlers not yet in place)
            _interrupted(_signum(interrupt))
        sys.stderr.write(f"sm120patch: interrupted ({signal.Signals(_signum(interrupt)).name}) as it exited; "
                         "the command had finished\n")
        sys.exit(128 + _signum(interrupt))


if __name__ == "__main__":
    main()
