"""SGLang from 0.5.15: the opt-in auto-enable (gated to TP2 on SM120) in both layouts of
arg_groups/overrides.py, the advice status, doctor and bench give per release, and the releases
that have the fusion flag but are not covered (0.4.9-0.4.10.post2). Real wheels throughout; the
auto-enable predicate is SGLang's own function, read from the wheel and run as it is."""

from __future__ import annotations

import ast
import builtins
import json
import logging
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from packaging.version import Version

from helpers import FLASHINFER_VERSION, ServingEnv, Session, changed, make_venv, run_cli, snapshot
from sm120patch import bench, pipeline
from sm120patch.distributions import load_registry
from sm120patch.errors import ExitCode
from sm120patch.edits import apply_edits
from sm120patch.semantics import evaluate
from sm120patch.wheels import fetch_wheel

OVERRIDES = "sglang/srt/arg_groups/overrides.py"
FUSION = "sglang/srt/layers/flashinfer_comm_fusion.py"
SGLANG = load_registry().get("sglang")


def pristine_and_patched(version: str, relpath: str, wheel_cache) -> tuple[bytes, bytes]:
    data = zipfile.ZipFile(fetch_wheel("sglang", version, wheel_cache)).read(relpath)
    patch_set = SGLANG.find(Version(version))
    return data, apply_edits(data, patch_set.patches_for(relpath), where=f"sglang {version}")


def platform(capability: int) -> dict:
    """What SGLang's architecture probes answer on a GPU of major ``capability`` (its utils and,
    from 0.5.19, get_platform(), which reads the same probes)."""
    flags = {"is_sm90": capability == 9, "is_sm100": capability == 10, "is_sm120": capability == 12,
             "is_blackwell": capability in (10, 12)}
    probes = {f"{name}_supported": (lambda value=value: value) for name, value in flags.items() if name != "is_blackwell"}
    return {**probes, "get_platform": lambda: SimpleNamespace(**flags)}


