"""Every hint and example sm120patch prints does what was asked when copied exactly as printed:
each test runs the printed command through a shell (sm120patch on PATH, as after the README's
install) and checks its effect on the files, not its words."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from packaging.version import Version

from helpers import (
    COMM, COMMUNICATOR, FLASHINFER_FILES, ROOT, SYMM_MEM, changed, run_cli, snapshot, tree_fingerprint, tree_snapshot,
)
from sm120patch.errors import ExitCode
from sm120patch.invocation import Invocation
from sm120patch.words import counted
from test_synthetic import data_dir, toy  # noqa: F401 - the synthetic distribution's fixtures


def printed(output: str) -> str:
    """The one command in the output's hint line, as printed between backquotes."""
    (line,) = [line for line in output.splitlines() if line.startswith("hint: ")]
    (command,) = re.findall(r"`([^`]+)`", line)
    return command


def test_an_invocation_repeats_options_in_order_and_quotes_them():
    given = Invocation("apply", (("--python", "/srv/my env/bin/python"), ("--flashinfer", "0.6.5"),
                                 ("--sglang", None), ("--dry-run", None)))
    assert str(given.replaced("--flashinfer", "0.6.4")) == (
        "sm120patch apply --python '/srv/my env/bin/python' --flashinfer 0.6.4 --sglang --dry-run")
    assert str(given.replaced("--with", "symm-mem").without("--dry-run")).endswith("--sglang --with symm-mem")


def test_a_wrong_selector_hint_repeats_the_same_command(toy, shell):
    python = str(toy.venv / "bin" / "python")
    before = toy.snapshot()
    # revert, status and a dry run keep their own command; copied, none of them patches anything.
    for words, effect in ((["revert"], "toyfuse 1.0: nothing to revert (not patched)"),
                          (["status"], "toyfuse 1.0: not patched"),
                          (["apply", "--dry-run"], "+        supported_major_versions=[9, 10, 12],")):
        result = shell(shlex.join(["sm120patch", words[0], "--python", python, "--toyfuse", "1.1", "--jit-cache-base",
                                   str(toy.home), *words[1:]]))
        assert result.returncode == ExitCode.USAGE, result.stderr
        command = printed(result.stderr)
        assert command.split()[:2] == ["sm120patch", words[0]] and "--toyfuse 1.0" in command, command
        again = shell(command)
        assert effect in again.stdout, (command, again.stdout, again.stderr)
        assert changed(before, toy.snapshot()) == [], command
    # apply, written --toyfuse=1.1: the hint applies, as was asked.
    result = shell(shlex.join(["sm120patch", "apply", "--python", python, "--toyfuse=1.1", "--jit-cache-base",
                               str(toy.home)]))
    applied = shell(printed(result.stderr))
    assert applied.returncode == 0 and "[9, 10, 12]" in (toy.site / "toyfuse" / "comm.py").read_text()


def test_a_directory_as_python_hints_the_interpreter_inside_it_quoted(tmp_path, shell):
    venv = tmp_path / "my envs" / "srv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    for directory in (venv / "bin", site):  # the environment's own directory is taken as it is (below)
        result = run_cli("status", "--python", str(directory))
        assert result.exit_code == ExitCode.USAGE
        command = printed(result.output)
        ran = shell(command)
        # It ran status on the environment's interpreter: nothing sm120patch patches is there.
        assert ran.stdout.startswith(f"Python {venv / 'bin' / 'python3'} "), (command, ran.stdout, ran.stderr)
        assert ran.returncode == ExitCode.NOT_OK and "is installed here" in ran.stdout
    plain = run_cli("status", "--python", str(tmp_path))  # no environment there: no made-up path
    assert plain.exit_code == ExitCode.USAGE and str(tmp_path) + "/bin" not in plain.output


