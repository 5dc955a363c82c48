"""Reliability, round four (issue 38): a signal while apply prints its report (after its commit
point), a refused apply that must change nothing in the JIT cache either, `manifest add` given a
bad wheel, and the state of installs that are all gone. Each test runs sm120patch as a user does
(a process of its own, or the CLI) and checks the files and the exit code, not only the words."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import FLASHINFER_FILES, make_venv, need, sm120patch_argv
from sm120patch.errors import ExitCode
from test_synthetic import data_dir, toy  # noqa: F401 - the synthetic distribution's fixtures

STRACE = shutil.which("strace")
SIGNALS = (("INT", 130), ("TERM", 143), ("HUP", 129))
STD_WRITE = re.compile(r"^write\((?P<fd>[12])<")  # a write to stdout or stderr (strace -y names the fd)


def digest(paths) -> str:
    """One hash of the bytes of ``paths`` (what "patched" means here: the files, not a message)."""
    h = hashlib.sha256()
    for path in paths:
        h.update(Path(path).read_bytes())
    return h.hexdigest()


def traced(argv: list[str], trace: Path, syscall: str, *inject: str) -> subprocess.CompletedProcess:
    """``argv`` under strace (this process only, not the target's probe), tracing ``syscall``;
    ``inject``: strace's -e inject=... expression."""
    extra = [arg for expression in inject for arg in ("-e", f"inject={expression}")]
    return subprocess.run([STRACE, "-y", "-o", str(trace), "-e", f"trace={syscall}", *extra, *argv],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))


def calls(trace: Path, syscall: str) -> list[str]:
    return [line for line in trace.read_text().splitlines() if line.startswith(f"{syscall}(")]


# -- 1. a signal while apply prints its report -------------------------------------------------

def toy_argv(toy, command: str) -> list[str]:
    return [sys.executable, "-m", "sm120patch", command, "--python", str(toy.venv / "bin" / "python"),
            "--jit-cache-base", str(toy.home)]


def test_a_signal_while_apply_prints_its_report_does_not_say_rolled_back(toy, tmp_path):
    """SIGINT, SIGTERM and SIGHUP in turn at every write of apply's report to stdout or stderr:
    the patch was committed before the report, so the run exits 0, the files are patched and
    the report is whole; the signal is said to have come after the commit."""
    need(STRACE is not None, "strace is not installed (.ci/run installs it)")
    comm = toy.site / "toyfuse" / "comm.py"
    pristine = digest([comm])
    clean = traced(toy_argv(toy, "apply"), tmp_path / "clean.txt", "write")
    assert clean.returncode == 0, clean.stderr
    patched, report = digest([comm]), clean.stdout
    assert patched != pristine and "patched 1 file" in report
    writes = [n for n, line in enumerate(calls(tmp_path / "clean.txt", "write"), 1) if STD_WRITE.match(line)]
    assert writes, "the report was not written"
    for index, n in enumerate(writes):
        assert subprocess.run(toy_argv(toy, "revert"), capture_output=True).returncode == 0
        assert digest([comm]) == pristine
        name, _ = SIGNALS[index % len(SIGNALS)]
        trace = tmp_path / f"signal-{n}.txt"
        proc = traced(toy_argv(toy, "apply"), trace, "write", f"write:signal={name}:when={n}")
        assert STD_WRITE.match(calls(trace, "write")[n - 1]), f"write #{n} is not the report's"
        where = f"SIG{name} at write #{n}"
        assert digest([comm]) == patched, f"{where}: not patched"
        assert proc.returncode == 0, f"{where}: exit {proc.returncode}: {proc.stderr}"
        assert proc.stdout == report, f"{where}: the report was cut: {proc.stdout!r}"
        assert "rolled back" not in proc.stderr and "Traceback" not in proc.stderr, f"{where}: {proc.stderr}"
        assert f"SIG{name} arrived after the apply was committed" in proc.stderr, f"{where}: {proc.stderr}"


