"""The server side of tuned limits (sm120patch/_tuned_runtime.py, the code the opt-in patch
tuned-limits inserts into the servers) and sm120patch's view of a profile (tunedlimits.py), on
profiles written here: what a box is, which profiles hold, why the others do not, and that a
profile never raises. The servers' own code following a profile is in test_tuned_limits.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sm120patch import _tuned_runtime as rt
from sm120patch import tunedlimits
from sm120patch.errors import PatchDataError
from sm120patch.patchsets import parse_patch_set


def fake_box(root: Path, gpus: list[tuple[str, str]], driver: str = "580.95.05") -> tuple[Path, Path]:
    """A sysfs and /proc tree holding ``gpus`` (bus id, model) as NVIDIA 3D controllers behind one
    bridge each, an NVIDIA audio function and a non-NVIDIA device beside them."""
    sys_root, proc_root = root / "sys", root / "proc"
    devices = sys_root / "devices" / "pci0000:00"
    bus = sys_root / "bus" / "pci" / "devices"
    bus.mkdir(parents=True)

    def device(bus_id: str, vendor: str, klass: str, bridge: str) -> None:
        where = devices / bridge / bus_id
        where.mkdir(parents=True)
        for name, value in (("vendor", vendor), ("class", klass), ("device", "0x2bb1"), ("numa_node", "0"),
                            ("max_link_speed", "32.0 GT/s PCIe"), ("max_link_width", "16")):
            (where / name).write_text(value + "\n")
        (bus / bus_id).symlink_to(where)

    for index, (bus_id, model) in enumerate(gpus):
        device(bus_id, "0x10de", "0x030200", f"0000:00:0{index + 1}.0")
        info = proc_root / "driver" / "nvidia" / "gpus" / bus_id
        info.mkdir(parents=True)
        (info / "information").write_text(f"Model: \t\t {model}\nIRQ:   \t\t 150\nBus Location: \t {bus_id}\n")
    device("0000:01:00.1", "0x10de", "0x040300", "0000:00:01.0")  # the first GPU's audio function
    device("0000:05:00.0", "0x8086", "0x030000", "0000:00:09.0")  # another vendor's display
    (proc_root / "driver" / "nvidia").mkdir(parents=True, exist_ok=True)
    (proc_root / "driver" / "nvidia" / "version").write_text(
        f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {driver}  Release Build  (dvs-builder@U22)\n"
        "GCC version:  gcc version 12.2.0\n")
    return sys_root, proc_root


RTX = "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"


def test_the_box_is_the_nvidia_gpus_their_pcie_paths_and_the_driver(tmp_path):
    sys_root, proc_root = fake_box(tmp_path, [("0000:01:00.0", RTX), ("0000:21:00.0", RTX)])
    box = rt._sm120patch_box(str(sys_root), str(proc_root))
    assert box["driver"] == "580.95.05"
    assert [g["bus_id"] for g in box["gpus"]] == ["0000:01:00.0", "0000:21:00.0"]
    assert [g["model"] for g in box["gpus"]] == [RTX, RTX]
    assert box["gpus"][1]["pcie_path"] == "pci0000:00/0000:00:02.0/0000:21:00.0"
    assert box["gpus"][0]["max_link_width"] == "16"
    # Another box: a GPU moved behind another bridge is another topology.
    other_root, other_proc = fake_box(tmp_path / "other", [("0000:01:00.0", RTX), ("0000:41:00.0", RTX)])
    assert rt._sm120patch_box(str(other_root), str(other_proc)) != box
    # No GPU, no driver: a box all the same (a CPU machine), never an exception.
    assert rt._sm120patch_box(str(tmp_path / "none"), str(tmp_path / "none")) == {"gpus": [], "driver": None}


def entry(**changes) -> dict:
    value = {"created": "2026-12-05T01:30:00Z", "written_by": "sm120patch 0.1.0",
             "software": {"flashinfer-python": "0.6.4", "sglang": "0.5.9"}, "nccl_env": {},
             "dtype": "bf16", "hidden": 4096, "oneshot_max_bytes": 131072, "fused_max_bytes": 1048576,
             "verdict": "fused wins up to 128 tokens"}
    value.update(changes)
    return value


def profile(box: dict, **entries) -> dict:
    return {"kind": "sm120patch tuned limits", "format": 1, "box": box,
            "entries": entries or {"4": entry()}}


BOX = {"gpus": [{"bus_id": "0000:01:00.0"}], "driver": "580.95.05"}
HERE = {"flashinfer-python": "0.6.4", "sglang": "0.5.9"}


@pytest.mark.parametrize("document, tp, nccl, versions, why", [
    (profile(BOX), 4, {}, HERE, ""),
    (profile(BOX), 8, {}, HERE, "no limits for TP8 (tuned: TP4)"),
    (profile({"gpus": [], "driver": "580.95.05"}), 4, {}, HERE, "made on another box"),
    (profile(BOX), 4, {}, {**HERE, "sglang": "0.5.10"}, "tuned with sglang 0.5.9, here 0.5.10"),
    (profile(BOX), 4, {}, {**HERE, "flashinfer-python": None}, "tuned with flashinfer-python 0.6.4, here not installed"),
    (profile(BOX), 4, {"NCCL_P2P_DISABLE": "1"}, HERE, "tuned with NCCL settings none, here {'NCCL_P2P_DISABLE': '1'}"),
    ({**profile(BOX), "format": 2}, 4, {}, HERE, "format 2, written by a newer sm120patch"),
    ({"kind": "something else"}, 4, {}, HERE, "not an sm120patch tuned-limits profile"),
    (profile(BOX, **{"4": entry(oneshot_max_bytes=2 << 20)}), 4, {}, HERE, "one-shot limit above the fused limit"),
    (profile(BOX, **{"4": entry(fused_max_bytes="1 MB")}), 4, {}, HERE, "not whole numbers of bytes"),
    (profile(BOX, **{"4": entry(fused_max_bytes=True)}), 4, {}, HERE, "not whole numbers of bytes"),
    (profile(BOX, **{"four": entry()}), 4, {}, HERE, "is not a TP size"),
    (profile(BOX, **{"4": entry(dtype="fp8")}), 4, {}, HERE, "no dtype or releases"),
    ([1, 2], 4, {}, HERE, "not an sm120patch tuned-limits profile"),
])
def test_a_profile_holds_only_for_its_box_releases_tp_and_nccl_settings(document, tp, nccl, versions, why):
    found, reason = rt._sm120patch_judge(document, tp, BOX, nccl, versions)
    assert (found is None) == bool(why)
    assert why in reason
    if not why:
        assert found["fused_max_bytes"] == 1048576


@pytest.mark.parametrize("content, why", [
    (None, "no profile at"),
    (b"{not json", "cannot read"),
    (b"\xff\xfe", "cannot read"),
    (b"[]", ""),  # read; the judge says it is not a profile
])
def test_reading_a_profile_never_raises(tmp_path, content, why):
    path = tmp_path / "tuned-limits.json"
    if content is not None:
        path.write_bytes(content)
    document, reason = rt._sm120patch_load(str(path))
    assert (document is None) == bool(why) and why in reason
    directory, reason = rt._sm120patch_load(str(tmp_path))  # a directory where the file should be
    assert directory is None and "cannot read" in reason


def test_status_reads_the_profile_where_the_server_does_and_checks_what_it_can(tmp_path):
    path = tmp_path / "tuned-limits.json"
    environ = {"SM120PATCH_TUNED_LIMITS": str(path)}
    assert tunedlimits.location({}) == ("/etc/sm120patch/tuned-limits.json", False)
    assert tunedlimits.location(environ) == (str(path), True)
    absent = tunedlimits.read(HERE, environ)
    assert not absent.usable and absent.problem.startswith("no profile at")
    box = rt._sm120patch_box()  # this machine's: the profile holds here
    software = {**HERE, "torch": "2.11.0+cu130"}
    path.write_text(json.dumps(profile(box, **{"4": entry(software=software), "8": entry(software={**software, "sglang": "0.5.8"})})))
    view = tunedlimits.read(HERE, environ)
    assert view.usable and [e.tp for e in view.entries] == [4]
    assert view.entries[0].unchecked == ("torch",)  # status cannot read the server's torch
    assert view.entries[0].fused_tokens == 128
    assert view.entries[0].words() == "TP4: fused up to 1 MiB per rank (128 tokens at hidden 4096, bf16), one-shot up to 128 KiB"
    assert view.others == ("TP8: tuned with sglang 0.5.8, here 0.5.9",)
    path.write_text(json.dumps(profile({"gpus": [{"bus_id": "elsewhere"}], "driver": None})))
    assert tunedlimits.read(HERE, environ).problem.startswith("made on another box")


def test_the_oneshot_choice_follows_the_entry_and_falls_back_to_flashinfer(monkeypatch):
    """The SGLang fused call's one-shot choice as the inserted code makes it, the profile's entry
    given (this process's GPU answered as SM120)."""
    limits = entry(fused_max_bytes=64 * 4096 * 2, oneshot_max_bytes=16 * 4096 * 2)
    monkeypatch.setattr(rt, "_SM120PATCH_DEVICE", {"sm120": True})
    monkeypatch.setattr(rt, "_SM120PATCH_SEEN", {4: limits, 2: None})
    assert rt._sm120patch_use_oneshot(None, 16, 16 * 4096 * 2, 4) is True
    assert rt._sm120patch_use_oneshot(None, 17, 17 * 4096 * 2, 4) is False
    assert rt._sm120patch_use_oneshot(None, 4, 10 ** 9, 4) is True  # two-shot needs more tokens than ranks
    assert rt._sm120patch_use_oneshot(False, 1, 8192, 4) is False  # a caller's choice stands
    assert rt._sm120patch_use_oneshot(None, 1, 8192, 2) is None  # FlashInfer's rule
    # Within the profile's one-shot limit but past FlashInfer's own one-shot rule: two-shot.
    monkeypatch.setattr(rt, "_SM120PATCH_SEEN", {8: entry(fused_max_bytes=64 << 20, oneshot_max_bytes=32 << 20)})
    assert rt._sm120patch_use_oneshot(None, 512, 3 << 20, 8) is False  # 3 MiB x 2 x 8 > 42 MiB
    assert rt._sm120patch_use_oneshot(None, 256, 2 << 20, 8) is True
    # Another GPU: FlashInfer's rule, whatever the profile says, and the profile is not asked.
    monkeypatch.setattr(rt, "_SM120PATCH_DEVICE", {"sm120": False})
    assert rt._sm120patch_use_oneshot(None, 16, 16 * 4096 * 2, 8) is None


def tables() -> tuple[dict, dict]:
    """vLLM's two fusion tables as `fusion-table` leaves them: a 120 row copied from SM90's."""
    return ({90: {2: 64, 4: 2, 8: 0.5}, 120: {2: 64, 4: 2, 8: 0.5}},
            {90: {2: 32, 4: 2, 8: 0.5}, 120: {2: 32, 4: 2, 8: 0.5}})


def narrowed(monkeypatch, caplog, fused: dict, oneshot: dict) -> list[str]:
    """The inserted vLLM code run on ``fused`` and ``oneshot`` as at import, in a fresh process's
    state; the lines it logged."""
    monkeypatch.setattr(rt, "_SM120PATCH_SEEN", {})
    caplog.clear()
    with caplog.at_level("INFO"):
        rt._sm120patch_tuned_rows(fused, oneshot)
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("sm120patch")]


