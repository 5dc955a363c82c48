"""The transaction: atomic writes, rollback on failure, recovery of an interrupted run."""

from __future__ import annotations

import errno
import os

import pytest

from sm120patch import transaction
from sm120patch.errors import ExitCode, TransactionError
from sm120patch.state import DistributionState
from sm120patch.transaction import atomic_write, environment_lock

from test_e2e import COMM, COMMUNICATOR, HEADER, LAMPORT


def test_atomic_write_replaces_content_keeps_mode_and_leaves_no_temp(tmp_path):
    target = tmp_path / "f.py"
    target.write_bytes(b"old")
    target.chmod(0o640)
    atomic_write(target, b"new", like=target.stat())
    assert target.read_bytes() == b"new"
    assert target.stat().st_mode & 0o777 == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["f.py"]


def test_atomic_write_failure_leaves_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "f.py"
    target.write_bytes(b"old")

    def full_disk(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(transaction.os, "write", full_disk)
    with pytest.raises(OSError):
        atomic_write(target, b"new")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.py"]


@pytest.mark.parametrize("failing_replace", [1, 2, 3, 4])
def test_a_failed_replace_rolls_every_file_back(sm120patch, serving_env, monkeypatch, failing_replace):
    """os.replace fails (EIO) at the N-th file: apply exits 4 and every file is pristine."""
    real_replace = os.replace
    calls = {"n": 0}

    def flaky_replace(src, dst):
        if any(str(dst).endswith(p) for p in (COMM, HEADER, LAMPORT, COMMUNICATOR)):
            calls["n"] += 1
            if calls["n"] == failing_replace:
                raise OSError(errno.EIO, "Input/output error", str(dst))
        return real_replace(src, dst)

    monkeypatch.setattr(transaction.os, "replace", flaky_replace)
    result = sm120patch("apply")
    assert result.exit_code == ExitCode.FAILED
    assert "Input/output error" in result.output and "rolled back" in result.output
    monkeypatch.setattr(transaction.os, "replace", real_replace)
    assert serving_env.record_mismatches() == []
    assert "Traceback" not in result.output
    assert sm120patch("status").exit_code == ExitCode.NOT_PATCHED  # no journal left behind


def test_an_interrupted_apply_is_rolled_back_by_the_next_run(sm120patch, serving_env, monkeypatch):
    """Leave exactly what a kill after the second file write leaves on disk (journal, stash,
    two patched files), then run again: the next command restores a consistent state."""
    real_write = transaction.atomic_write
    writes = {"n": 0}

    def dies_after_two_files(path, data, *, like=None):
        real_write(path, data, like=like)
        if like is not None:  # a package file, not state
            writes["n"] += 1
            if writes["n"] == 2:
                raise KeyboardInterrupt

    monkeypatch.setattr(transaction, "atomic_write", dies_after_two_files)
    monkeypatch.setattr(transaction, "rollback", lambda state: ())  # as if killed: no cleanup
    assert sm120patch("apply", "--flashinfer", "0.6.4").exit_code == 130  # Ctrl-C
    monkeypatch.undo()
    assert sorted(serving_env.record_mismatches()) == sorted([COMM, HEADER])  # half-applied

    status = sm120patch("status")
    assert status.exit_code == ExitCode.REFUSED
    assert "an interrupted apply was found" in status.output

    again = sm120patch("apply", "--flashinfer", "0.6.4")
    assert again.exit_code == 0, again.output
    assert "rolled back an interrupted apply (2 file(s) restored)" in again.output
    assert sorted(serving_env.record_mismatches()) == sorted([COMM, HEADER, LAMPORT])
    assert sm120patch("revert").exit_code == 0
    assert serving_env.record_mismatches() == []


def test_the_lock_refuses_a_second_writer_after_a_bounded_wait(tmp_path):
    import subprocess
    import sys
    import textwrap

    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from pathlib import Path
            from sm120patch.transaction import environment_lock
            with environment_lock(Path({str(tmp_path)!r})):
                print("locked", flush=True)
                time.sleep(30)
        """)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        messages = []
        with pytest.raises(TransactionError, match=f"pid {holder.pid}.*gave up after 1 s"):
            with environment_lock(tmp_path, timeout=1.0, on_wait=messages.append):
                pass
        assert messages == [f"waiting for another sm120patch (pid {holder.pid}) to finish ..."]
    finally:
        holder.kill()
        holder.wait()
    with environment_lock(tmp_path, timeout=1.0):  # released when the holder died
        pass


def test_state_directory_writable_by_others_is_refused(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o777)
    state.chmod(0o777)
    with pytest.raises(TransactionError, match="writable by other users"):
        with environment_lock(state):
            pass


def test_state_is_private_and_outside_the_package(sm120patch, serving_env):
    assert sm120patch("apply").exit_code == 0
    state = DistributionState(serving_env.root / "share" / "sm120patch" / "flashinfer-python")
    assert state.original(COMM).read_bytes() != serving_env.file(COMM).read_bytes()
    assert (state.root.stat().st_mode & 0o077) == 0
    assert not state.root.is_relative_to(serving_env.site_packages)
