# Copyright: sm120patch contributors
# Apache License 2.0 (see the repository's LICENSE terms in pyproject.toml)
"""The options every sm120patch.fleet module shares: which sm120patch, which JIT cache."""

from __future__ import annotations


class ModuleDocFragment:
    DOCUMENTATION = r"""
options:
  jit_cache_base:
    description: Base of FlashInfer's JIT cache, the server user's C($FLASHINFER_WORKSPACE_BASE) or C($HOME).
    type: path
  executable:
    description: The sm120patch command on the managed host.
    type: path
    default: sm120patch
author:
  - sm120patch contributors
"""
