# Copyright: sm120patch contributors
# Apache License 2.0 (see the repository's LICENSE terms in pyproject.toml)
"""The options the sm120patch.fleet modules share: which sm120patch, which JIT cache (check_log,
which reads a log and no cache, takes the EXECUTABLE part alone: sm120patch.fleet.target.executable)."""

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

    EXECUTABLE = r"""
options:
  executable:
    description: The sm120patch command on the managed host.
    type: path
    default: sm120patch
author:
  - sm120patch contributors
"""
