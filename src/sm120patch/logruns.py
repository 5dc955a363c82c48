"""Which run of the server and which of its processes (a rank) a log line belongs to.

One file often holds several runs (systemd's ``append:``, ``>>``, a log kept across restarts):
the crashed or fell-back run before a patch, then the run after it. A run starts at a line its
release prints once per start (``starts_run`` in logs.toml) when the process that prints it has
printed it already in the run being read, or that run is over (ready, crashed, died); the
newest run decides the verdict, and what came before it is dropped, so memory stays that of one
run.

Within a run each line is sorted to the process that wrote it (the rank or worker prefix of the
server's format; a header-less line, a traceback's, to the record above it), and each process
keeps what a verdict needs, bounded: its last :data:`MAX_EVENTS` events (the first of each row
kept), and of its tracebacks the first whose exception a signature row names and the last.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from sm120patch.logdata import LogData, LogLine

FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+?)\s*$')
TRACEBACK = "Traceback (most recent call last):"
MAIN = "main"  # the lines of no rank: SGLang's main process, vLLM's API server and engine core
MAX_EVENTS = 64
ENDS_RUN = ("ready", "crashed", "died")


@dataclass
class Traceback:
    active: bool = True
    frame: str | None = None
    frame_file: str | None = None
    exceptions: list = field(default_factory=list)
    functions: set = field(default_factory=set)  # the functions of its frames (bounded): where it went through


@dataclass
class Process:
    label: str
    is_rank: bool = False
    events: list = field(default_factory=list)  # (LogLine, text, match), bounded
    traceback: Traceback | None = None
    tracebacks: list = field(default_factory=list)  # at most: the first with a signature, and the last

    def add(self, row: LogLine, body: str, match) -> None:
        self.events.append((row, body, match))
        if len(self.events) > MAX_EVENTS:
            # Drop the oldest repeat: the first line of each row (what the verdict rests on) stays.
            seen = set()
            for index, (old, _, _) in enumerate(self.events):
                if id(old) in seen:
                    del self.events[index]
                    return
                seen.add(id(old))
            del self.events[0]


@dataclass
class Run:
    """One start of the server, from the line it began at."""

    number: int
    first_line: int
    processes: dict = field(default_factory=dict)
    starts: set = field(default_factory=set)  # (id of a starts_run row, the process label that printed it)
    over: bool = False  # ready, crashed or died: another start is a new run


class Runs:
    """Sorts each line of one server's log to its run and its process."""

    def __init__(self, logs: LogData, signatures) -> None:
        self.logs = logs
        self.signatures = signatures  # rows whose exceptions a traceback keeps
        self.run = Run(1, 1)
        self.count = 1
        self.last_key = MAIN

    def start(self, row: LogLine, line_number: int, proc: Process) -> bool:
        """Whether ``row``, printed by ``proc``, begins a new run here (the caller then sorts the
        line again and resets what it learnt). The same start line from another process (vLLM's
        engine cores under data parallelism) is the same run."""
        run = self.run
        if not row.starts_run:
            return False
        marker = (id(row), proc.label)
        if marker not in run.starts and not run.over:
            run.starts.add(marker)
            return False
        self.count += 1
        self.run = Run(self.count, line_number, starts={marker})
        self.last_key = MAIN
        return True

    def process(self, text: str) -> tuple[Process, str, bool]:
        """The process a line is of, the line without its prefixes, and whether it had a header."""
        logs, body = self.logs, text
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
            label = self.run.processes[key].label if key in self.run.processes else MAIN
        self.last_key = key
        proc = self.run.processes.get(key)
        if proc is None:
            proc = self.run.processes[key] = Process(label or MAIN)
        if label and label != proc.label:  # vLLM renames a worker once its ranks are known
            proc.label = label
        if not proc.is_rank and key != MAIN and logs.rank.search(proc.label):
            proc.is_rank = True
        return proc, body, header is not None

    def traceback(self, proc: Process, body: str) -> bool:
        """Follows a process's traceback; True when it changed what a verdict can say."""
        if TRACEBACK in body:
            proc.traceback = Traceback()
            kept = [t for t in proc.tracebacks if self._signed(t)][:1]
            proc.tracebacks = kept + [proc.traceback]
            return True
        tb = proc.traceback
        if tb is None or not tb.active:
            return False
        frame = FRAME.match(body)
        if frame is not None:
            tb.frame = body.strip()
            tb.frame_file = frame["file"]
            if len(tb.functions) < MAX_EVENTS:
                tb.functions.add(frame["func"])
            return False
        if body[:1].isspace() or not body.strip() or tb.frame is None:
            return False  # the source line under a frame, a caret line
        tb.exceptions.append(body.strip())
        tb.active = False
        return True

    def _signed(self, tb: Traceback) -> bool:
        return any(row.match(exc) for exc in tb.exceptions for row in self.signatures)

    def idle(self) -> None:
        """--follow found nothing new for a while: a traceback cut short is as complete as it gets."""
        for proc in self.run.processes.values():
            if proc.traceback is not None and proc.traceback.active and proc.traceback.exceptions:
                proc.traceback.active = False


__all__ = ["MAIN", "Process", "Run", "Runs", "Traceback"]