def test_the_environments_directory_is_taken_and_every_report_names_its_interpreter_first(toy, shell):
    """`--python ~/ml-env`, as every --help allows: the environment's interpreter is the target,
    and the first line of status and doctor names it; doctor without --python says how it chose."""
    python = toy.venv / "bin" / "python3"
    for command in ("status", "doctor"):
        ran = shell(shlex.join(["sm120patch", command, "--python", str(toy.venv), "--jit-cache-base", str(toy.home)]))
        assert ran.stdout.splitlines()[0].startswith(f"Python {python} ("), (command, ran.stdout, ran.stderr)
        assert ran.returncode == (ExitCode.NOT_OK if command == "status" else ExitCode.OK), ran.stderr
    chosen = shell(f"VIRTUAL_ENV={shlex.quote(str(toy.venv))} sm120patch doctor --jit-cache-base {shlex.quote(str(toy.home))}")
    first = chosen.stdout.splitlines()[0]
    assert first.startswith(f"Python {toy.venv}/bin/python") and "(no --python given: $VIRTUAL_ENV" in first, first
    assert "toyfuse 1.0: not patched" in chosen.stdout


def test_sm120patch_alone_prints_its_help():
    for words in ([], ["manifest"]):
        result = subprocess.run([sys.executable, "-m", "sm120patch", *words], capture_output=True, text=True)
        assert result.returncode == 0 and result.stdout.startswith("Usage: sm120patch"), result
        assert "error" not in result.stderr + result.stdout.splitlines()[0]
        assert "Examples:" in result.stdout


def test_help_names_all_three_and_the_maintainer_group_has_examples():
    top = run_cli("--help").output
    assert all(name in top for name in ("FlashInfer", "SGLang", "vLLM"))
    assert "Examples:\n    sm120patch manifest build" in run_cli("manifest", "--help").output


def test_verify_counts_failures_and_checks_that_could_not_run(toy, shell):
    python = str(toy.venv / "bin" / "python")
    result = shell(shlex.join(["sm120patch", "verify", "--python", python, "--jit-cache-base", str(toy.home), "--runtime"]))
    assert result.returncode == ExitCode.NOT_OK
    failed = sum(line.startswith("FAIL") for line in result.stdout.splitlines())
    not_run = sum(line.startswith("NOT RUN") for line in result.stdout.splitlines())
    assert failed >= 1
    counts = [counted(failed, "check") + " failed"] + ([counted(not_run, "check") + " you asked for could not run"]
                                                       if not_run else [])
    assert result.stdout.splitlines()[-1] == "NOT verified: " + ", ".join(counts)


def test_with_a_patch_of_a_distribution_left_out_names_the_selector(sm120patch, serving_env, shell):
    before = snapshot(serving_env)
    result = sm120patch("apply", "--flashinfer", "--with", "symm-mem")
    assert result.exit_code == ExitCode.USAGE
    assert "a patch of sglang 0.5.9, which the selectors leave out (--flashinfer)" in result.output
    assert changed(before, snapshot(serving_env)) == []
    ran = shell(printed(result.output))
    assert ran.returncode == 0, ran.stderr
    assert sorted(serving_env.record_mismatches()) == sorted([*FLASHINFER_FILES, COMMUNICATOR, SYMM_MEM])


def test_a_wrong_selector_keeps_every_other_option(sm120patch, serving_env, shell):
    before = snapshot(serving_env)
    result = sm120patch("apply", "--flashinfer", "0.6.5", "--sglang", "0.5.9", "--dry-run")
    command = printed(result.output)
    assert command.endswith("--flashinfer 0.6.4 --sglang 0.5.9 --dry-run"), command
    ran = shell(command)
    assert ran.returncode == 0 and f"+++ b/{COMMUNICATOR}" in ran.stdout and f"+++ b/{COMM}" in ran.stdout
    assert changed(before, snapshot(serving_env)) == []


