"""`sm120patch build` and `apply --build`: FlashInfer's own JIT build of trtllm_comm into the
server's JIT cache. Here (no GPU, no CUDA driver) the paths up to the build and its failures;
the build itself, and the first use after it, are measured on the H200 (docs/h200.md)."""

from __future__ import annotations


import pytest

from helpers import Session, changed, one_clear_error, snapshot
from sm120patch.errors import ExitCode
from sm120patch.jitbuild import parse_arch
from sm120patch.errors import UsageError


@pytest.mark.parametrize("text, wanted", [("12.0a", "12.0a"), ("9.0a,12.0a", "9.0a 12.0a"), (" 9.0a  12.0a ", "9.0a 12.0a"),
                                          ("10.0f", "10.0f")])
def test_arch_lists_are_flashinfers_form(text, wanted):
    assert parse_arch(text) == wanted


@pytest.mark.parametrize("text", ["", "12", "sm_120a", "12.0a;9.0a"])
def test_a_bad_arch_list_is_a_usage_error(text):
    with pytest.raises(UsageError, match="not a list of compute capabilities"):
        parse_arch(text)


def test_build_refuses_unpatched_sources_and_changes_nothing(sm120patch, serving_env):
    before = snapshot(serving_env)
    result = sm120patch("build")
    assert result.exit_code == ExitCode.REFUSED
    one_clear_error(result.output, "flashinfer-python 0.6.4 is not patched")
    assert f"hint: run `sm120patch apply --build --python {serving_env.python}`" in result.output
    assert changed(before, snapshot(serving_env)) == []


def test_dry_run_never_builds(sm120patch, serving_env):
    before = snapshot(serving_env)
    result = sm120patch("apply", "--build", "--dry-run")
    assert result.exit_code == 0 and "built trtllm_comm" not in result.output
    assert changed(before, snapshot(serving_env)) == []


def test_a_target_without_torch_is_exit_2_and_the_patch_stays(sm120patch, serving_env):
    result = sm120patch("apply", "--build", "--arch", "12.0a")
    assert result.exit_code == ExitCode.USAGE
    assert "flashinfer-python 0.6.4: patched 3 files" in result.output  # said first: it happened
    one_clear_error(result.output, "FlashInfer's JIT does not import in")
    assert "No module named" in result.output
    # The transaction had committed: the sources are patched, as the error leaves them.
    assert sm120patch("status").exit_code == ExitCode.OK


def test_no_gpu_and_no_arch_says_to_pass_arch(runtime_env):
    session = Session(runtime_env)
    assert session("apply", "--flashinfer").exit_code == 0
    try:
        result = session("build")
        assert result.exit_code == ExitCode.USAGE
        one_clear_error(result.output, "cannot tell which GPUs to build trtllm_comm for: no GPU is visible")
        assert "--arch 12.0a" in result.output
    finally:
        assert session("revert").exit_code == 0


def test_a_failed_build_leaves_no_half_written_entry(runtime_env, monkeypatch, tmp_path):
    """The compiler is missing: FlashInfer's ninja run fails; exit 1, its last lines shown, and
    the cache entry the build had started is gone."""
    session = Session(runtime_env)
    assert session("apply", "--flashinfer").exit_code == 0
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    monkeypatch.setenv("PATH", f"{runtime_env.root / 'bin'}:/usr/bin:/bin")
    try:
        result = session("build", "--arch", "12.0a")
        assert result.exit_code == ExitCode.NOT_OK, result.output
        one_clear_error(result.output, "FlashInfer's JIT build of trtllm_comm failed")
        assert "the half-built entry was removed" in result.output
        assert not runtime_env.jit_entry("120a", "trtllm_comm").exists()
    finally:
        monkeypatch.undo()
        assert session("revert").exit_code == 0


def test_verify_build_reports_a_failed_build(runtime_env, monkeypatch, tmp_path):
    """`verify --build` through the CLI: FlashInfer's build in a temporary workspace; without a
    compiler it fails, and verify says so (exit 1) and leaves the server's cache alone."""
    session = Session(runtime_env)
    assert session("apply", "--flashinfer").exit_code == 0
    before = snapshot(runtime_env)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    monkeypatch.setenv("PATH", f"{runtime_env.root / 'bin'}:/usr/bin:/bin")
    try:
        result = session("verify", "--build")
        assert result.exit_code == ExitCode.NOT_OK
        assert "FAIL  build" in result.output and "trtllm_comm JIT build (12.0a)" in result.output
        assert changed(before, snapshot(runtime_env)) == []
    finally:
        monkeypatch.undo()
        assert session("revert").exit_code == 0


@pytest.mark.nvcc
def test_a_gpu_less_build_compiles_everything_then_explains_the_link(runtime_env):
    """An image build: no GPU, no driver, `--arch 12.0a`. FlashInfer's JIT compiles every source
    of the patched trtllm_comm for sm_120a (minutes); linking needs libcuda, which only the
    driver or the CUDA toolkit's stub provides, and this machine's toolkit (assembled from PyPI's
    nvidia-cuda-* wheels) has no stub and no PyPI package ships one. So the test stops there:
    exit 1, the reason in one line, and no half-written entry."""
    from sm120patch.ptx import find_nvcc

    from helpers import need

    need(find_nvcc() is not None, "nvcc not found (CUDA_HOME, PATH, /usr/local/cuda)")
    session = Session(runtime_env)
    assert session("apply", "--flashinfer").exit_code == 0
    try:
        result = session("build", "--arch", "12.0a")
        entry = runtime_env.jit_entry("120a", "trtllm_comm")
        if result.exit_code == 0:  # a machine with a driver or the stub: the whole path, proven
            assert "built trtllm_comm for 120a" in result.output and (entry / "trtllm_comm.so").exists()
        else:
            assert result.exit_code == ExitCode.NOT_OK, result.output
            one_clear_error(result.output, "FlashInfer compiled trtllm_comm but could not link it: no libcuda")
            assert not entry.exists()
    finally:
        assert session("revert").exit_code == 0