def test_vllm_rows_only_narrow_at_each_tp_size_the_profile_holds_for(monkeypatch, tmp_path, caplog):
    path = tmp_path / "tuned-limits.json"
    monkeypatch.setenv("SM120PATCH_TUNED_LIMITS", str(path))
    path.write_text(json.dumps(profile(rt._sm120patch_box(), **{"4": entry(software={})})))
    fused, oneshot = tables()
    [line] = narrowed(monkeypatch, caplog, fused, oneshot)
    assert fused[120] == {2: 64, 4: 1.0, 8: 0.5} and oneshot[120] == {2: 32, 4: 0.125, 8: 0.5}
    assert fused[90] == {2: 64, 4: 2, 8: 0.5}  # SM90's own row untouched
    # One line, saying where it is in force and where not, and why.
    assert line.startswith("sm120patch tuned limits in force at TP4: fused up to 1048576 bytes, one-shot up to 131072 "
                           f"bytes (profile {path}, tuned 2026-12-05T01:30:00Z); not in force at TP2 (no limits for TP2 "
                           "(tuned: TP4)), TP8 (no limits for TP8 (tuned: TP4))"), line
    # Never widened: a profile that measured fusion winning past the row keeps the row.
    path.write_text(json.dumps(profile(rt._sm120patch_box(), **{"4": entry(software={}, fused_max_bytes=64 << 20,
                                                                              oneshot_max_bytes=8 << 20)})))
    fused, oneshot = tables()
    narrowed(monkeypatch, caplog, fused, oneshot)
    assert fused[120][4] == 2 and oneshot[120][4] == 2
    # No profile, a corrupt one: the rows as fusion-table made them, one line saying why.
    for content in (None, "{"):
        path.unlink(missing_ok=True)
        if content is not None:
            path.write_text(content)
        fused, oneshot = tables()
        [line] = narrowed(monkeypatch, caplog, fused, oneshot)
        assert (fused, oneshot) == tables() and line.startswith("sm120patch tuned limits not used ("), line


