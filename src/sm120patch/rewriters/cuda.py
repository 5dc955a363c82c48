"""Regex rewriters for CUDA/C++ sources, which have no libcst: exact site counts or refusal."""

from __future__ import annotations

import re

from sm120patch.errors import PatchDataError
from sm120patch.rewriters.base import AlreadyApplied, Changed, NoMatch, RewriteResult, Rewriter, decode, register
from sm120patch.words import counted


@register
class RegexReplace(Rewriter):
    """Replace every match of ``pattern`` by ``replacement`` (``re.sub`` syntax, named groups
    welcome). ``applied_pattern`` recognises the patched form: when it matches exactly
    ``sites`` times the file is already patched; otherwise ``pattern`` must match exactly
    ``sites`` times, and afterwards ``applied_pattern`` must too (a self-check of the data)."""

    name = "cuda.regex-replace"
    description = "Replace an exact number of regex matches; refuse on any other count."
    params = {"pattern": str, "replacement": str, "applied_pattern": str}

    def validate(self) -> None:
        for key in ("pattern", "applied_pattern"):
            try:
                re.compile(self.args[key], re.MULTILINE)
            except re.error as exc:
                raise PatchDataError(f"rewriter {self.name}: {key} does not compile: {exc}") from None

    def rewrite(self, data: bytes, *, sites: int) -> RewriteResult:
        text = decode(data, self.name)
        if isinstance(text, NoMatch):
            return text
        pattern = re.compile(self.args["pattern"], re.MULTILINE)
        applied = re.compile(self.args["applied_pattern"], re.MULTILINE)
        applied_count = len(applied.findall(text))
        if applied_count == sites:
            return AlreadyApplied(sites)
        new_text, count = pattern.subn(self.args["replacement"], text)
        if count != sites:
            return NoMatch(
                f"expected {counted(sites, 'site')} of /{pattern.pattern}/, found {count}"
                + (f" (and {applied_count} already patched)" if applied_count else "")
            )
        after = len(applied.findall(new_text))
        if after != sites:
            raise PatchDataError(
                f"rewriter {self.name}: after replacing, applied_pattern matched {after} "
                f"time(s), not {sites}: the patch data is inconsistent"
            )
        return Changed(new_text.encode("utf-8"), count)
