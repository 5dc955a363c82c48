"""Locating the target: the probe runs in the target interpreter; a bad --python is one clear
error; an install is identified by its .dist-info, and its files are read only where RECORD says."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from helpers import COMM
from sm120patch.distributions import load_registry
from sm120patch.environment import InstalledDistribution, parse_record_hash, resolve_python, start_probe
from sm120patch.errors import TargetError
from sm120patch.patchsets import normalize_relpath
from sm120patch.trees import InstalledTree

REGISTRY = load_registry(check_rewriters=False)


def probe(python=None):
    return start_probe(python, REGISTRY.wanted_rows()).result()


def test_record_hashes_decode_to_hex():
    assert parse_record_hash("sha256=47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU") == (
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    )
    assert parse_record_hash("md5=abc") is None


def test_probe_reports_the_target_interpreter_and_its_distributions(serving_env):
    env = probe(serving_env.python)
    assert env.prefix == serving_env.root
    flashinfer = env.get("flashinfer-python")
    assert flashinfer.raw_version == "0.6.4"
    assert flashinfer.site_dir == serving_env.site_packages
    assert flashinfer.dist_info == serving_env.dist_info("flashinfer_python")
    assert flashinfer.installer == "pip"
    # Only the rows the patch sets need come back (FlashInfer's RECORD has about 2,000).
    assert COMM in flashinfer.record and len(flashinfer.record) == 3
    assert env.get("sglang").pinned_version_of("flashinfer-python") == "0.6.3"
    assert env.get("flashinfer-jit-cache") is None
    tree = InstalledTree(env, flashinfer, REGISTRY.get("flashinfer-python"))
    assert tree.state.root == serving_env.site_packages / ".sm120patch" / flashinfer.dist_info.name


def test_a_relative_python_path_is_the_venv_not_its_base_interpreter(serving_env, monkeypatch):
    monkeypatch.chdir(serving_env.root)
    env = probe("bin/python")
    assert env.prefix == serving_env.root
    assert env.get("flashinfer-python") is not None


def test_a_bare_name_is_looked_up_on_path_like_a_shell_does(serving_env, monkeypatch):
    monkeypatch.setenv("PATH", f"{serving_env.root / 'bin'}:/usr/bin:/bin")
    assert resolve_python("python") == str(serving_env.root / "bin" / "python")
    with pytest.raises(TargetError, match="--python no-such-python: not found on PATH"):
        resolve_python("no-such-python")


def test_default_target_is_this_interpreter():
    assert probe().executable.resolve() == Path(sys.executable).resolve()


@pytest.mark.parametrize("python, message", [
    ("/nonexistent/python3", "no such file"),
    ("/bin/true", "not a usable Python interpreter"),
    ("/bin/ls", "not a usable Python interpreter"),
])
def test_a_bad_python_is_a_target_error(python, message):
    with pytest.raises(TargetError, match=message) as caught:
        probe(python)
    assert "flashinfer" not in caught.value.message  # nothing of what /bin/ls printed leaks into it


def test_a_file_that_is_no_program_is_a_target_error(tmp_path):
    text = tmp_path / "python3"
    text.write_text("just text\n")
    text.chmod(0o755)
    with pytest.raises(TargetError, match="could not run it"):
        probe(text)


def test_a_directory_is_not_a_python(tmp_path):
    with pytest.raises(TargetError, match="is a directory") as caught:
        probe(tmp_path)
    assert caught.value.hint and "bin/python" in caught.value.hint


@pytest.mark.parametrize("relpath", ["../x", "/abs", "a/../../b", ""])
def test_unsafe_relpaths(relpath):
    with pytest.raises(ValueError):
        normalize_relpath(relpath)


def tree_of(serving_env) -> InstalledTree:
    env = probe(serving_env.python)
    return InstalledTree(env, env.get("flashinfer-python"), REGISTRY.get("flashinfer-python"))


def test_reads_are_confined_to_record_listed_files(serving_env):
    tree = tree_of(serving_env)
    assert tree.read(COMM).data == serving_env.file(COMM).read_bytes()
    assert "not listed in flashinfer-python's RECORD" in tree.read("flashinfer/not_in_record.py").problem
    assert "not a safe relative path" in tree.read("../../../etc/passwd").problem


def test_a_symlinked_file_is_read_as_a_link(serving_env, tmp_path):
    path = serving_env.file(COMM)
    elsewhere = tmp_path / "comm.py"
    elsewhere.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(elsewhere)
    read = tree_of(serving_env).read(COMM)
    assert read.link == str(elsewhere) and read.data == elsewhere.read_bytes() and read.problem is None


def test_a_symlinked_parent_directory_is_refused(serving_env, tmp_path):
    jit = serving_env.file("flashinfer/jit")
    moved = tmp_path / "jit"
    jit.rename(moved)
    jit.symlink_to(moved)
    read = tree_of(serving_env).read(COMM)
    assert "leads outside" in read.problem


@pytest.mark.parametrize("line, pin", [
    ("flashinfer_python==0.6.3", "0.6.3"), ("flashinfer-python == 0.6.3", "0.6.3"),
    ("Flashinfer.Python[extra]===0.6.3", "0.6.3"), ("flashinfer-python (==0.6.3)", "0.6.3"),
    ('flashinfer_python==0.2.11.post3; extra == "srt"', None),  # only under a marker: not unconditional
    ("flashinfer_python>=0.6,==0.6.3", None), ("flashinfer_python>=0.6", None),
    ("flashinfer-python-cubin==0.6.3", None), ("flashinfer_python @ https://example.invalid/f.whl", None),
])
def test_only_an_unconditional_exact_pin_is_a_pin(line, pin):
    dist = InstalledDistribution(name="sglang", raw_version="0.5.9", site_dir=Path("/x"), dist_info=Path("/x/d"),
                                 record={}, requires=(line,))
    assert dist.pinned_version_of("flashinfer-python") == pin
