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

import email
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from helpers import ServingEnv, Session, make_venv, snapshot, write_tuned_profile
from sm120patch import _tuned_runtime as rt
from sm120patch import decisions
from sm120patch.data import data_dir
from sm120patch.distributions import load_registry
from sm120patch.edits import apply_edits
from sm120patch.errors import Sm120PatchError
from sm120patch.wheels import fetch_wheel

FIRST_FORM = Path(__file__).parent / "data" / "first-tuned-form"

# What SGLang's predicate modules import (communicator.py in 0.5.9, layer_boundary/residual/add_norm.py
# and flashinfer_comm_fusion.py in 0.5.21), found by importing them; torchvision's build pins torch.
# transformers at 0.5.9's pin: later releases need `kernels`, which the older transformers a release
# pins (put in front of these by the range test below) cannot work beside.
SERVER_REQUIREMENTS = [
    "torch==2.14.1", "torchvision==0.29.1", "triton", "apache-tvm-ffi!=0.1.8,!=0.1.8.post0,<0.2,>=0.1.6", "ninja",
    "packaging", "numpy", "tqdm", "requests", "einops", "tabulate", "click", "nvidia-ml-py", "filelock", "pybase64",
    "ipython", "pydantic", "aiohttp", "orjson", "pyzmq", "pillow", "fastapi", "safetensors", "openai",
    "partial-json-parser", "huggingface-hub", "transformers==4.57.1", "dill", "sentencepiece", "msgspec", "compressed-tensors",
    "gguf", "psutil", "setproctitle", "uvloop", "xgrammar",
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
    """A profile for this machine whose limits are not whole tokens (at hidden 4096, bf16)."""
    write_tuned_profile(path, {tp: (int(fused_tokens * HIDDEN * 2), int(oneshot_tokens * HIDDEN * 2))}, hidden=HIDDEN,
                        software=software)


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


# ---------------------------------------------------------------------------------------------
# Every range of SGLang releases the patch data distinguishes (each patches/sglang/X.toml): that
# range's lowest and highest release, its real wheel and the FlashInfer it pins (the first covered
# one, 0.5.0, for a pin below it), patched as the patch data says, imported in the server
# environment above in front of its packages (PYTHONPATH), with the transformers release it pins
# (and what that needs) in front of those. The probe `verify --tuned` runs asks each decision site
# the tuned-limits patch rewrites (0.5.8+: the predicate of the batch size; up to 0.5.7 the layer
# communicator's method and its gather step, each called as the server calls it) and the fused
# call's one-shot argument, in a process of its own per profile: what the server's code decides.

SGLANG = load_registry(full=False).get("sglang")
ENDS = sorted({str(v) for ps in SGLANG.patch_sets for v in (min(ps.versions), max(ps.versions))}, key=Version)
SERVED = 5120
TP = 4
# Limits that are not whole tokens at the served width, and not any release's default: fused up
# to 37.6 tokens, one-shot up to 2.4 (below TP: a batch of no more tokens than ranks stays one-shot).
FUSED, ONESHOT = int(37.6 * SERVED * 2), int(2.4 * SERVED * 2)


def requirements_of(wheel: Path) -> list[Requirement]:
    """The wheel's requirements (its METADATA's Requires-Dist), parsed."""
    with zipfile.ZipFile(wheel) as z:
        metadata = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        message = email.message_from_bytes(z.read(metadata))
    return [Requirement(line) for line in message.get_all("Requires-Dist") or []]


def pinned(wheel: Path, distribution: str) -> str | None:
    """The release of ``distribution`` the wheel pins (==), in any of its requirements (an extra's too)."""
    name = canonicalize_name(distribution)
    return next((spec.version for r in requirements_of(wheel) if canonicalize_name(r.name) == name
                 for spec in r.specifier if spec.operator == "=="), None)


def requirements(wheel: Path, names: set[str]) -> tuple[str, ...]:
    """The wheel's own requirements (not an extra's) for the distributions ``names``, as pip takes them."""
    return tuple(sorted(str(r) for r in requirements_of(wheel) if canonicalize_name(r.name) in names
                        and not (r.marker and "extra" in str(r.marker))))


@pytest.fixture(scope="module")
def pinned_transformers(server_env, tmp_path_factory):
    """transformers at a release, with what it needs, in a folder of its own (made once per release)."""
    made: dict[str, Path] = {}

    def get(version: str) -> Path:
        if version not in made:
            folder = tmp_path_factory.mktemp(f"transformers-{version}")
            subprocess.run([sys.executable, "-m", "pip", "--python", str(server_env.python), "install", "--quiet",
                            "--disable-pip-version-check", "--target", str(folder), f"transformers=={version}"],
                           check=True)
            made[version] = folder
        return made[version]

    yield get
    for folder in made.values():
        shutil.rmtree(folder, ignore_errors=True)


def patched_tree(folder: Path, server: Path, flashinfer: Path, patch_set, selected: list[str]) -> Path:
    """The two wheels' files as installed (once per folder), then every file of the server the patch
    set names, from the release's bytes, as the patches ``selected`` (with the required ones) make
    it, whatever the folder held before."""
    if not folder.exists():
        for wheel in (server, flashinfer):
            with zipfile.ZipFile(wheel) as z:
                z.extractall(folder)
    chosen = patch_set.select(selected)
    with zipfile.ZipFile(server) as z:
        for relpath in sorted({p.file for p in patch_set.patches}):
            edits = [p for p in chosen if p.file == relpath]
            (folder / relpath).write_bytes(apply_edits(z.read(relpath), edits, where=relpath) if edits else z.read(relpath))
    return folder


@pytest.mark.parametrize("version", ENDS, ids=[f"sglang-{v}" for v in ENDS])
def test_every_sglang_range_follows_a_profile_and_ignores_a_bad_one(server_env, pinned_transformers, wheel_cache,
                                                                       tmp_path, monkeypatch, version):
    patch_set = SGLANG.find(Version(version))
    sglang = fetch_wheel("sglang", version, wheel_cache)
    pin = pinned(sglang, "flashinfer_python") or "0.5.0"
    flashinfer = fetch_wheel("flashinfer-python", max(Version(pin), Version("0.5.0")).public, wheel_cache)
    transformers = pinned(sglang, "transformers")
    behind = [str(pinned_transformers(transformers))] if transformers else []

    tmp_path.chmod(0o755)
    profiles = tmp_path / "profiles"
    profiles.mkdir(mode=0o755)
    good = write_tuned_profile(profiles / "good.json", {TP: (FUSED, ONESHOT)}, hidden=SERVED)
    corrupt, stranger, planted = profiles / "corrupt.json", profiles / "stranger.json", profiles / "others.json"
    corrupt.write_text("{")
    stranger.write_text(json.dumps({"kind": "another tool's file"}))
    write_tuned_profile(planted, {TP: (FUSED, ONESHOT)}, hidden=SERVED)
    planted.chmod(0o666)  # others may write it: the server refuses it as it would a missing one
    bad = {"absent": str(profiles / "none.json"), "corrupt": str(corrupt), "not a profile": str(stranger),
           "another TP": write_tuned_profile(profiles / "tp8.json", {8: (FUSED, ONESHOT)}, hidden=SERVED),
           "others may write it": str(planted)}
    sizes = sorted({*range(1, TP + 2), *(n + d for n in (FUSED // (SERVED * 2), ONESHOT // (SERVED * 2)) for d in (-1, 0, 1))})
    cases = [{"tp": TP, "hidden": SERVED, "dtype": "bf16", "sizes": sizes, "profile": good},
             # A model wider than the one tuned: the limits are bytes, converted at the served width.
             {"tp": TP, "hidden": 7168, "dtype": "bf16", "sizes": sorted({*sizes, 26, 27, 28}), "profile": good}]
    cases += [{"tp": TP, "hidden": SERVED, "dtype": "bf16", "sizes": sizes, "profile": path} for path in bad.values()]

    def ask(tuned: bool) -> dict:
        tree = patched_tree(tmp_path / "tree", sglang, flashinfer, patch_set, ["tuned-limits"] if tuned else [])
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tree), *behind]))
        request = decisions.tuned_request(SGLANG, patch_set, [dict(c) for c in cases], tuned=tuned)
        found = decisions.run_tuned_probe(server_env.python, request)
        assert "cases" in found, found  # imported: nothing skipped, nothing raised
        for row in found["cases"]:
            assert "error" not in row and "skipped" not in row, row
        return found

    tuned, plain = ask(True), ask(False)
    caps = tuned["caps"]
    assert caps == plain["caps"] and all(isinstance(c, int) and c >= 2048 for c in caps.values()), caps
    assert set(caps) == {s["function"] for s in decisions.tuned_request(SGLANG, patch_set, [])["sites"]}
    mib = 1024 * 1024
    rule = rt._SM120PATCH_ONESHOT_RULE_MIB[TP] * mib

    # The profile, at the served width: each site fuses up to the profile's limit (never past its
    # cap), and the fused call is one-shot up to the one-shot limit and at every batch of <= TP tokens.
    for row, case in zip(tuned["cases"][:2], cases[:2]):
        width = case["hidden"] * 2
        for site, fused in row["sites"].items():
            assert fused == {str(n): 1 <= n <= min(caps[site], FUSED // width) for n in map(int, fused)}, (site, case)
        assert row["oneshot"] == {str(n): (n * width <= ONESHOT and n * width * 2 * TP <= rule) or n <= TP
                                  for n in map(int, row["oneshot"])}, case
        assert len(row["log"]) == 1 and row["log"][0].startswith(
            f"sm120patch tuned limits in force at TP{TP}: fused up to {FUSED} bytes, one-shot up to {ONESHOT} bytes")
    assert tuned["cases"][1]["sites"] != tuned["cases"][0]["sites"]  # the width changed the limit

    # The plain patch set: the release's caps, FlashInfer's one-shot rule; each bad profile: the same.
    plain_row = plain["cases"][0]
    for site, fused in plain_row["sites"].items():
        assert fused == {str(n): 1 <= n <= caps[site] for n in map(int, fused)}, site
    assert set(plain_row["oneshot"].values()) == {None}
    assert all(row["log"] == [] for row in plain["cases"])  # nothing of sm120patch's runs there
    for why, row, plain_same in zip(bad, tuned["cases"][2:], plain["cases"][2:]):
        assert (row["sites"], row["oneshot"]) == (plain_same["sites"], plain_same["oneshot"]), why
        assert len(row["log"]) == 1 and row["log"][0].startswith("sm120patch tuned limits not used ("), (why, row["log"])



# vLLM: each patch set's lowest and highest release (CI: those test_matrix.py installs, each set's
# first and the newest; SM120PATCH_FULL_MATRIX=1: all), its real wheel patched with tuned-limits
# (and fusion-table, whose SM120 rows it narrows) and the FlashInfer it pins, in front of the server
# environment above with what vLLM's fusion module imports beyond it, at the releases vLLM asks for:
# `verify --tuned`'s probe imports the module as the server does, in a process per profile.
VLLM = load_registry(full=False).get("vllm")
# Found by importing the fusion module of each release in front of the environment above.
VLLM_IMPORTS = {"cachetools", "cbor2", "cloudpickle", "llguidance", "prometheus-client", "py-cpuinfo", "openai-harmony",
                "oss-harmony", "transformers"}


def vllm_ends() -> list[str]:
    from test_tuned_matrix import ends

    return [version for _, version in ends("vllm")]


def flashinfer_at_most(pin: str, cache: Path, tmp_path: Path) -> Path:
    """The FlashInfer wheel a release pins; where the index has no wheel of it (vLLM 0.34.0 pins
    0.7.3), the newest one below it (what the fusion module imports of it is its comm package)."""
    try:
        return fetch_wheel("flashinfer-python", pin, cache)
    except Sm120PatchError:
        folder = tmp_path / "flashinfer"
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        "--disable-pip-version-check", "--dest", str(folder), f"flashinfer-python<={pin}"], check=True)
        return next(folder.glob("flashinfer_python-*.whl"))


@pytest.fixture(scope="module")
def vllm_imports(server_env, tmp_path_factory):
    """What a vLLM release's fusion module imports beyond the server environment, at the releases
    that release asks for (its own requirement lines), in a folder per set of lines."""
    made: dict[tuple, Path] = {}

    def get(wheel: Path) -> Path:
        lines = requirements(wheel, VLLM_IMPORTS)
        if lines not in made:
            folder = tmp_path_factory.mktemp("vllm-imports")
            subprocess.run([sys.executable, "-m", "pip", "--python", str(server_env.python), "install", "--quiet",
                            "--disable-pip-version-check", "--target", str(folder), *lines], check=True)
            made[lines] = folder
        return made[lines]

    yield get
    for folder in made.values():
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("version", vllm_ends(), ids=[f"vllm-{v}" for v in vllm_ends()])
def test_verify_tuned_runs_every_vllm_ranges_fusion_module_under_a_profile(server_env, vllm_imports, wheel_cache,
                                                                           tmp_path, monkeypatch, version):
    patch_set = VLLM.find(Version(version))
    vllm = fetch_wheel("vllm", version, wheel_cache)
    flashinfer = flashinfer_at_most(pinned(vllm, "flashinfer-python"), wheel_cache, tmp_path)
    table = [] if patch_set.patch("fusion-table").required else ["fusion-table"]
    behind = str(vllm_imports(vllm))

    tmp_path.chmod(0o755)
    profiles = tmp_path / "profiles"
    profiles.mkdir(mode=0o755)
    good = write_tuned_profile(profiles / "good.json", {TP: (FUSED, ONESHOT)}, hidden=SERVED)
    (profiles / "corrupt.json").write_text("{")
    sizes = sorted({*range(1, TP + 2), *(n + d for n in (FUSED // (SERVED * 2), ONESHOT // (SERVED * 2)) for d in (-1, 0, 1))})
    cases = [{"tp": TP, "hidden": SERVED, "dtype": "bf16", "sizes": sizes, "profile": good},
             {"tp": TP, "hidden": 7168, "dtype": "bf16", "sizes": sorted({*sizes, 26, 27, 28}), "profile": good},
             {"tp": TP, "hidden": SERVED, "dtype": "bf16", "sizes": sizes, "profile": str(profiles / "none.json")},
             {"tp": TP, "hidden": SERVED, "dtype": "bf16", "sizes": sizes, "profile": str(profiles / "corrupt.json")}]

    def ask(tuned: bool, asked: list[dict]) -> dict:
        tree = patched_tree(tmp_path / "tree", vllm, flashinfer, patch_set, table + (["tuned-limits"] if tuned else []))
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tree), behind]))
        request = decisions.tuned_request(VLLM, patch_set, [dict(c) for c in asked], tuned=tuned)
        found = decisions.run_tuned_probe(server_env.python, request)
        assert "cases" in found, found  # imported: nothing skipped, nothing raised
        for row in found["cases"]:
            assert "error" not in row and "skipped" not in row, row
        assert found["device"].startswith("stand-in SM120 GPU"), found["device"]
        return found

    tuned, plain = ask(True, cases), ask(False, cases[2:3])
    # The profile, at the served width: the pass fuses up to the profile's limit, and the fused call
    # is one-shot up to the one-shot limit and at every batch of no more tokens than ranks.
    for row, case in zip(tuned["cases"][:2], cases[:2]):
        width = case["hidden"] * 2
        assert row["sites"]["fusion pass"] == {str(n): n <= FUSED // width for n in case["sizes"]}, case
        assert row["oneshot"] == {str(n): n * width <= ONESHOT or n <= TP for n in case["sizes"]
                                  if n <= FUSED // width}, case
        assert len(row["log"]) == 1 and f"in force at TP{TP}: fused up to {FUSED} bytes" in row["log"][0], row["log"]
    # No profile, and a corrupt one: vLLM's own rows (fusion-table's), as without tuned-limits.
    for row in tuned["cases"][2:]:
        assert (row["sites"], row["oneshot"]) == (plain["cases"][0]["sites"], plain["cases"][0]["oneshot"])
        assert len(row["log"]) == 1 and row["log"][0].startswith("sm120patch tuned limits not used ("), row["log"]
    assert plain["cases"][0]["sites"]["fusion pass"][str(max(sizes))]  # the release fuses further than the profile


# The last test: it changes the shared environment's installed releases.
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
    # This test comes last in the file: it installs 0.5.21 over 0.5.9, with the transformers 0.5.21
    # pins (and the huggingface-hub that needs) over the ones the tests above share.
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                    "--disable-pip-version-check", str(fetch_wheel("sglang", "0.5.21", wheel_cache)),
                    str(fetch_wheel("flashinfer-python", "0.6.18", wheel_cache))], check=True)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
                    "--disable-pip-version-check", "transformers==5.12.1"], check=True)
    program, environ = first_form_sm120patch(tmp_path)
    where = ["--python", str(python), "--jit-cache-base", str(server_env.home)]
    before = snapshot(server_env)
    applied = subprocess.run([*program, "apply", *where, "--with", "tuned-limits"], capture_output=True, text=True,
                             env=environ, timeout=900)
    assert applied.returncode == 3, applied.stdout + applied.stderr
    errors = [line for line in applied.stderr.splitlines() if line.startswith("sm120patch: error:")]
    assert len(errors) == 1 and "Traceback" not in applied.stderr, applied.stderr
    assert "refused: sglang 0.5.21 at TP2: apply_flashinfer_allreduce_fusion(1 tokens) at TP2 raises ImportError" in errors[0]
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
