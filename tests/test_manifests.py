"""Vendor manifests: rebuilt from the real wheels by our builder, byte-identical to the
committed files; and consistent with the wheels' own RECORD."""

from __future__ import annotations

import zipfile

import pytest
from packaging.version import Version

from sm120patch.errors import PatchDataError
from sm120patch.manifests import build_manifest, load_manifest, manifest_path
from sm120patch.manifests import manifest_text
from sm120patch.distributions import load_registry
from sm120patch.wheels import fetch_wheel


@pytest.mark.parametrize("name, version, wheel_fixture", [
    ("flashinfer-python", "0.6.4", "flashinfer_wheel"),
    ("sglang", "0.5.9", "sglang_wheel"),
    ("vllm", "0.17.0", None),  # a ~430 MB wheel, also the matrix's representative of its layout
])
def test_rebuilt_manifest_is_byte_identical(request, name, version, wheel_fixture):
    wheel = request.getfixturevalue(wheel_fixture) if wheel_fixture else fetch_wheel(name, version)
    patch_set = load_registry().get(name).find(Version(version))
    assert manifest_text(build_manifest(wheel, patch_set)) == manifest_path(name, version).read_text()


def test_manifest_lists_pristine_and_patched_hashes():
    manifest = load_manifest("flashinfer-python", "0.6.4")
    comm = manifest.files["flashinfer/jit/comm.py"]
    assert comm.pristine.startswith("b0ec8d47")
    assert set(comm.patched) == {"jit-gate"} and comm.patched["jit-gate"] != comm.pristine
    assert manifest.files["flashinfer/data/include/flashinfer/comm/trtllm_allreduce.cuh"].pristine.startswith("a012a51b")


def test_a_wheel_whose_file_does_not_match_its_record_is_refused(tmp_path, flashinfer_wheel):
    tampered = tmp_path / flashinfer_wheel.name
    with zipfile.ZipFile(flashinfer_wheel) as src, zipfile.ZipFile(tampered, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename == "flashinfer/jit/comm.py":
                data += b"\n"
            dst.writestr(item, data)
    patch_set = load_registry().get("flashinfer-python").find(Version("0.6.4"))
    with pytest.raises(PatchDataError, match="does not match the wheel's RECORD"):
        build_manifest(tampered, patch_set)


def test_a_wheel_of_another_release_is_refused(sglang_wheel):
    patch_set = load_registry().get("flashinfer-python").find(Version("0.6.4"))
    with pytest.raises(PatchDataError, match="is not pinned by"):
        build_manifest(sglang_wheel, patch_set)


@pytest.mark.parametrize("name, version", [("flashinfer-python", "0.6.12"), ("sglang", "0.5.21")])
def test_a_sample_rebuilt_from_freshly_downloaded_wheels_is_byte_identical(tmp_path, name, version):
    """Not from the shared cache: a new download from the package index."""
    wheel = fetch_wheel(name, version, tmp_path)
    patch_set = load_registry().get(name).find(Version(version))
    assert manifest_text(build_manifest(wheel, patch_set)) == manifest_path(name, version).read_text()


def test_every_pinned_release_has_a_manifest_for_every_file():
    for patch_set in load_registry().patch_sets:
        for version in patch_set.versions:
            manifest = load_manifest(patch_set.distribution, str(version))
            assert manifest is not None, (patch_set.distribution, version)
            assert set(manifest.files) == set(patch_set.files)


def test_manifest_build_check_through_the_cli(wheel_cache, tmp_path):
    """`sm120patch manifest build --check` over every pinned release of a distribution: exit 0,
    one `ok` line each; an unknown distribution is bad input; written elsewhere, the same bytes."""
    from helpers import run_cli

    # One distribution's 40 releases: every other release's manifest is checked against its
    # wheel by test_matrix.py's test_every_release_takes_its_set_by_meaning; `make
    # check-manifests` runs the command over all of them (vLLM's 34 wheels are ~13 GB).
    ok = run_cli("manifest", "build", "--check", "--wheel-cache", str(wheel_cache), "--distribution", "flashinfer-python")
    assert ok.exit_code == 0, ok.output
    lines = ok.stdout.splitlines()  # progress lines go to stderr
    registry = load_registry()
    assert len(lines) == sum(len(ps.versions) for ps in registry.get("flashinfer-python").patch_sets)
    assert all(line.startswith("ok") for line in lines)
    unknown = run_cli("manifest", "build", "--check", "--distribution", "vllm-nightly")
    assert unknown.exit_code == 2 and "not a distribution sm120patch knows" in unknown.output
    out = tmp_path / "manifests"
    written = run_cli("manifest", "build", "--wheel-cache", str(wheel_cache), "--out", str(out),
                      "--distribution", "flashinfer-python")  # what --check read, now written elsewhere
    assert written.exit_code == 0
    target = out / "flashinfer-python" / "0.6.4.json"
    assert target.read_text() == manifest_path("flashinfer-python", "0.6.4").read_text()
