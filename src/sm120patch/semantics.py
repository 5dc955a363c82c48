"""Semantic checks of each patch, independent of hashes and of the rewriters that made it:
the standard library's ``ast`` for Python and plain counting for CUDA. Each check answers
"is this change present in this file?" with a short reason."""

from __future__ import annotations
from sm120patch.words import counted

BOUND = "'__CUDA_ARCH__ < 1200' bound"

import ast
import re
from typing import Callable

Check = Callable[[str], "tuple[bool, str]"]
CHECKS: dict[str, Check] = {}


def check(patch_id: str) -> Callable[[Check], Check]:
    def register(fn: Check) -> Check:
        CHECKS[patch_id] = fn
        return fn

    return register


def evaluate(name: str, data: bytes) -> tuple[bool | None, str]:
    """Run the check ``name`` on a file's bytes: (present, why), or (None, why) when the file is
    not UTF-8 text or does not parse (every caller says that in its own words)."""
    try:
        return CHECKS[name](data.decode("utf-8"))
    except (SyntaxError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        return None, str(exc)


def _functions(tree: ast.AST, name: str) -> list[ast.FunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]


def _or_operands(node: ast.AST) -> list[list[str]]:
    return [[ast.unparse(v) for v in n.values] for n in ast.walk(node) if isinstance(n, ast.BoolOp) and isinstance(n.op, ast.Or)]


@check("jit-gate")
def jit_gate(text: str) -> tuple[bool, str]:
    for function in _functions(ast.parse(text), "gen_trtllm_comm_module"):
        for call in (n for n in ast.walk(function) if isinstance(n, ast.Call)):
            for keyword in call.keywords:
                if keyword.arg == "supported_major_versions":
                    majors = ast.literal_eval(keyword.value)
                    return 12 in majors, f"gen_trtllm_comm_module: supported_major_versions={majors}"
    return False, "gen_trtllm_comm_module passes no supported_major_versions"


@check("pdl-gates")
def pdl_gates(text: str) -> tuple[bool, str]:
    bounds = len(re.findall(r"__CUDA_ARCH__\s*<\s*1200", text))
    opened = len(re.findall(r"\(__CUDA_ARCH__ >= 900\)\)", text))
    return bounds == 0 and opened > 0, f"{counted(bounds, BOUND)} left, {counted(opened, 'SM90+ gate')} open to SM120"


@check("lamport-stride")
def lamport_stride(text: str) -> tuple[bool, str]:
    by_tp = len(re.findall(r"lamport_peer_comm_buffer_ptrs\[i \+ tp_size", text))
    by_max = len(re.findall(r"lamport_peer_comm_buffer_ptrs\[i \+ MAX_RANKS_PER_NODE", text))
    return by_tp == 0 and by_max == 2, f"lamport slots at stride tp_size: {by_tp}, at MAX_RANKS_PER_NODE: {by_max}"


@check("cluster-clamp")
def cluster_clamp(text: str) -> tuple[bool, str]:
    """Every launcher of the file sizes its thread-block cluster by what the device can launch
    (``GetMaxClusterSize``, over cudaOccupancyMaxPotentialClusterSize) instead of a fixed 8: no
    fixed size is left and at least one launch site is clamped. Upstream's 0.6.17 form passes."""
    fixed = (len(re.findall(r"\bcluster_size = 8;", text))
             + len(re.findall(r"cluster_size > 8\) cluster_size = 8;", text))
             + len(re.findall(r"int cluster_size = std::min\([^;]*details::kClusterMaxSize\);", text)))
    clamped = len(re.findall(r"GetMaxClusterSize\(\s*reinterpret_cast", text))
    return fixed == 0 and clamped > 0, (f"{counted(fixed, 'fixed cluster size')} left, {counted(clamped, 'launch', 'launches')} clamped to the "
                                        f"largest cluster the device can launch")


@check("fusion-gate")
def fusion_gate(text: str) -> tuple[bool, str]:
    """Some ``or`` in the module accepts an SM120 flag beside the SM100 one, and that flag is
    assigned at module level (its name moves between releases; the shape does not)."""
    tree = ast.parse(text)
    sm120_flags = {
        target.id
        for node in tree.body if isinstance(node, ast.Assign)
        for target in node.targets if isinstance(target, ast.Name) and "sm120" in target.id
    }
    for operands in _or_operands(tree):
        if any("sm100" in op for op in operands) and any(op in sm120_flags for op in operands):
            return True, f"fusion predicate: {' or '.join(operands)}"
    return False, "no fusion predicate accepts an SM120 flag"


@check("backend-resolve")
def backend_resolve(text: str) -> tuple[bool, str]:
    for function in _functions(ast.parse(text), "_resolve_backend"):
        for operands in _or_operands(function):
            if any("sm90" in op for op in operands):
                return any("sm120" in op for op in operands), f"_resolve_backend accepts: {' or '.join(operands)}"
    return False, "no SM90/SM100 check in _resolve_backend"


@check("auto-enable")
def auto_enable(text: str) -> tuple[bool, str]:
    for function in _functions(ast.parse(text), "_handle_model_specific_adjustments"):
        for operands in _or_operands(function):
            if any("is_sm90_supported" in op for op in operands):
                ok = any("sm120" in op for op in operands)
                return ok, f"auto-enable condition: {' or '.join(operands)}"
    return False, "no auto-enable condition found"


@check("auto-enable-tp2")
def auto_enable_tp2(text: str) -> tuple[bool, str]:
    """The architecture alternative of SGLang's auto-enable condition (0.5.15+:
    _flashinfer_allreduce_fusion_auto_enable; 0.5.8-0.5.14: _handle_model_specific_adjustments) accepts
    SM120 only together with ``tp_size == 2`` (what the evidence supports; larger TP stays the
    user's explicit choice)."""
    tree = ast.parse(text)
    # 0.5.15+: overrides.py's own function; 0.5.8-0.5.14: server_args.py's model adjustments.
    functions = [*_functions(tree, "_flashinfer_allreduce_fusion_auto_enable"),
                 *_functions(tree, "_handle_model_specific_adjustments")]
    for function in functions:
        for node in (n for n in ast.walk(function) if isinstance(n, ast.BoolOp) and isinstance(n.op, ast.Or)):
            operands = [ast.unparse(v) for v in node.values]
            if not any("sm90" in op for op in operands):
                continue
            gated = [v for v in node.values if isinstance(v, ast.BoolOp) and isinstance(v.op, ast.And)
                     and any("sm120" in ast.unparse(p) for p in v.values)
                     and any(ast.unparse(p).endswith("tp_size == 2") for p in v.values)]
            return bool(gated), f"auto-enable condition: {' or '.join(operands)}"
    return False, "no SM90 condition in SGLang's auto-enable function"


def _guarded(scope: ast.AST, names: tuple[str, ...], guard: str) -> tuple[int, int]:
    """(guarded, unguarded): the uses of ``names`` (attributes or plain names) in ``scope``, by
    whether an enclosing ``if`` tests something named like ``guard``."""
    counts = [0, 0]

    def walk(node: ast.AST, guarded: bool) -> None:
        if isinstance(node, ast.If):
            tested = guarded or any(guard in n.id if isinstance(n, ast.Name) else guard in n.attr
                                    for n in ast.walk(node.test) if isinstance(n, (ast.Name, ast.Attribute)))
            walk(node.test, guarded)
            for child in node.body:
                walk(child, tested)
            for child in node.orelse:
                walk(child, guarded)
            return
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
        if name in names:
            counts[0 if guarded else 1] += 1
        for child in ast.iter_child_nodes(node):
            walk(child, guarded)

    walk(scope, False)
    return counts[0], counts[1]


@check("unicast-workspace")
def unicast_workspace(text: str) -> tuple[bool, str]:
    """FlashInfer's SymmDeviceMemory queries multicast support and its granularity only when the
    caller asks for multicast (upstream's form from 0.6.15 passes too)."""
    classes = [n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ClassDef) and n.name == "SymmDeviceMemory"]
    if not classes:
        return False, "no SymmDeviceMemory class"
    guarded, unguarded = _guarded(classes[0], ("CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED", "cuMulticastGetGranularity"),
                                  "enable_multicast")
    return unguarded == 0 and guarded > 0, (f"SymmDeviceMemory: {unguarded} multicast query(ies) made whatever the "
                                            f"caller asks, {guarded} only when it asks for multicast")


