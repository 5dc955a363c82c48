"""The journal: a transaction's write-ahead record, one versioned type whose bytes are made and
read back only here (the transaction writes them, atomically, before its first change).

    <state root>/journal.json    {"format", "operation", "run", "pid", "started", "roots",
                                  "entries": [{"op", "path", "label", "before", "after",
                                               "stash" | "aside"}, ...]}

It exists only while a run is changing the install location (its removal is the commit
point). When one run touches several install locations, the journal of the first is primary
and each other holds a pointer to it, ``{"format", "primary", "run"}``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple, Sequence

from sm120patch import __version__, dirfd, terminal
from sm120patch.errors import TransactionError, newer_format
from sm120patch.fileio import read_regular
from sm120patch.state import Owner, stash_root, state_root

JOURNAL_FORMAT = 2
# Who wrote it: an older sm120patch that cannot honour a newer format refuses and names this one.
WRITTEN_BY = f"sm120patch {__version__}"
JOURNAL_NAME = "journal.json"
REVERT_FORCE = "sm120patch revert --force"  # callers name the target: revert_command="... --python P"


class Journal(NamedTuple):
    """A transaction as its journal records it. ``entries`` are the journal's own records, one
    per change, in order."""

    path: Path  # the primary journal: a pointer in another install location leads here
    operation: str
    run: str
    roots: Sequence[str]  # the state roots it touches, the primary's first
    entries: Sequence[dict]
    pid: int | None = None
    started: str = "?"

    def describe(self, *, running: bool = False) -> str:
        """What the journal means to a status: a run in progress (``running``: another process
        holds the install location's lock), else one that was interrupted."""
        if running:
            return f"another sm120patch (pid {self.pid}) is running {self.operation} here right now"
        return f"an interrupted {self.operation} (started {self.started})"

    def to_bytes(self) -> bytes:
        return _dump({"format": JOURNAL_FORMAT, "written_by": WRITTEN_BY, "operation": self.operation, "run": self.run,
                      "pid": self.pid, "started": self.started, "roots": list(self.roots),
                      "entries": list(self.entries)})

    def pointer_bytes(self) -> bytes:
        """The journal of every other install location it touches: a pointer to this one."""
        return _dump({"format": JOURNAL_FORMAT, "written_by": WRITTEN_BY, "primary": str(self.path), "run": self.run})


def _dump(document: dict) -> bytes:
    return (json.dumps(document, indent=2, sort_keys=True) + "\n").encode()


def journal_at(site_dir: Path) -> Path:
    """The journal's path for the install location ``site_dir``."""
    return journal_in(state_root(site_dir))


def journal_in(root: Path) -> Path:
    """The journal's path in the state root ``root``."""
    return root / JOURNAL_NAME


def read_journal(path: Path, *, revert_command: str = REVERT_FORCE) -> Journal | None:
    """The journal at ``path`` (following a pointer to its primary), or None. A pointer whose
    primary is gone belonged to a run that committed: it is removed."""
    try:
        document = json.loads(read_regular(path).decode("utf-8"))
    except FileNotFoundError:
        return None
    except PermissionError:  # whether there is a journal at all cannot be known: say that, not more
        raise _no_access(path.parent) from None
    except (OSError, ValueError) as exc:
        raise _unreadable(path, exc, revert_command) from None
    found = document.get("format") if isinstance(document, dict) else None
    if isinstance(found, int) and not isinstance(found, bool) and found > JOURNAL_FORMAT:
        # A newer sm120patch's run: rolling it back (or "restoring every file" by force) with a
        # record this version misreads could make things worse; the version that wrote it can.
        written_by = document.get("written_by")
        raise newer_format("journal", path, found, JOURNAL_FORMAT, written_by if isinstance(written_by, str) else None)
    if isinstance(document, dict) and "primary" in document:
        primary = Path(document["primary"])
        if not primary.exists():
            dirfd.unlink(path, missing_ok=True)
            return None
        return read_journal(primary, revert_command=revert_command)
    try:
        if document["format"] != JOURNAL_FORMAT:
            raise ValueError(f"format {document['format']!r}, this sm120patch reads {JOURNAL_FORMAT}")
        for entry in document["entries"]:
            entry["op"], entry["path"], entry["before"], entry["after"]  # noqa: B018 - shape check
        return Journal(path, document["operation"], document.get("run"), document["roots"], document["entries"],
                       pid=document.get("pid"), started=document.get("started", "?"))
    except (KeyError, TypeError, ValueError) as exc:
        raise _unreadable(path, exc, revert_command) from None


def _no_access(directory: Path) -> TransactionError:
    try:
        owner = Owner.of(directory)
    except OSError:
        owner = None
    mine = owner is not None and owner.uid == os.geteuid()
    return TransactionError(
        f"sm120patch's state directory {directory} cannot be read by this user (uid {os.geteuid()}): permission "
        "denied; nothing was changed",
        hint=f"chmod 700 {terminal.quote(str(directory))}" if mine else
             f"run sm120patch as {owner.user}, who owns it" if owner else None)


def _unreadable(path: Path, exc: Exception, revert_command: str) -> TransactionError:
    return TransactionError(
        f"the journal {path} of an interrupted sm120patch run is unreadable ({exc}); nothing was changed",
        hint=f"`{revert_command}` restores every file to the release's bytes and removes the journal",
    )


def leftover_runs(site_dir: Path) -> list[Path]:
    """Stash directories no journal refers to: runs killed after their commit point, before
    they had cleaned up (their JIT asides carry the same run id)."""
    root = state_root(site_dir)
    if journal_in(root).exists() or not stash_root(root).is_dir():
        return []
    return sorted(p for p in stash_root(root).iterdir() if p.is_dir())
