"""Root on a service user's environment (issue 61): the user gets nothing outside its own
environment, none of its code runs as root, and the tuned-limits profile root writes is
root's.

The race tests run a swapper process of another uid (tests/race.py) against `apply`, `revert`
and the profile write, a few tries each (benchmarks/root_race.py runs hundreds; docs/root.md
has the figures). They need root: skipped without it, failed under CI=true."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

import race
from helpers import need
from sm120patch import _tuned_runtime as runtime
from sm120patch import dirfd, signals
from sm120patch.bench import profile
from sm120patch.environment import start_probe
from sm120patch.errors import RefusedError
from test_synthetic import data_dir, toy  # noqa: F401 - the synthetic distribution's fixtures
from test_tuning import pcie_entry

TRIES = int(os.environ.get("SM120PATCH_RACE_TRIES", "3"))


@pytest.fixture(scope="module")
def arena():
    race.need_root(pytest)
    made = race.make_arena()
    yield made
    race.cleanup(made)


# -- 1. a racing service user gets nothing ------------------------------------------------------

@pytest.mark.parametrize("command", ["apply", "revert", "profile"])
def test_a_service_user_racing_root_changes_no_file_outside_its_environment(arena, command):
    """Root runs `apply`, `revert` (of an apply) or writes a tuned-limits profile in the user's
    environment while the user swaps temporary files and whole directories for links to root's
    files: root's files keep their owner, mode, bytes and listing, and the user's .pth files
    (run by every start of its interpreter) never run as root. Whatever the run's outcome
    (it may well be refused or rolled back), it is never a traceback."""
    outcomes = race.race(arena, command, TRIES)
    assert sum(outcomes.values()) == TRIES, outcomes


def test_without_a_swapper_root_patches_the_users_environment_as_that_user(arena):
    """The same environment, no race: apply and revert succeed as root, what they write is the
    user's, and the user's interpreter ran only as the user."""
    arena.reset()
    env = arena.environ()
    for command in ("apply", "status", "revert"):
        proc = subprocess.run(arena.argv(command), capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        if command == "status":
            assert "can change them" in proc.stdout, proc.stdout  # the exposed directories are named
        if command == "apply":
            comm = arena.site / "toyfuse" / "comm.py"
            assert comm.stat().st_uid == arena.user.pw_uid
            owners = {p.stat().st_uid for p in (arena.site / ".sm120patch").rglob("*")}
            assert owners == {arena.user.pw_uid}, owners
    assert arena.pth_ran_as() == {arena.user.pw_uid}


# -- 2. the target's interpreter: as its owner, a framed answer ------------------------------------

def test_the_probe_reads_its_answer_past_a_banner_and_a_wrapper_that_leaves_children(tmp_path):
    """A wrapper interpreter that prints a banner, leaves a background job holding stdout and a
    `setsid` child: the probe still answers at once (no 60 s wait for stdout to close), and
    neither child outlives it."""
    wrapper = tmp_path / "python"
    marker = tmp_path / "children"
    wrapper.write_text(f"#!/bin/sh\necho 'welcome to the cluster'\nsleep 300 &\necho $! >> {marker}\n"
                       f"setsid sh -c 'echo $$ >> {marker}; exec sleep 301' &\nsleep 0.2\n"
                       f"exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    start = time.monotonic()
    env = start_probe(str(wrapper), ["toyfuse"]).result()
    assert time.monotonic() - start < 20
    assert env.python_version.count(".") == 2
    pids = [int(line) for line in marker.read_text().split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() and _state(pid) != "Z" for pid in pids):
        time.sleep(0.05)
    assert [pid for pid in pids if Path(f"/proc/{pid}").exists() and _state(pid) != "Z"] == []


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return "Z"


def test_a_pth_that_prints_does_not_make_the_interpreter_unusable(toy):
    (toy.site / "banner.pth").write_text("import sys; print('hello from a .pth'); sys.stdout.flush()\n")
    env = start_probe(str(toy.venv / "bin" / "python"), ["toyfuse"]).result()
    assert env.get("toyfuse") is not None and env.get("toyfuse").raw_version == "1.0"


def test_an_owner_without_a_passwd_entry_gets_no_home_of_roots_silently(tmp_path):
    """As root on an environment of a uid with no passwd entry, the JIT cache base is root's
    $HOME for want of another, and the reason says so."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    import pwd

    from sm120patch.jitcache import cache_base
    from sm120patch.state import Owner

    uid = next(u for u in range(47000, 48000) if not _has_passwd(u, pwd))
    base = cache_base(None, owner=Owner(uid, uid))
    assert f"uid {uid}" in base.reason and "no home" in base.reason and "--jit-cache-base" in base.reason


def _has_passwd(uid, pwd) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


# -- descriptors from the top down ----------------------------------------------------------------

def test_a_link_in_a_directory_another_user_owns_is_not_followed(tmp_path):
    """open_dir follows a link only where no other user can have planted it."""
    if os.geteuid() != 0:
        pytest.skip("needs root (a directory of another uid)")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (tmp_path / "root-only").mkdir()
    (theirs / "link").symlink_to(tmp_path / "root-only")
    (tmp_path / "mine").symlink_to(tmp_path / "root-only")
    os.chown(theirs, 4242, 4242)
    os.close(dirfd.open_dir(tmp_path / "mine"))  # root's directory: followed
    with pytest.raises(dirfd.UnsafePathError, match="uid 4242"):
        dirfd.open_dir(theirs / "link")
    with pytest.raises(dirfd.UnsafePathError):
        dirfd.write_file(theirs / "link" / "f", b"x", mode=0o644)
    assert list((tmp_path / "root-only").iterdir()) == []