def test_a_signal_while_apply_build_reports_or_builds_keeps_the_patch_and_says_so(serving_env, tmp_path):
    """apply --build on an environment whose build fails (its torch does not import): a signal at the
    report's writes, or at the wait for the build's process, never exits 128 + the signal
    ("rolled back"): the files are patched, the report is printed, and the exit code is the
    failed build's (1)."""
    need(STRACE is not None, "strace is not installed (.ci/run installs it)")
    # A torch that is there (apply --build checks for it before it writes) and does not import:
    # the build starts after the commit point and fails.
    (serving_env.site_packages / "torch").mkdir()
    (serving_env.site_packages / "torch" / "__init__.py").write_text('raise ImportError("a stand-in torch")\n')
    files = [serving_env.file(relpath) for relpath in FLASHINFER_FILES]
    pristine = digest(files)
    argv = sm120patch_argv(serving_env, "apply", "--flashinfer", "--build", "--arch", "12.0a")
    revert = sm120patch_argv(serving_env, "revert", "--flashinfer")
    clean = traced(argv, tmp_path / "clean.txt", "write,wait4")
    assert clean.returncode == ExitCode.NOT_OK, clean.stderr
    patched = digest(files)
    assert patched != pristine and "flashinfer-python 0.6.4: patched 6 files" in clean.stdout
    lines = calls(tmp_path / "clean.txt", "write")
    # The report is on stdout (stderr also carries the build's own progress lines, written during it).
    report = [n for n, line in enumerate(lines, 1) if (m := STD_WRITE.match(line)) and m["fd"] == "1"]
    # Inside the build: its announcement, the first thing the build writes (a count of wait4
    # calls is not the same from run to run: the probe's waits vary).
    build = next(n for n, line in enumerate(lines, 1) if "building trtllm_comm" in line)
    points = [("write", report[0]), ("write", report[-1]), ("build", build)]
    for (syscall, n), (name, _) in zip(points, SIGNALS):
        assert subprocess.run(revert, capture_output=True).returncode == 0 and digest(files) == pristine
        proc = traced(argv, tmp_path / f"{syscall}-{n}.txt", "write,wait4", f"write:signal={name}:when={n}")
        where = f"SIG{name} at {syscall} #{n}"
        assert digest(files) == patched, f"{where}: not patched"
        assert proc.returncode == ExitCode.NOT_OK, f"{where}: exit {proc.returncode}: {proc.stderr}"
        assert "flashinfer-python 0.6.4: patched 6 files" in proc.stdout, f"{where}: {proc.stdout}"
        assert "rolled back" not in proc.stderr and "Traceback" not in proc.stderr, f"{where}: {proc.stderr}"
        if syscall == "build":
            assert f"the build was interrupted (SIG{name}); the patch stands" in proc.stderr, f"{where}: {proc.stderr}"
        else:
            assert f"SIG{name} arrived after the apply was committed" in proc.stderr, f"{where}: {proc.stderr}"


# -- 4. a refused apply changes nothing, in the JIT cache either ---------------------------------

def copied_in_entry(env) -> Path:
    """A trtllm_comm entry without FlashInfer's lock beside it (copied in, restored from a
    backup): the only case where taking FlashInfer's lock has to create it."""
    entry = env.jit_entry("120a", "trtllm_comm")
    entry.mkdir(parents=True)
    (entry / "trtllm_comm.so").write_bytes(b"\x7fELF")
    return entry


@pytest.mark.parametrize("inject", ["error=EIO", "signal=INT"])
def test_a_rolled_back_apply_leaves_no_lock_file_it_created(toy, tmp_path, inject):
    """A JIT entry copied in without FlashInfer's lock: apply creates cached_ops/tmp/<module>.lock
    to take it. When the run is rolled back (a hard link that fails, or Ctrl-C at it), the lock
    file and the directory it made go too: "nothing was changed" holds for the JIT cache as well
    (before: the lock file stayed)."""
    need(STRACE is not None, "strace is not installed (.ci/run installs it)")
    entry = toy.home / ".cache" / "flashinfer" / "1.0" / "120a" / "cached_ops" / "toy_comm"
    entry.mkdir(parents=True)
    (entry / "toy_comm.so").write_bytes(b"\x7fELF")
    before = toy.snapshot()
    proc = traced(toy_argv(toy, "apply"), tmp_path / "trace.txt", "link,linkat", f"link,linkat:{inject}:when=1")
    expected = ExitCode.FAILED if inject.startswith("error") else 130
    assert proc.returncode == expected, proc.stdout + proc.stderr
    assert "rolled back" in proc.stderr or "nothing was changed" in proc.stderr, proc.stderr
    assert calls(tmp_path / "trace.txt", "link") or calls(tmp_path / "trace.txt", "linkat")
    assert not (entry.parent / "tmp").exists(), sorted((entry.parent / "tmp").iterdir())
    assert toy.snapshot() == before


