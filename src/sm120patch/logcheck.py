"""`sm120patch check-log`: whether a running (or finished) SGLang or vLLM server really fused,
read from its own log lines.

The lines are facts of each release, kept as data (``patches/<server>/logs.toml``: the literal
message fragments of the release's source, by PEP 440 range); this module only reads the log,
one line at a time (logs are big, rotated, interleaved across ranks, ANSI-coloured and not
always UTF-8), sorts each line to the process that wrote it, and turns what it saw into one
verdict per rank and one overall. Only `check-log` imports it: `status` stays fast.
"""

from __future__ import annotations

import os
import re
import select
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from sm120patch import environment, pipeline
from sm120patch.chain import STEPS, StepResult
from sm120patch.data import data_dir
from sm120patch.distributions import load_registry, specifier
from sm120patch.errors import PatchDataError, Sm120PatchError, TransactionError, UsageError
from sm120patch.invocation import command
from sm120patch.patchsets import read_toml
from sm120patch.reports import (CRASHED, FELL_BACK, FUSED, NOT_REQUESTED, STARTING, UNKNOWN_RELEASE, Crash,
                                LogCheckReport, RankVerdict)
from sm120patch.words import counted, spec_words

_SM120PATCH_COMMAND = re.compile(r"`sm120patch ([^`]*)`")

SERVERS = ("sglang", "vllm")
KINDS = ("version", "config", "tp", "requested", "progress", "ready", "fused", "kernel", "fell-back", "crashed",
         "signature", "note")
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[()][A-Za-z0-9]|\x1b[=>]")
FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+?)\s*$')
TRACEBACK = "Traceback (most recent call last):"
MAIN = "main"  # the lines of no rank: SGLang's main process, vLLM's API server and engine core
MAX_SEEN = 20
IDLE_CRASH_S = 2.0  # --follow: a traceback this long without its last line is taken as finished


# -- the data --------------------------------------------------------------------------------------

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
    step: str
    fix: str


class KernelNote(NamedTuple):
    versions: SpecifierSet
    text: str


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
    firsts: re.Pattern = field(compare=False, default=None)  # any row's first fragment: a cheap pre-filter

    def covers(self, version: Version | None) -> bool:
        return version is not None and self.versions.contains(version, prereleases=True)


def _regex(value, where: str) -> re.Pattern:
    if not isinstance(value, str):
        raise PatchDataError(f"{where}: a pattern must be a string")
    try:
        return re.compile(value)
    except re.error as exc:
        raise PatchDataError(f"{where}: {value!r} is not a regular expression ({exc})") from None


LINE_KEYS = {"versions", "kind", "message", "pattern", "step", "fix", "backend", "stage", "source",
             "source_versions", "file"}