def test_the_diff_help_example_applies_the_diff_by_hand(serving_env, shell, tmp_path, monkeypatch):
    need_patch = shutil.which("patch")
    if need_patch is None:
        pytest.skip("needs patch(1)")
    home = tmp_path / "operator"
    home.mkdir()
    (home / "ml-env").symlink_to(serving_env.root)
    examples = run_cli("diff", "--help").output.split("Examples:\n")[1].split("\n\n")[0]
    # One command per line, or over several ending in a backslash; a comment on a line of its own.
    lines = [c.strip() for c in re.split(r"(?<!\\)\n", examples) if c.strip() and not c.strip().startswith("#")]
    assert len(lines) == 2 and lines[1].startswith("patch -p1")
    for line in lines:
        ran = shell(f"HOME={home}; {line}", cwd=tmp_path)
        assert ran.returncode == 0, (line, ran.stdout, ran.stderr)
    status = run_cli("status", "--python", str(serving_env.python), "--jit-cache-base", str(serving_env.home))
    assert status.exit_code == ExitCode.OK, status.output
    assert "applied (by hand)" in status.output


def test_bench_with_python_given_does_not_hint_to_pass_it(read_only_cli):
    result = read_only_cli("bench")  # FlashInfer and SGLang, no torch
    assert result.exit_code == ExitCode.USAGE  # bench --help: "2  the target cannot run it: no torch, ..."
    assert "torch is not importable" in result.output and "hint: pass --python" not in result.output
    assert "2   the target cannot run it: no torch" in run_cli("bench", "--help").output


def test_the_exit_codes_of_every_help_are_in_the_readme_table():
    table = ROOT.joinpath("README.md").read_text().split("### Exit codes")[1].split("\n\n")[1]
    documented = {int(m) for m in re.findall(r"^\| (\d+) \|", table, flags=re.M)}
    assert documented == {int(code) for code in ExitCode}
    assert "`bench`: a target that cannot run it" in table and "none of the distributions" in table
    for command in ("status", "apply", "revert", "diff", "verify", "build", "bench", "doctor", "list", "export"):
        text = run_cli(command, "--help").output.split("Exit codes:\n")[1]
        codes = {int(m) for m in re.findall(r"^\s+(\d+)\s", text, flags=re.M)}
        assert codes <= documented, command


def test_list_takes_python_and_marks_what_is_installed(toy, shell):
    result = shell(shlex.join(["sm120patch", "list", "--python", str(toy.venv / "bin" / "python")]))
    assert result.returncode == 0, result.stderr
    section = result.stdout.split("toyfuse (--toyfuse)")[1]
    assert section.splitlines()[1] == "  installed there: 1.0 (patch set toyfuse/1.0.toml)"
    assert "flashinfer-python (--flashinfer)" in result.stdout and "  installed there: none" in result.stdout


