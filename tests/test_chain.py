"""The fusion chain (chain.py) and its headline, on the real FlashInfer 0.6.4 + SGLang 0.5.9
wheels (the README's pair): each state a user meets, from pristine to fused, as status prints
it and as --json carries every step. A changed sentence or step fails here."""

from __future__ import annotations

import json
import os
import shlex
import subprocess

import pytest

from helpers import FLASHINFER_VERSION, SGLANG_VERSION, changed, run_cli, snapshot
from sm120patch import chain, driver, pipeline

pytestmark = pytest.mark.wheels

FLAG = "--enable-flashinfer-allreduce-fusion"


def fusion_of(sm120patch, *args: str) -> dict:
    """sglang's fusion chain from status --json."""
    result = sm120patch("status", "--json", *args)
    document = json.loads(result.output)
    return next(d for d in document["distributions"] if d["name"] == "sglang")["fusion"]


def results(fusion: dict) -> dict[str, str]:
    return {s["id"]: s["result"] for s in fusion["steps"]}


def headline(output: str) -> str:
    lines = output.splitlines()
    at = lines.index("Will it fuse?")
    return lines[at + 1]


def commands(sm120patch, words: str) -> str:
    env = sm120patch.env
    return shlex.join(["sm120patch", *words.split(), "--python", str(env.python), "--jit-cache-base", str(env.home)])


def test_pristine_says_it_will_not_fuse_and_why_with_the_command_that_fixes_it(sm120patch):
    fusion = fusion_of(sm120patch)
    apply = commands(sm120patch, "apply")
    assert fusion["verdict"] == "will not fuse"
    assert fusion["headline"] == (
        f"sglang {SGLANG_VERSION} will not fuse on SM120: flashinfer-python {FLASHINFER_VERSION}'s SM120 gates are "
        f"closed (not patched: jit-gate not applied): sglang {SGLANG_VERSION} calls trtllm_allreduce_fusion.cuh's "
        f"fused kernel, and without jit-gate its JIT module does not build for SM120 — `{apply}`")
    assert results(fusion) == {"device": "unknown", "kernel-gates": "blocks", "server-gates": "blocks",
                               "requested": "ok", "workspace": "ok", "jit": "ok", "tp": "ok"}
    steps = {s["id"]: s for s in fusion["steps"]}
    assert steps["server-gates"]["text"] == f"sglang {SGLANG_VERSION}'s SM120 gates are closed (not patched: fusion-gate not applied)"
    assert steps["kernel-gates"]["fix"] == steps["server-gates"]["fix"] == apply
    assert steps["device"]["fix"] == commands(sm120patch, "doctor")
    assert steps["requested"]["condition"] == FLAG
    # The text report leads with the same sentence, marked.
    assert headline(sm120patch("status").output) == "  ! " + fusion["headline"]


def test_after_apply_it_names_the_flag_and_that_the_first_start_compiles(sm120patch):
    printed = fusion_of(sm120patch)["headline"].rsplit("`", 2)[1]
    assert run_cli(*shlex.split(printed)[1:]).exit_code == 0  # the fix, run exactly as printed
    fusion = fusion_of(sm120patch)
    assert fusion["verdict"] == "will fuse"
    assert fusion["conditions"] == [FLAG]
    # status never reads the GPUs: the sentence is about an SM120 GPU, and names what reads this machine's.
    assert fusion["headline"] == (
        f"sglang {SGLANG_VERSION} will fuse on an SM120 GPU when started with `{FLAG}`; its first start compiles "
        f"trtllm_comm (minutes per rank's first call): `{commands(sm120patch, 'build')}` builds it now — this "
        f"machine's GPUs: `{commands(sm120patch, 'doctor')}`")
    assert results(fusion) == {"device": "unknown", "kernel-gates": "ok", "server-gates": "ok", "requested": "ok",
                               "workspace": "ok", "jit": "ok", "tp": "ok"}
    jit = next(s for s in fusion["steps"] if s["id"] == "jit")
    assert jit["text"].startswith(f"no trtllm_comm built for {FLASHINFER_VERSION} in ") and jit["note"]


