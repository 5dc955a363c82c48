"""Hostile inputs: each gets one clear line (no traceback), a documented exit code, and no
change to the environment (every file under it and under its JIT cache base is hashed before
and after)."""

from __future__ import annotations

import re

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import (
    COMM, HEADER, ROOT, ServingEnv, changed, make_venv, need, one_clear_error, run_as_nobody, sm120patch_argv,
    snapshot,
)
from sm120patch.errors import ExitCode


def test_a_deleted_target_file(sm120patch, serving_env):
    serving_env.file(HEADER).unlink()
    serving_env.seed_jit(archs=("120a",), modules=("trtllm_comm",))
    before = snapshot(serving_env)
    status = sm120patch("status")
    assert status.exit_code == ExitCode.REFUSED and re.search(r"pdl-gates +missing", status.output)
    assert re.search(r"cluster-clamp-custom +missing", status.output)  # the header's other patch
    result = sm120patch("apply")
    assert result.exit_code == ExitCode.REFUSED
    one_clear_error(result.output, "trtllm_allreduce.cuh is missing")
    assert changed(before, snapshot(serving_env)) == []


def test_a_target_replaced_by_a_symlink(sm120patch, serving_env, tmp_path):
    path = serving_env.file(COMM)
    decoy = tmp_path / "elsewhere.py"
    decoy.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(decoy)
    serving_env.seed_jit(archs=("120a",), modules=("trtllm_comm",))
    before, decoy_bytes = snapshot(serving_env), decoy.read_bytes()
    result = sm120patch("apply")
    assert result.exit_code == ExitCode.REFUSED
    one_clear_error(result.output, "is a symbolic link")
    assert "never writes through a link" in result.output
    assert changed(before, snapshot(serving_env)) == [] and decoy.read_bytes() == decoy_bytes


@pytest.mark.parametrize("damage", ["corrupted", "truncated", "deleted"])
def test_a_damaged_saved_original_is_replaced_by_the_release_wheel(sm120patch, serving_env, damage):
    """Revert restores the release's bytes even without a good saved original: from the release
    wheel (sm120patch's wheel cache here), its file checked against the installed RECORD."""
    assert sm120patch("apply", "--flashinfer", "0.6.4").exit_code == 0
    original = serving_env.state().original(HEADER)
    if damage == "corrupted":
        original.write_bytes(original.read_bytes().replace(b"1200", b"1300", 1))
    elif damage == "truncated":
        original.write_bytes(original.read_bytes()[:1000])
    else:
        original.unlink()
    result = sm120patch("revert")
    assert result.exit_code == 0, result.output
    assert f"{HEADER}" in result.output and "release wheel flashinfer_python-0.6.4-py3-none-any.whl" in result.output
    assert serving_env.record_mismatches() == []
    assert not serving_env.state_root.exists()


def test_a_corrupted_journal(sm120patch, serving_env):
    assert sm120patch("apply", "--flashinfer", "0.6.4").exit_code == 0
    (serving_env.state_root / "journal.json").write_text('{"operation": "apply", "files": [{"relp')
    before = snapshot(serving_env)
    status = sm120patch("status")
    assert status.exit_code == ExitCode.REFUSED
    assert "of an interrupted sm120patch run is unreadable" in status.output
    for command in ("apply", "revert", "apply --dry-run"):
        result = sm120patch(*command.split())
        assert result.exit_code in (ExitCode.FAILED, ExitCode.REFUSED)
        one_clear_error(result.output, "journal")
        assert f"revert --force --python {serving_env.python}" in result.output  # the way out, for this env
        assert changed(before, snapshot(serving_env)) == []
    # The way out the hint gives works, and leaves the release's bytes.
    assert sm120patch("revert", "--force").exit_code == 0
    assert serving_env.record_mismatches() == [] and not serving_env.state_root.exists()


def write_data_dir(tmp_path: Path, toml_text: str) -> Path:
    data = tmp_path / "data"
    shutil.copytree(ROOT / "vendor-manifests", data / "vendor-manifests")
    shutil.copytree(ROOT / "patches", data / "patches")
    (data / "patches" / "flashinfer-python" / "0.6.4.toml").write_text(toml_text)
    return data


SET = ROOT / "patches" / "flashinfer-python" / "0.6.4.toml"


