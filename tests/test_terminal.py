"""What a person at a terminal and a script at the other end of a pipe get (issue #55): a closed
pipe that keeps the exit code, prose that fits the terminal with every command whole on a line,
colour on a terminal only, and --json documents of one shape."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import termios
from pathlib import Path

import click
import pytest

from helpers import ROOT, changed, run_cli
from sm120patch.cli import cli
from sm120patch.errors import ExitCode
from sm120patch.render import COMMON_KEYS
from test_synthetic import data_dir, toy  # noqa: F401 - the synthetic distribution's fixtures


def run(*argv: str, **environ: str) -> subprocess.CompletedProcess:
    """sm120patch in a process of its own, as a script runs it (it reads this test's data dir),
    its stdout a pipe; ``environ``: variables added to its environment."""
    return subprocess.run([sys.executable, "-m", "sm120patch", *argv], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **environ})


def on_a_terminal(*argv: str, columns: int = 80, **environ: str) -> tuple[int, str]:
    """sm120patch with its stdout and stderr a terminal (a pty) ``columns`` wide, no $COLUMNS:
    (its exit code, what the terminal showed)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "sm120patch", *argv], stdin=subprocess.DEVNULL, stdout=slave,
                            stderr=slave, env={**os.environ, **environ})
    os.close(slave)
    shown = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the program's end of the terminal is closed
            break
        if not data:
            break
        shown.append(data)
    os.close(master)
    return proc.wait(timeout=120), b"".join(shown).decode().replace("\r\n", "\n")


def commands_in(text: str) -> set[str]:
    return set(re.findall(r"`[^`\n]+`", text))


@pytest.fixture
def short_env(read_only_env, monkeypatch):
    """The shared real-wheel environment under a path as short as a user's (~/ml-env), so that a
    command fits 80 columns whole (a test's own paths alone are longer), its JIT cache base the HOME."""
    short = Path(tempfile.mkdtemp(prefix="s", dir="/tmp"))
    (short / "env").symlink_to(read_only_env.root)
    (short / "h").mkdir()
    monkeypatch.setenv("HOME", str(short / "h"))
    yield ["--python", str(short / "env" / "bin" / "python")]
    shutil.rmtree(short)


def test_status_fits_80_columns_and_never_breaks_a_command(short_env):
    argv = ["status", *short_env]
    plain = run(*argv)  # a pipe: one line per item, for grep and scripts
    assert any(len(line) > 80 for line in plain.stdout.splitlines())  # so that the width below means something
    wrapped = run(*argv, COLUMNS="80")
    assert wrapped.returncode == plain.returncode == ExitCode.NOT_OK
    lines = wrapped.stdout.splitlines()
    assert max(map(len, lines)) <= 80, [line for line in lines if len(line) > 80]
    assert all(line.count("`") % 2 == 0 for line in lines)  # every command opens and closes on one line
    assert commands_in(plain.stdout) and commands_in(plain.stdout) == commands_in(wrapped.stdout)
    assert sorted(wrapped.stdout.split()) == sorted(plain.stdout.split())  # the same words: only the lines differ
    assert "\x1b[" not in plain.stdout + wrapped.stdout  # no colour where stdout is no terminal
    # --brief: the answer alone, one line per server; wrapped on a terminal, a command kept whole.
    document = json.loads(run(*argv, "--json").stdout)
    headline = next(d for d in document["distributions"] if d["name"] == "sglang")["fusion"]["headline"]
    brief = run(*argv, "--brief")
    assert (brief.returncode, brief.stdout) == (ExitCode.NOT_OK, headline + "\n")
    brief = run(*argv, "--brief", COLUMNS="80").stdout.splitlines()
    assert " ".join(brief).split() == headline.split() and max(map(len, brief)) <= 80
    assert commands_in("\n".join(brief)) == commands_in(headline)


def test_verdicts_in_colour_on_a_terminal_only_and_never_under_no_color(short_env):
    argv = ["status", *short_env]
    code, shown = on_a_terminal(*argv)
    assert code == ExitCode.NOT_OK
    assert click.style("will not fuse", fg="red", bold=True) in shown
    lines = click.unstyle(shown).splitlines()
    assert max(map(len, lines)) <= 80 and all(line.count("`") % 2 == 0 for line in lines)  # the terminal's width
    code, shown = on_a_terminal(*argv, "--brief", NO_COLOR="1")
    assert code == ExitCode.NOT_OK and "\x1b[" not in shown and "will not fuse" in shown