def test_auto_enable_applied_fuses_without_a_flag(sm120patch):
    assert sm120patch("apply", "--with", "auto-enable").exit_code == 0
    fusion = fusion_of(sm120patch)
    assert fusion["verdict"] == "will fuse" and fusion["conditions"] == []
    assert fusion["headline"].startswith(
        f"sglang {SGLANG_VERSION} will fuse on an SM120 GPU without a flag: auto-enable applied, on by default on one node at "
        f"TP2, for the models SGLang auto-enables fusion for (TP4 and TP8 still need the flag); otherwise with {FLAG};")


def test_a_built_entry_drops_the_first_start_note_and_a_stale_one_blocks_until_apply_removes_it(sm120patch):
    env = sm120patch.env
    assert sm120patch("apply").exit_code == 0
    env.seed_jit(archs=("120a",), modules=("trtllm_comm",))
    fusion = fusion_of(sm120patch)
    assert fusion["headline"] == (f"sglang {SGLANG_VERSION} will fuse on an SM120 GPU when started with `{FLAG}` — "
                                  f"this machine's GPUs: `{commands(sm120patch, 'doctor')}`")
    jit = next(s for s in fusion["steps"] if s["id"] == "jit")
    assert jit["result"] == "ok" and jit["text"].endswith(" for 120a") and jit["note"] is None

    # An entry older than the patched sources (built before the patch, restored from a backup):
    # FlashInfer would load it as it is.
    entry = env.jit_entry("120a", "trtllm_comm")
    for path in entry.iterdir():
        os.utime(path, (0, 0))
    fusion = fusion_of(sm120patch)
    assert fusion["verdict"] == "will not fuse"
    assert results(fusion)["jit"] == "blocks"
    assert fusion["headline"] == (f"sglang {SGLANG_VERSION} will not fuse on SM120: {entry} was built before its sources "
                                  f"last changed, and FlashInfer loads it as it is — `{commands(sm120patch, 'apply')}`")
    assert run_cli(*shlex.split(fusion["headline"].rsplit("`", 2)[1])[1:]).exit_code == 0
    assert not entry.exists()
    assert fusion_of(sm120patch)["verdict"] == "will fuse"


def test_partly_patched_blocks_at_the_server_and_a_selector_makes_the_kernels_unknown(sm120patch):
    assert sm120patch("apply", "--flashinfer").exit_code == 0
    fusion = fusion_of(sm120patch)
    assert results(fusion)["kernel-gates"] == "ok" and results(fusion)["server-gates"] == "blocks"
    assert fusion["headline"].startswith(f"sglang {SGLANG_VERSION} will not fuse on SM120: sglang {SGLANG_VERSION}'s "
                                         "SM120 gates are closed")
    assert sm120patch("apply", "--sglang").exit_code == 0
    # FlashInfer left out by the selector: its gates are not known, so neither is the verdict.
    only = fusion_of(sm120patch, "--sglang")
    assert only["verdict"] == "not known"
    assert results(only)["kernel-gates"] == "unknown"
    assert only["headline"].startswith(f"sglang {SGLANG_VERSION}: whether it fuses on SM120 is not known: "
                                       f"flashinfer-python {FLASHINFER_VERSION} was not assessed in this run")


def _devices(capability: tuple[int, int], multicast: bool, peers: bool = True) -> driver.DriverFacts:
    devices = tuple(driver.Device(i, "GPU", capability, multicast, True, False) for i in range(2))
    return driver.DriverFacts(devices=devices, peer_access={(0, 1): peers, (1, 0): peers})


