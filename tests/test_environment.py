"""Locating the target: the probe runs in the target interpreter; a bad --python is one clear
error; an install is identified by its .dist-info, and its files are read only where RECORD says."""

from __future__ import annotations

import csv
import io
import sys
from pathlib import Path

import pytest

from helpers import COMM, FLASHINFER_FILES
from sm120patch.distributions import load_registry
from sm120patch.environment import InstalledDistribution, parse_record_hash, record_rows, resolve_python, start_probe
from sm120patch.errors import TargetError
from sm120patch.patchsets import normalize_relpath
from sm120patch.installed import InstalledTree

REGISTRY = load_registry(full=False)


def probe(python=None):
    return start_probe(python, REGISTRY.names).result(REGISTRY.wanted_rows)


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
    assert set(flashinfer.record) == set(FLASHINFER_FILES)
    assert env.get("sglang").pinned_version_of("flashinfer-python") == "0.6.3"
    assert env.get("flashinfer-jit-cache") is None
    tree = InstalledTree(env, flashinfer, REGISTRY.get("flashinfer-python"))
    assert tree.state.root == serving_env.site_packages / ".sm120patch" / flashinfer.dist_info.name


def test_a_distribution_asked_for_in_any_spelling_is_found_under_its_normalized_name(read_only_env):
    env = start_probe(read_only_env.python, ["FlashInfer_Python", "SGLang"]).result()
    assert env.get("flashinfer-python").raw_version == "0.6.4" and env.get("sglang") is not None


def test_a_relative_python_path_is_the_venv_not_its_base_interpreter(read_only_env, monkeypatch):
    monkeypatch.chdir(read_only_env.root)
    env = probe("bin/python")
    assert env.prefix == read_only_env.root
    assert env.get("flashinfer-python") is not None


def test_a_bare_name_is_looked_up_on_path_like_a_shell_does(read_only_env, monkeypatch):
    monkeypatch.setenv("PATH", f"{read_only_env.root / 'bin'}:/usr/bin:/bin")
    assert resolve_python("python") == str(read_only_env.root / "bin" / "python")
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


def test_reads_are_confined_to_record_listed_files(read_only_env):
    tree = tree_of(read_only_env)
    assert tree.read(COMM).data == read_only_env.file(COMM).read_bytes()
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


RECORD = (
    'vllm/__init__.py,sha256=47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU,0\r\n'
    '"vllm/configs/E=1,N=14336.json",sha256=47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU,12\r\n'
    'x/vllm/__init__.py,,\r\n'
    'vllm/config/vllm.py,sha256=47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU,7\r\n'
    'vllm-0.19.0.dist-info/RECORD,,'
)


def test_record_rows_are_the_csv_modules_rows_of_the_wanted_files():
    wanted = ["vllm/__init__.py", "vllm/configs/E=1,N=14336.json", "vllm/config/vllm.py", "vllm-0.19.0.dist-info/RECORD",
              "vllm/missing.py"]
    rows = record_rows(RECORD.encode(), wanted)
    expected = {row[0]: row for row in csv.reader(io.StringIO(RECORD)) if row[0] in wanted}
    assert sorted(rows) == sorted(expected)  # first line, quoted path, last line without newline; not x/vllm/...
    for path, (_, hash_value, size) in expected.items():
        assert rows[path].sha256 == (parse_record_hash(hash_value) if hash_value else None)
        assert rows[path].size == (int(size) if size else None)
    assert set(record_rows(RECORD.encode(), suffixes=["/__init__.py"])) == {"vllm/__init__.py", "x/vllm/__init__.py"}


def test_metadata_only_importlib_metadata_can_read_is_found_too(tmp_path, monkeypatch):
    # An .egg-info (a legacy `setup.py develop`): the probe falls back to importlib.metadata.
    (tmp_path / "vllm-0.19.0-py3.11.egg-info").mkdir()
    (tmp_path / "vllm-0.19.0-py3.11.egg-info" / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.19.0\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    vllm = probe().get("vllm")
    assert (vllm.raw_version, vllm.has_record, vllm.record) == ("0.19.0", False, {})


def test_a_dist_info_is_read_by_sm120patch_itself(tmp_path, monkeypatch):
    dist_info = tmp_path / "vllm-0.19.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: vLLM\nVersion: 0.19.0\n"
                                        "Requires-Dist: flashinfer-python==0.6.4\n\nlong description\n")
    (dist_info / "RECORD").write_text(RECORD.replace("\r\n", "\n"))
    (dist_info / "direct_url.json").write_text("{not json")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    vllm = probe().get("vllm")
    assert (vllm.raw_version, vllm.dist_info, vllm.site_dir) == ("0.19.0", dist_info, tmp_path)
    # Only the rows of the files 0.19.0's patch set touches (this RECORD lists one of them).
    assert "vllm/config/vllm.py" in REGISTRY.get("vllm").files_for("0.19.0") and list(vllm.record) == ["vllm/config/vllm.py"]
    assert vllm.record["vllm/config/vllm.py"].size == 7 and vllm.pinned_version_of("flashinfer-python") == "0.6.4"
    assert vllm.direct_url is None and not vllm.editable  # unreadable direct_url.json: not known to be editable
    (dist_info / "RECORD").unlink()
    assert probe().get("vllm").has_record is False
