"""User sessions on a real environment: flashinfer-python 0.6.4 and sglang 0.5.9 wheels,
pip-installed into a throwaway venv. Each test reads like what an operator types, and checks
what the tool says against a snapshot of every file of the environment, its state and its JIT
cache, taken before and after."""

from __future__ import annotations

import re

import ast
import json

from helpers import FLASHINFER_FILES, COMM, COMMUNICATOR, HEADER, LAMPORT, SERVER_ARGS, changed, snapshot, tree_snapshot
from sm120patch.errors import ExitCode


def supported_majors(comm_py: str) -> list[int]:
    """The list gen_trtllm_comm_module passes as supported_major_versions, read by parsing."""
    for node in ast.walk(ast.parse(comm_py)):
        if isinstance(node, ast.FunctionDef) and node.name == "gen_trtllm_comm_module":
            for kw in (k for n in ast.walk(node) if isinstance(n, ast.Call) for k in n.keywords):
                if kw.arg == "supported_major_versions":
                    return ast.literal_eval(kw.value)
    raise AssertionError("gen_trtllm_comm_module has no supported_major_versions")


def fusion_predicate_names(communicator_py: str) -> set[str]:
    """Names in the or-condition of apply_flashinfer_allreduce_fusion's return expression."""
    for node in ast.walk(ast.parse(communicator_py)):
        if isinstance(node, ast.FunctionDef) and node.name == "apply_flashinfer_allreduce_fusion":
            ors = [n for n in ast.walk(node) if isinstance(n, ast.BoolOp) and isinstance(n.op, ast.Or)]
            return {v.id for o in ors for v in o.values if isinstance(v, ast.Name)}
    raise AssertionError("no apply_flashinfer_allreduce_fusion")


def test_status_on_a_fresh_install_says_not_patched(read_only_cli, read_only_env):
    before = snapshot(read_only_env)
    result = read_only_cli("status")
    assert snapshot(read_only_env) == before  # status changes nothing
    assert result.exit_code == ExitCode.NOT_OK
    assert "flashinfer-python 0.6.4: not patched" in result.output
    assert "sglang 0.5.9: not patched" in result.output
    assert "pins flashinfer-python==0.6.3; 0.6.4 is installed" in result.output


def test_apply_status_revert_round_trip_restores_every_record_hash(sm120patch, serving_env):
    assert serving_env.record_mismatches() == []

    before = snapshot(serving_env)
    applied = sm120patch("apply", "--flashinfer", "0.6.4", "--sglang", "0.5.9")
    assert applied.exit_code == 0, applied.output
    assert "flashinfer-python 0.6.4: patched 6 files" in applied.output
    assert "sglang 0.5.9: patched 1 file\n" in applied.output
    # What changed is exactly the four files it names, and sm120patch's own state beside them.
    site = str(serving_env.site_packages)
    assert {p for p in changed(before, snapshot(serving_env)) if ".sm120patch" not in p} == {
        f"{site}/{rel}" for rel in (*FLASHINFER_FILES, COMMUNICATOR)}

    comm = serving_env.file(COMM).read_text()
    assert supported_majors(comm) == [9, 10, 12]
    header = serving_env.file(HEADER).read_text()
    assert "__CUDA_ARCH__ < 1200" not in header
    assert header.count("(defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900))") == 13
    lamport = serving_env.file(LAMPORT).read_text()
    assert "lamport_peer_comm_buffer_ptrs[i + tp_size" not in lamport
    assert "lamport_peer_comm_buffer_ptrs[i + MAX_RANKS_PER_NODE]" in lamport
    assert "lamport_peer_comm_buffer_ptrs[i + MAX_RANKS_PER_NODE * 2]" in lamport
    assert "TVM_FFI_ICHECK(tp_size <= static_cast<int64_t>(MAX_RANKS_PER_NODE))" in lamport
    mnnvl = serving_env.file(FLASHINFER_FILES[3]).read_text()
    assert "if self._enable_multicast:" in mnnvl and "self._mc_granularity = alloc_granularity" in mnnvl
    communicator = serving_env.file(COMMUNICATOR).read_text()
    assert "_is_sm120_supported" in fusion_predicate_names(communicator)
    assert "_is_sm120_supported = _is_cuda and is_sm120_supported()" in communicator
    assert sorted(serving_env.record_mismatches()) == sorted([*FLASHINFER_FILES, COMMUNICATOR])

    status = sm120patch("status", "--json")
    assert status.exit_code == ExitCode.OK, status.output
    doc = json.loads(status.output)
    states = {(d["name"], p["id"]): p["state"] for d in doc["distributions"] for p in d["patches"]}
    assert states == {
        ("flashinfer-python", "jit-gate"): "applied",
        ("flashinfer-python", "pdl-gates"): "applied",
        ("flashinfer-python", "lamport-stride"): "applied",
        ("flashinfer-python", "unicast-workspace"): "applied",
        ("flashinfer-python", "cluster-clamp"): "applied",
        ("flashinfer-python", "cluster-clamp-moe"): "applied",
        ("flashinfer-python", "cluster-clamp-custom"): "applied",
        ("sglang", "fusion-gate"): "applied",
        ("sglang", "auto-enable"): "pristine",
        ("sglang", "symm-mem"): "pristine",
        ("sglang", "tuned-limits"): "pristine",
        ("sglang", "tuned-oneshot"): "pristine",
    }

    reverted = sm120patch("revert")
    assert reverted.exit_code == 0, reverted.output
    assert serving_env.record_mismatches() == []
    assert sm120patch("status").exit_code == ExitCode.NOT_OK
    assert snapshot(serving_env) == before  # byte-identical, and no state left behind


