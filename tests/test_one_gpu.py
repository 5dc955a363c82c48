"""Many ranks on one GPU (tests/one_gpu.py): FlashInfer's fused allreduce + residual + RMSNorm at
TP2, TP4 and TP8 on a single GPU, through each workspace path and through the servers' own code,
pristine vs patched (benchmarks/one_gpu_ranks.py), and the lamport-stride bug
(benchmarks/lamport_stride_demo.py --one-gpu). GPU tier only: CI has no GPU and skips it.

On the lent H200: `bash benchmarks/h200_session.sh ranks` (docs/one-gpu.md) makes the
environments and runs these tests. The variables they read:

- SM120PATCH_GPU_PYTHON: the serving interpreter of an environment whose FlashInfer is patched
  (`sm120patch apply`); its JIT cache base is FLASHINFER_WORKSPACE_BASE=<environment>/ws.
- SM120PATCH_GPU_PRISTINE_PYTHON (optional): the same release as released, its cache base
  likewise; with it, each case's outputs are compared bit for bit with the patched ones.
- SM120PATCH_ONE_GPU_SUITES: the suites (default legacy,unified), and
  SM120PATCH_ONE_GPU_SERVERS: a directory with pristine/<suite>.py and patched/<suite>.py for
  the sglang-*/vllm-* suites (the wheel's file, and sm120patch's patched bytes).
- SM120PATCH_ONE_GPU_OUT: where each run's JSON document is written (kept even when a test fails);
  SM120PATCH_ONE_GPU_REUSE_PRISTINE=1 compares with a pristine document already there.
- SM120PATCH_ONE_GPU_TIMEOUT: seconds for all ranks of one run (a rank still running then is
  killed and named).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PATCHED = os.environ.get("SM120PATCH_GPU_PYTHON")
PRISTINE = os.environ.get("SM120PATCH_GPU_PRISTINE_PYTHON")
SUITES = os.environ.get("SM120PATCH_ONE_GPU_SUITES", "legacy,unified")
SERVERS = os.environ.get("SM120PATCH_ONE_GPU_SERVERS")
OUT = Path(os.environ.get("SM120PATCH_ONE_GPU_OUT", "/tmp/one-gpu-results"))
TIMEOUT = float(os.environ.get("SM120PATCH_ONE_GPU_TIMEOUT", "150"))
# SM120PATCH_ONE_GPU_REUSE_PRISTINE=1: a pristine document already in SM120PATCH_ONE_GPU_OUT is
# compared with, not made again (the pristine kernels' outputs are deterministic: same inputs,
# same sha256), when a later device call re-runs only the patched side.
REUSE_PRISTINE = os.environ.get("SM120PATCH_ONE_GPU_REUSE_PRISTINE") == "1"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not PATCHED, reason="needs a CUDA GPU and a serving interpreter with CUDA torch and a "
                       "patched FlashInfer: set SM120PATCH_GPU_PYTHON (benchmarks/h200_session.sh ranks makes "
                       "them on the lent H200)"),
]


def environment(python: str) -> dict:
    """The rank processes' environment: the serving interpreter's JIT cache base, sm_90a and the
    build's cores as the session built it; the launcher adds the multicast-off variables."""
    return dict(os.environ, FLASHINFER_WORKSPACE_BASE=str(Path(python).parent.parent / "ws"))


def run_suites(label: str, python: str, world: int) -> dict:
    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / f"{label}-tp{world}.json"
    if label == "pristine" and REUSE_PRISTINE and out.exists():
        return json.loads(out.read_text())  # pristine's outputs, made by an earlier call on this machine
    servers = []
    for suite in SUITES.split(","):
        if suite.startswith(("sglang-", "vllm-")):
            servers += ["--server", f"{suite}={Path(SERVERS) / label / (suite + '.py')}"]
    proc = subprocess.run([python, str(ROOT / "benchmarks" / "one_gpu_ranks.py"), "run", "--world", str(world),
                           "--label", label, "--suites", SUITES, *servers, "--out", str(out),
                           "--timeout", str(TIMEOUT)], capture_output=True, text=True, env=environment(python),
                          timeout=TIMEOUT + 60)
    print(proc.stdout + proc.stderr)
    assert out.exists(), proc.stdout + proc.stderr
    return json.loads(out.read_text())


