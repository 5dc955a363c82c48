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
# The SGLang release whose tuned layer the tuned-profile test runs (its suite from one_gpu_ranks.py
# servers; the serving interpreter's FlashInfer must be one that release runs with).
TUNED_SUITE = os.environ.get("SM120PATCH_ONE_GPU_TUNED_SUITE", "sglang-tuned-0.5.9")
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


# -- issue #52: the tuner, and SGLang's layer under a tuned-limits profile -----------------------

TUNE_TOKENS = (1, 16, 64, 256)


def tune(world: int, profile: Path, **env) -> tuple[int, dict]:
    """`sm120patch bench --tune` on the patched environment, every rank on this one GPU
    (SM120PATCH_TUNE_ONE_GPU=1, the tuner's test-only switch): its exit code and --json document."""
    import sys

    python = Path(PATCHED)
    environ = dict(environment(PATCHED), SM120PATCH_TUNE_ONE_GPU="1", **env,
                   PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "sm120patch", "bench", "--tune", "--python", str(python),
                           "--jit-cache-base", str(python.parent.parent / "ws"), "--tp", str(world), "--hidden", "4096",
                           "--tokens", ",".join(map(str, TUNE_TOKENS)), "--repeats", "3", "--profile", str(profile),
                           "--json"], capture_output=True, text=True, env=environ, timeout=TIMEOUT + 60)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"tune-tp{world}{'-forced' if env else ''}.txt").write_text(proc.stdout + proc.stderr)
    print(proc.stdout + proc.stderr)
    return proc.returncode, json.loads(proc.stdout)


@pytest.mark.parametrize("world", [2])
def test_tuner_with_ranks_on_one_gpu_checks_every_path_and_writes_no_profile_unless_forced(world, tmp_path):
    """The tuner end to end on one GPU: every pair completes its fused call, every path at every
    size is within tolerance of the float32 reference on every rank, and then it refuses (exit 3)
    to write a profile from time-sliced ranks, saying why; forced by the test-only
    SM120PATCH_TUNE_ALLOW_SHARED_GPU=1, it writes one that the servers' own code accepts on this
    box."""
    from sm120patch import _tuned_runtime as runtime

    profile = tmp_path / "tuned-limits.json"
    code, document = tune(world, profile)
    assert code == 3 and not profile.exists(), document
    [error] = document["errors"]
    assert "ranks 0 and 1 ran on one GPU" in error and "no profile was written" in error
    rows = document["entry"]["table"]
    # The sizes asked for, and any the tuner measured between two of them to narrow a limit down
    # (time-sliced timings may put a crossover anywhere): each checked like the others.
    assert [row["tokens"] for row in rows if not row.get("probe")] == list(TUNE_TOKENS)
    assert [row["tokens"] for row in rows] == sorted(row["tokens"] for row in rows)
    assert all(TUNE_TOKENS[0] < row["tokens"] < TUNE_TOKENS[-1] for row in rows if row.get("probe"))
    for row in rows:
        checks = {k: v for k, v in row.items() if k.endswith("_check")}
        assert "unfused_check" in checks and all(v <= 1.0 for v in checks.values()), row
        assert ("twoshot_check" in checks) == (row["tokens"] > world), row

    code, document = tune(world, profile, SM120PATCH_TUNE_ALLOW_SHARED_GPU="1")
    assert code == 0 and document["errors"] == [] and profile.exists(), document
    # The servers' own code, in the serving interpreter, as a server process judges it at its start.
    judged = subprocess.run([PATCHED, "-c", "import json, sys; ns = {}; exec(open(sys.argv[1]).read(), ns); "
                             "entry, why = ns['_sm120patch_decide'](int(sys.argv[2]), False); "
                             "print(json.dumps([entry is not None, why]))", str(Path(runtime.__file__)), str(world)],
                            capture_output=True, text=True, env=dict(os.environ, SM120PATCH_TUNED_LIMITS=str(profile)))
    assert json.loads(judged.stdout) == [True, ""], judged.stdout + judged.stderr


@pytest.mark.parametrize("world", [2, 4])
def test_sglang_layer_under_a_tuned_profile_takes_each_path_where_it_says(world):
    """SGLang's layer patched with tuned-limits (its own predicate and fused call; 0.5.9 unless
    SM120PATCH_ONE_GPU_TUNED_SUITE names another release's suite, e.g. sglang-tuned-0.5.21), ranks on
    this GPU: under a profile made on this box (fused up to 64 tokens, one-shot up to 16) it takes
    one-shot up to 16 tokens (and at or below the ranks' count), two-shot above, and the unfused path
    past 64, each within tolerance on every rank, and logs the limits; with no profile or a corrupt
    one it fuses every batch with FlashInfer's own one-shot choice, as today's patched server does,
    and logs why once."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from one_gpu_ranks import TUNED_BATCHES, TUNED_TOKENS

    suite = TUNED_SUITE
    out = OUT / f"{suite}-tp{world}.json"
    OUT.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([PATCHED, str(ROOT / "benchmarks" / "one_gpu_ranks.py"), "run", "--world", str(world),
                           "--label", "tuned", "--suites", suite, "--server",
                           f"{suite}={Path(SERVERS) / 'patched' / suite}", "--out", str(out), "--timeout", str(TIMEOUT)],
                          capture_output=True, text=True, env=environment(PATCHED), timeout=TIMEOUT + 60)
    print(proc.stdout + proc.stderr)
    document = json.loads(out.read_text())
    launch = document["launch"]
    assert launch["hung"] == [] and all(code == 0 for code in launch["exit_codes"]), launch
    rows = [r for r in document["records"] if r.get("suite") == suite and "event" not in r]
    assert not [r for r in rows if "error" in r], [r for r in rows if "error" in r]
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    taken = {}
    for row in rows:
        taken.setdefault(row["profile"], {}).setdefault(row["tokens"], set()).add(row["strategy"])
    assert all(len(paths) == 1 for by in taken.values() for paths in by.values()), taken  # every rank alike
    paths = {profile: {t: paths.pop() for t, paths in by.items()} for profile, by in taken.items()}
    fused, oneshot = TUNED_TOKENS["fused"], TUNED_TOKENS["oneshot"]
    assert paths["tuned"] == {t: "unfused" if t > fused else "oneshot" if t <= max(oneshot, world) else "twoshot"
                              for t in TUNED_BATCHES}
    assert paths["none"] == paths["corrupt"] == {t: "oneshot" for t in TUNED_BATCHES}  # FlashInfer's rule at TP2/TP4
    assert {r["handed"] for r in rows if r["profile"] != "tuned"} == {None}
    logs = {e["profile"]: e["log"] for e in document["records"] if e.get("event") == "log" and e.get("rank") == 0}
    assert len(logs["tuned"]) == 1 and logs["tuned"][0].startswith(
        f"sm120patch tuned limits in force at TP{world}: fused up to {fused * 4096 * 2} bytes, "
        f"one-shot up to {oneshot * 4096 * 2} bytes (profile "), logs
    assert len(logs["none"]) == 1 and "no profile at" in logs["none"][0]
    assert len(logs["corrupt"]) == 1 and "cannot read" in logs["corrupt"][0]
