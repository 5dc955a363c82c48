"""Where fusion wins, from a measured table: the limits `bench --tune` writes into the profile.

Pure arithmetic on the tuner's rows (one hidden size and dtype, one TP size): each row holds, per
path, the median time of several independent repetitions and its interquartile range. The result
is the pair of limits the servers read (``_tuned_runtime.py``): one-shot for messages of up to A
bytes per rank, two-shot up to B, unfused beyond B (B == 0: never fused).

The rule, in order:

- Two paths tie at a size only when the measurement cannot tell them apart: their interquartile
  ranges overlap *and* their medians are within the noise the repetitions show, the notches of a
  box plot (McGill, Tukey and Larsen, 1978: median +- 1.58 IQR / sqrt(repetitions), about a 95 %
  comparison of two medians). A median twice another's with a long tail reaching it is a loss.
  Each tie is listed in the profile and counts as neither path being faster there.
- A and B are chosen among the measured sizes to make the sum, over every measured size, of each
  size's time relative to its fastest path as small as possible. No single size vetoes fusion:
  a loss at one size (the smallest included) stands only when the wins elsewhere do not outweigh
  it, and the verdict names it. Where choices cost the same, the release's own choice stands:
  fuse rather than not, one-shot rather than two-shot.
- Then each limit is narrowed between the last size where its path wins (or ties) and the first
  measured size above where it loses, by bisection on the token count with the same checks and
  repetitions (``next_probe``: the tuner measures the size it names in the same run, and the rows
  it adds are marked "probe"), until the two sizes are within 10 % of each other: the limit is
  the last winning size, within 10 % of the crossover. Without probes (a table measured before)
  the limit stays on the measured size and the verdict says the crossover was not narrowed down.
- A never exceeds FlashInfer's own one-shot region (``_should_use_oneshot``), so a tuned one-shot
  never needs more lamport workspace than the release's rule already takes; and a batch of no
  more tokens than ranks is always one-shot (FlashInfer's two-shot refuses it, and the server's
  patch sends it one-shot).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from sm120patch.errors import CheckFailedError
from sm120patch.words import counted, size_words

# FlashInfer's `_use_oneshot_heuristics` (flashinfer/comm/trtllm_ar.py, the same from 0.6.4 to
# 0.7.4): one-shot while tokens * hidden * 2 * world * itemsize <= this many MiB. A world size
# without a row has no one-shot region in the release (its rule raises KeyError there).
RELEASE_ONESHOT_MIB = {2: 512, 4: 64, 8: 42}
FUSED_PATHS = ("oneshot", "twoshot")
# Each unfused path the tuner can time: its name in the profile ("unfused") and its columns'
# prefix in the table ("<prefix>_us", "<prefix>_iqr_us"). NCCL's columns are "unfused_*".
UNFUSED_PATHS = {"nccl": "unfused", "sglang-pcie-ipc": "sglang_pcie_ipc", "vllm-pcie-ipc": "vllm_pcie_ipc"}
COLUMNS = dict({path: path for path in FUSED_PATHS}, **UNFUSED_PATHS)
WHAT_WINS = {"nccl": "NCCL allreduce + fused_add_rmsnorm (the server without fusion)",
             "sglang-pcie-ipc": "SGLang's PCIe-IPC allreduce + norm (its switch on, fusion off)",
             "vllm-pcie-ipc": "vLLM's PCIe-IPC allreduce + norm (its switch on, fusion off)"}
# The notch of a box plot (McGill, Tukey and Larsen 1978): the median +- NOTCH * IQR / sqrt(n).
# Two medians whose notches do not overlap differ at roughly the 95 % level.
NOTCH = 1.58
# The tuner's --repeats default: the repetitions behind a recorded row that does not say.
DEFAULT_REPEATS = 7
# A limit is narrowed until the last winning and the first losing size are this close.
WITHIN = 0.10
# Bisection needs about four probes per limit from a doubling of sizes; this bounds a table whose
# crossovers move between probes (noise) from asking forever.
MAX_PROBES = 12


def release_oneshot_max_bytes(world: int) -> int:
    """The largest message per rank (bytes) FlashInfer's own rule sends one-shot at ``world``."""
    return RELEASE_ONESHOT_MIB.get(world, 0) * 2 ** 20 // (2 * world)


