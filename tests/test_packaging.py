"""A non-editable install must carry the patch sets and manifests inside the wheel."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_ships_patch_sets_and_manifests(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--disable-pip-version-check",
         "--wheel-dir", str(tmp_path), str(ROOT)],
        check=True,
    )
    (wheel,) = tmp_path.glob("sm120patch-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    tomls = list((ROOT / "patches").rglob("*.toml"))
    assert len(tomls) > 3
    for toml in tomls:
        assert f"sm120patch/_data/patches/{toml.relative_to(ROOT / 'patches')}" in names
    for manifest in (ROOT / "vendor-manifests").rglob("*.json"):
        assert f"sm120patch/_data/vendor-manifests/{manifest.relative_to(ROOT / 'vendor-manifests')}" in names
    assert "sm120patch/_probe.py" in names
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "sm120patch = sm120patch.__main__:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_the_command_runs_with_the_garbage_collector_on():
    # The entry point pauses it only while sm120patch imports itself (docs/benchmarks.md).
    code = ("import gc, sys; import sm120patch.cli as cli; "
            "cli.main = lambda: print(gc.isenabled(), len(gc.get_objects()) < gc.get_freeze_count()); "
            "from sm120patch.__main__ import main; main()")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "True True\n"