def test_vllm_never_fused_profile_leaves_the_pass_off_at_that_tp_size(monkeypatch, tmp_path, caplog):
    """A 0/0 entry (fusion never won): the TP size leaves the fused row, so vLLM's pass stays off
    there (no row of 0 MB, whose compile range would be empty), and the line says so."""
    path = tmp_path / "tuned-limits.json"
    monkeypatch.setenv("SM120PATCH_TUNED_LIMITS", str(path))
    path.write_text(json.dumps(profile(rt._sm120patch_box(), **{"4": entry(software={}, fused_max_bytes=0,
                                                                              oneshot_max_bytes=0)})))
    fused, oneshot = tables()
    [line] = narrowed(monkeypatch, caplog, fused, oneshot)
    assert fused[120] == {2: 64, 8: 0.5}
    assert "in force at TP4: fusion never won on this box, the fusion pass stays off" in line


def test_vllm_without_an_sm120_row_nothing_is_narrowed(monkeypatch, tmp_path, caplog):
    """`--with tuned-limits` alone on vLLM 0.29+: no 120 row, so the server is the plain `apply`'s,
    whatever the profile says; the line says why."""
    path = tmp_path / "tuned-limits.json"
    monkeypatch.setenv("SM120PATCH_TUNED_LIMITS", str(path))
    path.write_text(json.dumps(profile(rt._sm120patch_box(), **{"4": entry(software={})})))
    fused, oneshot = ({90: {2: 64, 4: 2, 8: 0.5}}, {90: {2: 32, 4: 2, 8: 0.5}})
    [line] = narrowed(monkeypatch, caplog, fused, oneshot)
    assert (fused, oneshot) == ({90: {2: 64, 4: 2, 8: 0.5}}, {90: {2: 32, 4: 2, 8: 0.5}})
    assert "vLLM has no SM120 fusion row to narrow" in line and "--with fusion-table" in line


