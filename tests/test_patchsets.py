"""Patch-set data: every shipped set loads and validates; malformed data is a clear error."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from packaging.version import Version

from sm120patch.errors import PatchDataError, UsageError
from sm120patch.distributions import load_registry
from sm120patch.patchsets import parse_patch_set

VALID = """\
versions = ["0.6.4"]
summary = "s"

[[patch]]
id = "jit-gate"
check = "jit-gate"
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
    registry = load_registry()
    flashinfer = registry.get("flashinfer-python").find(Version("0.6.4"))
    sglang = registry.get("sglang").find(Version("0.5.9"))
    assert [p.id for p in flashinfer.patches] == ["jit-gate", "pdl-gates", "lamport-stride", "unicast-workspace",
                                                  "cluster-clamp", "cluster-clamp-moe", "cluster-clamp-custom"]
    upstream_3903 = [p for p in flashinfer.patches if p.id != "unicast-workspace"]
    assert all(p.required and p.fixed_in == "0.6.17" and "3903" in p.upstream for p in upstream_3903)
    unicast = flashinfer.patch("unicast-workspace")
    assert unicast.required and unicast.fixed_in == "0.6.15" and "3745" in unicast.upstream
    assert flashinfer.patch("pdl-gates").edits[0].sites == 13
    # The clamp's three launchers: the fused, the MoE and the custom allreduce's, each a header.
    clamps = [flashinfer.patch(i) for i in ("cluster-clamp", "cluster-clamp-moe", "cluster-clamp-custom")]
    assert len({p.file for p in clamps}) == 3 and all(p.check == "cluster-clamp" for p in clamps)
    assert [(p.id, p.required) for p in sglang.patches] == [
        ("fusion-gate", True), ("auto-enable", False), ("symm-mem", False), ("tuned-limits", False),
        ("tuned-oneshot", False),
    ]
    assert sglang.patch("tuned-limits").requires == ("tuned-oneshot",)


def test_pins_are_exact():
    flashinfer = load_registry().get("flashinfer-python")
    for version in ("0.6.4.post1", "0.6.4+local", "0.6.16.post5", "0.4.1", "0.6.17"):
        assert flashinfer.find(Version(version)) is None, version
    assert flashinfer.fixed_upstream(Version("0.6.17")) and not flashinfer.fixed_upstream(Version("0.6.16.post4"))


def test_select_takes_required_and_named_opt_in_patches():
    sglang = load_registry().get("sglang").find(Version("0.5.9"))
    assert [p.id for p in sglang.select()] == ["fusion-gate"]
    assert [p.id for p in sglang.select(["symm-mem"])] == ["fusion-gate", "symm-mem"]
    with pytest.raises(UsageError, match="opt-in patches here: auto-enable, symm-mem, tuned-limits, tuned-oneshot"):
        sglang.select(["nope"])
    # A required patch is always applied: naming it with --with is a mistake, said as one.
    with pytest.raises(UsageError, match="fusion-gate: required, so always applied"):
        sglang.select(["fusion-gate"])


def test_a_valid_file_parses(tmp_path):
    patch_set = parse_patch_set(write(tmp_path, VALID.format(file="flashinfer/jit/comm.py")), "flashinfer-python")
    assert patch_set.files == ("flashinfer/jit/comm.py",)


@pytest.mark.parametrize("file", ["../evil.py", "/etc/passwd", "flashinfer/../../x.py", ""])
def test_a_file_that_escapes_the_package_is_refused(tmp_path, file):
    with pytest.raises(PatchDataError, match="not a safe relative path"):
        parse_patch_set(write(tmp_path, VALID.format(file=file)), "flashinfer-python")


@pytest.mark.parametrize(
    "text, message",
    [
        ("distribution = [", "not valid TOML"),
        (VALID.format(file="a.py").replace('versions = ["0.6.4"]', 'versions = ["x.y"]'), "is not a version"),
        (VALID.format(file="a.py").replace("sites = 1", "sites = 0"), "sites must be at least 1"),
        (VALID.format(file="a.py").replace("sites = 1", 'sites = "1"'), "'sites' has the wrong type"),
        (VALID.format(file="a.py").replace("python.extend-list-argument", "python.eval"), "unknown rewriter"),
        (VALID.format(file="a.py").replace('required = true\n', ''), "missing 'required'"),
        (VALID.format(file="a.py").replace('check = "jit-gate"', 'check = "nope"'), "no semantic check named 'nope'"),
        (VALID.format(file="a.py").replace('check = "jit-gate"\n', ''), "missing 'check'"),
        (VALID.format(file="a.py") + VALID.format(file="b.py").split("summary = \"s\"\n", 1)[1], "duplicate id"),
    ],
)
def test_malformed_patch_sets_are_clear_errors(tmp_path, text, message):
    with pytest.raises(PatchDataError, match=message):
        parse_patch_set(write(tmp_path, text), "flashinfer-python")



