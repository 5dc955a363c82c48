"""Tuned limits on the servers' own code: the real files of SGLang 0.5.9, 0.5.14 and 0.5.23 and vLLM
0.19, 0.29 and 0.33, patched by the patch data (`apply --with tuned-limits` on the runtime
environment's SGLang 0.5.9, the patch set's edits on the others' wheel files), decide as the profile
says, and as today's patched server does without one, with a corrupt one, or with one made for
another box or TP size. The code runs in the serving interpreter under the stand-in driver (torch
answers as an SM120 GPU): the fusion predicate and the module-level flags it reads, as the release
writes them, with the profile reader the patch inserted; only what it asks of the rest of the
server (the parallel state, the server's flags) is answered here, as a TP-N single-node server
with fusion on answers it."""

from __future__ import annotations

import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from helpers import COMMUNICATOR, Session, snapshot
from sm120patch import _tuned_runtime as rt
from sm120patch.distributions import load_registry
from sm120patch.edits import apply_edits
from sm120patch.wheels import fetch_wheel

FUSED_FILE = "sglang/srt/layers/flashinfer_comm_fusion.py"
BATCHES = [1, 2, 3, 4, 8, 16, 17, 32, 63, 64, 65, 128, 512, 1024, 2047, 2048, 2049, 4096]
HIDDEN = 4096

# What every script here starts with: the serving interpreter's torch answering as an SM120 GPU, and
# what the code logs collected.
SERVER_PROCESS = r"""
import ast, json, logging, sys, tempfile, types
import torch
torch.cuda.get_device_capability = lambda device=None: (12, 0)  # an SM120 GPU, as the server's process sees it
logged = []
class Handler(logging.Handler):
    def emit(self, record):
        logged.append(record.getMessage())
logging.getLogger().addHandler(Handler())
logging.getLogger().setLevel(logging.INFO)
"""


def run_script(env, script: str, profile: Path, *args: str) -> dict:
    """``script`` in the serving interpreter, with the profile at ``profile``; its last JSON line."""
    environ = {"PATH": "/usr/bin:/bin", "HOME": str(env.home), "SM120PATCH_TUNED_LIMITS": str(profile)}
    proc = subprocess.run([str(env.python), "-c", SERVER_PROCESS + script, *args], capture_output=True, text=True,
                          timeout=300, env=environ)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    return json.loads(lines[-1])


# Loads the patch-inserted code and the predicate from a server file, as written, into a module of
# its own, and prints, for each batch, the predicate's answer and the one-shot choice the fused call
# would be handed for it.
PREDICATE_SCRIPT = r"""
import os
path, predicate, hidden = sys.argv[1], sys.argv[2], int(sys.argv[3])
batches, cases = json.loads(sys.argv[4]), json.loads(sys.argv[5])
sys.path.insert(0, sys.argv[6])
from standin_driver import load_predicate, sglang_predicate_names
module = load_predicate(path, predicate, sglang_predicate_names(torch))
decide = getattr(module, predicate)
oneshot = module.__dict__.get("_sm120patch_use_oneshot", lambda use_oneshot, *args: use_oneshot)
results = []
for profile, tp in cases:  # each a fresh server process as far as the inserted code can tell
    os.environ["SM120PATCH_TUNED_LIMITS"] = profile
    module.__dict__.get("_SM120PATCH_SEEN", {}).clear()
    if "_sm120patch_sglang_tp_size" in module.__dict__:  # SGLang's parallel state, as a TP-N server has it
        module._sm120patch_sglang_tp_size = lambda tp=tp: tp
    del logged[:]
    results.append({"fuses": {b: bool(decide(b)) for b in batches},
                    "oneshot": {b: oneshot(None, b, b * hidden * 2, tp) for b in batches}, "log": list(logged)})
print(json.dumps({"cases": results}))
"""


def sglang_files(version: str, wheel_cache, *, tuned: bool) -> dict[str, bytes]:
    """The SGLang release's predicate and fused-call files, patched by its pinned set: the required
    patches (today's patched server), plus tuned-limits (and what it requires) when ``tuned``."""
    registry = load_registry()
    patch_set = registry.get("sglang").find(__import__("packaging.version").version.Version(version))
    chosen = patch_set.select(["tuned-limits"] if tuned else [])
    archive = zipfile.ZipFile(fetch_wheel("sglang", version, wheel_cache))
    files = {}
    for relpath in {p.file for p in patch_set.patches if p.id in ("fusion-gate", "tuned-limits", "tuned-oneshot")}:
        patches = [p for p in chosen if p.file == relpath]
        files[relpath] = apply_edits(archive.read(relpath), patches, where=relpath) if patches else archive.read(relpath)
    return files


