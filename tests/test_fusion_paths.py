"""Past the gate, on the box our users have: the server's own workspace code, run to its decision
under a stand-in driver that answers as a PCIe SM120 GPU does (tests/standin_driver.py:
capability 12.0, no multicast, cuMulticast* -> CUDA_ERROR_NOT_SUPPORTED, unicast cuMem*
succeeding), pristine and patched. The code is the real wheels' (FlashInfer installed in the
runtime environment and patched by `sm120patch apply`; SGLang's preflight functions read from
its wheel and run as they are). docs/fusion-paths.md has the map these tests pin down."""

from __future__ import annotations

import ast
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

import standin_driver
from helpers import COMMUNICATOR, FLASHINFER_FILES, ServingEnv, Session, make_venv, need, run_cli
from sm120patch.distributions import load_registry
from sm120patch.edits import apply_edits
from sm120patch.wheels import fetch_wheel

TESTS = Path(__file__).parent
STANDIN = TESTS / "standin_driver.py"
PREFLIGHT = "sglang/srt/layers/flashinfer_comm_fusion.py"
# The functions of SGLang's preflight (0.5.11+), in the order they call each other.
PREFLIGHT_FUNCTIONS = ("_make_flashinfer_workspace_allocation_prop", "_flashinfer_trtllm_workspace_allocation_sizes",
                       "_probe_cumem_create_sequence", "_preflight_check_workspace_memory")


@pytest.fixture(scope="session")
def fusion_env(runtime_env):
    """The runtime environment (torch CPU, the real flashinfer-python 0.6.4) with the CUDA driver
    binding FlashInfer's comm package imports (cuda-python; it loads no driver until called)."""
    need(bool(standin_driver.cudart_paths()),
         "needs the CUDA toolkit's libcudart (FlashInfer's comm package looks for it among loaded libraries)")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(runtime_env.python), "install", "--quiet",
                    "--disable-pip-version-check", "cuda-python>=12.9"], check=True)
    return runtime_env


def run_standin(env, script: str, *args: str, pythonpath: str | None = None) -> dict:
    """Run ``script`` in the serving interpreter under the stand-in driver; it prints one JSON
    line (the stand-in's launcher destroys its process group after it). ``pythonpath``: a directory
    put before the environment's site-packages."""
    environ = {"PATH": "/usr/bin:/bin", "HOME": str(env.home)}
    if os.environ.get("CUDA_HOME"):
        environ["CUDA_HOME"] = os.environ["CUDA_HOME"]
    if pythonpath:
        environ["PYTHONPATH"] = pythonpath
    proc = subprocess.run([str(env.python), str(STANDIN), "-c", script, *args], capture_output=True, text=True,
                          timeout=300, env=environ)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    return json.loads(lines[-1])


# FlashInfer's unified workspace, called as SGLang 0.5.10 and vLLM 0.17+ call it.
UNIFIED = """
import json, tempfile
import standin_driver as sd
sd.install(devices=2, stop_at="cuMemCreate")
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
import flashinfer.comm as comm
try:
    comm.create_allreduce_fusion_workspace(backend="trtllm", world_size=2, rank=0, max_token_num=128,
                                           hidden_dim=4096, dtype=torch.bfloat16, force_oneshot_support=False)
    outcome = "returned"
except sd.Reached as exc:
    outcome = "reached " + str(exc)
except Exception as exc:
    outcome = type(exc).__name__ + ": " + str(exc)
print(json.dumps({"outcome": outcome, "calls": sd.CALLS}))
"""