FORMER = """
[[patch.former]]
form = "{form}"
summary = "s"
check = "jit-gate"

[[patch.former.edit]]
rewriter = "python.extend-list-argument"
sites = 1
params = {{ function = "f", keyword = "k", value = "{value}" }}
"""


def test_an_older_form_is_kept_with_its_patch(tmp_path):
    """[[patch.former]]: the edits a patch had in an earlier sm120patch, kept in the data so that
    an environment patched with them is recognised (the manifest keys it <id>@<form>)."""
    patch_set = parse_patch_set(write(tmp_path, VALID.format(file="a.py") + FORMER.format(form="old", value="11")),
                                "flashinfer-python")
    patch = patch_set.patch("jit-gate")
    assert [f.form for f in patch.formers] == ["old"]
    assert patch.former("old").edits[0].params["value"] == "11" and patch.former("old").formers == ()


@pytest.mark.parametrize("former, message", [
    (FORMER.format(form="Old+1", value="11"), "form 'Old\\+1' must be a unique name"),
    (FORMER.format(form="old", value="11") + FORMER.format(form="old", value="10"), "form 'old' must be a unique name"),
    (FORMER.format(form="old", value="12"), "former old has today's edits: it is not an older form"),
    (FORMER.format(form="old", value="11").replace('check = "jit-gate"', 'check = "nope"'), "no semantic check named 'nope'"),
    (FORMER.format(form="old", value="11").replace('summary = "s"\n', 'summary = "s"\nsince = "0.1"\n'),
     "unknown key\\(s\\) since"),
    (FORMER.format(form="old", value="11").split("[[patch.former.edit]]")[0], "missing 'edit'"),
])
def test_malformed_older_forms_are_clear_errors(tmp_path, former, message):
    with pytest.raises(PatchDataError, match=message):
        parse_patch_set(write(tmp_path, VALID.format(file="a.py") + former), "flashinfer-python")


DISTRIBUTION = """\
name = "flashinfer-python"
option = "flashinfer"
summary = "s"
"""


def sets_dir(tmp_path: Path, files: dict[str, list[str]]) -> Path:
    """patches/flashinfer-python/ with one valid set per file name, pinning the given releases."""
    directory = tmp_path / "flashinfer-python"
    directory.mkdir()
    (directory / "distribution.toml").write_text(DISTRIBUTION)
    for name, versions in files.items():
        pins = ", ".join(f'"{v}"' for v in versions)
        (directory / name).write_text(VALID.format(file="a.py").replace('versions = ["0.6.4"]', f"versions = [{pins}]"))
    return tmp_path