def service_env(shared_dir, flashinfer_wheel):
    """An environment and a JIT cache base in a directory every user can reach, readable by all."""
    from helpers import ServingEnv

    system_python = shutil.which("python3", path="/usr/bin")
    root = shared_dir / "venv"
    # Files of its own (linked=False): the tests chown and chmod it.
    make_venv(root, [flashinfer_wheel], python=system_python, linked=False)
    (shared_dir / "home").mkdir()
    return ServingEnv(root, shared_dir / "home"), system_python


def test_an_apply_refused_for_permissions_creates_nothing_in_the_jit_cache(shared_dir, flashinfer_wheel):
    """nobody's own JIT cache (where it could create FlashInfer's lock), root's environment: the
    apply is refused (exit 4), and the JIT cache base is what it was, no cached_ops/tmp/, no lock."""
    from helpers import run_as_nobody, tree_snapshot

    env, system_python = service_env(shared_dir, flashinfer_wheel)
    entry = copied_in_entry(env)
    subprocess.run(["chown", "-R", "nobody:nogroup", str(env.home)], check=True)
    before = tree_snapshot(env.root, env.home)
    proc = run_as_nobody(sm120patch_argv(env, "apply", python=system_python), shared_dir)
    need("No module named" not in proc.stderr, f"nobody cannot run sm120patch here: {proc.stderr.strip()[-200:]}")
    assert proc.returncode == ExitCode.FAILED, proc.stderr
    assert "permission denied; nothing was changed" in proc.stderr and "Traceback" not in proc.stderr
    assert not (entry.parent / "tmp").exists(), sorted(map(str, env.home.rglob("*")))
    assert tree_snapshot(env.root, env.home) == before


def test_root_creating_flashinfers_lock_in_a_service_users_cache_leaves_it_theirs(shared_dir, flashinfer_wheel):
    """Root applies to nobody's environment, with nobody's JIT cache base, where an entry has no
    lock yet: cached_ops/tmp/ is created for nobody, who can then still create the lock of any
    other module there (the server's FlashInfer does, at every build and load)."""
    from helpers import run_cli

    env, _ = service_env(shared_dir, flashinfer_wheel)
    entry = copied_in_entry(env)
    subprocess.run(["chown", "-R", "nobody:nogroup", str(env.root), str(env.home)], check=True)
    result = run_cli("apply", "--python", str(env.python), "--jit-cache-base", str(env.home))
    assert result.exit_code == 0, result.output
    tmp = entry.parent / "tmp"
    assert (tmp.stat().st_uid, tmp.stat().st_gid) == (65534, 65534)
    assert (tmp / "trtllm_comm.lock").stat().st_uid == 65534
    other = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "touch",
                            str(tmp / "norm.lock")], capture_output=True, text=True)
    assert other.returncode == 0, other.stderr
    assert run_cli("revert", "--python", str(env.python), "--jit-cache-base", str(env.home)).exit_code == 0


def test_permission_denied_to_the_owner_names_the_mode_not_the_user(shared_dir, flashinfer_wheel):
    """nobody's environment whose site-packages is mode 0555: "run sm120patch as nobody" would
    be no help to nobody; the hint names the mode and the chmod."""
    from helpers import run_as_nobody, tree_snapshot

    env, system_python = service_env(shared_dir, flashinfer_wheel)
    subprocess.run(["chown", "-R", "nobody:nogroup", str(env.root), str(env.home)], check=True)
    env.site_packages.chmod(0o555)
    before = tree_snapshot(env.root, env.home)
    proc = run_as_nobody(sm120patch_argv(env, "apply", python=system_python), shared_dir)
    need("No module named" not in proc.stderr, f"nobody cannot run sm120patch here: {proc.stderr.strip()[-200:]}")
    assert proc.returncode == ExitCode.FAILED, proc.stderr
    assert f"cannot write {env.site_packages}: permission denied; nothing was changed" in proc.stderr
    assert "run sm120patch as nobody" not in proc.stderr, proc.stderr
    assert "is mode 0555" in proc.stderr and f"`chmod u+w {env.site_packages}`" in proc.stderr, proc.stderr
    assert tree_snapshot(env.root, env.home) == before
    # A dry run runs the same pre-flight: it says what the real run would say, not "exit 0".
    dry = run_as_nobody(sm120patch_argv(env, "apply", "--dry-run", python=system_python), shared_dir)
    assert dry.returncode == ExitCode.FAILED, dry.stderr
    assert f"cannot write {env.site_packages}: permission denied" in dry.stderr
    assert tree_snapshot(env.root, env.home) == before