PATHS_SCRIPT = """
import json, sys, tempfile
import standin_driver as sd
sd.install(devices=2, stop_at="cuMemCreate")
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
import flashinfer, flashinfer.comm as comm
from flashinfer.comm import trtllm_ar
sd.stop_at_runtime_allocations()
try:
    if sys.argv[1] == "legacy":  # as SGLang <= 0.5.9 and vLLM <= 0.16 call it
        trtllm_ar.trtllm_create_ipc_workspace_for_all_reduce_fusion(0, 2, 128, 4096, group=dist.group.WORLD)
    else:
        comm.create_allreduce_fusion_workspace(backend="trtllm", world_size=2, rank=0, max_token_num=128,
                                               hidden_dim=4096, dtype=torch.bfloat16)
    outcome = "returned"
except sd.Reached as exc:
    outcome = "reached " + str(exc)
except Exception as exc:
    outcome = type(exc).__name__ + ": " + str(exc)
print(json.dumps({"flashinfer": flashinfer.__version__, "outcome": outcome, "calls": sd.CALLS}))
"""
# What FlashInfer 0.6.12's comm package imports beyond the runtime environment (its own
# requirements; triton is imported by a module the package loads).
RELEASE_EXTRAS = {"0.6.12": ["cuda-tile", "triton"], "0.6.16.post4": []}


@pytest.fixture(scope="session")
def flashinfer_release(fusion_env, wheel_cache, tmp_path_factory):
    """Another FlashInfer release for the runtime environment's interpreter: a --target
    directory (the real wheel, no dependencies, plus what its comm package imports) put first
    on PYTHONPATH; one per release and test session."""
    made = {}

    def get(version: str) -> Path:
        if version not in made:
            target = tmp_path_factory.mktemp(f"flashinfer-{version}")
            subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
                            "--disable-pip-version-check", "--target", str(target),
                            str(fetch_wheel("flashinfer-python", version, wheel_cache)), *RELEASE_EXTRAS[version]],
                           check=True)
            made[version] = target
        return made[version]

    return get


@pytest.mark.parametrize("version, call, stop", [
    ("0.6.4", "legacy", "cudaMalloc"),  # CUDA IPC buffers: nothing asks about multicast
    ("0.6.12", "unified", "torch symmetric memory"),  # 0.6.10-0.6.14: torch decides, per rank
    ("0.6.12", "legacy", "torch symmetric memory"),
    ("0.6.16.post4", "unified", "cuMemCreate"),  # upstream's unicast SymmDeviceMemory (PR #3745)
])
def test_each_flashinfer_workspace_path_reaches_its_allocation_without_multicast(fusion_env, flashinfer_release,
                                                                                version, call, stop):
    """The paths that need no patch on a GPU without multicast: each gets to its first
    allocation, with no cuMulticast* call on the way."""
    pythonpath = None if version == "0.6.4" else str(flashinfer_release(version))
    result = run_standin(fusion_env, PATHS_SCRIPT, call, pythonpath=pythonpath)
    assert result["flashinfer"] == version
    assert result["outcome"] == f"reached {stop}", result
    assert [c for c in result["calls"] if c.startswith("cuMulticast")] == []


def test_flashinfer_unified_workspace_without_multicast_pristine_refuses_patched_allocates(fusion_env):
    """FlashInfer 0.6.4 (0.6.0-0.6.9 take this path): pristine, SymmDeviceMemory raises although
    the trtllm workspace asks for no multicast; with unicast-workspace it goes on to the unicast
    allocation, and nothing asks the driver anything about multicast but its support."""
    pristine = run_standin(fusion_env, UNIFIED)
    assert pristine["outcome"] == "RuntimeError: [SymmDeviceMemory] Device does not support multicasting.", pristine
    assert "cuMemCreate" not in pristine["calls"]

    session = Session(fusion_env)
    assert session("apply", "--flashinfer").exit_code == 0
    try:
        patched = run_standin(fusion_env, UNIFIED)
    finally:
        assert session("revert", "--flashinfer").exit_code == 0
    assert patched["outcome"] == "reached cuMemCreate", patched
    assert [c for c in patched["calls"] if c.startswith("cuMulticast")] == []
    assert "cuMemGetAllocationGranularity" in patched["calls"]


