"""`sm120patch bench --tune` without GPUs: the limits derived from recorded tables (the two-H200
run in docs/two-gpu.md, and PCIe-shaped tables written from the figures issue #52 cites), the
profile it writes (its checks, the merge, the atomic write, the refusals), and the worker's own
arithmetic in a real torch (CPU) environment. No GPU ran any of this; docs/tuning.md says so."""

from __future__ import annotations

import ast
import json
import random
import re
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from helpers import ROOT
from sm120patch.bench.limits import Bracket, Row, derive, next_probe, refine, release_oneshot_max_bytes

HIDDEN = 4096
KIB = 1024


def table(columns: dict[str, list[float | None]], *, tokens=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048),
          spread=(0.98, 1.03), hidden=HIDDEN) -> list[Row]:
    """Rows at hidden ``hidden`` bf16: each column's medians, each with an interquartile range
    of ``spread`` around it (None: not measured at that size)."""
    rows = []
    for index, n in enumerate(tokens):
        row = {"tokens": n, "bytes": n * hidden * 2}
        for column, medians in columns.items():
            if medians[index] is not None:
                row[f"{column}_us"] = medians[index]
                row[f"{column}_iqr_us"] = [medians[index] * spread[0], medians[index] * spread[1]]
        rows.append(Row.from_table(row))
    return rows


# -- FlashInfer's own one-shot region, read from the release --------------------------------

def test_the_one_shot_ceiling_is_the_releases_rule(flashinfer_wheel):
    """_use_oneshot_heuristics in the 0.6.4 wheel, converted to a message size per rank exactly
    as _should_use_oneshot computes it (tokens * hidden * 2 * world * itemsize / 2**20 <= MiB)."""
    source = zipfile.ZipFile(flashinfer_wheel).read("flashinfer/comm/trtllm_ar.py").decode()
    found = re.search(r"_use_oneshot_heuristics: dict\[int, int\] = (\{.*?\})", source, re.S).group(1)
    rule = ast.literal_eval(found)
    assert rule == {2: 512, 4: 64, 8: 42}
    for world, mib in rule.items():
        limit = release_oneshot_max_bytes(world)
        assert limit * 2 * world / 2 ** 20 <= mib < (limit + 1) * 2 * world / 2 ** 20
    assert release_oneshot_max_bytes(4) == 8 * 2 ** 20 and release_oneshot_max_bytes(8) == 2752512
    assert release_oneshot_max_bytes(16) == 0  # no row: the release has no one-shot region there


# -- the two-H200 run (docs/two-gpu.md, section 3) ------------------------------------------

def _two_h200(hidden: int) -> list[Row]:
    """The table as printed in docs/two-gpu.md: one-shot (FlashInfer's choice at TP2) and NCCL +
    norm, medians only (that run recorded no spread)."""
    text = (ROOT / "docs" / "two-gpu.md").read_text()
    block = text[text.index(f"hidden {hidden}, auto"):]
    block = block[:block.index("crossover:")]
    rows = []
    for line in block.splitlines():
        words = line.split()
        if words and words[0].isdigit():
            tokens, fused, unfused = int(words[0]), float(words[-3]), float(words[-2])
            rows.append(Row.from_table({"tokens": tokens, "bytes": tokens * hidden * 2, "oneshot_us": fused,
                                        "unfused_us": unfused}))
    assert len(rows) == 12
    return rows


@pytest.mark.parametrize("hidden", [4096, 7168])
def test_the_two_h200_table_fuses_one_shot_up_to_the_largest_size(hidden):
    """On NVLink one-shot beat NCCL at every size (1.02x to 2.87x): fused and one-shot up to the
    largest size measured (far below TP2's one-shot ceiling of 128 MiB), and the verdict says the
    limit is where the measurement stopped, not a crossover."""
    limits = derive(_two_h200(hidden), world=2, hidden=hidden)
    assert limits.fused_max_bytes == limits.oneshot_max_bytes == 2048 * hidden * 2
    assert limits.unfused == "nccl" and not limits.ties
    assert "fused was faster at every size measured" in limits.verdict and "one-shot throughout" in limits.verdict


def test_the_recorded_one_gpu_table_is_fused_where_its_wins_outweigh_its_loss_at_one_token():
    """The table the tuner measured on the lent H200 with both ranks on GPU 0
    (docs/one-gpu/2026-12-05/tune-tp2.txt, 3 repetitions; time slicing, so no server's figures,
    but a real table): one-shot loses at 1 token (2249 vs 949 us) and wins 5-8x from 16 tokens
    on. The verdict recorded then was "fusion never wins" (the smallest size vetoed it); the cost
    rule fuses throughout and names the loss."""
    text = (ROOT / "docs" / "one-gpu" / "2026-12-05" / "tune-tp2.txt").read_text()
    recorded = json.JSONDecoder().raw_decode(text)[0]["entry"]
    assert recorded["verdict"].startswith("fusion never wins at TP2") and recorded["fused_max_bytes"] == 0
    limits = derive([Row.from_table(row, repeats=3) for row in recorded["table"]], world=2, hidden=HIDDEN)
    assert limits.fused_max_bytes == limits.oneshot_max_bytes == 256 * HIDDEN * 2
    assert limits.verdict == ("fusion wins at TP2, hidden 4096 up to 2 MiB per rank (256 tokens): one-shot throughout; "
                              "it loses at 8 KiB (1 token) (137 % slower at 1 token), which its wins elsewhere "
                              "outweigh; the limit is the largest size measured")


# -- PCIe-shaped tables (the published figures issue #52 cites) -----------------------------

# RTX PRO 6000 x4 on one NUMA node: one-shot 6.1 vs NCCL 13.5 us at the smallest sizes, 95.6 vs
# 85.2 us at 1 MB; one-shot's crossover with NCCL about 120 KB; two-shot (more tokens than ranks
# only) beats one-shot from 128 KB and ties NCCL at 256 KB.
PCIE_X4 = {
    "oneshot": [6.1, 6.6, 7.8, 10.5, 17.5, 30.0, 52.0, 95.6, 190.0, 380.0, 760.0, 1520.0],
    "twoshot": [None, None, None, 12.0, 14.0, 22.0, 44.0, 80.0, 150.0, 290.0, 570.0, 1130.0],
    "unfused": [13.5, 13.8, 14.3, 15.2, 17.0, 22.5, 36.0, 85.2, 120.0, 200.0, 360.0, 700.0],
}


def test_pcie_x4_one_shot_to_64k_two_shot_to_256k_then_nccl():
    limits = derive(table(PCIE_X4), world=4, hidden=HIDDEN)
    assert (limits.oneshot_max_bytes, limits.fused_max_bytes) == (64 * KIB, 256 * KIB)
    assert limits.unfused == "nccl"
    # 256 KiB: two-shot 22.0 and NCCL 22.5 us, within each other's interquartile range: a tie,
    # listed, and settled the release's way (fused).
    assert {"bytes": 256 * KIB, "tokens": 32, "paths": ["nccl", "twoshot"]} in [
        dict(t, paths=sorted(t["paths"])) for t in limits.ties]
    # The tie is said as one, and the crossover, measured only at doubling sizes, is said to lie
    # between them (the tuner narrows it down in the same run: next_probe, below).
    assert limits.verdict == ("fusion wins at TP4, hidden 4096 up to 256 KiB per rank (32 tokens): one-shot up to "
                              "64 KiB, two-shot above; a tie at 256 KiB (32 tokens) (fused there, as the release does); "
                              "from 512 KiB (64 tokens) NCCL allreduce + fused_add_rmsnorm (the server without fusion) "
                              "is faster (the crossover lies between 256 KiB and 512 KiB: not narrowed down by the "
                              "measurement)")


def test_pcie_x8_across_numa_one_shot_to_32k():
    """x8 across NUMA nodes: one-shot's crossover about 48 KB; two-shot (from 16 tokens) never wins."""
    x8 = {"oneshot": [9.0, 10.0, 12.0, 22.0, 40.0, 75.0] + [None] * 6,
          "twoshot": [None] * 4 + [35.0, 60.0, 110.0, 210.0, 400.0, 780.0, 1500.0, 3000.0],
          "unfused": [16.0, 16.5, 17.0, 19.0, 22.0, 30.0, 45.0, 90.0, 130.0, 220.0, 400.0, 760.0]}
    limits = derive(table(x8), world=8, hidden=HIDDEN)
    assert (limits.oneshot_max_bytes, limits.fused_max_bytes) == (32 * KIB, 32 * KIB)
    assert "one-shot throughout; from 64 KiB (8 tokens) NCCL" in limits.verdict