def test_a_patched_file_at_mode_000_tells_its_owner_which_mode_to_change(shared_dir, flashinfer_wheel):
    """nobody's environment, patched (by root, for nobody), one patched file then chmod 000, and
    nobody runs revert and status: one line that names the mode and the chmod, as
    docs/guarantees.md promises to a process that already runs as the owner (before:
    "Permission denied (.../comm.py)" alone), exit 4 as for any permission error, and nothing
    changes."""
    from helpers import COMM, one_clear_error, run_as_nobody, run_cli, tree_snapshot

    env, system_python = service_env(shared_dir, flashinfer_wheel)
    subprocess.run(["chown", "-R", "nobody:nogroup", str(env.root), str(env.home)], check=True)
    assert run_cli("apply", "--python", str(env.python), "--jit-cache-base", str(env.home)).exit_code == 0
    comm = env.file(COMM)
    comm.chmod(0)
    before = tree_snapshot(env.root, env.home)
    for command in ("revert", "status"):
        proc = run_as_nobody(sm120patch_argv(env, command, python=system_python), shared_dir)
        need("No module named" not in proc.stderr, f"nobody cannot run sm120patch here: {proc.stderr.strip()[-200:]}")
        output = proc.stdout + proc.stderr
        assert proc.returncode == ExitCode.FAILED, (command, output)
        assert "Traceback" not in output, output
        assert f"{comm} is mode 0000: its owner (nobody, who runs sm120patch) may not read or write it; " \
            f"`chmod u+rw {comm}`" in output, (command, output)
        assert "run sm120patch as nobody" not in output, output
        one_clear_error(proc.stderr, str(comm))
        assert tree_snapshot(env.root, env.home) == before, command
    comm.chmod(0o644)
    assert run_cli("revert", "--python", str(env.python), "--jit-cache-base", str(env.home)).exit_code == 0


# -- 3. the state of installs that are all gone --------------------------------------------------

@pytest.mark.parametrize("command", ["revert", "apply", "revert --force"])
def test_state_of_every_uninstalled_distribution_is_shown_then_removed(sm120patch, serving_env, command):
    """Every patched distribution uninstalled: status names their state, the command removes
    exactly it (nothing else in the environment changes), and a second run finds nothing."""
    import json

    from helpers import snapshot

    assert sm120patch("apply").exit_code == 0
    names = sorted(p.name for p in serving_env.state_root.iterdir())
    assert len(names) == 2, names  # flashinfer's and sglang's
    subprocess.run([sys.executable, "-m", "pip", "--python", str(serving_env.python), "uninstall", "--yes", "--quiet",
                    "flashinfer-python", "sglang"], check=True)
    status = sm120patch("status", "--json")
    orphaned = json.loads(status.output)["orphaned_state"]
    assert sorted(o["install"] for o in orphaned) == names, status.output
    files = sorted(f for o in orphaned for f in o["files"])
    assert files == sorted(str(p) for p in serving_env.state_root.rglob("*") if p.is_file())
    before = snapshot(serving_env)
    if command == "revert":  # the dry run says what the run will remove, and removes nothing
        dry = sm120patch("revert", "--dry-run", "--json")
        assert dry.exit_code == 0, dry.output
        document = json.loads(dry.output)
        assert document["would_change"] is True, dry.output
        assert sorted(f for o in document["orphans_removed"] for f in o["files"]) == files
        assert "would remove sm120patch's state of" in sm120patch("revert", "--dry-run").output
        assert snapshot(serving_env) == before
    cleaned = sm120patch(*command.split())
    assert cleaned.exit_code == 0, cleaned.output
    for name in names:
        assert f"removed sm120patch's state of {name}" in cleaned.output, cleaned.output
    assert not serving_env.state_root.exists(), sorted(serving_env.state_root.rglob("*"))
    after = snapshot(serving_env)
    root = str(serving_env.state_root)
    gone = sorted(set(before) - set(after))
    assert gone == sorted(k for k in before if k == root or k.startswith(root + "/")), gone  # exactly the state
    assert [k for k in after if before.get(k) != after[k]] == []  # and nothing else changed
    again = sm120patch(*command.split())
    assert again.exit_code == ExitCode.USAGE and "none of flashinfer-python, sglang" in again.output, again.output
    assert json.loads(sm120patch("status", "--json").output)["orphaned_state"] == []