@pytest.mark.wheels
def test_the_demo_writes_nothing_outside_its_directory(tmp_path, wheel_cache, flashinfer_wheel, sglang_wheel):
    home = tmp_path / "home"
    home.mkdir()
    demo = tmp_path / "demo"
    env = dict(os.environ, HOME=str(home), SM120PATCH_DEMO_DIR=str(demo),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("SM120PATCH_WHEEL_CACHE", None)
    if wheel_cache.parts[-2:] == ("sm120patch", "wheels"):  # the demo copies from this cache, read only
        env["XDG_CACHE_HOME"] = str(wheel_cache.parents[1])
    # The wheel cache (gigabytes: every file read twice was most of this test's time) by what any
    # write to it changes; the home by its bytes.
    before = tree_snapshot(home) | tree_fingerprint(wheel_cache)
    ran = subprocess.run(["bash", str(ROOT / "demo" / "run.sh")], capture_output=True, text=True, env=env, cwd=ROOT)
    assert ran.returncode == 0, ran.stderr
    assert changed(before, tree_snapshot(home) | tree_fingerprint(wheel_cache)) == []
    assert "(exit code 1: something is not patched" in ran.stdout
    assert sorted(p.name for p in (demo / "wheels").iterdir()) == sorted([flashinfer_wheel.name, sglang_wheel.name])
    # Each step under a screen, and one summary line at the end (issue #64).
    steps = ran.stdout.split("\n$ sm120patch ")[1:]
    assert len(steps) == 5 and all(len(step.splitlines()) <= 30 for step in steps), [len(s.splitlines()) for s in steps]
    assert ran.stdout.splitlines()[-1].startswith("demo: exit codes status 1 -> apply 0 -> status 0 -> revert 0 -> "
                                                  "status 1; site-packages after revert: byte-identical")


@pytest.mark.wheels  # it installs sm120patch from PyPI's click, libcst, packaging, gitpython
def test_the_readme_install_without_pipx_puts_sm120patch_on_path(tmp_path):
    text = ROOT.joinpath("README.md").read_text()
    block = text.split("Without pipx")[1].split("```\n")[1]
    assert "export PATH=" in block and block.rstrip().splitlines()[-1].startswith("sm120patch status")
    checkout = tmp_path / "checkout"  # a clean copy: pip builds in the directory it is given
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in filter(None, files.split("\0")):
        if (ROOT / name).is_file():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, checkout / name)
    home = tmp_path / "home"
    home.mkdir()
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(home / "ml-env")], check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    env.update(HOME=str(home), PATH=os.pathsep.join(p for p in env["PATH"].split(os.pathsep)
                                                    if not Path(p, "sm120patch").exists()))
    ran = subprocess.run(["bash", "-c", block], capture_output=True, text=True, cwd=checkout, env=env)
    assert "command not found" not in ran.stderr, ran.stderr
    assert f"\nPython {home / 'ml-env' / 'bin' / 'python3'} (" in ran.stdout, (ran.stdout, ran.stderr)
    assert ran.returncode == ExitCode.NOT_OK and "is installed here" in ran.stdout  # nothing in that venv


def test_without_python_the_activated_environment_is_the_target_and_the_first_line_says_so(
        read_only_env, monkeypatch, tmp_path):
    """A bare `sm120patch status` with a server venv activated reports on that venv (not on
    sm120patch's own interpreter, which with pipx is never the server's) and says why; with
    nothing activated and sm120patch's own interpreter holding none of the distributions,
    python3 on PATH is the target. A venv typed as a bare directory name is found, with the
    interpreter to pass."""
    monkeypatch.setenv("VIRTUAL_ENV", str(read_only_env.root))
    monkeypatch.delenv("CONDA_PREFIX", raising=False)
    result = run_cli("status", "--jit-cache-base", str(read_only_env.home))
    first, second = result.output.splitlines()[:2]
    assert first.startswith(f"Python {read_only_env.root / 'bin'}/python")
    assert second == "  (no --python given: $VIRTUAL_ENV: the activated environment; --python names your server's interpreter)"
    assert "sglang 0.5.9" in result.output
    applied = json.loads(run_cli("apply", "--dry-run", "--json", "--jit-cache-base", str(read_only_env.home)).output)
    assert applied["target_chosen_by"] == "$VIRTUAL_ENV: the activated environment"

    monkeypatch.delenv("VIRTUAL_ENV")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(read_only_env.python)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    document = json.loads(run_cli("status", "--json", "--jit-cache-base", str(read_only_env.home)).output)
    assert document["target"] == str(bin_dir / "python3")
    assert document["target_chosen_by"] == "python3 on PATH (no environment is activated)"

    monkeypatch.chdir(read_only_env.root.parent)
    # The environment's directory, by its bare name: its interpreter is the target (every --help
    # says so), named on the first line.
    named = run_cli("status", "--python", read_only_env.root.name, "--jit-cache-base", str(read_only_env.home))
    assert named.exit_code == ExitCode.NOT_OK
    assert named.output.startswith(f"Python {read_only_env.root}/bin/python")