@check("preflight-unicast")
def preflight_unicast(text: str) -> tuple[bool, str]:
    """SGLang's workspace preflight asks for the multicast granularity only where the device
    reports multicast."""
    functions = _functions(ast.parse(text), "_flashinfer_trtllm_workspace_allocation_sizes")
    if not functions:
        return False, "no _flashinfer_trtllm_workspace_allocation_sizes (the workspace preflight)"
    guarded, unguarded = _guarded(functions[0], ("cuMulticastGetGranularity",), "multicast_supported")
    return unguarded == 0 and guarded > 0, (f"preflight: cuMulticastGetGranularity asked {counted(unguarded, 'time')} on any "
                                            f"GPU, {guarded} only where the GPU reports multicast")


def _module_dicts(tree: ast.Module) -> dict[str, list]:
    """Module-level dict literals (``NAME = {...}``, annotated or not): name -> literal keys, in
    the module's order, the first binding of each name."""
    found: dict[str, list] = {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if targets and isinstance(node.value, ast.Dict):
            for target in targets:
                if isinstance(target, ast.Name):
                    found.setdefault(target.id, [ast.literal_eval(k) for k in node.value.keys if k is not None])
    return found


@check("symm-mem")
def symm_mem(text: str) -> tuple[bool, str]:
    for name, keys in _module_dicts(ast.parse(text)).items():
        if name.endswith("SYMM_MEM_ALL_REDUCE_MAX_SIZES"):
            return 12 in keys, f"{name} keys: {keys}"
    return False, "no SYMM_MEM_ALL_REDUCE_MAX_SIZES dict"


VLLM_FUSION_TABLES = ("FI_ALLREDUCE_FUSION_MAX_SIZE_MB", "_FI_ALLREDUCE_ONE_SHOT_MAX_SIZES_MB")


@check("fusion-table")
def fusion_table(text: str) -> tuple[bool, str]:
    """vLLM's pass reads both tables by compute capability (``to_int()``: 120 for SM120); with no
    120 row it logs 'not supported for world size' and stays off."""
    tables = _module_dicts(ast.parse(text))
    keys = {name: tables.get(name) for name in VLLM_FUSION_TABLES}
    missing = [name for name, found in keys.items() if found is None]
    if missing:
        return False, f"no {' or '.join(missing)} table"
    return all(120 in found for found in keys.values()), "; ".join(f"{n} keys: {k}" for n, k in keys.items())


@check("vllm-auto-enable")
def vllm_auto_enable(text: str) -> tuple[bool, str]:
    for function in _functions(ast.parse(text), "enable_allreduce_rms_fusion"):
        for operands in _or_operands(function):
            if any("capability(90)" in op for op in operands):
                return any("(120)" in op for op in operands), f"auto-enable condition: {' or '.join(operands)}"
    return False, "no SM90 condition in enable_allreduce_rms_fusion"


def _calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name]


