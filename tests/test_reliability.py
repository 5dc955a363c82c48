"""Reliability, round three (issue 24): package upgrades under a patch, inputs that used to hang
or crash, claims that were not true, and small input edges. Each test changes the environment
as a user's tools would, runs sm120patch as a user does (a process of its own), and checks the
files and the exit code, not only the words. The signal sweeps at every write-related system
call are in test_fault_injection.py."""

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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from helpers import FLASHINFER_FILES, ROOT, changed, make_venv, need, run_cli, snapshot
from sm120patch.environment import Environment, InstalledDistribution, start_probe
from sm120patch.errors import ExitCode
from sm120patch.installed import InstalledTree
from sm120patch.wheels import fetch_wheel
from test_synthetic import data_dir, toy  # noqa: F401 - the synthetic distribution's fixtures


def sm120patch(toy, *words: str) -> str:
    """A command line against the toy environment, quoted."""
    return shlex.join(["sm120patch", words[0], "--python", str(toy.venv / "bin" / "python"),
                       "--jit-cache-base", str(toy.home), *words[1:]])


def one_error_line(stderr: str, text: str) -> None:
    lines = stderr.splitlines()
    assert lines and lines[0].startswith("sm120patch: error: ") and text in lines[0], stderr
    assert len([line for line in lines if not line.startswith("hint: ")]) == 1 and "Traceback" not in stderr, stderr


# -- upgrades and reinstalls under a patch ----------------------------------------------------

def pip(env, *args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--python", str(env.python), *args, "--quiet", "--no-deps",
                    "--no-compile", "--disable-pip-version-check"], check=True)


def test_state_of_a_version_that_is_gone_is_reported_then_removed(sm120patch, serving_env, wheel_cache):
    assert sm120patch("apply").exit_code == 0
    old = serving_env.dist_info("flashinfer_python").name
    pip(serving_env, "install", str(fetch_wheel("flashinfer-python", "0.6.5", wheel_cache)))  # an upgrade over it
    status = sm120patch("status", "--json")
    (orphan,) = json.loads(status.output)["orphaned_state"]
    assert orphan["install"] == old and len(orphan["files"]) == 1 + len(FLASHINFER_FILES)  # ledger and originals
    assert all(Path(f).is_file() for f in orphan["files"])
    assert "that install is gone" in sm120patch("status").output
    reverted = sm120patch("revert")
    assert reverted.exit_code == 0 and f"removed sm120patch's state of {old}" in reverted.output
    assert not serving_env.state_root.exists(), sorted(serving_env.state_root.rglob("*"))


def test_a_reinstall_of_the_same_release_then_revert_leaves_no_state(sm120patch, serving_env, flashinfer_wheel):
    assert sm120patch("apply", "--flashinfer").exit_code == 0
    pip(serving_env, "install", "--force-reinstall", str(flashinfer_wheel))
    assert "the files are the release's again" in sm120patch("status", "--flashinfer").output
    reverted = sm120patch("revert", "--flashinfer")
    assert reverted.exit_code == 0 and "removed sm120patch's ledger and saved originals" in reverted.output
    assert not serving_env.state_root.exists(), sorted(serving_env.state_root.rglob("*"))
    assert serving_env.record_mismatches() == []


def test_state_of_an_uninstalled_distribution_goes_with_the_next_apply(sm120patch, serving_env):
    assert sm120patch("apply").exit_code == 0
    subprocess.run([sys.executable, "-m", "pip", "--python", str(serving_env.python), "uninstall", "--yes", "--quiet",
                    "sglang"], check=True)
    assert "sglang-0.5.9.dist-info" in sm120patch("status").output
    applied = sm120patch("apply")
    assert applied.exit_code == 0 and "removed sm120patch's state of sglang-0.5.9.dist-info" in applied.output
    assert sorted(p.name for p in serving_env.state_root.iterdir()) == [serving_env.dist_info("flashinfer_python").name]