def test_a_misspelt_opt_in_patch_or_distribution_gets_the_nearest_name(read_only_env):
    """`--with auto-enabel` is one error whose hint is the same command with auto-enable, and it
    runs as printed; `manifest add flashinfer` names flashinfer-python (the selector's word)."""
    python = str(read_only_env.python)
    before = snapshot(read_only_env)
    typo = run_cli("apply", "--python", python, "--with", "auto-enabel", "--dry-run")
    assert typo.exit_code == 2 and "--with auto-enabel: no such patch" in typo.output
    assert typo.output.rstrip().endswith("uses auto-enable, the nearest opt-in patch")
    command = printed(typo.output)
    assert command == f"sm120patch apply --python {python} --with auto-enable --dry-run"
    fixed = run_cli(*shlex.split(command)[1:])
    assert fixed.exit_code == 0 and "+++ b/sglang/srt/server_args.py" in fixed.output
    assert snapshot(read_only_env) == before
    wrong = run_cli("manifest", "add", "flashinfer", "0.6.4", "--check")
    assert wrong.exit_code == 2
    assert wrong.output.splitlines()[-1] == "hint: did you mean flashinfer-python?"


@pytest.mark.parametrize("command, changes", [("status", False), ("doctor", False), ("verify", False),
                                              ("check-log", False), ("diff", False), ("list", False),
                                              ("bench", False), ("apply", True), ("revert", True)])
def test_each_help_says_what_an_interrupt_leaves_for_that_command(command, changes):
    """A command that changes nothing does not promise a rollback of a change it never makes."""
    text = run_cli(command, "--help").output
    codes = text.split("Exit codes:")[1]
    line = " ".join(codes[codes.index("130 "):].split())  # the last code, its lines (wrapped at 80 columns) joined
    assert ("the change in progress was rolled back" in line) == changes
    assert ("nothing of the environment was changed" in line) == (not changes)


@pytest.mark.parametrize("command", ["status", "doctor", "verify", "diff", "list", "bench"])
def test_an_interrupted_command_that_changes_nothing_says_so(command, tmp_path):
    """Interrupted while it waits on the target interpreter (one that never answers), a command
    that only reads says it changed nothing, as its --help says, not that it rolled a change back."""
    python = tmp_path / "python3"
    python.write_text('#!/bin/sh\ntouch "$0.started"\nexec sleep 120\n')
    python.chmod(0o755)
    proc = subprocess.Popen([sys.executable, "-m", "sm120patch", command, "--python", str(python)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, HOME=str(tmp_path)))
    try:
        for _ in range(600):
            if Path(f"{python}.started").exists() or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        try:  # the interpreter it waited on, and sm120patch itself if it did not stop
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 130, err
    assert err == "sm120patch: interrupted (SIGINT); this command changes nothing\n", err


def test_a_bad_arch_list_gets_the_same_command_with_a_good_one(read_only_env):
    python = str(read_only_env.python)
    bad = run_cli("build", "--python", python, "--arch", "12")
    assert bad.exit_code == 2
    command = printed(bad.output)
    assert command == f"sm120patch build --python {python} --arch 12.0a"
    again = run_cli(*shlex.split(command)[1:], "--jit-cache-base", str(read_only_env.home))
    assert again.exit_code == 3 and "not a list of compute capabilities" not in again.output  # it parses
    assert printed(again.output).endswith("--arch 12.0a")  # pristine sources are refused: apply --build, that arch


def test_hints_keep_what_was_given_and_say_what_help_lists(toy, shell, tmp_path):
    """#55: build --arch on an unpatched environment hints apply --build with the same --arch (on an
    image build, without it the build is for no GPU); apply with --python on an interpreter
    without any of them does not say "pass --python"; a group's --help lists commands."""
    python = str(toy.venv / "bin" / "python")
    before = toy.snapshot()
    refused = shell(shlex.join(["sm120patch", "build", "--python", python, "--jit-cache-base", str(toy.home),
                                "--arch", "12.0a"]))
    assert refused.returncode == ExitCode.REFUSED, refused.stderr
    assert printed(refused.stderr) == shlex.join(["sm120patch", "apply", "--build", "--python", python,
                                                  "--jit-cache-base", str(toy.home), "--arch", "12.0a"])
    assert changed(before, toy.snapshot()) == []
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    nothing = shell(shlex.join(["sm120patch", "apply", "--python", str(bare / "bin" / "python")]))
    assert nothing.returncode == ExitCode.USAGE and "is installed in" in nothing.stderr
    assert "pass --python" not in nothing.stderr and "hint: that interpreter is not your server's" in nothing.stderr
    for words, lists in ((["bogus"], "commands"), (["manifest", "bogus"], "commands"), (["status", "--bogus"], "options")):
        result = run_cli(*words)
        assert result.exit_code == ExitCode.USAGE
        assert f"--help` lists the {lists}, with examples" in result.output, words


