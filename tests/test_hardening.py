"""Issue #61, items 4, 5, 7, 8 and 9: what a hostile file, path or archive, a concurrent run and
a user's own files can make sm120patch print or do. Each test failed before its fix."""

from __future__ import annotations

import fcntl
import json
import os
import re
import resource
import struct
import subprocess
import sys
import threading
import zipfile
import zlib
from pathlib import Path

import pytest
from packaging.version import Version

from helpers import changed, run_cli, sm120patch_argv, tree_snapshot
from sm120patch import terminal
from sm120patch.errors import ExitCode
from test_synthetic import data_dir  # noqa: F401 - the synthetic distribution's data
from test_terminal import on_a_terminal
from toy import SOURCE, install, make_install, make_wheel

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
    comm.write_text(SOURCE.replace("    return", f"    # {HOSTILE}\n    return"))  # within a diff's context
    (tmp_path / "home").mkdir()
    env = {**os.environ, "SM120PATCH_DATA_DIR": str(data_dir), "HOME": str(tmp_path / "home"),
           "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    python = str(venv / "bin" / "python")
    wheels = ["--wheel-dir", str(tmp_path)]
    runs = {"status": sm120patch("status", "--python", python, env=env),
            "apply": sm120patch("apply", "--python", python, *wheels, env=env),
            "revert --dry-run": sm120patch("revert", "--dry-run", "--force", "--python", python, *wheels, env=env)}
    for name, proc in runs.items():
        shown = proc.stdout + proc.stderr
        assert not CONTROLS.search(shown), (name, shown)
        assert b"Traceback" not in shown, name
    # The refusal's diff and the forced revert's show what the file holds, as text.
    assert runs["apply"].returncode == ExitCode.REFUSED
    assert rb"+    # \x1b]52;c;ZXZpbA==\x07 \x1b]0;owned\x07 \x1b[2J \x9b31m \x00 \x08\u202e" in runs["apply"].stderr
    assert rb"-    # \x1b]52;c;ZXZpbA==\x07" in runs["revert --dry-run"].stdout
    # `diff` into a file or a pipe is a patch: the file's bytes exactly, so that `patch -p1` applies
    # it; on a terminal, the same diff is shown with its escapes visible.
    exact = sm120patch("diff", "--force", "--python", python, env=env)
    assert exact.returncode == ExitCode.OK and f"     # {HOSTILE}\n".encode() in exact.stdout
    code, shown = on_a_terminal("diff", "--force", "--python", python, **{k: env[k] for k in ("SM120PATCH_DATA_DIR",
                                                                                              "HOME")})
    assert code == ExitCode.OK and not CONTROLS.search(shown.replace("\n", "").encode()), shown
    assert " supported_major_versions=[9, 10, 12]," in shown and "     # \\x1b]52;c;ZXZpbA==\\x07" in shown
    # The command `next:` and a hint name is the same path, when pasted into a shell.
    hint = re.search(rb"reinstall with `([^`]+)`", runs["apply"].stderr).group(1).decode()
    assert subprocess.run(["bash", "-c", f"test -x {hint.split(' -m ')[0]}"]).returncode == 0, hint
    comm.write_text(SOURCE)  # the release's bytes again: the next command apply runs, as printed
    status = sm120patch("status", "--python", python, env=env)
    (command,) = re.findall(r"next: `(sm120patch apply [^`]+)`", status.stdout.decode())
    applied = subprocess.run(["bash", "-c", command], capture_output=True, env=env, timeout=120)
    assert applied.returncode == ExitCode.OK, applied.stderr
    assert "[9, 10, 12]" in comm.read_text()



@pytest.mark.parametrize("name", ["plain/path", "it's a $HOME `x`", "esc\x1b]0;t\x07", "nul-less\x01\x7f\x9b\u202e",
                                  "not utf-8 \udcff\udc80", "back\\slash 'quote'\n"])
def test_a_quoted_word_names_the_same_bytes_in_bash_and_shows_no_control(name):
    quoted = terminal.quote(name)
    assert terminal.visible(quoted) == quoted  # nothing in it a terminal acts on
    said = subprocess.run(["bash", "-c", f"printf %s {quoted}"], capture_output=True, check=True).stdout
    assert said == os.fsencode(name)


# -- item 8: a zip bomb in a wheel -----------------------------------------------------------------

def bomb_wheel(path: Path, files: dict[str, bytes], bomb: str, size: int) -> Path:
    """A wheel whose member ``bomb`` is ``size`` zero bytes, deflated to about a thousandth of
    that: written by hand, as one 16 MiB deflate block flushed in full (so it repeats byte for
    byte) ``size`` / 16 MiB times; the other members stored."""
    chunk = 1 << 24
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = compressor.compress(bytes(chunk)) + compressor.flush(zlib.Z_FULL_FLUSH)
    deflated = block * (size // chunk) + compressor.flush()
    crc = 0
    for _ in range(size // chunk):
        crc = zlib.crc32(bytes(chunk), crc)
    members = [(name, 0, zlib.crc32(data), data, len(data)) for name, data in files.items()]
    members.append((bomb, zipfile.ZIP_DEFLATED, crc, deflated, size))
    out, central = bytearray(), bytearray()
    for name, method, crc, data, usize in members:
        encoded = name.encode()
        central += struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, method, 0, 33, crc, len(data), usize,
                               len(encoded), 0, 0, 0, 0, 0, len(out)) + encoded
        out += struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, method, 0, 33, crc, len(data), usize, len(encoded), 0)
        out += encoded + data
    out += central + struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(members), len(members), len(central),
                                 len(out), 0)
    path.write_bytes(bytes(out))
    return path