# -- inputs that hung or crashed --------------------------------------------------------------

def test_a_fifo_in_place_of_a_patched_file_is_refused_without_waiting(toy, shell):
    comm = toy.site / "toyfuse" / "comm.py"
    comm.unlink()
    os.mkfifo(comm)
    for words in (["status"], ["apply"], ["revert"], ["diff"]):
        ran = shell(sm120patch(toy, *words) if words[0] != "diff" else
                    shlex.join(["sm120patch", "diff", "--python", str(toy.venv / "bin" / "python")]), timeout=30)
        assert ran.returncode == ExitCode.REFUSED, (words, ran.stdout, ran.stderr)
        one_error_line(ran.stderr, "is a FIFO (named pipe), not a regular file")


def test_a_fifo_in_place_of_record_is_an_unreadable_record_not_a_missing_row(toy, shell):
    record = toy.site / "toyfuse-1.0.dist-info" / "RECORD"
    record.unlink()
    os.mkfifo(record)
    ran = shell(sm120patch(toy, "apply"), timeout=30)
    assert ran.returncode == ExitCode.REFUSED
    one_error_line(ran.stderr, "RECORD cannot be read")
    assert "not listed" not in ran.stderr


def test_metadata_without_a_version_is_one_line_with_the_reinstall(toy, shell):
    metadata = toy.site / "toyfuse-1.0.dist-info" / "METADATA"
    metadata.write_text(metadata.read_text().replace("Version: 1.0\n", ""))
    before = toy.snapshot()
    for words in (["status"], ["verify"], ["apply"], ["revert"]):
        ran = shell(sm120patch(toy, *words))
        assert ran.returncode == ExitCode.REFUSED, (words, ran.stderr)
        one_error_line(ran.stderr, "has no Version: field (a damaged install)")
        assert "toyfuse==1.0" in ran.stderr  # the reinstall names the release its .dist-info names
    assert changed(before, toy.snapshot()) == []


STRACE = shutil.which("strace")
PACKAGE = Path(sys.modules["sm120patch"].__file__).parent  # (sm120patch here is a function)
HANDLER_CALLS = ("rt_sigaction", "rt_sigprocmask")
ADDRESS = re.compile(r"0x[0-9a-f]+")


def startup_moments() -> list[tuple[str, str | None, int, str]]:
    """The moments of ``python -m sm120patch list`` a Ctrl-C is sent at, each named by what the
    process does there: (syscall, path or None, n, the call). Every change of a signal handler
    or of the signal mask (the interpreter's, main()'s, the CLI's, the finalizer's: the n-th
    call of its syscall, which only the interpreter and sm120patch make, in a fixed order), and
    the first stat of each of sm120patch's modules as it is imported (by path)."""
    trace = subprocess.run([STRACE, "-o", "/dev/stdout", "-e", f"trace={','.join(HANDLER_CALLS)},%%stat",
                            sys.executable, "-m", "sm120patch", "list"], capture_output=True, text=True, check=True).stdout
    moments, counts, stated = [], {}, set()
    for line in trace.splitlines():
        syscall = line.partition("(")[0]
        counts[syscall] = counts.get(syscall, 0) + 1
        if syscall in HANDLER_CALLS:
            if syscall == "rt_sigprocmask" or ", NULL, " not in line:  # a query changes nothing
                moments.append((syscall, None, counts[syscall], ADDRESS.sub("ADDR", line)))
            continue
        path = line.split('"')[1] if '"' in line else ""
        if path.startswith(f"{PACKAGE}/") and path.endswith(".py") and path not in stated:
            stated.add(path)
            moments.append((syscall, path, 1, line))
    return moments