def closed_pipe(argv: list[str]) -> subprocess.CompletedProcess:
    """``argv`` with its stdout the write end of a pipe whose read end is already closed."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([sys.executable, "-m", "sm120patch", *argv], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(write)


def test_a_closed_stdout_ends_quietly_with_the_exit_code_the_command_would_have_had(toy):
    python = str(toy.venv / "bin" / "python")
    target = ["--python", python, "--jit-cache-base", str(toy.home)]
    before = toy.snapshot()
    for argv, code in ((["status", *target], ExitCode.NOT_OK), (["diff", "--python", python], ExitCode.OK),
                       (["list"], ExitCode.OK), (["status", *target, "--json"], ExitCode.NOT_OK)):
        proc = closed_pipe(argv)
        assert (proc.returncode, proc.stderr) == (code, ""), argv
    assert changed(before, toy.snapshot()) == []
    applied = closed_pipe(["apply", *target])
    assert (applied.returncode, applied.stderr) == (ExitCode.OK, "")
    assert "[9, 10, 12]" in (toy.site / "toyfuse" / "comm.py").read_text()  # the change was made, all of it
    proc = closed_pipe(["status", *target])  # patched now: 0, where a closed pipe must not make it 1
    assert (proc.returncode, proc.stderr) == (ExitCode.OK, "")


def json_commands(group=None, prefix=()) -> dict[str, click.Command]:
    """Every command that takes --json, by its words ("check-log", "manifest build")."""
    group = group or cli
    found = {}
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            found.update(json_commands(command, (*prefix, name)))
        elif any(p.name == "as_json" for p in command.params):
            found[" ".join((*prefix, name))] = command
    return found


def test_every_json_document_carries_the_same_top_level_keys_and_next_as_objects(toy, tmp_path):
    python = str(toy.venv / "bin" / "python")
    log = tmp_path / "server.log"
    log.write_text("")
    target = ["--python", python, "--jit-cache-base", str(toy.home)]
    argv = {"status": target, "apply": [*target, "--dry-run"], "revert": [*target, "--dry-run"], "build": target,
            "verify": target, "doctor": target, "bench": ["--python", python], "check-log": [str(log)],
            "list": ["--python", python]}
    assert set(json_commands()) == set(argv)  # a new --json command gets its line here
    before = toy.snapshot()
    codes = set()
    for command, args in argv.items():
        result = run(*command.split(), *args, "--json")
        document = json.loads(result.stdout)
        assert tuple(document)[:len(COMMON_KEYS)] == COMMON_KEYS, (command, list(document))
        assert document["command"] == command and document["exit_code"] == result.returncode, command
        assert all(set(step) == {"command", "reason"} for step in document["next"]), command
        codes.add(result.returncode)
    assert len(codes) > 1  # reports and refusals alike (build refuses the unpatched toy; bench finds no torch)
    assert changed(before, toy.snapshot()) == []
    # The next step is a command a script can run as it is.

    (step,) = json.loads(run("status", *target, "--json").stdout)["next"]
    assert step["command"] == shlex.join(["sm120patch", "apply", *target]) and "`" not in step["command"]


def test_quiet_is_taken_after_the_command_name_too(toy):
    python = str(toy.venv / "bin" / "python")
    for words in json_commands():
        assert "-q" in run_cli(*words.split(), "--help").stdout, words
    result = run("status", "--python", python, "--jit-cache-base", str(toy.home), "-q")
    assert (result.returncode, result.stdout, result.stderr) == (ExitCode.NOT_OK, "", "")
    assert run_cli("list", "-q").output == ""


def test_every_help_fits_80_columns_with_every_exit_code(monkeypatch):
    """`--help` in tmux at 80 columns: no line wider (exit codes wrapped under their text, a long
    example continued with a backslash), and each command's codes still listed."""
    def commands(group, words=()):
        yield words
        for name, command in group.commands.items():
            yield from commands(command, (*words, name)) if isinstance(command, click.Group) else [(*words, name)]

    monkeypatch.setenv("COLUMNS", "80")
    for words in commands(cli):
        text = run_cli(*words, "--help").output
        wide = [line for line in text.splitlines() if len(line) > 80]
        assert wide == [], (words, wide)
    assert "  1   a fused result differs from the reference" in run_cli("bench", "--help").output