def real_function(source: bytes, name: str, capability: int):
    """``name`` from SGLang's module ``source``, with the module constants it reads, compiled as
    it is; the names it imports answer as on a GPU of major ``capability``. A name the function
    reads that is neither fails the test (a new release reads something new: look at it)."""
    tree = ast.parse(source)
    function = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    function.decorator_list = []  # SGLang's pass registry; not part of the decision
    loaded = {n.id for n in ast.walk(function) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    namespace = {
        "Any": object, "logger": logging.getLogger("sglang-under-test"),
        "envs": SimpleNamespace(SGLANG_FLASHINFER_MNNVL_CUTEDSL_AR_FUSION=SimpleNamespace(get=lambda: False)),
        "model_config_of": lambda view: view.get_model_config(),
        "attn_dp_enabled_of": lambda view: view.enable_dp_attention,
        "_mnnvl_supported": lambda is_multi_node=False: False,
        **platform(capability),
    }
    constants = [n for n in tree.body if isinstance(n, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id in loaded and t.id not in namespace for t in n.targets)]
    module = ast.Module(body=[*constants, function], type_ignores=[])
    exec(compile(module, f"<sglang {name}>", "exec"), namespace)
    local = {n.id for n in ast.walk(function) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    local |= {a.arg for a in function.args.args} | {"torch", "SUPPORTED_TP_SIZES"}  # MiMo's local imports
    unknown = loaded - local - set(namespace) - set(dir(builtins))
    assert not unknown, f"{name} reads {sorted(unknown)}: give them SM120's answers here"
    return namespace[name]


def view(tp: int, *, arch: str = "DeepseekV3ForCausalLM", nnodes: int = 1, backend: str | None = None):
    hf_config = SimpleNamespace(architectures=[arch], model_type="deepseek_v3", hidden_size=7168)
    return SimpleNamespace(flashinfer_allreduce_fusion_backend=backend, tp_size=tp, nnodes=nnodes,
                           enable_dp_attention=False, moe_a2a_backend="none", disable_custom_all_reduce=False,
                           attn_cp_size=1, encoder_only=False, enable_pdmux=False,
                           get_model_config=lambda: SimpleNamespace(hf_config=hf_config, dtype=None))


# 0.5.17: is_sm*_supported(), called from server_args.py; 0.5.23: get_platform(), from model_hook.py,
# with the DeepSeek V4.1 and MiMo branches.
@pytest.mark.parametrize("version", ["0.5.17", "0.5.23"])
def test_the_real_auto_enable_turns_fusion_on_at_tp2_on_sm120_only_when_patched(wheel_cache, version, monkeypatch):
    pristine, patched = pristine_and_patched(version, OVERRIDES, wheel_cache)
    assert evaluate("auto-enable-tp2", pristine)[0] is False and evaluate("auto-enable-tp2", patched)[0] is True
    name = "_flashinfer_allreduce_fusion_auto_enable"
    auto = {"flashinfer_allreduce_fusion_backend": "auto"}

    assert real_function(pristine, name, 12)(view(2)) == {}
    sm120 = real_function(patched, name, 12)
    assert sm120(view(2)) == auto
    assert sm120(view(4)) == {} and sm120(view(8)) == {}  # TP4/TP8: only the user's own flag
    assert sm120(view(2, nnodes=2)) == {}
    assert sm120(view(2, backend="trtllm")) == {}  # the user's choice stays theirs
    assert sm120(view(2, arch="LlamaForCausalLM")) == {}
    if version == "0.5.23":
        # MiMo's branch imports torch and SGLang's CuTeDSL sizes before it asks for SM100.
        for name_, attrs in (("torch", {"bfloat16": "bf16"}), ("sglang", {}), ("sglang.srt", {}), ("sglang.srt.layers", {}),
                             ("sglang.srt.layers.flashinfer_mnnvl_cutedsl", {"SUPPORTED_TP_SIZES": (2, 4, 8)})):
            monkeypatch.setitem(sys.modules, name_, SimpleNamespace(**attrs, __path__=[]))
        assert sm120(view(2, arch="MiMoV2ForCausalLM")) == {}  # its cutedsl backend is SM100's alone
    # Where SGLang already auto-enables, the patch changes nothing.
    for capability, tp in ((9, 4), (10, 8)):
        assert real_function(patched, name, capability)(view(tp)) == real_function(pristine, name, capability)(view(tp)) == auto

    # Backend "auto" resolves to trtllm on SM120 once backend-resolve is applied (mnnvl is SM100's).
    fusion_pristine, fusion_patched = pristine_and_patched(version, FUSION, wheel_cache)
    with pytest.raises(ValueError, match="requires SM90 or SM10X"):
        real_function(fusion_pristine, "_resolve_backend", 12)("auto")
    assert real_function(fusion_patched, "_resolve_backend", 12)("auto") == "trtllm"


def advice(version: str, applied=frozenset(), flashinfer: str | None = FLASHINFER_VERSION) -> list[str]:
    return [a.render(version, flashinfer or "") for a in
            SGLANG.advice_for(Version(version), frozenset(applied), Version(flashinfer) if flashinfer else None)]


PLAIN = "also sends its plain tensor-parallel allreduces through FlashInfer"
PCIE_IPC = "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1"
MLA = "pass --attention-backend flashinfer"
CUSTOM = "pass --disable-custom-all-reduce"


@pytest.mark.parametrize("version, flashinfer, present, absent", [
    ("0.5.9", "0.6.4", [MLA, CUSTOM, "only with --enable-flashinfer-allreduce-fusion"], [PLAIN, PCIE_IPC]),
    ("0.5.14", "0.6.12", ["--flashinfer-allreduce-fusion-backend trtllm", "deprecated"], [PLAIN, PCIE_IPC]),
    ("0.5.17", "0.6.12", ["or by default at TP2 with the opt-in patch auto-enable"], [PLAIN, PCIE_IPC]),
    ("0.5.18", "0.6.12", [PLAIN], [PCIE_IPC]),
    ("0.5.21", "0.6.18", [PLAIN, MLA, CUSTOM], [PCIE_IPC]),  # its pin has no PCIe-IPC kernels
    ("0.5.21", "0.7.0", [PLAIN, PCIE_IPC, "with flashinfer-python 0.7.0"], []),
    ("0.5.23", None, [PLAIN], [PCIE_IPC]),
])
def test_advice_is_given_only_where_the_installed_release_makes_it_true(version, flashinfer, present, absent):
    text = "\n".join(advice(version, flashinfer=flashinfer))
    for sentence in present:
        assert sentence in text, sentence
    for sentence in absent:
        assert sentence not in text, sentence


def test_with_auto_enable_applied_the_advice_says_what_turns_on_instead_of_offering_it():
    offered = "\n".join(advice("0.5.19"))
    applied = "\n".join(advice("0.5.19", {"fusion-gate", "auto-enable"}))
    assert "with the opt-in patch auto-enable" in offered and "(auto-enable applied)" not in offered
    assert "(auto-enable applied) switches fusion on by default on SM120 at TP2" in applied
    assert "at TP4 and TP8 it stays off unless you pass --flashinfer-allreduce-fusion-backend trtllm" in applied
    assert "with the opt-in patch auto-enable" not in applied


def sglang_env(tmp_path: Path, version: str, *others: Path) -> ServingEnv:
    root = tmp_path / "venv"
    make_venv(root, [fetch_wheel("sglang", version), *others])
    (tmp_path / "home").mkdir()
    return ServingEnv(root, tmp_path / "home")


@pytest.mark.wheels
def test_status_says_per_release_what_auto_enable_turns_on_and_revert_restores_every_byte(tmp_path):
    flashinfer = fetch_wheel("flashinfer-python", "0.7.0")  # fixed upstream; has the PCIe-IPC kernels
    env = sglang_env(tmp_path, "0.5.23", flashinfer)
    session = Session(env)
    before = snapshot(env)

    status = session("status")
    assert "at TP2 on one node" in status.output and "at TP4 and TP8 only --flashinfer-allreduce-fusion-backend trtllm" in status.output
    assert PCIE_IPC in status.output and "with flashinfer-python 0.7.0" in status.output
    assert PLAIN in status.output

    applied = session("apply", "--sglang", "--with", "auto-enable")
    assert applied.exit_code == 0, applied.output
    assert str(env.file(OVERRIDES)) in changed(before, snapshot(env))
    document = json.loads(session("status", "--json").output)
    sglang = next(d for d in document["distributions"] if d["name"] == "sglang")
    assert {p["id"]: p["state"] for p in sglang["patches"]}["auto-enable"] == "applied"
    texts = "\n".join(a["text"] for a in sglang["advice"])
    assert "(auto-enable applied) switches fusion on by default on SM120 at TP2" in texts

    # bench names this release's own flag and prints the advice about running the server.
    report = pipeline.status(pipeline.Request(python=str(env.python), jit_base=str(env.home)))
    assert bench._sglang_flag(load_registry(), report) == "--flashinfer-allreduce-fusion-backend trtllm"
    lines = [text for item in report.trees for _, text in item.advice_lines(bench=True)]
    assert any(PCIE_IPC in line for line in lines) and any(MLA in line for line in lines)
    assert not any("Benchmark before production" in line for line in lines)  # bench is that benchmark

    assert session("revert").exit_code == 0
    assert changed(before, snapshot(env)) == []


def test_bench_without_sglang_names_each_releases_flag():
    status = SimpleNamespace(trees=[])
    flag = bench._sglang_flag(load_registry(), status)
    assert flag == ("fusion (SGLang before 0.5.14: --enable-flashinfer-allreduce-fusion; "
                    "from 0.5.14: --flashinfer-allreduce-fusion-backend trtllm)")


@pytest.mark.wheels
def test_a_release_before_coverage_is_named_not_covered_and_refused_with_why(tmp_path):
    env = sglang_env(tmp_path, "0.4.9")
    session = Session(env)
    before = snapshot(env)

    status = session("status")
    assert "sglang 0.4.9: not covered" in status.output
    assert "FlashInfer 0.2.x" in status.output and "no patch set is pinned" not in status.output
    for args in (("apply", "--sglang"), ("apply", "--sglang", "--force")):
        refused = session(*args)
        assert refused.exit_code == ExitCode.REFUSED, refused.output
        assert "sglang 0.4.9 is not covered" in refused.output and "--force" not in refused.output.split("hint:")[-1]
    assert changed(before, snapshot(env)) == []

    listed = run_cli("list")
    assert "from 0.4.9, up to 0.4.10.post2  not covered: it runs FlashInfer 0.2.x" in listed.output
    rows = json.loads(run_cli("list", "--json").output)["distributions"]["sglang"]["not_covered"]
    assert rows == [{"versions": "<=0.4.10.post2,>=0.4.9", "reason": SGLANG.not_covered[0].reason}]