def test_ctrl_c_while_starting_is_one_line_never_a_traceback(tmp_path):
    """Ctrl-C, from strace, at every moment of start-up and exit where a signal handler or the
    signal mask changes, and as each of sm120patch's modules is imported. Before sm120patch's
    first line runs, the interpreter's own start-up answers (CPython prints what it prints
    there, or dies of the signal); from that line on: one line, exit 130 (or death by SIGINT
    once the line is out, or as the interpreter finalizes), never a traceback of ours, never a
    signal dropped in a finalizer ("Exception ignored"). Each moment is reached in the run
    that is sent the signal (its own trace says so), so none is skipped for a shorter run."""
    need(STRACE is not None, "strace is not installed (.ci/run installs it)")
    moments = startup_moments()
    imports = [m for m in moments if m[1] is not None and Path(m[1]).name not in ("__init__.py", "__main__.py")]
    assert len(imports) >= 10 and sum(m[0] == "rt_sigprocmask" for m in moments) >= 2, moments

    def interrupt_at(index: int) -> tuple[int, str] | str:
        syscall, path, n, call = moments[index]
        trace = tmp_path / f"trace-{index}.txt"
        where = ["-P", path] if path else []
        proc = subprocess.run([STRACE, "-o", str(trace), *where, "-e", f"trace={syscall}", "-e",
                               f"inject={syscall}:signal=INT:when={n}", sys.executable, "-m", "sm120patch", "list"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=120)
        calls = [line for line in trace.read_text().splitlines() if line.startswith(f"{syscall}(")]
        if len(calls) < n or (path is None and ADDRESS.sub("ADDR", calls[n - 1]) != call):
            return f"{call}: not the call the signal was sent at: {calls[n - 1:n]}"
        return proc.returncode, proc.stderr

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(interrupt_at, range(len(moments))))
    ours = 0
    for (syscall, path, n, call), result in zip(moments, results):
        assert not isinstance(result, str), result
        returncode, stderr = result
        frames = [line for line in stderr.splitlines() if line.strip().startswith("File ")]
        assert not any("sm120patch" in line for line in frames), (call, stderr)
        assert "Exception ignored" not in stderr, (call, stderr)
        if stderr.startswith("sm120patch:"):
            ours += 1
            assert stderr.count("\n") == 1 and "interrupted (SIGINT)" in stderr, (call, stderr)
            assert returncode in (130, -signal.SIGINT), (call, returncode, stderr)
        if (syscall, path, n, call) in imports:  # in sm120patch's own code: its line, every time
            assert returncode == 130 and stderr.startswith("sm120patch: interrupted (SIGINT)"), (call, returncode, stderr)
    print(f"\nSIGINT at {len(moments)} moments of start-up: {ours} answered with sm120patch's line")
    assert ours > len(imports)  # the handlers' moments too, not only the imports


