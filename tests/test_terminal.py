"""What a person at a terminal and a script at the other end of a pipe get (issue #55): a closed
pipe that keeps the exit code, prose that fits the terminal with every command whole on a line,
colour on a terminal only, and --json documents of one shape."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers import changed
from sm120patch.errors import ExitCode
from test_synthetic import data_dir, toy  # noqa: F401 - the synthetic distribution's fixtures


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
