"""What a log collector put in front of the server's own line, taken off before the line is read:
a terminal's colours (ANSI), journald's ``journalctl -o short`` / ``short-iso`` / ``short-precise``
(``Nov 28 10:03:41 host unit[pid]: ``), syslog (RFC 3164 and RFC 5424, ``<PRI>`` first), Docker's
``docker logs -t`` and Kubernetes' ``kubectl logs --timestamps`` (an RFC 3339 time and a space),
and a Loki export (``logcli``'s time, then its ``{labels}``). ``journalctl -o cat`` and a plain
file have none.

Each shape is anchored at the start of the line and ends in a separator the servers' own headers
never start with (SGLang's ``[``, vLLM's level or ``(Worker...``), so a line without a collector's
prefix is left as it is."""

from __future__ import annotations

import re

ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[()][A-Za-z0-9]|\x1b[=>]")

_BSD_TIME = r"[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d(?:\.\d+)?"
_ISO_TIME = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?"
_TAG = r"[^\s\[\]:]+(?:\[\d+\])?: "  # unit[pid]: (journald, syslog's tag)
PREFIX = re.compile(
    r"^(?:<\d{1,3}>)?(?:"
    rf"1 {_ISO_TIME} \S+ \S+ \S+ \S+ (?:-|(?:\[[^\]]*\])+) "  # RFC 5424: VERSION TIME HOST APP PROCID MSGID SD
    rf"|(?:{_BSD_TIME}|{_ISO_TIME}) \S+ {_TAG}"  # journald short / short-iso, RFC 3164 syslog
    rf"|{_ISO_TIME} (?:\{{[^}}]*\}} )?"  # docker -t, kubectl --timestamps; a Loki export's labels
    r")")


_SERVERS_OWN = set("[( \t")  # SGLang's "[", vLLM's "(Worker...", a traceback's indent


def strip(text: str) -> str:
    """The server's own line: colours and a collector's prefix taken off."""
    if "\x1b" in text:
        text = ANSI.sub("", text)
    if text[:1] in _SERVERS_OWN:  # the servers' own first characters: no collector's prefix
        return text
    match = PREFIX.match(text)
    return text[match.end():] if match else text


__all__ = ["strip"]
