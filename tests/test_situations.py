"""The situations production servers are in (issues 12 and 14): two runs at once, two
installs of one release, a root run on a service user's environment, uv's symlinked installs,
a read-only package directory, FlashInfer building its module at that moment, and the user
who fixed it by hand first. Each compares the whole environment (files, state, JIT cache,
owners, modes) before and after, and checks what the tool said against it."""

from __future__ import annotations

import re

import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import (
    FLASHINFER_FILES,
    COMM, COMMUNICATOR, HEADER, LAMPORT, ServingEnv, Session, changed, make_venv, one_clear_error,
    run_as_nobody, run_cli, sm120patch_argv, snapshot,
)
from sm120patch.errors import ExitCode
from sm120patch.manifests import load_manifest

FLASHINFER = FLASHINFER_FILES


def states(env: ServingEnv) -> dict[str, str]:
    """Each patched file: pristine / patched / other, by the vendor manifests."""
    found = {}
    for relpath, (name, version) in {**{f: ("flashinfer-python", "0.6.4") for f in FLASHINFER},
                                     COMMUNICATOR: ("sglang", "0.5.9")}.items():
        import hashlib

        digest = hashlib.sha256(env.file(relpath).read_bytes()).hexdigest()
        expected = load_manifest(name, version).files[relpath]
        found[relpath] = ("pristine" if digest == expected.pristine else
                          "patched" if digest in expected.patched.values() else "other")
    return found