# -- 6. sm120patch itself upgraded or downgraded under a patched environment -----------------------

def data_without(tmp_path: Path, relpath: str, patch_id: str | None) -> Path:
    """The data of an sm120patch that does not know ``patch_id`` (of the patch-set file
    ``relpath``): today's, less that patch, as SM120PATCH_DATA_DIR sees it. That is what an older
    sm120patch meets in an environment a newer one patched (the issue's case: main three days
    earlier had no unicast-workspace)."""
    from helpers import ROOT

    data = tmp_path / f"data-without-{patch_id}"
    shutil.copytree(ROOT / "patches", data / "patches")
    shutil.copytree(ROOT / "vendor-manifests", data / "vendor-manifests")
    if patch_id is None:  # today's data, to be changed otherwise by the caller
        return data
    toml = data / "patches" / relpath
    text = toml.read_text()
    start = text.index(f'[[patch]]\nid = "{patch_id}"')
    end = text.find("\n[[patch]]\n", start + 1)
    toml.write_text(text[:start] + (text[end + 1:] if end != -1 else ""))
    return data


def without_hashes(data: Path, relpath: str) -> Path:
    """``data`` with FlashInfer 0.6.4's vendor manifest lacking ``relpath`` (as an older
    sm120patch's did before a patch of that file existed)."""
    import json

    manifest = data / "vendor-manifests" / "flashinfer-python" / "0.6.4.json"
    document = json.loads(manifest.read_text())
    del document["files"][relpath]
    manifest.write_text(json.dumps(document))
    return data


@pytest.mark.parametrize("lacks", ["the patch", "the patch and the file", "the file's hashes"])
def test_revert_restores_every_file_the_ledger_lists_whatever_todays_data_knows(sm120patch, serving_env, tmp_path,
                                                                                monkeypatch, lacks):
    """Patched with today's data (unicast-workspace on flashinfer/comm/mnnvl.py among the
    patches), reverted by an sm120patch whose data lacks that patch, or the file too (its
    vendor manifest has no mnnvl.py, as before unicast-workspace existed), or only the file's
    hashes: the ledger lists the file and holds its original, so status names it and revert
    restores it too. Every file is back to its RECORD bytes and nothing of sm120patch's state is
    left (before: mnnvl.py stayed patched and its original went with the ledger; with the patch
    in the data but the file's hashes not, a KeyError traceback and nothing reverted)."""
    from helpers import MNNVL, changed, snapshot

    before = snapshot(serving_env)
    assert sm120patch("apply").exit_code == 0
    assert "unicast-workspace" in serving_env.state().read_ledger().files[MNNVL].patches
    data = data_without(tmp_path, "flashinfer-python/0.6.4.toml", None if lacks == "the file's hashes"
                        else "unicast-workspace")
    if lacks != "the patch":
        without_hashes(data, MNNVL)
    monkeypatch.setenv("SM120PATCH_DATA_DIR", str(data))
    status = sm120patch("status")
    assert "Traceback" not in status.output, status.output
    if lacks == "the file's hashes":  # the ledger vouches for the bytes it wrote: patched, as it was left
        assert status.exit_code == 0 and re.search(r"unicast-workspace +applied", status.output), status.output
    else:
        assert f"{MNNVL}: patched by an sm120patch whose data has unicast-workspace, which this one's does not" \
            in status.output, status.output
    result = sm120patch("revert")
    assert result.exit_code == 0, result.output
    assert "flashinfer-python 0.6.4: restored 6 files" in result.output, result.output
    assert serving_env.record_mismatches() == []
    assert not serving_env.state_root.exists(), sorted(serving_env.state_root.rglob("*"))
    assert changed(before, snapshot(serving_env)) == []


