"""Where fusion wins, from a measured table: the limits `bench --tune` writes into the profile.

Pure arithmetic on the tuner's rows (one hidden size and dtype, one TP size): each row holds, per
path, the median time of several independent repetitions and its interquartile range. The result
is the pair of limits the servers read (``_tuned_runtime.py``): one-shot for messages of up to A
bytes per rank, two-shot up to B, unfused beyond B (B == 0: never fused).

The rule, in order:

- Two paths whose interquartile ranges overlap are a tie: the measurement cannot tell them apart,
  so neither counts as faster there (each tie is listed in the profile).
- Never fused when an unfused path beats both fused calls at the smallest size measured (the
  decode sizes fusion exists for): fusion then has nothing to win at this TP on this box.
- Otherwise A and B are chosen among the measured sizes to make the sum, over every measured
  size, of each size's time relative to its fastest path as small as possible. A single size
  where the other path wins by a little inside a run of clear wins does not cut the limit short
  (a non-monotone blip); a lasting loss does. Where choices cost the same, the release's own
  choice stands: fuse rather than not, one-shot rather than two-shot.
- A never exceeds FlashInfer's own one-shot region (``_should_use_oneshot``), so a tuned one-shot
  never needs more lamport workspace than the release's rule already takes; and a batch of no
  more tokens than ranks is always one-shot (FlashInfer's two-shot refuses it, and the server's
  patch sends it one-shot).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

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


def release_oneshot_max_bytes(world: int) -> int:
    """The largest message per rank (bytes) FlashInfer's own rule sends one-shot at ``world``."""
    return RELEASE_ONESHOT_MIB.get(world, 0) * 2 ** 20 // (2 * world)


@dataclass(frozen=True)
class Timing:
    """One path at one size: the median of the repetitions and the interquartile range."""

    median: float
    q1: float
    q3: float

    def ties(self, other: Timing) -> bool:
        return self.q1 <= other.q3 and other.q1 <= self.q3


@dataclass(frozen=True)
class Row:
    tokens: int
    bytes: int
    timings: Mapping[str, Timing]  # path (FUSED_PATHS, UNFUSED_PATHS) -> its timing, where measured

    @classmethod
    def from_table(cls, row: Mapping) -> Row:
        """A row of the profile's table (a path without its interquartile range: no spread)."""
        timings = {}
        for path, column in COLUMNS.items():
            median = row.get(f"{column}_us")
            if median is not None:
                q1, q3 = row.get(f"{column}_iqr_us") or (median, median)
                timings[path] = Timing(float(median), float(q1), float(q3))
        return cls(int(row["tokens"]), int(row["bytes"]), timings)

    def fastest_unfused(self) -> str | None:
        measured = [p for p in UNFUSED_PATHS if p in self.timings]
        return min(measured, key=lambda p: self.timings[p].median, default=None)


@dataclass(frozen=True)
class Limits:
    oneshot_max_bytes: int
    fused_max_bytes: int
    unfused: str  # the fastest unfused path measured (UNFUSED_PATHS)
    ties: list[dict] = field(default_factory=list)  # {"bytes", "tokens", "paths"}: within noise of the fastest
    verdict: str = ""

    @property
    def never_fused(self) -> bool:
        return self.fused_max_bytes == 0


def derive(rows: Sequence[Row], *, world: int, hidden: int) -> Limits:
    """The limits for one TP size and hidden size from its measured rows (see the module's rule)."""
    rows = sorted(rows, key=lambda r: r.bytes)
    usable = [r for r in rows if r.fastest_unfused() and ("oneshot" in r.timings or "twoshot" in r.timings)]
    if not usable:
        raise CheckFailedError("the tuner measured no size with both a fused and an unfused timing: no limits to derive")
    ceiling = release_oneshot_max_bytes(world)
    ties = [tie for r in rows if (tie := _tie(r))]

    def fused_path(row: Row, oneshot_limit: int) -> str | None:
        """What the server runs for ``row`` when it fuses with one-shot up to ``oneshot_limit``."""
        oneshot = row.tokens <= world or row.bytes <= oneshot_limit
        path = "oneshot" if oneshot else "twoshot"
        return path if path in row.timings else None

    first = usable[0]
    first_fused = [first.timings[p] for p in FUSED_PATHS if p in first.timings and (p == "twoshot" or first.bytes <= ceiling
                                                                                      or first.tokens <= world)]
    best_unfused = first.timings[first.fastest_unfused()]
    if all(t.median > best_unfused.median and not t.ties(best_unfused) for t in first_fused):
        limits = (0, 0)
    else:
        candidates_b = [0] + [r.bytes for r in usable]
        candidates_a = [0] + [r.bytes for r in usable if r.bytes <= ceiling]
        best = None
        for b in candidates_b:
            for a in (a for a in candidates_a if a <= b):
                cost = 0.0
                for row in usable:
                    path = (fused_path(row, a) if row.bytes <= b else row.fastest_unfused())
                    if path is None:  # the server would run a path not measured at this size
                        cost = float("inf")
                        break
                    cost += _relative(row, path)
                # Equal cost (to rounding): the larger B, then the larger A (the release's choices).
                key = (round(cost, 9), -b, -a)
                if best is None or key < best[0]:
                    best = (key, a, b)
        limits = (best[1], best[2])
    a, b = limits
    # The unfused path the server is left with: the fastest where it stops fusing (at the largest
    # size measured when it fuses throughout).
    unfused = next((r for r in usable if r.bytes > b), usable[-1]).fastest_unfused()
    return Limits(a, b, unfused, ties, _verdict(usable, a, b, unfused, world=world, hidden=hidden))


def _relative(row: Row, path: str) -> float:
    """``path``'s time at ``row`` over the fastest path's: 1 when within the noise of the fastest."""
    fastest = min(row.timings.values(), key=lambda t: t.median)
    timing = row.timings[path]
    return 1.0 if timing.ties(fastest) else timing.median / fastest.median


def _tie(row: Row) -> dict | None:
    fastest = min(row.timings, key=lambda p: row.timings[p].median)
    paths = sorted(p for p in row.timings if row.timings[p].ties(row.timings[fastest]))
    return {"bytes": row.bytes, "tokens": row.tokens, "paths": paths} if len(paths) > 1 else None


def _verdict(rows: Sequence[Row], a: int, b: int, unfused: str, *, world: int, hidden: int) -> str:
    at = f"TP{world}, hidden {hidden}"
    if b == 0:
        first = rows[0]
        fused = min((first.timings[p].median for p in FUSED_PATHS if p in first.timings))
        path = first.fastest_unfused()
        return (f"fusion never wins at {at}: already at {size_words(first.bytes)} per rank "
                f"({counted(first.tokens, 'token')}) the unfused path takes {first.timings[path].median:.1f} µs and the "
                f"fused call {fused:.1f} µs; what wins here is {WHAT_WINS[unfused]}")
    fused_rows = [r for r in rows if r.bytes <= b]
    last = fused_rows[-1]
    shots = (f"one-shot up to {size_words(a)}, two-shot above" if 0 < a < b else
             "one-shot throughout" if a == b else
             f"two-shot (one-shot only for batches of at most {counted(world, 'token')})")
    beyond = next((r for r in rows if r.bytes > b), None)
    if beyond is None:
        tail = "; fused was faster at every size measured, so the limit is the largest size measured"
    else:
        tail = f"; from {size_words(beyond.bytes)} ({counted(beyond.tokens, 'token')}) {WHAT_WINS[unfused]} is faster"
    return (f"fusion wins at {at} up to {size_words(b)} per rank ({counted(last.tokens, 'token')}): "
            f"{shots}{tail}")