def spawn(env: ServingEnv, *args: str, wait: float | None = None) -> subprocess.Popen:
    environ = dict(os.environ, **({"SM120PATCH_LOCK_WAIT": str(wait)} if wait is not None else {}))
    return subprocess.Popen(sm120patch_argv(env, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=environ)


def stderr_until(proc: subprocess.Popen, words: str) -> str:
    """What ``proc`` wrote to stderr up to and including the line that holds ``words``: the
    test moves on when the run has reached that point, never after a guessed sleep."""
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if words in line:
            return "".join(seen)
    pytest.fail(f"the run ended (exit {proc.wait()}) before it said {words!r}: {''.join(seen)}")


@pytest.fixture
def held_install_lock(serving_env):
    """Another sm120patch holding the install location's lock, released on request."""
    fd = os.open(serving_env.site_packages, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield lambda: fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def take_install_lock(env: ServingEnv):
    fd = os.open(env.site_packages, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return lambda: os.close(fd)


# -- 1. concurrent runs ------------------------------------------------------------------------

@pytest.mark.parametrize("first, second, final", [
    (("apply",), ("apply",), "patched"),
    (("apply",), ("apply", "--sglang", "0.5.9", "--with", "symm-mem"), "patched"),
    (("apply",), ("revert",), "pristine"),
    (("revert",), ("apply",), "patched"),
])
def test_two_runs_at_once_behave_as_one_after_the_other(sm120patch, serving_env, first, second, final):
    """Both runs start while a third holds the lock: each waits (and says so), then judges the
    state under the lock. Both exit 0, and the environment ends wholly in one state."""
    if first == ("revert",):
        assert sm120patch("apply").exit_code == 0
    held_install_lock = take_install_lock(serving_env)
    # Both wait on the lock before it is released; the wait is long enough that whichever takes
    # it second never gives up while the first runs, however busy the machine is.
    a = spawn(serving_env, *first, wait=600)
    waited_a = stderr_until(a, "waiting: another sm120patch is changing")
    b = spawn(serving_env, *second, wait=600)
    waited_b = stderr_until(b, "waiting: another sm120patch is changing")
    held_install_lock()
    out_a, err_a = a.communicate(timeout=600)
    out_b, err_b = b.communicate(timeout=600)
    err_a, err_b = waited_a + err_a, waited_b + err_b
    assert (a.returncode, b.returncode) == (0, 0), (err_a, err_b)
    assert err_a.count("waiting:") == 1 and err_b.count("waiting:") == 1, (err_a, err_b)
    found = states(serving_env)
    # flock grants no order between two waiters: either finished last, and its state stands.
    assert len(set(found.values())) == 1, found
    assert set(found.values()) <= {"patched", "pristine"}
    if final == "patched" and first == second:
        assert set(found.values()) == {"patched"}
        assert "nothing to change" in out_a + out_b
    assert not (serving_env.state_root / "journal.json").exists()
    assert sm120patch("status").exit_code in (0, 1)


def test_a_lock_held_past_the_wait_is_exit_4_and_changes_nothing(sm120patch, serving_env, held_install_lock):
    before = snapshot(serving_env)
    result = sm120patch("apply")
    assert result.exit_code == ExitCode.FAILED
    one_clear_error(result.output, f"another sm120patch is changing {serving_env.site_packages}; gave up after 10 s")
    assert "waiting:" in result.output and "hint: run again when it has finished" in result.output
    assert changed(before, snapshot(serving_env)) == []


@pytest.mark.parametrize("wait, said", [("1.5", "gave up after 1.5 s"), ("0", "gave up after 0 s")])
def test_sm120patch_lock_wait_sets_how_long_a_run_waits(sm120patch, serving_env, held_install_lock, monkeypatch,
                                                         wait, said):
    monkeypatch.setenv("SM120PATCH_LOCK_WAIT", wait)
    before = snapshot(serving_env)
    result = sm120patch("apply")
    assert result.exit_code == ExitCode.FAILED
    one_clear_error(result.output, f"another sm120patch is changing {serving_env.site_packages}; {said}")
    assert "SM120PATCH_LOCK_WAIT=SECONDS waits longer" in result.output
    assert changed(before, snapshot(serving_env)) == []


@pytest.mark.parametrize("wait", ["soon", "-1", "inf", "nan"])
def test_a_lock_wait_that_is_not_seconds_is_one_usage_line(sm120patch, serving_env, held_install_lock, monkeypatch,
                                                           wait):
    monkeypatch.setenv("SM120PATCH_LOCK_WAIT", wait)
    before = snapshot(serving_env)
    result = sm120patch("apply")
    assert result.exit_code == ExitCode.USAGE
    one_clear_error(result.output, f"SM120PATCH_LOCK_WAIT={wait!r} is not a number of seconds (0 or more)")
    assert changed(before, snapshot(serving_env)) == []


def test_status_during_a_run_says_a_run_is_in_progress_not_interrupted(sm120patch, serving_env, held_install_lock,
                                                                      monkeypatch):
    (serving_env.state_root).mkdir(mode=0o700)
    (serving_env.state_root / "journal.json").write_text(
        '{"format": 2, "operation": "apply", "run": "x", "pid": 1, "roots": [], "entries": []}')
    monkeypatch.setenv("SM120PATCH_LOCK_WAIT", "0.5")  # status waits for the run as long as this, then says so
    status = sm120patch("status")
    assert status.exit_code == ExitCode.FAILED
    one_clear_error(status.output, f"a run is in progress: another sm120patch is changing {serving_env.site_packages}: "
                                   "another sm120patch (pid 1) is running apply here right now")
    assert "interrupted" not in status.output


# -- 2. install identity -------------------------------------------------------------------------

def test_two_target_directories_of_one_release_never_share_a_record(tmp_path, flashinfer_wheel, monkeypatch):
    """Two `pip install --target` copies of flashinfer-python 0.6.4, one interpreter, PYTHONPATH
    picks which: each has its own state; revert of one never touches the other's."""
    python = tmp_path / "venv" / "bin" / "python"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(python.parent.parent)], check=True)
    targets = [tmp_path / "a", tmp_path / "b"]
    for target in targets:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
                        "--disable-pip-version-check", "--target", str(target), str(flashinfer_wheel)], check=True)
    home = tmp_path / "home"
    home.mkdir()
    env_a, env_b = ServingEnv(tmp_path / "venv", home), ServingEnv(tmp_path / "venv", home)

    def run(target: Path, *args: str):
        monkeypatch.setenv("PYTHONPATH", str(target))
        return run_cli(args[0], "--python", str(python), "--jit-cache-base", str(home), *args[1:])

    assert run(targets[0], "apply").exit_code == 0
    state_a = targets[0] / ".sm120patch"
    kept = {p: p.read_bytes() for p in state_a.rglob("*") if p.is_file()}
    assert any(p.name == "ledger.json" for p in kept)

    status_b = run(targets[1], "status")
    assert status_b.exit_code == ExitCode.NOT_OK
    assert "had been applied" not in status_b.output and str(targets[1]) in status_b.output
    revert_b = run(targets[1], "revert")
    assert revert_b.exit_code == 0 and "nothing to revert (not patched)" in revert_b.output
    assert {p: p.read_bytes() for p in state_a.rglob("*") if p.is_file()} == kept  # a's record untouched
    assert not (targets[1] / ".sm120patch").exists()

    # A hint for a --target install names the directory, so pip puts the bytes back there.
    (targets[1] / COMM).write_text("# hand edit\n")
    refused = run(targets[1], "apply")
    assert refused.exit_code == ExitCode.REFUSED
    assert f"--target {targets[1]}" in refused.output

    assert run(targets[0], "revert").exit_code == 0
    assert not state_a.exists()
    del env_a, env_b


