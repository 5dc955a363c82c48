"""A file's bytes through the edits of its patches, each by its named rewriter."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from sm120patch.errors import PatchDataError, RefusedError
from sm120patch.rewriters.base import AlreadyApplied, Changed, create

if TYPE_CHECKING:  # patch sets are data above the rewriters; only their type is named here
    from sm120patch.patchsets import Patch


def apply_edits(data: bytes, patches: Sequence[Patch], *, where: str, by_meaning: bool = False) -> bytes:
    """Run every edit of ``patches`` on ``data``. Pinned use (the default): ``data`` must be
    pristine for all of them, anything else is inconsistent patch data. ``by_meaning`` (--force,
    unpinned releases, source trees): edits already present are skipped, and a rewriter that
    finds another site count refuses the file; exact site counts hold either way."""
    for patch in patches:
        for edit in patch.edits:
            result = create(edit.rewriter, edit.params).rewrite(data, sites=edit.sites)
            if isinstance(result, Changed):
                data = result.data
            elif by_meaning and isinstance(result, AlreadyApplied):
                continue
            elif by_meaning:
                raise RefusedError(f"--force: cannot apply {patch.id} to {where}: {result.reason}")
            else:
                detail = getattr(result, "reason", "already applied in the pristine file")
                raise PatchDataError(f"{where}: patch {patch.id} ({edit.rewriter}): {detail}")
    return data
