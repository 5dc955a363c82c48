"""The ``sm120patch`` command (and ``python -m sm120patch``).

The cyclic garbage collector is paused while sm120patch imports itself and click: the tens
of thousands of objects made then (modules, classes, functions) live until exit, and the
collector's passes over them, during the imports and once more at exit, cost a tenth of
``status`` (docs/benchmarks.md). They are frozen, so no later pass looks at them again; the
command itself runs with the collector on.
"""

import gc
import signal
import sys


def _before_start(signum, frame) -> None:  # noqa: ARG001
    raise KeyboardInterrupt(signum)


def main() -> None:
    # Until the CLI installs its own handlers (signals.py), a signal means nothing was begun.
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _before_start)
    gc.disable()
    try:
        from sm120patch.cli import main as run
    except KeyboardInterrupt as exc:
        signum = exc.args[0] if exc.args else signal.SIGINT
        sys.stderr.write(f"sm120patch: interrupted ({signal.Signals(signum).name}) while starting; nothing was changed\n")
        sys.exit(128 + signum)
    gc.freeze()
    gc.enable()
    run()


if __name__ == "__main__":
    main()
