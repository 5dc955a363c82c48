"""The regex rewriter: exact counts, the applied form, and the real FlashInfer sources."""

from __future__ import annotations

import pytest

from helpers import wheel_file
from sm120patch.errors import PatchDataError
from sm120patch.distributions import load_registry
from sm120patch.rewriters import AlreadyApplied, Changed, NoMatch, create

GATE = dict(
    pattern=r"\(A >= 9\) && \(A < 12\)",
    replacement="(A >= 9)",
    applied_pattern=r"\(A >= 9\)\)",
)


def test_replaces_exactly_the_pinned_number_of_sites():
    source = b"#if ((A >= 9) && (A < 12))\n#endif\n#if ((A >= 9) && (A < 12))\n"
    result = create("cuda.regex-replace", GATE).rewrite(source, sites=2)
    assert result == Changed(b"#if ((A >= 9))\n#endif\n#if ((A >= 9))\n", 2)
    assert create("cuda.regex-replace", GATE).rewrite(result.data, sites=2) == AlreadyApplied(2)


def test_other_counts_are_refused_with_both_numbers():
    source = b"#if ((A >= 9) && (A < 12))\n#if ((A >= 9))\n"
    result = create("cuda.regex-replace", GATE).rewrite(source, sites=2)
    assert isinstance(result, NoMatch)
    assert "found 1" in result.reason and "1 already patched" in result.reason


def test_named_groups_in_replacements():
    params = dict(pattern=r"^(?P<indent>[ ]*)// here\n", replacement="\\g<indent>// here\n\\g<indent>check();\n",
                  applied_pattern=r"check\(\);")
    result = create("cuda.regex-replace", params).rewrite(b"{\n    // here\n}\n", sites=1)
    assert result == Changed(b"{\n    // here\n    check();\n}\n", 1)


def test_inconsistent_data_is_caught_by_the_self_check():
    params = dict(GATE, applied_pattern="never")
    with pytest.raises(PatchDataError, match="inconsistent"):
        create("cuda.regex-replace", params).rewrite(b"((A >= 9) && (A < 12))", sites=1)


def test_a_pattern_that_does_not_compile_is_patch_data_error():
    with pytest.raises(PatchDataError, match="does not compile"):
        create("cuda.regex-replace", dict(GATE, pattern="(unclosed"))


def test_binary_files_are_no_match():
    result = create("cuda.regex-replace", GATE).rewrite(b"\xff\xfe\x00", sites=1)
    assert isinstance(result, NoMatch) and "UTF-8" in result.reason


def _edits(patch_id: str):
    patch_set = load_registry().get("flashinfer-python").find(__import__("packaging.version").version.Version("0.6.4"))
    return patch_set.patch(patch_id).edits


def test_pdl_gates_on_the_real_header_remove_all_thirteen_bounds(flashinfer_wheel):
    source = wheel_file(flashinfer_wheel, "flashinfer/data/include/flashinfer/comm/trtllm_allreduce.cuh")
    assert source.count(b"__CUDA_ARCH__ < 1200") == 13
    (edit,) = _edits("pdl-gates")
    result = create(edit.rewriter, edit.params).rewrite(source, sites=edit.sites)
    assert isinstance(result, Changed) and result.sites == 13
    assert b"1200" not in result.data
    assert len(source.splitlines()) == len(result.data.splitlines())


def test_lamport_stride_on_the_real_source(flashinfer_wheel):
    source = wheel_file(flashinfer_wheel, "flashinfer/data/csrc/trtllm_allreduce.cu")
    for edit in _edits("lamport-stride"):
        result = create(edit.rewriter, edit.params).rewrite(source, sites=edit.sites)
        assert isinstance(result, Changed), result
        source = result.data
    text = source.decode()
    assert "[i + tp_size]" not in text and "[i + tp_size * 2]" not in text
    check = text.index("TVM_FFI_ICHECK(tp_size <= static_cast<int64_t>(MAX_RANKS_PER_NODE))")
    assert text.index("// add ipc buffer pointers") < check < text.index("for (int i = 0; i < tp_size; ++i)")


