"""libcst rewriters: short inline before/after specs for each behaviour, then the real
upstream files from the wheels."""

from __future__ import annotations

import textwrap

import pytest

from helpers import wheel_file
from sm120patch.errors import PatchDataError
from sm120patch.rewriters import AlreadyApplied, Changed, NoMatch, create


def rewrite(rewriter: str, source: str, /, *, sites: int = 1, **params):
    return create(rewriter, params).rewrite(textwrap.dedent(source).encode(), sites=sites)


def assert_rewrites(rewriter: str, before: str, after: str, /, **params) -> None:
    """``before`` becomes exactly ``after``, and rewriting ``after`` says it is already applied."""
    result = rewrite(rewriter, before, **params)
    assert isinstance(result, Changed), result
    assert result.data.decode() == textwrap.dedent(after)
    again = create(rewriter, params).rewrite(result.data, sites=result.sites)
    assert again == AlreadyApplied(result.sites)


EXTEND = dict(function="gen", keyword="majors", value="12")


def test_extend_list_argument_appends_inside_the_named_function():
    assert_rewrites(
        "python.extend-list-argument",
        """\
        def gen():
            return f(majors=[9, 10])  # keep me
        def other():
            return f(majors=[9, 10])
        """,
        """\
        def gen():
            return f(majors=[9, 10, 12])  # keep me
        def other():
            return f(majors=[9, 10])
        """,
        **EXTEND,
    )


def test_extend_list_argument_refuses_a_wrong_site_count():
    result = rewrite("python.extend-list-argument", "def gen():\n    f(majors=[9])\n    f(majors=[10])\n", **EXTEND)
    assert isinstance(result, NoMatch)
    assert "expected 1 site" in result.reason and "found 2" in result.reason


def test_extend_list_argument_refuses_half_applied_sources():
    result = rewrite(
        "python.extend-list-argument", "def gen():\n    f(majors=[9, 12])\n    f(majors=[9])\n", sites=2, **EXTEND
    )
    assert isinstance(result, NoMatch)
    assert "found 1 to patch and 1 already patched" in result.reason


def test_add_import_name_keeps_one_name_per_line():
    assert_rewrites(
        "python.add-import-name",
        """\
        from pkg.utils import (
            is_a,
            is_b,
        )
        """,
        """\
        from pkg.utils import (
            is_a,
            is_b,
            is_c,
        )
        """,
        module="pkg.utils", name="is_c", after="is_b",
    )


def test_add_import_name_on_one_line():
    assert_rewrites(
        "python.add-import-name", "from m import a, b\n", "from m import a, c, b\n", module="m", name="c", after="a"
    )


def test_add_import_name_needs_the_anchor():
    result = rewrite("python.add-import-name", "from m import a\n", module="m", name="c", after="z")
    assert isinstance(result, NoMatch)


def test_insert_statement_after_the_anchor_assignment():
    assert_rewrites(
        "python.insert-statement-after",
        "x = 1\ny = f()\nz = 3\n",
        "x = 1\ny = f()\nnew = y and g()\nz = 3\n",
        anchor="y", statement="new = y and g()",
    )


def test_extend_or_condition_keeps_parentheses_and_only_whole_chains():
    assert_rewrites(
        "python.extend-or-condition",
        """\
        def pred():
            return (
                # comment stays
                (a or b)
                and c
            )
        def other():
            return a or b
        """,
        """\
        def pred():
            return (
                # comment stays
                (a or b or n)
                and c
            )
        def other():
            return a or b
        """,
        function="pred", operands=["a", "b"], add="n",
    )
    longer = rewrite("python.extend-or-condition", "def pred():\n    return a or b or z\n",
                     function="pred", operands=["a", "b"], add="n")
    assert isinstance(longer, NoMatch)  # `a or b` is only part of that chain


def test_extend_or_condition_matches_calls_by_meaning():
    assert_rewrites(
        "python.extend-or-condition",
        "def h(self):\n    if x and (is_a()  or  is_b()):\n        pass\n",
        "def h(self):\n    if x and (is_a()  or  is_b() or is_c()):\n        pass\n",
        function="h", operands=["is_a()", "is_b()"], add="is_c()",
    )


def test_copy_dict_entry_keeps_the_layout():
    assert_rewrites(
        "python.copy-dict-entry",
        """\
        SIZES = {
            9: {2: 1},
            10: {
                2: 64,  # MB
            },
        }
        """,
        """\
        SIZES = {
            9: {2: 1},
            10: {
                2: 64,  # MB
            },
            12: {
                2: 64,  # MB
            },
        }
        """,
        variable="SIZES", source_key="10", new_key="12",
    )


def test_copy_dict_entry_in_an_annotated_table():
    assert_rewrites(
        "python.copy-dict-entry",
        """\
        MAX_MB: dict[int, dict[int, float]] = {
            90: {
                2: 64,  # 64MB
            },
            100: {2: 32},
        }
        OTHER: dict[int, int] = {90: 1}
        """,
        """\
        MAX_MB: dict[int, dict[int, float]] = {
            90: {
                2: 64,  # 64MB
            },
            120: {
                2: 64,  # 64MB
            },
            100: {2: 32},
        }
        OTHER: dict[int, int] = {90: 1}
        """,
        variable="MAX_MB", source_key="90", new_key="120",
    )