def parse_logs(path: Path, server: str) -> LogData:
    """``patches/<server>/logs.toml``, validated: every error names the file and the row."""
    where = f"{server}/logs.toml"
    doc = read_toml(path, where)
    fmt = doc.get("format")
    if not isinstance(fmt, dict) or "header" not in fmt or "rank" not in fmt:
        raise PatchDataError(f"{where}: needs [format] with header and rank")
    rows = []
    for index, raw in enumerate(doc.get("line", [])):
        lwhere = f"{where}: line #{index + 1}"
        unknown = set(raw) - LINE_KEYS
        if unknown:
            raise PatchDataError(f"{lwhere}: unknown key(s) {', '.join(sorted(unknown))}")
        if raw.get("kind") not in KINDS:
            raise PatchDataError(f"{lwhere}: kind must be one of {', '.join(KINDS)}")
        message = raw.get("message")
        if not isinstance(message, list) or not message or not all(isinstance(m, str) and m for m in message):
            raise PatchDataError(f"{lwhere}: message is a list of the literal fragments the release prints")
        kind = raw["kind"]
        if kind in ("fell-back", "signature"):
            if raw.get("step") not in STEPS or not isinstance(raw.get("fix"), str):
                raise PatchDataError(f"{lwhere}: a {kind} line names its step (one of {', '.join(STEPS)}) and fix")
        elif "step" in raw or "fix" in raw:
            raise PatchDataError(f"{lwhere}: only fell-back and signature lines have a step and a fix")
        if kind == "progress" and not isinstance(raw.get("stage"), str):
            raise PatchDataError(f"{lwhere}: a progress line names its stage")
        pattern = _regex(raw["pattern"], lwhere) if "pattern" in raw else None
        if kind in ("version", "tp", "kernel") and (pattern is None or "value" not in pattern.groupindex):
            raise PatchDataError(f"{lwhere}: a {kind} line's pattern captures (?P<value>...)")
        if ("source" in raw) != ("source_versions" in raw):
            raise PatchDataError(f"{lwhere}: source and source_versions go together")
        rows.append(LogLine(specifier(raw.get("versions"), lwhere), kind, tuple(message), pattern, raw.get("step"),
                            raw.get("fix"), raw.get("backend"), raw.get("stage"), raw.get("source"),
                            specifier(raw.get("source_versions", ""), lwhere), raw.get("file")))
    for kind in ("fused", "ready", "crashed"):
        if not any(r.kind == kind for r in rows):
            raise PatchDataError(f"{where}: no {kind} line: check-log could not give that verdict")
    quiet = []
    for index, raw in enumerate(doc.get("quiet", [])):
        qwhere = f"{where}: quiet #{index + 1}"
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
    return LogData(server, specifier(doc.get("versions"), where), _regex(fmt["header"], f"{where}: format.header"),
                   _regex(fmt["rank"], f"{where}: format.rank"),
                   _regex(fmt["process"], f"{where}: format.process") if "process" in fmt else None,
                   tuple(rows), tuple(quiet), tuple(notes), firsts)


def load_logs(server: str, directory: Path | None = None) -> LogData:
    directory = directory or data_dir("patches")
    return parse_logs(directory / server / "logs.toml", server)


# -- reading ----------------------------------------------------------------------------------------

def _decode(raw: bytes) -> str:
    text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
    return ANSI.sub("", text) if "\x1b" in text else text


CHUNK = 1 << 16
MAX_LINE = 1 << 20  # a longer "line" (a binary blob) is cut into pieces of this size


class Follower:
    """The lines of a file as they are written, like ``tail -F``: it waits for a file that does
    not exist yet, and starts again from the top when the file is replaced (rotation: another
    inode at the path, after what was left in the old one is read) or truncated (copytruncate).
    Yields None when nothing new came for a while (the caller checks its clock)."""

    def __init__(self, path: Path, poll: float = 0.2) -> None:
        self.path, self.poll = path, poll
        self.handle = None
        self.inode = None

    def _open(self) -> bool:
        try:
            self.handle = open(self.path, "rb")  # noqa: SIM115 - kept open while following
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise TransactionError(f"cannot read {self.path}: {exc.strerror or exc}") from None
        self.inode = os.fstat(self.handle.fileno()).st_ino
        return True

    def __iter__(self) -> Iterator[bytes | None]:
        pending = b""
        while True:
            if self.handle is None and not self._open():
                yield None
                time.sleep(self.poll)
                continue
            data = self.handle.read(CHUNK)
            if data:
                pending += data
                while True:
                    cut = pending.find(b"\n")
                    if cut < 0:
                        break
                    yield pending[:cut + 1]
                    pending = pending[cut + 1:]
                while len(pending) >= MAX_LINE:
                    yield pending[:MAX_LINE]
                    pending = pending[MAX_LINE:]
                continue
            # At the end of what is there: replaced, truncated, or just not written yet.
            try:
                now = os.stat(self.path)
            except FileNotFoundError:
                now = None
            position = self.handle.tell()
            if now is not None and now.st_ino != self.inode:
                if pending:
                    yield pending
                    pending = b""
                self.handle.close()
                self.handle = None
                continue
            if now is not None and now.st_size < position:
                pending = b""
                self.handle.seek(0)
                continue
            yield None
            time.sleep(self.poll)


