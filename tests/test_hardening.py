"""Issue #61, items 4, 5, 7, 8 and 9: what a hostile file, path or archive, a concurrent run and
a user's own files can make sm120patch print or do. Each test failed before its fix."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sm120patch.errors import ExitCode
from test_synthetic import data_dir  # noqa: F401 - the synthetic distribution's data
from toy import SOURCE, make_install, make_wheel

BIN = str(Path(sys.executable).parent)  # where this checkout's `sm120patch` command is


def sm120patch(*argv: str, env: dict, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sm120patch", *argv], capture_output=True, env=env, timeout=120,
                          **kwargs)


# -- item 4: escapes from a file or a path ---------------------------------------------------------

# What a drifted file may hold: OSC 52 (write the clipboard), OSC 0 (the window title), a CSI that
# clears the screen, 8-bit CSI (C1), NUL, a backspace that overwrites what was shown, a bidi override.
HOSTILE = "\x1b]52;c;ZXZpbA==\x07 \x1b]0;owned\x07 \x1b[2J \x9b31m \x00 \x08\u202e"
CONTROLS = re.compile(rb"[\x00-\x08\x0b-\x1f\x7f]|\xc2[\x80-\x9f]|\xe2\x80[\xa8\xa9\xaa-\xae]")


def test_escapes_from_a_file_or_a_path_are_shown_never_obeyed(data_dir, tmp_path):  # noqa: F811
    venv = tmp_path / "env\x1b]0;title\x07\x1b[31m"  # a path a terminal would act on
    site = make_install(venv, [make_wheel(tmp_path, "1.0")])
    comm = site / "toyfuse" / "comm.py"
    comm.write_text(f"# {HOSTILE}\n{SOURCE}")
    (tmp_path / "home").mkdir()
    env = {**os.environ, "SM120PATCH_DATA_DIR": str(data_dir), "HOME": str(tmp_path / "home"),
           "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    python = str(venv / "bin" / "python")
    wheels = ["--wheel-dir", str(tmp_path)]
    runs = {"status": sm120patch("status", "--python", python, env=env),
            "apply": sm120patch("apply", "--python", python, *wheels, env=env),
            "diff": sm120patch("diff", "--force", "--python", python, env=env),
            "revert --dry-run": sm120patch("revert", "--dry-run", "--force", "--python", python, *wheels, env=env)}
    for name, proc in runs.items():
        shown = proc.stdout + proc.stderr
        assert not CONTROLS.search(shown), (name, shown)
        assert b"Traceback" not in shown, name
    # The refusal's diff and the forced revert's show what the file holds, as text.
    assert runs["apply"].returncode == ExitCode.REFUSED
    assert rb"+# \x1b]52;c;ZXZpbA==\x07 \x1b]0;owned\x07 \x1b[2J \x9b31m \x00 \x08\u202e" in runs["apply"].stderr
    assert rb"-# \x1b]52;c;ZXZpbA==\x07" in runs["revert --dry-run"].stdout
    # The command `next:` and a hint name is the same path, when pasted into a shell.
    hint = re.search(rb"reinstall with `([^`]+)`", runs["apply"].stderr).group(1).decode()
    assert subprocess.run(["bash", "-c", f"test -x {hint.split(' -m ')[0]}"]).returncode == 0, hint
    comm.write_text(SOURCE)  # the release's bytes again: the next command apply runs, as printed
    status = sm120patch("status", "--python", python, env=env)
    (command,) = re.findall(r"next: `(sm120patch apply [^`]+)`", status.stdout.decode())
    applied = subprocess.run(["bash", "-c", command], capture_output=True, env=env, timeout=120)
    assert applied.returncode == ExitCode.OK, applied.stderr
    assert "[9, 10, 12]" in comm.read_text()