@pytest.mark.parametrize("world", [2, 4, 8])
def test_patched_fused_outputs_are_within_tolerance_and_bit_identical_to_pristine(world):
    """Patched: every suite creates its workspace and every case is within the bf16 tolerance of
    the float32 reference on every rank, no rank hangs, no cuMulticast* call is made (the shim
    would refuse it: it must not even be tried). Pristine, where given, is run first and
    recorded; wherever both ran a case, the outputs are bit-identical (on SM90 the patch set
    changes no kernel code the fused path runs)."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from one_gpu_ranks import CASES, outcome

    pristine = run_suites("pristine", PRISTINE, world) if PRISTINE else None
    patched = run_suites("patched", PATCHED, world)
    launch = patched["launch"]
    assert launch["hung"] == [], f"rank(s) {launch['hung']} hung at TP{world}: {launch['tails']}"
    assert all(code == 0 for code in launch["exit_codes"]), launch
    done = [r for r in patched["records"] if r.get("event") == "done"]
    assert len(done) == world and all(r["multicast_calls"] == [] for r in done), done
    for suite in patched["suites"]:
        result = outcome(patched, suite)
        assert not result["fell_back"] and not result["raised"], (suite, result["raised"], result["log"])
        expected = sum(1 for tokens, strategy in CASES if strategy == "oneshot" or tokens > world)
        assert len(result["complete"]) == expected, (suite, sorted(result["cases"]))
        over = {case: max(r["worst_ratio"] for r in rows) for case, rows in result["complete"].items()
                if not all(r["ok"] for r in rows)}
        assert not over, f"{suite} at TP{world}: outside tolerance (ratio to the tolerance): {over}"
        if pristine and suite in pristine["suites"]:
            base = outcome(pristine, suite)["complete"]
            for case in set(base) & set(result["complete"]):
                a = sorted(base[case], key=lambda r: r["rank"])
                b = sorted(result["complete"][case], key=lambda r: r["rank"])
                assert [r["digests"] for r in a] == [r["digests"] for r in b], f"{suite} {case}: not bit-identical"


@pytest.mark.parametrize("world", [2, 4, 8])
def test_lamport_stride_patched_is_correct_where_pristine_is_recorded(world):
    """benchmarks/lamport_stride_demo.py --one-gpu, first round (three consecutive flags: the
    three lamport buffer sets): patched, every rank's every call is correct; pristine (where
    given) is run first and its outcome recorded beside it (what the bug does at this TP)."""
    OUT.mkdir(parents=True, exist_ok=True)
    results = {}
    for label, python in (("pristine", PRISTINE), ("patched", PATCHED)):
        if not python:
            continue
        out = OUT / f"lamport-{label}-tp{world}.json"
        proc = subprocess.run([python, str(ROOT / "benchmarks" / "lamport_stride_demo.py"), "--one-gpu",
                               "--world", str(world), "--rounds", "1", "--timeout", "45", "--json", str(out)],
                              capture_output=True, text=True, env=environment(python), timeout=200)
        (OUT / f"lamport-{label}-tp{world}.txt").write_text(proc.stdout + proc.stderr)
        print(proc.stdout + proc.stderr)
        assert out.exists(), proc.stdout + proc.stderr
        results[label] = json.loads(out.read_text())
    patched = results["patched"]
    rnd = patched["rounds"][0]
    assert not rnd["hung"], f"patched TP{world}: rank(s) {rnd['hung_ranks']} hung"
    assert patched["correct"] == world * patched["calls"], (OUT / f"lamport-patched-tp{world}.txt").read_text()