def test_a_crash_fix_read_with_python_names_that_python_in_every_command(tmp_path, read_only_env):
    from test_logcheck import check, flashinfer_unpatched_traceback, logged, sglang_line, sglang_settings

    marker = logged("sglang", "0.5.9", "sglang/srt/managers/scheduler.py", "Scheduler hit an exception",
                    traceback=flashinfer_unpatched_traceback())
    text = sglang_settings("0.5.9", 2, True) + sglang_line("0.5.9", " TP0", marker)
    python = str(read_only_env.python)
    code, doc = check(tmp_path, text, "--python", python)
    commands = re.findall(r"`(sm120patch [^`]+)`", doc["fix"])
    assert code == 1 and doc["verdict"] == "crashed" and len(commands) == 2, doc["fix"]
    assert all(shlex.split(c)[-2:] == ["--python", python] or f"--python {python}" in c for c in commands), commands


def test_small_truths_of_help_list_and_check_log(tmp_path):
    """#55 item 8: the top-level exit codes name 5 and check-log's and build's meanings; commands
    without --python do not describe exit 2 with it; list is in release order; an unmapped
    release's range is in words; a crash in a file sm120patch does not patch, fixed by apply, says
    where the fix goes."""
    from test_logcheck import flashinfer_unpatched_traceback, logged, sglang_line, sglang_settings

    text = run_cli("--help").output.split("Exit codes:")[1]
    assert {int(m) for m in re.findall(r"^    (\d+) ", text, flags=re.M)} == {0, 1, 2, 3, 4, 5, 130}
    top = " ".join(text.split())
    one, three = top.split(" 1 ")[1].split(" 2 ")[0], top.split(" 3 ")[1].split(" 4 ")[0]
    assert "check-log" in one and "build" in one and "check-log" in three
    assert "5 check-log: no verdict yet" in top
    for words in (["export"], ["manifest", "build"], ["manifest", "add"]):
        codes = " ".join(run_cli(*words, "--help").output.split("Exit codes:")[1].split())
        assert "2 bad input" in codes and "--python" not in codes, words
    listed = run_cli("list").output
    firsts = [re.match(r"  (?:from |before |up to )?(\d+(?:\.\d+)+)", line) for line in listed.splitlines()]
    by_distribution, current = {}, None
    for line, first in zip(listed.splitlines(), firsts):
        if not line.startswith(" "):
            current = by_distribution.setdefault(line.split()[0], [])
        elif first and not line.startswith("  before "):
            current.append(Version(first.group(1)))
    assert all(v == sorted(v) for v in by_distribution.values()), by_distribution
    assert by_distribution["flashinfer-python"][0] == Version("0.4.0")

    marker = logged("sglang", "0.5.9", "sglang/srt/managers/scheduler.py", "Scheduler hit an exception",
                    traceback=flashinfer_unpatched_traceback())
    log = tmp_path / "server.log"
    log.write_text(sglang_settings("0.5.9", 2, True) + sglang_line("0.5.9", " TP0", marker))
    crashed = run_cli("check-log", str(log), "--server", "sglang", "--version", "0.5.9").output
    assert "a file sm120patch does not patch; the fix below patches the gate that leads here" in crashed
    unmapped = json.loads(run_cli("check-log", str(log), "--server", "sglang", "--version", "0.5.99", "--json").stdout)
    assert unmapped["verdict"] == "unknown-release" and "lines for from 0.5.1, up to 0.5.23 " in unmapped["summary"]
