"""The command line itself: help, exit codes, one-line errors, module entry point."""

from __future__ import annotations

import json
import subprocess
import sys

from click.testing import CliRunner

from sm120patch.cli import cli
from sm120patch.errors import ExitCode


def run(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_help_lists_commands_and_exit_codes():
    result = run("--help")
    assert result.exit_code == 0
    for word in ("apply", "status", "revert", "Exit codes:", "3  refused"):
        assert word in result.output
    assert "--dry-run" in run("apply", "--help").output


def test_python_dash_m_works():
    proc = subprocess.run([sys.executable, "-m", "sm120patch", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and "sm120patch" in proc.stdout


def test_bad_python_is_one_line_and_exit_2(tmp_path):
    result = run("status", "--python", str(tmp_path / "nope"))
    assert result.exit_code == ExitCode.USAGE
    assert result.output.strip().splitlines() == [f"sm120patch: error: --python {tmp_path / 'nope'}: no such file"]


def test_an_environment_without_our_packages(tmp_path):
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    python = str(tmp_path / "venv" / "bin" / "python")
    status = run("status", "--python", python, "--json")
    assert status.exit_code == ExitCode.NOT_PATCHED
    assert json.loads(status.output)["distributions"] == []
    apply = run("apply", "--python", python)
    assert apply.exit_code == ExitCode.USAGE
    assert "neither flashinfer-python nor sglang is installed" in apply.output
    assert "Traceback" not in apply.output


def test_unknown_option_is_a_usage_error():
    assert run("apply", "--frobnicate").exit_code == 2


def test_apply_json_is_a_document(sm120patch):
    result = sm120patch("apply", "--json")
    doc = json.loads(result.output)
    assert doc["operation"] == "apply"
    assert [r["name"] for r in doc["results"]] == ["flashinfer-python", "sglang"]
    assert {f["file"] for f in doc["results"][0]["files"]} == {
        "flashinfer/jit/comm.py",
        "flashinfer/data/include/flashinfer/comm/trtllm_allreduce.cuh",
        "flashinfer/data/csrc/trtllm_allreduce.cu",
    }
