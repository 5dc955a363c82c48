"""`sm120patch manifest add`: a new upstream release pinned by one command, on the real wheels.
Each test works on a temporary copy of the data (SM120PATCH_DATA_DIR) from which shipped
releases are removed; adding them back must give the shipped files byte for byte."""

from __future__ import annotations

import io
import os
import shutil
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version

from helpers import record_hash, run_cli
from sm120patch.data import data_dir
from sm120patch.errors import ExitCode
from sm120patch.patchsets import parse_patch_set
from sm120patch.releases import format_versions, with_versions
from sm120patch.wheels import fetch_wheel

SHIPPED = {name: data_dir(name) for name in ("patches", "vendor-manifests")}


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def data(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "data"
    for name, source in SHIPPED.items():
        shutil.copytree(source, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setenv("SM120PATCH_DATA_DIR", str(root))
    return root


def remove(data: Path, distribution: str, version: str) -> Path:
    """Unpin ``version`` (its set keeps the others) and delete its manifest; the set's file."""
    for path in (data / "patches" / distribution).glob("[0-9]*.toml"):
        patch_set = parse_patch_set(path, distribution)
        if Version(version) in patch_set.versions:
            rest = [v for v in patch_set.versions if v != Version(version)]
            assert rest, f"{version} is alone in {path.name}: the test needs a release that shares its set"
            path.write_text(with_versions(path.read_text(), rest, path.name))
            (data / "vendor-manifests" / distribution / f"{version}.json").unlink()
            return path
    raise AssertionError(f"{distribution} {version} is not pinned")


def shipped_tree() -> dict[str, bytes]:
    return {f"{name}/{rel}": data for name, source in SHIPPED.items() for rel, data in tree(source).items()
            if "__pycache__" not in rel}


def data_tree(data: Path) -> dict[str, bytes]:
    return {f"{name}/{rel}": content for name in SHIPPED for rel, content in tree(data / name).items()}


# The newest release of each distribution and one from the middle of a layout group. (A set's
# first release cannot be removed: its file is named after it, and the registry refuses that.)
@pytest.mark.wheels
@pytest.mark.parametrize("distribution, version", [
    ("flashinfer-python", "0.6.16.post4"), ("sglang", "0.5.23"), ("vllm", "0.34.0"),
    ("sglang", "0.5.16"),
])
def test_adding_a_removed_release_back_gives_the_shipped_pin_and_manifest_byte_for_byte(data, distribution, version):
    remove(data, distribution, version)
    before = data_tree(data)
    assert before != shipped_tree()

    checked = run_cli("manifest", "add", distribution, version, "--check")
    assert checked.exit_code == ExitCode.NOT_OK, checked.output  # a pin is missing
    assert f"{distribution} {version}: would pin it to" in checked.output and "+++ b/" in checked.output
    assert data_tree(data) == before  # --check writes nothing

    added = run_cli("manifest", "add", distribution, version)
    assert added.exit_code == 0, added.output
    assert f"{distribution} {version}: pinned to {distribution}/" in added.output
    assert data_tree(data) == shipped_tree()

    again = run_cli("manifest", "add", distribution, version)
    assert again.exit_code == 0 and "already pinned by" in again.output


def as_release(source: Path, old: str, new: str, directory: Path, edits: dict[str, bytes] | None = None) -> Path:
    """The wheel ``source`` (release ``old``) rebuilt as release ``new``, as upstream would
    publish it: its .dist-info renamed, METADATA's Version: and the file name saying ``new``, the
    files in ``edits`` replaced, and RECORD listing every file with its hash."""
    import csv

    name = source.name.split("-")[0]
    old_info, new_info = f"{name}-{old}.dist-info/", f"{name}-{new}.dist-info/"
    target = directory / source.name.replace(f"-{old}-", f"-{new}-")
    rows = []
    with zipfile.ZipFile(source) as original, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as out:
        for item in original.infolist():
            path = new_info + item.filename[len(old_info):] if item.filename.startswith(old_info) else item.filename
            if path == new_info + "RECORD":
                continue
            content = (edits or {}).get(path, original.read(item))
            if path == new_info + "METADATA":
                assert f"\nVersion: {old}\n".encode() in content
                content = content.replace(f"\nVersion: {old}\n".encode(), f"\nVersion: {new}\n".encode(), 1)
            out.writestr(path, content)
            rows.append([path, record_hash(content), len(content)])
        record = io.StringIO()
        csv.writer(record, lineterminator="\n").writerows([*rows, [new_info + "RECORD", "", ""]])
        out.writestr(new_info + "RECORD", record.getvalue())
    return target


def moved_site_wheel(tmp_path: Path, version: str) -> Path:
    """SGLang 0.5.23's wheel as release ``version``, with the fusion predicate's SM100 test
    moved out of flashinfer_ar_fusion_applies() into a helper (its RECORD updated to match)."""
    source = fetch_wheel("sglang", "0.5.23")
    relpath = "sglang/srt/layers/layer_boundary/residual/add_norm.py"
    with zipfile.ZipFile(source) as original:
        text = original.read(relpath).decode()
    old = "        (_is_sm90_supported or _is_sm100_supported)\n"
    assert text.count(old) == 1
    changed = text.replace(old, "        _arch_supported()\n") + (
        "\n\ndef _arch_supported():\n    return _is_sm90_supported or _is_sm100_supported\n")
    return as_release(source, "0.5.23", version, tmp_path, {relpath: changed.encode()})


@pytest.mark.wheels
def test_a_release_whose_site_moved_is_refused_with_the_counts_and_nothing_is_written(data, tmp_path):
    wheel = moved_site_wheel(tmp_path, "0.5.24")
    before = data_tree(data)
    refused = run_cli("manifest", "add", "sglang", "0.5.24", "--wheel", str(wheel))
    assert refused.exit_code == ExitCode.REFUSED, refused.output
    lines = refused.output.splitlines()
    assert lines[0] == "sglang 0.5.24: no patch set fits; nothing was written"
    assert "  sglang/0.5.22.toml (pinned to 0.5.22 to 0.5.23):" in lines
    assert any("fusion-gate (python.extend-or-condition) in sglang/srt/layers/layer_boundary/residual/add_norm.py: "
               "expected 1 site of '_is_sm90_supported or _is_sm100_supported' in flashinfer_ar_fusion_applies(), "
               "found 0 to patch and 0 already patched" in line for line in lines), refused.output
    assert any(line.endswith("add_norm.py: changed since sglang 0.5.23, where every rewriter finds its pinned count")
               for line in lines)
    assert "sglang 0.5.24: no patch set fits (nearest: sglang/0.5.22.toml); nothing was written" in refused.output
    assert data_tree(data) == before


@pytest.mark.wheels
def test_a_set_that_fits_away_from_its_neighbours_gets_a_new_file_named_after_the_release(data, tmp_path, wheel_cache):
    # 0.5.14's bytes as a release 0.5.24: the sets of 0.5.15-0.5.23 do not fit, 0.5.14's does.
    wheel = as_release(fetch_wheel("sglang", "0.5.14", wheel_cache), "0.5.14", "0.5.24", tmp_path)
    added = run_cli("manifest", "add", "sglang", "0.5.24", "--wheel", str(wheel))
    assert added.exit_code == 0, added.output
    assert "pinned to new file 0.5.24.toml (a copy of sglang/0.5.14.toml)" in added.output
    new = data / "patches" / "sglang" / "0.5.24.toml"
    assert new.read_text() == with_versions((data / "patches/sglang/0.5.14.toml").read_text(), [Version("0.5.24")], "")
    import json

    manifest = json.loads((data / "vendor-manifests/sglang/0.5.24.json").read_text())
    shipped = json.loads((data / "vendor-manifests/sglang/0.5.14.json").read_text())
    assert manifest["files"] == shipped["files"] and manifest["patch_set"] == "sglang/0.5.24.toml"
    status = run_cli("list", "--json")
    assert status.exit_code == 0


def test_a_fixed_upstream_release_is_recorded_as_such_without_a_download(data, tmp_path):
    cache = tmp_path / "cache"
    before = data_tree(data)
    result = run_cli("manifest", "add", "flashinfer-python", "0.7.0", "--wheel-cache", str(cache))
    assert result.exit_code == 0, result.output
    assert result.output == "flashinfer-python 0.7.0: fixed upstream from 0.6.17: nothing to pin\n"
    assert not cache.exists() and data_tree(data) == before


@pytest.mark.wheels
def test_newer_asks_the_index_and_check_says_when_support_is_missing(data):
    shipped = run_cli("manifest", "add", "flashinfer-python", "--newer", "--check")
    assert shipped.exit_code == 0, shipped.output  # every newer FlashInfer is fixed upstream
    assert "flashinfer-python 0.6.17: fixed upstream from 0.6.17: nothing to pin" in shipped.output
    assert "rc" not in shipped.output.replace("nothing to pin", "")  # no pre-release is offered

    remove(data, "sglang", "0.5.23")
    before = data_tree(data)
    missing = run_cli("manifest", "add", "sglang", "--newer", "--check")
    assert missing.exit_code == ExitCode.NOT_OK, missing.output
    assert "sglang 0.5.23: would pin it to sglang/0.5.22.toml" in missing.output
    assert data_tree(data) == before
    added = run_cli("manifest", "add", "sglang", "--newer")
    assert added.exit_code == 0 and data_tree(data) == shipped_tree()


@pytest.mark.parametrize("args, message", [
    (("sglang",), "give a VERSION, or --newer"),
    (("sglang", "0.5.24", "--newer"), "give a VERSION or --newer (not both)"),
    (("sglangx", "0.5.24"), "sglangx: not a distribution sm120patch knows (flashinfer-python, sglang, vllm)"),
    (("sglang", "five"), "'five' is not a version"),
])
def test_bad_input_is_one_line(data, args, message):
    result = run_cli("manifest", "add", *args)
    assert result.exit_code == ExitCode.USAGE and message in result.output, result.output
    assert "Traceback" not in result.output


def test_a_wheel_of_another_release_is_refused(data, tmp_path):
    wheel = tmp_path / "sglang-0.5.23-py3-none-any.whl"
    wheel.write_bytes(b"")
    result = run_cli("manifest", "add", "sglang", "0.5.24", "--wheel", str(wheel))
    assert result.exit_code == ExitCode.USAGE and "not a wheel of sglang 0.5.24" in result.output


def test_every_shipped_versions_list_is_canonical():
    """What `manifest add` writes is what the files already hold, so adding rewrites one list."""
    for path in sorted(SHIPPED["patches"].glob("*/[0-9]*.toml")):
        patch_set = parse_patch_set(path, path.parent.name)
        assert with_versions(path.read_text(), patch_set.versions, path.name) == path.read_text(), path


def test_a_long_versions_list_wraps_within_the_line_with_a_trailing_comma():
    versions = [Version(f"0.{n}.0") for n in range(40)]
    text = format_versions(versions)
    lines = text.splitlines()
    assert lines[0] == "versions = [" and lines[-1] == "]" and all(len(line) <= 100 for line in lines)
    assert lines[-2].endswith(",") and text.count('"') == 80
    assert format_versions(versions[:3]) == 'versions = ["0.0.0", "0.1.0", "0.2.0"]\n'


@pytest.mark.wheels
def test_an_installed_sm120patch_is_never_changed_by_manifest_add(tmp_path, monkeypatch, wheel_cache):
    import sm120patch.data

    packaged = tmp_path / "site-packages" / "sm120patch" / "_data"
    for name, source in SHIPPED.items():
        shutil.copytree(source, packaged / name, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.delenv("SM120PATCH_DATA_DIR", raising=False)
    monkeypatch.setattr(sm120patch.data, "_PACKAGE_DATA", packaged)
    wheel = as_release(fetch_wheel("sglang", "0.5.14", wheel_cache), "0.5.14", "0.5.24", tmp_path)
    before = tree(packaged)
    result = run_cli("manifest", "add", "sglang", "0.5.24", "--wheel", str(wheel))
    assert result.exit_code == ExitCode.USAGE, result.output
    assert "runs from an installed wheel" in result.output and "SM120PATCH_DATA_DIR" in result.output
    assert tree(packaged) == before


# -- a --wheel that is not the release it claims, or not a wheel at all (issue 38) ----------------

@pytest.mark.wheels
@pytest.mark.parametrize("cut", ["truncated", "corrupt"])
def test_a_truncated_or_corrupt_wheel_is_one_line(data, tmp_path, flashinfer_wheel, cut):
    """A cut download (the end of the archive missing), or one whose bytes were damaged in the
    middle (a member's CRC no longer matches): bad input in one line, nothing written."""
    wheel = as_release(flashinfer_wheel, "0.6.4", "0.6.4.post1", tmp_path)  # a release sm120patch does not know
    content = bytearray(wheel.read_bytes())
    if cut == "truncated":
        content = content[:len(content) // 2]
    else:
        with zipfile.ZipFile(io.BytesIO(bytes(content))) as archive:
            info = archive.getinfo("flashinfer/jit/comm.py")
        start = info.header_offset + 30 + len(info.filename) + len(info.extra)
        content[start + info.compress_size // 2] ^= 0xFF
    wheel.write_bytes(bytes(content))
    before = data_tree(data)
    result = run_cli("manifest", "add", "flashinfer-python", "0.6.4.post1", "--wheel", str(wheel))
    assert result.exit_code == ExitCode.USAGE, result.output
    lines = [line for line in result.output.splitlines() if not line.startswith("hint: ")]
    assert lines == [f"sm120patch: error: {wheel}: " + lines[0].split(f"{wheel}: ", 1)[1]], result.output
    assert "not a readable wheel" in lines[0] and "truncated or damaged" in lines[0]
    assert data_tree(data) == before


def test_a_fifo_as_the_wheel_is_refused_at_once(data, tmp_path, shell):
    fifo = tmp_path / "sglang-0.5.24-py3-none-any.whl"
    os.mkfifo(fifo)
    ran = shell(f"sm120patch manifest add sglang 0.5.24 --wheel {fifo}", timeout=30)
    assert ran.returncode == ExitCode.USAGE, (ran.stdout, ran.stderr)
    assert ran.stderr == f"sm120patch: error: {fifo} is a FIFO (named pipe), not a wheel file\n"


@pytest.mark.wheels
def test_a_wheel_renamed_to_another_release_is_refused(data, tmp_path, flashinfer_wheel):
    """0.6.4's wheel renamed 0.6.4.post1: its METADATA says 0.6.4, so it is not 0.6.4.post1's,
    and no pin or manifest of 0.6.4.post1 is written from 0.6.4's bytes."""
    wheel = tmp_path / flashinfer_wheel.name.replace("0.6.4", "0.6.4.post1")
    shutil.copyfile(flashinfer_wheel, wheel)
    before = data_tree(data)
    result = run_cli("manifest", "add", "flashinfer-python", "0.6.4.post1", "--wheel", str(wheel))
    assert result.exit_code == ExitCode.USAGE, result.output
    assert result.output.splitlines()[0] == (f"sm120patch: error: {wheel}: its METADATA says flashinfer-python 0.6.4, "
                                             "its file name flashinfer-python 0.6.4.post1: a renamed wheel is not "
                                             "that release")
    assert data_tree(data) == before