def test_source_that_does_not_parse_is_no_match():
    result = rewrite("python.extend-list-argument", "def gen(:\n", **EXTEND)
    assert isinstance(result, NoMatch) and "does not parse" in result.reason


@pytest.mark.parametrize(
    "name, params, message",
    [
        ("python.nope", {}, "unknown rewriter"),
        ("python.extend-list-argument", {"function": "f", "keyword": "k"}, "missing parameter(s) value"),
        ("python.extend-list-argument", {**EXTEND, "extra": 1}, "unknown parameter(s) extra"),
        ("python.extend-list-argument", {**EXTEND, "value": "1 +"}, "not a Python expression"),
        ("python.extend-or-condition", {"function": "f", "operands": "a", "add": "b"}, "list of strings"),
        ("python.insert-statement-after", {"anchor": "x", "statement": "def ("}, "not a Python statement"),
    ],
)
def test_bad_parameters_are_patch_data_errors(name, params, message):
    with pytest.raises(PatchDataError, match=message.replace("(", r"\(").replace(")", r"\)")):
        create(name, params)


def test_jit_gate_on_the_real_comm_py(flashinfer_wheel):
    source = wheel_file(flashinfer_wheel, "flashinfer/jit/comm.py")
    result = create("python.extend-list-argument", EXTEND | {"function": "gen_trtllm_comm_module",
                                                             "keyword": "supported_major_versions"}).rewrite(source, sites=1)
    assert isinstance(result, Changed)
    changed = [(a, b) for a, b in zip(source.decode().splitlines(), result.data.decode().splitlines()) if a != b]
    assert changed == [("        supported_major_versions=[9, 10]", "        supported_major_versions=[9, 10, 12]")]
    # gen_trtllm_mnnvl_comm_module and the rest of the file are untouched byte for byte
    assert len(source) + len(", 12") == len(result.data)


def test_fusion_gate_edits_on_the_real_communicator(sglang_wheel):
    source = wheel_file(sglang_wheel, "sglang/srt/layers/communicator.py")
    for name, params in [
        ("python.add-import-name", dict(module="sglang.srt.utils", name="is_sm120_supported", after="is_sm100_supported")),
        ("python.insert-statement-after", dict(anchor="_is_sm100_supported", statement="_is_sm120_supported = _is_cuda and is_sm120_supported()")),
        ("python.extend-or-condition", dict(function="apply_flashinfer_allreduce_fusion", operands=["_is_sm90_supported", "_is_sm100_supported"], add="_is_sm120_supported")),
    ]:
        result = create(name, params).rewrite(source, sites=1)
        assert isinstance(result, Changed), (name, result)
        added = len(result.data.decode().splitlines()) - len(source.decode().splitlines())
        assert added in (0, 1), name  # one new line, or one line changed in place
        source = result.data
    text = source.decode()
    assert "    is_sm100_supported,\n    is_sm120_supported,\n)" in text
    assert "(_is_sm90_supported or _is_sm100_supported or _is_sm120_supported)" in text


REPLACE = dict(
    function="setup",
    old="# probe\nok = probe( device )\nif not ok:\n    raise RuntimeError('no')\n",
    new="if wanted:\n    ok = probe(device)\n    if not ok:\n        raise RuntimeError(\"no\")\n",
)
REPLACE_BEFORE = b'''def setup(device, wanted):
    x = 1

    # probe
    ok = probe(device)
    if not ok:
        raise RuntimeError("no")
    return x


def other(device):
    ok = probe(device)
    if not ok:
        raise RuntimeError("no")
'''
REPLACE_AFTER = b'''def setup(device, wanted):
    x = 1

    # probe
    if wanted:
        ok = probe(device)
        if not ok:
            raise RuntimeError("no")
    return x


def other(device):
    ok = probe(device)
    if not ok:
        raise RuntimeError("no")
'''


def test_replace_statements_matches_by_meaning_inside_the_named_function_only():
    """Layout, quotes and comments do not matter for the match; the same statements in another function
    are not a site; the blank line and comment above the run stay."""
    rewriter = create("python.replace-statements", REPLACE)
    result = rewriter.rewrite(REPLACE_BEFORE, sites=1)
    assert result == Changed(REPLACE_AFTER, 1)
    # The old statements reappear inside the new ones: that is the applied form, not a site.
    assert rewriter.rewrite(REPLACE_AFTER, sites=1) == AlreadyApplied(1)


def test_replace_statements_new_comments_replace_the_old_ones():
    params = dict(REPLACE, new="# only when asked (upstream's fix)\n" + REPLACE["new"])
    result = create("python.replace-statements", params).rewrite(REPLACE_BEFORE, sites=1)
    assert b"\n    x = 1\n\n    # only when asked (upstream's fix)\n    if wanted:\n" in result.data
    assert b"# probe" not in result.data


