"""Semantic checks of each patch, independent of hashes and of the rewriters that made it:
the standard library's ``ast`` for Python and plain counting for CUDA. Each check answers
"is this change present in this file?" with a short reason."""

from __future__ import annotations

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
    return bounds == 0 and opened > 0, f"{bounds} '__CUDA_ARCH__ < 1200' bound(s) left, {opened} SM90+ gate(s) open to SM120"


@check("lamport-stride")
def lamport_stride(text: str) -> tuple[bool, str]:
    by_tp = len(re.findall(r"lamport_peer_comm_buffer_ptrs\[i \+ tp_size", text))
    by_max = len(re.findall(r"lamport_peer_comm_buffer_ptrs\[i \+ MAX_RANKS_PER_NODE", text))
    return by_tp == 0 and by_max == 2, f"lamport slots at stride tp_size: {by_tp}, at MAX_RANKS_PER_NODE: {by_max}"


@check("fusion-gate")
def fusion_gate(text: str) -> tuple[bool, str]:
    tree = ast.parse(text)
    sm120_flags = {
        target.id
        for node in tree.body if isinstance(node, ast.Assign)
        for target in node.targets if isinstance(target, ast.Name)
        if "sm120" in ast.unparse(node.value) or "== 12" in ast.unparse(node.value)
    }
    for function in _functions(tree, "apply_flashinfer_allreduce_fusion"):
        for operands in _or_operands(function):
            if any(op in sm120_flags or "sm120" in op for op in operands):
                return True, f"fusion predicate: {' or '.join(operands)}"
        return False, "apply_flashinfer_allreduce_fusion does not accept SM120"
    return False, "no apply_flashinfer_allreduce_fusion in this file"


@check("auto-enable")
def auto_enable(text: str) -> tuple[bool, str]:
    for function in _functions(ast.parse(text), "_handle_model_specific_adjustments"):
        for operands in _or_operands(function):
            if any("is_sm90_supported" in op for op in operands):
                ok = any("sm120" in op for op in operands)
                return ok, f"auto-enable condition: {' or '.join(operands)}"
    return False, "no auto-enable condition found"


@check("symm-mem")
def symm_mem(text: str) -> tuple[bool, str]:
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "TORCH_SYMM_MEM_ALL_REDUCE_MAX_SIZES" for t in node.targets
        ) and isinstance(node.value, ast.Dict):
            keys = [ast.literal_eval(k) for k in node.value.keys if k is not None]
            return 12 in keys, f"TORCH_SYMM_MEM_ALL_REDUCE_MAX_SIZES keys: {keys}"
    return False, "no TORCH_SYMM_MEM_ALL_REDUCE_MAX_SIZES dict"
