"""Every release in the support list, installed from its real wheel into a throwaway venv:
apply (with every opt-in patch) -> semantic checks -> revert, with every RECORD hash equal after.
Wheels are downloaded once into the shared cache (~/.cache/sm120patch/wheels)."""

from __future__ import annotations

import re

import json
import os
import zipfile

import pytest
from packaging.version import Version

from helpers import ServingEnv, Session, make_venv
from sm120patch.errors import ExitCode
from sm120patch.distributions import load_registry
from sm120patch.hashing import sha256
from sm120patch.manifests import combination_key, load_manifest
from sm120patch.edits import apply_edits
from sm120patch.semantics import CHECKS, unbound_names
from sm120patch.wheels import fetch_wheel

REGISTRY = load_registry(full=False)
# CI installs the first release of each patch set (one per file layout) and each distribution's
# newest into a throwaway venv and runs the whole CLI round trip on it; every other release's
# bytes are covered without a venv (test_every_release_takes_its_set_by_meaning, and
# test_manifests rebuilding every manifest from its wheel). `make matrix`
# (SM120PATCH_FULL_MATRIX=1) installs every release (vLLM: 34 wheels, ~13 GB).
FULL = os.environ.get("SM120PATCH_FULL_MATRIX") == "1"


def _representative(ps, version) -> bool:
    newest = max(v for s in REGISTRY.get(ps.distribution).patch_sets for v in s.versions)
    return FULL or version in (min(ps.versions), newest)


RELEASES = [(ps.distribution, str(v)) for ps in REGISTRY.patch_sets for v in sorted(ps.versions) if _representative(ps, v)]
# Every other release whose wheel is small enough to fetch in CI (vLLM's are ~400 MB: the
# representative ones only): the representative ones are installed, and their round trip
# checks the same by meaning on the installed bytes (the rewriters' work, done once).
EVERY = [(ps.distribution, str(v)) for ps in REGISTRY.patch_sets for v in sorted(ps.versions)
         if ps.distribution != "vllm" and not _representative(ps, v)]


# The fully patched bytes' sha256 of each (release bytes, patches) already checked in this run:
# most of the (release, file) pairs below hold bytes another release has too (255 pairs, 73
# distinct), and the same edits on the same bytes give the same bytes, checks and names.
CHECKED: dict[tuple[str, tuple[str, ...]], str] = {}


@pytest.mark.parametrize("name, version", EVERY, ids=[f"{n}-{v}" for n, v in EVERY])
def test_every_release_takes_its_set_by_meaning(wheel_cache, name, version):
    """The release's own files from its wheel, every patch of its set applied (opt-in ones too):
    each patch's semantic check fails before and passes after, what a patch uses, the module
    binds, and both the release's bytes and the fully patched ones are those its shipped
    manifest vouches for (`make check-manifests` rebuilds every manifest through the CLI). The
    releases of RELEASES: test_release_applies_and_reverts_exactly checks the same."""
    patch_set = load_registry().get(name).find(Version(version))
    manifest = load_manifest(name, version)
    with zipfile.ZipFile(fetch_wheel(name, version, wheel_cache)) as wheel:
        for relpath in patch_set.files:
            pristine = wheel.read(relpath)
            hashes = manifest.files[relpath]
            assert hashes.pristine == sha256(pristine), f"{relpath}: not the bytes the manifest names"
            key = (sha256(pristine), tuple(p.id for p in patch_set.patches_for(relpath)))
            if key in CHECKED:  # these bytes, these patches: checked for another release
                assert hashes.combination_of(CHECKED[key]) == combination_key(patch_set.patches_for(relpath)), relpath
                continue
            patched = apply_edits(pristine, patch_set.patches_for(relpath), where=f"{name} {version}")
            assert hashes.combination_of(sha256(patched)) == combination_key(patch_set.patches_for(relpath)), relpath
            for patch in patch_set.patches_for(relpath):
                assert CHECKS[patch.check](pristine.decode())[0] is False, f"{patch.id} already in {relpath}"
                ok, detail = CHECKS[patch.check](patched.decode())
                assert ok, f"{patch.id}: {detail}"
            if relpath.endswith(".py"):
                assert set(unbound_names(patched.decode())) <= set(unbound_names(pristine.decode())), relpath
            CHECKED[key] = sha256(patched)


@pytest.fixture
def fresh_env(tmp_path):
    def make(*wheels) -> ServingEnv:
        root = tmp_path / "venv"
        make_venv(root, list(wheels))
        (tmp_path / "home").mkdir()
        return ServingEnv(root, tmp_path / "home")

    return make


