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