@dataclass(frozen=True)
class Timing:
    """One path at one size: the median of the repetitions, the interquartile range, and how
    many repetitions they come from."""

    median: float
    q1: float
    q3: float
    repeats: int = DEFAULT_REPEATS

    @property
    def notch(self) -> float:
        """Half the width of the median's notch: the noise of the median these repetitions show."""
        return NOTCH * (self.q3 - self.q1) / math.sqrt(max(self.repeats, 1))

    def ties(self, other: Timing) -> bool:
        """Neither is faster as far as the repetitions can tell: the interquartile ranges overlap
        and the medians are within each other's notch."""
        spreads = self.q1 <= other.q3 and other.q1 <= self.q3
        return spreads and abs(self.median - other.median) <= self.notch + other.notch


@dataclass(frozen=True)
class Row:
    tokens: int
    bytes: int
    timings: Mapping[str, Timing]  # path (FUSED_PATHS, UNFUSED_PATHS) -> its timing, where measured
    probe: bool = False  # measured by the refinement (next_probe), between two sizes asked for

    @classmethod
    def from_table(cls, row: Mapping, *, repeats: int = DEFAULT_REPEATS) -> Row:
        """A row of the profile's table (a path without its interquartile range: no spread; a row
        without "repeats": ``repeats``)."""
        timings = {}
        n = row.get("repeats", repeats)
        for path, column in COLUMNS.items():
            median = row.get(f"{column}_us")
            if median is not None:
                q1, q3 = row.get(f"{column}_iqr_us") or (median, median)
                timings[path] = Timing(float(median), float(q1), float(q3), int(n))
        return cls(int(row["tokens"]), int(row["bytes"]), timings, bool(row.get("probe")))

    def fastest_unfused(self) -> str | None:
        measured = [p for p in UNFUSED_PATHS if p in self.timings]
        return min(measured, key=lambda p: self.timings[p].median, default=None)

    def outcome(self, path: str | None) -> str:
        """How fused ``path`` does against the fastest unfused path here: "win", "tie", "loss"
        (a path not measured here loses: the server would run something nobody timed)."""
        unfused = self.fastest_unfused()
        if path is None or path not in self.timings or unfused is None:
            return "loss"
        mine, theirs = self.timings[path], self.timings[unfused]
        return "tie" if mine.ties(theirs) else "win" if mine.median < theirs.median else "loss"


@dataclass(frozen=True)
class Bracket:
    """Where a limit's crossover lies: its path wins (or ties) at ``low`` tokens and loses at
    ``high`` (``high`` may be a size above the one-shot ceiling, where one-shot cannot run)."""

    limit: str  # "oneshot" (A) or "fused" (B)
    low: int
    high: int

    @property
    def narrow(self) -> bool:
        """Within WITHIN of each other (or no whole token between them): the limit at ``low``
        is within 10 % of the crossover."""
        return self.high <= self.low * (1 + WITHIN) or self.high - self.low <= 1

    @property
    def probe(self) -> int:
        return (self.low + self.high) // 2


@dataclass(frozen=True)
class Limits:
    oneshot_max_bytes: int
    fused_max_bytes: int
    unfused: str  # the fastest unfused path measured (UNFUSED_PATHS)
    ties: list[dict] = field(default_factory=list)  # {"bytes", "tokens", "paths"}: within noise of the fastest
    verdict: str = ""
    brackets: tuple[Bracket, ...] = ()  # each limit's crossover, where the table has one

    @property
    def never_fused(self) -> bool:
        return self.fused_max_bytes == 0