CLAMPED = {  # patch id -> (header, the launcher lines from the first cluster line to its loop)
    "cluster-clamp": ("trtllm_allreduce_fusion.cuh", "  int threads_per_token = params.hidden_dim / VEC_SIZE;\n",
                      "  while (threads_per_token % cluster_size != 0 && cluster_size > 1) {"),
    "cluster-clamp-moe": ("trtllm_moe_allreduce_fusion.cuh", "  int warps_per_token = (threads_per_token + 31) / 32;\n",
                          "  while (warps_per_token % cluster_size != 0) {"),
    "cluster-clamp-custom": ("trtllm_allreduce.cuh", "  int warp_min_number = heuristic_min_warp_number(",
                             "  int cta_size = warps_per_token / cluster_size * details::kWarpSize;"),
}


def _launch_sites(text: str, first: str, last: str) -> list[str]:
    sites, at = [], 0
    while (start := text.find(first, at)) >= 0 and (end := text.find(last, start)) >= 0:
        sites.append(text[start:end])
        at = end
    return sites


@pytest.fixture(scope="module")
def upstream_fixed_wheel(wheel_cache):
    from sm120patch.wheels import fetch_wheel

    return fetch_wheel("flashinfer-python", "0.6.17", wheel_cache)


@pytest.mark.parametrize("version", ["0.6.4", "0.6.16.post4"])
@pytest.mark.parametrize("patch_id", sorted(CLAMPED))
def test_the_cluster_clamp_gives_upstream_0_6_17_launch_code(patch_id, version, wheel_cache, upstream_fixed_wheel):
    """Each launcher's cluster sizing, patched, is upstream's own 0.6.17 code line for line; the
    helper it calls is upstream's body, defined in the header itself (utils.cuh, where upstream
    put it, is included by every FlashInfer module: changing it would make every cached JIT
    module stale)."""
    from sm120patch.wheels import fetch_wheel

    header, first, last = CLAMPED[patch_id]
    relpath = f"flashinfer/data/include/flashinfer/comm/{header}"
    source = wheel_file(fetch_wheel("flashinfer-python", version, wheel_cache), relpath)
    patch_set = load_registry().get("flashinfer-python").find(__import__("packaging.version").version.Version(version))
    data = source
    for edit in patch_set.patch(patch_id).edits:
        result = create(edit.rewriter, edit.params).rewrite(data, sites=edit.sites)
        assert isinstance(result, Changed), result
        data = result.data
    patched, upstream = data.decode(), wheel_file(upstream_fixed_wheel, relpath).decode()
    assert _launch_sites(source.decode(), first, last) != _launch_sites(upstream, first, last)  # the pristine differs
    assert _launch_sites(patched, first, last) == _launch_sites(upstream, first, last) != []
    utils = wheel_file(upstream_fixed_wheel, "flashinfer/data/include/flashinfer/utils.cuh").decode()
    body = lambda text: text[text.index("inline int GetMaxClusterSize("):].split("\n}\n")[0]  # noqa: E731
    assert body(patched) == body(utils)
    for edit in patch_set.patch(patch_id).edits:  # a second run finds every edit in place
        assert create(edit.rewriter, edit.params).rewrite(data, sites=edit.sites) == AlreadyApplied(edit.sites)


def test_the_fp4_block_sizes_of_0_6_0_to_0_6_3_are_capped_at_the_clamp(wheel_cache):
    """0.6.0-0.6.3 set the fused launcher's cluster again for FP4 patterns (capped at 8); without
    the cap at the clamp an FP4 launch would still ask for 8."""
    from sm120patch.wheels import fetch_wheel

    relpath = "flashinfer/data/include/flashinfer/comm/trtllm_allreduce_fusion.cuh"
    source = wheel_file(fetch_wheel("flashinfer-python", "0.6.3", wheel_cache), relpath)
    assert source.count(b"if (cluster_size > 8) cluster_size = 8;") == 3
    patch_set = load_registry().get("flashinfer-python").find(__import__("packaging.version").version.Version("0.6.3"))
    data = source
    for edit in patch_set.patch("cluster-clamp").edits:
        data = create(edit.rewriter, edit.params).rewrite(data, sites=edit.sites).data
    text = data.decode()
    assert "cluster_size > 8" not in text
    assert text.count("if (cluster_size > max_cluster_size) cluster_size = max_cluster_size;") == 3
    launcher = text[text.index("cudaError_t allreduce_fusion_kernel_launcher("):]
    assert launcher.index("static const int max_cluster_size") < launcher.index("cluster_size > max_cluster_size")