def test_a_loss_at_the_smallest_size_alone_does_not_veto_what_the_cost_rule_fuses():
    """Issue #60 item 7: SGLang's PCIe-IPC allreduce beats both fused calls at 1 token (by 22 %),
    but one-shot wins from 2 tokens on by 25-45 %: the summed time fuses, so fused it is, and the
    verdict names the loss and what wins at that size rather than claiming a win everywhere."""
    columns = dict(PCIE_X4, sglang_pcie_ipc=[5.0, 9.0, 12.0, 16.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1900.0])
    limits = derive(table(columns), world=4, hidden=HIDDEN)
    assert (limits.oneshot_max_bytes, limits.fused_max_bytes) == (64 * KIB, 256 * KIB)
    assert ("; it loses at 8 KiB (1 token) (22 % slower at 1 token), which its wins elsewhere outweigh"
            in limits.verdict)


def test_a_ten_percent_loss_at_one_token_fuses_where_fusion_wins_by_a_third():
    """The shape issue #60 describes: 10 % slower than NCCL at 1 token, 30-45 % faster from 2 to 64
    tokens, slower beyond: fused up to 64 tokens (the old rule never fused)."""
    nccl = [10.0, 10.5, 11.0, 12.0, 14.0, 18.0, 26.0, 42.0, 74.0, 140.0, 270.0, 530.0]
    oneshot = [11.0, 6.0, 6.2, 6.8, 8.0, 10.5, 17.0, 60.0, 120.0, 240.0, 480.0, 960.0]
    twoshot = [None, None, None, 9.0, 10.0, 12.6, 18.2, 50.0, 100.0, 200.0, 400.0, 800.0]
    limits = derive(table({"oneshot": oneshot, "twoshot": twoshot, "unfused": nccl}), world=4, hidden=HIDDEN)
    assert limits.fused_max_bytes == 64 * HIDDEN * 2 and limits.oneshot_max_bytes == 64 * HIDDEN * 2
    assert limits.verdict.startswith("fusion wins at TP4, hidden 4096 up to 512 KiB per rank (64 tokens): one-shot "
                                     "throughout; it loses at 8 KiB (1 token) (10 % slower at 1 token)")


def test_a_median_twice_nccls_is_a_loss_though_the_spreads_overlap():
    """Issue #60 item 7: NCCL's repetitions have a long upper tail that reaches the fused path's
    (the interquartile ranges overlap up to 16 tokens), but the fused median is twice NCCL's: the
    seven repetitions tell them apart (the medians' notches do not overlap), so it is a loss, never
    a tie, and nothing is fused (it was fused to 128 KiB when overlapping spreads alone made a tie)."""
    tokens = (1, 2, 4, 8, 16, 32, 64, 128)
    rows = []
    for n in tokens:
        nccl = 10.0 + n * 0.1
        fused = 2 * nccl
        nccl_q3 = fused * 0.96 if n <= 16 else nccl * 1.05  # the tail reaches the fused path's quartile
        row = {"tokens": n, "bytes": n * HIDDEN * 2, "repeats": 7,
               "unfused_us": nccl, "unfused_iqr_us": [nccl * 0.97, nccl_q3],
               "oneshot_us": fused, "oneshot_iqr_us": [fused * 0.95, fused * 1.03]}
        if n > 4:
            row.update(twoshot_us=fused * 1.1, twoshot_iqr_us=[fused * 1.05, fused * 1.15])
        rows.append(Row.from_table(row))
    first = rows[0].timings
    assert first["oneshot"].q1 <= first["nccl"].q3 and first["oneshot"].median == 2 * first["nccl"].median
    assert not first["oneshot"].ties(first["nccl"])
    limits = derive(rows, world=4, hidden=HIDDEN)
    assert limits.never_fused and limits.ties == []
    assert limits.verdict.startswith("fusion never wins at TP4, hidden 4096: at 8 KiB per rank (1 token) the unfused "
                                     "path takes 10.1 µs and the fused call 20.2 µs")
    # The same medians with fewer repetitions: the notches widen and the noise can no longer tell.
    few = [Row(r.tokens, r.bytes, {k: replace(v, repeats=2) for k, v in r.timings.items()}) for r in rows]
    assert few[0].timings["oneshot"].ties(few[0].timings["nccl"])


def test_unfused_faster_at_most_sizes_is_never_fused_and_says_what_wins():
    """SGLang's PCIe-IPC allreduce beats both fused calls everywhere but at 2 tokens: never
    fused; the verdict says fusion does not pay, where it won, and names the path that wins."""
    columns = dict(PCIE_X4, sglang_pcie_ipc=[5.0, 7.0, 7.0, 9.0, 11.0, 16.0, 30.0, 60.0, 100.0, 180.0, 340.0, 650.0])
    limits = derive(table(columns), world=4, hidden=HIDDEN)
    assert (limits.oneshot_max_bytes, limits.fused_max_bytes) == (0, 0) and limits.never_fused
    assert limits.unfused == "sglang-pcie-ipc"
    assert limits.verdict.startswith("fusion does not pay at TP4, hidden 4096: it wins at 16 KiB (2 tokens), less than "
                                     "it loses elsewhere: at 8 KiB per rank (1 token) the unfused path takes 5.0 µs and "
                                     "the fused call 6.1 µs")
    assert "SGLang's PCIe-IPC allreduce + norm (its switch on, fusion off)" in limits.verdict


def test_a_pcie_ipc_path_absent_above_its_workspace_is_absent_there_not_free():
    """SGLang's PCIe-IPC allreduce measured up to its workspace (512 tokens) and not run above it
    (the server sends those to NCCL): it wins from 16 tokens, so fusion stops at 8 and the verdict
    names it; above 512 tokens NCCL is what the server runs, and the derivation neither counts the
    missing column as 0 us nor makes it the unfused path there."""
    pcie = [9.0, 9.5, 10.0, 11.0, 12.0, 15.0, 25.0, 50.0, 90.0, 160.0, None, None]
    limits = derive(table(dict(PCIE_X4, sglang_pcie_ipc=pcie)), world=4, hidden=HIDDEN)
    assert (limits.oneshot_max_bytes, limits.fused_max_bytes) == (64 * KIB, 64 * KIB)
    assert limits.unfused == "sglang-pcie-ipc"
    assert limits.verdict == ("fusion wins at TP4, hidden 4096 up to 64 KiB per rank (8 tokens): one-shot throughout; "
                              "a tie at 64 KiB (8 tokens) (fused there, as the release does); from 128 KiB (16 tokens) "
                              "SGLang's PCIe-IPC allreduce + norm (its switch on, fusion off) is faster (the crossover "
                              "lies between 64 KiB and 128 KiB: not narrowed down by the measurement)")
    rows = table(dict(PCIE_X4, sglang_pcie_ipc=pcie))
    assert [r.fastest_unfused() for r in rows[-3:]] == ["sglang-pcie-ipc", "nccl", "nccl"]
    # Where it is measured only above the fused limit, it cannot pull the limit down.
    late = [None] * 10 + [300.0, 600.0]
    assert derive(table(dict(PCIE_X4, sglang_pcie_ipc=late)), world=4, hidden=HIDDEN).fused_max_bytes == 256 * KIB


def test_a_tie_at_the_smallest_size_is_not_a_loss():
    """Within noise at the smallest size: the release's choice (fuse) stands there."""
    columns = {"oneshot": [13.6] + PCIE_X4["oneshot"][1:], "twoshot": PCIE_X4["twoshot"], "unfused": PCIE_X4["unfused"]}
    limits = derive(table(columns), world=4, hidden=HIDDEN)
    assert limits.fused_max_bytes == 256 * KIB
    assert {"bytes": 8 * KIB, "tokens": 1, "paths": ["nccl", "oneshot"]} in limits.ties


