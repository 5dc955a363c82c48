"""Words for counts, for every report: "1 file", "2 files", never "file(s)"."""

from __future__ import annotations


def counted(n: int, word: str, plural: str | None = None) -> str:
    """``n`` and ``word`` in the right number (``plural`` where adding "s" is wrong)."""
    return f"{n} {word}" if n == 1 else f"{n} {plural or word + 's'}"
