"""What a release's log lines mean: ``patches/<server>/logs.toml`` (the literal message
fragments of each release's source, by PEP 440 range) and ``patches/common-logs.toml`` (what any
server's process prints when it dies outside Python, and the causes a failure line can name),
read and validated. Every error names the file and the row."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from sm120patch.chain import STEPS
from sm120patch.data import data_dir
from sm120patch.distributions import specifier
from sm120patch.errors import PatchDataError
from sm120patch.patchsets import read_toml

# config: the settings line; tp, dp, pp (its parallel sizes), requested; off: a setting under which the server never fuses;
# lazy: a setting under which the workspace waits for the first request; request: a request was
# served; progress, ready, fused, kernel, fell-back; crashed: the process is going down (Python);
# died: it went down outside Python (C++, the kernel, a launcher); signature: an exception line
# that says why; note.
KINDS = ("version", "config", "tp", "dp", "pp", "requested", "off", "lazy", "request", "progress", "ready", "fused", "kernel",
         "fell-back", "crashed", "died", "signature", "note")
STEPPED = ("fell-back", "signature", "off", "died")  # the kinds that name a step and a fix


class LogLine(NamedTuple):
    """A line a release writes (a ``[[line]]`` of logs.toml)."""

    versions: SpecifierSet
    kind: str
    message: tuple[str, ...]  # literal fragments of the release's source, all in the line
    pattern: re.Pattern | None = None  # picks values (``value``, ``backend``) out of a matching line
    step: str | None = None
    fix: str | None = None
    backend: str | None = None
    stage: str | None = None
    source: str | None = None  # the distribution whose source has the message (None: the server)
    source_versions: SpecifierSet = SpecifierSet()
    file: str | None = None
    # Optional (issue #54):
    starts_run: bool = False  # a new start of the server: an earlier run in the same file is over
    echo: bool = False  # repeats another rank's failure: the verdict names the rank with the cause
    printed_by: str | None = None  # not in any wheel's Python (C++, the kernel, the shell): who prints it
    only_if_requested: bool = False  # a fused line that means fusion only where fusion was asked for

    def match(self, text: str) -> re.Match | bool:
        if not all(fragment in text for fragment in self.message):
            return False
        if self.pattern is None:
            return True
        return self.pattern.search(text) or False


class Quiet(NamedTuple):
    """What it means, in ``versions``, that fusion was asked for, the server got ready and no
    rank logged the workspace."""

    versions: SpecifierSet
    step: str | None
    fix: str | None
    fused: str | None = None  # a release that logs no workspace line at INFO: why silence means fused


class KernelNote(NamedTuple):
    versions: SpecifierSet
    text: str


class Cause(NamedTuple):
    """A cause a failure line (its exception text) can name, whatever the server: it replaces
    the row's own step and fix (``patches/common-logs.toml``)."""

    message: tuple[str, ...]  # any of these fragments in the line
    step: str | None  # None: a failure of no fusion step (the server's own, e.g. CUDA graph capture)
    fix: str
    frames: tuple[str, ...] = ()  # only in a traceback that went through one of these functions


@dataclass(frozen=True)
class LogData:
    server: str
    versions: SpecifierSet  # the releases whose lines were read
    header: re.Pattern
    rank: re.Pattern
    process: re.Pattern | None
    lines: tuple[LogLine, ...]
    quiet: tuple[Quiet, ...]
    kernel_notes: tuple[KernelNote, ...]
    causes: tuple[Cause, ...] = ()
    firsts: re.Pattern = field(compare=False, default=None)  # any row's first fragment: a cheap pre-filter
    # The starts of the records that echo a request (--log-requests): the user's text, never counted.
    echo: tuple[str, ...] = ()

    def covers(self, version: Version | None) -> bool:
        return version is not None and self.versions.contains(version, prereleases=True)

    def cause(self, text: str, functions=frozenset()) -> Cause | None:
        return next((c for c in self.causes if any(m in text for m in c.message)
                     and (not c.frames or functions.intersection(c.frames))), None)


