"""A file's bytes through the edits of its patches, each by its named rewriter. This is where the
patch-set format meets the rewriters: the rewriters are handed an edit's parameters and its site
count, and never see a patch."""

from __future__ import annotations

from typing import Iterator, Sequence

from sm120patch.errors import PatchDataError, RefusedError
from sm120patch.patchsets import Edit, Patch
from sm120patch.rewriters import AlreadyApplied, Changed, RewriteResult, create


def edit_steps(data: bytes, patches: Sequence[Patch]) -> Iterator[tuple[Patch, Edit, RewriteResult, bytes]]:
    """Each edit of ``patches`` run in turn, on the bytes the edits before it made:
    (patch, edit, its result, the bytes after it)."""
    for patch in patches:
        for edit in patch.edits:
            result = create(edit.rewriter, edit.params).rewrite(data, sites=edit.sites)
            if isinstance(result, Changed):
                data = result.data
            yield patch, edit, result, data


def apply_edits(data: bytes, patches: Sequence[Patch], *, where: str, by_meaning: bool = False) -> bytes:
    """Run every edit of ``patches`` on ``data``. Pinned use (the default): ``data`` must be
    pristine for all of them, anything else is inconsistent patch data. ``by_meaning`` (--force,
    unpinned releases, source trees): edits already present are skipped, and a rewriter that
    finds another site count refuses the file; exact site counts hold either way."""
    for patch, edit, result, data in edit_steps(data, patches):
        if isinstance(result, Changed) or (by_meaning and isinstance(result, AlreadyApplied)):
            continue
        if by_meaning:
            raise RefusedError(f"--force: cannot apply {patch.id} to {where}: {result.reason}")
        detail = getattr(result, "reason", "already applied in the pristine file")
        raise PatchDataError(f"{where}: patch {patch.id} ({edit.rewriter}): {detail}")
    return data