def predicate_file(files: dict[str, bytes]) -> tuple[str, bytes]:
    return next((name, data) for name, data in files.items() if name != FUSED_FILE)


def decisions(env, path: Path, predicate: str, *cases: tuple[Path, int]) -> list[dict]:
    """What the predicate in ``path`` decides for each case (a profile, a TP size), in one process."""
    results = run_script(env, PREDICATE_SCRIPT, cases[0][0], str(path), predicate, str(HIDDEN), json.dumps(BATCHES),
                         json.dumps([[str(profile), tp] for profile, tp in cases]), str(Path(__file__).parent))["cases"]
    return [_keyed(result) for result in results]


def _keyed(result: dict) -> dict:
    result["fuses"] = {int(k): v for k, v in result["fuses"].items()}
    result["oneshot"] = {int(k): v for k, v in result["oneshot"].items()}
    return result


def write_profile(path: Path, software: dict, **entries) -> None:
    """A profile for this machine (its box as the server reads it), one entry per TP size:
    (fused tokens, one-shot tokens) at hidden 4096, bf16."""
    document = {"kind": "sm120patch tuned limits", "format": 1, "box": rt._sm120patch_box(), "entries": {
        tp.lstrip("tp"): {"created": "2026-12-05T01:30:00Z", "software": software, "nccl_env": {}, "dtype": "bf16",
                          "hidden": HIDDEN, "fused_max_bytes": fused * HIDDEN * 2, "oneshot_max_bytes": one * HIDDEN * 2}
        for tp, (fused, one) in entries.items()}}
    path.write_text(json.dumps(document))