def test_a_manifest_without_a_file_its_patch_set_patches_is_refused_in_one_line(sm120patch, serving_env, tmp_path,
                                                                                monkeypatch):
    """No ledger vouches for the file and the manifest has no hashes for it: nothing says what
    its release bytes are, so apply refuses the data (exit 2, one line) and changes nothing."""
    from helpers import MNNVL, changed, one_clear_error, snapshot

    data = without_hashes(data_without(tmp_path, "flashinfer-python/0.6.4.toml", None), MNNVL)
    monkeypatch.setenv("SM120PATCH_DATA_DIR", str(data))
    before = snapshot(serving_env)
    result = sm120patch("apply")
    assert result.exit_code == ExitCode.USAGE, result.output
    one_clear_error(result.output, f"the vendor manifest of flashinfer-python 0.6.4 has no hashes for {MNNVL}")
    assert changed(before, snapshot(serving_env)) == []


def test_an_upgrade_that_adds_a_patch_sees_partly_patched_then_adds_it_and_reverts_exactly(sm120patch, serving_env,
                                                                                          tmp_path, monkeypatch):
    """The other way round: an environment patched by an sm120patch without unicast-workspace,
    then today's: status says partly patched, apply adds the patch, revert is exact."""
    from helpers import MNNVL, changed, snapshot

    before = snapshot(serving_env)
    monkeypatch.setenv("SM120PATCH_DATA_DIR", str(data_without(tmp_path, "flashinfer-python/0.6.4.toml",
                                                               "unicast-workspace")))
    assert sm120patch("apply", "--flashinfer").exit_code == 0
    monkeypatch.delenv("SM120PATCH_DATA_DIR")
    status = sm120patch("status")
    assert "flashinfer-python 0.6.4: partly patched" in status.output, status.output
    applied = sm120patch("apply", "--flashinfer")
    assert applied.exit_code == 0 and "patched 1 file" in applied.output, applied.output
    assert "unicast-workspace" in serving_env.state().read_ledger().files[MNNVL].patches
    assert sm120patch("revert").exit_code == 0
    assert serving_env.record_mismatches() == [] and not serving_env.state_root.exists()
    assert changed(before, snapshot(serving_env)) == []


@pytest.mark.parametrize("record", ["ledger", "journal"])
def test_a_ledger_or_journal_of_a_newer_format_is_refused_naming_the_version_that_reads_it(toy, record):
    """After a downgrade: an install whose ledger (or whose interrupted run's journal) a newer
    sm120patch wrote in a format this one cannot honour. status, apply and revert each refuse
    in one line that names the sm120patch that wrote it (exit 3), and nothing changes; never
    "unreadable, move it aside" (which would throw the record of what was patched away) or
    `revert --force`."""
    import json

    from helpers import one_clear_error
    from sm120patch.state import InstallState, state_root

    assert subprocess.run(toy_argv(toy, "apply"), capture_output=True).returncode == 0
    root = state_root(toy.site)
    ledger = InstallState(root / "toyfuse-1.0.dist-info").ledger_path
    if record == "ledger":
        document, path = json.loads(ledger.read_text()), ledger
    else:
        document, path = {"operation": "apply", "run": "r1", "roots": [str(root)], "entries": []}, root / "journal.json"
    document.update(format=99, written_by="sm120patch 7.1.0")
    path.write_text(json.dumps(document))
    before = toy.snapshot()
    for command in ("status", "apply", "revert", "revert --force"):
        words = command.split()
        proc = subprocess.run(toy_argv(toy, words[0]) + words[1:], capture_output=True, text=True)
        output = proc.stdout + proc.stderr
        assert proc.returncode == ExitCode.REFUSED, (command, output)
        text = f"{path} was written by sm120patch 7.1.0 ({record} format 99); this sm120patch 0.1.0 reads format 2"
        if command == "status":
            assert text in output, output
        else:
            one_clear_error(output, text)
            assert "hint: install sm120patch 7.1.0 or later (the version that wrote it)" in output, output
        assert "move it aside" not in output and "unreadable" not in output, output
        assert toy.snapshot() == before, command