def test_the_device_step_judged_with_the_drivers_answers(read_only_env):
    """What doctor and bench pass in: on SM90 upstream fuses without a patch (the pristine gates
    do not block there); on SM120 the pristine gates do; no peer access blocks at the device."""
    request = pipeline.Request(python=str(read_only_env.python), jit_base=str(read_only_env.home))
    before = snapshot(read_only_env)

    def chain_for(facts):
        report = pipeline.status(request, device=facts)
        return next(t.chain for t in report.trees if t.chain is not None)

    hopper = chain_for(_devices((9, 0), multicast=False))
    assert hopper.verdict == "will fuse" and hopper.upstream_device == "SM90"
    assert hopper.headline.startswith(f"sglang {SGLANG_VERSION} will fuse on these GPUs (SM90) when started with `{FLAG}`")
    assert hopper.step("kernel-gates").text == "not needed on SM90: upstream supports it"

    blackwell = chain_for(_devices((12, 0), multicast=False))
    assert blackwell.step("device").result is chain.StepResult.OK
    assert blackwell.step("device").text == "2 GPUs, compute capability 12.0; no multicast; peer access between every pair"
    assert blackwell.blocking.id == "kernel-gates"

    no_peers = chain_for(_devices((12, 0), multicast=False, peers=False))
    assert no_peers.blocking.id == "device" and "no peer access GPU0->GPU1, GPU1->GPU0" in no_peers.blocking.text
    assert snapshot(read_only_env) == before


def test_status_and_apply_end_with_the_next_step_from_the_chain(sm120patch):
    """Unpatched, status ends with the apply command; apply ends with the start (the release's
    flag, and the build that saves the first start its compile), each runnable as printed."""
    status = sm120patch("status").output.splitlines()
    assert status[-1] == f"next: `{commands(sm120patch, 'apply')}`"
    applied = sm120patch("apply")
    assert applied.exit_code == 0
    last = applied.output.splitlines()[-4:]
    assert last == [f"next: 1. `{commands(sm120patch, 'build')}` (compiles trtllm_comm now, so that the start does not)",
                    f"      2. `{commands(sm120patch, 'bench --tune --model YOUR_MODEL_DIR')}` (measures where fusion wins on these GPUs; "
                    "`apply --with tuned-limits` then keeps the server to it)",
                    f"      3. restart the server with `{FLAG}`",
                    "      4. check-log on its log says whether it fused (`sm120patch check-log --help`)"]
    assert all(len(line) <= 100 for line in last[2:]), last  # the prose; a command is never wrapped
    assert run_cli("check-log", "--help").exit_code == 0
    assert sm120patch("status").output.splitlines()[-4:] == last
    assert json.loads(sm120patch("status", "--json").output)["next"] == [
        {"command": commands(sm120patch, "build"), "reason": "compiles trtllm_comm now, so that the start does not"},
        {"command": commands(sm120patch, "bench --tune --model YOUR_MODEL_DIR"),
         "reason": "measures where fusion wins on these GPUs; `apply --with tuned-limits` then keeps the server to it"},
        {"command": None, "reason": f"restart the server with {FLAG}"},
        {"command": None, "reason": "check-log on its log says whether it fused"}]