def test_vllm_oneshot_floor_keeps_batches_of_no_more_tokens_than_ranks_one_shot(monkeypatch):
    """FlashInfer's two-shot asserts more tokens than ranks: where the profile narrowed a TP size,
    vLLM's choice of two-shot at 1..TP tokens becomes one-shot; elsewhere its choice stands."""
    monkeypatch.setattr(rt, "_SM120PATCH_SEEN", {"vllm": {4: entry()}})
    assert [rt._sm120patch_oneshot_floor(False, n, 4, 120) for n in (1, 2, 3, 4, 5)] == [True] * 4 + [False]
    assert rt._sm120patch_oneshot_floor(None, 1, 4, 120) is None  # MNNVL: FlashInfer's own choice
    assert rt._sm120patch_oneshot_floor(False, 1, 8, 120) is False  # TP8 not narrowed: vLLM's row decides
    assert rt._sm120patch_oneshot_floor(False, 1, 4, 90) is False  # another GPU


def set_text(tmp_path: Path, patches: str) -> Path:
    path = tmp_path / "1.0.toml"
    path.write_text('versions = ["1.0"]\nsummary = "s"\n' + patches)
    return path


PATCH = '''
[[patch]]
id = "{id}"
check = "jit-gate"
file = "a.py"
required = {required}
summary = "s"
{extra}
[[patch.edit]]
rewriter = "python.insert-statement-after"
sites = 1
params = {{ anchor = "x", statement = "y = 1" }}
'''


def test_an_opt_in_patch_brings_what_it_requires(tmp_path):
    text = (PATCH.format(id="table", required="false", extra="")
            + PATCH.format(id="tuned", required="false", extra='requires = ["table"]'))
    patch_set = parse_patch_set(set_text(tmp_path, text), "toy")
    assert [p.id for p in patch_set.select(["tuned"])] == ["table", "tuned"]
    assert [p.id for p in patch_set.select(["table"])] == ["table"]
    bad = PATCH.format(id="tuned", required="false", extra='requires = ["nope"]')
    with pytest.raises(PatchDataError, match="requires 'nope', which is not another patch"):
        parse_patch_set(set_text(tmp_path, bad), "toy")
    required = PATCH.format(id="table", required="false", extra="") + PATCH.format(
        id="gate", required="true", extra='requires = ["table"]')
    with pytest.raises(PatchDataError, match="only an opt-in one may require"):
        parse_patch_set(set_text(tmp_path, required), "toy")