def _regex(value, where: str) -> re.Pattern:
    if not isinstance(value, str):
        raise PatchDataError(f"{where}: a pattern must be a string")
    try:
        return re.compile(value)
    except re.error as exc:
        raise PatchDataError(f"{where}: {value!r} is not a regular expression ({exc})") from None


LINE_KEYS = {"versions", "kind", "message", "pattern", "step", "fix", "backend", "stage", "source",
             "source_versions", "file", "starts_run", "echo", "printed_by", "only_if_requested"}
FLAGS = ("starts_run", "echo", "only_if_requested")


def _line(raw: dict, lwhere: str, default_versions: str | None) -> LogLine:
    unknown = set(raw) - LINE_KEYS
    if unknown:
        raise PatchDataError(f"{lwhere}: unknown key(s) {', '.join(sorted(unknown))}")
    if raw.get("kind") not in KINDS:
        raise PatchDataError(f"{lwhere}: kind must be one of {', '.join(KINDS)}")
    message = raw.get("message")
    if not isinstance(message, list) or not message or not all(isinstance(m, str) and m for m in message):
        raise PatchDataError(f"{lwhere}: message is a list of the literal fragments the release prints")
    kind = raw["kind"]
    if kind in STEPPED:
        if (raw.get("step") not in STEPS and not (kind == "died" and "step" not in raw)) \
                or not isinstance(raw.get("fix"), str):
            raise PatchDataError(f"{lwhere}: a {kind} line names its fix and step (one of {', '.join(STEPS)}; "
                                 "a died line may leave the step out)")
    elif "step" in raw or "fix" in raw:
        raise PatchDataError(f"{lwhere}: only {', '.join(STEPPED)} lines have a step and a fix")
    if kind == "progress" and not isinstance(raw.get("stage"), str):
        raise PatchDataError(f"{lwhere}: a progress line names its stage")
    pattern = _regex(raw["pattern"], lwhere) if "pattern" in raw else None
    if kind in ("version", "tp", "dp", "pp", "kernel") and (pattern is None or "value" not in pattern.groupindex):
        raise PatchDataError(f"{lwhere}: a {kind} line's pattern captures (?P<value>...)")
    if ("source" in raw) != ("source_versions" in raw):
        raise PatchDataError(f"{lwhere}: source and source_versions go together")
    for flag in FLAGS:
        if not isinstance(raw.get(flag, False), bool):
            raise PatchDataError(f"{lwhere}: {flag} is true or false")
    if "printed_by" in raw and not isinstance(raw["printed_by"], str):
        raise PatchDataError(f"{lwhere}: printed_by is a string")
    versions = raw.get("versions", default_versions)
    return LogLine(specifier(versions, lwhere), kind, tuple(message), pattern, raw.get("step"), raw.get("fix"),
                   raw.get("backend"), raw.get("stage"), raw.get("source"),
                   specifier(raw.get("source_versions", ""), lwhere), raw.get("file"),
                   raw.get("starts_run", False), raw.get("echo", False), raw.get("printed_by"),
                   raw.get("only_if_requested", False))


def parse_common(path: Path) -> tuple[tuple[LogLine, ...], tuple[Cause, ...]]:
    """``common-logs.toml``: lines any server's process prints (no release range: every one), and
    the causes a failure line can name."""
    where = "common-logs.toml"
    doc = read_toml(path, where)
    rows = []
    for index, raw in enumerate(doc.get("line", [])):
        lwhere = f"{where}: line #{index + 1}"
        if "printed_by" not in raw:
            raise PatchDataError(f"{lwhere}: a line of every server names who prints it (printed_by)")
        rows.append(_line(raw, lwhere, ">=0"))
    return tuple(rows), _causes(doc, where, step_required=True)


