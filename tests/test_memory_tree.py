"""The planner against the tree interface alone: a FlashInfer release's real files held in memory
(tests/memory_tree.py) are assessed, planned, patched and reverted exactly as an install is, with
no environment, no RECORD, no state directory and no writer of sm120patch's."""

from __future__ import annotations

import zipfile

from sm120patch.assess import State, Verdict, assess
from sm120patch.distributions import load_registry
from sm120patch.hashing import sha256
from sm120patch.manifests import combination_key, load_manifest
from sm120patch.plan import plan_apply, plan_revert

from helpers import FLASHINFER_VERSION
from memory_tree import MemoryTree


def _tree(flashinfer_wheel) -> MemoryTree:
    distribution = load_registry().get("flashinfer-python")
    manifest = load_manifest(distribution.name, FLASHINFER_VERSION)
    with zipfile.ZipFile(flashinfer_wheel) as archive:
        files = {relpath: archive.read(relpath) for relpath in manifest.files}
    return MemoryTree(distribution, FLASHINFER_VERSION, files,
                      {relpath: hashes.pristine for relpath, hashes in manifest.files.items()})


def test_a_tree_in_memory_is_patched_and_reverted_through_the_planner(flashinfer_wheel):
    tree = _tree(flashinfer_wheel)
    released = dict(tree.files)
    pristine = assess(tree, tree.distribution, ledger=tree.read_ledger())
    assert pristine.verdict is Verdict.NOT_PATCHED
    assert {fa.state for fa in pristine.files.values()} == {State.PRISTINE}

    selected = pristine.patch_set.select()
    tree.write(plan_apply(pristine, selected))
    patched = assess(tree, tree.distribution, ledger=tree.read_ledger())
    assert patched.verdict is Verdict.PATCHED
    # Every file now holds the manifest's patched bytes for the patches it carries.
    manifest = pristine.manifest
    for relpath, data in tree.files.items():
        wanted = [p for p in selected if p.file == relpath]
        expected = manifest.files[relpath].patched[combination_key(wanted)] if wanted else manifest.files[relpath].pristine
        assert sha256(data) == expected, relpath
    assert tree.ledger is not None and set(tree.originals) == {p.file for p in selected}

    again = plan_apply(patched, selected)
    assert again.empty  # a second apply plans nothing

    tree.write(plan_revert(patched))
    assert tree.files == released and tree.ledger is None and not tree.originals
    assert assess(tree, tree.distribution, ledger=None).verdict is Verdict.NOT_PATCHED


def test_a_file_changed_by_hand_is_refused_by_the_planner(flashinfer_wheel):
    import pytest

    from sm120patch.errors import RefusedError

    tree = _tree(flashinfer_wheel)
    relpath = next(iter(tree.files))
    tree.files[relpath] += b"\n# edited by hand\n"
    drifted = assess(tree, tree.distribution, ledger=None)
    assert drifted.files[relpath].state is State.DRIFTED
    with pytest.raises(RefusedError, match="is not the 0.6.4 release's bytes"):
        plan_apply(drifted, drifted.patch_set.select())