def test_a_fifo_or_a_directory_in_place_of_the_profile_is_refused_at_once(tmp_path, monkeypatch):
    import os

    fifo = tmp_path / "tuned-limits.json"
    os.mkfifo(fifo)  # no writer: opening it would block the server for good
    monkeypatch.setenv("SM120PATCH_TUNED_LIMITS", str(fifo))
    assert rt._sm120patch_decide(4, False) == (None, f"cannot read {fifo} (not a regular file)")


def test_an_unexpected_shape_is_a_reason_never_an_exception(tmp_path, monkeypatch):
    path = tmp_path / "tuned-limits.json"
    monkeypatch.setenv("SM120PATCH_TUNED_LIMITS", str(path))
    odd = profile(rt._sm120patch_box(), **{"4": entry(software={"sglang": "0.5.9"}, nccl_env=["not", "a", "dict"])})
    path.write_text(json.dumps(odd))
    entry_, why = rt._sm120patch_decide(4, False)
    assert entry_ is None and why


def trusted_profile(tmp_path: Path) -> Path:
    """A valid profile in a directory only its owner (this user) may write."""
    where = tmp_path / "etc"
    where.mkdir(mode=0o755)
    path = where / "tuned-limits.json"
    path.write_text(json.dumps(profile(BOX)))
    path.chmod(0o644)
    return path


def test_a_profile_others_may_write_is_refused(tmp_path):
    """A root-run server's profile decides what runs on its GPUs: like sshd's StrictModes, the
    reader refuses a file, or a directory above it, that anyone but root and the server's own
    user may write, and says which."""
    import os

    path = trusted_profile(tmp_path)
    tmp_path.chmod(0o755)
    assert rt._sm120patch_load(str(path)) == (profile(BOX), "")
    path.chmod(0o666)
    document, why = rt._sm120patch_load(str(path))
    assert document is None and why == f"not trusted: {path} can be written by others than root and this server's user (owner uid {os.geteuid()}, mode 666)"
    path.chmod(0o644)
    path.parent.chmod(0o777)
    document, why = rt._sm120patch_load(str(path))
    assert document is None and why.startswith(f"not trusted: its directory {path.parent} can be written by others")
    path.parent.chmod(0o1777)  # sticky, as /tmp: no one else can rename what this user owns there
    assert rt._sm120patch_load(str(path))[0] == profile(BOX)
    path.parent.chmod(0o755)
    if os.geteuid() == 0:  # a file another user owns (root can give it away)
        os.chown(path, 12345, -1)
        document, why = rt._sm120patch_load(str(path))
        assert document is None and "(owner uid 12345, mode 644)" in why
        os.chown(path, 0, -1)
        os.chown(path.parent, 12345, -1)
        document, why = rt._sm120patch_load(str(path))
        assert document is None and f"its directory {path.parent}" in why and "owner uid 12345" in why
        os.chown(path.parent, 0, -1)
    # Through a symlink: the directories of the file it names are checked too.
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    loose.chmod(0o777)
    (loose / "real.json").write_text(json.dumps(profile(BOX)))
    (loose / "real.json").chmod(0o644)
    link = path.parent / "linked.json"
    link.symlink_to(loose / "real.json")
    document, why = rt._sm120patch_load(str(link))
    assert document is None and f"its directory {loose}" in why


def test_a_relative_profile_path_is_refused(tmp_path, monkeypatch):
    """A relative SM120PATCH_TUNED_LIMITS would resolve against the server's working directory."""
    path = trusted_profile(tmp_path)
    monkeypatch.chdir(path.parent)
    monkeypatch.setenv("SM120PATCH_TUNED_LIMITS", path.name)
    assert rt._sm120patch_decide(4, False) == (
        None, "SM120PATCH_TUNED_LIMITS is a relative path (tuned-limits.json): give the profile's absolute path")


