"""verify: static (hashes + semantics), runtime (FlashInfer's own JIT spec in the target
interpreter) and compile (nvcc PTX) checks, failing before apply and passing after."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from helpers import Session, changed, need, tree_snapshot
import sm120patch as sm120patch_module
from sm120patch.errors import ExitCode
from sm120patch.ptx import find_nvcc
from sm120patch.semantics import CHECKS

from helpers import COMM, HEADER, LAMPORT


def checks(result) -> dict[tuple[str, str], dict]:
    return {(c["kind"], c["subject"]): c for c in json.loads(result.output)["checks"]}


def test_static_verify_fails_pristine_and_passes_patched(sm120patch):
    pristine = sm120patch("verify", "--json")
    assert pristine.exit_code == ExitCode.NOT_OK
    found = checks(pristine)
    assert found[("static", "flashinfer-python jit-gate")]["ok"] is False
    assert found[("semantic", "flashinfer-python pdl-gates")]["detail"].startswith("13 '__CUDA_ARCH__ < 1200' bounds left")

    assert sm120patch("apply").exit_code == 0
    patched = sm120patch("verify")
    assert patched.exit_code == ExitCode.OK, patched.output
    assert "FAIL" not in patched.output and patched.output.rstrip().endswith("verified")
    assert "PASS  semantic sglang fusion-gate: fusion predicate: _is_sm90_supported or _is_sm100_supported or _is_sm120_supported" in patched.output


def test_semantic_checks_do_not_trust_hashes(sm120patch, serving_env):
    """A hand edit that removes the gates by other means passes the semantic check and fails
    the hash check: the two are independent."""
    path = serving_env.file(HEADER)
    path.write_text("// rebuilt locally\n" + path.read_text().replace(" && (__CUDA_ARCH__ < 1200)", ""))
    found = checks(sm120patch("verify", "--json"))
    assert found[("static", "flashinfer-python pdl-gates")]["ok"] is False
    assert found[("semantic", "flashinfer-python pdl-gates")]["ok"] is True


@pytest.mark.parametrize("patch_id, relpath", [("jit-gate", COMM), ("lamport-stride", LAMPORT)])
def test_semantic_checks_on_the_real_pristine_files(read_only_env, patch_id, relpath):
    ok, detail = CHECKS[patch_id](read_only_env.file(relpath).read_text())
    assert ok is False and detail


def test_compile_check_without_nvcc_says_so(sm120patch, monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))  # a toolkit location without nvcc
    assert sm120patch("apply").exit_code == 0
    result = sm120patch("verify", "--compile")
    # A check the user asked for that could not run does not pass: it says what to install.
    assert result.exit_code == ExitCode.NOT_OK
    assert "nvcc not found" in result.output and "install the CUDA toolkit" in result.output
    assert result.output.rstrip().endswith("NOT verified: 1 check you asked for could not run"), result.output


def test_runtime_check_without_torch_fails_and_says_what_to_install(sm120patch, serving_env):
    """The serving_env has no torch: --runtime cannot run, so verify does not pass."""
    assert sm120patch("apply").exit_code == 0
    before = {p: p.stat().st_mtime_ns for p in serving_env.home.rglob("*")}
    result = sm120patch("verify", "--runtime", "--json")
    assert result.exit_code == ExitCode.NOT_OK
    runtime = next(c for (kind, subject), c in checks(result).items() if kind == "runtime" and "gen_trtllm" in subject)
    assert runtime["ok"] is None and "install torch" in runtime["detail"]
    # The check ran in a temporary workspace: nothing appeared in the server's JIT cache base.
    assert {p: p.stat().st_mtime_ns for p in serving_env.home.rglob("*")} == before


@pytest.mark.nvcc
def test_runtime_and_compile_verify_fail_before_apply_and_pass_after(runtime_env):
    need(find_nvcc() is not None, "nvcc not found (CUDA_HOME, PATH, /usr/local/cuda)")
    session = Session(runtime_env)
    home = tree_snapshot(runtime_env.home, Path.home())
    before = session("verify", "--runtime", "--compile", "--json")
    # FlashInfer's import writes a log into its workspace: the check used a temporary one.
    assert changed(home, tree_snapshot(runtime_env.home, Path.home())) == []
    assert before.exit_code == ExitCode.NOT_OK
    found = checks(before)
    runtime = next(c for (kind, _), c in found.items() if kind == "runtime" and "gen_trtllm_comm_module" in c["subject"])
    assert runtime["ok"] is False
    assert "No supported CUDA architectures found for major versions [9, 10]" in runtime["detail"]
    lamport = found[("compile", "sm_120a lamport kernel PTX")]
    assert lamport["ok"] is False and lamport["detail"] == "0 griddepcontrol instructions: the kernel body is compiled out"
    # sglang's dependencies are absent here: its import is skipped, says why, and is informative only.
    assert found[("runtime", "import sglang.srt.layers.communicator")]["ok"] is None

    assert session("apply").exit_code == 0
    try:
        after = session("verify", "--runtime", "--compile", "--json")
        assert after.exit_code == ExitCode.OK, after.output
        found = checks(after)
        runtime = next(c for (kind, _), c in found.items() if kind == "runtime" and "gen_trtllm_comm_module" in c["subject"])
        assert "-gencode=arch=compute_120a,code=sm_120a" in runtime["detail"]
        # The whole body: as many PDL instructions as the sm_90a kernel, which was never gated.
        counts = re.fullmatch(r"(\d+) griddepcontrol instructions \(sm_90a: (\d+)\)",
                              found[("compile", "sm_120a lamport kernel PTX")]["detail"])
        assert counts and counts[1] == counts[2] != "0", found[("compile", "sm_120a lamport kernel PTX")]
        assert found[("compile", "sm_90a PTX unchanged")]["detail"] == "byte-identical to the release header's PTX"
        assert found[("compile", "sm_100a PTX unchanged")]["ok"] is True
        # FlashInfer's comm package needs the CUDA runtime loaded (no GPU here): the import of
        # the patched mnnvl.py cannot run, which says nothing about the patch.
        mnnvl = found[("runtime", "import flashinfer.comm.mnnvl")]
        assert mnnvl["ok"] is None and "raised while its packages import" in mnnvl["detail"], mnnvl
    finally:
        assert session("revert").exit_code == 0
    assert runtime_env.record_mismatches() == []


def test_the_import_check_blames_a_patched_module_only_for_its_own_errors(runtime_env, tmp_path):
    """A module whose own code fails (a patch's missing import) is an error; one whose package
    fails before it runs (FlashInfer's comm package without the CUDA runtime) cannot be checked."""
    (tmp_path / "package").mkdir()
    (tmp_path / "package" / "__init__.py").write_text("")
    (tmp_path / "package" / "patched.py").write_text("flag = is_sm120_supported()\n")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "__init__.py").write_text("assert False, 'libcudart is not loaded in the current process'\n")
    (tmp_path / "broken" / "patched.py").write_text("")
    probe = Path(sm120patch_module.__file__).with_name("_runtime_probe.py")
    proc = subprocess.run([str(runtime_env.python), str(probe), json.dumps({"modules": ["package.patched", "broken.patched"]})],
                          capture_output=True, text=True, cwd=tmp_path, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    modules = json.loads(proc.stdout.strip().splitlines()[-1])["modules"]
    assert modules["package.patched"] == {"error": "NameError: name 'is_sm120_supported' is not defined"}
    assert "skipped" in modules["broken.patched"] and "libcudart is not loaded" in modules["broken.patched"]["skipped"]
