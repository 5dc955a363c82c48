"""Named source rewriters: ``python.*`` use libcst, ``cuda.*`` use exact-count regexes."""

from __future__ import annotations

from sm120patch.rewriters.base import (
    REGISTRY,
    AlreadyApplied,
    Changed,
    NoMatch,
    RewriteResult,
    Rewriter,
    create,
)
from sm120patch.rewriters.apply import apply_edits

__all__ = [
    "REGISTRY",
    "AlreadyApplied",
    "Changed",
    "NoMatch",
    "RewriteResult",
    "Rewriter",
    "apply_edits",
    "create",
    "load_all",
]


def load_all() -> None:
    """Import the rewriter modules so that they register (libcst is imported only here,
    keeping ``status`` fast)."""
    from sm120patch.rewriters import cuda, python  # noqa: F401