PREFLIGHT_SCRIPT = """
import json, sys, tempfile
import standin_driver as sd
sd.install(devices=2, multicast=sys.argv[2] == "multicast")
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
logged = []
module = sd.load_plain_functions(sys.argv[1], "sglang_preflight", logged)
proceed = module._preflight_check_workspace_memory(2, 2048, 4096, torch.bfloat16, cpu_group=dist.group.WORLD)
print(json.dumps({"proceed": proceed, "calls": sd.CALLS, "log": logged}))
"""


def preflight_bytes(version: str, wheel_cache) -> tuple[bytes, bytes]:
    """SGLang's flashinfer_comm_fusion.py of ``version``: the wheel's bytes and sm120patch's patched ones."""
    import zipfile

    wheel = fetch_wheel("sglang", version, wheel_cache)
    pristine = zipfile.ZipFile(wheel).read(PREFLIGHT)
    patch_set = load_registry().get("sglang").find(Version(version))
    patched = apply_edits(pristine, patch_set.patches_for(PREFLIGHT), where=f"sglang {version}")
    return pristine, patched


def log_verdict(tmp_path, server: str, version: str, messages: list[str], *, process: str | None = None) -> dict:
    """``check-log --json`` on what the release's own code logged under the stand-in driver, in
    that release's log format (read from its wheel, as test_logcheck does), after the settings
    line that asks for fusion: the verdict a user's log would get."""
    import test_logcheck as logs

    if server == "sglang":
        text = logs.sglang_settings(version, 2, True) + "".join(logs.sglang_line(version, " TP0", m) for m in messages)
    else:
        text = logs.vllm_settings(version, 2, True) + "".join(
            logs.vllm_line(version, process, "flashinfer_all_reduce.py:42", m, level="WARNING") for m in messages)
    log = tmp_path / f"{server}-{version}.log"
    log.write_text(text)
    result = run_cli("check-log", str(log), "--server", server, "--version", version, "--json")
    return {"exit_code": result.exit_code, **json.loads(result.output)}


@pytest.mark.parametrize("version", ["0.5.11", "0.5.14", "0.5.23"])  # the preflight's three layouts
def test_sglang_preflight_without_multicast_pristine_skips_fusion_patched_proceeds(fusion_env, wheel_cache,
                                                                                 tmp_path, version):
    pristine, patched = preflight_bytes(version, wheel_cache)
    functions = {n.name for n in ast.parse(pristine).body if isinstance(n, ast.FunctionDef)}
    assert set(PREFLIGHT_FUNCTIONS) <= functions
    results = {}
    for name, data in (("pristine", pristine), ("patched", patched)):
        path = tmp_path / f"{name}.py"
        path.write_bytes(data)
        results[name] = run_standin(fusion_env, PREFLIGHT_SCRIPT, str(path), "none")

    assert results["pristine"]["proceed"] is False
    assert "cuMulticastGetGranularity" in results["pristine"]["calls"]
    assert any("preflight probe failed" in line and "Skipping allreduce fusion" in line
               for line in results["pristine"]["log"]), results["pristine"]["log"]
    assert results["patched"]["proceed"] is True, results["patched"]
    assert [c for c in results["patched"]["calls"] if c.startswith("cuMulticast")] == []
    assert results["patched"]["calls"].count("cuMemCreate") == 3  # the three buffers, probed unicast
    assert results["patched"]["log"] == []
    # What that code logged, in the release's format, is a fall-back at the workspace step.
    verdict = log_verdict(tmp_path, "sglang", version, results["pristine"]["log"])
    assert verdict["exit_code"] == 1 and verdict["verdict"] == "fell-back" and verdict["step"] == "workspace", verdict


def test_sglang_preflight_patched_still_aligns_to_multicast_where_the_gpu_has_it(fusion_env, wheel_cache, tmp_path):
    """On a GPU that reports multicast (an NVSwitch box) the patched preflight asks for the
    multicast granularity as before: the patch changes nothing there."""
    _, patched = preflight_bytes("0.5.14", wheel_cache)
    path = tmp_path / "patched.py"
    path.write_bytes(patched)
    result = run_standin(fusion_env, PREFLIGHT_SCRIPT, str(path), "multicast")
    assert result["calls"].count("cuMulticastGetGranularity") == 3
    assert result["proceed"] is True and result["calls"].count("cuMemCreate") == 3