# -- 3. sudo on a service user's environment -------------------------------------------------------

def test_root_on_a_service_users_environment(shared_dir, flashinfer_wheel, sglang_wheel):
    """Root patches an environment owned by another user: the state it writes belongs to that
    user (who can read it and go on), and the JIT cache base is that user's home."""
    root = shared_dir / "venv"
    # Files of its own (linked=False): chown would change the shared install's files through links.
    make_venv(root, [flashinfer_wheel, sglang_wheel], python=shutil.which("python3", path="/usr/bin"), linked=False)
    subprocess.run(["chown", "-R", "nobody:nogroup", str(root)], check=True)
    env = ServingEnv(root, shared_dir / "home")
    result = run_cli("apply", "--python", str(env.python))  # no --jit-cache-base: as a user runs it
    assert result.exit_code == 0, result.output
    assert "JIT cache base: /nonexistent (the home of nobody, who owns the environment" in result.output
    for path in [env.state_root, *env.state_root.rglob("*")]:
        assert (path.stat().st_uid, path.stat().st_gid) == (65534, 65534), path
    for relpath in (*FLASHINFER_FILES, COMMUNICATOR):
        assert env.file(relpath).stat().st_uid == 65534
    # The owner reads what root did, and can undo it.
    status = as_nobody(env, "status", shared_dir)
    assert status.returncode == 0, status.stderr
    reverted = as_nobody(env, "revert", shared_dir)
    assert reverted.returncode == 0, reverted.stderr
    assert env.record_mismatches() == [] and not env.state_root.exists()


def as_nobody(env: ServingEnv, command: str, shared: Path) -> subprocess.CompletedProcess:
    """sm120patch run by the service user."""
    argv = sm120patch_argv(ServingEnv(env.root, shared / "home"), command, python=shutil.which("python3", path="/usr/bin"))
    return run_as_nobody(argv, shared, HOME="/nonexistent")


# -- 4. uv's symlinked installs ---------------------------------------------------------------------

def symlink_like_uv(env: ServingEnv, cache: Path) -> None:
    """What `uv pip install --link-mode=symlink` leaves: every file a link into uv's cache."""
    for relpath in (*FLASHINFER, ):
        path = env.file(relpath)
        target = cache / relpath
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
        path.unlink()
        path.symlink_to(target)
    (env.dist_info("flashinfer_python") / "INSTALLER").write_text("uv\n")


def test_a_symlinked_install_is_told_as_it_is_and_force_then_revert_restores_the_links(sm120patch, serving_env, tmp_path):
    cache = tmp_path / "uv-cache"
    symlink_like_uv(serving_env, cache)
    serving_env.seed_jit()
    cache_before = snapshot(serving_env, cache)  # the shared cache is never written, first to last

    status = sm120patch("status")
    assert status.exit_code == ExitCode.NOT_OK  # not patched; not "drifted": the bytes are the release's
    assert "not the release's bytes" not in status.output
    assert "symbolic link" in status.output

    refused = sm120patch("apply", "--flashinfer")
    assert refused.exit_code == ExitCode.REFUSED
    one_clear_error(refused.output, "is a symbolic link")
    assert f"uv pip install --python {serving_env.python} --reinstall --link-mode=copy" in refused.output
    assert "pip install --force-reinstall" not in refused.output  # a uv environment has no pip
    assert changed(cache_before, snapshot(serving_env, cache)) == []

    forced = sm120patch("apply", "--flashinfer", "--force")
    assert forced.exit_code == 0, forced.output
    for relpath in FLASHINFER:
        assert not serving_env.file(relpath).is_symlink()
    assert states(serving_env)[COMM] == "patched"
    assert [p for p in changed(cache_before, snapshot(serving_env, cache)) if str(cache) in p] == []
    assert not (serving_env.state_root / "journal.json").exists()

    reverted = sm120patch("revert", "--flashinfer")
    assert reverted.exit_code == 0, reverted.output
    for relpath in FLASHINFER:
        assert serving_env.file(relpath).is_symlink()
    after = snapshot(serving_env, cache)
    assert [p for p in changed(cache_before, after) if "trtllm_comm" not in p] == []


