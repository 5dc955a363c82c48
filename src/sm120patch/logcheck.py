"""`sm120patch check-log`: whether a running (or finished) SGLang or vLLM server really fused,
read from its own log lines.

Its parts, each found by name: where the lines come from (:mod:`sm120patch.logsource`: a file,
a pipe, ``--follow``), what a collector put in front of a line (:mod:`sm120patch.collectors`),
which run and which rank a line belongs to (:mod:`sm120patch.logruns`), and what a release's lines
mean (:mod:`sm120patch.logdata`, the data of ``patches/<server>/logs.toml``). This module turns
what the newest run said into one verdict per rank and one overall. Only `check-log` imports
it: `status` stays fast.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from dataclasses import replace
from typing import Callable, NamedTuple

from packaging.version import InvalidVersion, Version

from sm120patch import collectors, environment, pipeline
from sm120patch.chain import StepResult
from sm120patch.distributions import load_registry
from sm120patch.errors import Sm120PatchError, TransactionError, UsageError
from sm120patch.invocation import command
from sm120patch.logdata import LogData, LogLine, load_logs, parse_logs
from sm120patch.logruns import MAIN, TRACEBACK as TRACEBACK_LINE, Runs
from sm120patch.logsource import Unwrap, open_lines
from sm120patch.reports import (CRASHED, FELL_BACK, FUSED, NOT_REQUESTED, STARTING, UNKNOWN_RELEASE, Crash,
                                LogCheckReport, RankVerdict)
from sm120patch.words import counted, spec_words

_SM120PATCH_COMMAND = re.compile(r"`sm120patch ([^`]*)`")

SERVERS = ("sglang", "vllm")
MAX_SEEN = 20
IDLE_CRASH_S = 2.0  # --follow: a traceback this long without its last line is taken as finished
NAMES = {"sglang": "SGLang", "vllm": "vLLM"}


class Analysis:
    """Everything the newest run of the log said, sorted by process. :meth:`report` turns it into
    the verdict."""

    def __init__(self, data: dict[str, LogData], server: str | None, version: Version | None,
                 version_from: str) -> None:
        self.data = data
        self.server = server
        self.given = version, version_from  # --version or --python: every run is of that release
        self.version = version
        self.version_from = version_from
        self.runs: Runs | None = None
        self.lines = 0
        self.at = 0  # the line number in the stream (a fleet's stream holds other replicas' lines too)
        self.changed = False  # an event since the verdict was last made
        self.ambiguous: list[str] = []  # lines whose meaning depends on a release not known

    @property
    def logs(self) -> LogData | None:
        return self.data.get(self.server) if self.server else None

    @property
    def processes(self) -> dict:
        return self.runs.run.processes if self.runs is not None else {}

    def _format_of(self, text: str) -> str | None:
        for name, logs in self.data.items():
            if (logs.process is not None and logs.process.match(text)) or logs.header.match(text):
                return name
        return None

    def _begin(self, server: str) -> None:
        self.server = server
        logs = self.logs
        self.runs = Runs(logs, [row for row in logs.lines if row.kind == "signature"])

    def feed(self, raw: str, at: int | None = None) -> None:
        self.lines += 1
        self.at = at if at is not None else self.lines
        text = collectors.strip(raw)
        if not text:
            return
        if self.runs is None:
            found = self._format_of(text)
            if found is None:
                return
            if self.server is not None and found != self.server:
                raise UsageError(
                    f"line {self.at} is in {NAMES[found]}'s log format, and no line before it in "
                    f"{NAMES[self.server]}'s: this is not a log of --server {self.server}",
                    hint=f"drop --server, or give --server {found}")
            self._begin(found)
        logs = self.runs.logs
        proc, body, header = self.runs.process(text)
        if header and body.startswith(logs.echo):
            return  # a request echoed by --log-requests: the user's text, never the server's word
        rows = []
        if logs.firsts.search(text) is not None:
            # Only the server's own records say what it did (a line with its header); a line
            # without one is a traceback's or native code's (printed_by), never a fusion line.
            rows = [(row, m) for row in logs.lines if (header or row.printed_by is not None)
                    and self._may_apply(row) and (m := row.match(text))]
        for row, _ in rows:
            if self.runs.start(row, self.at, proc):
                proc, body, _ = self.runs.process(text)
                self.version, self.version_from = self.given
                self.ambiguous = []
                self.changed = True
        if self.runs.traceback(proc, body):
            self.changed = True
        if rows and self.version is None and self._ambiguous(rows, body):
            rows = [(row, m) for row, m in rows if row.kind != "fell-back"]
        for row, match in rows:
            proc.add(row, body, match if match is not True else None)
            self.changed = True
            if row.kind in ("ready", "crashed", "died"):
                self.runs.run.over = True
            if row.kind == "version" and self.version is None:
                found = match["value"] if match is not True else None
                try:
                    self.version, self.version_from = Version(found), "the log"
                except (InvalidVersion, TypeError):
                    pass

    def _may_apply(self, row: LogLine) -> bool:
        logs = self.logs
        return self.version is None or not logs.covers(self.version) or row.versions.contains(
            self.version, prereleases=True)

    def _ambiguous(self, rows, body: str) -> bool:
        """A line that is a fall-back in some releases and not in others, the release not known:
        say so, and do not count it as one (the lines say no more)."""
        kinds = {row.kind for row, _ in rows} - {"signature"}  # an exception's fragment quoted in the line
        if "fell-back" not in kinds or len(kinds) == 1:
            return False
        meanings = "; ".join(f"{row.kind} in {self.server} {row.versions}" for row, _ in rows)
        note = f"{body} (means {meanings}: --version tells which)"
        if len(self.ambiguous) < MAX_SEEN and note not in self.ambiguous:  # once, however many ranks print it
            self.ambiguous.append(note)
        return True

    def idle(self) -> None:
        if self.runs is not None:
            self.runs.idle()

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

    def _fix(self, row_step: str | None, row_fix: str | None, text: str, proc=None,
             functions=frozenset()) -> tuple[str | None, str | None]:
        """The step and fix of a failure line, or of the cause its text names: a cause
        (out of memory), or an exception a signature row knows (a fell-back line that caught
        FlashInfer's JIT gate names the JIT gate, not the workspace). With ``proc``, the process's
        lines before it may name the cause (vLLM logs a backend's failure, then that no backend
        made the workspace): the newest that names one."""
        said = [text]
        if proc is not None:
            said += [body for row, body, _ in reversed(proc.events) if row.kind in ("note", "fell-back")]
        signatures = [row for row in self.logs.lines if row.kind == "signature" and self._applies(row)]
        for line in said:
            cause = self.logs.cause(line, functions)
            if cause is not None:
                return cause.step, cause.fix
            signature = next((row for row in signatures if row.match(line)), None)
            if signature is not None:
                return signature.step, signature.fix
        return row_step, row_fix

    def report(self, source: str, *, registry=None, timed_out: bool = False) -> LogCheckReport:
        runs = self.runs
        base = dict(source=source, server=self.server, version=str(self.version) if self.version else None,
                    version_from=self.version_from if self.version else "", lines=self.lines, timed_out=timed_out,
                    run=runs.run.number if runs else 1, runs=runs.count if runs else 1,
                    run_line=runs.run.first_line if runs else 1)
        logs = self.logs
        if runs is None:
            formats = NAMES[self.server] + "'s" if self.server else "SGLang's or vLLM's"
            return LogCheckReport(**base, verdict=STARTING, final=False,
                                  summary=f"no line of {formats} log format in {counted(self.lines, 'line')}: "
                                          "no verdict")
        notes = []
        if self.version is None:
            notes.append(f"release not known ({'SGLang does not log its version' if logs.server == 'sglang' else 'no version line in this log'}): "
                         "every known release's lines were used; --version or --python names it")
        notes += [f"not counted: {a}" for a in self.ambiguous]
        if runs.count > 1:
            notes.append(f"the log holds {runs.count} runs of the server: the newest (run {runs.run.number}, from "
                         f"line {runs.run.first_line}) decides; the earlier ones are over")
        if self.version is not None and not logs.covers(self.version):
            seen = [f"{proc.label}: {body}" for key, proc in self.processes.items() for row, body, _ in proc.events
                    if row.kind not in ("config", "tp", "requested", "version", "progress")]
            return LogCheckReport(**base, verdict=UNKNOWN_RELEASE, final=True, seen=seen[:MAX_SEEN],
                                  summary=f"{logs.server} {self.version} is not mapped: sm120patch knows its log "
                                          f"lines for {spec_words(logs.versions)} (what was seen is below, read with every "
                                          "known release's lines)")
        tp = self._size("tp")
        # Every rank of every data-parallel replica and pipeline stage makes its own workspace
        # (DP2 x TP2 is 4 ranks, not 2).
        expected = tp * (self._size("dp") or 1) * (self._size("pp") or 1) if tp is not None else None
        requested = None
        if any(True for _ in self._events("config")):
            requested = any(True for _ in self._events("requested"))
        ranks = {key: proc for key, proc in self.processes.items() if proc.is_rank}
        ready = next(iter(self._events("ready")), None)
        kernel = [(proc.label, m["value"]) for _, proc, _, _, m in self._events("kernel") if m is not None]
        for note in logs.kernel_notes:
            if self.version is None or note.versions.contains(self.version, prereleases=True):
                if not kernel:
                    notes.append(note.text)
        if kernel:
            notes.append("the fusion pass replaced patterns: " + ", ".join(f"{label}: {n}" for label, n in kernel))
        # A line every rank prints (sm120patch's tuned limits) is one note naming its ranks.
        said: dict[str, list[str]] = {}
        for _, proc, row, body, _ in self._events("note"):
            said.setdefault(body, []).append(proc.label)
        notes += [f"{', '.join(dict.fromkeys(labels))}: {body}" for body, labels in said.items()]
        per_rank = self._per_rank(ranks, ready is not None)
        more = dict(ranks=per_rank, expected_ranks=expected, notes=notes)

        crash = self._crash(registry)
        if crash is not None:
            signature, marker_proc, crash_info, functions = crash
            pending = any(p.traceback is not None and p.traceback.active for p in self.processes.values())
            step, fix = self._fix(signature.step if signature else None, signature.fix if signature else None,
                                  crash_info.exception or "", functions=functions)
            where = f" ({marker_proc.label})" if marker_proc.label != MAIN else ""
            summary = f"crashed{where}: {crash_info.exception or crash_info.marker}"
            return LogCheckReport(**base, verdict=CRASHED, final=not pending, summary=summary, step=step, fix=fix,
                                  message=crash_info.marker, crash=crash_info, **more)

        # A death outside Python outranks all but a Python crash (whose traceback says more): native
        # lines (printed_by) before the launcher's own report of a child gone, ranks before the rest.
        died = next(iter(sorted(self._events("died"), key=lambda e: (e[2].printed_by is None, not e[1].is_rank))),
                    None)
        if died is not None:
            _, proc, row, body, _ = died
            where = f" ({proc.label})" if proc.label != MAIN else ""
            fused_before = any(True for _ in self._events("fused"))
            step, fix = self._fix(row.step, row.fix, body)
            return LogCheckReport(**base, verdict=CRASHED, final=True, step=step, fix=fix, message=body,
                                  summary=f"died outside Python{where}: {body}"
                                          + ("; fusion had started (the workspace was created)" if fused_before else ""),
                                  crash=Crash(body, None, None, None, None, row.printed_by), **more)

        # The line that says why on the rank that failed, before another rank's echo of it.
        fell = next(iter(sorted(self._events("fell-back"), key=lambda e: (e[2].echo, not e[1].is_rank))), None)
        if fell is not None:
            _, proc, row, body, _ = fell
            where = f" on {proc.label}" if proc.label != MAIN else ""
            step, fix = self._fix(row.step, row.fix, body, proc)
            return LogCheckReport(**base, verdict=FELL_BACK, final=True, step=step, fix=fix, message=body,
                                  summary=f"fell back to unfused allreduce{where}: {body}", **more)

        off = next(iter(self._events("off")), None)
        if off is not None and requested:
            _, proc, row, body, _ = off
            return LogCheckReport(**base, verdict=NOT_REQUESTED, final=True, step=row.step, fix=row.fix,
                                  summary="not fused: fusion was asked for, but a setting of this run keeps it off "
                                          f"({', '.join(row.message)})", **more)

        fused, plain = {}, {}
        for key, proc, row, body, match in self._events("fused"):
            (plain if row.only_if_requested and not requested else fused)[key] = (row, body, match)
        # The release not known, a line that means fusion only where it was asked for in some
        # releases is not fusion's until the settings line says so.
        fused = {key: event for key, event in fused.items() if key not in plain}
        if plain and not fused:
            said = ("the settings line does not ask for fusion" if requested is False
                    else "the settings line is not in this log, so it cannot tell")
            notes.append(f"FlashInfer's allreduce workspace was created on {counted(len(plain), 'process', 'processes')}, which "
                         f"this release also does for plain allreduces without the fusion pass ({said})")
            if requested is None and ready is not None:
                return LogCheckReport(**base, verdict=STARTING, final=True,
                                      summary="no verdict: the workspace lines on "
                                              f"{counted(len(plain), 'process', 'processes')} mean fusion only where "
                                              "the settings line asks for the pass, and the settings line is not in "
                                              "this log (rotated away?): read the log from the server's start",
                                      **more)
        if fused:
            backends = sorted({(m["backend"] if m is not None and "backend" in m.groupdict() and m["backend"]
                                else row.backend) or "?" for row, _, m in fused.values()})
            want = expected if expected is not None else max(len(ranks), 1)
            have = len([k for k in fused if k in ranks]) if ranks else len(fused)
            backend = ", ".join(backends)
            if have >= want and ready is not None:
                return LogCheckReport(**base, verdict=FUSED, final=True, backend=backend,
                                      message=next(iter(fused.values()))[1],
                                      summary=f"fused: FlashInfer's workspace (backend {backend}) was created on "
                                              f"every rank ({have} of {want}) and the server is ready", **more)
            if have >= want:
                # Exit 0 means fused and serving: CUDA graph capture and the first compile still come
                # after the workspace, and either can end the start.
                return LogCheckReport(**base, verdict=STARTING, final=False, backend=backend,
                                      message=next(iter(fused.values()))[1],
                                      summary=f"fused so far, not serving yet: the workspace (backend {backend}) "
                                              f"was created on every rank ({have} of {want}), and the server has "
                                              f"not said it is ready ({self._stage() or 'no later stage logged'}): "
                                              "no verdict yet", **more)
            if ready is not None:
                missing = sorted(proc.label for key, proc in ranks.items() if key not in fused)
                return LogCheckReport(**base, verdict=FELL_BACK, final=True, step="workspace", backend=backend,
                                      fix="a rank without the workspace serves unfused: its own lines above say "
                                          "why; restart the server once they are fixed",
                                      summary=f"fell back: the workspace was created on {have} of {want} ranks"
                                              + (f" (none on {', '.join(missing)})" if missing else ""), **more)
        if ready is not None:
            if requested:
                if tp == 1:
                    return LogCheckReport(**base, verdict=FELL_BACK, final=True, step="tp",
                                          fix="fusion fuses tensor-parallel allreduces: it needs TP 2 or more",
                                          summary="fell back: fusion was asked for at TP 1 (nothing to fuse)", **more)
                lazy = next(iter(self._events("lazy")), None)
                if lazy is not None and next(iter(self._events("request")), None) is None:
                    return LogCheckReport(**base, verdict=STARTING, final=False,
                                          summary="not known until the first request: with "
                                                  f"{', '.join(lazy[2].message)} this release creates the workspace "
                                                  "at the first fused call, and no request was served yet", **more)
                quiet = next((q for q in logs.quiet if self.version is None
                              or q.versions.contains(self.version, prereleases=True)), None)
                if quiet is not None and quiet.fused and self.version is not None:
                    return LogCheckReport(**base, verdict=FUSED, final=True,
                                          summary=f"fused, by what the log leaves out: {quiet.fused}", **more)
                return LogCheckReport(**base, verdict=FELL_BACK, final=True, step=quiet.step if quiet else None,
                                      fix=quiet.fix if quiet else None,
                                      summary="fell back: fusion was asked for, the server is ready, and no rank "
                                              "logged FlashInfer's workspace", **more)
            flag = self._flag(registry)
            said = ("the settings line does not ask for fusion" if requested is False
                    else "the settings line is not in this log (rotated away?)")
            return LogCheckReport(**base, verdict=NOT_REQUESTED, final=True, step="requested", fix=flag,
                                  summary=f"not requested: the server is ready and no fusion line came ({said})",
                                  **more)
        stage = self._stage()
        partial = f"; the workspace on {counted(len(fused), 'rank')} so far" if fused else ""
        return LogCheckReport(**base, verdict=STARTING, final=False,
                              summary=f"still starting ({stage or 'no start-up stage logged yet'}{partial}): "
                                      "no verdict yet", **more)

    def _size(self, kind: str) -> int | None:
        """The parallel size (tp, dp, pp) the settings line gives."""
        return next((int(m["value"]) for _, _, _, _, m in self._events(kind) if m is not None), None)

    def _stage(self) -> str | None:
        """The start-up stage the newest progress line of any process names."""
        newest = None
        for proc in self.processes.values():
            for row, _, _ in proc.events:
                if row.kind == "progress" and self._applies(row):
                    newest = row.stage
        return newest

    def _per_rank(self, ranks: dict, ready: bool) -> list[RankVerdict]:
        out = []
        for key, proc in ranks.items():
            verdict, detail, cause = STARTING, "no fusion line yet", False
            for row, body, match in proc.events:
                if not self._applies(row):
                    continue
                if row.kind == "progress" and verdict == STARTING:
                    detail = row.stage
                elif row.kind == "fused" and verdict in (STARTING,):
                    verdict, detail = FUSED, body
                elif row.kind == "fell-back" and verdict != CRASHED and not (cause and row.echo):
                    verdict, detail, cause = FELL_BACK, body, not row.echo
                elif row.kind in ("crashed", "died"):
                    verdict, detail = CRASHED, body
            if verdict == CRASHED and proc.tracebacks and proc.tracebacks[-1].exceptions:
                detail = proc.tracebacks[-1].exceptions[-1]
            if verdict == STARTING and ready:
                verdict, detail = NOT_REQUESTED, "ready, no fusion line"
            out.append(RankVerdict(proc.label, verdict, detail))
        return sorted(out, key=lambda r: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", r.rank)])

    def _crash(self, registry):
        markers = list(self._events("crashed"))
        signatures = [row for row in self.logs.lines if row.kind == "signature" and self._applies(row)]

        def signature_of(proc):
            for tb in proc.tracebacks:
                for exc in tb.exceptions:
                    for row in signatures:
                        if row.match(exc):
                            return row, tb, exc
            return None

        if not markers:
            # A traceback with none of the server's lines around it (Python's own report of an
            # uncaught exception, on stderr) whose exception a signature row knows, in a run that
            # never got ready: the process died of it.
            if next(iter(self._events("ready")), None) is not None:
                return None
            bare = [p for p in self.processes.values() if signature_of(p) is not None]
            if not bare:
                return None
            proc = sorted(bare, key=lambda p: not p.is_rank)[0]
            markers = [(None, proc, None, f"{TRACEBACK_LINE} (no line of the server's own around it)", None)]

        # The process that says why: one whose exception has a known signature, then a rank, then any.
        candidates = sorted(self.processes.values(), key=lambda p: (signature_of(p) is None, not p.is_rank))
        chosen = next((p for p in candidates if p.tracebacks and any(t.exceptions for t in p.tracebacks)), None)
        _, marker_proc, _, marker_body, _ = sorted(markers, key=lambda m: not m[1].is_rank)[0]
        signature = exception = frame = frame_file = None
        functions = frozenset()
        if chosen is not None:
            found = signature_of(chosen)
            if found is not None:
                signature, tb, exception = found
            else:
                tb = next(t for t in reversed(chosen.tracebacks) if t.exceptions)
                exception = tb.exceptions[-1]
            frame, frame_file, functions = tb.frame, tb.frame_file, frozenset(tb.functions)
            marker_proc = chosen if chosen.is_rank or not marker_proc.is_rank else marker_proc
        patched_by = _patched_by(frame_file, registry) if frame_file else None
        return signature, marker_proc, Crash(marker_body, exception, frame, frame_file, patched_by), functions

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
    # Only a run that begins after check-log started decides (it follows the log for it): a log
    # kept across restarts still ends with the run before the restart until the new one's first
    # line comes, and that run's verdict is not the restarted server's.
    new_run: bool = False


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
    # Without --server, the lines' format says which server (a --version is that server's release).
    data = {name: load_logs(name) for name in SERVERS}
    fleet = Fleet(lambda: Analysis(data, server, version, version_from))
    source = request.source
    started = time.monotonic()
    deadline = started + request.timeout
    predicted = _predicted(request.python, server) if request.python else None

    def finish(analysis: Analysis, timed_out: bool) -> LogCheckReport:
        report = analysis.report(source, registry=registry, timed_out=timed_out)
        report.predicted = predicted
        if predicted is not None and report.step and report.verdict != FUSED:
            # The log names the step; the chain of this environment has its exact command, or
            # judges that step open, which means the server did not run from that environment.
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

    follow = request.follow or request.new_run
    before: dict | None = None  # --new-run: the runs each replica's log held once what was there was read

    def runs_read(analysis: Analysis) -> int:
        return analysis.runs.count if analysis.runs is not None else 0

    def replica(name: str | None, analysis: Analysis, timed_out: bool) -> LogCheckReport:
        """A replica's verdict so far; with --new-run, none until a run begins after the start."""
        runs = runs_read(analysis)
        if before is None or runs > before.get(name, 0):
            report = finish(analysis, timed_out)
        else:
            newest = (f"run {analysis.runs.run.number}, from line {analysis.runs.run.first_line}" if runs
                      else "none")
            report = LogCheckReport(source=source, server=analysis.server, version=str(version) if version else None,
                                    version_from=version_from if version else "", verdict=STARTING, final=False,
                                    summary=f"no run of the server began after check-log started (the newest in the "
                                            f"log: {newest}, was already there): no verdict yet",
                                    lines=analysis.lines, timed_out=timed_out, run=runs, runs=runs)
        report.replica = name
        return report

    def current(timed_out: bool = False) -> LogCheckReport:
        # Lines of no replica that hold no server line (kubectl's own warnings in the stream) are no
        # replica of the server: they do not make the fleet "no verdict".
        read = {name: a for name, a in fleet.replicas.items() if a.runs is not None} or fleet.replicas
        return fleet.report([replica(name, analysis, timed_out) for name, analysis in read.items()],
                            source, timed_out)

    # --follow: the first final verdict once what was there is read (the newest run of each replica
    # decides); a pipe or FIFO, followed or not, ends at its writer's close or at the deadline.
    lines = open_lines(source, follow=follow, deadline=deadline, mark_start=request.new_run)
    idle_since = None
    caught_up = False
    try:
        for text in lines:
            if text is None:
                now = time.monotonic()
                if not caught_up and request.new_run:
                    before = {name: runs_read(a) for name, a in fleet.replicas.items()}
                caught_up = True
                idle_since = idle_since or now
                if now - idle_since >= IDLE_CRASH_S:
                    fleet.idle()
            else:
                idle_since = None
                fleet.feed(text)
            if follow and caught_up and fleet.changed():
                report = current()
                if on_event is not None:
                    on_event(report)
                if report.final:
                    return report
            if (follow or text is None) and time.monotonic() >= deadline:
                return current(timed_out=True)
    except OSError as exc:
        raise TransactionError(f"cannot read {source}: {exc.strerror or exc}") from None
    fleet.idle()
    return current()


# -- several replicas in one stream ------------------------------------------------------------------

# `kubectl logs -l app=... --prefix` (and `kubectl logs deploy/x --all-containers --prefix`) puts
# "[pod/NAME/CONTAINER] " before each line of each pod: the replica. SGLang's own lines begin
# "[" and a date, never a resource kind and a slash.
REPLICA = re.compile(r"\[(?P<name>[a-z][a-z0-9.-]*/[^/\]\s]+/[^/\]\s]+)\] ")
_DIGITS = frozenset("0123456789")
_WRAPPED = frozenset("0123456789{")
# Worst first: the overall verdict of several replicas is the worst of theirs.
WORST = (CRASHED, FELL_BACK, NOT_REQUESTED, UNKNOWN_RELEASE, STARTING, FUSED)


class Fleet:
    """The replicas of one stream, each read on its own (its runs, its ranks, its verdict): a
    stream without replica prefixes is one replica, named None."""

    def __init__(self, make: Callable[[], Analysis]) -> None:
        self.make = make
        self.replicas: dict[str | None, Analysis] = {}
        self.unwrap: dict[str | None, Unwrap] = {}
        self.lines = 0

    def feed(self, raw: str) -> None:
        self.lines += 1
        name = None
        first = raw[:1]
        if first == "[" and raw[1:2] not in _DIGITS:  # SGLang's own "[" is its date's
            match = REPLICA.match(raw)
            if match is not None:
                name, raw = match["name"], raw[match.end():]
                first = raw[:1]
        analysis = self.replicas.get(name)
        if analysis is None:
            analysis = self.replicas[name] = self.make()
            self.unwrap[name] = Unwrap()
        if first in _WRAPPED:  # what a container runtime wraps a line in starts with a date or "{"
            raw = self.unwrap[name](raw)
            if raw is None:  # a partial record: the line goes on in the next one
                analysis.lines += 1
                return
        analysis.feed(raw, self.lines)

    def idle(self) -> None:
        for analysis in self.replicas.values():
            analysis.idle()
            analysis.changed = True

    def changed(self) -> bool:
        changed = False
        for analysis in self.replicas.values():
            changed |= analysis.changed
            analysis.changed = False
        return changed

    def report(self, reports: list[LogCheckReport], source: str, timed_out: bool) -> LogCheckReport:
        """One replica's report as it is (named, if the stream named it); several: the worst one's,
        its summary naming it, with every replica's report under it, final when every one is."""
        if not reports:
            return self.make().report(source, timed_out=timed_out)
        if len(reports) == 1:
            return reports[0]
        named = sorted(reports, key=lambda r: (r.replica is None, r.replica or ""))
        worst = min(named, key=lambda r: WORST.index(r.verdict))
        counts = Counter(r.verdict for r in named)
        tally = ", ".join(f"{n} {verdict}" for verdict, n in sorted(counts.items(), key=lambda c: WORST.index(c[0])))
        overall = replace(worst, replicas=named, final=all(r.final for r in named), lines=self.lines,
                          summary=f"{counted(len(named), 'replica')} ({tally}); the worst, "
                                  f"{worst.replica or 'the lines without a replica prefix'}: {worst.summary}")
        return overall


__all__ = ["CheckLogRequest", "Fleet", "check_log", "load_logs", "parse_logs", "Sm120PatchError"]