@pytest.mark.parametrize("server, version, flashinfer, needs", [
    ("sglang", "0.5.9", "0.6.4", ()),
    ("sglang", "0.5.10", "0.6.7.post2", ("flashinfer-python:unicast-workspace",)),
    ("sglang", "0.5.10", "0.6.12", ()),
    ("sglang", "0.5.11", "0.6.8.post1", ("sglang:preflight-unicast", "flashinfer-python:unicast-workspace")),
    ("sglang", "0.5.14", "0.6.12", ("sglang:preflight-unicast",)),
    ("sglang", "0.5.23", "0.7.2", ("sglang:preflight-unicast",)),
    ("vllm", "0.16.0", "0.6.3", ()),
    ("vllm", "0.17.0", "0.6.4", ("flashinfer-python:unicast-workspace",)),
    ("vllm", "0.21.0", "0.6.8.post1", ("flashinfer-python:unicast-workspace",)),
    ("vllm", "0.22.0", "0.6.11.post2", ()),
    ("vllm", "0.33.0", "0.7.2.post1", ()),
])
def test_the_map_names_what_each_pinned_combination_needs(server, version, flashinfer, needs):
    """The releases each server pins (docs/fusion-paths.md), against the data status reads."""
    row = load_registry().get(server).fusion_path(Version(version), Version(flashinfer))
    assert row is not None
    assert tuple(f"{owner}:{patch_id}" for owner, patch_id in row.needs) == needs


def test_a_pair_that_falls_back_is_told_so_and_the_printed_command_makes_it_fuse(tmp_path, wheel_cache):
    """SGLang 0.5.11 with the FlashInfer it pins (0.6.8.post1), as released: the fusion chain
    blocks at FlashInfer's gates first, and its workspace step names both patches without which
    the server falls back on a PCIe GPU; the printed command, run exactly as printed, applies
    them all, and the headline then says it fuses with the release's flag (the files are the
    manifest's patched bytes). The device step points at doctor, which works as printed too."""
    env = ServingEnv(tmp_path / "venv", tmp_path / "home")
    make_venv(env.root, [fetch_wheel("flashinfer-python", "0.6.8.post1", wheel_cache),
                         fetch_wheel("sglang", "0.5.11", wheel_cache)])
    before = run_cli("status", "--python", str(env.python), "--json")
    fusion = next(d for d in json.loads(before.output)["distributions"] if d["name"] == "sglang")["fusion"]
    steps = {s["id"]: s for s in fusion["steps"]}
    assert fusion["verdict"] == "will not fuse"
    assert fusion["headline"].startswith("sglang 0.5.11 will not fuse on SM120: flashinfer-python 0.6.8.post1's "
                                         "SM120 gates are closed")
    assert steps["workspace"]["result"] == "blocks"
    assert "until sglang:preflight-unicast, flashinfer-python:unicast-workspace is applied" in steps["workspace"]["text"]
    assert "preflight probe failed" in steps["workspace"]["text"]
    printed = fusion["headline"].rsplit("`", 2)[1]
    assert printed == steps["workspace"]["fix"] == f"sm120patch apply --python {env.python}"
    assert run_cli(*shlex.split(printed)[1:]).exit_code == 0

    after = run_cli("status", "--python", str(env.python))
    assert after.exit_code == 0, after.output
    assert ("  - sglang 0.5.11 will fuse on an SM120 GPU when started with `--enable-flashinfer-allreduce-fusion`;"
            in after.output)
    assert "    workspace     ok       workspace preflight, then the unified workspace" in after.output
    pointer = next(line for line in after.output.splitlines() if "check: `sm120patch doctor" in line).rsplit("`", 2)[1]
    doctor = run_cli(*shlex.split(pointer)[1:])
    assert doctor.exit_code == 0 and "sglang 0.5.11 will fuse on " in doctor.output  # these GPUs, or an SM120 GPU
    assert sorted(env.record_mismatches()) == sorted([PREFLIGHT, COMMUNICATOR, *FLASHINFER_FILES])