@pytest.mark.parametrize("files, message", [
    ({"0.6.3.toml": ["0.6.3", "0.6.4"], "0.6.4.toml": ["0.6.4"]}, "also pinned by flashinfer-python/0.6.3.toml"),
    ({"a.toml": ["0.6.4"]}, "a.toml: a patch set is named after the lowest release it pins"),
    ({"0.6.4.toml": ["0.6.4"], "0.6.4.0.toml": ["0.6.5"]}, "are named after one release"),
    ({"0.6.3.toml": ["0.6.4"]}, "named after 0.6.3, but the lowest release it pins is 0.6.4 (name it 0.6.4.toml)"),
    ({"0.6.3.toml": ["0.6.3", "0.6.5"], "0.6.4.toml": ["0.6.4"]}, "pins 0.6.5, at or past the next set (0.6.4.toml)"),
])
def test_patch_sets_are_named_after_their_lowest_release_and_pin_each_release_once(tmp_path, files, message):
    # What lets status read only one file: the set for a release is the last one named at or below it.
    with pytest.raises(PatchDataError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_registry(sets_dir(tmp_path, files))


def test_status_reads_only_the_set_named_for_the_installed_release(tmp_path):
    root = sets_dir(tmp_path, {"0.6.0.toml": ["0.6.0", "0.6.1"], "0.6.4.toml": ["0.6.4", "0.6.5"]})
    (root / "flashinfer-python" / "0.6.0.toml").write_text("not = [toml")  # read it and fail
    flashinfer = load_registry(root, full=False).get("flashinfer-python")
    assert flashinfer.find(Version("0.6.5")).versions == (Version("0.6.4"), Version("0.6.5"))
    assert flashinfer.find(Version("0.6.6")) is None and flashinfer.find(Version("0.5.9")) is None
    assert flashinfer.files_for("0.6.5") == ("a.py",)
    with pytest.raises(PatchDataError, match="0.6.0.toml: not valid TOML"):
        flashinfer.find(Version("0.6.1"))
    with pytest.raises(PatchDataError, match="0.6.0.toml: not valid TOML"):
        load_registry(root)  # every other command reads every set first


@pytest.mark.parametrize(
    "text, message",
    [
        (DISTRIBUTION.replace('option = "flashinfer"\n', ""), "missing 'option'"),
        (DISTRIBUTION.replace('"flashinfer-python"', '"other"'), "lives in patches/flashinfer-python/"),
        (DISTRIBUTION + '[[advice]]\nlevel = "loud"\ntext = "t"\n', "needs level"),
        (DISTRIBUTION + '[[advice]]\nversions = "~"\nlevel = "info"\ntext = "t"\n', "not a version specifier"),
        (DISTRIBUTION + '[verify]\nspec = "x"\n', "unknown verify key"),
        (DISTRIBUTION + '[checkout]\nlayout = [["a"]]\n', "checkout.layout"),
        (DISTRIBUTION + '[[advice]]\nlevel = "info"\ntext = "t"\nwhen_applied = ["jit-gate", "nope"]\n',
         "advice #1 names no patch of flashinfer-python: nope"),
        (DISTRIBUTION + '[[advice]]\nlevel = "info"\ntext = "t"\nbench = "yes"\n', "advice #1: bench is true or false"),
        (DISTRIBUTION + '[[advice]]\nlevel = "info"\ntext = "t"\nwith = ">=1"\n', "with needs fusion_with"),
        (DISTRIBUTION + '[[not_covered]]\nversions = ">=0.4"\n', "not_covered #1: needs versions"),
        (DISTRIBUTION + '[[not_covered]]\nversions = ""\nreason = "r"\n', "not_covered #1: needs versions"),
        (DISTRIBUTION + '[[fusion_flag]]\nversions = ">=0.4"\nflag = ""\n', "fusion_flag #1: needs versions"),
    ],
)
def test_malformed_distribution_data_is_a_clear_error(tmp_path, text, message):
    directory = tmp_path / "flashinfer-python"
    directory.mkdir()
    (directory / "distribution.toml").write_text(text)
    (directory / "0.6.4.toml").write_text(VALID.format(file="a.py"))
    with pytest.raises(PatchDataError, match=message):
        load_registry(tmp_path)


def test_the_registry_knows_each_shipped_distribution_from_data():
    registry = load_registry()
    assert registry.names == ("flashinfer-python", "sglang", "vllm")
    flashinfer, sglang, vllm = registry
    assert (flashinfer.option, flashinfer.jit_module, str(flashinfer.fixed_in)) == ("flashinfer", "trtllm_comm", "0.6.17")
    assert sglang.pins == "flashinfer-python" and sglang.jit_module is None
    assert flashinfer.checkout.repo_path("flashinfer/data/include/x.cuh") == "include/x.cuh"
    assert sglang.checkout.repo_path("sglang/srt/layers/communicator.py") == "python/sglang/srt/layers/communicator.py"
    assert vllm.pins == "flashinfer-python" and vllm.jit_module is None and vllm.fixed_in is None
    assert vllm.checkout.repo_path("vllm/config/vllm.py") == "vllm/config/vllm.py"
    assert vllm.needs_nothing(Version("0.11.0")) and not vllm.needs_nothing(Version("0.11.1"))
    # Every patch names a semantic check that exists (parse refuses the others).
    assert all(p.check for ps in registry.patch_sets for p in ps.patches)


@pytest.mark.parametrize("edit, message", [
    (('by = "auto-enable"', 'by = "auto-enabel"'), "fusion_chain.auto_enable #2 names no patch of sglang: auto-enabel"),
    (('limits = "for gpt-oss', 'limit = "for gpt-oss'), "fusion_chain.auto_enable #1: needs versions, by"),
    (('[fusion_chain]\n', '[fusion_chain]\nspeed = "fast"\n'), "fusion_chain: unknown key(s) speed"),
    (('build = ["jit-gate"]', 'build = ["jit-gates"]'),
     "fusion_chain.kernel_path #1 names no patch of flashinfer-python: jit-gates"),
    (('launch_without = "', 'launch_with = "'), "fusion_chain.kernel_path #1: a path with launch patches says"),
    (("rows = 512", "rows = 0"), "pcie_ipc #1: rows is a positive number of tokens"),
    ((":PcieIpcCommunicator", ".PcieIpcCommunicator"), "pcie_ipc #1: code names module:Class"),
    (('switch = "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1"\n', ""), "pcie_ipc #1: needs versions, with, name, switch and code"),
])
def test_the_fusion_chain_data_is_checked_on_load(tmp_path, edit, message):
    """A [fusion_chain] row that names a patch the distribution does not have, misses a field or
    has an unknown key is one clear error when the data is read, not a wrong sentence later."""
    import shutil

    from sm120patch.data import data_dir

    root = tmp_path / "patches"
    shutil.copytree(data_dir("patches"), root)
    path = root / "sglang" / "distribution.toml"
    text = path.read_text()
    assert edit[0] in text
    path.write_text(text.replace(edit[0], edit[1], 1))
    with pytest.raises(PatchDataError) as raised:
        load_registry(root)
    assert message in str(raised.value)