@pytest.mark.parametrize("writer", ["7.1.0", "0.1.0", "0.0.9"])
def test_a_newer_format_ledger_beside_a_current_one_changes_nothing_and_advises_what_can_be_done(tmp_path, monkeypatch,
                                                                                               writer):
    """Two distributions patched in one environment, one ledger then rewritten in a newer format:
    revert refuses the whole run (exit 3) and nothing changes, the other distribution included,
    as docs/guarantees.md says (before: it reverted the other one and said "nothing was
    changed"). The refusal names the version the ledger records; "install X or later" only
    when X is newer than this sm120patch (before: "install sm120patch 0.1.0 or later", said by
    0.1.0 itself)."""
    import json

    from helpers import one_clear_error
    from sm120patch import __version__
    from sm120patch.state import InstallState, state_root
    from toy import make_data, make_install, make_wheel

    (tmp_path / "data-wheels").mkdir()
    data = make_data(tmp_path / "data", tmp_path / "data-wheels", ("toyfuse", "toyserve"))
    monkeypatch.setenv("SM120PATCH_DATA_DIR", str(data))
    (tmp_path / "wheels").mkdir()
    venv, home = tmp_path / "venv", tmp_path / "home"
    home.mkdir()
    site = make_install(venv, [make_wheel(tmp_path / "wheels", "1.0", name=n) for n in ("toyfuse", "toyserve")])
    argv = [sys.executable, "-m", "sm120patch", "revert", "--python", str(venv / "bin" / "python"),
            "--jit-cache-base", str(home)]
    assert subprocess.run([*argv[:3], "apply", *argv[4:]], capture_output=True).returncode == 0
    ledger = InstallState(state_root(site) / "toyfuse-1.0.dist-info").ledger_path
    document = json.loads(ledger.read_text())
    document.update(format=99, written_by=f"sm120patch {writer}")
    ledger.write_text(json.dumps(document))
    from helpers import tree_snapshot

    before = tree_snapshot(venv, home)
    proc = subprocess.run(argv, capture_output=True, text=True)
    assert proc.returncode == ExitCode.REFUSED, proc.stdout + proc.stderr
    one_clear_error(proc.stderr, f"{ledger} was written by sm120patch {writer} (ledger format 99)")
    assert tree_snapshot(venv, home) == before  # toyserve's patch stands too
    newer = tuple(map(int, writer.split("."))) > tuple(map(int, __version__.split(".")))
    advice = (f"hint: install sm120patch {writer} or later (the version that wrote it)" if newer else
              "hint: install the sm120patch build that patched this environment (one that reads ledger format 99)")
    assert advice in proc.stderr, proc.stderr
    assert ("or later" in proc.stderr) == newer, proc.stderr


def test_bytes_another_sm120patch_wrote_without_force_are_not_called_forced(sm120patch, serving_env, tmp_path,
                                                                           monkeypatch):
    """jit-gate applied by an sm120patch whose data had another applied form of it (here: the
    form this data's manifest lists, seen by data that lists another hash for it): the ledger
    vouches for the bytes and says an ordinary apply wrote them. status must not label it
    "applied (forced)" (--force was never used); it names it as another sm120patch's form, with
    the way to today's, and revert is exact."""
    import json

    from helpers import changed, snapshot

    pristine = snapshot(serving_env)
    assert sm120patch("apply", "--flashinfer").exit_code == 0
    data = data_without(tmp_path, "flashinfer-python/0.6.4.toml", None)
    manifest = data / "vendor-manifests" / "flashinfer-python" / "0.6.4.json"
    document = json.loads(manifest.read_text())
    document["files"]["flashinfer/jit/comm.py"]["patched"]["jit-gate"] = "0" * 64  # today's form is another
    manifest.write_text(json.dumps(document))
    monkeypatch.setenv("SM120PATCH_DATA_DIR", str(data))
    status = sm120patch("status")
    assert "forced" not in status.output, status.output
    assert re.search(r"jit-gate +applied \(another sm120patch's form\)", status.output), status.output
    assert "flashinfer/jit/comm.py: written by another sm120patch" in status.output, status.output
    doc = json.loads(sm120patch("status", "--json").output)
    origins = {p["id"]: p["origin"] for d in doc["distributions"] for p in d["patches"]}
    assert origins["jit-gate"] == "another sm120patch's form", origins
    assert sm120patch("revert").exit_code == 0
    assert serving_env.record_mismatches() == [] and changed(pristine, snapshot(serving_env)) == []