def test_the_tp_step_says_which_limits_are_in_force(sm120patch, tmp_path, monkeypatch):
    """Untuned (what the release's own limits do, and the command that measures), a profile that
    holds but is not read, tuned (the limits, where from), tuned-limits applied without a profile."""
    from sm120patch import _tuned_runtime

    profile = tmp_path / "tuned-limits.json"
    monkeypatch.setenv("SM120PATCH_TUNED_LIMITS", str(profile))

    def tp() -> dict:
        return next(s for s in fusion_of(sm120patch)["steps"] if s["id"] == "tp")

    untuned = tp()
    assert untuned["result"] == "ok"
    assert untuned["text"].startswith("untuned: SGLang fuses every batch of up to 2048 tokens")
    assert untuned["note"].startswith(f"`{commands(sm120patch, 'bench --tune --model YOUR_MODEL_DIR')}` (measures where fusion wins")
    software = {"flashinfer-python": FLASHINFER_VERSION, "sglang": SGLANG_VERSION, "torch": "2.11.0+cu130"}
    entry = {"created": "2026-12-05T01:30:00Z", "software": software, "nccl_env": {}, "dtype": "bf16", "hidden": 4096,
             "fused_max_bytes": 64 * 4096 * 2, "oneshot_max_bytes": 16 * 4096 * 2}
    profile.write_text(json.dumps({"kind": "sm120patch tuned limits", "format": 1,
                                   "box": _tuned_runtime._sm120patch_box(), "entries": {"4": entry}}))
    limits = "TP4: fused up to 512 KiB per rank (64 tokens at hidden 4096, bf16), one-shot up to 128 KiB"
    held = tp()
    assert held["text"].startswith(f"untuned: a profile holds for this box ({limits}), but sglang {SGLANG_VERSION} "
                                   "reads it only with tuned-limits applied")
    assert held["note"] == f"`{commands(sm120patch, 'apply --with tuned-limits')}` (the server then keeps to the profile)"
    assert sm120patch("apply", "--with", "tuned-limits").exit_code == 0
    tuned = tp()
    assert tuned["result"] == "ok"
    assert tuned["text"] == (f"tuned on this box ({profile}, 2026-12-05T01:30:00Z): {limits}; other TP sizes: the "
                             "release's own limits (the server also checks torch and its NCCL settings against the profile)"
                             f"; `{commands(sm120patch, 'verify --tuned')}` runs the server's decisions under it")
    assert tuned["note"] is None
    chain = fusion_of(sm120patch)
    assert chain["verdict"] == "will fuse"
    assert "; tuned limits at TP4 (the profile holds for this box as sm120patch reads it)" in chain["headline"]
    profile.unlink()
    # Tuning applied, no profile: not ok (the release's B200 limits apply), the command that measures, and the
    # headline says it.
    gone = tp()
    assert gone["result"] == "warn"
    assert gone["text"].startswith(f"tuned-limits applied, but no profile holds here (no profile at {profile}): the "
                                   "release's own limits apply, tuned on NVLink B200s (SGLang fuses every batch")
    assert gone["fix"] == commands(sm120patch, "bench --tune --model YOUR_MODEL_DIR")
    chain = fusion_of(sm120patch)
    assert chain["verdict"] == "will fuse"
    assert "; tuned-limits applied but no profile holds: the release's B200 limits apply" in chain["headline"]


# The field report's hand fix, as its user ran it on the installed files (sed, nothing else): the
# JIT gate's list, and SM120 in SGLang 0.5.9's fusion predicate.
HAND_FIX = {
    "flashinfer/jit/comm.py": [r"s/supported_major_versions=\[9, 10\]/supported_major_versions=[9, 10, 12]/"],
    "sglang/srt/layers/communicator.py": [
        r"s/^    is_sm100_supported,$/    is_sm100_supported,\n    is_sm120_supported,/",
        r"s/^_is_sm100_supported = _is_cuda and is_sm100_supported()$/&\n_is_sm120_supported = _is_cuda and is_sm120_supported()/",
        r"s/(_is_sm90_supported or _is_sm100_supported)/(_is_sm90_supported or _is_sm100_supported or _is_sm120_supported)/",
    ],
}