# bench's worker creating the workspace as the server does: SGLang 0.5.14's own preflight
# (its functions, loaded as a module), then FlashInfer's unified call.
BENCH_SCRIPT = """
import json, sys, tempfile
import standin_driver as sd
sd.install(devices=2, stop_at="cuMemCreate", answer_first=3 if sys.argv[2] == "stop" else 10**6)
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
logged = []
sd.load_plain_functions(sys.argv[1], "sglang_preflight", logged)
worker = {"__name__": "bench_worker"}
exec(compile(open(sys.argv[3]).read(), sys.argv[3], "exec"), worker)
paths = [{"server": "a server that does not import here", "workspace": "legacy", "preflight": "no_such_module:check"},
         {"server": "sglang 0.5.14 with flashinfer-python 0.6.4", "workspace": "unified",
          "preflight": "sglang_preflight:_preflight_check_workspace_memory"}][:int(sys.argv[4])]
try:
    outcome = worker["check_server_paths"](paths, 0, 2, 128, 4096, torch.bfloat16)
except worker["Failure"] as failure:
    outcome = "Failure " + failure.phase + ": " + failure.message
except sd.Reached as reached:
    outcome = "reached " + str(reached)
print(json.dumps({"outcome": outcome, "calls": sd.CALLS, "log": logged}))
"""


def test_bench_creates_the_workspace_as_the_server_does_and_fails_where_the_server_would_fall_back(
        fusion_env, wheel_cache, tmp_path):
    from sm120patch import bench

    pristine, patched = preflight_bytes("0.5.14", wheel_cache)
    (tmp_path / "pristine.py").write_bytes(pristine)
    (tmp_path / "patched.py").write_bytes(patched)
    worker = str(bench.WORKER)

    refused = run_standin(fusion_env, BENCH_SCRIPT, str(tmp_path / "pristine.py"), "go", worker, "2")
    assert refused["outcome"] == ("Failure server-path: sglang 0.5.14 with flashinfer-python 0.6.4: its own workspace "
                                  "preflight (sglang_preflight:_preflight_check_workspace_memory) skips fusion on these "
                                  "GPUs (the server would serve unfused; its log line is above)"), refused
    assert any("Skipping allreduce fusion" in line for line in refused["log"])

    # SGLang patched, FlashInfer 0.6.4 as released: past the preflight, FlashInfer refuses.
    past_preflight = run_standin(fusion_env, BENCH_SCRIPT, str(tmp_path / "patched.py"), "go", worker, "2")
    assert past_preflight["outcome"].startswith("Failure server-path: sglang 0.5.14 with flashinfer-python 0.6.4: "
                                                "FlashInfer's create_allreduce_fusion_workspace")
    assert past_preflight["outcome"].endswith("RuntimeError: [SymmDeviceMemory] Device does not support multicasting.")

    # A server whose preflight does not import in this interpreter: said, not run, not a failure.
    alone = run_standin(fusion_env, BENCH_SCRIPT, str(tmp_path / "patched.py"), "go", worker, "1")
    assert alone["outcome"] == [{"server": "a server that does not import here", "workspace": "legacy",
                                 "preflight": "not importable in this interpreter (ModuleNotFoundError: No module "
                                              "named 'no_such_module'): not run"}]

    session = Session(fusion_env)
    assert session("apply", "--flashinfer").exit_code == 0
    try:
        fused = run_standin(fusion_env, BENCH_SCRIPT, str(tmp_path / "patched.py"), "stop", worker, "2")
    finally:
        assert session("revert", "--flashinfer").exit_code == 0
    # The preflight probes its three buffers (answered), then FlashInfer's own allocation begins
    # (where the stand-in stops), with no multicast call anywhere.
    assert fused["outcome"] == "reached cuMemCreate" and fused["calls"].count("cuMemCreate") == 4, fused
    assert not [c for c in fused["calls"] if c.startswith("cuMulticast")]
    assert fused["log"] == []


