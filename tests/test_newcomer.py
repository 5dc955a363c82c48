"""The newcomer's pass (issue #64): what a new user meets first. A Ctrl-C after `apply` has
printed its report, `--json` when interrupted, the default `status` that fits a screen, the
commands the tool prints run as printed, vLLM's --compilation-config as one pasteable value."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import need
from test_synthetic import data_dir, toy  # noqa: F401 - the synthetic distribution's fixtures

STRACE = shutil.which("strace")
COMMITTED = "sm120patch: SIGINT arrived after the apply was committed: the change stands and its cleanup finished\n"


def toy_argv(toy, *words: str) -> list[str]:
    return [sys.executable, "-m", "sm120patch", words[0], "--python", str(toy.venv / "bin" / "python"),
            "--jit-cache-base", str(toy.home), *words[1:]]


def after_the_report(trace: str) -> list[tuple[str, int]]:
    """Every syscall of a traced run after its last write to stdout (the report's end), as
    (syscall, n): the n-th call of that syscall in the run, which strace can inject a signal at."""
    counts: dict[str, int] = {}
    moments = []
    for line in trace.splitlines():
        syscall = line.partition("(")[0]
        if not syscall.isidentifier():
            continue
        counts[syscall] = counts.get(syscall, 0) + 1
        if syscall == "write" and line.startswith("write(1,"):
            moments = []
            continue
        moments.append((syscall, counts[syscall]))
    return moments


def test_a_ctrl_c_after_apply_printed_its_report_never_reads_as_rolled_back(toy, tmp_path):
    """SIGINT at every syscall `apply` makes after the last line of its report (strace injects
    it there): the patch stands, so the exit code is apply's own (0), never 130 nor a death by
    the signal (which the shell shows as 130, "rolled back"), and stderr is empty or the one line
    that says the signal came after the commit. Before, Python's finalization put the default
    handler back and a Ctrl-C there ended the process silently by the signal."""
    need(STRACE is not None, "strace is not installed (.ci/run installs it)")
    revert = toy_argv(toy, "revert")
    status = toy_argv(toy, "status", "--brief")
    first = tmp_path / "trace.txt"
    subprocess.run([STRACE, "-o", str(first), *toy_argv(toy, "apply")], capture_output=True, check=True, timeout=120)
    moments = after_the_report(first.read_text())
    assert moments, first.read_text()[-2000:]
    subprocess.run(revert, capture_output=True, check=True, timeout=120)
    outcomes = {}
    for syscall, n in moments:
        trace = tmp_path / f"trace-{syscall}-{n}.txt"
        proc = subprocess.run([STRACE, "-o", str(trace), "-e", f"trace={syscall}", "-e",
                               f"inject={syscall}:signal=INT:when={n}", *toy_argv(toy, "apply")],
                              capture_output=True, text=True, timeout=120)
        reached = sum(line.startswith(f"{syscall}(") for line in trace.read_text().splitlines()) >= n
        outcomes[(syscall, n)] = (reached, proc.returncode, proc.stderr)
        assert subprocess.run(status, capture_output=True, timeout=120).returncode == 0, (syscall, n, proc.stderr)
        subprocess.run(revert, capture_output=True, check=True, timeout=120)
    for moment, (reached, returncode, stderr) in outcomes.items():
        assert returncode == 0, (moment, returncode, stderr)
        assert stderr in ("", COMMITTED), (moment, stderr)
    answered = [m for m, (reached, _, stderr) in outcomes.items() if reached and stderr == COMMITTED]
    print(f"\nSIGINT at {len(moments)} moments after apply's report: {len(answered)} answered with the committed line")
    assert answered  # the signal was delivered and said, not only sent to a process already gone


@pytest.mark.parametrize("command, syscall, code", [
    ("status", "wait4", 130),  # while it waits for the target interpreter's answer
    ("apply", "rename", 130),  # inside the transaction: rolled back
    ("revert", "wait4", 130),
    ("verify", "wait4", 130),
])
def test_an_interrupted_json_command_still_prints_its_document(toy, command, syscall, code):
    """`--json` always prints a document on stdout: an interrupt's too, with the same keys as
    every other (command, exit_code, target, next) and the one line the text gives, under
    error. Before, an interrupted --json run printed nothing on stdout."""
    import json

    need(STRACE is not None, "strace is not installed (.ci/run installs it)")
    if command == "revert":
        subprocess.run(toy_argv(toy, "apply"), capture_output=True, check=True, timeout=120)
    proc = subprocess.run([STRACE, "-o", "/dev/null", "-e", f"trace={syscall}", "-e",
                           f"inject={syscall}:signal=INT:when=1", *toy_argv(toy, command, "--json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    document = json.loads(proc.stdout)
    assert list(document)[:4] == ["command", "exit_code", "target", "next"] and document["command"] == command
    assert document["exit_code"] == code and "interrupted (SIGINT)" in document["error"]["message"], document
    assert proc.stderr.startswith("sm120patch: interrupted (SIGINT)"), proc.stderr


def pass_config_fields(site: Path) -> dict[str, str]:
    """PassConfig's fields and their annotations, read from the installed vLLM's own source."""
    import ast

    source = next(p for p in (site / "vllm" / "config" / "compilation.py", site / "vllm" / "config" / "pass_config.py")
                  if p.is_file() and "class PassConfig" in p.read_text())
    tree = ast.parse(source.read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "PassConfig")
    return {n.target.id: ast.unparse(n.annotation) for n in cls.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


@pytest.mark.wheels  # fetches a real vLLM wheel itself (no wheel fixture marks it)
@pytest.mark.parametrize("version", ["0.11.1"])
def test_vllm_gets_one_compilation_config_with_the_size_for_this_box(tmp_path, version):
    """vLLM's advice names one --compilation-config a user can paste: the key that turns the
    pass on and the size key with its value, both fields of the release's own PassConfig (read
    from its wheel), parsed as vLLM parses the option (JSON). Before, it named
    pass_config.fi_allreduce_fusion_max_size_mb and the switch as two things, with no value."""
    import json
    import re
    import shlex

    from helpers import Session
    from test_vllm import vllm_env

    env = vllm_env(tmp_path, version)
    output = Session(env)("status", "--verbose").output
    configs = re.findall(r"`(--compilation-config '[^`]*')`", output)
    assert configs, output
    fields = pass_config_fields(env.site_packages)
    for config in configs:
        option, value = shlex.split(config)
        passes = json.loads(value)["pass_config"]
        assert set(passes) <= set(fields), (passes, fields)
        switch, sizing = list(passes)
        assert fields[switch] == "bool" and passes[switch] is True
        assert "float" in fields[sizing] and passes[sizing] == 0.5