def test_a_blip_inside_a_run_of_wins_does_not_cut_the_limit_but_a_lasting_loss_does():
    """One size where NCCL wins by 12% between sizes where one-shot wins by 30%: the limit goes
    past it. The same loss at two sizes in a row, with nothing won beyond: the limit stops before."""
    blip = dict(PCIE_X4, oneshot=[6.1, 6.6, 16.0, 10.5] + PCIE_X4["oneshot"][4:])
    assert derive(table(blip), world=4, hidden=HIDDEN).fused_max_bytes == 256 * KIB
    lasting = {"oneshot": [6.1, 6.6, 16.0, 17.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 3840.0],
               "twoshot": [None] * 3 + [17.5, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 3840.0],
               "unfused": PCIE_X4["unfused"]}
    assert derive(table(lasting), world=4, hidden=HIDDEN).fused_max_bytes == 16 * KIB


def test_noise_wide_enough_makes_every_size_a_tie_and_the_release_rule_stands():
    """A spread of +-60%: nothing is told apart, so fused up to the largest size, one-shot up to
    FlashInfer's own ceiling (TP4: 8 MiB, 1024 tokens at hidden 4096) and two-shot above; the
    verdict says tie, never "fused was faster at every size"."""
    limits = derive(table(PCIE_X4, spread=(0.4, 1.6)), world=4, hidden=HIDDEN)
    assert limits.fused_max_bytes == 2048 * HIDDEN * 2
    assert limits.oneshot_max_bytes == release_oneshot_max_bytes(4) == 1024 * HIDDEN * 2
    assert len(limits.ties) == 12
    assert limits.verdict == ("fused and unfused tie at TP4, hidden 4096 at every size up to 16 MiB per rank (2048 "
                              "tokens), within the noise of the repetitions: fused there, as the release does (one-shot "
                              "up to 8 MiB, two-shot above); the limit is the largest size measured")
    assert "faster" not in limits.verdict


def test_one_shot_never_passes_the_releases_ceiling():
    """NVLink-like at TP8: one-shot beats everything at every size, but the tuned one-shot stops at
    FlashInfer's own region (2.625 MiB per rank at TP8: 256 tokens at hidden 4096)."""
    fast = {"oneshot": [5.0 * (1 + i) for i in range(12)], "twoshot": [None] * 4 + [40.0 * (1 + i) for i in range(8)],
            "unfused": [100.0 * (1 + i) for i in range(12)]}
    limits = derive(table(fast), world=8, hidden=HIDDEN)
    assert limits.oneshot_max_bytes == 256 * HIDDEN * 2 <= release_oneshot_max_bytes(8)
    assert limits.fused_max_bytes == 2048 * HIDDEN * 2


# -- narrowing a limit down: bisection between the measured sizes -------------------------------

def modelled(world: int, paths: dict, *, spread: float = 0.005):
    """A box as a function: each path's median at ``tokens`` (one-shot only inside the release's
    region, two-shot only above ``world`` tokens, as the worker times them), with a spread of
    +-``spread``; returns measure(tokens) -> its row, and the list of token counts it was asked."""
    asked = []

    def measure(tokens: int) -> Row:
        asked.append(tokens)
        row = {"tokens": tokens, "bytes": tokens * HIDDEN * 2, "repeats": 7}
        for column, at in paths.items():
            if column == "oneshot" and row["bytes"] > release_oneshot_max_bytes(world) and tokens > world:
                continue
            if column == "twoshot" and tokens <= world:
                continue
            median = at(tokens)
            row[f"{column}_us"], row[f"{column}_iqr_us"] = median, [median * (1 - spread), median * (1 + spread)]
        return Row.from_table(row)
    return measure, asked


DOUBLING = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
# One-shot and two-shot cross at 13 tokens, two-shot and NCCL at 45: between measured sizes.
CROSSING = {"oneshot": lambda n: 5.0 + 0.75 * n, "twoshot": lambda n: 8.25 + 0.5 * n, "unfused": lambda n: 17.25 + 0.3 * n}


def test_each_limit_is_narrowed_to_within_ten_percent_of_its_crossover():
    """Issue #60 item 7: at doubling sizes the limits land on 8 and 32 tokens, up to 2x below the
    crossovers (13 and 45 tokens); the tuner's bisection, measuring the sizes next_probe names with
    the same measure function, brings each within 10 % of its crossover, in a handful of sizes,
    each strictly between two measured ones."""
    measure, asked = modelled(4, CROSSING)
    rows = [measure(n) for n in DOUBLING]
    coarse = derive(rows, world=4, hidden=HIDDEN)
    assert (coarse.oneshot_max_bytes, coarse.fused_max_bytes) == (8 * HIDDEN * 2, 32 * HIDDEN * 2)
    assert sorted(coarse.brackets, key=lambda b: b.limit) == [Bracket("fused", 32, 64), Bracket("oneshot", 8, 16)]
    asked.clear()
    limits, measured = refine(rows, measure, world=4, hidden=HIDDEN)
    a, b = limits.oneshot_max_bytes // (HIDDEN * 2), limits.fused_max_bytes // (HIDDEN * 2)
    assert 13 / 1.1 <= a <= 13 and 45 / 1.1 <= b <= 45, (a, b)
    assert len(asked) <= 8 and all(8 < n < 16 or 32 < n < 64 for n in asked)
    assert [r.tokens for r in measured if r.probe] == asked
    assert next_probe(limits) is None and all(bracket.narrow for bracket in limits.brackets)
    beyond = min(r.tokens for r in measured if r.bytes > limits.fused_max_bytes)
    assert limits.verdict.startswith(f"fusion wins at TP4, hidden 4096 up to {b * 8} KiB per rank ({b} tokens): "
                                     f"one-shot up to {a * 8} KiB, two-shot above; ")
    assert limits.verdict.endswith(f"; from {beyond * 8} KiB ({beyond} tokens) NCCL allreduce + fused_add_rmsnorm (the "
                                   "server without fusion) is faster")
    assert "not narrowed down" not in limits.verdict


def test_the_probes_alone_decide_a_limit_again_as_the_tuner_reads_them_back():
    """The profile's table holds the probes (marked); derive on it gives the narrowed limits again,
    and a probe never moves a limit the cost rule did not choose (the rows asked for decide which
    sizes are fused, the probes only where between two of them)."""
    measure, _ = modelled(4, CROSSING)
    limits, rows = refine([measure(n) for n in DOUBLING], measure, world=4, hidden=HIDDEN)
    again = derive(list(reversed(rows)), world=4, hidden=HIDDEN)
    assert (again.oneshot_max_bytes, again.fused_max_bytes, again.verdict) == (
        limits.oneshot_max_bytes, limits.fused_max_bytes, limits.verdict)
    never = {"oneshot": lambda n: 30.0 + n, "twoshot": lambda n: 40.0 + n, "unfused": lambda n: 10.0 + n}
    measure, asked = modelled(4, never)
    limits, _ = refine([measure(n) for n in DOUBLING], measure, world=4, hidden=HIDDEN)
    assert limits.never_fused and asked == list(DOUBLING)  # nothing to narrow: no probe


def test_one_shot_throughout_moves_with_the_fused_limit_and_stops_at_the_ceiling():
    """One-shot beats two-shot everywhere and crosses NCCL at 100 tokens: A follows B as it is
    narrowed (one-shot throughout). At TP8, where one-shot wins past the release's one-shot ceiling
    (336 tokens at hidden 4096, between the measured 256 and 512), the one-shot limit is narrowed
    up to that ceiling and no further; fused to the largest size."""
    fast = {"oneshot": lambda n: 4.0 + 0.2 * n, "twoshot": lambda n: 9.0 + 0.3 * n, "unfused": lambda n: 14.0 + 0.1 * n}
    measure, _ = modelled(4, fast)
    limits, _ = refine([measure(n) for n in DOUBLING], measure, world=4, hidden=HIDDEN)
    b = limits.fused_max_bytes // (HIDDEN * 2)
    assert limits.oneshot_max_bytes == limits.fused_max_bytes and 100 / 1.1 <= b <= 100
    late = {"oneshot": lambda n: 4.0 + 0.1 * n, "twoshot": lambda n: 30.0 + 0.2 * n, "unfused": lambda n: 50.0 + 0.3 * n}
    measure, asked = modelled(8, late)
    limits, _ = refine([measure(n) for n in DOUBLING], measure, world=8, hidden=HIDDEN)
    a = limits.oneshot_max_bytes // (HIDDEN * 2)
    assert release_oneshot_max_bytes(8) == 336 * HIDDEN * 2 and 336 / 1.1 <= a <= 336
    assert limits.fused_max_bytes == 2048 * HIDDEN * 2 and all(256 < n <= 336 for n in asked[len(DOUBLING):])