def _stream(handle) -> Iterator[bytes]:
    """A file read to its end, line by line, never whole."""
    while True:
        line = handle.readline(MAX_LINE)
        if not line:
            return
        yield line


def _stdin_lines(follow_deadline: float | None) -> Iterator[bytes | None]:
    """Standard input line by line; with a deadline it never blocks past it (None: an idle tick)."""
    fd = sys.stdin.buffer.fileno() if hasattr(sys.stdin, "buffer") else None
    if fd is None or follow_deadline is None:
        yield from _stream(sys.stdin.buffer)
        return
    pending = b""
    while True:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if not ready:
            yield None
            continue
        data = os.read(fd, CHUNK)
        if not data:
            if pending:
                yield pending
            return
        pending += data
        while (cut := pending.find(b"\n")) >= 0:
            yield pending[:cut + 1]
            pending = pending[cut + 1:]
        while len(pending) >= MAX_LINE:
            yield pending[:MAX_LINE]
            pending = pending[MAX_LINE:]


# -- what the lines say ------------------------------------------------------------------------------

@dataclass
class Traceback:
    active: bool = True
    frame: str | None = None
    frame_file: str | None = None
    exceptions: list = field(default_factory=list)


@dataclass
class Process:
    label: str
    is_rank: bool = False
    events: list = field(default_factory=list)  # (LogLine, text, match)
    traceback: Traceback | None = None
    tracebacks: list = field(default_factory=list)