def _defines(tree: ast.Module, name: str) -> bool:
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body)


@check("tuned-limits")
def tuned_limits(text: str) -> tuple[bool, str]:
    """SGLang's fusion predicate caps the batch by the tuned limit, with the profile reader beside it."""
    tree = ast.parse(text)
    caps = _calls(tree, "_sm120patch_fused_max_tokens")
    # The reader, and what it asks of the server as this release has it (per patch set).
    reader = _defines(tree, "_sm120patch_tuned_limits") and _defines(tree, "_sm120patch_sglang_served")
    return bool(caps) and reader, (f"{counted(len(caps), 'batch cap')} through the tuned limits; the profile reader "
                                   + ("is" if reader else "is not") + " in the module")


@check("tuned-oneshot")
def tuned_oneshot(text: str) -> tuple[bool, str]:
    """SGLang's fused call takes its one-shot choice from the tuned limits."""
    tree = ast.parse(text)
    passed = [k for n in ast.walk(tree) if isinstance(n, ast.Call) for k in n.keywords
              if k.arg == "use_oneshot" and isinstance(k.value, ast.Call) and isinstance(k.value.func, ast.Name)
              and k.value.func.id == "_sm120patch_use_oneshot"]
    return bool(passed) and _defines(tree, "_sm120patch_use_oneshot"), (
        f"use_oneshot from the tuned limits at {counted(len(passed), 'call')}")


@check("tuned-rows")
def tuned_rows(text: str) -> tuple[bool, str]:
    """vLLM narrows its SM120 rows of both fusion tables to the tuned limits at import, and its fused
    call keeps a batch of no more tokens than ranks one-shot under them."""
    tree = ast.parse(text)
    narrowed = [n for n in tree.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)
                and isinstance(n.value.func, ast.Name) and n.value.func.id == "_sm120patch_tuned_rows"
                and [a.id for a in n.value.args if isinstance(a, ast.Name)] == list(VLLM_FUSION_TABLES)]
    floors = _calls(tree, "_sm120patch_oneshot_floor")
    defined = _defines(tree, "_sm120patch_tuned_rows") and _defines(tree, "_sm120patch_oneshot_floor")
    return len(narrowed) == 1 and len(floors) == 1 and defined, (
        f"{counted(len(narrowed), 'narrowing of the SM120 rows')} at import, "
        f"{counted(len(floors), 'one-shot floor')} in the fused call")


# Names that sglang patches put into code; each must be bound where it is used.
INTRODUCED_NAMES = ("is_sm120_supported", "_is_sm120_supported", "torch", "is_cuda", "_is_cuda", "get_platform",
                    "_sm120patch_fused_max_tokens", "_sm120patch_use_oneshot",
                    "_sm120patch_tuned_rows", "_sm120patch_oneshot_floor")


def unbound_names(text: str) -> list[str]:
    """Introduced names a module uses but never binds at module level (a missing import would
    be a NameError at server start, which no hash can show)."""
    tree = ast.parse(text)
    bound: set[str] = set()
    for node in tree.body:
        for sub in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(sub, (ast.Import, ast.ImportFrom)):
                bound.update((a.asname or a.name).split(".")[0] for a in sub.names)
            elif isinstance(sub, (ast.Assign, ast.AnnAssign)):
                targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
                bound.update(t.id for t in targets if isinstance(t, ast.Name))
            elif isinstance(sub, (ast.FunctionDef, ast.ClassDef)):
                bound.add(sub.name)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return sorted(name for name in INTRODUCED_NAMES if name in used and name not in bound)