def test_a_tie_at_a_probe_counts_as_the_limits_path_winning():
    """Within the noise at the probe (two-shot and NCCL tie there): fused, as the release does."""
    measure, _ = modelled(4, CROSSING, spread=0.05)
    limits, rows = refine([measure(n) for n in DOUBLING], measure, world=4, hidden=HIDDEN)
    b = limits.fused_max_bytes // (HIDDEN * 2)
    edge = next(r for r in rows if r.tokens == b)
    assert edge.outcome("twoshot") == "tie" and b > 45


def test_random_boxes_narrow_every_limit_with_few_probes_inside_their_brackets():
    """Boxes as random straight lines per path (any order of crossovers, spreads up to +-10 %),
    narrowed as the tuner does: it ends (each bracket within 10 %, never more than MAX_PROBES
    sizes), every probe lies strictly between two sizes asked for, and the limits keep the
    contract's invariants (A <= B, A within the release's one-shot region)."""
    from sm120patch.bench.limits import MAX_PROBES

    generator = random.Random(60)
    for _ in range(200):
        world = generator.choice((2, 4, 8))
        paths = {name: (lambda base, slope: lambda n: base + slope * n)(generator.uniform(3, 30), generator.uniform(0.05, 1))
                 for name in ("oneshot", "twoshot", "unfused")}
        measure, asked = modelled(world, paths, spread=generator.choice((0.0, 0.01, 0.1)))
        rows = [measure(n) for n in DOUBLING]
        limits, measured = refine(rows, measure, world=world, hidden=HIDDEN)
        probes = asked[len(DOUBLING):]
        assert len(probes) <= MAX_PROBES and all(n not in DOUBLING for n in probes)
        assert len(probes) == MAX_PROBES or all(bracket.narrow for bracket in limits.brackets)
        a, b = limits.oneshot_max_bytes, limits.fused_max_bytes
        assert a <= b and a <= release_oneshot_max_bytes(world) and b <= DOUBLING[-1] * HIDDEN * 2


def test_random_tables_keep_the_contracts_invariants():
    """A <= B, A within the release's one-shot region, both measured sizes (or 0), and never
    fused whenever an unfused path wins clearly at the smallest size."""
    generator = random.Random(52)
    tokens = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
    for _ in range(300):
        world = generator.choice((2, 4, 8))
        columns = {name: [generator.uniform(5, 50) * (1 + i) ** generator.uniform(0.3, 1.2) for i in range(12)]
                   for name in ("oneshot", "twoshot", "unfused")}
        columns["twoshot"] = [None if n <= world else t for n, t in zip(tokens, columns["twoshot"])]
        spread = generator.choice([(1.0, 1.0), (0.97, 1.04), (0.8, 1.3)])
        rows = table(columns, spread=spread)
        limits = derive(rows, world=world, hidden=HIDDEN)
        sizes = {0} | {r.bytes for r in rows}
        a, b = limits.oneshot_max_bytes, limits.fused_max_bytes
        assert a <= b and a <= release_oneshot_max_bytes(world) and {a, b} <= sizes
        if all(r.outcome(p) == "loss" for r in rows for p in ("oneshot", "twoshot")):  # unfused wins everywhere
            assert b == 0
        if b:  # what is fused costs no more, summed, than never fusing
            assert "fusion wins" in limits.verdict or "tie" in limits.verdict


# -- the profile ----------------------------------------------------------------------------

from sm120patch import _tuned_runtime as runtime  # noqa: E402
from sm120patch.bench import profile  # noqa: E402
from sm120patch.errors import ExitCode, RefusedError, Sm120PatchError  # noqa: E402

SOFTWARE = {"flashinfer-python": "0.6.4", "sglang": "0.5.9", "torch": "2.11.0+cu130"}
GPUS = [{"bus_id": "0000:01:00.0", "uuid": "GPU-a"}, {"bus_id": "0000:02:00.0", "uuid": "GPU-b"},
        {"bus_id": "0000:41:00.0", "uuid": "GPU-c"}, {"bus_id": "0000:42:00.0", "uuid": "GPU-d"}]


def pcie_entry(world: int = 4, **overrides) -> dict:
    rows = [dict(tokens=r.tokens, bytes=r.bytes) for r in table(PCIE_X4)]
    limits = derive(table(PCIE_X4), world=world, hidden=HIDDEN)
    made = profile.entry(limits, rows=rows, software=SOFTWARE, nccl_env=runtime._sm120patch_nccl_env(), dtype="bf16",
                         hidden=HIDDEN, model=None, gpus=GPUS[:world])
    return dict(made, **overrides)


def test_a_new_profile_is_made_with_its_directory_readable_and_in_force_on_this_box(tmp_path):
    """Written where nothing was (its directory made), world-readable for the server's user, no
    temporary file left; the servers' own code accepts it for this box, this TP, these releases."""
    path = tmp_path / "etc" / "sm120patch" / "tuned-limits.json"
    box = runtime._sm120patch_box()
    written = profile.write(path, box=box, tp=4, new_entry=pcie_entry())
    assert written == profile.Written(path, False, False, (), False)
    assert oct(path.stat().st_mode & 0o777) == "0o644" and sorted(p.name for p in path.parent.iterdir()) == [path.name]
    document, why = runtime._sm120patch_load(str(path))
    assert why == "" and runtime._sm120patch_check_document(document) == ""
    entry, why = runtime._sm120patch_judge(document, 4, runtime._sm120patch_box(), runtime._sm120patch_nccl_env(),
                                           SOFTWARE)
    assert why == "" and (entry["oneshot_max_bytes"], entry["fused_max_bytes"]) == (64 * KIB, 256 * KIB)
    assert runtime._sm120patch_judge(document, 2, box, runtime._sm120patch_nccl_env(), SOFTWARE)[1] == \
        "no limits for TP2 (tuned: TP4)"


def test_a_second_tp_joins_the_file_and_a_rerun_replaces_only_its_own_entry(tmp_path):
    path = tmp_path / "tuned-limits.json"
    box = runtime._sm120patch_box()
    profile.write(path, box=box, tp=4, new_entry=pcie_entry())
    first_tp4 = json_of(path)["entries"]["4"]
    assert profile.write(path, box=box, tp=2, new_entry=pcie_entry(2)) == profile.Written(path, False, False, ("4",), False)
    again = pcie_entry(verdict="measured again")
    assert profile.write(path, box=box, tp=4, new_entry=again) == profile.Written(path, True, False, ("2",), False)
    entries = json_of(path)["entries"]
    assert list(entries) == ["2", "4"] and entries["4"] == again != first_tp4 and entries["2"] == pcie_entry(2) | {
        "created": entries["2"]["created"]}


def test_a_profile_from_another_box_is_replaced_whole_and_said(tmp_path):
    path = tmp_path / "tuned-limits.json"
    other = {"gpus": [{"bus_id": "0000:81:00.0"}], "driver": "580.1"}
    profile.write(path, box=other, tp=2, new_entry=pcie_entry(2))
    box = runtime._sm120patch_box()
    assert profile.write(path, box=box, tp=4, new_entry=pcie_entry()) == profile.Written(path, False, True, (), False)
    document = json_of(path)
    assert document["box"] == box and list(document["entries"]) == ["4"]


