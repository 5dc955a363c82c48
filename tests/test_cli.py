"""The command line itself: help with examples and each command's own exit codes, one-line
errors with hints that work as printed, one selector grammar, a closed pipe is not an error."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import COMM, FLASHINFER_FILES, changed, one_clear_error, run_cli, snapshot
from sm120patch.errors import ExitCode

COMMANDS = ["status", "apply", "revert", "diff", "verify", "doctor", "bench", "build", "export", "list"]


def test_top_level_help_lists_every_command_uncut_with_examples_and_exit_codes():
    result = run_cli("--help")
    assert result.exit_code == 0
    for word in [*COMMANDS, "Examples:", "Exit codes:", "130 interrupted"]:
        assert word in result.output
    commands = result.output.split("Commands:")[1].split("Examples:")[0]
    assert "..." not in commands  # summaries are whole sentences, not cut off


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_examples_and_its_own_exit_codes(command):
    text = run_cli(command, "--help").output
    assert "Examples:" in text and f"sm120patch {command}" in text.split("Examples:")[1]
    codes = text.split("Exit codes:")[1]
    assert "  0 " in codes
    if command in ("status", "apply", "revert", "verify", "doctor", "bench", "build"):
        assert "130" in codes
    if command == "revert":
        assert "status" not in codes  # revert's own codes, not status's


def test_python_dash_m_works():
    proc = subprocess.run([sys.executable, "-m", "sm120patch", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and "sm120patch" in proc.stdout


def test_bad_python_is_one_line_and_exit_2(tmp_path):
    result = run_cli("status", "--python", str(tmp_path / "nope"))
    assert result.exit_code == ExitCode.USAGE
    assert result.output.strip().splitlines() == [f"sm120patch: error: --python {tmp_path / 'nope'}: no such file"]


def test_a_directory_as_python_is_exit_2_with_a_hint(tmp_path):
    result = run_cli("status", "--python", str(tmp_path))
    assert result.exit_code == ExitCode.USAGE
    one_clear_error(result.output, "is a directory")
    assert "hint: pass the interpreter itself, e.g. --python /srv/venv/bin/python3" in result.output  # none is inside


def test_a_program_that_is_not_python_is_exit_2():
    result = run_cli("status", "--python", "/bin/ls")
    assert result.exit_code == ExitCode.USAGE
    one_clear_error(result.output, "not a usable Python interpreter")
    assert "flashinfer" not in result.output


def test_a_missing_source_directory_says_so(tmp_path):
    result = run_cli("status", "--source", str(tmp_path / "nope"))
    assert result.exit_code == ExitCode.USAGE
    one_clear_error(result.output, "no such directory")


def test_an_environment_without_our_packages(tmp_path):
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    python = str(tmp_path / "venv" / "bin" / "python")
    status = run_cli("status", "--python", python, "--json")
    assert status.exit_code == ExitCode.NOT_OK
    assert json.loads(status.output)["distributions"] == []
    apply = run_cli("apply", "--python", python)
    assert apply.exit_code == ExitCode.USAGE
    one_clear_error(apply.output, "none of flashinfer-python, sglang, vllm is installed")


def test_usage_errors_are_one_line_with_a_hint_and_keep_did_you_mean():
    result = run_cli("stauts")
    assert result.exit_code == ExitCode.USAGE
    one_clear_error(result.output, "No such command 'stauts'")
    assert "Did you mean" in result.output and "status" in result.output
    assert "Usage:" not in result.output
    unknown = run_cli("apply", "--frobnicate")
    assert unknown.exit_code == ExitCode.USAGE
    one_clear_error(unknown.output, "--frobnicate")
    assert "hint: `sm120patch apply --help`" in unknown.output


def test_python_and_source_together_are_refused(tmp_path):
    result = run_cli("status", "--python", sys.executable, "--source", str(tmp_path))
    assert result.exit_code == ExitCode.USAGE
    one_clear_error(result.output, "two different targets")


@pytest.mark.parametrize("command", ["status", "apply", "revert", "diff"])
def test_one_selector_grammar_on_every_command(sm120patch, serving_env, command):
    """--flashinfer alone, --flashinfer VER and --flashinfer=vVER mean the same everywhere."""
    before = snapshot(serving_env)
    # status: FlashInfer is not patched (1); apply patches it (then: nothing to change), revert
    # and diff succeed.
    expected = {"status": ExitCode.NOT_OK, "apply": 0, "revert": 0, "diff": 0}[command]
    for args in (["--flashinfer"], ["--flashinfer", "0.6.4"], ["--flashinfer=v0.6.4"]):
        result = sm120patch(command, *args)
        assert result.exit_code == expected, (args, result.output)
        assert "sglang" not in result.output.replace("sglang 0.5.9 pins", "")
    wrong = sm120patch(command, "--flashinfer", "0.6.5")
    assert wrong.exit_code == ExitCode.USAGE
    one_clear_error(wrong.output, "--flashinfer 0.6.5: ")
    # The hint names this environment, so it works when copied as printed.
    assert f"--python {serving_env.python}" in wrong.output and "--flashinfer 0.6.4" in wrong.output
    bad = sm120patch(command, "--flashinfer", "latest")
    assert bad.exit_code == ExitCode.USAGE
    one_clear_error(bad.output, "--flashinfer latest: not a version")
    touched = [p for p in changed(before, snapshot(serving_env)) if "/.sm120patch" not in p]
    # Only apply changes files, and with --flashinfer only FlashInfer's.
    assert (touched != []) == (command == "apply") and not any("/sglang/" in p for p in touched), touched


SELECTOR_COMMANDS = ["status", "apply", "revert", "diff"]  # every command with --flashinfer/--sglang/--vllm


@pytest.mark.parametrize("command", SELECTOR_COMMANDS)
@pytest.mark.parametrize("value", ["", " 0.6.4", "0.6.4 ", "\t"])
def test_an_empty_or_padded_selector_is_refused_not_read_as_any_release(command, value):
    """``--flashinfer ''`` is not ``--flashinfer`` alone (any release), and ``' 0.6.4'`` is not
    0.6.4: a value the shell quoted is taken as typed, and refused."""
    result = run_cli(command, "--python", sys.executable, "--flashinfer", value)
    assert result.exit_code == ExitCode.USAGE, result.output
    one_clear_error(result.output, "not a version")


def test_with_names_valid_ids_and_refuses_required_ones(sm120patch, serving_env):
    before = snapshot(serving_env)
    unknown = sm120patch("apply", "--with", "nope")
    assert unknown.exit_code == ExitCode.USAGE
    one_clear_error(unknown.output, "--with nope: no such patch")
    assert "auto-enable" in unknown.output and "symm-mem" in unknown.output
    required = sm120patch("apply", "--sglang", "--with", "fusion-gate")
    assert required.exit_code == ExitCode.USAGE
    one_clear_error(required.output, "fusion-gate: required, so always applied")
    assert changed(before, snapshot(serving_env)) == []


def test_with_repeated_takes_every_value_as_the_comma_form_does(sm120patch, serving_env):
    """`--with a --with b` is `--with a,b` (it used to keep only the last); an empty value is refused."""
    repeated = sm120patch("apply", "--sglang", "--dry-run", "--with", "symm-mem", "--with", "auto-enable")
    joined = sm120patch("apply", "--sglang", "--dry-run", "--with", "auto-enable,symm-mem")
    assert repeated.exit_code == joined.exit_code == 0, repeated.output
    assert repeated.output == joined.output
    assert "server_args.py" in repeated.output and "all_reduce_utils.py" in repeated.output
    empty = sm120patch("apply", "--sglang", "--with", "symm-mem", "--with", " , ")
    assert empty.exit_code == ExitCode.USAGE
    one_clear_error(empty.output, "names no patch")


def test_apply_json_is_a_document_that_matches_the_files(sm120patch, serving_env):
    before = {f: serving_env.file(f).read_bytes() for f in (COMM,)}
    result = sm120patch("apply", "--json")
    assert result.exit_code == 0
    doc = json.loads(result.output)
    assert doc["operation"] == "apply" and doc["dry_run"] is False
    assert [r["name"] for r in doc["results"]] == ["flashinfer-python", "sglang"]
    files = {f["file"]: f for f in doc["results"][0]["files"]}
    assert set(files) == set(FLASHINFER_FILES)
    import hashlib

    assert files[COMM]["after"] == hashlib.sha256(serving_env.file(COMM).read_bytes()).hexdigest()
    assert files[COMM]["before"] == hashlib.sha256(before[COMM]).hexdigest()


def test_diff_on_a_patched_environment_says_nothing_to_apply(sm120patch):
    assert sm120patch("apply").exit_code == 0
    result = sm120patch("diff")
    assert result.exit_code == 0
    assert "nothing to apply" in result.output and "already patched" in result.output


def test_a_closed_pipe_is_not_an_error(serving_env):
    """`sm120patch diff | head -1`: exits quietly, as git and pip do."""
    proc = subprocess.run(
        f"{sys.executable} -m sm120patch diff --python {serving_env.python} | head -1",
        shell=True, capture_output=True, text=True, executable="/bin/bash",
    )
    assert proc.stdout.startswith("--- ") and proc.stderr == ""
    status = subprocess.run(
        ["bash", "-o", "pipefail", "-c", f"{sys.executable} -m sm120patch diff --python {serving_env.python} | head -1"],
        capture_output=True, text=True)
    assert status.returncode == 0, status.stderr


def test_list_shows_every_distribution_and_json_agrees():
    text = run_cli("list")
    assert text.exit_code == 0
    assert "flashinfer-python" in text.output and "sglang" in text.output and "0.6.17" in text.output
    doc = json.loads(run_cli("list", "--json").output)["distributions"]
    assert set(doc) >= {"flashinfer-python", "sglang"}
    assert doc["flashinfer-python"]["releases"]["0.6.4"]["patch_set"] == "flashinfer-python/0.6.4.toml"
    assert doc["sglang"]["releases"]["0.5.9"]["opt_in"] == ["auto-enable", "symm-mem", "tuned-limits", "tuned-oneshot"]


def test_dry_runs_say_what_the_jit_cache_and_a_revert_would_lose_and_change_nothing(sm120patch, serving_env):
    """apply --dry-run names the stale JIT entry the real apply removes; revert --dry-run prints
    the diff back to the release and downloads nothing; neither changes a byte."""
    serving_env.seed_jit(archs=("120a",), modules=("trtllm_comm",))
    entry = serving_env.jit_entry("120a", "trtllm_comm")
    before = snapshot(serving_env)
    dry = sm120patch("apply", "--dry-run")
    assert dry.exit_code == 0 and f"  would remove stale entry {entry}" in dry.output
    document = json.loads(sm120patch("apply", "--dry-run", "--json").output)
    assert document["jit_cache_would_remove"] == [str(entry)] and document["jit_cache_removed"] == []
    assert changed(before, snapshot(serving_env)) == []

    assert sm120patch("apply").exit_code == 0
    patched = snapshot(serving_env)
    back = sm120patch("revert", "--dry-run")
    assert back.exit_code == 0, back.output
    assert "-        supported_major_versions=[9, 10, 12]\n+        supported_major_versions=[9, 10]" in back.output
    assert changed(patched, snapshot(serving_env)) == []
    assert sm120patch("revert").exit_code == 0
    assert serving_env.record_mismatches() == []


def test_quiet_prints_errors_only_and_the_exit_code_says_the_outcome(serving_env):
    python = str(serving_env.python)
    base = ("--python", python, "--jit-cache-base", str(serving_env.home))
    status = run_cli("-q", "status", *base)
    assert status.exit_code == 1 and status.output == ""
    applied = run_cli("--quiet", "apply", *base)
    assert applied.exit_code == 0 and applied.output == ""
    assert sorted(serving_env.record_mismatches())  # the change was made all the same
    assert run_cli("-q", "status", *base).exit_code == 0
    document = json.loads(run_cli("-q", "status", *base, "--json").output)  # --json still prints its document
    assert document["exit_code"] == 0
    wrong = run_cli("-q", "apply", "--python", "/nonexistent/python")
    assert wrong.exit_code == 2
    one_clear_error(wrong.output, "--python /nonexistent/python: no such file")