@pytest.fixture(scope="module")
def installed(runtime_env) -> dict:
    """What the runtime environment has installed, as the server reads it (importlib.metadata)."""
    out = subprocess.run([str(runtime_env.python), "-c", "from importlib import metadata as m; import json; "
                          "print(json.dumps({n: m.version(n) for n in ('flashinfer-python', 'sglang')}))"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.parametrize("version, predicate", [
    ("0.5.14", "apply_flashinfer_allreduce_fusion"),
    ("0.5.23", "flashinfer_ar_fusion_applies"),
])
def test_sglang_predicate_follows_a_profile_and_ignores_a_bad_one(runtime_env, installed, wheel_cache, tmp_path,
                                                                  version, predicate):
    today = tmp_path / "today.py"
    today.write_bytes(predicate_file(sglang_files(version, wheel_cache, tuned=False))[1])
    tuned = tmp_path / "tuned.py"
    tuned.write_bytes(predicate_file(sglang_files(version, wheel_cache, tuned=True))[1])
    profiles = {name: tmp_path / f"{name.replace(' ', '-')}.json" for name in
                ("used", "never", "absent", "corrupt", "another TP", "another release", "another box")}
    write_profile(profiles["used"], installed, tp4=(64, 16))  # fused up to 64 tokens, one-shot up to 16
    write_profile(profiles["never"], installed, tp4=(0, 0))  # fusion never wins at TP4
    profiles["corrupt"].write_text('{"kind": "sm120patch tuned limits", "format": 1, "box": ')
    write_profile(profiles["another TP"], installed, tp8=(64, 16))
    write_profile(profiles["another release"], {**installed, "sglang": "0.5.8"}, tp4=(64, 16))
    write_profile(profiles["another box"], installed, tp4=(64, 16))
    moved = json.loads(profiles["another box"].read_text())
    moved["box"] = {"gpus": [{"bus_id": "0000:c1:00.0"}], "driver": "580.95.05"}
    profiles["another box"].write_text(json.dumps(moved))

    [baseline] = decisions(runtime_env, today, predicate, (profiles["used"], 4))
    assert baseline["fuses"] == {b: b <= 2048 for b in BATCHES}  # SGLang's own cap
    assert set(baseline["oneshot"].values()) == {None}  # FlashInfer's rule decides
    assert baseline["log"] == []  # today's patched server has no profile reader

    names = list(profiles)
    results = dict(zip(names, decisions(runtime_env, tuned, predicate, *((profiles[n], 4) for n in names))))
    used = results.pop("used")
    assert used["fuses"] == {b: b <= 64 for b in BATCHES}
    assert used["oneshot"] == {b: b <= 16 for b in BATCHES}
    assert used["log"] == [f"sm120patch tuned limits in force at TP4: fused up to {64 * HIDDEN * 2} bytes, one-shot up to "
                           f"{16 * HIDDEN * 2} bytes (profile {profiles['used']}, tuned 2026-12-05T01:30:00Z)"]
    assert not any(results.pop("never")["fuses"].values())

    # Every way a profile does not hold: exactly today's decisions, and one line saying why.
    why = {"absent": "no profile at", "corrupt": "cannot read", "another TP": "no limits for TP4 (tuned: TP8)",
           "another release": "tuned with sglang 0.5.8", "another box": "made on another box"}
    for name, result in results.items():
        assert result["fuses"] == baseline["fuses"] and result["oneshot"] == baseline["oneshot"], name
        assert len(result["log"]) == 1 and why[name] in result["log"][0], (name, result["log"])
        assert result["log"][0].endswith(": the release's own fusion limits hold"), name


def test_sglang_059_applied_follows_the_profile_and_reverts_to_the_release(runtime_env, installed, tmp_path):
    """`apply --with tuned-limits` on the runtime environment's real SGLang 0.5.9: the predicate and
    the one-shot choice follow the profile; revert gives back the release's bytes."""
    session = Session(runtime_env)
    before = snapshot(runtime_env)
    applied = session("apply", "--sglang", "--with", "tuned-limits")
    assert applied.exit_code == 0, applied.output
    try:
        profile = tmp_path / "tuned-limits.json"
        write_profile(profile, installed, tp4=(128, 32), tp8=(32, 32))
        path = runtime_env.file(COMMUNICATOR)
        at4, at8, at2 = decisions(runtime_env, path, "apply_flashinfer_allreduce_fusion", (profile, 4), (profile, 8),
                                  (profile, 2))
        assert at4["fuses"] == {b: b <= 128 for b in BATCHES}
        assert at4["oneshot"] == {b: b <= 32 for b in BATCHES}
        assert at8["fuses"] == {b: b <= 32 for b in BATCHES}
        assert at2["fuses"] == {b: b <= 2048 for b in BATCHES} and "no limits for TP2" in at2["log"][0]
        # SGLang's own fused call (flashinfer_allreduce_residual_rmsnorm, called as layernorm.py calls
        # it) hands FlashInfer's kernel the profile's one-shot choice.
        handed = fused_calls(runtime_env, profile, 4)
        assert handed["kernel"] == {str(b): b <= 32 for b in BATCHES if b <= 2048}
        assert handed["log"] == [at4["log"][0]]
        profile.unlink()
        assert set(fused_calls(runtime_env, profile, 4)["kernel"].values()) == {None}  # FlashInfer's own rule
    finally:
        reverted = session("revert", "--sglang")
    assert reverted.exit_code == 0, reverted.output
    assert snapshot(runtime_env) == before


# SGLang 0.5.9's fused call as its module has it (the functions and the workspace manager, without
# the custom-op registration), the predicate's module (the patched communicator's inserted code)
# under its own name, and FlashInfer's comm package answered by a recorder of what the kernel is
# handed: the call runs on the CPU and says which one-shot choice reached the kernel.
FUSED_SCRIPT = r"""
from typing import Optional, Tuple
import torch.distributed as dist
fused_path, predicate_path, tp, batches = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)

def load(path, name, keep, names):
    tree = ast.parse(open(path).read())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            node.decorator_list = [d for d in node.decorator_list if not ast.unparse(d).startswith("register_custom_op")]
    module = types.ModuleType(name)
    module.__dict__.update(names)
    exec(compile(ast.Module([n for n in tree.body if keep(n)], []), path, "exec"), module.__dict__)
    sys.modules[name] = module
    return module

def bound(node):
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return [node.name]
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return [t.id for t in targets if isinstance(t, ast.Name)]

predicate = load(predicate_path, "sglang.srt.layers.communicator",
                 lambda n: any(b.lower().startswith("_sm120patch") for b in bound(n)), {})
predicate._sm120patch_sglang_tp_size = lambda: tp

handed = []
class Comm:
    class AllReduceFusionPattern:
        kARResidualRMSNorm = 1
    def trtllm_create_ipc_workspace_for_all_reduce_fusion(self, *args, **kwargs):
        return "ipc handles", "workspace"
    def trtllm_allreduce_fusion(self, **kwargs):
        handed.append(kwargs["use_oneshot"])
comm = Comm()
fused = load(fused_path, "sglang_fused", lambda n: isinstance(n, (ast.FunctionDef, ast.ClassDef)) or bound(n) == ["_workspace_manager"],
             dict(torch=torch, dist=dist, Optional=Optional, Tuple=Tuple, logger=logging.getLogger("sglang_fused"),
                  is_flashinfer_available=lambda: True, get_tensor_model_parallel_world_size=lambda: tp,
                  comm=comm, _flashinfer_comm=comm))
kernel = {}
for b in batches:
    x = torch.zeros(b, 4096, dtype=torch.bfloat16)
    fused.flashinfer_allreduce_residual_rmsnorm(input_tensor=x, residual=torch.zeros_like(x),
                                                weight=torch.ones(4096, dtype=torch.bfloat16), eps=1e-6)
    kernel[b] = handed[-1]
print(json.dumps({"kernel": kernel, "log": [line for line in logged if "sm120patch" in line]}))
"""


def fused_calls(env, profile: Path, tp: int) -> dict:
    return run_script(env, FUSED_SCRIPT, profile, str(env.file(FUSED_FILE)), str(env.file(COMMUNICATOR)), str(tp),
                      json.dumps([b for b in BATCHES if b <= 2048]))


VLLM_SCRIPT = r"""
import ast, json, sys, types
path = sys.argv[1]
KEEP = ("FI_ALLREDUCE_FUSION_MAX_SIZE_MB", "_FI_ALLREDUCE_ONE_SHOT_MAX_SIZES_MB", "MiB",
        "_select_flashinfer_allreduce_use_oneshot")
def wanted(node):
    if isinstance(node, ast.FunctionDef):
        return node.name in KEEP or node.name.startswith("_sm120patch")
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return any(isinstance(t, ast.Name) and (t.id in KEEP or t.id.lower().startswith("_sm120patch")) for t in targets)
module = types.ModuleType("vllm_fusion")
tree = ast.parse(open(path).read())
exec(compile(ast.Module([n for n in tree.body if wanted(n)], []), path, "exec"), module.__dict__)
MiB = 1024 * 1024
out = {"fused": module.FI_ALLREDUCE_FUSION_MAX_SIZE_MB[120], "oneshot": module._FI_ALLREDUCE_ONE_SHOT_MAX_SIZES_MB[120]}
select = module.__dict__.get("_select_flashinfer_allreduce_use_oneshot")
if select is not None and "workspace_backend" in select.__code__.co_varnames:
    out["choice"] = {n: select("trtllm", 120, 4, n * 4096 * 2) for n in (1, 16, 17, 256, 257)}
print(json.dumps(out))
"""


@pytest.mark.parametrize("version", ["0.19.0", "0.29.0", "0.33.0"])
def test_vllm_sm120_rows_follow_a_profile_and_stay_sm90s_copy_without_one(runtime_env, wheel_cache, tmp_path, version):
    registry = load_registry()
    patch_set = registry.get("vllm").find(__import__("packaging.version").version.Version(version))
    relpath = next(p.file for p in patch_set.patches if p.id == "tuned-limits")
    pristine = zipfile.ZipFile(fetch_wheel("vllm", version, wheel_cache)).read(relpath)
    today, tuned = tmp_path / "today.py", tmp_path / "tuned.py"
    table = [p for p in patch_set.select([] if patch_set.patch("fusion-table").required else ["fusion-table"])
             if p.file == relpath]
    today.write_bytes(apply_edits(pristine, table, where=relpath))
    tuned.write_bytes(apply_edits(pristine, [p for p in patch_set.select(["tuned-limits"]) if p.file == relpath],
                                  where=relpath))
    profile = tmp_path / "tuned-limits.json"

    def run(path: Path) -> dict:
        proc = subprocess.run([str(runtime_env.python), "-c", VLLM_SCRIPT, str(path)], capture_output=True, text=True,
                              env={"PATH": "/usr/bin:/bin", "SM120PATCH_TUNED_LIMITS": str(profile)}, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    baseline = run(today)
    assert baseline["fused"] == {"2": 64, "4": 2, "8": 0.5}  # fusion-table's copy of SM90's row
    for content in (None, "{", json.dumps({"kind": "other"})):
        profile.unlink(missing_ok=True)
        if content is not None:
            profile.write_text(content)
        assert run(tuned) == baseline, content
    write_profile(profile, {"vllm": version}, tp4=(16, 16))
    with_profile = run(tuned)
    # vLLM is not installed in the runtime environment: a profile tuned with it does not hold there.
    assert with_profile == baseline
    write_profile(profile, {}, tp4=(16, 8))
    with_profile = run(tuned)
    assert with_profile["fused"] == {**baseline["fused"], "4": 16 * HIDDEN * 2 / 2 ** 20}
    assert with_profile["oneshot"] == {**baseline["oneshot"], "4": 8 * HIDDEN * 2 / 2 ** 20}
    if "choice" in with_profile:  # vLLM's own one-shot choice, on the tuned row
        assert with_profile["choice"] == {"1": True, "16": False, "17": False, "256": False, "257": False}
        assert baseline["choice"] == {"1": True, "16": True, "17": True, "256": True, "257": False}