@pytest.mark.parametrize("content, said", [
    (b"server_args: {}\n", "holds something that is not a tuned-limits profile (JSONDecodeError)"),
    (b'{"kind": "an ansible inventory"}', "not an sm120patch tuned-limits profile"),
    (b'{"kind": "sm120patch tuned limits", "format": 9, "box": {}, "entries": {}}',
     "format 9, written by a newer sm120patch (this patch reads format 1)"),
])
def test_a_file_that_is_not_a_profile_this_version_reads_is_never_overwritten(tmp_path, content, said):
    path = tmp_path / "tuned-limits.json"
    path.write_bytes(content)
    with pytest.raises(RefusedError) as raised:
        profile.write(path, box=runtime._sm120patch_box(), tp=4, new_entry=pcie_entry())
    assert said in raised.value.message and "nothing was written" in raised.value.message
    assert raised.value.hint == "move it away, or pass --profile with another path"
    assert path.read_bytes() == content and sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_a_path_that_cannot_be_written_is_one_error_with_the_way_out(tmp_path):
    """The parent is a file (as unwritable as /etc/sm120patch for a user, and so for root too):
    one line, exit 4, the command with --profile somewhere writable and the variable to set."""
    blocker = tmp_path / "etc"
    blocker.write_text("a file, not a directory")
    with pytest.raises(Sm120PatchError) as raised:
        profile.write(blocker / "sm120patch" / "tuned-limits.json", box={}, tp=4, new_entry=pcie_entry())
    error = raised.value
    assert error.exit_code == ExitCode.FAILED and error.message.startswith(f"cannot write the profile at {blocker}/sm120patch")
    assert "nothing was written" in error.message and "\n" not in error.message
    assert error.hint_line.startswith("`--profile ") and "set SM120PATCH_TUNED_LIMITS to that path" in error.hint_line


def test_ranks_sharing_a_gpu_are_refused_unless_a_test_forces_it(monkeypatch):
    shared = [GPUS[0], GPUS[1], dict(GPUS[0], uuid="MIG-1")]
    with pytest.raises(RefusedError) as raised:
        profile.refuse_shared_gpus(shared)
    assert raised.value.message.startswith("ranks 0 and 2 ran on one GPU (0000:01:00.0): their timings measure one GPU "
                                           "taking turns")
    profile.refuse_shared_gpus(GPUS)
    with pytest.raises(RefusedError, match=r"^ranks 0 and 1 ran on one GPU \(GPU-a\)"):
        profile.refuse_shared_gpus([{"bus_id": None, "uuid": "GPU-a"}] * 2)
    monkeypatch.setenv(profile.ALLOW_SHARED, "1")
    profile.refuse_shared_gpus(shared)


@pytest.mark.parametrize("config, expected", [
    ({"hidden_size": 7168, "torch_dtype": "bfloat16"}, (7168, "bf16")),
    ({"text_config": {"hidden_size": 5120, "torch_dtype": "float16"}}, (5120, "fp16")),
    ({"hidden_size": 4096, "dtype": "float32"}, (4096, None)),
])
def test_a_models_config_gives_its_hidden_size_and_dtype(tmp_path, config, expected):
    (tmp_path / "config.json").write_text(__import__("json").dumps(config))
    assert profile.read_model(tmp_path / "config.json") == expected
    assert profile.read_model(tmp_path) == expected  # the model's directory


def json_of(path: Path) -> dict:
    return __import__("json").loads(path.read_text())


# -- the command, from the workers' document to the profile ------------------------------------
# The workers need CUDA GPUs: here `run` hands back the document they write (its rows the PCIe
# table above, its box and NCCL settings this machine's, as the worker computes them with
# _tuned_runtime.py), and everything after it is the real code.

from click.testing import CliRunner  # noqa: E402

from sm120patch import bench  # noqa: E402
from sm120patch.cli import cli  # noqa: E402
from sm120patch.distributions import load_registry  # noqa: E402


def pcie_rows(columns: dict = PCIE_X4) -> list[dict]:
    rows = []
    for index, n in enumerate((1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)):
        row = {"tokens": n, "bytes": n * HIDDEN * 2, "graphs": True}
        for column, medians in columns.items():
            if medians[index] is not None:
                row.update({f"{column}_us": medians[index], f"{column}_iqr_us": [medians[index] * 0.98,
                                                                                  medians[index] * 1.03]})
        rows.append(row)
    return rows


@pytest.fixture
def tuned(monkeypatch):
    """`bench --tune --tp 4 --hidden 4096` with the workers' document given: returns a function
    that runs the command with these GPUs (bus ids per rank) and extra arguments."""
    def invoke(*args, gpus=GPUS, pcie_ipc=(), rows=None, made=None, collectives="nccl", probe=None):
        """``pcie_ipc``: the servers' PCIe-IPC paths _prepare found; ``rows`` and ``made`` (the
        workers' account of each path), ``collectives`` (the workers' process group): what the
        workers hand back. ``probe``: tokens -> the row the workers measure when the tuner asks
        for a size between two (as rank 0 does: the rows so far to ``ask``, until it says None);
        without it the workers measure only the sizes asked for."""
        def prepare(request):
            return bench._Prepared(bench.replace(request, python=Path("/srv/env/bin/python")), 4,
                                   load_registry(full=False), None, [], tuple(pcie_ipc))

        def run(request, *, world_size, on_event=None, servers=(), tune=None, ask=None):
            assert tune["oneshot_max_bytes"] == 8 * 2 ** 20 and tune["repeats"] == 7
            assert {"flashinfer-python", "sglang", "vllm", "torch"} <= set(tune["distributions"])
            assert tune["runtime"] == Path(runtime.__file__).read_text()
            invoke.config = tune
            meta = {"flashinfer": "0.6.4", "torch": "2.11.0+cu130", "cuda": "13.0", "collectives": collectives,
                    "device": "NVIDIA RTX PRO 6000",
                    "capability": "12.0", "tune": {"box": runtime._sm120patch_box(), "gpus": list(gpus),
                                                   "nccl_env": runtime._sm120patch_nccl_env(), "software": SOFTWARE,
                                                   "rows": list(rows or pcie_rows())}}
            invoke.asked = []
            while probe is not None and (tokens := ask(meta["tune"]["rows"])) is not None:
                invoke.asked.append(tokens)
                meta["tune"]["rows"].append(dict(probe(tokens), probe=True))
            if made is not None:
                meta["tune"]["pcie_ipc"] = made
            return bench.BenchReport(request, world_size, meta, [])

        monkeypatch.setattr(bench, "_prepare", prepare)
        monkeypatch.setattr(bench, "run", run)
        return CliRunner().invoke(cli, ["bench", "--tune", "--tp", "4", *args])
    return invoke


def test_tune_writes_a_profile_the_servers_take_and_says_what_it_measured(tuned, tmp_path):
    path = tmp_path / "tuned-limits.json"
    result = tuned("--hidden", "4096", "--profile", str(path))
    assert result.exit_code == 0, result.output
    entry, why = runtime._sm120patch_judge(json_of(path), 4, runtime._sm120patch_box(), runtime._sm120patch_nccl_env(),
                                           SOFTWARE)
    assert why == "" and (entry["oneshot_max_bytes"], entry["fused_max_bytes"], entry["unfused"]) == (
        64 * KIB, 256 * KIB, "nccl")
    assert entry["gpus_used"] == [g["bus_id"] for g in GPUS] and entry["table"] == pcie_rows()
    assert entry["software"] == SOFTWARE and entry["hidden"] == HIDDEN and entry["dtype"] == "bf16"
    lines = result.output.splitlines()
    assert "limits at TP4: one-shot up to 64 KiB per rank, fused up to 256 KiB (32 tokens at hidden 4096), unfused beyond" \
        in lines
    assert ("  tie at 256 KiB: NCCL+norm and two-shot are within the noise of the repetitions (their interquartile "
            "ranges and their medians' notches overlap)") in lines
    assert f"verdict: {entry['verdict']}" in lines
    assert f"profile: wrote the TP4 limits into {path}" in lines
    assert "       1     8 KiB           6.1 [6.0-6.3]                       -        13.5 [13.2-13.9]" in lines
    assert "    2048    16 MiB  1520.0 [1489.6-1565.6]  1130.0 [1107.4-1163.9]     700.0 [686.0-721.0]" in lines
    assert lines[-1] == ("  it holds for this box (its GPUs, PCIe paths, driver), these releases and NCCL settings; servers "
                         "patched with tuned-limits read it at start if their environment has "
                         f"SM120PATCH_TUNED_LIMITS={path}")