def test_the_readmes_screen_is_what_status_prints_at_80_columns(read_only_env, monkeypatch):
    """The README's "Is it fusing?" screen, as status prints it for an interpreter path as long as
    /home/me/ml-env/bin/python3 (so that the lines break where the README's do); and the Quick
    start says what to do when pipx is missing or ~/.local/bin is not on PATH."""
    readme = (ROOT / "README.md").read_text()
    shown = readme.split("$ sm120patch status --python ~/ml-env/bin/python3            # at 80 columns\n")[1]
    shown = shown.split("\n$ ")[0].splitlines()
    short = Path(tempfile.mkdtemp(prefix="", dir="/tmp"))  # /tmp/ and 8 characters
    try:
        (short / "e").symlink_to(read_only_env.root)
        python = str(short / "e" / "bin" / "python3")
        assert len(python) == len("/home/me/ml-env/bin/python3")
        monkeypatch.setenv("HOME", str(short))
        printed = run("status", "--python", python, COLUMNS="80").stdout.replace(python, "/home/me/ml-env/bin/python3")
    finally:
        shutil.rmtree(short)
    printed = re.sub(r"\(3\.\d+\.\d+\)", "(3.11.7)", printed)
    assert printed.splitlines()[:len(shown)] == shown
    quick = readme.split("## Quick start")[1].split("## ")[0]
    assert "\npipx ensurepath " in quick and "No pipx: `python3 -m pip install --user pipx`" in quick


# What only the writing commands (and the other commands) need: status, run most, by people and by
# Ansible, must not pay for them (make bench; docs/benchmarks.md).
NOT_FOR_STATUS = ("sm120patch.transaction", "sm120patch.write", "sm120patch.plan", "sm120patch.changes",
                  "sm120patch.jitbuild", "sm120patch.releases", "sm120patch.verify", "sm120patch.logcheck",
                  "sm120patch.bench", "sm120patch.doctor", "sm120patch.driver", "libcst", "shutil", "ctypes")


def _loaded(toy, *argv: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """A command against the toy environment in a process of its own, and the modules it loaded."""
    code = ("import sys\nfrom sm120patch.cli import cli\ntry:\n    cli(sys.argv[1:], prog_name='sm120patch')\n"
            "except SystemExit:\n    pass\nprint(' '.join(sorted(sys.modules)), file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", code, argv[0], "--python", str(toy.venv / "bin" / "python"),
                           "--jit-cache-base", str(toy.home), *argv[1:]], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "80"}, timeout=120)
    return proc, set(proc.stderr.split())


def test_status_imports_nothing_only_the_other_commands_need(toy):
    """Wrapping and colour included: status's imports hold none of the writers' modules."""
    for extra in ([], ["--brief"], ["--json"]):
        proc, loaded = _loaded(toy, "status", *extra)
        assert "sm120patch.render" in loaded and "toyfuse" in proc.stdout, proc.stdout + proc.stderr
        assert sorted(loaded & set(NOT_FOR_STATUS)) == [], extra


def test_revert_reads_only_the_installed_releases_sets_and_runs_no_rewriter(toy):
    """Revert puts saved bytes back: it neither checks every patch set of every distribution nor
    imports libcst (a third of a small revert's time went to both), and apply makes only the
    rewriters its own edits run."""
    before = toy.snapshot()
    proc, loaded = _loaded(toy, "apply")
    assert proc.returncode == 0 and toy.snapshot() != before, proc.stdout + proc.stderr
    assert "libcst" in loaded  # the toy's edits are python.* ones
    proc, loaded = _loaded(toy, "revert")
    assert proc.returncode == 0 and toy.snapshot() == before, proc.stdout + proc.stderr
    assert "libcst" not in loaded


def test_doctor_without_the_driver_does_not_say_it_will_fuse_here(sm120patch):
    """Where the driver cannot be read, doctor's verdict is about an SM120 GPU, says that this
    machine's are not known and why, and is not marked ok."""
    from sm120patch import driver

    facts = driver.query()
    if facts.devices:
        pytest.skip("the driver answers on this machine: doctor reads its GPUs")
    assert sm120patch("apply").exit_code == ExitCode.OK
    report = sm120patch("doctor").output.splitlines()
    (line,) = [line for line in report if "sglang 0.5.9 will fuse" in line]
    assert line.startswith("info  sglang 0.5.9 will fuse on an SM120 GPU when started with "), line
    assert line.endswith(f" — this machine's GPUs are not known: the driver was not read ({facts.error})"), line
