"""The ``sm120patch`` command (and ``python -m sm120patch``).

The cyclic garbage collector is paused while sm120patch imports itself and click: the tens
of thousands of objects made then (modules, classes, functions) live until exit, and the
collector's passes over them, during the imports and once more at exit, cost a tenth of
``status`` (docs/benchmarks.md). They are frozen, so no later pass looks at them again; the
command itself runs with the collector on.
"""

import gc


def main() -> None:
    gc.disable()
    from sm120patch.cli import main as run

    gc.freeze()
    gc.enable()
    run()


if __name__ == "__main__":
    main()