def test_tune_from_ranks_sharing_a_gpu_prints_the_table_and_writes_nothing(tuned, tmp_path, monkeypatch):
    path = tmp_path / "tuned-limits.json"
    result = tuned("--hidden", "4096", "--profile", str(path), gpus=[GPUS[0], GPUS[0], GPUS[2], GPUS[3]])
    assert result.exit_code == ExitCode.REFUSED and not path.exists()
    assert "profile: not written (below)" in result.output
    assert "sm120patch: error: ranks 0 and 1 ran on one GPU (0000:01:00.0)" in result.output
    assert "ranks: every rank on GPU 0" not in result.output  # four GPUs' ranks, two of them shared: NCCL
    monkeypatch.setenv(profile.ALLOW_SHARED, "1")
    # Every rank on GPU 0 (the test-only SM120PATCH_TUNE_ONE_GPU): the workers' gloo is said, never NCCL's.
    forced = tuned("--hidden", "4096", "--profile", str(path), "--json", gpus=[GPUS[0]] * 4,
                   collectives="gloo, every rank on GPU 0")
    assert forced.exit_code == 0 and path.exists() and json.loads(forced.output)["collectives"].startswith("gloo")
    text = tuned("--hidden", "4096", "--profile", str(path), gpus=[GPUS[0]] * 4, collectives="gloo, every rank on GPU 0")
    assert ("ranks: every rank on GPU 0 (SM120PATCH_TUNE_ONE_GPU, for tests): the collectives went over gloo through "
            "host memory, so NCCL below means gloo") in " ".join(text.output.split())


def test_tune_reads_the_models_config_and_its_dtype(tuned, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"text_config": {"hidden_size": 4096}, "torch_dtype": "float16"}')
    path = tmp_path / "tuned-limits.json"
    assert tuned("--model", str(model / "config.json"), "--profile", str(path)).exit_code == 0
    entry = json_of(path)["entries"]["4"]
    assert (entry["hidden"], entry["dtype"], entry["model"]) == (4096, "fp16", str(model / "config.json"))
    assert tuned("--model", str(model), "--dtype", "bf16", "--profile", str(path)).exit_code == 0
    assert json_of(path)["entries"]["4"]["dtype"] == "bf16"  # --dtype given wins over the model's


def test_tune_narrows_the_limits_down_in_the_same_run_and_prints_the_probes(tuned, tmp_path):
    """The workers measure the sizes the tuner asks for between two measured ones (here the PCIe
    table's box as a function: each path's time between the sizes asked for, interpolated) until
    each limit is within 10 % of its crossover; the probes are in the table (marked), the profile
    and the JSON, and the limits written are the narrowed ones, derived again from that table."""
    def probe(tokens: int) -> dict:
        lower = max((r for r in pcie_rows() if r["tokens"] < tokens), key=lambda r: r["tokens"])
        upper = min((r for r in pcie_rows() if r["tokens"] > tokens), key=lambda r: r["tokens"])
        share = (tokens - lower["tokens"]) / (upper["tokens"] - lower["tokens"])
        row = {"tokens": tokens, "bytes": tokens * HIDDEN * 2, "graphs": True, "repeats": 7}
        for column in ("oneshot", "twoshot", "unfused"):
            if f"{column}_us" in lower and f"{column}_us" in upper:
                median = lower[f"{column}_us"] + share * (upper[f"{column}_us"] - lower[f"{column}_us"])
                row[f"{column}_us"], row[f"{column}_iqr_us"] = median, [median * 0.98, median * 1.03]
        return row

    path = tmp_path / "tuned-limits.json"
    result = tuned("--hidden", "4096", "--profile", str(path), probe=probe)
    assert result.exit_code == 0, result.output
    asked = tuned.asked
    assert asked and all(8 < n < 16 or 32 < n < 64 for n in asked) and len(asked) <= 8
    entry = json_of(path)["entries"]["4"]
    table = entry["table"]
    assert [r["tokens"] for r in table] == sorted(r["tokens"] for r in table)
    assert sorted(r["tokens"] for r in table if r.get("probe")) == sorted(asked)
    again = derive([Row.from_table(r) for r in table], world=4, hidden=HIDDEN)
    assert (entry["oneshot_max_bytes"], entry["fused_max_bytes"]) == (again.oneshot_max_bytes, again.fused_max_bytes)
    a, b = entry["oneshot_max_bytes"] // (HIDDEN * 2), entry["fused_max_bytes"] // (HIDDEN * 2)
    assert 8 < a < 16 and 32 < b < 64 and all(bracket.narrow for bracket in again.brackets)
    lines = result.output.splitlines()
    assert any(line.startswith(f"  {asked[0]:>5}*") for line in lines)
    assert ("  * measured to narrow a limit down (between two sizes asked for, the same checks and repetitions)"
            in lines)
    assert "not narrowed down" not in entry["verdict"]
    document = json.loads(tuned("--hidden", "4096", "--profile", str(path), "--json", probe=probe).stdout)
    assert document["entry"]["table"] == table and document["entry"]["fused_max_bytes"] == b * HIDDEN * 2


@pytest.mark.parametrize("args, said", [
    (["--model", "/m/config.json"], "--model is for --tune"),
    (["--repeats", "9"], "--repeats is for --tune"),
    (["--tune"], "--tune measures for one model: pass --hidden N"),
    (["--tune", "--hidden", "4096,7168"], "--tune: one hidden size (the model's), not 4096,7168"),
    (["--tune", "--hidden", "4096", "--check-only"], "drop --check-only and --strategy"),
    (["--tune", "--hidden", "4096", "--repeats", "2"], "2 is not in the range 3<=x<=101"),
    (["--tune", "--model", "/nonexistent/config.json"], "--model /nonexistent/config.json: cannot read it as a model's"),
])
def test_tune_options_are_refused_as_they_are_parsed(args, said):
    result = CliRunner().invoke(cli, ["bench", *args])
    assert result.exit_code == ExitCode.USAGE, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("sm120patch: error:")]
    assert len(errors) == 1 and said in errors[0] and "Traceback" not in result.output


def test_without_profile_the_tuner_writes_where_the_servers_look(tuned, tmp_path, monkeypatch):
    """$SM120PATCH_TUNED_LIMITS (else /etc/sm120patch/tuned-limits.json): no variable to set then."""
    path = tmp_path / "fleet" / "tuned-limits.json"
    monkeypatch.setenv("SM120PATCH_TUNED_LIMITS", str(path))
    result = tuned("--hidden", "4096")
    assert result.exit_code == 0 and path.exists()
    assert result.output.splitlines()[-1].endswith("servers patched with tuned-limits read it at start")


def test_tune_json_is_the_entry_and_where_it_went(tuned, tmp_path):
    import json

    path = tmp_path / "tuned-limits.json"
    result = tuned("--hidden", "4096", "--profile", str(path), "--json")
    assert result.exit_code == 0
    document = json.loads(result.stdout)
    assert document["entry"] == json_of(path)["entries"]["4"] and document["errors"] == []
    assert document["profile"] == {"path": str(path), "replaced_tp": False, "other_box": False, "kept": [],
                                   "foreign_owner": None}
    assert document["world_size"] == 4 and document["flashinfer"] == "0.6.4"


# -- the servers' PCIe-IPC paths: which the tuner times, the worker's config, the table -------

from types import SimpleNamespace  # noqa: E402

from packaging.version import Version  # noqa: E402

from sm120patch.bench.limits import UNFUSED_PATHS  # noqa: E402
from sm120patch.wheels import fetch_wheel  # noqa: E402

SGLANG_PATH = {"name": "sglang-pcie-ipc", "column": "sglang_pcie_ipc",
               "code": "sglang.srt.distributed.device_communicators.pcie_ipc_ar:PcieIpcCommunicator", "rows": 512,
               "switch": "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1", "server": "sglang 0.5.21 with flashinfer-python 0.7.0"}


def installed(*releases: tuple[str, str], flashinfer: str | None) -> SimpleNamespace:
    """A status of an environment holding these (distribution, release) pairs beside FlashInfer
    ``flashinfer`` (the fields pcie_ipc_paths reads, as pipeline.status fills them)."""
    registry = load_registry(full=False)
    trees = []
    for name, version in releases:
        d = registry.get(name)
        trees.append(SimpleNamespace(distribution=d, tree=SimpleNamespace(version=Version(version)),
                                     with_raw_version=(flashinfer or "") if d.fusion_with else "",
                                     assessment=SimpleNamespace(name=d.name, raw_version=version)))
    return SimpleNamespace(trees=trees)


