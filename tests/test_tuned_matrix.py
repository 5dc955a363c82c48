"""Tuned limits on every range of releases the patch data distinguishes (each patches/*/X.toml):
that range's lowest and highest release, from its real wheel, patched with `--with tuned-limits`
as the patch data says.

vLLM: the module-level code of the patched fusion file as written (its two tables, the inserted
code, the narrowing statement, from 0.29 vLLM's own one-shot selector) runs in a process of its
own, at import as the server runs it, under a profile whose limits are not whole tokens: the SM120
rows, and the one-shot choice the fused call hands FlashInfer at 1..TP tokens and at each
limit -1, +0, +1 byte, are what the profile says; with no profile and with each bad one,
everything equals the patch set without tuned-limits. CI runs the releases test_matrix.py
installs for vLLM (each set's first release and the newest: its wheels are ~400 MB);
SM120PATCH_FULL_MATRIX=1 runs every set's lowest and highest.

SGLang: what the inserted code asks of the server (`_sm120patch_sglang_served`, one per patch set)
names only what that release's own modules bind, read from its wheel. The patched decision code
itself, on every set's lowest and highest release, imported with its dependencies as the server
imports it: tests/test_verify_tuned.py."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version

from helpers import VLLM_TUNED_MODULE, write_tuned_profile
from sm120patch.distributions import load_registry
from sm120patch.edits import apply_edits
from sm120patch.wheels import fetch_wheel

REGISTRY = load_registry(full=False)
FULL = os.environ.get("SM120PATCH_FULL_MATRIX") == "1"
NEWEST_VLLM = max(v for s in REGISTRY.get("vllm").patch_sets for v in s.versions)


def ends(distribution: str) -> list[tuple[str, str]]:
    """(patch set file, release) for each set's lowest and highest release; for vLLM outside the
    full matrix, only those test_matrix.py installs in CI (a set's first release, the newest)."""
    picked = []
    for ps in REGISTRY.get(distribution).patch_sets:
        for version in sorted({min(ps.versions), max(ps.versions)}):
            if distribution != "vllm" or FULL or version in (min(ps.versions), NEWEST_VLLM):
                picked.append((ps.path.name, str(version)))
    return picked


HIDDEN = 5120
# Limits that are not whole tokens at the served width, and not any release's default.
FUSED, ONESHOT = 37 * HIDDEN * 2 + 1234, 3 * HIDDEN * 2 - 777  # one-shot below TP4 x hidden x 2: the floor matters
TP = 4

VLLM_SCRIPT = r"""
import ast, json, logging, sys, types
path = sys.argv[1]
sizes = json.loads(sys.argv[2])
""" + VLLM_TUNED_MODULE + r"""
fused = module.FI_ALLREDUCE_FUSION_MAX_SIZE_MB.get(120)
oneshot_row = module._FI_ALLREDUCE_ONE_SHOT_MAX_SIZES_MB.get(120)
select = module.__dict__.get("_select_flashinfer_allreduce_use_oneshot")
floor = module.__dict__.get("_sm120patch_oneshot_floor", lambda choice, *args: choice)
def choice(tokens, nbytes):
    # The fused call's choice: vLLM's own rule on its row (0.29+ its selector; before, the same
    # comparison written in the call), then the floor the patch puts around it.
    if select is not None and "workspace_backend" in select.__code__.co_varnames:
        made = select("trtllm", 120, 4, nbytes)
    else:
        limit = (oneshot_row or {}).get(4)
        made = limit is None or nbytes <= limit * MiB
    return floor(made, tokens, 4, 120)
print(json.dumps({"fused": fused, "oneshot": oneshot_row, "log": [l for l in logged if l.startswith("sm120patch")],
                  "choice": [choice(t, b) for t, b in sizes]}))
"""


@pytest.mark.parametrize("name, version", ends("vllm"), ids=[f"vllm-{v}" for _, v in ends("vllm")])
def test_vllm_decisions_follow_a_profile_at_its_boundaries_and_ignore_a_bad_one(wheel_cache, tmp_path, name, version):
    patch_set = REGISTRY.get("vllm").find(Version(version))
    relpath = next(p.file for p in patch_set.patches if p.id == "tuned-limits")
    pristine = zipfile.ZipFile(fetch_wheel("vllm", version, wheel_cache)).read(relpath)
    table = [] if patch_set.patch("fusion-table").required else ["fusion-table"]

    def patched(selected: list[str]) -> Path:
        path = tmp_path / f"{'-'.join(selected) or 'plain'}.py"
        chosen = [p for p in patch_set.select(selected) if p.file == relpath]
        path.write_bytes(apply_edits(pristine, chosen, where=relpath) if chosen else pristine)
        return path

    tmp_path.chmod(0o755)
    profile = tmp_path / "tuned-limits.json"
    # Token counts 1..TP and one past, then messages at each limit -1, +0, +1 byte (a token count
    # is what vLLM's floor reads; the bytes are what its rule compares).
    sizes = [(t, t * HIDDEN * 2) for t in range(1, TP + 2)]
    sizes += [(max(TP + 1, n // (HIDDEN * 2)), n) for limit in (ONESHOT, FUSED) for n in (limit - 1, limit, limit + 1)]

    def run(path: Path) -> dict:
        proc = subprocess.run([sys.executable, "-c", VLLM_SCRIPT, str(path), json.dumps(sizes)], capture_output=True,
                              text=True, env={"PATH": "/usr/bin:/bin", "SM120PATCH_TUNED_LIMITS": str(profile)},
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    without = run(patched(table))  # the patch set without tuned-limits
    tuned = patched(table + ["tuned-limits"])
    bad = {"absent": None, "corrupt": "{", "not a profile": json.dumps({"kind": "other"}),
           "another TP": ("tp", {8: (FUSED, ONESHOT)}), "others may write it": ("mode", {TP: (FUSED, ONESHOT)})}
    for why, content in bad.items():
        profile.unlink(missing_ok=True)
        if isinstance(content, tuple):
            write_tuned_profile(profile, content[1], hidden=HIDDEN)
            if content[0] == "mode":
                profile.chmod(0o666)
        elif content is not None:
            profile.write_text(content)
            profile.chmod(0o644)
        result = run(tuned)
        # What a TP4 server decides (vLLM's rows hold every TP size: a TP8 entry is used at TP8).
        assert (result["fused"][str(TP)], result["oneshot"][str(TP)], result["choice"]) == \
            (without["fused"][str(TP)], without["oneshot"][str(TP)], without["choice"]), why
        assert len(result["log"]) == 1, why
        if why == "another TP":
            assert f"not in force at TP2 (no limits for TP2 (tuned: TP8)), TP{TP} (no limits for TP{TP}" in result["log"][0]
        else:
            assert (result["fused"], result["oneshot"]) == (without["fused"], without["oneshot"]), why
            assert result["log"][0].startswith("sm120patch tuned limits not used ("), why

    write_tuned_profile(profile, {TP: (FUSED, ONESHOT)}, hidden=HIDDEN)
    result = run(tuned)
    mib = 1024 * 1024
    assert result["fused"] == {**without["fused"], str(TP): FUSED / mib}
    assert result["oneshot"] == {**without["oneshot"], str(TP): ONESHOT / mib}
    # One-shot exactly up to the profile's limit, and at every batch of no more tokens than ranks.
    assert result["choice"] == [tokens <= TP or nbytes <= ONESHOT for tokens, nbytes in sizes]
    assert len(result["log"]) == 1 and result["log"][0].startswith(
        f"sm120patch tuned limits in force at TP{TP}: fused up to {FUSED} bytes, one-shot up to {ONESHOT} bytes")


def served_imports(text: str) -> list[tuple[str, str]]:
    """(module, name) for each name `_sm120patch_sglang_served` imports, in the patched file."""
    tree = ast.parse(text)
    [served] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_sm120patch_sglang_served"]
    return [(node.module, alias.name) for node in ast.walk(served) if isinstance(node, ast.ImportFrom)
            for alias in node.names]


def bound_in(wheel: zipfile.ZipFile, module: str, seen: frozenset = frozenset()) -> set[str]:
    """The names a module of the wheel binds at its top level (a package's star imports of its
    own submodules followed)."""
    base = module.replace(".", "/")
    path = next(p for p in (base + ".py", base + "/__init__.py") if p in wheel.namelist())
    names: set[str] = set()
    for node in ast.parse(wheel.read(path)).body:
        for sub in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(sub, (ast.FunctionDef, ast.ClassDef)):
                names.add(sub.name)
            elif isinstance(sub, (ast.Assign, ast.AnnAssign)):
                targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
                names.update(t.id for t in targets if isinstance(t, ast.Name))
            elif isinstance(sub, (ast.Import, ast.ImportFrom)):
                star = isinstance(sub, ast.ImportFrom) and any(a.name == "*" for a in sub.names)
                if star and module not in seen:
                    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
                    names |= bound_in(wheel, f"{package}.{sub.module}" if sub.level else sub.module, seen | {module})
                else:
                    names.update((a.asname or a.name).split(".")[0] for a in sub.names if a.name != "*")
    return names


@pytest.mark.parametrize("name, version", ends("sglang"), ids=[f"sglang-{v}" for _, v in ends("sglang")])
def test_sglang_asks_the_server_only_what_the_release_binds(wheel_cache, name, version):
    """`_sm120patch_sglang_served` of each patch set imports only names its release's modules
    bind (SGLang 0.5.21 stopped exporting get_tensor_model_parallel_world_size from
    sglang.srt.distributed: the inserted code that imported it raised on every call)."""
    patch_set = REGISTRY.get("sglang").find(Version(version))
    tuned = next(p for p in patch_set.patches if p.id == "tuned-limits")
    with zipfile.ZipFile(fetch_wheel("sglang", version, wheel_cache)) as wheel:
        text = apply_edits(wheel.read(tuned.file), patch_set.patches_for(tuned.file), where=version).decode()
        imports = served_imports(text)
        assert imports, version
        for module, imported in imports:
            assert imported in bound_in(wheel, module), f"{version}: {module} binds no {imported}"
