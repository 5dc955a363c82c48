"""Upgrading sm120patch over an environment an earlier sm120patch patched: the real FlashInfer
0.6.4 wheel, patched with the data of the commit before the cluster clamp (its patches/ and
vendor-manifests/ exported from git and read through SM120PATCH_DATA_DIR, which replaces both),
then looked at and patched again with today's data. Status must call it partly patched, apply
must add exactly the clamp's three files, and revert must give back the release bytes of every
file, the old patches' files too."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import (COMM, FLASHINFER_FILES, FUSION_HEADER, HEADER, LAMPORT, MNNVL, MOE_HEADER, ROOT, changed,
                     need, snapshot)
from sm120patch.errors import ExitCode
from sm120patch.hashing import sha256_file

# fb95bbc added cluster-clamp, cluster-clamp-moe and cluster-clamp-custom; its parent is the last
# commit whose data patched FlashInfer 0.6.4 without them.
BEFORE_CLAMP = "cd1a147"
OLD_FILES = (COMM, HEADER, LAMPORT, MNNVL)  # what that data's 0.6.4 set writes
CLAMP_FILES = (FUSION_HEADER, MOE_HEADER, HEADER)  # what the clamp adds (HEADER: pdl-gates' file)
CLAMP_IDS = ("cluster-clamp", "cluster-clamp-moe", "cluster-clamp-custom")


@pytest.fixture(scope="module")
def old_data(tmp_path_factory) -> Path:
    """patches/ and vendor-manifests/ as they were at BEFORE_CLAMP."""
    need(shutil.which("git") is not None and (ROOT / ".git").exists(), "needs git and this checkout's history")
    found = subprocess.run(["git", "cat-file", "-e", f"{BEFORE_CLAMP}^{{commit}}"], cwd=ROOT, capture_output=True)
    need(found.returncode == 0, f"commit {BEFORE_CLAMP} is not in this clone (shallow?)")
    root = tmp_path_factory.mktemp("data-before-clamp")
    archive = subprocess.run(["git", "archive", BEFORE_CLAMP, "patches", "vendor-manifests"], cwd=ROOT,
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    old_set = (root / "patches" / "flashinfer-python").glob("*.toml")
    assert not any("cluster-clamp" in path.read_text() for path in old_set)  # the data really is the old one
    return root


def states(result) -> tuple[str, dict[str, str]]:
    doc = json.loads(result.output)
    flashinfer = next(d for d in doc["distributions"] if d["name"] == "flashinfer-python")
    return flashinfer["state"], {p["id"]: p["state"] for p in flashinfer["patches"]}


def manifest_patched(version: str = "0.6.4") -> dict[str, str]:
    """Today's manifest: each patched file's sha256 with every patch of the file applied (the
    manifest keys a file's hashes by the patches applied to it, joined by '+')."""
    doc = json.loads((ROOT / "vendor-manifests" / "flashinfer-python" / f"{version}.json").read_text())
    return {path: max(entry["patched"].items(), key=lambda item: item[0].count("+"))[1]
            for path, entry in doc["files"].items() if entry.get("patched")}


def test_an_environment_patched_before_the_clamp_is_partly_patched_and_apply_adds_the_clamp(
        sm120patch, serving_env, old_data, monkeypatch):
    site = serving_env.site_packages
    before = snapshot(serving_env)

    # The earlier sm120patch's apply (its data; the code reads no other version of it).
    monkeypatch.setenv("SM120PATCH_DATA_DIR", str(old_data))
    old = sm120patch("apply", "--flashinfer")
    assert old.exit_code == 0, old.output
    assert "flashinfer-python 0.6.4: patched 4 files" in old.output
    assert {p for p in changed(before, snapshot(serving_env)) if ".sm120patch" not in p} == {
        f"{site}/{rel}" for rel in OLD_FILES}
    old_status = sm120patch("status", "--flashinfer", "--json")
    assert old_status.exit_code == ExitCode.OK and states(old_status)[0] == "patched", old_status.output

    # Today's data.
    monkeypatch.delenv("SM120PATCH_DATA_DIR")
    after_old = snapshot(serving_env)
    status = sm120patch("status", "--flashinfer", "--json")
    assert status.exit_code == ExitCode.NOT_OK, status.output
    state, patches = states(status)
    assert state == "partly patched"
    assert patches == {"jit-gate": "applied", "pdl-gates": "applied", "lamport-stride": "applied",
                       "unicast-workspace": "applied", **{pid: "pristine" for pid in CLAMP_IDS}}
    text = sm120patch("status", "--flashinfer")
    assert "flashinfer-python 0.6.4: partly patched" in text.output, text.output
    assert snapshot(serving_env) == after_old  # status changes nothing

    applied = sm120patch("apply", "--flashinfer")
    assert applied.exit_code == 0, applied.output
    assert "flashinfer-python 0.6.4: patched 3 files" in applied.output, applied.output
    for rel in CLAMP_FILES:
        assert rel in applied.output
    # Exactly the clamp's three files changed; the old patches' other files are left as they were.
    assert {p for p in changed(after_old, snapshot(serving_env)) if ".sm120patch" not in p} == {
        f"{site}/{rel}" for rel in CLAMP_FILES}
    # And every file now has the bytes a fresh apply of today's data gives (the manifest's).
    pinned = manifest_patched()
    assert sorted(pinned) == sorted(FLASHINFER_FILES)
    for rel in FLASHINFER_FILES:
        assert sha256_file(serving_env.file(rel)) == pinned[rel], rel
    done = sm120patch("status", "--flashinfer", "--json")
    assert done.exit_code == ExitCode.OK, done.output
    assert states(done) == ("patched", {pid: "applied" for pid in patches})

    # Revert: the release bytes of all six files (RECORD hashes), and nothing of sm120patch left.
    reverted = sm120patch("revert", "--flashinfer")
    assert reverted.exit_code == 0, reverted.output
    assert "restored 6 files" in reverted.output, reverted.output
    assert serving_env.record_mismatches() == []
    assert snapshot(serving_env) == before