@pytest.mark.parametrize("releases, flashinfer, timed", [
    ([("sglang", "0.5.21")], "0.7.0", ["sglang-pcie-ipc"]),
    ([("sglang", "0.5.23")], "0.7.4", ["sglang-pcie-ipc"]),
    ([("sglang", "0.5.20")], "0.7.0", []),  # the release has no pcie_ipc_ar.py
    ([("sglang", "0.5.21")], "0.6.18", []),  # its pin: no PcieIpcAllReduceWorkspace, SGLang stays on NCCL
    ([("vllm", "0.31.0")], "0.7.0.post1", ["vllm-pcie-ipc"]),
    ([("vllm", "0.34.0")], "0.7.3", ["vllm-pcie-ipc"]),
    ([("vllm", "0.30.0")], "0.7.0", ["vllm-pcie-ipc"]),  # the same file as 0.31, with a FlashInfer that has it
    ([("vllm", "0.30.0")], "0.6.18.post1", []),  # its own pin
    ([("vllm", "0.29.0")], "0.7.0", []),
    ([("flashinfer-python", "0.7.0")], "0.7.0", []),  # no server installed
    ([("sglang", "0.5.22"), ("vllm", "0.32.0")], "0.7.0", ["sglang-pcie-ipc", "vllm-pcie-ipc"]),
])
def test_the_tuner_times_the_pcie_ipc_paths_the_installed_releases_have(releases, flashinfer, timed):
    paths = bench.pcie_ipc_paths(installed(*releases, flashinfer=flashinfer))
    assert [p["name"] for p in paths] == timed
    for path in paths:
        assert path["column"] == UNFUSED_PATHS[path["name"]] and path["rows"] == 512
        name, version = next(r for r in releases if path["name"].startswith(r[0]))
        assert path["server"] == f"{name} {version} with flashinfer-python {flashinfer}"


def test_the_paths_data_names_the_servers_real_code_and_switch(wheel_cache):
    """Each [[pcie_ipc]] row is true of the wheels: the class is defined in that module of the
    first and last release of its range (and the module is absent from the release before it),
    the switch is read in the release's environ/envs, and FlashInfer has PcieIpcAllReduceWorkspace
    from 0.7.0 (not in 0.6.17)."""
    registry = load_registry(full=False)
    for name, releases in (("sglang", ("0.5.21", "0.5.23")), ("vllm", ("0.30.0", "0.34.0"))):
        (row,) = registry.get(name).pcie_ipc
        assert row.name in UNFUSED_PATHS
        module, _, cls = row.code.partition(":")
        for version in releases:
            with zipfile.ZipFile(fetch_wheel(name, version, wheel_cache)) as wheel:
                source = wheel.read(module.replace(".", "/") + ".py").decode()
                settings = wheel.read("sglang/srt/environ.py" if name == "sglang" else "vllm/envs.py").decode()
            assert f"class {cls}" in source and row.switch.split("=")[0] in settings
        with zipfile.ZipFile(fetch_wheel(name, {"sglang": "0.5.20", "vllm": "0.29.0"}[name], wheel_cache)) as wheel:
            assert module.replace(".", "/") + ".py" not in wheel.namelist()  # the release before the range has none
    for version, has in (("0.7.0", True), ("0.6.17", False)):
        with zipfile.ZipFile(fetch_wheel("flashinfer-python", version, wheel_cache)) as wheel:
            assert ("PcieIpcAllReduceWorkspace" in wheel.read("flashinfer/comm/__init__.py").decode()) is has


@pytest.mark.wheels
def test_status_of_a_real_environment_gives_the_path_to_time(tmp_path):
    """SGLang 0.5.21 beside FlashInfer 0.7.0, installed from their wheels: the tuner's decision
    comes from what pipeline.status finds there."""
    from helpers import make_venv
    from sm120patch import pipeline

    root = tmp_path / "venv"
    make_venv(root, [fetch_wheel("sglang", "0.5.21"), fetch_wheel("flashinfer-python", "0.7.0")])
    (tmp_path / "home").mkdir()
    status = pipeline.status(pipeline.Request(python=str(root / "bin" / "python"), jit_base=str(tmp_path / "home")),
                             load_registry(full=False))
    assert bench.pcie_ipc_paths(status) == [SGLANG_PATH]


def test_tune_gives_the_worker_the_paths_and_prints_and_keeps_the_pcie_ipc_column(tuned, tmp_path):
    """The worker's config carries the paths _prepare found; what comes back (SGLang's path timed
    up to its 512-token workspace, vLLM's not made) is printed, derived from, written into the
    profile and the JSON: the column where it ran, absent (never 0 us) where it did not."""
    import json

    pcie = [9.0, 9.5, 10.0, 11.0, 12.0, 15.0, 25.0, 50.0, 90.0, 160.0, None, None]
    rows = pcie_rows(dict(PCIE_X4, sglang_pcie_ipc=pcie))
    for row in rows[-2:]:
        row["not_run"] = ["sglang-pcie-ipc"]
    vllm = {"name": "vllm-pcie-ipc", "column": "vllm_pcie_ipc", "code": "vllm.x:Y", "rows": 512,
            "switch": "VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC=1", "server": "vllm 0.31.0 with flashinfer-python 0.7.0"}
    made = [dict(SGLANG_PATH, how="the server's own PcieIpcCommunicator", error=None),
            dict(vllm, how="the server's own FlashInferPcieIpcAllReduce",
                 error="pcie ipc workspace failed while preparing: {0: 'RuntimeError: CUDART error'}")]
    path = tmp_path / "tuned-limits.json"
    result = tuned("--hidden", "4096", "--profile", str(path), pcie_ipc=[SGLANG_PATH, vllm], rows=rows, made=made)
    assert result.exit_code == 0, result.output
    assert tuned.config["pcie_ipc"] == [SGLANG_PATH, vllm]
    lines = result.output.splitlines()
    assert ("check: one-shot, two-shot, NCCL + fused_add_rmsnorm and SGLang PCIe-IPC + fused_add_rmsnorm each matched "
            "NCCL allreduce + float32 RMSNorm at every size where it ran, before it was timed") in lines
    assert ("SGLang PCIe-IPC: sglang 0.5.21 with flashinfer-python 0.7.0's PCIe-IPC allreduce "
            "(SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1, fusion off), made with the server's own PcieIpcCommunicator, its "
            "workspace sized for 512 tokens; not run at 1024, 2048 tokens (the server sends those to NCCL)") in lines
    assert ("warning: vllm 0.31.0 with flashinfer-python 0.7.0's PCIe-IPC allreduce "
            "(VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC=1, fusion off) could not be made here: pcie ipc workspace failed "
            "while preparing: {0: 'RuntimeError: CUDART error'}; a server started with "
            "VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC=1 would not run it either: tuned without it") in lines
    header = next(line for line in lines if line.strip().startswith("tokens"))
    assert header.split() == ["tokens", "size", "one-shot", "two-shot", "NCCL+norm", "SGLang", "PCIe-IPC"]
    assert "       1     8 KiB           6.1 [6.0-6.3]                       -        13.5 [13.2-13.9]" \
           "           9.0 [8.8-9.3]" in lines
    assert lines[lines.index(header) + 12].endswith("700.0 [686.0-721.0]                       -")
    assert ("verdict: fusion wins at TP4, hidden 4096 up to 64 KiB per rank (8 tokens): one-shot throughout; a tie at "
            "64 KiB (8 tokens) (fused there, as the release does); from 128 KiB (16 tokens) SGLang's PCIe-IPC allreduce "
            "+ norm (its switch on, fusion off) is faster (the crossover lies between 64 KiB and 128 KiB: not narrowed "
            "down by the measurement)") in lines
    entry = json_of(path)["entries"]["4"]
    assert entry["unfused"] == "sglang-pcie-ipc" and entry["table"] == rows
    assert entry["table"][0]["sglang_pcie_ipc_us"] == 9.0 and "sglang_pcie_ipc_us" not in entry["table"][-1]
    document = json.loads(tuned("--hidden", "4096", "--profile", str(path), "--json", pcie_ipc=[SGLANG_PATH, vllm],
                                rows=rows, made=made).stdout)
    assert document["pcie_ipc"] == made and document["entry"]["table"] == rows