# vLLM's own workspace manager (vllm/distributed/device_communicators/flashinfer_all_reduce.py,
# 0.19+), its functions loaded as a module, called as the fusion pass calls it on one node.
VLLM_SCRIPT = """
import json, sys, tempfile, types
import standin_driver as sd
sd.install(devices=2, stop_at="cuMemCreate")
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
logged = []
# VLLM_FLASHINFER_ALLREDUCE_BACKEND at its default; VLLM_ALLREDUCE_USE_FLASHINFER (0.29+) off: it
# only sizes plain allreduces from a capability table, which the workspace path does not need.
envs = types.SimpleNamespace(VLLM_FLASHINFER_ALLREDUCE_BACKEND="auto", VLLM_ALLREDUCE_USE_FLASHINFER=False)
manager = sd.load_plain_functions(sys.argv[1], "vllm_fi_ar", logged,
                                  {"envs": envs, "get_node_count": lambda *a, **k: 1, "_node_count": lambda *a, **k: 1})
try:
    workspace = manager.get_fi_ar_workspace(2, 0, 128, 4096, torch.bfloat16, dist.group.WORLD)
    outcome = "returned " + ("None" if workspace is None else "a workspace")
except sd.Reached as exc:
    outcome = "reached " + str(exc)
except Exception as exc:
    outcome = type(exc).__name__ + ": " + str(exc)
print(json.dumps({"outcome": outcome, "calls": sd.CALLS, "log": logged}))
"""
MANAGER = "vllm/distributed/device_communicators/flashinfer_all_reduce.py"


def vllm_manager(version: str, wheel_cache, tmp_path) -> str:
    import zipfile

    path = tmp_path / f"vllm-{version}-flashinfer_all_reduce.py"
    path.write_bytes(zipfile.ZipFile(fetch_wheel("vllm", version, wheel_cache)).read(MANAGER))
    return str(path)


def test_vllm_019_manager_without_multicast_falls_back_with_flashinfer_as_released_and_fuses_patched(
        fusion_env, wheel_cache, tmp_path):
    """vLLM 0.19.0 (backend auto -> trtllm on one node) with FlashInfer 0.6.4: as released, vLLM's
    own manager catches FlashInfer's refusal and returns no workspace ("expected on GPUs without
    NVSwitch"); with unicast-workspace it reaches FlashInfer's unicast allocation."""
    manager = vllm_manager("0.19.0", wheel_cache, tmp_path)
    pristine = run_standin(fusion_env, VLLM_SCRIPT, manager)
    assert pristine["outcome"] == "returned None", pristine
    assert any("expected on GPUs without NVSwitch" in line for line in pristine["log"]), pristine["log"]
    verdict = log_verdict(tmp_path, "vllm", "0.19.0", pristine["log"], process="Worker_TP0")
    assert verdict["exit_code"] == 1 and verdict["verdict"] == "fell-back" and verdict["step"] == "workspace", verdict

    session = Session(fusion_env)
    assert session("apply", "--flashinfer").exit_code == 0
    try:
        patched = run_standin(fusion_env, VLLM_SCRIPT, manager)
    finally:
        assert session("revert", "--flashinfer").exit_code == 0
    assert patched["outcome"] == "reached cuMemCreate", patched
    assert [c for c in patched["calls"] if c.startswith("cuMulticast")] == []


def test_vllm_029_manager_tries_mnnvl_then_falls_back_to_trtllm_without_multicast(
        fusion_env, flashinfer_release, wheel_cache, tmp_path):
    """vLLM 0.29.0 (backend auto tries mnnvl first) with FlashInfer 0.6.16.post4: mnnvl fails
    without multicast, vLLM says so and falls back to trtllm, which reaches its unicast allocation:
    nothing to patch, as the map says."""
    result = run_standin(fusion_env, VLLM_SCRIPT, vllm_manager("0.29.0", wheel_cache, tmp_path),
                         pythonpath=str(flashinfer_release("0.6.16.post4")))
    assert result["outcome"] == "reached cuMemCreate", result
    assert any("falling back to trtllm" in line for line in result["log"]), result["log"]