def test_a_fifo_renamed_over_the_profile_never_blocks_the_reader(tmp_path):
    """The reader opens without blocking and checks what it opened, not a stat of the name and
    then an open by name: a FIFO renamed over the profile between the two blocked the server for
    good. Here the FIFO is renamed over the profile at the moment the reader opens it (Python's
    audit event for an open, raised before the call), in a process of its own: the read ends at
    once and says what is there."""
    import subprocess
    import sys
    import textwrap

    where = tmp_path / "etc"
    where.mkdir(mode=0o755)
    tmp_path.chmod(0o755)
    path = where / "tuned-limits.json"
    path.write_text(json.dumps(profile(BOX)))
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(Path(rt.__file__).parent.parent)!r})
        from sm120patch import _tuned_runtime as rt
        path = {str(path)!r}
        def swap(event, args):
            if event == "open" and args and args[0] == path and not os.path.exists(path + ".fifo"):
                os.mkfifo(path + ".fifo", 0o644)
                os.rename(path + ".fifo", path)
                os.mkfifo(path + ".fifo", 0o644)  # once only
        sys.addaudithook(swap)
        print(rt._sm120patch_load(path))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=20)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == repr((None, f"cannot read {path} (not a regular file)"))


def test_a_profile_nested_past_the_parsers_depth_is_a_reason(tmp_path):
    path = trusted_profile(tmp_path)
    tmp_path.chmod(0o755)
    path.write_text("[" * 100000 + "]" * 100000)
    document, why = rt._sm120patch_load(str(path))
    assert document is None and why == f"cannot read {path} (nested too deeply to be a profile)"


def test_the_tuned_check_asks_each_site_the_patch_data_rewrites_and_the_fused_calls_argument():
    """`verify --tuned`'s request, from the patch data: SGLang's decision sites (each with the
    release cap the patch wraps there) and the one-shot argument of the fused call, as the tuned
    patch writes it and as the release has it; vLLM's fusion module and its call's expression."""
    from packaging.version import Version

    from sm120patch import decisions
    from sm120patch.distributions import load_registry

    registry = load_registry(full=False)
    sglang, vllm = registry.get("sglang"), registry.get("vllm")
    old = decisions.tuned_request(sglang, sglang.find(Version("0.5.4")), [])
    assert old["kind"] == "sites"
    assert [(s["function"], s["cap"]) for s in old["sites"]] == [
        ("should_fuse_mlp_allreduce_with_next_layer", "FUSE_ALLREDUCE_MAX_BATCH_SIZE"),
        ("_gather_hidden_states_and_residual", "4096")]
    assert old["oneshot"]["module"] == "sglang.srt.layers.flashinfer_comm_fusion"
    assert old["oneshot"]["expression"].startswith("_sm120patch_use_oneshot(use_oneshot, input_tensor.shape[0]")
    new = decisions.tuned_request(sglang, sglang.find(Version("0.5.23")), [], tuned=False)
    assert [(s["module"], s["function"]) for s in new["sites"]] == [
        ("sglang.srt.layers.layer_boundary.residual.add_norm", "flashinfer_ar_fusion_applies")]
    assert new["oneshot"]["expression"] == "use_oneshot"  # the release's own argument there
    for version, release_expression in (("0.11.1", "use_oneshot"), ("0.34.0", "_select_flashinfer_allreduce_use_oneshot(")):
        request = decisions.tuned_request(vllm, vllm.find(Version(version)), [])
        assert request["kind"] == "tables" and request["module"].startswith("vllm.compilation.")
        assert request["oneshot"]["expression"].startswith("_sm120patch_oneshot_floor(")
        plain = decisions.tuned_request(vllm, vllm.find(Version(version)), [], tuned=False)
        assert plain["oneshot"]["expression"].startswith(release_expression)


def test_the_tuned_check_reads_the_servers_one_line_per_tp_size():
    from sm120patch import decisions

    vllm = ["sm120patch tuned limits in force at TP2: fused up to 1 bytes, one-shot up to 1 bytes; at TP4: fused up "
            "to 2 bytes, one-shot up to 1 bytes (profile /p, tuned x); not in force at TP8 (no limits for TP8): there "
            "the rows stay as they were"]
    assert [decisions.in_force(vllm, tp) for tp in (2, 4, 8)] == [True, True, False]
    sglang = ["sm120patch tuned limits in force at TP4: fused up to 9 bytes, one-shot up to 3 bytes (profile /p, tuned x)"]
    assert [decisions.in_force(sglang, tp) for tp in (2, 4)] == [False, True]
    assert not decisions.in_force(["sm120patch tuned limits not used (no profile at /p): the release's own fusion "
                                   "limits hold"], 4)
