"""Root against a racing service user (issue 61), many tries: `apply`, `revert` and the
tuned-limits profile write run as root in an environment that user ``sm120race`` owns, while a
process of that user swaps temporary files and whole directories for links to root's files
(tests/race.py). A try is lost when any root-owned file outside the environment changed owner,
mode, bytes or listing, or the user's .pth ran as root; the script stops at the first loss.

    sudo .venv/bin/python benchmarks/root_race.py [TRIES] [apply|revert|profile ...] [--files-only]   # default 300 tries of each

Prints, per command, the tries, the outcomes (exit codes / wrote / refused) and the swapper's
count of links it planted; docs/root.md records a run. Run it against an older checkout with
PYTHONPATH=/path/to/old/src to see the user win there.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import race  # noqa: E402

COMMANDS = ("apply", "revert", "profile")


def main() -> int:
    args = [a for a in sys.argv[1:] if a != "--files-only" and a not in COMMANDS]
    commands = [a for a in sys.argv[1:] if a in COMMANDS] or list(COMMANDS)
    check_pth = "--files-only" not in sys.argv  # judge root's files alone (an older sm120patch loses on the .pth first)
    tries = int(args[0]) if args else 300
    race.need_root()
    arena = race.make_arena()
    results = {}
    try:
        for command in commands:
            outcomes: Counter = Counter()
            start = time.monotonic()
            lost = None
            for n in range(tries):
                try:
                    outcomes[race.one_try(arena, command, swap=bool(n % 2), check_pth=check_pth)] += 1
                except AssertionError as exc:
                    lost = f"try {n + 1}: {exc}"
                    break
            results[command] = {"tries": sum(outcomes.values()) + (lost is not None), "outcomes": dict(outcomes),
                                "user_won": lost, "seconds": round(time.monotonic() - start, 1),
                                "links_planted": dict(race.PLANTED[command])}
            print(json.dumps({command: results[command]}), flush=True)
    finally:
        race.cleanup(arena)
    return 1 if any(r["user_won"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