def data_before_the_tp2_gate(tmp_path: Path) -> Path:
    """The data of the sm120patch before SGLang 0.5.8-0.5.14's auto-enable was gated to TP2:
    today's, with that patch's former form ("ungated") as the patch itself, and the manifests'
    hashes to match (what that sm120patch's data had, byte for byte: the ungated form's hash is
    the one its manifests listed)."""
    import json

    from helpers import ROOT

    data = tmp_path / "data-ungated"
    shutil.copytree(ROOT / "patches", data / "patches")
    shutil.copytree(ROOT / "vendor-manifests", data / "vendor-manifests")
    for name in ("0.5.8", "0.5.11", "0.5.14"):
        toml = data / "patches" / "sglang" / f"{name}.toml"
        text = toml.read_text()
        start = text.index("# The form sm120patch applied before it was gated to TP2")
        end = text.find("\n[[patch]]\n", start)
        text = text[:start].rstrip("\n") + "\n" + (text[end:] if end != -1 else "")
        text = text.replace('add = "(is_sm120_supported() and self.tp_size == 2)" }', 'add = "is_sm120_supported()" }')
        toml.write_text(text.replace('check = "auto-enable-tp2"', 'check = "auto-enable"'))
    for manifest in (data / "vendor-manifests" / "sglang").glob("*.json"):
        document = json.loads(manifest.read_text())
        for hashes in document["files"].values():
            if "auto-enable@ungated" in hashes["patched"]:
                hashes["patched"]["auto-enable"] = hashes["patched"].pop("auto-enable@ungated")
        manifest.write_text(json.dumps(document))
    return data


@pytest.mark.parametrize("then", ["revert", "apply, then revert"])
def test_the_older_form_of_auto_enable_is_shown_updated_by_apply_and_reverted_exactly(sm120patch, serving_env, tmp_path,
                                                                                     monkeypatch, then):
    """SGLang 0.5.9 with auto-enable applied by the sm120patch before the TP2 gate (its data,
    from today's former form): status says "applied (older form)" with the apply that updates
    it; apply brings server_args.py to the TP2 form in one run, and revert from either form
    gives back the release's bytes: the whole environment hashes as before the first apply."""
    from helpers import SERVER_ARGS, changed, snapshot
    from sm120patch.semantics import evaluate

    pristine = snapshot(serving_env)
    monkeypatch.setenv("SM120PATCH_DATA_DIR", str(data_before_the_tp2_gate(tmp_path)))
    assert sm120patch("apply", "--with", "auto-enable").exit_code == 0
    monkeypatch.delenv("SM120PATCH_DATA_DIR")
    server_args = serving_env.file(SERVER_ARGS)
    assert evaluate("auto-enable", server_args.read_bytes())[0] is True
    assert evaluate("auto-enable-tp2", server_args.read_bytes())[0] is False  # the older form: every TP size
    status = sm120patch("status")
    assert re.search(r"auto-enable +applied \(older form\)", status.output), status.output
    update = f"sm120patch apply --python {serving_env.python} --jit-cache-base {serving_env.home}"
    assert f"auto-enable: applied (older form): `{update}` updates it" in status.output, status.output
    if then.startswith("apply"):
        applied = sm120patch("apply")
        assert applied.exit_code == 0, applied.output
        assert "sglang 0.5.9: patched 1 file" in applied.output and SERVER_ARGS in applied.output, applied.output
        assert "flashinfer-python 0.6.4: nothing to change" in applied.output, applied.output
        assert evaluate("auto-enable-tp2", server_args.read_bytes())[0] is True
        again = sm120patch("status")
        assert "older form" not in again.output and re.search(r"auto-enable +applied ", again.output), again.output
        assert sm120patch("apply").output.count("nothing to change") == 2  # a second apply changes nothing
    reverted = sm120patch("revert")
    assert reverted.exit_code == 0, reverted.output
    assert serving_env.record_mismatches() == [] and not serving_env.state_root.exists()
    assert changed(pristine, snapshot(serving_env)) == []