@pytest.mark.parametrize("name, version", RELEASES, ids=[f"{n}-{v}" for n, v in RELEASES])
def test_release_applies_and_reverts_exactly(fresh_env, wheel_cache, name, version):
    env = fresh_env(fetch_wheel(name, version, wheel_cache))
    session = Session(env)
    patch_set = REGISTRY.get(name).find(Version(version))
    selector = f"--{REGISTRY.get(name).option}"
    opt_in = ",".join(p.id for p in patch_set.patches if not p.required)
    pristine = {f: env.file(f).read_text() for f in patch_set.files}
    # What test_every_release_takes_its_set_by_meaning checks of the other releases: the installed
    # bytes are those the shipped manifest names, each patch's check fails on them...
    manifest = load_manifest(name, version)
    for relpath in patch_set.files:
        assert manifest.files[relpath].pristine == sha256(env.file(relpath).read_bytes()), relpath
    for patch in patch_set.patches:
        assert CHECKS[patch.check](pristine[patch.file])[0] is False, f"{patch.id} already in {patch.file}"

    status = session("status")
    # A set of opt-in patches only (vLLM 0.29+) requires nothing: pristine is a done state.
    requires = any(p.required for p in patch_set.patches)
    assert status.exit_code == (ExitCode.NOT_OK if requires else ExitCode.OK), status.output
    assert requires or "nothing required (opt-in patches only)" in status.output
    auto_enables = any(a.level == "warn" for a in REGISTRY.get(name).advice_for(Version(version)))
    assert ("turns fusion on by itself on SM120" in status.output) == auto_enables
    applied = session("apply", selector, version, *(["--with", opt_in] if opt_in else []))
    assert applied.exit_code == 0, applied.output
    for relpath in patch_set.files:  # ...and every patch of the set applied, the manifest vouches for the bytes
        combination = manifest.files[relpath].combination_of(sha256(env.file(relpath).read_bytes()))
        assert combination == combination_key(patch_set.patches_for(relpath)), relpath
    for patch in patch_set.patches:
        text = env.file(patch.file).read_text()
        ok, detail = CHECKS[patch.check](text)
        assert ok, f"{patch.id}: {detail}"
        if patch.file.endswith(".py"):  # what the patch uses, the module binds
            assert set(unbound_names(text)) <= set(unbound_names(pristine[patch.file])), patch.id
    status = session("status", "--json")
    assert status.exit_code == ExitCode.OK, status.output
    assert {p["state"] for d in json.loads(status.output)["distributions"] for p in d["patches"]} == {"applied"}
    assert session("apply", selector, version, *(["--with", opt_in] if opt_in else [])).output.count("nothing to change") == 1

    reverted = session("revert")
    assert reverted.exit_code == 0, reverted.output
    assert env.record_mismatches() == []


def test_fixed_upstream_release_is_recognised(fresh_env, wheel_cache):
    env = fresh_env(fetch_wheel("flashinfer-python", "0.6.17", wheel_cache))
    session = Session(env)
    status = session("status")
    assert status.exit_code == ExitCode.OK
    assert "flashinfer-python 0.6.17: fixed upstream" in status.output
    assert "supports SM120 here natively (fixed upstream in 0.6.17)" in status.output
    assert "trtllm_mnnvl_comm is [9, 10]" in status.output  # what stays gated even there
    applied = session("apply")
    assert applied.exit_code == 0
    assert "nothing to do" in applied.output and "natively" in applied.output
    assert env.record_mismatches() == []


def test_a_local_build_with_an_unknown_version(fresh_env, wheel_cache):
    """A build from a checkout reports '0.6.16.post4+local': no set pins it. Refused with the
    nearest known releases; --force applies the closest set by meaning, shows the diff, records
    it as unpinned; revert restores the build's own bytes."""
    env = fresh_env(fetch_wheel("flashinfer-python", "0.6.16.post4", wheel_cache))
    dist_info = next(env.site_packages.glob("flashinfer_python-*.dist-info"))
    metadata = dist_info / "METADATA"
    metadata.write_text(metadata.read_text().replace("Version: 0.6.16.post4", "Version: 0.6.16.post4+local", 1))
    session = Session(env)

    refused = session("apply")
    assert refused.exit_code == ExitCode.REFUSED
    assert "no patch set is pinned to flashinfer-python 0.6.16.post4+local" in refused.output
    assert "nearest known below: 0.6.16.post4" in refused.output and "--force" in refused.output

    forced = session("apply", "--force")
    assert forced.exit_code == 0, forced.output
    assert "applied flashinfer-python/0.6.15.toml by meaning (--force), recorded as unpinned" in forced.output
    assert "+        supported_major_versions=[9, 10, 12]" in forced.output
    status = session("status")
    assert "unpinned: no patch set pins 0.6.16.post4+local" in status.output
    assert re.search(r"jit-gate +applied", status.output)

    assert session("revert").exit_code == 0
    assert env.record_mismatches() == [f"{dist_info.name}/METADATA"]  # the test's own edit, nothing else