# SGLang 0.5.10's own workspace manager (no preflight yet), called as ensure_workspace_initialized
# calls it.
SGLANG_0510_SCRIPT = """
import json, sys, tempfile
import standin_driver as sd
sd.install(devices=2, stop_at="cuMemCreate")
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
import flashinfer.comm
logged = []
module = sd.load_plain_functions(sys.argv[1], "sglang_fusion", logged, {"_flashinfer_comm": flashinfer.comm})
manager = module.FlashInferWorkspaceManager()
try:
    manager.initialize(2, 0, 128, 4096, torch.bfloat16)
    outcome = "fusion off" if module._flashinfer_allreduce_unavailable else "initialized"
except sd.Reached as exc:
    outcome = "reached " + str(exc)
print(json.dumps({"outcome": outcome, "calls": sd.CALLS, "log": logged}))
"""


def test_sglang_0510_manager_without_multicast_turns_fusion_off_as_released_and_allocates_patched(
        fusion_env, wheel_cache, tmp_path):
    import zipfile

    path = tmp_path / "sglang-0.5.10-flashinfer_comm_fusion.py"
    path.write_bytes(zipfile.ZipFile(fetch_wheel("sglang", "0.5.10", wheel_cache)).read(PREFLIGHT))
    pristine = run_standin(fusion_env, SGLANG_0510_SCRIPT, str(path))
    assert pristine["outcome"] == "fusion off", pristine
    assert pristine["log"] == ["Failed to initialize FlashInfer workspace: [SymmDeviceMemory] Device does not support "
                               "multicasting.. Disabling flashinfer allreduce fusion permanently."]
    verdict = log_verdict(tmp_path, "sglang", "0.5.10", pristine["log"])
    assert verdict["exit_code"] == 1 and verdict["verdict"] == "fell-back" and verdict["step"] == "workspace", verdict

    session = Session(fusion_env)
    assert session("apply", "--flashinfer").exit_code == 0
    try:
        patched = run_standin(fusion_env, SGLANG_0510_SCRIPT, str(path))
    finally:
        assert session("revert", "--flashinfer").exit_code == 0
    assert patched["outcome"] == "reached cuMemCreate", patched
    assert [c for c in patched["calls"] if c.startswith("cuMulticast")] == []


@pytest.mark.parametrize("version, wanted", [("0.6.4", ["12.0a"]), ("0.6.16.post4", ["12.0f"])])
def test_what_each_flashinfer_builds_for_a_detected_sm120_gpu_is_its_own_answer(fusion_env, flashinfer_release,
                                                                               monkeypatch, version, wanted):
    """An image build names the arch (`--arch 12.0a`); the server's FlashInfer, left to itself on
    an SM120 GPU, names its own: 12.0a up to 0.6.6, 12.0f from 0.6.7 with nvcc 12.9 or later. The
    answer is FlashInfer's own CompilationContext's, and `build` names the difference."""
    from sm120patch.jitbuild import arch_note, sm120_archs
    from sm120patch.ptx import find_nvcc

    need(find_nvcc() is not None, "nvcc not found (FlashInfer 0.6.7+ asks nvcc's version for SM120's suffix)")
    if version != "0.6.4":
        monkeypatch.setenv("PYTHONPATH", str(flashinfer_release(version)))
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")  # the server's own detection: never the caller's list
    assert sm120_archs(fusion_env.python) == wanted
    note = arch_note("12.0a", wanted)
    assert (note is None) is (wanted == ["12.0a"])
    if note:
        assert "FLASHINFER_CUDA_ARCH_LIST='12.0a'" in note and note.endswith("else use --arch '12.0f'"), note