def test_the_field_reports_hand_fix_fuses_says_what_is_missing_and_apply_completes_it(sm120patch):
    """SGLang 0.5.9 calls trtllm_allreduce_fusion, whose kernel (trtllm_allreduce_fusion.cuh)
    has no `< 1200` bound: with the JIT gate and the predicate opened by hand it builds and runs
    on SM120. The chain says so, names what is missing and what it means, and `apply` adopts the
    hand edits and completes them; revert gives back the release's bytes."""
    env = sm120patch.env
    release = snapshot(env)
    for relpath, script in HAND_FIX.items():
        subprocess.run(["sed", "-i", *(a for s in script for a in ("-e", s)), str(env.file(relpath))], check=True)
    assert changed(release, snapshot(env)) == sorted(str(env.file(r)) for r in HAND_FIX)

    fusion = fusion_of(sm120patch)
    assert fusion["verdict"] == "will fuse", fusion["headline"]
    assert results(fusion) == {"device": "unknown", "kernel-gates": "ok", "server-gates": "ok", "requested": "ok",
                               "workspace": "ok", "jit": "ok", "tp": "ok"}
    kernel = next(s for s in fusion["steps"] if s["id"] == "kernel-gates")
    assert kernel["text"] == (f"flashinfer-python {FLASHINFER_VERSION}'s SM120 gates are open for sglang {SGLANG_VERSION}'s "
                              "fused call (trtllm_allreduce_fusion.cuh's fused kernel): jit-gate applied")
    assert kernel["note"].startswith(f"flashinfer-python {FLASHINFER_VERSION} is partly patched: cluster-clamp not applied: "
                                     "the fused kernel launches its thread-block cluster as released")
    assert ("; pdl-gates, lamport-stride, cluster-clamp-moe, cluster-clamp-custom not applied: they complete upstream's "
            "fix of kernels sglang does not call (the plain custom allreduce, the MoE fusion) — `apply` completes it"
            in kernel["note"])
    assert fusion["headline"].startswith(f"sglang {SGLANG_VERSION} will fuse on an SM120 GPU when started with `{FLAG}`; "
                                         f"{kernel['note']}; its first start compiles trtllm_comm")
    status = sm120patch("status")
    assert status.exit_code == 1  # partly patched: not done, and status says what it will do all the same
    assert headline(status.output) == "  - " + fusion["headline"]
    assert f"`{commands(sm120patch, 'apply')}` (completes the partial patch" in status.output

    applied = sm120patch("apply")
    assert applied.exit_code == 0, applied.output
    fusion = fusion_of(sm120patch)
    kernel = next(s for s in fusion["steps"] if s["id"] == "kernel-gates")
    assert kernel["text"] == (f"flashinfer-python {FLASHINFER_VERSION}'s SM120 gates are open (jit-gate, pdl-gates, "
                              "lamport-stride, cluster-clamp, cluster-clamp-moe, cluster-clamp-custom applied)")
    assert not kernel["note"] and fusion["verdict"] == "will fuse"
    document = json.loads(sm120patch("status", "--json").output)
    assert {d["name"]: d["state"] for d in document["distributions"]} == {"flashinfer-python": "patched",
                                                                         "sglang": "patched"}

    assert sm120patch("revert").exit_code == 0
    assert changed(release, snapshot(env)) == []



def test_the_headline_never_says_will_fuse_on_sm120_while_the_gpus_are_not_known():
    """status never reads the GPUs, doctor cannot where the driver does not answer: every other
    step holding, the sentence is about an SM120 GPU and says how this machine's are read, or that
    they are not known and why; with the driver's SM120 answer it is about this machine."""
    commands = chain.Commands(*(f"sm120patch {word} --python /srv/env/bin/python" for word in chain.Commands._fields))
    ok = tuple(chain.Step(step, chain.StepResult.OK, "holds") for step in chain.STEPS[1:])
    requested = chain.Step("requested", chain.StepResult.OK, "on with the flag", condition=FLAG)
    rest = tuple(requested if s.id == "requested" else s for s in ok)

    def headline(facts):
        return chain.Chain("sglang 0.5.9", (chain._device(facts, commands), *rest), None).headline

    assert headline(None) == (f"sglang 0.5.9 will fuse on an SM120 GPU when started with `{FLAG}` — this machine's "
                              f"GPUs: `{commands.doctor}`")
    unread = headline(driver.DriverFacts(error="no CUDA driver (libcuda.so.1 not found)"))
    assert unread == (f"sglang 0.5.9 will fuse on an SM120 GPU when started with `{FLAG}` — this machine's GPUs are "
                      "not known: the driver was not read (no CUDA driver (libcuda.so.1 not found))")
    assert headline(_devices((12, 0), multicast=False)) == f"sglang 0.5.9 will fuse on SM120 when started with `{FLAG}`"
