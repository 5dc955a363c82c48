"""`sm120patch manifest add`: a new upstream release pinned by one command, on the real wheels.
Each test works on a temporary copy of the data (SM120PATCH_DATA_DIR) from which shipped
releases are removed; adding them back must give the shipped files byte for byte."""

from __future__ import annotations

import io
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
    ("flashinfer-python", "0.6.16.post4"), ("sglang", "0.5.23"), ("vllm", "0.33.0"),
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


def moved_site_wheel(tmp_path: Path, version: str) -> Path:
    """SGLang 0.5.23's wheel as release ``version``, with the fusion predicate's SM100 test
    moved out of flashinfer_ar_fusion_applies() into a helper (its RECORD updated to match)."""
    source = fetch_wheel("sglang", "0.5.23")
    relpath = "sglang/srt/layers/layer_boundary/residual/add_norm.py"
    target = tmp_path / source.name.replace("0.5.23", version)
    with zipfile.ZipFile(source) as original, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as out:
        text = original.read(relpath).decode()
        old = "        (_is_sm90_supported or _is_sm100_supported)\n"
        assert text.count(old) == 1
        changed = text.replace(old, "        _arch_supported()\n") + (
            "\n\ndef _arch_supported():\n    return _is_sm90_supported or _is_sm100_supported\n")
        digest = record_hash(changed.encode())
        for item in original.infolist():
            content = original.read(item)
            if item.filename == relpath:
                content = changed.encode()
            elif item.filename.endswith(".dist-info/RECORD"):
                lines = io.StringIO(content.decode()).read().splitlines()
                content = "\n".join(f"{relpath},{digest},{len(changed.encode())}" if line.startswith(relpath + ",")
                                    else line for line in lines).encode() + b"\n"
            out.writestr(item, content)
    return target


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
               "expected 1 site(s) of '_is_sm90_supported or _is_sm100_supported' in flashinfer_ar_fusion_applies(), "
               "found 0 to patch and 0 already patched" in line for line in lines), refused.output
    assert any(line.endswith("add_norm.py: changed since sglang 0.5.23, where every rewriter finds its pinned count")
               for line in lines)
    assert "sglang 0.5.24: no patch set fits (nearest: sglang/0.5.22.toml); nothing was written" in refused.output
    assert data_tree(data) == before


@pytest.mark.wheels
def test_a_set_that_fits_away_from_its_neighbours_gets_a_new_file_named_after_the_release(data, tmp_path, wheel_cache):
    # 0.5.14's bytes as a release 0.5.24: the sets of 0.5.15-0.5.23 do not fit, 0.5.14's does.
    source = fetch_wheel("sglang", "0.5.14", wheel_cache)
    wheel = tmp_path / source.name.replace("0.5.14", "0.5.24")
    shutil.copyfile(source, wheel)
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
    source = fetch_wheel("sglang", "0.5.14", wheel_cache)
    wheel = tmp_path / source.name.replace("0.5.14", "0.5.24")
    shutil.copyfile(source, wheel)
    before = tree(packaged)
    result = run_cli("manifest", "add", "sglang", "0.5.24", "--wheel", str(wheel))
    assert result.exit_code == ExitCode.USAGE, result.output
    assert "runs from an installed wheel" in result.output and "SM120PATCH_DATA_DIR" in result.output
    assert tree(packaged) == before
