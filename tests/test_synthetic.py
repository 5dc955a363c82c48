"""Fast tests of the whole pipeline on a small synthetic distribution, no real wheels: a
third distribution ("toyfuse") added as data alone (a distribution.toml and a patch set beside
the shipped ones), a wheel made here, its manifest built by sm120patch's own builder, and an
install that is a bare venv's site-packages with a RECORD. `make check` runs these."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from helpers import changed, tree_snapshot
from sm120patch import changes, pipeline
from sm120patch.assess import Verdict
from sm120patch.distributions import load_registry
from sm120patch.errors import ExitCode, RefusedError, UsageError
from sm120patch.render import render_change, render_status
from toy import SOURCE, make_data, make_install, make_wheel

@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """The shipped data plus toyfuse, as SM120PATCH_DATA_DIR sees it."""
    return make_data(tmp_path_factory.mktemp("data"), tmp_path_factory.mktemp("wheels"))


@pytest.fixture
def toy(data_dir, tmp_path, monkeypatch):
    """A bare venv with toyfuse 1.0 unpacked into its site-packages, as an installer would."""
    monkeypatch.setenv("SM120PATCH_DATA_DIR", str(data_dir))
    venv = tmp_path / "venv"
    site = make_install(venv, [make_wheel(tmp_path, "1.0")])
    home = tmp_path / "home"
    home.mkdir()
    return Toy(venv, site, home, load_registry(data_dir / "patches"))


class Toy:
    def __init__(self, venv: Path, site: Path, home: Path, registry) -> None:
        self.venv, self.site, self.home, self.registry = venv, site, home, registry

    def request(self, **kwargs) -> pipeline.Request:
        return pipeline.Request(python=str(self.venv / "bin" / "python"), selectors={"toyfuse": pipeline.ANY},
                                jit_base=str(self.home), **kwargs)

    def snapshot(self) -> dict:
        return tree_snapshot(self.venv, self.home)


def test_a_third_distribution_is_data_alone(toy):
    assert toy.registry.names == ("flashinfer-python", "sglang", "toyfuse", "vllm")
    report = pipeline.status(toy.request(), toy.registry)
    (item,) = report.trees
    assert item.assessment.verdict is Verdict.NOT_PATCHED and report.exit_code == ExitCode.NOT_OK
    assert [a.render("1.0") for a in item.advice] == ["toyfuse 1.0 is made up for the tests"]
    assert item.jit is not None and item.jit.entries == []


def test_apply_status_revert_round_trip(toy):
    before = toy.snapshot()
    entry = toy.home / ".cache" / "flashinfer" / "1.0" / "120a" / "cached_ops" / "toy_comm"
    entry.mkdir(parents=True)
    (entry / "toy_comm.so").write_bytes(b"\x7fELF")
    applied = changes.apply(toy.request(), toy.registry)
    assert applied.exit_code == ExitCode.OK and applied.jit_removed == [entry] and not entry.exists()
    assert "[9, 10, 12]" in (toy.site / "toyfuse" / "comm.py").read_text()
    assert pipeline.status(toy.request(), toy.registry).exit_code == ExitCode.OK
    again = changes.apply(toy.request(), toy.registry)
    assert not again.changed
    reverted = changes.revert(toy.request(), toy.registry)
    assert reverted.exit_code == ExitCode.OK
    shutil.rmtree(toy.home / ".cache")  # the seeded entry went, as it should; FlashInfer's lock dir too
    assert changed(before, toy.snapshot()) == []


def test_dry_run_changes_nothing_and_plans_the_diff(toy):
    before = toy.snapshot()
    report = changes.apply(toy.request(dry_run=True), toy.registry)
    (result,) = report.results
    assert "+        supported_major_versions=[9, 10, 12]," in result.plan.files[0].diff("toyfuse/comm.py")
    assert changed(before, toy.snapshot()) == []


def test_a_hand_edit_is_drift_refused_then_forced_and_reverted(toy):
    comm = toy.site / "toyfuse" / "comm.py"
    comm.write_text("# tuned\n" + SOURCE)
    before = toy.snapshot()
    with pytest.raises(RefusedError, match="is not the 1.0 release's bytes"):
        changes.apply(toy.request(), toy.registry)
    assert changed(before, toy.snapshot()) == []
    assert re.search(r"jit-gate +drifted", render_status(pipeline.status(toy.request(), toy.registry)))
    forced = changes.apply(toy.request(force=True), toy.registry)
    assert forced.exit_code == ExitCode.OK
    assert comm.read_text().startswith("# tuned\n") and "[9, 10, 12]" in comm.read_text()
    # --force wants the release's bytes, and nothing here has them (no wheel): said, not done.
    left = changes.revert(toy.request(force=True), toy.registry)
    assert left.exit_code == ExitCode.REFUSED and "pass --wheel-dir" in left.left[0].error.hint
    assert "[9, 10, 12]" in comm.read_text()
    # Plain revert puts back what sm120patch replaced: the hand edit.
    assert changes.revert(toy.request(), toy.registry).exit_code == ExitCode.OK
    assert changed(before, toy.snapshot()) == []


def test_a_version_selector_must_match(toy):
    with pytest.raises(UsageError, match="--toyfuse 1.1: .* has toyfuse 1.0"):
        pipeline.status(pipeline.Request(python=str(toy.venv / "bin" / "python"), selectors={"toyfuse": "1.1"}),
                        toy.registry)


def test_an_unknown_release_is_refused_with_the_nearest(toy):
    metadata = toy.site / "toyfuse-1.0.dist-info" / "METADATA"
    metadata.write_text(metadata.read_text().replace("Version: 1.0", "Version: 1.0.5"))
    (toy.site / "toyfuse-1.0.dist-info").rename(toy.site / "toyfuse-1.0.5.dist-info")
    with pytest.raises(RefusedError, match="no patch set is pinned to toyfuse 1.0.5"):
        changes.apply(toy.request(), toy.registry)


def test_fixed_upstream_is_told_from_data(toy):
    metadata = toy.site / "toyfuse-1.0.dist-info" / "METADATA"
    metadata.write_text(metadata.read_text().replace("Version: 1.0", "Version: 2.0"))
    report = pipeline.status(toy.request(), toy.registry)
    assert report.trees[0].assessment.verdict is Verdict.FIXED_UPSTREAM and report.exit_code == ExitCode.OK


def test_a_second_apply_touches_nothing(toy):
    assert changes.apply(toy.request(), toy.registry).exit_code == ExitCode.OK
    comm = toy.site / "toyfuse" / "comm.py"
    before, mtime = toy.snapshot(), comm.stat().st_mtime_ns
    again = changes.apply(toy.request(), toy.registry)
    assert again.exit_code == ExitCode.OK and not again.changed
    assert "nothing to change (already patched)" in render_change(again)
    assert changed(before, toy.snapshot()) == [] and comm.stat().st_mtime_ns == mtime


def test_a_forced_apply_still_needs_every_site(toy):
    """--force patches by meaning, never by guess: a file the rewriter finds no site in is
    refused even forced, and nothing is written."""
    comm = toy.site / "toyfuse" / "comm.py"
    comm.write_text(SOURCE.replace("supported_major_versions", "majors"))
    before = toy.snapshot()
    with pytest.raises(RefusedError, match=r"expected 1 site "):
        changes.apply(toy.request(force=True), toy.registry)
    assert changed(before, toy.snapshot()) == []


def test_a_file_edited_after_patching_is_not_reverted_unless_forced(toy):
    assert changes.apply(toy.request(), toy.registry).exit_code == ExitCode.OK
    comm = toy.site / "toyfuse" / "comm.py"
    comm.write_text(comm.read_text() + "# local tweak\n")
    wheels = toy.home.parent / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "1.0")  # where the release's bytes come from
    before = toy.snapshot()
    refused = changes.revert(toy.request(wheel_dir=wheels), toy.registry)
    assert refused.exit_code == ExitCode.REFUSED
    (left,) = refused.left
    assert (left.name, left.version) == ("toyfuse", "1.0")
    assert "+# local tweak" in left.error.hint  # the drift, as a diff against the release
    assert changed(before, toy.snapshot()) == []
    forced = changes.revert(toy.request(force=True, wheel_dir=wheels), toy.registry)
    assert forced.exit_code == ExitCode.OK
    assert comm.read_text() == SOURCE and not (toy.site / ".sm120patch").exists()


def test_a_patched_file_keeps_its_mode(toy):
    comm = toy.site / "toyfuse" / "comm.py"
    comm.chmod(0o640)
    assert changes.apply(toy.request(), toy.registry).exit_code == ExitCode.OK
    assert comm.stat().st_mode & 0o777 == 0o640
    assert changes.revert(toy.request(), toy.registry).exit_code == ExitCode.OK
    assert comm.stat().st_mode & 0o777 == 0o640


def test_a_reinstall_that_dropped_the_patches_is_reported_and_cleared(toy):
    assert changes.apply(toy.request(), toy.registry).exit_code == ExitCode.OK
    (toy.site / "toyfuse" / "comm.py").write_text(SOURCE)  # what pip install --force-reinstall leaves
    report = pipeline.status(toy.request(), toy.registry)
    assert report.exit_code == ExitCode.NOT_OK
    assert ("jit-gate had been applied; the files are the release's again (the package was reinstalled)"
            in render_status(report))
    assert changes.apply(toy.request(), toy.registry).exit_code == ExitCode.OK
    assert changes.revert(toy.request(), toy.registry).exit_code == ExitCode.OK
    assert (toy.site / "toyfuse" / "comm.py").read_text() == SOURCE
