"""Tuned limits on the servers' own code: the real files of SGLang 0.5.9, 0.5.14 and 0.5.23 and vLLM
0.19, 0.29 and 0.34, patched by the patch data (`apply --with tuned-limits` on the runtime
environment's SGLang 0.5.9, the patch set's edits on the others' wheel files). The code runs in the
serving interpreter, torch answering as an SM120 GPU (the device is all that is stood in): the
fusion predicate and the module-level flags it reads, as the release writes them, with every
function the patch inserted as written, nothing of it replaced. What the inserted code asks of
the rest of the server (its parallel state, the served model's width, its fusion flag) it asks
through the release's own modules, which import the whole server and its dependencies: this
environment has the release without them, so here the predicate shows that the inserted code
never raises and stands down with one line; SGLang's fused call and vLLM's tables, which ask the
server nothing, follow the profile."""

from __future__ import annotations

import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from helpers import COMMUNICATOR, VLLM_TUNED_MODULE, Session, snapshot, write_tuned_profile
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
    for kept in ("_SM120PATCH_SEEN", "_SM120PATCH_TOKENS", "_SM120PATCH_DEVICE"):  # what a process keeps
        module.__dict__.get(kept, {}).clear()
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
    """A profile for this machine, one entry per TP size (``tp4=``): (fused tokens, one-shot
    tokens) at hidden 4096, bf16."""
    limits = {tp.lstrip("tp"): (fused * HIDDEN * 2, one * HIDDEN * 2) for tp, (fused, one) in entries.items()}
    write_tuned_profile(path, limits, hidden=HIDDEN, software=software, created="2026-12-05T01:30:00Z")


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

    # The patched predicate asks the server for its TP size, hidden size and fusion flag through
    # the release's own modules (`_sm120patch_sglang_served`, as written, nothing replaced): here the
    # release is installed without its dependencies, so they cannot be imported. Whatever the
    # profile, the inserted code never raises into the server: it stands down for the process (the
    # one-shot choice too) and says why in one line, and every decision is today's.
    names = list(profiles)
    results = dict(zip(names, decisions(runtime_env, tuned, predicate, *((profiles[n], 4) for n in names))))
    for name, result in results.items():
        assert result["fuses"] == baseline["fuses"] and result["oneshot"] == baseline["oneshot"], name
        assert len(result["log"]) == 1, (name, result["log"])
        assert result["log"][0].startswith("sm120patch tuned limits not used (the profile could not be applied "
                                           "(ModuleNotFoundError: No module named "), (name, result["log"])
        assert result["log"][0].endswith(": the release's own fusion limits hold"), name


def test_sglang_059_applied_follows_the_profile_and_reverts_to_the_release(runtime_env, installed, tmp_path):
    """`apply --with tuned-limits` on the runtime environment's real SGLang 0.5.9: the fused call
    hands FlashInfer the profile's one-shot choice; the predicate, whose server modules cannot be
    imported here (see above), stands down without raising; revert gives back the release's bytes."""
    session = Session(runtime_env)
    before = snapshot(runtime_env)
    applied = session("apply", "--sglang", "--with", "tuned-limits")
    assert applied.exit_code == 0, applied.output
    try:
        profile = tmp_path / "tuned-limits.json"
        write_profile(profile, installed, tp4=(128, 32), tp8=(32, 32))
        path = runtime_env.file(COMMUNICATOR)
        for result in decisions(runtime_env, path, "apply_flashinfer_allreduce_fusion", (profile, 4), (profile, 8)):
            assert result["fuses"] == {b: b <= 2048 for b in BATCHES} and set(result["oneshot"].values()) == {None}
            assert len(result["log"]) == 1 and "the profile could not be applied (ModuleNotFoundError" in result["log"][0]
        # SGLang's own fused call (flashinfer_allreduce_residual_rmsnorm, called as layernorm.py calls
        # it) hands FlashInfer's kernel the profile's one-shot choice: one-shot up to 32 tokens, and
        # at every batch of no more tokens than ranks.
        handed = fused_calls(runtime_env, profile, 4)
        assert handed["kernel"] == {str(b): b <= 32 for b in BATCHES if b <= 2048}
        assert handed["log"] == [f"sm120patch tuned limits in force at TP4: fused up to {128 * HIDDEN * 2} bytes, one-shot "
                                 f"up to {32 * HIDDEN * 2} bytes (profile {profile}, tuned 2026-12-05T01:30:00Z)"]
        write_profile(profile, installed, tp4=(128, 1))  # a one-shot limit below what 2..4 tokens need
        assert fused_calls(runtime_env, profile, 4)["kernel"] == {str(b): b <= 4 for b in BATCHES if b <= 2048}
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
dist.destroy_process_group()  # not left to interpreter teardown, where gloo's threads can abort the process
"""


def fused_calls(env, profile: Path, tp: int) -> dict:
    return run_script(env, FUSED_SCRIPT, profile, str(env.file(FUSED_FILE)), str(env.file(COMMUNICATOR)), str(tp),
                      json.dumps([b for b in BATCHES if b <= 2048]))


VLLM_SCRIPT = r"""
import ast, json, logging, sys, types
path, profile_written = sys.argv[1], sys.argv[2] == "1"
""" + VLLM_TUNED_MODULE + r"""
out = {"fused": module.FI_ALLREDUCE_FUSION_MAX_SIZE_MB.get(120), "oneshot": module._FI_ALLREDUCE_ONE_SHOT_MAX_SIZES_MB.get(120),
       "log": [line for line in logged if line.startswith("sm120patch")]}
