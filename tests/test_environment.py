"""Locating the target: the probe runs in the target interpreter; bad --python is clear."""

from __future__ import annotations

import sys

import pytest

from sm120patch.environment import InstalledFiles, locate, normalize_relpath, parse_record_hash
from sm120patch.errors import RefusedError, TargetError


def test_record_hashes_decode_to_hex():
    assert parse_record_hash("sha256=47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU") == (
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    )
    assert parse_record_hash("md5=abc") is None


def test_probe_reports_the_target_interpreter_and_its_distributions(serving_env):
    env = locate(serving_env.python)
    assert env.prefix == serving_env.root
    flashinfer = env.get("flashinfer-python")
    assert flashinfer.raw_version == "0.6.4"
    assert flashinfer.location == serving_env.site_packages
    assert "flashinfer/jit/comm.py" in flashinfer.record
    assert env.get("sglang").pinned_version_of("flashinfer-python") == "0.6.3"
    assert env.get("flashinfer-jit-cache") is None
    assert env.state_root(flashinfer) == serving_env.root / "share" / "sm120patch"


def test_a_relative_python_path_is_the_venv_not_its_base_interpreter(serving_env, monkeypatch):
    monkeypatch.chdir(serving_env.root)
    env = locate("bin/python")
    assert env.prefix == serving_env.root
    assert env.get("flashinfer-python") is not None


def test_default_target_is_this_interpreter():
    assert locate().executable.resolve() == __import__("pathlib").Path(sys.executable).resolve()


@pytest.mark.parametrize("python, message", [
    ("/nonexistent/python3", "no such file"),
    ("/bin/true", "not a usable Python interpreter"),
])
def test_a_bad_python_is_a_target_error(python, message):
    with pytest.raises(TargetError, match=message):
        locate(python)


def test_a_file_that_is_no_program_is_a_target_error(tmp_path):
    text = tmp_path / "python3"
    text.write_text("just text\n")
    text.chmod(0o755)
    with pytest.raises(TargetError, match="could not run it"):
        locate(text)


def test_a_directory_is_not_a_python(tmp_path):
    with pytest.raises(TargetError, match="not an executable file"):
        locate(tmp_path)


@pytest.mark.parametrize("relpath", ["../x", "/abs", "a/../../b", ""])
def test_unsafe_relpaths(relpath):
    with pytest.raises(ValueError):
        normalize_relpath(relpath)


def test_edits_are_confined_to_record_listed_files(serving_env):
    tree = InstalledFiles(locate(serving_env.python).get("flashinfer-python"))
    assert tree.absolute("flashinfer/jit/comm.py") == serving_env.file("flashinfer/jit/comm.py")
    with pytest.raises(RefusedError, match="not listed in flashinfer-python's RECORD"):
        tree.absolute("flashinfer/not_in_record.py")
    with pytest.raises(RefusedError, match="not a safe relative path"):
        tree.absolute("../../../etc/passwd")


def test_a_symlinked_target_file_is_refused(serving_env, tmp_path):
    path = serving_env.file("flashinfer/jit/comm.py")
    elsewhere = tmp_path / "comm.py"
    elsewhere.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(elsewhere)
    tree = InstalledFiles(locate(serving_env.python).get("flashinfer-python"))
    with pytest.raises(RefusedError, match="symbolic link"):
        tree.absolute("flashinfer/jit/comm.py")