def derive(rows: Sequence[Row], *, world: int, hidden: int) -> Limits:
    """The limits for one TP size and hidden size from its measured rows (see the module's rule)."""
    rows = sorted(rows, key=lambda r: (r.bytes, r.probe))
    usable = [r for r in rows if r.fastest_unfused() and ("oneshot" in r.timings or "twoshot" in r.timings)]
    base = [r for r in usable if not r.probe]
    if not base:
        raise CheckFailedError("the tuner measured no size with both a fused and an unfused timing: no limits to derive")
    ceiling = release_oneshot_max_bytes(world)
    ties = [tie for r in rows if (tie := _tie(r))]

    def fused_path(row: Row, oneshot_limit: int) -> str | None:
        """What the server runs for ``row`` when it fuses with one-shot up to ``oneshot_limit``."""
        oneshot = row.tokens <= world or row.bytes <= oneshot_limit
        path = "oneshot" if oneshot else "twoshot"
        return path if path in row.timings else None

    # The cost rule, on the sizes asked for (the probes only narrow a limit it chose).
    candidates_b = [0] + [r.bytes for r in base]
    candidates_a = [0] + [r.bytes for r in base if r.bytes <= ceiling]
    best = None
    for b in candidates_b:
        for a in (a for a in candidates_a if a <= b):
            cost = 0.0
            for row in base:
                path = (fused_path(row, a) if row.bytes <= b else row.fastest_unfused())
                if path is None:  # the server would run a path not measured at this size
                    cost = float("inf")
                    break
                cost += _relative(row, path)
            # Equal cost (to rounding): the larger B, then the larger A (the release's choices).
            key = (round(cost, 9), -b, -a)
            if best is None or key < best[0]:
                best = (key, a, b)
    a, b = best[1], best[2]

    brackets = []
    probes = [r for r in usable if r.probe]
    if b:
        # B: between the last fused size and the next size asked for, where the fused path the
        # server would run there (one-shot when A reaches B and the ceiling allows) loses.
        last = next(r for r in base if r.bytes == b)
        above = next((r for r in base if r.bytes > b), None)
        oneshot_to_b = a == b

        def path_b(row: Row) -> str | None:
            return fused_path(row, row.bytes if oneshot_to_b and row.bytes <= ceiling else a)

        if above is not None and above.outcome(path_b(above)) == "loss":
            low, high = _bisected(last, above, probes, lambda r: r.outcome(path_b(r)) != "loss")
            brackets.append(Bracket("fused", low.tokens, high.tokens))
            b = low.bytes
            if oneshot_to_b and path_b(low) == "oneshot":
                a = b
    if 0 < a < b:
        # A: between the last one-shot size and the next one asked for, where two-shot is faster
        # (or one-shot may not run: above the release's ceiling).
        last = next(r for r in base if r.bytes == a)
        above = next((r for r in base if r.bytes > a), None)

        def oneshot_wins(row: Row) -> bool:
            if row.tokens <= world or "twoshot" not in row.timings:
                return "oneshot" in row.timings
            if "oneshot" not in row.timings or row.bytes > ceiling:
                return False
            mine, theirs = row.timings["oneshot"], row.timings["twoshot"]
            return mine.ties(theirs) or mine.median < theirs.median

        if above is not None and not oneshot_wins(above):
            unit = last.bytes // last.tokens
            top = min(above.tokens, ceiling // unit + 1)  # the first size one-shot may not run at
            if top > last.tokens:
                high_row = above if top == above.tokens else Row(top, top * unit, {})
                low, high = _bisected(last, high_row, probes, oneshot_wins)
                brackets.append(Bracket("oneshot", low.tokens, high.tokens))
                a = low.bytes
    unfused = next((r for r in usable if r.bytes > b), usable[-1]).fastest_unfused()
    verdict = _verdict(usable, a, b, unfused, world=world, hidden=hidden,
                       open_brackets=[x for x in brackets if x.limit == "fused" and not x.narrow])
    return Limits(a, b, unfused, ties, verdict, tuple(brackets))


def _bisected(low: Row, high: Row, probes: Sequence[Row], wins: Callable[[Row], bool]) -> tuple[Row, Row]:
    """The bracket ``low`` (wins) .. ``high`` (loses) narrowed by the probes measured inside it,
    in the order bisection asked for them (each halves what is left, so ascending order suffices:
    the crossover is taken to be single inside two neighbouring measured sizes)."""
    for probe in sorted((p for p in probes if low.tokens < p.tokens < high.tokens), key=lambda p: p.tokens):
        if probe.tokens >= high.tokens:
            break
        if wins(probe):
            low = probe
        else:
            high = probe
    return low, high


def next_probe(limits: Limits) -> int | None:
    """The token count the tuner measures next to narrow a limit (the middle of the widest
    bracket left), or None when every limit is within 10 % of its crossover."""
    open_brackets = [b for b in limits.brackets if not b.narrow]
    if not open_brackets:
        return None
    return max(open_brackets, key=lambda b: b.high / b.low).probe


def refine(rows: Sequence[Row], measure: Callable[[int], Row], *, world: int, hidden: int) -> tuple[Limits, list[Row]]:
    """Derive, then measure what ``next_probe`` asks (``measure``: tokens -> its row, with every
    path checked and timed as the table's rows are) until each limit sits within 10 % of its
    crossover. Returns the limits and every row, the probes marked."""
    rows = list(rows)
    limits = derive(rows, world=world, hidden=hidden)
    for _ in range(MAX_PROBES):
        tokens = next_probe(limits)
        if tokens is None:
            break
        measured = measure(tokens)
        rows.append(Row(measured.tokens, measured.bytes, measured.timings, True))
        limits = derive(rows, world=world, hidden=hidden)
    return limits, rows


def _relative(row: Row, path: str) -> float:
    """``path``'s time at ``row`` over the fastest path's: 1 when within the noise of the fastest."""
    fastest = min(row.timings.values(), key=lambda t: t.median)
    timing = row.timings[path]
    return 1.0 if timing.ties(fastest) else timing.median / fastest.median


def _tie(row: Row) -> dict | None:
    fastest = min(row.timings, key=lambda p: row.timings[p].median)
    paths = sorted(p for p in row.timings if row.timings[p].ties(row.timings[fastest]))
    return {"bytes": row.bytes, "tokens": row.tokens, "paths": paths} if len(paths) > 1 else None


def _at(row: Row) -> str:
    return f"{size_words(row.bytes)} ({counted(row.tokens, 'token')})"


def _sizes(rows: Sequence[Row]) -> str:
    words = [_at(r) for r in rows]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _verdict(rows: Sequence[Row], a: int, b: int, unfused: str, *, world: int, hidden: int,
             open_brackets: Sequence[Bracket] = ()) -> str:
    at = f"TP{world}, hidden {hidden}"

    def served(row: Row) -> str | None:
        oneshot = row.tokens <= world or row.bytes <= a
        return "oneshot" if oneshot else "twoshot"

    if b == 0:
        first = rows[0]
        fused = min((first.timings[p].median for p in FUSED_PATHS if p in first.timings))
        path = first.fastest_unfused()
        wins = [r for r in rows if any(r.outcome(p) == "win" for p in FUSED_PATHS if p in r.timings)]
        lead = (f"fusion never wins at {at}" if not wins else
                f"fusion does not pay at {at}: it wins at {_sizes(wins)}, less than it loses elsewhere")
        return (f"{lead}: at {size_words(first.bytes)} per rank ({counted(first.tokens, 'token')}) the unfused path "
                f"takes {first.timings[path].median:.1f} µs and the fused call {fused:.1f} µs; what wins here is "
                f"{WHAT_WINS[unfused]}")
    fused_rows = [r for r in rows if r.bytes <= b]
    last = fused_rows[-1]
    outcomes = {r.tokens: r.outcome(served(r)) for r in fused_rows}
    losses = [r for r in fused_rows if outcomes[r.tokens] == "loss"]
    tied = [r for r in fused_rows if outcomes[r.tokens] == "tie"]
    shots = (f"one-shot up to {size_words(a)}, two-shot above" if 0 < a < b else
             "one-shot throughout" if a == b else
             f"two-shot (one-shot only for batches of at most {counted(world, 'token')})")
    if not losses and len(tied) == len(fused_rows):
        head = (f"fused and unfused tie at {at} at every size up to {size_words(b)} per rank "
                f"({counted(last.tokens, 'token')}), within the noise of the repetitions: fused there, as the "
                f"release does ({shots})")
    else:
        head = f"fusion wins at {at} up to {size_words(b)} per rank ({counted(last.tokens, 'token')}): {shots}"
        if tied:
            head += f"; a tie at {_sizes(tied)} (fused there, as the release does)"
        if losses:
            head += (f"; it loses at {_sizes(losses)}"
                     f" ({', '.join(_loss_words(r, served(r)) for r in losses)}), which its wins elsewhere outweigh")
    beyond = next((r for r in rows if r.bytes > b), None)
    if beyond is None:
        tail = ("; fused was faster at every size measured, so the limit is the largest size measured"
                if not losses and not tied else "; the limit is the largest size measured")
    else:
        tail = f"; from {size_words(beyond.bytes)} ({counted(beyond.tokens, 'token')}) {WHAT_WINS[unfused]} is faster"
        if open_brackets:
            tail += (f" (the crossover lies between {size_words(b)} and {size_words(beyond.bytes)}: not narrowed down "
                     "by the measurement)")
    return head + tail


def _loss_words(row: Row, path: str) -> str:
    unfused = row.timings[row.fastest_unfused()]
    if path not in row.timings:
        return f"{path} not measured at {counted(row.tokens, 'token')}"
    return f"{(row.timings[path].median / unfused.median - 1) * 100:.0f} % slower at {counted(row.tokens, 'token')}"
