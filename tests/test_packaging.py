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
    for toml in (ROOT / "patches").glob("*.toml"):
        assert f"sm120patch/_data/patches/{toml.name}" in names
    for manifest in (ROOT / "vendor-manifests").rglob("*.json"):
        assert f"sm120patch/_data/vendor-manifests/{manifest.relative_to(ROOT / 'vendor-manifests')}" in names
    assert "sm120patch/_probe.py" in names