def test_replace_statements_refuses_another_count():
    twice = REPLACE_BEFORE.replace(b"    return x\n", b'    ok = probe(device)\n    if not ok:\n        raise RuntimeError("no")\n    return x\n')
    result = create("python.replace-statements", REPLACE).rewrite(twice, sites=1)
    assert isinstance(result, NoMatch) and "found 2 to patch" in result.reason


def test_replace_statements_needs_statements():
    with pytest.raises(PatchDataError, match="holds no statement"):
        create("python.replace-statements", dict(REPLACE, new="# nothing\n"))
    with pytest.raises(PatchDataError, match="not Python statements"):
        create("python.replace-statements", dict(REPLACE, old="if (:\n"))


# -- the tuned-limits rewriters -------------------------------------------------------------------

CAP = dict(function="applies", old="LIMIT", new="_cap(LIMIT, size())")


def test_replace_expression_wraps_inside_the_named_function_and_knows_its_own_result():
    assert_rewrites(
        "python.replace-expression",
        """\
        LIMIT = 2048
        def applies(n):
            return n > 0 and n <= LIMIT  # the cap
        def other(n):
            return n <= LIMIT
        """,
        """\
        LIMIT = 2048
        def applies(n):
            return n > 0 and n <= _cap(LIMIT, size())  # the cap
        def other(n):
            return n <= LIMIT
        """,
        **CAP,
    )


def test_replace_expression_matches_by_meaning_and_counts_every_site():
    source = "def applies(n):\n    if n >   LIMIT:\n        return False\n    return n <= LIMIT\n"
    result = rewrite("python.replace-expression", source, sites=2, **CAP)
    assert isinstance(result, Changed) and result.data.count(b"_cap(LIMIT, size())") == 2
    assert isinstance(rewrite("python.replace-expression", source, sites=1, **CAP), NoMatch)
    literal = dict(function="applies", old="x.shape[0] <= 2048", new="x.shape[0] <= _cap(2048, size())")
    assert isinstance(rewrite("python.replace-expression", "def applies(x):\n    return x.shape[0] <= 4096\n", **literal),
                      NoMatch)


def test_replace_argument_only_in_the_named_calls():
    assert_rewrites(
        "python.replace-argument",
        """\
        def fused(x, use_oneshot=None):
            ensure(use_oneshot=use_oneshot)
            kwargs = dict(input=x, use_oneshot=use_oneshot)
            comm.run(**kwargs)
        """,
        """\
        def fused(x, use_oneshot=None):
            ensure(use_oneshot=use_oneshot)
            kwargs = dict(input=x, use_oneshot=pick(use_oneshot, x))
            comm.run(**kwargs)
        """,
        function="fused", calls=["comm.run", "dict"], keyword="use_oneshot", old="use_oneshot",
        new="pick(use_oneshot, x)",
    )


def test_wrap_dict_entry_keeps_the_value_and_the_layout():
    assert_rewrites(
        "python.wrap-dict-entry",
        """\
        TABLE: dict[int, dict[int, float]] = {
            90: {2: 64, 4: 2},
            120: {2: 64, 4: 2},  # SM120
        }
        """,
        """\
        TABLE: dict[int, dict[int, float]] = {
            90: {2: 64, 4: 2},
            120: _row("fused", {2: 64, 4: 2}),  # SM120
        }
        """,
        variable="TABLE", key="120", wrap='_row("fused", VALUE)',
    )
    result = rewrite("python.wrap-dict-entry", "TABLE = {90: {}}\n", variable="TABLE", key="120", wrap="f(VALUE)")
    assert isinstance(result, NoMatch)
    with pytest.raises(PatchDataError, match="must name VALUE"):
        create("python.wrap-dict-entry", dict(variable="TABLE", key="120", wrap="f(x)"))


def test_insert_module_code_before_the_binding_once():
    source = '"""doc"""\nimport os\n\n# the cap\nLIMIT = 2048\n\n\ndef applies(n):\n    return n <= LIMIT\n'
    result = rewrite("python.insert-module-code", source, source="tuned-limits", before="LIMIT")
    assert isinstance(result, Changed)
    text = result.data.decode()
    # The shipped code, whole and as written, between the imports and the statement it goes before
    # (whose comment stays with it).
    from sm120patch import _tuned_runtime

    shipped = open(_tuned_runtime.__file__, encoding="utf-8").read()
    assert shipped.strip() in text
    assert text.index("import os") < text.index("def _sm120patch_tuned_limits") < text.index("# the cap\nLIMIT = 2048")
    compile(text, "patched", "exec")
    again = create("python.insert-module-code", dict(source="tuned-limits", before="LIMIT")).rewrite(result.data, sites=1)
    assert again == AlreadyApplied(1)
    with pytest.raises(PatchDataError, match="unknown source"):
        create("python.insert-module-code", dict(source="nope", before="LIMIT"))
