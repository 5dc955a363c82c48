"""vLLM, the third distribution: status and doctor say whether its fusion pass can run on SM120
as installed and how to turn it on, apply/revert act on its tables, a checkout takes one commit.
Real vLLM wheels (~400 MB each, cached): 0.10.2 (before the capability gate), 0.19.0 (fusion-table
required, auto-enable opt-in), 0.29.0 (every patch opt-in); the matrix covers one release per layout."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import git
import pytest

from helpers import FLASHINFER_VERSION, ServingEnv, Session, changed, make_venv, run_cli, snapshot
from sm120patch.errors import ExitCode
from sm120patch.wheels import fetch_wheel

TABLES = "vllm/compilation/passes/fusion/allreduce_rms_fusion.py"
STAYS_OFF = "as installed: the fusion pass stays off on SM120"
SIZES_ITSELF = "as installed: the fusion pass sizes itself on SM120"


def vllm_env(tmp_path: Path, version: str, *others: Path) -> ServingEnv:
    root = tmp_path / "venv"
    make_venv(root, [fetch_wheel("vllm", version), *others])
    (tmp_path / "home").mkdir()
    return ServingEnv(root, tmp_path / "home")


@pytest.mark.wheels  # fetches a real vLLM wheel itself (no wheel fixture marks it)
def test_status_says_the_pass_stays_off_until_fusion_table_and_how_to_turn_it_on(tmp_path, flashinfer_wheel):
    env = vllm_env(tmp_path, "0.19.0", flashinfer_wheel)
    session = Session(env)
    before = snapshot(env)

    status = session("status")
    assert status.exit_code == ExitCode.NOT_OK
    assert "vllm 0.19.0: not patched" in status.output
    assert f"vllm 0.19.0 {STAYS_OFF}" in status.output and SIZES_ITSELF not in status.output
    assert """--compilation-config '{"pass_config": {"fuse_allreduce_rms": true}}'""" in status.output
    assert f"vllm 0.19.0 pins flashinfer-python==0.6.6; {FLASHINFER_VERSION} is installed" in status.output

    diff = session("diff", "--vllm")
    assert diff.exit_code == 0 and diff.output.count("+    120: {") == 2 and f"+++ b/{TABLES}" in diff.output
    applied = session("apply", "--vllm")  # vLLM alone: FlashInfer stays as it is
    assert applied.exit_code == 0, applied.output
    assert "vllm 0.19.0: patched 1 file" in applied.output and "flashinfer-python" not in applied.output
    assert [p for p in changed(before, snapshot(env)) if "/.sm120patch" not in p] == [str(env.file(TABLES))]

    document = json.loads(session("status", "--json").output)
    vllm = next(d for d in document["distributions"] if d["name"] == "vllm")
    assert vllm["state"] == "patched"
    texts = [a["text"] for a in vllm["advice"]]
    assert any(SIZES_ITSELF in t for t in texts) and not any(STAYS_OFF in t for t in texts)
    assert {p["id"]: p["state"] for p in vllm["patches"]} == {"fusion-table": "applied", "auto-enable": "pristine",
                                                                 "tuned-limits": "pristine"}

    doctor = session("doctor")
    assert f"vllm 0.19.0 {SIZES_ITSELF}" in doctor.output
    # FlashInfer stayed as released: the chain blocks there, and doctor says so with the command.
    assert (f"vllm 0.19.0 will not fuse on SM120: flashinfer-python {FLASHINFER_VERSION}'s SM120 gates are closed"
            in doctor.output)

    assert session("revert").exit_code == 0
    assert changed(before, snapshot(env)) == []


@pytest.mark.wheels  # fetches a real vLLM wheel itself (no wheel fixture marks it)
def test_a_release_before_the_capability_gate_needs_nothing(tmp_path):
    env = vllm_env(tmp_path, "0.10.2")
    session = Session(env)
    before = snapshot(env)
    status = session("status")
    assert status.exit_code == ExitCode.OK
    assert "vllm 0.10.2: nothing to patch" in status.output
    assert "needs only FlashInfer's patch and the flag" in status.output
    assert """'{"pass_config": {"enable_fi_allreduce_fusion": true}}'""" in status.output
    assert "fusion-table" not in status.output  # no patch listed for a release that takes none
    applied = session("apply")
    assert applied.exit_code == 0 and "vllm 0.10.2: nothing to do" in applied.output
    assert session("verify").exit_code == 0
    assert changed(before, snapshot(env)) == []


@pytest.mark.wheels  # fetches a real vLLM wheel itself (no wheel fixture marks it)
def test_from_0_29_every_patch_is_opt_in_and_status_says_why(tmp_path):
    env = vllm_env(tmp_path, "0.29.0")
    session = Session(env)
    before = snapshot(env)
    status = session("status")
    assert status.exit_code == ExitCode.OK
    assert "vllm 0.29.0: nothing required (opt-in patches only)" in status.output
    assert "also sends them through FlashInfer on SM120" in status.output
    assert "patched" not in status.output.split("vllm 0.29.0:")[1].splitlines()[0]
    fusion = next(d for d in json.loads(session("status", "--json").output)["distributions"]
                  if d["name"] == "vllm")["fusion"]
    assert fusion["headline"].startswith("vllm 0.29.0 will not fuse on SM120: flashinfer-python is not installed")
    gate = next(s for s in fusion["steps"] if s["id"] == "server-gates")
    assert gate["result"] == "ok" and gate["condition"] == "pass_config.fi_allreduce_fusion_max_size_mb set in its --compilation-config"
    assert "(or `--with fusion-table`)" in gate["text"]
    applied = session("apply", "--vllm")
    assert applied.exit_code == 0, applied.output
    assert "patched" not in applied.output  # nothing was, so nothing is claimed
    assert changed(before, snapshot(env)) == []

    opted = session("apply", "--vllm", "--with", "fusion-table")
    assert opted.exit_code == 0 and "vllm 0.29.0: patched 1 file" in opted.output
    assert "vllm 0.29.0: patched" in session("status").output
    fusion = next(d for d in json.loads(session("status", "--json").output)["distributions"]
                  if d["name"] == "vllm")["fusion"]
    assert next(s for s in fusion["steps"] if s["id"] == "server-gates")["condition"] is None
    verified = session("verify")
    assert verified.exit_code == 0 and "FI_ALLREDUCE_FUSION_MAX_SIZE_MB keys: [90, 120, 100, 103, 107]" in verified.output
    assert session("revert").exit_code == 0
    assert changed(before, snapshot(env)) == []


def test_list_shows_vllm_ranges_and_what_needs_nothing():
    result = run_cli("list")
    assert result.exit_code == 0
    lines = result.output.split("vllm (--vllm)")[1].splitlines()
    assert any(line.split()[:3] == ["0.19.0", "to", "0.28.0"] and "fusion-table" in line for line in lines)
    assert any("0.29.0 to 0.34.0" in line and "opt-in: fusion-table, auto-enable" in line for line in lines)
    assert any("from 0.10.0, before 0.11.1" in line and "nothing to patch" in line for line in lines)


@pytest.fixture
def vllm_repo(tmp_path) -> git.Repo:
    """vLLM's repository layout (the package at the top) from the real 0.19.0 wheel's Python files."""
    root = tmp_path / "vllm"
    with zipfile.ZipFile(fetch_wheel("vllm", "0.19.0")) as archive:
        for name in archive.namelist():
            if name.startswith("vllm/") and name.endswith(".py"):
                path = root / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(archive.read(name))
    repo = git.Repo.init(root, initial_branch="main")
    with repo.config_writer() as config:
        config.set_value("user", "name", "Upstream Dev")
        config.set_value("user", "email", "dev@example.org")
    repo.git.add(A=True)
    repo.index.commit("vLLM v0.19.0")
    repo.create_tag("v0.19.0")
    return repo


@pytest.mark.wheels  # fetches a real vLLM wheel itself (no wheel fixture marks it)
def test_a_vllm_checkout_takes_one_commit_and_the_dry_run_none(vllm_repo):
    root = vllm_repo.working_tree_dir
    head = vllm_repo.head.commit.hexsha
    dry = run_cli("apply", "--source", root, "--with", "auto-enable", "--dry-run")
    assert dry.exit_code == 0 and "+    120: {" in dry.output
    assert vllm_repo.head.commit.hexsha == head and vllm_repo.active_branch.name == "main"
    assert not vllm_repo.is_dirty(untracked_files=True)

    applied = run_cli("apply", "--source", root, "--with", "auto-enable")
    assert applied.exit_code == 0, applied.output
    assert vllm_repo.active_branch.name == "sm120patch/vllm-0.19.0"
    assert sorted(vllm_repo.git.show("--name-only", "--format=", "HEAD").split()) == [TABLES, "vllm/config/vllm.py"]
    assert run_cli("status", "--source", root).exit_code == 0

    assert run_cli("revert", "--source", root).exit_code == 0
    assert vllm_repo.active_branch.name == "main" and vllm_repo.head.commit.hexsha == head


@pytest.mark.parametrize("source, present", [
    ("A: dict[int, dict] = {90: {2: 64}, 120: {2: 64}}\n_FI_ONE = 1\n", None),  # tables missing
    ("FI_ALLREDUCE_FUSION_MAX_SIZE_MB: dict = {90: {}, 120: {}}\n_FI_ALLREDUCE_ONE_SHOT_MAX_SIZES_MB = {90: {}}\n", False),
    ("FI_ALLREDUCE_FUSION_MAX_SIZE_MB = {90: {}, 120: {}}\n_FI_ALLREDUCE_ONE_SHOT_MAX_SIZES_MB: dict = {120: {}}\n", True),
])
def test_the_fusion_table_check_wants_a_120_row_in_both_tables(source, present):
    from sm120patch.semantics import evaluate

    ok, why = evaluate("fusion-table", source.encode())
    assert ok is (present or False) and (present is not None or "no FI_ALLREDUCE_FUSION_MAX_SIZE_MB" in why)


@pytest.mark.parametrize("condition, present", [
    ("p.is_device_capability_family(100) or p.is_device_capability(90)", False),
    ("p.is_device_capability_family(100) or p.is_device_capability(90) or p.is_device_capability(120)", True),
])
def test_the_auto_enable_check_reads_enable_allreduce_rms_fusion(condition, present):
    from sm120patch.semantics import evaluate

    source = f"def enable_allreduce_rms_fusion(cfg):\n    return cfg.tp > 1 and ({condition})\n"
    assert evaluate("vllm-auto-enable", source.encode())[0] is present
    assert evaluate("vllm-auto-enable", f"def other():\n    return {condition}\n".encode())[0] is False


@pytest.mark.wheels  # fetches a real vLLM wheel itself (no wheel fixture marks it)
def test_0_34_added_through_manifest_add_is_covered_by_status_apply_and_revert(tmp_path):
    """vLLM 0.34.0 (2026-11-16): its fusion file is 0.33.0's byte for byte, vllm/config/vllm.py
    changed; `manifest add vllm 0.34.0` pinned it to the 0.29.0 set."""
    env = vllm_env(tmp_path, "0.34.0")
    session = Session(env)
    before = snapshot(env)
    status = session("status")
    assert status.exit_code == ExitCode.OK, status.output
    assert "vllm 0.34.0: nothing required (opt-in patches only)" in status.output
    assert "vllm 0.34.0 pins flashinfer-python==0.7.3" not in status.output  # no FlashInfer installed here
    applied = session("apply", "--vllm", "--with", "fusion-table,auto-enable")
    assert applied.exit_code == 0 and "vllm 0.34.0: patched 2 files" in applied.output, applied.output
    assert sorted(p for p in changed(before, snapshot(env)) if "/.sm120patch" not in p) == sorted(
        str(env.file(f)) for f in (TABLES, "vllm/config/vllm.py"))
    document = json.loads(session("status", "--json").output)
    vllm = next(d for d in document["distributions"] if d["name"] == "vllm")
    assert {p["id"]: p["state"] for p in vllm["patches"]} == {"fusion-table": "applied", "auto-enable": "applied",
                                                                 "tuned-limits": "pristine"}
    verified = session("verify")
    assert verified.exit_code == 0 and "FI_ALLREDUCE_FUSION_MAX_SIZE_MB keys: [90, 120, 100, 103, 107]" in verified.output
    assert session("revert").exit_code == 0
    assert changed(before, snapshot(env)) == []


@pytest.mark.wheels  # fetches a real vLLM wheel itself (no wheel fixture marks it)
def test_a_hand_fixed_jit_gate_is_what_the_fusion_pass_needs_of_flashinfers_kernel_patches(tmp_path, flashinfer_wheel):
    """vLLM 0.19 calls allreduce_fusion (backend trtllm), the fused kernel of
    trtllm_allreduce_fusion.cuh: with FlashInfer's JIT gate opened by hand that kernel builds
    and runs on SM120, so the kernel-gates step is open and says what the rest would complete;
    on a GPU without multicast this pair still needs unicast-workspace, which the workspace step
    says."""
    import subprocess

    env = vllm_env(tmp_path, "0.19.0", flashinfer_wheel)
    session = Session(env)
    subprocess.run(["sed", "-i", r"s/supported_major_versions=\[9, 10\]/supported_major_versions=[9, 10, 12]/",
                    str(env.file("flashinfer/jit/comm.py"))], check=True)
    assert session("apply", "--vllm").exit_code == 0
    fusion = next(d for d in json.loads(session("status", "--json").output)["distributions"]
                  if d["name"] == "vllm")["fusion"]
    steps = {s["id"]: s for s in fusion["steps"]}
    assert steps["kernel-gates"]["result"] == "ok", steps["kernel-gates"]
    assert steps["kernel-gates"]["text"] == (f"flashinfer-python {FLASHINFER_VERSION}'s SM120 gates are open for vllm "
                                             "0.19.0's fused call (trtllm_allreduce_fusion.cuh's fused kernel): jit-gate applied")
    assert "they complete upstream's fix of kernels vllm does not call" in steps["kernel-gates"]["note"]
    assert steps["workspace"]["result"] == "blocks" and "unicast-workspace" in steps["workspace"]["text"]
    assert fusion["verdict"] == "will not fuse" and "unicast-workspace" in fusion["headline"]