@pytest.mark.parametrize("how", ["console script", "python -m"])
def test_a_signal_that_came_while_python_started_is_answered_once_the_handlers_are_in_place(how):
    """What a launcher can do about Ctrl-C inside Python's own start-up (before sm120patch's
    first line: README, "Ctrl-C while starting"): start sm120patch with SIGINT, SIGTERM and
    SIGHUP blocked. A signal that came meanwhile waits, and sm120patch, which unblocks them once
    its handlers are in place, answers it with its one line and 130 (before: it kept the
    launcher's mask, so the signal was never delivered, and later Ctrl-Cs neither: the command
    ran to its end, exit 0)."""
    script = Path(sys.executable).parent / "sm120patch"
    argv = [str(script), "--version"] if how == "console script" else [sys.executable, "-m", "sm120patch", "--version"]
    launcher = ("import os, signal, sys\n"
                "signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))\n"
                "os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, pending until unblocked\n"
                "os.execv(sys.argv[1], sys.argv[1:])\n")
    proc = subprocess.run([sys.executable, "-c", launcher, *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 130, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stderr == "sm120patch: interrupted (SIGINT) while starting; nothing was changed\n", proc.stderr
    assert proc.stdout == ""


def test_a_python_that_never_answers_is_killed_with_what_it_started(tmp_path):
    pidfile = tmp_path / "child.pid"
    python = tmp_path / "python3"
    python.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {pidfile}\nwait\n")
    python.chmod(0o755)
    probe = start_probe(str(python), ["flashinfer-python"])
    deadline = time.monotonic() + 120  # a bound for a busy machine, not a timing under test
    while not (pidfile.exists() and pidfile.read_text().strip()):
        assert time.monotonic() < deadline, "the stand-in python never started its child"
        time.sleep(0.05)
    child = int(pidfile.read_text())
    probe.stop()  # what result() does when the 60 s are up, or a signal arrives
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the probe's child outlived it")


# -- claims that were not true --------------------------------------------------------------

def test_a_byte_that_is_not_utf8_in_metadata_is_not_a_bad_interpreter(toy, shell):
    metadata = toy.site / "toyfuse-1.0.dist-info" / "METADATA"
    metadata.write_bytes(metadata.read_bytes() + b"Summary: caf\xe9\n")
    ran = shell(sm120patch(toy, "status"))
    assert ran.returncode == ExitCode.NOT_OK and "toyfuse 1.0: not patched" in ran.stdout, ran.stderr


def test_a_record_row_hashed_with_md5_stops_apply(toy, shell):
    record = toy.site / "toyfuse-1.0.dist-info" / "RECORD"
    record.write_text("\n".join(
        "toyfuse/comm.py,md5=0123456789abcdef,99" if row.startswith("toyfuse/comm.py,") else row
        for row in record.read_text().splitlines()) + "\n")
    before = toy.snapshot()
    ran = shell(sm120patch(toy, "apply"))
    assert ran.returncode == ExitCode.REFUSED
    one_error_line(ran.stderr, "RECORD lists toyfuse/comm.py with an md5 hash, not sha256")
    assert changed(before, toy.snapshot()) == []


def test_a_state_directory_its_owner_cannot_read_is_not_called_an_interrupted_run(toy, shared_dir):
    from helpers import run_as_nobody

    state = shared_dir / "state"
    state.mkdir()
    subprocess.run(["chown", "nobody", str(state)], check=True)
    state.chmod(0)
    code = ("from pathlib import Path; from sm120patch.journal import read_journal\n"
            "from sm120patch.errors import Sm120PatchError\n"
            f"try:\n    read_journal(Path({str(state / 'journal.json')!r}))\n"
            "except Sm120PatchError as exc:\n    print(exc.message); print(exc.hint)\n")
    ran = run_as_nobody(["/usr/bin/python3", "-c", code], shared_dir)
    assert "cannot be read by this user" in ran.stdout and "interrupted" not in ran.stdout, (ran.stdout, ran.stderr)
    assert f"chmod 700 {state}" in ran.stdout


# -- small input edges --------------------------------------------------------------------------

def test_a_python_path_too_long_is_bad_input():
    result = run_cli("status", "--python", "/" + "a" * 5000)
    assert result.exit_code == ExitCode.USAGE and "File name too long" in result.output
    assert len(result.output) < 400  # the value is shortened in the message


def test_an_old_python_is_refused_not_reported_empty(tmp_path):
    python = tmp_path / "python3.6"  # answers as a Python 3.6 would (framed, on the probe's own pipe)
    python.write_text("#!/bin/sh\nprintf '\\036sm120patch-answer\\n%s\\n\\036sm120patch-end\\n' "
                      "\"{'executable': '$0', 'python_version': '3.6.15', 'prefix': '/opt/py36', "
                      "'base_prefix': '/opt/py36', 'user_base': '', 'distributions': {}}\" "
                      "> /proc/self/fd/$SM120PATCH_PROBE_FD\n")
    python.chmod(0o755)
    result = run_cli("status", "--python", str(python))
    assert result.exit_code == ExitCode.USAGE
    assert "is Python 3.6.15: the servers sm120patch patches run on Python 3.8 or newer" in result.output


def test_a_newline_in_an_option_value_stays_one_line():
    result = subprocess.run([sys.executable, "-m", "sm120patch", "status", "--python", "/srv/a\nb"],
                            capture_output=True, text=True)
    assert result.returncode == ExitCode.USAGE and result.stderr == "sm120patch: error: --python /srv/a\\nb: no such file\n"


@pytest.mark.parametrize("args, text", [
    (["apply", "--with", ","], "',' names no patch"),
    (["apply", "--with", ""], "'' names no patch"),
    (["revert", "--wheel-dir", "/nonexistent"], "Directory '/nonexistent' does not exist"),
])
def test_empty_or_missing_option_values_are_refused(args, text):
    result = run_cli(*args)
    assert result.exit_code == ExitCode.USAGE and text in result.output.splitlines()[0]


def test_json_errors_are_a_json_document_on_stdout(toy, shell):
    ran = shell(sm120patch(toy, "status", "--toyfuse", "1.1", "--json"))
    assert ran.returncode == ExitCode.USAGE
    error = json.loads(ran.stdout)["error"]
    assert error["exit_code"] == 2 and "has toyfuse 1.0" in error["message"] and "--toyfuse 1.0" in error["hint"]
    assert ran.stderr.startswith("sm120patch: error: ")


def test_an_install_in_the_base_of_a_system_site_packages_venv_is_named_as_shared(tmp_path):
    base, venv = tmp_path / "base", tmp_path / "venv"
    site = base / "lib" / "python3.12" / "site-packages"
    dist = InstalledDistribution("flashinfer-python", "0.6.4", site, site / "flashinfer_python-0.6.4.dist-info", {})
    shared = Environment(venv / "bin" / "python", "3.12.0", venv, None, {"flashinfer-python": dist}, base_prefix=base)
    own = shared._replace(prefix=base)
    assert shared.shares_base(dist) and not own.shares_base(dist)
    from sm120patch.distributions import load_registry

    tree = InstalledTree(shared, dist, load_registry(full=False).get("flashinfer-python"))
    assert "--system-site-packages: a change there is a change for every environment on that base" in tree.words.shared_with
    assert InstalledTree(own, dist, tree.distribution).words.shared_with is None


def test_the_sweeps_and_exit_codes_are_documented():
    readme = ROOT.joinpath("README.md").read_text()
    assert "| 143 | terminated (SIGTERM" in readme and "| 129 | hung up (SIGHUP" in readme
    assert "(143: SIGTERM, 129: SIGHUP)" in run_cli("apply", "--help").output


def test_a_signal_a_finalizer_drops_is_noted_and_ends_the_run_before_its_commit_point(capfd):
    """A handler runs between any two bytecodes, also in a weakref callback, where Python prints
    the exception and drops it: the run would go on as if no Ctrl-C came, and commit."""
    import weakref

    from sm120patch import signals

    class Owner:
        pass

    with signals.handled():
        owner = Owner()
        keep = weakref.ref(owner, lambda ref: signals._handler(signal.SIGINT, None))
        del owner  # the callback runs here; its Interrupted is unraisable
        assert keep() is None and signals.pending() == signal.SIGINT
        with pytest.raises(signals.Interrupted) as raised:
            signals.commit_point("apply")  # the transaction rolls back instead of committing
        assert raised.value.signum == signal.SIGINT and signals.STATE.committed is None
    assert "Exception ignored" not in capfd.readouterr().err


def test_a_command_whose_signal_a_finalizer_dropped_exits_as_interrupted(monkeypatch):
    import weakref

    from sm120patch import signals

    class Owner:
        pass

    def list_then_drop(*args, **kwargs):
        owner = Owner()
        keep = weakref.ref(owner, lambda ref: signals._handler(signal.SIGTERM, None))
        del owner  # the callback runs here (the reference outlives what it refers to)
        assert keep() is None
        return "listed"

    monkeypatch.setattr("sm120patch.render.render_list", list_then_drop)
    result = run_cli("list")
    assert result.exit_code == 143, result.output
    assert "interrupted (SIGTERM)" in result.output and "Exception ignored" not in result.output