def _causes(doc: dict, where: str, *, step_required: bool) -> tuple[Cause, ...]:
    causes = []
    for index, raw in enumerate(doc.get("cause", [])):
        cwhere = f"{where}: cause #{index + 1}"
        message = raw.get("message")
        step = raw.get("step")
        if (not isinstance(message, list) or not message or not all(isinstance(m, str) and m for m in message)
                or not (step in STEPS or (step is None and not step_required))
                or not isinstance(raw.get("fix"), str)):
            raise PatchDataError(f"{cwhere}: needs message (fragments), step (one of {', '.join(STEPS)}"
                                 + ("" if step_required else ", or none: a failure of no fusion step") + ") and fix")
        frames = raw.get("frames", [])
        if not isinstance(frames, list) or not all(isinstance(f, str) and f for f in frames):
            raise PatchDataError(f"{cwhere}: frames is a list of function names")
        causes.append(Cause(tuple(message), step, raw["fix"], tuple(frames)))
    return tuple(causes)


def parse_logs(path: Path, server: str, common: tuple[tuple[LogLine, ...], tuple[Cause, ...]] = ((), ())) -> LogData:
    """``patches/<server>/logs.toml``, validated (with the common lines and causes)."""
    where = f"{server}/logs.toml"
    doc = read_toml(path, where)
    fmt = doc.get("format")
    if not isinstance(fmt, dict) or "header" not in fmt or "rank" not in fmt:
        raise PatchDataError(f"{where}: needs [format] with header and rank")
    rows = [_line(raw, f"{where}: line #{index + 1}", None) for index, raw in enumerate(doc.get("line", []))]
    for kind in ("fused", "ready", "crashed"):
        if not any(r.kind == kind for r in rows):
            raise PatchDataError(f"{where}: no {kind} line: check-log could not give that verdict")
    rows += common[0]
    quiet = []
    for index, raw in enumerate(doc.get("quiet", [])):
        qwhere = f"{where}: quiet #{index + 1}"
        if raw.get("verdict") == "fused" and isinstance(raw.get("text"), str):
            quiet.append(Quiet(specifier(raw.get("versions"), qwhere), None, None, raw["text"]))
            continue
        if raw.get("step") not in STEPS or not isinstance(raw.get("fix"), str):
            raise PatchDataError(f"{qwhere}: needs versions, step (one of {', '.join(STEPS)}) and fix")
        quiet.append(Quiet(specifier(raw.get("versions"), qwhere), raw["step"], raw["fix"]))
    notes = []
    for index, raw in enumerate(doc.get("kernel_note", [])):
        nwhere = f"{where}: kernel_note #{index + 1}"
        if not isinstance(raw.get("text"), str):
            raise PatchDataError(f"{nwhere}: needs versions and text")
        notes.append(KernelNote(specifier(raw.get("versions"), nwhere), raw["text"]))
    firsts = re.compile("|".join(sorted({re.escape(r.message[0]) for r in rows}, key=len, reverse=True)))
    echo = fmt.get("echo", [])
    if not isinstance(echo, list) or not all(isinstance(e, str) and e for e in echo):
        raise PatchDataError(f"{where}: format.echo is a list of the literal starts of the records that echo a request")
    return LogData(server, specifier(doc.get("versions"), where), _regex(fmt["header"], f"{where}: format.header"),
                   _regex(fmt["rank"], f"{where}: format.rank"),
                   _regex(fmt["process"], f"{where}: format.process") if "process" in fmt else None,
                   tuple(rows), tuple(quiet), tuple(notes),
                   _causes(doc, where, step_required=False) + common[1], firsts,  # the server's causes first
                   tuple(echo))


def load_logs(server: str, directory: Path | None = None) -> LogData:
    directory = directory or data_dir("patches")
    return parse_logs(directory / server / "logs.toml", server, parse_common(directory / "common-logs.toml"))


__all__ = ["KINDS", "Cause", "KernelNote", "LogData", "LogLine", "Quiet", "load_logs", "parse_logs"]
