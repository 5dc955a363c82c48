"""Words for every report: counts ("1 file", "2 files", never "file(s)") and version ranges."""

from __future__ import annotations


def counted(n: int, word: str, plural: str | None = None) -> str:
    """``n`` and ``word`` in the right number (``plural`` where adding "s" is wrong)."""
    return f"{n} {word}" if n == 1 else f"{n} {plural or word + 's'}"


def spec_words(versions) -> str:
    """'>=0.10.0,<0.11.1' -> 'from 0.10.0, before 0.11.1' (the list's column, bench's flag words)."""
    words = {">=": "from", ">": "after", "<": "before", "<=": "up to", "==": ""}
    parts = sorted(versions, key=lambda s: s.operator not in (">=", ">"))
    return ", ".join(f"{words.get(s.operator, s.operator)} {s.version}".strip() for s in parts)


def size_words(n: int) -> str:
    """A byte count as people read it: 8 KiB, 1.8 MiB, 512 B."""
    for unit, scale in (("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value >= 10 or value == int(value) else f"{value:.1f} {unit}"
    return f"{n} B"