@pytest.mark.parametrize("mangle, message", [
    (lambda text: text.replace('versions = [', 'versions = [[', 1), "not valid TOML"),
    (lambda text: text.replace('file = "flashinfer/jit/comm.py"', 'file = "../../../../etc/passwd"'),
     "not a safe relative path"),
    (lambda text: text.replace('file = "flashinfer/jit/comm.py"', 'file = "/etc/passwd"'), "not a safe relative path"),
    (lambda text: text.replace('"python.extend-list-argument"', '"python.exec"'), "unknown rewriter"),
    (lambda text: text.replace('check = "jit-gate"', 'check = "always-true"'), "no semantic check named"),
])
def test_malformed_patch_data(sm120patch, serving_env, tmp_path, monkeypatch, mangle, message):
    monkeypatch.setenv("SM120PATCH_DATA_DIR", str(write_data_dir(tmp_path, mangle(SET.read_text()))))
    before = snapshot(serving_env)
    result = sm120patch("apply", "--flashinfer", "0.6.4")
    assert result.exit_code == ExitCode.USAGE
    one_clear_error(result.output, message)
    assert changed(before, snapshot(serving_env)) == []


def test_patch_data_is_parsed_never_executed(sm120patch, serving_env, tmp_path, monkeypatch):
    canary = tmp_path / "executed"
    text = SET.read_text().replace('value = "12"', f'value = "__import__(\'os\').system(\'touch {canary}\')"')
    monkeypatch.setenv("SM120PATCH_DATA_DIR", str(write_data_dir(tmp_path, text)))
    before = snapshot(serving_env)
    for extra in (["--dry-run"], []):
        # The expression is only parsed and inserted as text; the result is not the bytes the
        # vendor manifest pins, so even the dry run refuses.
        refused = sm120patch("apply", "--flashinfer", "0.6.4", *extra)
        assert refused.exit_code == ExitCode.USAGE
        one_clear_error(refused.output, "the rewriters produced bytes the vendor manifest does not expect")
    assert not canary.exists()
    assert changed(before, snapshot(serving_env)) == []


def test_owner_and_mode_of_patched_files_are_kept(sm120patch, serving_env):
    need(os.geteuid() == 0, "changing a file's owner needs root")
    path = serving_env.file(COMM)
    os.chown(path, 65534, 65534)
    path.chmod(0o604)
    assert sm120patch("apply").exit_code == 0
    assert (path.stat().st_uid, path.stat().st_gid, path.stat().st_mode & 0o777) == (65534, 65534, 0o604)
    assert sm120patch("revert").exit_code == 0
    assert (path.stat().st_uid, path.stat().st_gid, path.stat().st_mode & 0o777) == (65534, 65534, 0o604)


@pytest.mark.parametrize("read_only", ["", "sglang"])
def test_a_read_only_directory_changes_nothing_anywhere(serving_env, read_only):
    """All of site-packages read-only, or only sglang's directory: one run is one transaction,
    so FlashInfer's files and its JIT entries are not touched either (checked before anything is)."""
    need(os.geteuid() == 0 and shutil.which("unshare") is not None, "a read-only bind mount needs root and unshare")
    serving_env.seed_jit()
    before = snapshot(serving_env)
    mount = serving_env.site_packages / read_only if read_only else serving_env.site_packages
    script = f"mount --bind '{mount}' '{mount}' && mount -o remount,bind,ro '{mount}' && exec \"$@\""
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", *sm120patch_argv(serving_env, "apply")],
                          capture_output=True, text=True)
    need("mount:" not in proc.stderr, f"cannot make a read-only mount here: {proc.stderr.strip()}")
    assert proc.returncode == ExitCode.FAILED, proc.stderr
    one_clear_error(proc.stderr, "read-only file system; nothing was changed")
    assert changed(before, snapshot(serving_env)) == []


def test_permission_denied_for_another_users_environment(shared_dir, flashinfer_wheel):
    """The environment belongs to root; sm120patch runs as nobody."""
    system_python = shutil.which("python3", path="/usr/bin")
    root = shared_dir / "venv"
    make_venv(root, [flashinfer_wheel], python=system_python)
    (shared_dir / "home").mkdir()
    env = ServingEnv(root, shared_dir / "home")
    env.seed_jit(archs=("120a",), modules=("trtllm_comm",))
    before = snapshot(env)
    proc = run_as_nobody(sm120patch_argv(env, "apply", python=system_python), shared_dir)
    need("No module named" not in proc.stderr, f"nobody cannot run sm120patch here: {proc.stderr.strip()[-200:]}")
    assert proc.returncode == ExitCode.FAILED, proc.stderr
    one_clear_error(proc.stderr, "permission denied; nothing was changed")
    # The same command through sudo, as it works where sm120patch is not on sudo's PATH (pipx).
    assert (f'hint: `sudo "$(command -v sm120patch)" apply --python {env.python} --jit-cache-base {env.home}` '
            "runs it as root\n") in proc.stderr, proc.stderr
    assert changed(before, snapshot(env)) == []