def test_where_sglang_does_not_import_its_tune_batches_are_its_own(wheel_cache):
    """The worker's fallback sizes SGLang's tune batches as pcie_ipc_ar.py's _tune_batches does
    (read from the 0.5.21 and 0.5.23 wheels and run here), for the widths a server gets."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("worker", Path(bench.__file__).with_name("_bench_worker.py"))
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    for version in ("0.5.21", "0.5.23"):
        with zipfile.ZipFile(fetch_wheel("sglang", version, wheel_cache)) as wheel:
            tree = ast.parse(wheel.read("sglang/srt/distributed/device_communicators/pcie_ipc_ar.py").decode())
        function = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_tune_batches")
        namespace: dict = {}
        exec(compile(ast.Module([function], []), "pcie_ipc_ar.py", "exec"), namespace)
        for rows in (1, 8, 48, 64, 160, 256, 512, 700, 2048):
            assert worker.pcie_ipc_batches(rows) == namespace["_tune_batches"](rows), rows


def test_a_pcie_ipc_path_its_server_sends_no_size_to_has_no_column(tuned, tmp_path):
    """Made, but at no size measured would the server send it there (SGLang's path at fp16: it
    serves bf16 only): no column, not named as checked, and the line says where it did not run."""
    rows = pcie_rows()
    for row in rows:
        row["not_run"] = ["sglang-pcie-ipc"]
    made = [dict(SGLANG_PATH, how="the server's own PcieIpcCommunicator", error=None)]
    result = tuned("--hidden", "4096", "--profile", str(tmp_path / "p.json"), pcie_ipc=[SGLANG_PATH], rows=rows,
                   made=made)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    header = next(line for line in lines if line.strip().startswith("tokens"))
    assert header.split() == ["tokens", "size", "one-shot", "two-shot", "NCCL+norm"]
    assert next(line for line in lines if line.startswith("check:")).startswith(
        "check: one-shot, two-shot and NCCL + fused_add_rmsnorm each matched")
    assert any(line.endswith("not run at 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048 tokens (the server sends "
                             "those to NCCL)") for line in lines)


# -- hostile profiles: status and the tuner say one line, and the tuner before it measures ------

from sm120patch import tunedlimits  # noqa: E402


def hostile_profiles() -> list[tuple[str, bytes, str]]:
    """(what, the file's bytes, what sm120patch says of it): the shapes issue #60 item 8 and #61
    item 8 name, each in a profile otherwise made on this box."""
    box = runtime._sm120patch_box()

    def document(**entries) -> bytes:
        return json.dumps({"kind": profile.KIND, "format": 1, "box": box, "entries": entries}).encode()

    good = pcie_entry()
    return [
        ("a TP key str.isdigit() takes and int() refuses", document(**{"²": good}), "entry '²' is not a TP size"),
        ("a TP key the server never looks up", document(**{"04": good}),
         "entry '04' is not a TP size as the server looks it up (4)"),
        ("a dtype that is a list", document(**{"4": dict(good, dtype=["bf16"])}),
         "a part of it is not of the type a profile holds (TypeError)"),
        ("NCCL settings that are not an object", document(**{"4": dict(good, nccl_env=["NCCL_P2P_LEVEL=PHB"])}),
         "TP4: its NCCL settings are not names and values"),
        ("releases that are not strings", document(**{"4": dict(good, software={"torch": [2, 11]})}),
         "TP4: its releases are not names and versions"),
        ("nesting deeper than json reads", b"[" * 100000 + b"]" * 100000, "nested too deeply"),
    ]


@pytest.mark.parametrize("what, content, said", hostile_profiles(), ids=[h[0] for h in hostile_profiles()])
def test_status_reads_a_hostile_profile_as_one_reason(tmp_path, what, content, said):
    """Issue #60 item 8: what status reads (tunedlimits.read) never raises; it says why the
    profile, or the entry, does not hold, as the server would find (it keeps the release's limits)."""
    path = tmp_path / "tuned-limits.json"
    path.write_bytes(content)
    view = tunedlimits.read(dict(SOFTWARE), {"SM120PATCH_TUNED_LIMITS": str(path)})
    assert not view.entries and said in " ".join((view.problem, *view.others)), view
    document, why = tunedlimits.load(str(path))
    assert (document is None) == (why != "") and tunedlimits.problem(document) if document is not None else True


@pytest.mark.parametrize("what, content, said", hostile_profiles(), ids=[h[0] for h in hostile_profiles()])
def test_the_tuner_refuses_a_profile_it_cannot_merge_into_before_it_measures(tuned, tmp_path, what, content, said):
    """Issue #60 item 8: a file at the profile's path the tuner could not merge into is refused
    before any worker starts (it was found after the whole measurement, or crashed the writer):
    one line, exit 3, the file as it was."""
    path = tmp_path / "tuned-limits.json"
    path.write_bytes(content)
    tuned.config = None
    result = tuned("--hidden", "4096", "--profile", str(path))
    assert result.exit_code == ExitCode.REFUSED, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("sm120patch: error:")]
    assert len(errors) == 1 and said in errors[0] and errors[0].endswith("nothing was measured")
    assert "Traceback" not in result.output and tuned.config is None  # no worker ran
    assert path.read_bytes() == content


def test_the_tuner_refuses_a_path_it_cannot_write_before_it_measures(tuned, tmp_path):
    """A parent that is a file (no user, root included, can make the profile there): exit 4 with
    the way out, before any worker starts."""
    blocker = tmp_path / "etc"
    blocker.write_text("a file, not a directory")
    tuned.config = None
    result = tuned("--hidden", "4096", "--profile", str(blocker / "sm120patch" / "tuned-limits.json"))
    assert result.exit_code == ExitCode.FAILED, result.output
    assert f"cannot write the profile at {blocker}/sm120patch/tuned-limits.json" in result.output
    assert tuned.config is None


def test_status_of_a_real_environment_under_a_hostile_profile_is_one_line_each(read_only_cli, tmp_path, monkeypatch):
    """`status` on the real SGLang 0.5.9 environment with each hostile profile (status reads the
    profile for every server with a fusion chain): no traceback (the CLI runs with exceptions
    raised), the same exit code and the same tp step as with no profile (the environment does not
    have tuned-limits applied, so the step says untuned either way)."""
    path = tmp_path / "tuned-limits.json"
    monkeypatch.setenv("SM120PATCH_TUNED_LIMITS", str(path))
    plain = read_only_cli("status", "--json")
    for what, content, said in hostile_profiles():
        path.write_bytes(content)
        result = read_only_cli("status", "--json")
        assert result.exit_code == plain.exit_code, (what, result.output)
        steps = [s for t in json.loads(result.stdout)["distributions"] if t.get("fusion")
                 for s in t["fusion"]["steps"] if s["id"] == "tp"]
        assert steps and all(s["text"].startswith("untuned") for s in steps), (what, steps)


def test_tuned_on_this_box_names_what_status_cannot_see_the_servers_nccl_settings(tmp_path):
    """Issue #60 item 8: with the target's torch read (no release left unchecked), the tp step of a
    server with tuned-limits applied says the limits hold, and that the server also compares its
    own NCCL settings, which status cannot see, with the profile's (here NCCL_P2P_LEVEL=PHB); an
    entry tuned with another torch is not said to hold, with the reason."""
    from types import SimpleNamespace

    from sm120patch import chain

    path = tmp_path / "tuned-limits.json"
    entries = {"4": pcie_entry(nccl_env={"NCCL_P2P_LEVEL": "PHB"}),
               "8": pcie_entry(8, software=dict(SOFTWARE, torch="2.9.0"))}
    path.write_text(json.dumps({"kind": profile.KIND, "format": 1, "box": runtime._sm120patch_box(), "entries": entries}))
    view = tunedlimits.read(dict(SOFTWARE), {"SM120PATCH_TUNED_LIMITS": str(path)})
    assert [e.tp for e in view.entries] == [4] and view.entries[0].unchecked == ()
    assert view.others == ("TP8: tuned with torch 2.9.0, here 2.11.0+cu130",)
    sglang = load_registry(full=False).get("sglang")
    server = SimpleNamespace(name="sglang", raw_version="0.5.9", applied_ids=frozenset({tunedlimits.PATCH_ID}), former_ids=(),
                             patch_set=SimpleNamespace(patches=[SimpleNamespace(id=tunedlimits.PATCH_ID)]))
    step = chain._tp(sglang, server, chain.Commands(*["sm120patch x"] * 6), view)
    assert step.text.startswith(f"tuned on this box ({path}, ")
    assert step.text.endswith("(the server also checks its own NCCL settings, which status cannot see, against the "
                              "profile's: NCCL_P2P_LEVEL=PHB)")
    assert "torch" not in step.text
