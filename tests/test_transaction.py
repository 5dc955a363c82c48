"""The transaction: atomic writes, rollback on failure (the real one, on I/O errors and on
Ctrl-C), recovery of an interrupted run, the lock, the state directory."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from helpers import FLASHINFER_FILES, COMM, COMMUNICATOR, HEADER, LAMPORT, changed, snapshot
from sm120patch import fileops, signals, transaction
from sm120patch.errors import ExitCode, TransactionError
from sm120patch.state import TEMPORARY, TEMPORARY_SUFFIXES, Owner, ensure_dir, temporary
from sm120patch.fileops import atomic_write
from sm120patch.locks import install_locks


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

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(OSError):
        atomic_write(target, b"new")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.py"]


@pytest.mark.parametrize("failing_replace", [1, 2, 3, 4])
def test_a_failed_replace_rolls_everything_back(sm120patch, serving_env, monkeypatch, failing_replace):
    """The rename over the N-th package file fails (EIO): apply exits 4, and every file, the
    state directory and the JIT cache are exactly as before (entries were only moved aside).
    (Renames go through directory descriptors: the name renamed over is the file's own name.)"""
    serving_env.seed_jit()
    before = snapshot(serving_env)
    real_rename = os.rename
    calls = {"n": 0}
    names = {os.path.basename(p) for p in (*FLASHINFER_FILES, COMMUNICATOR)}

    def flaky_rename(src, dst, **fds):
        if os.path.basename(str(dst)) in names and ".sm120patch-" in os.path.basename(str(src)):
            calls["n"] += 1
            if calls["n"] == failing_replace:
                raise OSError(errno.EIO, "Input/output error", str(dst))
        return real_rename(src, dst, **fds)

    monkeypatch.setattr(os, "rename", flaky_rename)
    result = sm120patch("apply")
    monkeypatch.setattr(os, "rename", real_rename)
    assert result.exit_code == ExitCode.FAILED
    assert "Input/output error" in result.output and "the environment is as it was" in result.output
    assert "Traceback" not in result.output
    assert changed(before, snapshot(serving_env)) == []


def raise_after_two_files(monkeypatch, exc: type[BaseException] | BaseException) -> dict:
    """Make the transaction raise ``exc`` right after it has written the second package file."""
    real_write = fileops.atomic_write
    writes = {"n": 0}

    def write_then_raise(path, data, **kwargs):
        real_write(path, data, **kwargs)
        if any(str(path).endswith(p) for p in FLASHINFER_FILES):
            writes["n"] += 1
            if writes["n"] == 2:
                raise exc

    # The transaction writes through fileops.atomic_write, looked up when it writes.
    monkeypatch.setattr(fileops, "atomic_write", write_then_raise)
    return writes


@pytest.mark.parametrize("interrupt", [signals.Interrupted(signal.SIGINT), KeyboardInterrupt()],
                         ids=["ctrl-c-as-the-cli-raises-it", "keyboard-interrupt"])
def test_ctrl_c_in_the_middle_runs_the_real_rollback(sm120patch, serving_env, monkeypatch, interrupt):
    """Ctrl-C after the second package file (as the CLI's handler raises it, and as a plain
    KeyboardInterrupt): exit 130, and the rollback that really runs on Ctrl-C leaves nothing
    changed anywhere (files, state, JIT entries)."""
    serving_env.seed_jit()
    before = snapshot(serving_env)
    writes = raise_after_two_files(monkeypatch, interrupt)
    result = sm120patch("apply", "--flashinfer", "0.6.4")
    monkeypatch.undo()
    assert writes["n"] == 2
    assert result.exit_code == ExitCode.INTERRUPTED
    assert "sm120patch: interrupted (SIGINT); any change in progress was rolled back\n" in result.output
    assert changed(before, snapshot(serving_env)) == []
    assert sm120patch("status").exit_code == ExitCode.NOT_OK  # no journal left: an ordinary pristine env


def test_a_journal_left_by_a_kill_is_rolled_back_by_the_next_run(sm120patch, serving_env, monkeypatch):
    """What a SIGKILL after the second file leaves (journal, stash, two patched files, entries
    aside) is made by stopping the run there without its rollback; then status says so (exit 3)
    and the next apply rolls it back first, then applies."""
    serving_env.seed_jit()
    before = snapshot(serving_env)
    class Killed(BaseException):
        pass

    raise_after_two_files(monkeypatch, Killed)
    monkeypatch.setattr(transaction, "rollback", lambda *a, **k: (_ for _ in ()).throw(Killed()))
    with pytest.raises(Killed):
        sm120patch("apply", "--flashinfer", "0.6.4")
    monkeypatch.undo()
    assert sorted(serving_env.record_mismatches()) == sorted([COMM, HEADER])  # half-applied
    assert not serving_env.jit_entry("90a", "trtllm_comm").exists()  # moved aside, not deleted

    status = sm120patch("status")
    assert status.exit_code == ExitCode.REFUSED
    assert "an interrupted apply" in status.output

    again = sm120patch("apply", "--flashinfer", "0.6.4")
    assert again.exit_code == 0, again.output
    assert "rolled back an interrupted apply" in again.output
    assert sorted(serving_env.record_mismatches()) == sorted([*FLASHINFER_FILES])
    assert sm120patch("revert").exit_code == 0
    after = snapshot(serving_env)
    # Everything is as before but the stale trtllm_comm entries (the apply removed them) and
    # FlashInfer's lock files (created, as FlashInfer itself does, to hold its lock).
    assert all("trtllm_comm" in p or p.endswith(".lock") or p.endswith("/tmp") for p in changed(before, after)), \
        changed(before, after)


def test_the_lock_refuses_a_second_writer_after_a_bounded_wait(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import time
            from pathlib import Path
            from sm120patch.locks import install_locks
            with install_locks([Path({str(tmp_path)!r})]):
                print("locked", flush=True)
                time.sleep(30)
        """)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        messages = []
        with pytest.raises(TransactionError, match=f"another sm120patch is changing {tmp_path}; gave up after 1 s"):
            with install_locks([tmp_path], timeout=1.0, on_wait=messages.append):
                pass
        assert messages == [f"waiting: another sm120patch is changing {tmp_path} ..."]
    finally:
        holder.kill()
        holder.wait()
    with install_locks([tmp_path], timeout=1.0):  # released when the holder died
        pass


def test_state_directory_writable_by_others_is_refused(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(0o777)
    with pytest.raises(TransactionError, match="writable by other users"):
        ensure_dir(state, Owner.of(tmp_path))


def test_state_sits_beside_the_install_private_and_outside_every_package(sm120patch, serving_env):
    assert sm120patch("apply").exit_code == 0
    state = serving_env.state()
    assert state.root == serving_env.site_packages / ".sm120patch" / serving_env.dist_info("flashinfer_python").name
    assert state.original(COMM).read_bytes() != serving_env.file(COMM).read_bytes()
    assert (serving_env.state_root.stat().st_mode & 0o077) == 0
    assert (state.root.stat().st_mode & 0o077) == 0
    assert sm120patch("revert").exit_code == 0
    assert not serving_env.state_root.exists()  # a full revert leaves no trace, no lock file


def test_the_state_directory_override(sm120patch, serving_env, tmp_path, monkeypatch):
    monkeypatch.setenv("SM120PATCH_STATE_DIR", str(tmp_path / "state"))
    assert sm120patch("apply").exit_code == 0
    assert not serving_env.state_root.exists()
    (root,) = (tmp_path / "state").iterdir()
    assert (root / serving_env.dist_info("flashinfer_python").name / "ledger.json").is_file()
    assert sm120patch("status").exit_code == 0
    assert sm120patch("revert").exit_code == 0
    assert serving_env.record_mismatches() == []


def test_every_temporary_name_is_one_the_cleanup_finds(tmp_path):
    """The names a run gives its temporary files and the pattern status and the next run find
    them by come from one place (state.py): each kind matches, nothing else does."""
    for suffix in TEMPORARY_SUFFIXES:
        assert TEMPORARY.match(temporary(tmp_path / "ledger.json", suffix, pid=4242).name), suffix
    assert not TEMPORARY.match("ledger.json")
    assert not TEMPORARY.match(".ledger.json.sm120patch-4242.bak")
    with pytest.raises(ValueError):
        temporary(tmp_path / "ledger.json", "bak")