# -- 5. all or nothing: tests/test_hostile_inputs.py mounts sglang's directory read-only ------------

# -- 6. FlashInfer building trtllm_comm at that moment ---------------------------------------------

def test_flashinfers_build_lock_is_waited_for_then_named(sm120patch, serving_env):
    serving_env.seed_jit()
    lock = serving_env.jit_entry("90a", "trtllm_comm").parent / "tmp" / "trtllm_comm.lock"
    before = snapshot(serving_env)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time\n"
        f"f = open({str(lock)!r}, 'a'); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        result = sm120patch("apply")
    finally:
        holder.kill()
        holder.wait()
    assert result.exit_code == ExitCode.FAILED
    one_clear_error(result.output, "a FlashInfer process is building or loading trtllm_comm")
    assert str(lock) in result.output and "hint: run again once the server has started" in result.output
    assert changed(before, snapshot(serving_env)) == []
    assert sm120patch("apply").exit_code == 0  # once the build is over


def test_an_entry_built_from_another_environments_sources_is_reported(sm120patch, serving_env, tmp_path):
    entry = serving_env.jit_entry("120a", "trtllm_comm")
    entry.mkdir(parents=True)
    other = tmp_path / "other-env/lib/python3.11/site-packages/flashinfer/data/csrc/trtllm_allreduce.cu"
    (entry / "build.ninja").write_text(f"build trtllm_allreduce.cuda.o: cuda_compile {other}\n")
    status = sm120patch("status")
    assert f"built from another environment's sources ({other})" in status.output



def test_an_entry_a_build_did_not_finish_is_incomplete_never_current(sm120patch, serving_env):
    """What an interrupted build used to leave (issue 38): build.ninja and .d files, no
    trtllm_comm.so. status calls it incomplete, never "current", and the fusion chain's jit step
    does not count it as built."""
    import json

    assert sm120patch("apply").exit_code == 0
    entry = serving_env.jit_entry("120a", "trtllm_comm")
    entry.mkdir(parents=True)
    source = serving_env.file("flashinfer/data/csrc/trtllm_allreduce.cu")
    (entry / "build.ninja").write_text(f"build trtllm_allreduce.cuda.o: cuda_compile {source}\n")
    (entry / "trtllm_allreduce.cuda.o.d").write_text("trtllm_allreduce.cuda.o: x\n")
    status = sm120patch("status")
    assert f"{entry}: incomplete (no trtllm_comm.so: a build that did not finish); the next start rebuilds it" \
        in status.output, status.output
    assert f"{entry}: current" not in status.output
    assert f"trtllm_comm in {entry} is incomplete" in status.output and "trtllm_comm built in" not in status.output
    jit = next(d for d in json.loads(sm120patch("status", "--json").output)["distributions"]
               if d["name"] == "flashinfer-python")["jit_cache"]
    assert jit["incomplete"] == [str(entry)] and jit["stale"] == []


def test_an_entry_being_built_now_is_told_from_an_abandoned_one(sm120patch, serving_env):
    """The same half-built entry while FlashInfer's lock on it is held (a server's first start,
    a build running): status says it is being built now, never "incomplete ... the next start
    rebuilds it" (before: it said so of a build in progress); the lock let go, incomplete."""
    import fcntl
    import json

    assert sm120patch("apply").exit_code == 0
    entry = serving_env.jit_entry("120a", "trtllm_comm")
    entry.mkdir(parents=True)
    source = serving_env.file("flashinfer/data/csrc/trtllm_allreduce.cu")
    (entry / "build.ninja").write_text(f"build trtllm_allreduce.cuda.o: cuda_compile {source}\n")
    (entry.parent / "tmp").mkdir()
    lock = entry.parent / "tmp" / "trtllm_comm.lock"
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as FlashInfer's filelock holds it while it builds
        status = sm120patch("status")
        assert f"{entry}: being built now (FlashInfer's lock cached_ops/tmp/trtllm_comm.lock is held" in status.output, \
            status.output
        assert "the next start rebuilds it" not in status.output
        assert f"trtllm_comm in {entry} is being built now" in status.output, status.output
        jit = next(d for d in json.loads(sm120patch("status", "--json").output)["distributions"]
                   if d["name"] == "flashinfer-python")["jit_cache"]
        assert jit["building"] == [str(entry)] and jit["incomplete"] == [str(entry)]
    after = sm120patch("status")
    assert f"{entry}: incomplete (no trtllm_comm.so" in after.output and "being built" not in after.output, after.output


