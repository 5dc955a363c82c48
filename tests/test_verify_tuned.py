"""`verify --tuned` and `apply --with tuned-limits`'s check after writing, on the real releases: the
server's own fusion predicate and fused-call argument, imported in the serving interpreter as the
server imports them (SGLang's modules with their dependencies installed; torch CPU, so the probe's
stand-in SM120 device answers for the GPU), asked at a profile's boundaries. Nothing sm120patch
inserts, nor anything it calls, is replaced anywhere here.

SGLang 0.5.9 with FlashInfer 0.6.4 (the field report's pair) follows a profile whose limits are not
whole tokens; SGLang 0.5.21 with the FlashInfer it pins (0.6.18), patched with the first form of
tuned-limits sm120patch shipped for it (tests/data/first-tuned-form: its runtime source, patch set
and manifest as released): its TP-size reader imports a name 0.5.21's sglang.srt.distributed no
longer exports, so every call of the patched predicate raises, and `apply --with tuned-limits`
rolls back."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ServingEnv, Session, make_venv, snapshot
from sm120patch import _tuned_runtime as rt
from sm120patch.data import data_dir
from sm120patch.wheels import fetch_wheel

FIRST_FORM = Path(__file__).parent / "data" / "first-tuned-form"

# What SGLang's predicate modules import (communicator.py in 0.5.9, layer_boundary/residual/add_norm.py
# and flashinfer_comm_fusion.py in 0.5.21), found by importing them; torchvision's build pins torch.
SERVER_REQUIREMENTS = [
    "torch==2.14.1", "torchvision==0.29.1", "triton", "apache-tvm-ffi!=0.1.8,!=0.1.8.post0,<0.2,>=0.1.6", "ninja",
    "packaging", "numpy", "tqdm", "requests", "einops", "tabulate", "click", "nvidia-ml-py", "filelock", "pybase64",
    "ipython", "pydantic", "aiohttp", "orjson", "pyzmq", "pillow", "fastapi", "safetensors", "openai",
    "partial-json-parser", "huggingface-hub", "transformers", "dill", "sentencepiece", "msgspec", "compressed-tensors",
    "gguf", "psutil", "setproctitle", "uvloop",
]
HIDDEN = 4096


@pytest.fixture(scope="module")
def server_env(tmp_path_factory, flashinfer_wheel, sglang_wheel) -> ServingEnv:
    """SGLang 0.5.9 and FlashInfer 0.6.4 (the wheels, no dependencies) with what SGLang's fusion
    modules import: several gigabytes, made once for this file and removed after it."""
    root = tmp_path_factory.mktemp("server") / "venv"
    make_venv(root, [flashinfer_wheel, sglang_wheel], linked=False)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(root / "bin" / "python"), "install", "--quiet",
                    "--disable-pip-version-check", *SERVER_REQUIREMENTS], check=True)
    home = root.parent / "home"
    home.mkdir()
    yield ServingEnv(root, home)
    shutil.rmtree(root.parent, ignore_errors=True)


def write_profile(path, software: dict, tp: int, fused_tokens: float, oneshot_tokens: float) -> None:
    """A profile for this machine (its box as the server reads it) whose limits are not whole tokens."""
    entry = {"created": "2026-12-06T03:00:00Z", "software": software, "nccl_env": {}, "dtype": "bf16",
             "hidden": HIDDEN, "fused_max_bytes": int(fused_tokens * HIDDEN * 2),
             "oneshot_max_bytes": int(oneshot_tokens * HIDDEN * 2)}
    path.write_text(json.dumps({"kind": "sm120patch tuned limits", "format": 1, "box": rt._sm120patch_box(),
                                "entries": {str(tp): entry}}))


def tuned_rows(result) -> dict[str, dict]:
    return {c["subject"]: c for c in json.loads(result.output)["checks"] if c["kind"] == "tuned"}


def test_verify_tuned_runs_sglang_059s_decisions_at_the_profiles_boundaries(server_env, tmp_path, monkeypatch):
    session = Session(server_env)
    before = snapshot(server_env)
    applied = session("apply", "--with", "tuned-limits")
    assert applied.exit_code == 0, applied.output
    # The check ran before the commit point and passed; the report says what else came, what was checked
    # on which device, and that without a profile the release's B200 limits apply.
    report = applied.output.splitlines()
    assert any(line.startswith("sglang 0.5.9: tuned-limits also applied tuned-oneshot: on SM120 the fused call")
               for line in report), applied.output
    assert "decisions checked in the target interpreter on a stand-in SM120 GPU (no SM120 GPU visible to torch here)" in report
    assert ("checked: sglang 0.5.9 at TP4: 1-4, 2047-2048 tokens: fused (FlashInfer's one-shot rule); 2049 tokens: not "
            "fused — no profile holds: the release's own limits") in report
    assert any(line.startswith("sglang 0.5.9: tuned-limits applied, but no profile holds here (no profile at ")
               for line in report), applied.output
    try:
        profile = tmp_path / "tuned-limits.json"
        monkeypatch.setenv("SM120PATCH_TUNED_LIMITS", str(profile))
        # No profile: the release's own limits, at 1..TP and its cap, and nothing raises.
        untuned = session("verify", "--tuned", "--json")
        assert untuned.exit_code == 0, untuned.output
        rows = tuned_rows(untuned)
        assert rows["sglang 0.5.9 device"]["detail"].startswith("stand-in SM120 GPU")
        assert rows["sglang 0.5.9 at TP4"]["ok"] is True
        assert rows["sglang 0.5.9 at TP4"]["detail"] == ("1-4, 2047-2048 tokens: fused (FlashInfer's one-shot rule); "
                                                         "2049 tokens: not fused — no profile holds: the release's own limits")
        # A profile: fused up to 64.5 tokens, one-shot up to 16.5 (at hidden 4096, bf16).
        write_profile(profile, {"sglang": "0.5.9", "flashinfer-python": "0.6.4"}, 4, 64.5, 16.5)
        tuned = session("verify", "--tuned")
        assert tuned.exit_code == 0, tuned.output
        assert ("PASS  tuned    sglang 0.5.9 at TP4: 1-4, 15-16 tokens: fused one-shot; 17, 63-64 tokens: fused two-shot; "
                "65, 2047-2049 tokens: not fused — as the profile says") in tuned.output
        assert "stand-in SM120 GPU (no SM120 GPU visible to torch here)" in tuned.output
        # Tuned for another release of FlashInfer: the server's own reader refuses it, and verify says so.
        write_profile(profile, {"sglang": "0.5.9", "flashinfer-python": "0.6.3"}, 4, 64.5, 16.5)
        other = tuned_rows(session("verify", "--tuned", "--json"))
        assert all(row["ok"] for row in other.values())  # sm120patch's view: no entry holds, the release's limits
        assert other["sglang 0.5.9 at TP4"]["detail"].endswith("no profile holds: the release's own limits")
    finally:
        reverted = session("revert")
    assert reverted.exit_code == 0, reverted.output
    assert snapshot(server_env) == before


def first_form_sm120patch(tmp_path: Path) -> tuple[list[str], dict]:
    """This sm120patch, inserting the first tuned-limits form it shipped for SGLang 0.5.21: that form's
    runtime source (the insert-module-code rewriter reads sm120patch/_tuned_runtime.py), patch set and
    manifest, byte for byte as released (the manifest pins the bytes the rewriters must produce). Its
    TP-size reader imports a name 0.5.21's sglang.srt.distributed no longer exports."""
    import sm120patch

    root = tmp_path / "first-form"
    shutil.copytree(Path(sm120patch.__file__).parent, root / "src" / "sm120patch",
                    ignore=shutil.ignore_patterns("__pycache__", "_data"))
    shutil.copyfile(FIRST_FORM / "_tuned_runtime.py", root / "src" / "sm120patch" / "_tuned_runtime.py")
    for name in ("patches", "vendor-manifests"):
        shutil.copytree(data_dir(name), root / "data" / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copyfile(FIRST_FORM / "sglang-0.5.21.toml", root / "data" / "patches" / "sglang" / "0.5.21.toml")
    shutil.copyfile(FIRST_FORM / "sglang-0.5.21.json", root / "data" / "vendor-manifests" / "sglang" / "0.5.21.json")
    environ = dict(os.environ, PYTHONPATH=str(root / "src"), SM120PATCH_DATA_DIR=str(root / "data"))
    return [sys.executable, "-m", "sm120patch"], environ


def test_apply_with_tuned_limits_rolls_back_where_the_servers_code_raises(server_env, wheel_cache, tmp_path):
    """SGLang 0.5.21 with FlashInfer 0.6.18 (the release it pins), and the first tuned-limits form
    sm120patch shipped for it: its TP-size reader raises ImportError at every call of the predicate,
    with or without a profile; `apply --with tuned-limits` runs the predicate before its commit point
    and rolls the whole apply back."""
    python = server_env.python
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                    "--disable-pip-version-check", str(fetch_wheel("sglang", "0.5.21", wheel_cache)),
                    str(fetch_wheel("flashinfer-python", "0.6.18", wheel_cache))], check=True)
    program, environ = first_form_sm120patch(tmp_path)
    where = ["--python", str(python), "--jit-cache-base", str(server_env.home)]
    before = snapshot(server_env)
    applied = subprocess.run([*program, "apply", *where, "--with", "tuned-limits"], capture_output=True, text=True,
                             env=environ, timeout=900)
    assert applied.returncode == 3, applied.stdout + applied.stderr
    errors = [line for line in applied.stderr.splitlines() if line.startswith("sm120patch: error:")]
    assert len(errors) == 1 and "Traceback" not in applied.stderr, applied.stderr
    assert "refused: sglang 0.5.21 at TP2: apply_flashinfer_allreduce_fusion(1) at TP2 raises ImportError" in errors[0]
    assert "in _sm120patch_sglang_tp_size" in errors[0] and errors[0].endswith("rolled back, the environment is as it was")
    assert snapshot(server_env) == before  # byte-identical: every file, its mode, the file list
    # Without tuned-limits the same sm120patch applies, and verify --tuned says there is nothing tuned to check.
    plain = subprocess.run([*program, "apply", *where], capture_output=True, text=True, env=environ, timeout=900)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    try:
        result = Session(server_env)("verify", "--tuned")
        assert "NOT RUN  tuned    tuned-limits: not run: no server here has tuned-limits applied" in result.output
    finally:
        reverted = subprocess.run([*program, "revert", *where], capture_output=True, text=True, env=environ, timeout=900)
        assert reverted.returncode == 0, reverted.stdout + reverted.stderr
    assert snapshot(server_env) == before