class Analysis:
    """Everything the log said, sorted by process. :meth:`report` turns it into the verdict."""

    def __init__(self, data: dict[str, LogData], server: str | None, version: Version | None,
                 version_from: str) -> None:
        self.data = data
        self.server = server
        self.version = version
        self.version_from = version_from
        self.processes: dict[str, Process] = {}
        self.last_key = MAIN
        self.lines = 0
        self.changed = False  # an event since the verdict was last made

    @property
    def logs(self) -> LogData | None:
        return self.data.get(self.server) if self.server else None

    def _detect(self, text: str) -> None:
        for name, logs in self.data.items():
            body = text
            if logs.process is not None:
                match = logs.process.match(body)
                if match:
                    body = body[match.end():]
            if logs.header.match(body) or (logs.process is not None and logs.process.match(text)):
                self.server = name
                return

    def _process(self, key: str, label: str) -> Process:
        proc = self.processes.get(key)
        if proc is None:
            proc = self.processes[key] = Process(label)
        proc.label = label
        logs = self.logs
        if key != MAIN and logs.rank.search(label):
            proc.is_rank = True
        return proc

    def feed(self, raw: bytes) -> None:
        self.lines += 1
        text = _decode(raw)
        if not text:
            return
        if self.server is None:
            self._detect(text)
            if self.server is None:
                return
        logs = self.logs
        body = text
        key = label = None
        if logs.process is not None:
            match = logs.process.match(body)
            if match:
                key, label = f"pid {match['pid']}", match["scope"].strip()
                body = body[match.end():]
        header = logs.header.match(body)
        if header is not None:
            if key is None:
                scope = header.groupdict().get("scope") or ""
                key = label = scope.strip() or MAIN
            body = body[header.end():]
        if key is None:  # a continuation line (a traceback's): the record above it
            key = self.last_key
            label = self.processes[key].label if key in self.processes else MAIN
        self.last_key = key
        proc = self._process(key, label or MAIN)
        self._traceback(proc, body, header is not None)
        if logs.firsts.search(text) is None:
            return
        for row in logs.lines:
            if self.version is not None and logs.covers(self.version) and not row.versions.contains(
                    self.version, prereleases=True):
                continue
            match = row.match(text)
            if not match:
                continue
            proc.events.append((row, body, match if match is not True else None))
            self.changed = True
            if row.kind == "version" and self.version is None:
                found = match["value"] if match is not True else None
                try:
                    self.version, self.version_from = Version(found), "the log"
                except (InvalidVersion, TypeError):
                    pass

    def _traceback(self, proc: Process, body: str, headed: bool) -> None:
        if TRACEBACK in body:
            proc.traceback = Traceback()
            proc.tracebacks.append(proc.traceback)
            self.changed = True
            return
        tb = proc.traceback
        if tb is None or not tb.active:
            return
        frame = FRAME.match(body)
        if frame is not None:
            tb.frame = body.strip()
            tb.frame_file = frame["file"]
            return
        if body[:1].isspace() or not body.strip() or tb.frame is None:
            return  # the source line under a frame, a caret line
        tb.exceptions.append(body.strip())
        tb.active = False
        self.changed = True

    def idle(self) -> None:
        """--follow found nothing new for a while: a traceback cut short is as complete as it gets."""
        for proc in self.processes.values():
            if proc.traceback is not None and proc.traceback.active and proc.traceback.exceptions:
                proc.traceback.active = False

    # -- the verdict --

    def _applies(self, row: LogLine) -> bool:
        logs = self.logs
        if self.version is None or not logs.covers(self.version):
            return True
        return row.versions.contains(self.version, prereleases=True)

    def _events(self, kind: str):
        for key, proc in self.processes.items():
            for row, body, match in proc.events:
                if row.kind == kind and self._applies(row):
                    yield key, proc, row, body, match

    def report(self, source: str, *, registry=None, timed_out: bool = False) -> LogCheckReport:
        base = dict(source=source, server=self.server, version=str(self.version) if self.version else None,
                    version_from=self.version_from if self.version else "", lines=self.lines, timed_out=timed_out)
        logs = self.logs
        if logs is None:
            return LogCheckReport(**base, verdict=STARTING, final=False,
                                  summary="no line of SGLang's or vLLM's log format yet: no verdict")
        notes = []
        if self.version is None:
            notes.append(f"release not known ({'SGLang does not log its version' if logs.server == 'sglang' else 'no version line in this log'}): "
                         "every known release's lines were used; --version or --python names it")
        if self.version is not None and not logs.covers(self.version):
            seen = [f"{proc.label}: {body}" for key, proc in self.processes.items() for row, body, _ in proc.events
                    if row.kind not in ("config", "tp", "requested", "version", "progress")]
            return LogCheckReport(**base, verdict=UNKNOWN_RELEASE, final=True, seen=seen[:MAX_SEEN],
                                  summary=f"{logs.server} {self.version} is not mapped: sm120patch knows its log "
                                          f"lines for {spec_words(logs.versions)} (what was seen is below, read with every "
                                          "known release's lines)")
        tp = next((int(m["value"]) for _, _, _, _, m in self._events("tp") if m is not None), None)
        requested = None
        if any(True for _ in self._events("config")):
            requested = any(True for _ in self._events("requested"))
        ranks = {key: proc for key, proc in self.processes.items() if proc.is_rank}
        expected = tp if tp is not None else None
        ready = next(iter(self._events("ready")), None)
        kernel = [(proc.label, m["value"]) for _, proc, _, _, m in self._events("kernel") if m is not None]
        for note in logs.kernel_notes:
            if self.version is None or note.versions.contains(self.version, prereleases=True):
                if not kernel:
                    notes.append(note.text)
        if kernel:
            notes.append("the fusion pass replaced patterns: " + ", ".join(f"{label}: {n}" for label, n in kernel))
        for _, proc, row, body, _ in self._events("note"):
            notes.append(f"{proc.label}: {body}")
        per_rank = self._per_rank(ranks, ready is not None)

        crash = self._crash(registry)
        if crash is not None:
            signature, marker_proc, crash_info = crash
            pending = any(p.traceback is not None and p.traceback.active for p in self.processes.values())
            step = signature.step if signature else None
            fix = signature.fix if signature else None
            where = f" ({marker_proc.label})" if marker_proc.label != MAIN else ""
            summary = f"crashed{where}: {crash_info.exception or crash_info.marker}"
            return LogCheckReport(**base, verdict=CRASHED, final=not pending, summary=summary, step=step, fix=fix,
                                  message=crash_info.marker, ranks=per_rank, expected_ranks=expected,
                                  crash=crash_info, notes=notes)

        fell = next(iter(sorted(self._events("fell-back"), key=lambda e: not e[1].is_rank)), None)
        if fell is not None:
            _, proc, row, body, _ = fell
            where = f" on {proc.label}" if proc.label != MAIN else ""
            return LogCheckReport(**base, verdict=FELL_BACK, final=True, step=row.step, fix=row.fix, message=body,
                                  summary=f"fell back to unfused allreduce{where}: {body}", ranks=per_rank,
                                  expected_ranks=expected, notes=notes)

        fused = {key: (row, body, match) for key, proc, row, body, match in self._events("fused")}
        if fused:
            backends = sorted({(m["backend"] if m is not None and "backend" in m.groupdict() and m["backend"]
                                else row.backend) or "?" for row, _, m in fused.values()})
            want = expected if expected is not None else max(len(ranks), 1)
            have = len([k for k in fused if k in ranks]) if ranks else len(fused)
            backend = ", ".join(backends)
            if have >= want:
                when = "" if ready is not None else "; the server has not said it is ready yet"
                return LogCheckReport(**base, verdict=FUSED, final=ready is not None, backend=backend,
                                      message=next(iter(fused.values()))[1], ranks=per_rank, expected_ranks=expected,
                                      summary=f"fused: FlashInfer's workspace (backend {backend}) was created on "
                                              f"every rank ({have} of {want}){when}", notes=notes)
            if ready is not None:
                missing = sorted(proc.label for key, proc in ranks.items() if key not in fused)
                return LogCheckReport(**base, verdict=FELL_BACK, final=True, step="workspace", backend=backend,
                                      fix="a rank without the workspace serves unfused: its own lines above say "
                                          "why; restart the server once they are fixed",
                                      summary=f"fell back: the workspace was created on {have} of {want} ranks"
                                              + (f" (none on {', '.join(missing)})" if missing else ""),
                                      ranks=per_rank, expected_ranks=expected, notes=notes)
        if ready is not None:
            if requested:
                if tp == 1:
                    return LogCheckReport(**base, verdict=FELL_BACK, final=True, step="tp",
                                          fix="fusion fuses tensor-parallel allreduces: it needs TP 2 or more",
                                          summary="fell back: fusion was asked for at TP 1 (nothing to fuse)",
                                          ranks=per_rank, expected_ranks=expected, notes=notes)
                quiet = next((q for q in logs.quiet if self.version is None
                              or q.versions.contains(self.version, prereleases=True)), None)
                return LogCheckReport(**base, verdict=FELL_BACK, final=True, step=quiet.step if quiet else None,
                                      fix=quiet.fix if quiet else None, ranks=per_rank, expected_ranks=expected,
                                      summary="fell back: fusion was asked for, the server is ready, and no rank "
                                              "logged FlashInfer's workspace", notes=notes)
            flag = self._flag(registry)
            said = ("the settings line does not ask for fusion" if requested is False
                    else "the settings line is not in this log (rotated away?)")
            return LogCheckReport(**base, verdict=NOT_REQUESTED, final=True, step="requested", fix=flag,
                                  summary=f"not requested: the server is ready and no fusion line came ({said})",
                                  ranks=per_rank, expected_ranks=expected, notes=notes)
        stage = None
        for proc in self.processes.values():
            for row, _, _ in proc.events:
                if row.kind == "progress" and self._applies(row):
                    stage = row.stage
        partial = f"; the workspace on {counted(len(fused), 'rank')} so far" if fused else ""
        return LogCheckReport(**base, verdict=STARTING, final=False, ranks=per_rank, expected_ranks=expected,
                              summary=f"still starting ({stage or 'no start-up stage logged yet'}{partial}): "
                                      "no verdict yet", notes=notes)

    def _per_rank(self, ranks: dict, ready: bool) -> list[RankVerdict]:
        out = []
        for key, proc in ranks.items():
            verdict, detail = STARTING, "no fusion line yet"
            for row, body, match in proc.events:
                if not self._applies(row):
                    continue
                if row.kind == "progress" and verdict == STARTING:
                    detail = row.stage
                elif row.kind == "fused" and verdict in (STARTING,):
                    verdict, detail = FUSED, body
                elif row.kind == "fell-back" and verdict != CRASHED:
                    verdict, detail = FELL_BACK, body
                elif row.kind == "crashed":
                    verdict, detail = CRASHED, body
            if verdict == CRASHED and proc.tracebacks and proc.tracebacks[-1].exceptions:
                detail = proc.tracebacks[-1].exceptions[-1]
            if verdict == STARTING and ready:
                verdict, detail = NOT_REQUESTED, "ready, no fusion line"
            out.append(RankVerdict(proc.label, verdict, detail))
        return sorted(out, key=lambda r: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", r.rank)])

    def _crash(self, registry):
        markers = list(self._events("crashed"))
        if not markers:
            return None
        signatures = [row for row in self.logs.lines if row.kind == "signature" and self._applies(row)]

        def signature_of(proc):
            for tb in proc.tracebacks:
                for exc in tb.exceptions:
                    for row in signatures:
                        if row.match(exc):
                            return row, tb, exc
            return None

        # The process that says why: one whose exception has a known signature, then a rank, then any.
        candidates = sorted(self.processes.values(), key=lambda p: (signature_of(p) is None, not p.is_rank))
        chosen = next((p for p in candidates if p.tracebacks and any(t.exceptions for t in p.tracebacks)), None)
        _, marker_proc, _, marker_body, _ = sorted(markers, key=lambda m: not m[1].is_rank)[0]
        signature = exception = frame = frame_file = None
        if chosen is not None:
            found = signature_of(chosen)
            if found is not None:
                signature, tb, exception = found
            else:
                tb = next(t for t in reversed(chosen.tracebacks) if t.exceptions)
                exception = tb.exceptions[-1]
            frame, frame_file = tb.frame, tb.frame_file
            marker_proc = chosen if chosen.is_rank or not marker_proc.is_rank else marker_proc
        patched_by = _patched_by(frame_file, registry) if frame_file else None
        return signature, marker_proc, Crash(marker_body, exception, frame, frame_file, patched_by)

    def _flag(self, registry) -> str | None:
        if registry is None:
            return None
        try:
            distribution = registry.get(self.server)
        except KeyError:
            return None
        if self.version is not None:
            flag = distribution.fusion_flag(self.version)
            return f"turn fusion on with {flag}" if flag else None
        flags = [f"{f.flag} ({f.versions})" for f in distribution.fusion_flags]
        return ("turn fusion on with " + "; ".join(flags)) if flags else None


def _patched_by(frame_file: str, registry) -> str | None:
    """Which distribution's patches touch the file of a traceback frame (site-packages paths end
    with the RECORD path the patch data names)."""
    if registry is None:
        return None
    path = frame_file.replace("\\", "/")
    found = []
    for distribution in registry:
        ids = sorted({p.id for ps in distribution.patch_sets for p in ps.patches
                      if path == p.file or path.endswith("/" + p.file)})
        if ids:
            found.append(f"{distribution.name}: {', '.join(ids)}")
    return "; ".join(found) or None


# -- the command ------------------------------------------------------------------------------------

class CheckLogRequest(NamedTuple):
    source: str  # a path or "-"
    server: str | None = None
    version: str | None = None
    python: str | None = None
    follow: bool = False
    timeout: float = 600.0


def _installed_version(python: str, server: str | None, registry) -> tuple[str | None, str | None]:
    """(server, version) as the target interpreter has them installed (the probe status uses)."""
    names = [server] if server else list(SERVERS)
    env = environment.start_probe(python, names).result(registry.wanted_rows)
    for name in names:
        installed = env.get(name)
        if installed is not None:
            return name, installed.raw_version
    raise UsageError(f"neither {' nor '.join(names)} is installed for {python}",
                     hint="--python names the interpreter the server runs; or give --version")


def _predicted(python: str, server: str | None):
    """The fusion chain status judges for ``server`` in the environment of ``python`` (None:
    no server there has one)."""
    report = pipeline.status(pipeline.Request(python=python))
    return next((t.chain for t in report.trees if t.chain is not None and (server is None or t.distribution.name == server)),
                None)


def check_log(request: CheckLogRequest, *, on_event: Callable[[LogCheckReport], None] | None = None) -> LogCheckReport:
    registry = load_registry(full=False)
    server, raw_version, version_from = request.server, request.version, "--version" if request.version else ""
    if request.python and not raw_version:
        server, raw_version = _installed_version(request.python, server, registry)
        version_from = "--python"
    version = None
    if raw_version:
        try:
            version = Version(raw_version.lstrip("v"))
        except InvalidVersion:
            raise UsageError(f"--version {raw_version!r} is not a release number (e.g. 0.5.9)") from None
        if not server:
            raise UsageError("--version names a release of which server? give --server sglang or --server vllm")
    data = {name: load_logs(name) for name in ([server] if server else SERVERS)}
    analysis = Analysis(data, server, version, version_from)
    source = request.source
    deadline = time.monotonic() + request.timeout if request.follow else None

    predicted = _predicted(request.python, server) if request.python else None

    def finish(timed_out: bool = False) -> LogCheckReport:
        report = analysis.report(source, registry=registry, timed_out=timed_out)
        report.predicted = predicted
        if predicted is not None and report.step and report.verdict != FUSED:
            # The log names the step; the chain of this environment has its exact command, or
            # judges that step open, which means the server did not run from this environment.
            step = predicted.step(report.step)
            if step.result is StepResult.BLOCKS and step.fix:
                report.fix = f"{report.fix or step.text} — here: `{step.fix}`"
            elif step.result is StepResult.OK and report.step not in ("requested", "tp"):
                report.notes = [*report.notes, f"status judges the {report.step} step open in {request.python} "
                                               f"({step.text}): did the server run from that environment?"]
        if request.python and report.fix:  # an sm120patch command in the fix, for the environment asked about
            report.fix = _SM120PATCH_COMMAND.sub(
                lambda m: m.group(0) if "--python" in m.group(1) else f"`{command(m.group(1), ('--python', request.python))}`",
                report.fix)
        return report

    if source == "-":
        lines = _stdin_lines(deadline)
    else:
        path = Path(source)
        if request.follow:
            lines = Follower(path)
        else:
            try:
                handle = open(path, "rb")  # noqa: SIM115 - closed when the generator is
            except FileNotFoundError:
                raise UsageError(f"no such file: {source}", hint="--follow waits for a log that does not exist yet") from None
            except IsADirectoryError:
                raise UsageError(f"{source} is a directory, not a log file") from None
            except OSError as exc:
                raise TransactionError(f"cannot read {source}: {exc.strerror or exc}") from None
            lines = _stream_closing(handle)
    idle_since = None
    try:
        for raw in lines:
            if raw is None:
                now = time.monotonic()
                idle_since = idle_since or now
                if now - idle_since >= IDLE_CRASH_S:
                    analysis.idle()
                    analysis.changed = True
            else:
                idle_since = None
                analysis.feed(raw)
            if deadline is not None and analysis.changed:
                analysis.changed = False
                report = finish()
                if on_event is not None:
                    on_event(report)
                if report.final:
                    return report
            if deadline is not None and time.monotonic() >= deadline:
                return finish(timed_out=True)
    except OSError as exc:
        raise TransactionError(f"cannot read {source}: {exc.strerror or exc}") from None
    analysis.idle()
    return finish()


def _stream_closing(handle) -> Iterator[bytes]:
    with handle:
        yield from _stream(handle)


__all__ = ["CheckLogRequest", "check_log", "load_logs", "parse_logs", "Sm120PatchError"]
