"""Patch-set data: every shipped set loads and validates; malformed data is a clear error."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from packaging.version import Version

from sm120patch.errors import PatchDataError, UsageError
from sm120patch.patchsets import load_catalog, parse_patch_set

VALID = """\
distribution = "flashinfer-python"
versions = ["0.6.4"]
summary = "s"

[[patch]]
id = "jit-gate"
file = "{file}"
required = true
summary = "s"

[[patch.edit]]
rewriter = "python.extend-list-argument"
sites = 1
params = {{ function = "f", keyword = "k", value = "12" }}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "set.toml"
    path.write_text(textwrap.dedent(text))
    return path


def test_shipped_patch_sets_pin_the_core_releases():
    catalog = load_catalog()
    flashinfer = catalog.find("flashinfer-python", Version("0.6.4"))
    sglang = catalog.find("sglang", Version("0.5.9"))
    assert [p.id for p in flashinfer.patches] == ["jit-gate", "pdl-gates", "lamport-stride"]
    assert all(p.required and p.fixed_in == "0.6.17" and "3903" in p.upstream for p in flashinfer.patches)
    assert flashinfer.patch("pdl-gates").edits[0].sites == 13
    assert [(p.id, p.required) for p in sglang.patches] == [
        ("fusion-gate", True), ("auto-enable", False), ("symm-mem", False)
    ]


def test_pins_are_exact():
    catalog = load_catalog()
    assert catalog.find("flashinfer-python", Version("0.6.4.post1")) is None
    assert catalog.find("flashinfer-python", Version("0.6.4+local")) is None
    assert catalog.find("flashinfer-python", Version("0.6.16.post5")) is None
    assert catalog.find("flashinfer-python", Version("0.4.1")) is None
    assert catalog.find("flashinfer-python", Version("0.6.17")) is None


def test_select_takes_required_and_named_opt_in_patches():
    sglang = load_catalog().find("sglang", Version("0.5.9"))
    assert [p.id for p in sglang.select()] == ["fusion-gate"]
    assert [p.id for p in sglang.select(["symm-mem"])] == ["fusion-gate", "symm-mem"]
    with pytest.raises(UsageError, match="opt-in patches: auto-enable, symm-mem"):
        sglang.select(["nope"])


def test_a_valid_file_parses(tmp_path):
    patch_set = parse_patch_set(write(tmp_path, VALID.format(file="flashinfer/jit/comm.py")))
    assert patch_set.files == ("flashinfer/jit/comm.py",)


@pytest.mark.parametrize("file", ["../evil.py", "/etc/passwd", "flashinfer/../../x.py", ""])
def test_a_file_that_escapes_the_package_is_refused(tmp_path, file):
    with pytest.raises(PatchDataError, match="not a safe relative path"):
        parse_patch_set(write(tmp_path, VALID.format(file=file)))


@pytest.mark.parametrize(
    "text, message",
    [
        ("distribution = [", "not valid TOML"),
        (VALID.format(file="a.py").replace('versions = ["0.6.4"]', 'versions = ["x.y"]'), "is not a version"),
        (VALID.format(file="a.py").replace("sites = 1", "sites = 0"), "sites must be at least 1"),
        (VALID.format(file="a.py").replace("sites = 1", 'sites = "1"'), "'sites' has the wrong type"),
        (VALID.format(file="a.py").replace("python.extend-list-argument", "python.eval"), "unknown rewriter"),
        (VALID.format(file="a.py").replace('required = true\n', ''), "missing 'required'"),
        (VALID.format(file="a.py") + VALID.format(file="b.py").split("summary = \"s\"\n", 1)[1], "duplicate id"),
    ],
)
def test_malformed_patch_sets_are_clear_errors(tmp_path, text, message):
    with pytest.raises(PatchDataError, match=message):
        parse_patch_set(write(tmp_path, text))


def test_two_sets_pinning_one_release_conflict(tmp_path):
    (tmp_path / "a.toml").write_text(VALID.format(file="a.py"))
    (tmp_path / "b.toml").write_text(VALID.format(file="b.py"))
    with pytest.raises(PatchDataError, match="also pinned by a.toml"):
        load_catalog(tmp_path)