def test_dry_run_prints_a_diff_and_changes_nothing(sm120patch, serving_env):
    serving_env.seed_jit()
    before = snapshot(serving_env)
    result = sm120patch("apply", "--dry-run", "--with", "symm-mem")
    assert result.exit_code == 0
    assert "+        supported_major_versions=[9, 10, 12]" in result.output
    assert "+    12: {" in result.output
    assert result.output.count("-#if (defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && (__CUDA_ARCH__ < 1200))") == 13
    assert snapshot(serving_env) == before


def test_apply_removes_only_trtllm_comm_from_the_jit_cache(sm120patch, serving_env):
    kept = []
    for arch in ("120a", "90a_120a"):
        for module in ("trtllm_comm", "norm", "sampling"):
            entry = serving_env.jit_entry(arch, module)
            entry.mkdir(parents=True)
            (entry / f"{module}.so").write_bytes(b"\x7fELF")
            if module != "trtllm_comm":
                kept.append(entry)
    other_version = serving_env.jit_entry("120a", "trtllm_comm", version="0.6.3")
    other_version.mkdir(parents=True)

    before = snapshot(serving_env)
    result = sm120patch("apply", "--flashinfer", "0.6.4")
    assert result.exit_code == 0
    assert result.output.count("  removed stale entry ") == 2
    assert f"JIT cache base: {serving_env.home} (--jit-cache-base)" in result.output
    assert not serving_env.jit_entry("120a", "trtllm_comm").exists()
    assert not serving_env.jit_entry("90a_120a", "trtllm_comm").exists()
    assert all((entry / f"{entry.name}.so").exists() for entry in kept)
    assert other_version.exists()  # another release's cache is not ours to touch
    # In the cache: the two entries went, and FlashInfer's build lock of each arch directory
    # (which sm120patch holds while it removes them) exists; nothing else.
    cache = {p for p in changed(before, snapshot(serving_env)) if p.startswith(str(serving_env.home))}
    assert {p for p in cache if "/cached_ops/tmp" not in p} == {
        str(serving_env.jit_entry(arch, "trtllm_comm")) + suffix
        for arch in ("120a", "90a_120a") for suffix in ("", "/trtllm_comm.so")}


def test_sglang_only_apply_keeps_the_jit_cache(sm120patch, serving_env):
    entry = serving_env.jit_entry("120a", "trtllm_comm")
    entry.mkdir(parents=True)
    (entry / "trtllm_comm.so").write_bytes(b"built from FlashInfer's sources, which this apply leaves alone")
    cache = tree_snapshot(serving_env.home)
    before = snapshot(serving_env)
    applied = sm120patch("apply", "--sglang", "0.5.9")
    assert applied.exit_code == 0, applied.output
    assert tree_snapshot(serving_env.home) == cache and "JIT" not in applied.output
    assert {p for p in changed(before, snapshot(serving_env)) if "/.sm120patch" not in p} == {str(serving_env.file(COMMUNICATOR))}