select = module.__dict__.get("_select_flashinfer_allreduce_use_oneshot")
floor = module.__dict__.get("_sm120patch_oneshot_floor", lambda choice, *args: choice)
if select is not None and "workspace_backend" in select.__code__.co_varnames:
    # vLLM's own choice, then the fused call's floor on it, as call_trtllm_fused_allreduce_norm makes them
    out["choice"] = {n: floor(select("trtllm", 120, 4, n * 4096 * 2), n, 4, 120) for n in (1, 4, 5, 16, 17, 256, 257)}
print(json.dumps(out))
"""


@pytest.mark.parametrize("version", ["0.19.0", "0.29.0", "0.34.0"])
def test_vllm_sm120_rows_narrow_to_a_profile_and_stay_as_applied_without_one(runtime_env, wheel_cache, tmp_path, version):
    registry = load_registry()
    patch_set = registry.get("vllm").find(__import__("packaging.version").version.Version(version))
    relpath = next(p.file for p in patch_set.patches if p.id == "tuned-limits")
    pristine = zipfile.ZipFile(fetch_wheel("vllm", version, wheel_cache)).read(relpath)
    table_required = patch_set.patch("fusion-table").required

    def patched(selected: list[str]) -> Path:
        path = tmp_path / f"{'-'.join(selected) or 'plain'}.py"
        chosen = [p for p in patch_set.select(selected) if p.file == relpath]
        path.write_bytes(apply_edits(pristine, chosen, where=relpath) if chosen else pristine)
        return path

    profile = tmp_path / "tuned-limits.json"
    tmp_path.chmod(0o755)  # the reader trusts no directory others may write

    def run(path: Path) -> dict:
        proc = subprocess.run([str(runtime_env.python), "-c", VLLM_SCRIPT, str(path), "1"], capture_output=True,
                              text=True, env={"PATH": "/usr/bin:/bin", "SM120PATCH_TUNED_LIMITS": str(profile)},
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    plain = run(patched([]))
    tabled = run(patched(["fusion-table"] if not table_required else []))
    assert tabled["fused"] == {"2": 64, "4": 2, "8": 0.5}  # fusion-table's copy of SM90's row
    with_table = patched(["tuned-limits", "fusion-table"] if not table_required else ["tuned-limits"])
    for content in (None, "{", json.dumps({"kind": "other"})):
        profile.unlink(missing_ok=True)
        if content is not None:
            profile.write_text(content)
        result = run(with_table)
        assert {k: v for k, v in result.items() if k != "log"} == {k: v for k, v in tabled.items() if k != "log"}
        assert len(result["log"]) == 1 and result["log"][0].startswith("sm120patch tuned limits not used (")
    # A profile whose one-shot limit (2 tokens at hidden 4096) is below what batches of up to TP need.
    write_profile(profile, {}, tp4=(16, 2))
    result = run(with_table)
    assert result["fused"] == {**tabled["fused"], "4": 16 * HIDDEN * 2 / 2 ** 20}
    assert result["oneshot"] == {**tabled["oneshot"], "4": 2 * HIDDEN * 2 / 2 ** 20}
    assert len(result["log"]) == 1 and "in force at TP4: fused up to 131072 bytes, one-shot up to 16384 bytes" in \
        result["log"][0] and "not in force at TP2 (no limits for TP2 (tuned: TP4)), TP8" in result["log"][0]
    if "choice" in result:  # vLLM's own one-shot choice on the narrowed row: two-shot never below TP+1 tokens
        assert result["choice"] == {"1": True, "4": True, "5": False, "16": False, "17": False, "256": False,
                                    "257": False}
        assert tabled["choice"] == {"1": True, "4": True, "5": True, "16": True, "17": True, "256": True, "257": False}
    if not table_required:  # tuned-limits alone (0.29+): no SM120 row, the plain apply's server whatever the profile
        alone = run(patched(["tuned-limits"]))
        assert alone["fused"] is None and alone["oneshot"] is None and plain["fused"] is None
        assert len(alone["log"]) == 1 and "vLLM has no SM120 fusion row to narrow" in alone["log"][0]
