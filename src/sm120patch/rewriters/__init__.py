"""Named source rewriters: ``python.*`` use libcst, ``cuda.*`` use exact-count regexes. Each is
handed its parameters and a site count; none knows the patch-set format (``edits`` joins them)."""

from __future__ import annotations

import importlib
from typing import Any, Mapping

from sm120patch.errors import PatchDataError
from sm120patch.rewriters.base import (
    REGISTRY,
    AlreadyApplied,
    Changed,
    NoMatch,
    RewriteResult,
    Rewriter,
)

__all__ = [
    "FAMILIES",
    "REGISTRY",
    "AlreadyApplied",
    "Changed",
    "NoMatch",
    "RewriteResult",
    "Rewriter",
    "create",
    "load_all",
]

# A rewriter's name says its family ("python.extend-list" is in rewriters/python.py), and a family
# module registers its rewriters when it is imported. Families are imported by name when a
# rewriter is first asked for, not with this package: python.py imports libcst (about 120 ms),
# which `status` never needs.
FAMILIES = ("cuda", "python")


def load_all() -> None:
    """Import every family module, so that each registers its rewriters."""
    for family in FAMILIES:
        importlib.import_module(f"{__name__}.{family}")


def create(name: str, params: Mapping[str, Any]) -> Rewriter:
    """Instantiate a registered rewriter by name (patch sets refer to rewriters this way)."""
    family = name.partition(".")[0]
    if family in FAMILIES:
        importlib.import_module(f"{__name__}.{family}")
    try:
        cls = REGISTRY[name]
    except KeyError:
        load_all()
        known = ", ".join(sorted(REGISTRY))
        raise PatchDataError(f"unknown rewriter {name!r} (known: {known})") from None
    return cls(**params)