def test_opt_in_patches_need_with(sm120patch, serving_env):
    assert sm120patch("apply", "--sglang", "0.5.9").exit_code == 0
    assert "is_sm120_supported()" not in serving_env.file(SERVER_ARGS).read_text().split("def _handle_model_specific_adjustments")[1][:6000]
    result = sm120patch("apply", "--sglang", "0.5.9", "--with", "auto-enable")
    assert result.exit_code == 0, result.output
    assert "sglang 0.5.9: patched 1 file\n" in result.output  # communicator.py untouched
    assert "or (is_sm120_supported() and self.tp_size == 2))" in serving_env.file(SERVER_ARGS).read_text()  # TP2 only
    assert sm120patch("revert").exit_code == 0
    assert serving_env.record_mismatches() == []


def test_force_patches_a_drifted_file_by_meaning_and_revert_restores_its_bytes(sm120patch, serving_env):
    """A local change the rewriters can still read (a comment at the top of comm.py): refused,
    then patched by meaning with --force, shown as forced and unpinned, and revert puts back the
    bytes sm120patch replaced (the user's change), not the release's."""
    comm = serving_env.file(COMM)
    edited = "# local: pinned build of our image\n" + comm.read_text()
    comm.write_text(edited)
    assert sm120patch("apply", "--flashinfer").exit_code == ExitCode.REFUSED
    forced = sm120patch("apply", "--flashinfer", "--force")
    assert forced.exit_code == 0, forced.output
    assert comm.read_text().startswith("# local: pinned build") and "[9, 10, 12]" in comm.read_text()
    status = sm120patch("status", "--flashinfer")
    assert re.search(r"jit-gate +applied \(forced\)", status.output)
    assert "applied with --force to bytes no vendor manifest vouches for (unpinned)" in status.output
    assert sm120patch("revert", "--flashinfer").exit_code == 0
    assert comm.read_text() == edited
    assert serving_env.record_mismatches() == [COMM]


def test_status_reports_a_stale_entry(sm120patch, serving_env):
    """An entry older than the patched sources (built before, copied in, restored from a
    backup) is stale: status says so; apply moves it out of the way."""
    import os

    assert sm120patch("apply", "--flashinfer").exit_code == 0
    entry = serving_env.jit_entry("120a", "trtllm_comm")
    entry.mkdir(parents=True)
    (entry / "trtllm_comm.so").write_bytes(b"\x7fELF")
    os.utime(entry / "trtllm_comm.so", (1_000_000, 1_000_000))
    status = sm120patch("status", "--flashinfer")
    assert "stale" in status.output and str(entry) in status.output
    again = sm120patch("apply", "--flashinfer")
    assert again.exit_code == 0 and f"removed stale entry {entry}" in again.output and not entry.exists()


def test_aot_module_that_shadows_the_patched_sources_is_reported(sm120patch, serving_env):
    aot = serving_env.file("flashinfer/data/aot/trtllm_comm/trtllm_comm.so")
    aot.parent.mkdir(parents=True)
    aot.write_bytes(b"\x7fELF")
    status = sm120patch("status")
    assert f"AOT: {aot}" in status.output
    assert "uninstall flashinfer-jit-cache" in status.output
    applied = sm120patch("apply")
    assert applied.exit_code == 0
    assert f"warning: prebuilt {aot} (flashinfer/data/aot)" in applied.output


def test_flashinfer_jit_cache_with_a_prebuilt_trtllm_comm_is_reported(sm120patch, serving_env):
    """flashinfer-jit-cache (a separate, multi-GB distribution) is stood in for by its
    metadata: what sm120patch reads is its RECORD, which lists the prebuilt module."""
    dist_info = serving_env.site_packages / "flashinfer_jit_cache-0.6.4+cu130.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: flashinfer-jit-cache\nVersion: 0.6.4+cu130\n")
    (dist_info / "RECORD").write_text(
        "flashinfer_jit_cache/jit_cache/trtllm_comm/trtllm_comm.so,,\n"
        "flashinfer_jit_cache-0.6.4+cu130.dist-info/RECORD,,\n"
    )
    status = sm120patch("status", "--json")
    (shadow,) = json.loads(status.output)["aot_shadowing"]
    assert shadow["source"] == "flashinfer-jit-cache 0.6.4+cu130"
    assert shadow["path"].endswith("flashinfer_jit_cache/jit_cache/trtllm_comm/trtllm_comm.so")