def test_another_environments_entry_is_foreign_not_stale_however_old(sm120patch, serving_env, tmp_path):
    """Two environments sharing one cache base: an entry the other one's build left (here without
    its library, as an interrupted build leaves it), older than this environment's sources (this
    one was installed or patched later). It was built from the other's files, and status says so,
    as the README promises, not STALE."""
    entry = serving_env.jit_entry("120a", "trtllm_comm")
    entry.mkdir(parents=True)
    other = tmp_path / "other-env/lib/python3.11/site-packages/flashinfer/data/csrc/trtllm_allreduce.cu"
    (entry / "build.ninja").write_text(f"build trtllm_allreduce.cuda.o: cuda_compile {other}\n")
    os.utime(entry / "build.ninja", (1_000_000, 1_000_000))
    status = sm120patch("status")
    line = next(line for line in status.output.splitlines() if line.strip().startswith(str(entry)))
    assert f"built from another environment's sources ({other})" in line and "STALE" not in line, line
    assert "incomplete (no trtllm_comm.so" in line, line


# -- the user who fixed it by hand first ------------------------------------------------------------

def test_a_hand_edit_equal_to_the_patch_is_told_apart_adopted_and_reverted(sm120patch, serving_env, tmp_path):
    reference = tmp_path / "reference"
    shutil.copytree(serving_env.root, reference / "venv", symlinks=True)
    Session(ServingEnv(reference / "venv", serving_env.home))("apply", "--flashinfer")
    patched_comm = (next((reference / "venv" / "lib").glob("python3*/site-packages")) / COMM).read_bytes()
    serving_env.file(COMM).write_bytes(patched_comm)  # what a careful `sed` leaves

    status = sm120patch("status")
    assert re.search(r"jit-gate +applied \(by hand\)", status.output)
    assert f"{COMM}: patched by hand, identical to jit-gate; sm120patch has no record of it" in status.output
    applied = sm120patch("apply")
    assert applied.exit_code == 0, applied.output
    assert f"{COMM} was patched by hand, identical to the patch: recorded as applied" in applied.output
    assert "patched by hand" not in sm120patch("status").output  # recorded now
    reverted = sm120patch("revert")
    assert reverted.exit_code == 0, reverted.output
    assert serving_env.record_mismatches() == []
    assert not serving_env.state_root.exists()


def test_a_partial_sed_is_changed_by_hand_refused_with_a_diff_and_revert_force_restores(sm120patch, serving_env):
    """The field reports' common case: some of the 13 gates edited by hand."""
    header = serving_env.file(HEADER)
    header.write_text(header.read_text().replace(" && (__CUDA_ARCH__ < 1200)", "", 3))
    status = sm120patch("status")
    assert status.exit_code == ExitCode.REFUSED
    assert "changed by hand, not the release's bytes" in status.output
    refused = sm120patch("apply")
    assert refused.exit_code == ExitCode.REFUSED
    assert f"--- release/{HEADER}" in refused.output and f"+++ installed/{HEADER}" in refused.output
    assert f"{serving_env.python} -m pip install --force-reinstall --no-deps flashinfer-python==0.6.4" in refused.output
    restored = sm120patch("revert", "--force")
    assert restored.exit_code == 0, restored.output
    assert serving_env.record_mismatches() == []


def test_a_revert_that_cannot_do_one_distribution_does_the_others(sm120patch, serving_env):
    assert sm120patch("apply").exit_code == 0
    communicator = serving_env.file(COMMUNICATOR)
    communicator.write_text(communicator.read_text() + "# tuned by hand after patching\n")
    result = sm120patch("revert")
    assert result.exit_code == ExitCode.REFUSED
    assert "sglang 0.5.9 was not reverted" in result.output
    assert [m for m in serving_env.record_mismatches() if m.startswith("flashinfer")] == []
    assert states(serving_env)[COMMUNICATOR] == "other"