def limited_memory(megabytes: int):
    """A child's address space capped, so that a read of a whole bomb fails there fast (a
    MemoryError) instead of taking this machine's memory."""
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (megabytes << 20, megabytes << 20))


def test_a_zip_bomb_in_a_wheel_is_refused_in_one_line_without_reading_it(data_dir, tmp_path):  # noqa: F811
    venv = tmp_path / "env"
    site = make_install(venv, [make_wheel(tmp_path, "1.0")])
    (site / "toyfuse" / "comm.py").write_text("# tuned\n" + SOURCE)  # drifted: apply reads the wheel's bytes
    meta = {"toyfuse-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: toyfuse\nVersion: 1.0\n"}
    record = b"toyfuse/comm.py,,\ntoyfuse-1.0.dist-info/METADATA,,\ntoyfuse-1.0.dist-info/RECORD,,\n"
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    bomb_wheel(wheels / "toyfuse-1.0-py3-none-any.whl", {**meta, "toyfuse-1.0.dist-info/RECORD": record},
               "toyfuse/comm.py", 1 << 30)
    # A bomb in the RECORD, the first member any wheel is read for (manifest add, too).
    meta12 = {"toyfuse-1.2.dist-info/METADATA": meta["toyfuse-1.0.dist-info/METADATA"].replace(b"1.0", b"1.2")}
    bombed_record = bomb_wheel(tmp_path / "toyfuse-1.2-py3-none-any.whl", meta12, "toyfuse-1.2.dist-info/RECORD",
                               1 << 30)
    (tmp_path / "home").mkdir()
    env = {**os.environ, "SM120PATCH_DATA_DIR": str(data_dir), "HOME": str(tmp_path / "home")}
    before = tree_snapshot(venv, tmp_path / "home", data_dir)
    target = ["--python", str(venv / "bin" / "python"), "--wheel-dir", str(wheels)]
    # apply refuses the drifted file (3), its diff against the release left out; revert --force finds
    # no readable release bytes (3); manifest add names the member and the bound (2).
    bound = "toyfuse-1.2.dist-info/RECORD inflates to 1,073,741,824 bytes"
    for argv, code, words in ((["apply", *target], ExitCode.REFUSED, "is not the 1.0 release's bytes"),
                              (["revert", "--force", *target], ExitCode.REFUSED, "nor in a wheel sm120patch can read"),
                              (["manifest", "add", "toyfuse", "1.2", "--wheel", str(bombed_record)], ExitCode.USAGE,
                               bound)):
        proc = sm120patch(*argv, env=env, preexec_fn=limited_memory(768), text=True)
        assert proc.returncode == code, (argv, proc.stderr)
        assert "Traceback" not in proc.stderr and "MemoryError" not in proc.stderr, proc.stderr
        (said,) = [line for line in proc.stderr.splitlines() if line.startswith("sm120patch: error:")]
        assert words in said, said
    assert changed(before, tree_snapshot(venv, tmp_path / "home", data_dir)) == []


# -- item 5: readers beside a run ------------------------------------------------------------------

