"""What reaches a terminal from a file or a path: made visible, never obeyed. A drifted file's
diff, a path, a line of a build's output may hold bytes a terminal acts on: an escape sequence
(CSI moves the cursor or hides text, OSC 0 sets the window title, OSC 52 writes the clipboard),
another C0 or C1 control, NUL, a carriage return that overwrites the line, a bidirectional
override that shows code in another order than it runs. :func:`visible` writes each such
character as its Python escape (``\\x1b``, ``\\x00``, ``\\u202e``), so the terminal gets only
printable text and the reader still sees what the file holds; :func:`quote` writes a shell word
that names exactly the same path when pasted (``$'...'`` for one with such characters)."""

from __future__ import annotations

import re
from typing import Iterable

# C0 controls, DEL and C1 controls (0x80-0x9f: 8-bit CSI, OSC, ST and the rest), the Unicode line
# and paragraph separators, and the bidirectional formatting characters (Trojan Source).
_UNSAFE = "\x00-\x1f\x7f-\x9f\u2028\u2029\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
# A surrogate is a byte of a path that is not UTF-8 (os.fsdecode's surrogateescape): not printable either.
_UNSAFE_OR_SURROGATE = re.compile(f"[{_UNSAFE}\ud800-\udfff]")


def _shown(match: re.Match) -> str:
    char = match.group(0)
    if "\udc80" <= char <= "\udcff":  # an undecodable byte of a path: that byte
        return f"\\x{ord(char) - 0xdc00:02x}"
    return repr(char)[1:-1] if ord(char) < 0x100 else f"\\u{ord(char):04x}"


def visible(text: str, *, keep: str = "\n\t") -> str:
    """``text`` with every character a terminal would act on written as its escape (``\\x1b``);
    the characters in ``keep`` (a report's newlines and tabs) stay as they are, and so does
    printable text. sm120patch's own colours are added after this (render.paint)."""
    if not _UNSAFE_OR_SURROGATE.search(text):
        return text
    return _UNSAFE_OR_SURROGATE.sub(lambda m: m.group(0) if m.group(0) in keep else _shown(m), text)


def one_line(text: str) -> str:
    """A message as one line: a newline in a value the user gave, like any other control, escaped."""
    return visible(text, keep="")


def quote(word: str) -> str:
    """``word`` as one shell word that names the same bytes when pasted: shlex.quote's for
    printable text; ANSI-C quoting (``$'...'``: bash, zsh, ksh, busybox sh) with each unsafe
    character as the escapes of its bytes otherwise, so a path holding an escape sequence is
    both shown harmlessly and copied exactly."""
    if not _UNSAFE_OR_SURROGATE.search(word):
        import shlex  # here: status, which quotes no word on most runs, keeps its imports short

        return shlex.quote(word)
    parts = []
    for char in word:
        if _UNSAFE_OR_SURROGATE.match(char):
            parts.append("".join(f"\\x{byte:02x}" for byte in char.encode("utf-8", "surrogateescape"
                                                                            if "\udc80" <= char <= "\udcff" else "surrogatepass")))
        elif char in "\\'":
            parts.append("\\" + char)
        else:
            parts.append(char)
    return "$'" + "".join(parts) + "'"


def join(words: Iterable[str]) -> str:
    """A command line of ``words``, each :func:`quote`d."""
    return " ".join(quote(word) for word in words)


__all__ = ["join", "one_line", "quote", "visible"]