# -- the tuned-limits profile's write --------------------------------------------------------------

def write(path: Path, tp: int = 4) -> profile.Written:
    return profile.write(path, box=runtime._sm120patch_box(), tp=tp, new_entry=pcie_entry(tp))


def test_a_symlinked_profile_path_is_refused_not_replaced(tmp_path):
    real = tmp_path / "real.json"
    write(real)
    before = real.read_bytes()
    link = tmp_path / "tuned.json"
    link.symlink_to(real)
    with pytest.raises(RefusedError, match="symbolic link"):
        write(link, tp=2)
    assert link.is_symlink() and real.read_bytes() == before


def test_the_profile_is_0644_in_a_0755_directory_whatever_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        path = tmp_path / "etc" / "sm120patch" / "tuned.json"
        write(path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o755
    assert path.stat().st_uid == os.geteuid()


def test_a_planted_profile_of_another_user_gives_neither_owner_mode_nor_entries(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root (a file of another uid)")
    path = tmp_path / "tuned.json"
    write(path, tp=2)
    os.chown(path, 4242, 4242)
    path.chmod(0o666)
    written = write(path, tp=4)
    document = json.loads(path.read_text())
    assert list(document["entries"]) == ["4"] and written.foreign_owner is not None and written.kept == ()
    info = path.stat()
    assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (0, 0o644)


def test_two_tuners_on_one_profile_take_turns_and_every_entry_survives(tmp_path):
    """Two tuners writing into one profile at once, 20 TP sizes each (even and odd): every one
    of the 40 entries is there at the end (unserialized, a third of them were lost), and no
    temporary file is left."""
    path = tmp_path / "tuned.json"
    script = ("import sys; sys.path.insert(0, sys.argv[2]); from test_root import write; from pathlib import Path\n"
              "for tp in range(int(sys.argv[3]), int(sys.argv[3]) + 40, 2): write(Path(sys.argv[1]), tp)\n")
    here = str(Path(__file__).parent)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(path), here, str(first)]) for first in (2, 3)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    assert sorted(map(int, json.loads(path.read_text())["entries"])) == list(range(2, 42))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tuned.json"]


def test_a_killed_tuners_temporary_file_is_removed_by_the_next(tmp_path):
    path = tmp_path / "tuned.json"
    left = tmp_path / f".tuned.json{dirfd.TEMPORARY_MARK}99999-0123abcd.tmp"
    left.write_text("half")
    write(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tuned.json"]


def test_a_signal_after_the_profiles_rename_is_reported_as_a_profile_written(tmp_path, monkeypatch):
    """SIGINT just after the rename: the write finishes, and the run knows the profile was
    replaced (signals.STATE.committed: the CLI then says the change stands, never "this command
    changes nothing"). Before it (at the new file's fsync): nothing is written and no temporary
    file is left."""
    path = tmp_path / "tuned.json"
    real_rename = os.rename

    def rename_then_signal(*args, **kwargs):
        real_rename(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)

    with signals.handled():
        monkeypatch.setattr(os, "rename", rename_then_signal)
        written = write(path)
        monkeypatch.setattr(os, "rename", real_rename)
        assert signals.STATE.committed == "tuned-limits profile write" and signals.late() == signal.SIGINT
    assert written.path == path and json.loads(path.read_text())["entries"]

    other = tmp_path / "other.json"

    real_fsync = os.fsync

    def fsync_then_signal(fd):  # the new file's fsync, before the rename
        real_fsync(fd)
        os.kill(os.getpid(), signal.SIGTERM)

    with signals.handled():
        monkeypatch.setattr(os, "fsync", fsync_then_signal)
        with pytest.raises(signals.Interrupted):
            write(other)
        monkeypatch.setattr(os, "fsync", real_fsync)
        assert signals.STATE.committed is None
    assert not other.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["tuned.json"]


def test_the_race_needs_root_and_says_so_under_ci(monkeypatch):
    """Without root the race tests skip with their reason; under CI=true they fail instead."""
    need(True, "")
    if os.geteuid() == 0:
        pytest.skip("runs as root: the race itself ran")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(AssertionError, match="needs root"):
        race.need_root(pytest)


def test_a_stray_file_in_an_installs_state_is_removed_with_it_not_a_traceback(toy):
    """The environment's owner can put anything in the state sm120patch keeps beside the install
    (the race swapped the install's state directory for another holding `comm.py`): after a
    reinstall, the revert that drops the ledger and its originals drops that file too, in one
    line, never a traceback."""
    from toy import SOURCE
    from test_reliability_four import toy_argv

    assert subprocess.run(toy_argv(toy, "apply"), capture_output=True).returncode == 0
    (toy.site / "toyfuse" / "comm.py").write_text(SOURCE)  # a reinstall put the release's bytes back
    state = toy.site / ".sm120patch" / "toyfuse-1.0.dist-info"
    (state / "comm.py").write_text("not sm120patch's\n")
    proc = subprocess.run(toy_argv(toy, "revert"), capture_output=True, text=True)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert not (toy.site / ".sm120patch").exists()