def test_status_beside_apply_and_revert_sees_a_committed_state_every_time(serving_env):
    """10 `status --json` in a loop each, while apply and revert take turns on a real FlashInfer
    0.6.4 + SGLang 0.5.9 environment: every reader gets a document, of the state before a run or
    after it (both distributions patched, or neither: one transaction patches both), never a
    half state, an interrupted run, a reinstall or an error."""
    readers, rounds = 10, 3
    environ = {**os.environ, "SM120PATCH_LOCK_WAIT": "300"}  # a writer waits out the readers, as they wait for it
    stop, seen = threading.Event(), []

    def read() -> None:
        while not stop.is_set():
            proc = subprocess.run(sm120patch_argv(serving_env, "status", "--json"), capture_output=True, text=True,
                                  timeout=300, env=environ)
            seen.append(proc)

    threads = [threading.Thread(target=read) for _ in range(readers)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(rounds):
            for command in ("apply", "revert"):
                proc = subprocess.run(sm120patch_argv(serving_env, command), capture_output=True, text=True,
                                      timeout=300, env=environ)
                assert proc.returncode == ExitCode.OK, proc.stderr
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert len(seen) >= readers * rounds
    committed = {("patched", False, None, None), ("not patched", False, None, None)}
    wrong = []
    for proc in seen:
        try:
            document = json.loads(proc.stdout)  # a document, always
        except ValueError:
            wrong.append((proc.returncode, proc.stderr))
            continue
        found = {(d["state"], bool(d["dropped_by_reinstall"]), d["interrupted_transaction"], d["in_progress"])
                 for d in document["distributions"]}
        # One committed state, flashinfer-python's and sglang's alike (one transaction patches both).
        if (proc.returncode not in (ExitCode.OK, ExitCode.NOT_OK) or proc.returncode != document["exit_code"]
                or len(found) != 1 or not found <= committed):
            wrong.append((proc.returncode, found or document.get("error")))
    print(f"\n{len(seen)} status documents beside {rounds} apply/revert rounds, {len(wrong)} not a committed state")
    assert wrong == [], f"{len(wrong)} of {len(seen)}: {wrong[:5]}"


# -- item 9: smaller ones --------------------------------------------------------------------------

@pytest.mark.skipif(os.geteuid() != 0, reason="git's ownership check needs a checkout of another user: root chowns it")
def test_root_on_another_users_checkout_says_what_git_said_and_the_way_out(tmp_path):
    import git

    root = tmp_path / "sglang"
    (root / "python" / "sglang").mkdir(parents=True)
    (root / "python" / "sglang" / "__init__.py").write_text("")
    repo = git.Repo.init(root, initial_branch="main")
    repo.git.add(A=True)
    repo.git.commit("-m", "SGLang v0.5.9", env={"GIT_AUTHOR_NAME": "u", "GIT_AUTHOR_EMAIL": "u@example.org",
                                                 "GIT_COMMITTER_NAME": "u", "GIT_COMMITTER_EMAIL": "u@example.org"})
    repo.create_tag("v0.5.9")
    for path in [tmp_path, root, *root.rglob("*")]:  # a service user's clone (a uid with no passwd entry)
        os.lchown(path, 4242, 4242)
    proc = sm120patch("status", "--source", str(root), env={**os.environ, "GIT_CONFIG_GLOBAL": "/dev/null"}, text=True)
    assert proc.returncode == ExitCode.USAGE, proc.stderr
    error, hint = proc.stderr.splitlines()
    assert "git refuses to read it: detected dubious ownership in repository at" in error, error
    assert "release tag" not in error
    assert hint == (f"hint: run sm120patch as uid 4242, who owns it, or trust it for this user: "
                    f"`git config --global --add safe.directory {root}`")
    # The way out, taken: the hint's command, then the same status reads the tag.
    config = tmp_path.parent / "gitconfig"
    subprocess.run(["git", "config", "--file", str(config), "--add", "safe.directory", str(root)], check=True)
    trusted = sm120patch("status", "--source", str(root), env={**os.environ, "GIT_CONFIG_GLOBAL": str(config)},
                         text=True)
    assert "sglang 0.5.9" in trusted.stdout, trusted.stderr


def test_status_that_a_run_keeps_waiting_says_a_run_is_in_progress_with_a_document(data_dir, tmp_path):  # noqa: F811
    site = make_install(tmp_path / "env", [make_wheel(tmp_path, "1.0")])
    environ = {**os.environ, "SM120PATCH_DATA_DIR": str(data_dir), "HOME": str(tmp_path),
               "SM120PATCH_LOCK_WAIT": "0.5"}
    fd = os.open(site, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # what a run that is changing the environment holds
        proc = sm120patch("status", "--json", "--python", str(tmp_path / "env" / "bin" / "python"), env=environ,
                          text=True)
    finally:
        os.close(fd)
    assert proc.returncode == ExitCode.FAILED, proc.stderr
    document = json.loads(proc.stdout)
    assert document["exit_code"] == ExitCode.FAILED
    assert document["error"]["message"].startswith(f"a run is in progress: another sm120patch is changing {site}")


def small_sglang_checkout(root: Path, sglang_wheel: Path) -> Path:
    """An SGLang 0.5.9 checkout (python/sglang/, the v0.5.9 tag) of the files its patch set names
    alone, from the release's wheel: enough for apply --source to commit there."""
    import git

    from sm120patch.distributions import load_registry

    names = ["sglang/__init__.py", *load_registry().get("sglang").find(Version("0.5.9")).files]
    with zipfile.ZipFile(sglang_wheel) as archive:
        for name in names:
            (root / "python" / name).parent.mkdir(parents=True, exist_ok=True)
            (root / "python" / name).write_bytes(archive.read(name))
    repo = git.Repo.init(root, initial_branch="main")
    with repo.config_writer() as config:
        config.set_value("user", "name", "Upstream Dev")
        config.set_value("user", "email", "dev@example.org")
    repo.git.add(A=True)
    repo.index.commit("SGLang v0.5.9")
    repo.create_tag("v0.5.9")
    return root


def test_export_never_replaces_a_users_file_of_the_same_name_unless_forced(tmp_path, sglang_wheel):
    root = str(small_sglang_checkout(tmp_path / "sglang", sglang_wheel))
    assert run_cli("apply", "--source", root).exit_code == ExitCode.OK
    first = run_cli("export", "--source", root, "--out", str(tmp_path / "first"))
    assert first.exit_code == ExitCode.OK, first.output
    (made,) = (tmp_path / "first").iterdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / made.name).write_text("my own notes\n")
    before = tree_snapshot(out)
    refused = run_cli("export", "--source", root, "--out", str(out))
    assert refused.exit_code == ExitCode.REFUSED
    assert f"{out / made.name} exists and is not sm120patch's export of this commit; nothing was written" in refused.output
    assert f"--force` replaces it" in refused.output
    assert changed(before, tree_snapshot(out)) == []  # no file replaced, no staging directory left
    forced = run_cli("export", "--source", root, "--out", str(out), "--force")
    assert forced.exit_code == ExitCode.OK and (out / made.name).read_bytes() == made.read_bytes()
    again = run_cli("export", "--source", root, "--out", str(out))  # its own export: replaced, as before
    assert again.exit_code == ExitCode.OK and sorted(out.iterdir()) == [out / made.name]


def test_a_copy_found_through_pythonpath_is_named_with_the_one_a_server_without_it_imports(data_dir, tmp_path):  # noqa: F811
    venv = tmp_path / "env"
    site = make_install(venv, [make_wheel(tmp_path, "1.0")])
    other = tmp_path / "other"
    other.mkdir()
    install(other, make_wheel(tmp_path, "1.0"))  # a second toyfuse, in a directory PYTHONPATH names
    (tmp_path / "home").mkdir()
    env = {**os.environ, "SM120PATCH_DATA_DIR": str(data_dir), "HOME": str(tmp_path / "home"), "PYTHONPATH": str(other),
           "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    python = str(venv / "bin" / "python")
    said = (f"a directory on PYTHONPATH ({other}), which the interpreter imports only while PYTHONPATH names it: a "
            f"server started without it imports the copy in {site} (toyfuse 1.0), which this run leaves as it is "
            f"(`env -u PYTHONPATH sm120patch apply --python {python}` patches that one)")
    status = sm120patch("status", "--python", python, env=env, text=True)
    assert f"! installed in {said}" in status.stdout, status.stdout
    applied = sm120patch("apply", "--python", python, env=env, text=True)
    assert applied.returncode == ExitCode.OK and f"note: toyfuse is installed in {said}" in applied.stdout
    assert "[9, 10, 12]" in (other / "toyfuse" / "comm.py").read_text()  # the copy the interpreter imports now
    assert "[9, 10, 12]" not in (site / "toyfuse" / "comm.py").read_text()
    # The command it names patches the other copy, the one a server without PYTHONPATH imports.
    command = re.search(r"`(env -u PYTHONPATH [^`]+)`", applied.stdout).group(1)
    assert subprocess.run(["bash", "-c", command], env=env, capture_output=True, timeout=120).returncode == 0
    assert "[9, 10, 12]" in (site / "toyfuse" / "comm.py").read_text()

