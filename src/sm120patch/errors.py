"""One exception base for every expected failure, each carrying its documented exit code.

The CLI turns a :class:`Sm120PatchError` into one line (``sm120patch: error: ...``), an
optional ``hint:`` line that works when copied as printed, and the exit code below."""

from __future__ import annotations

import enum
import os
from typing import Sequence

from packaging.version import InvalidVersion, Version

from sm120patch import __version__, terminal


class ExitCode(enum.IntEnum):
    """Process exit codes, documented in the README ("Exit codes") and in each command's help."""

    OK = 0
    # status: something installed is not (fully) patched; verify/bench: a check failed or could
    # not run; revert: something could not be restored (the rest was); build, and apply --build
    # once the patch is applied: the build did not succeed (failed, could not start, interrupted).
    NOT_OK = 1
    USAGE = 2  # bad input: options, --python, a version selector, patch-set data
    REFUSED = 3  # a file is not the release's bytes (drift), no pinned patch set, an interrupted run
    FAILED = 4  # an operation failed (I/O, permissions, lock held); everything was rolled back
    # check-log: no verdict yet (the server is still starting, or --follow's timeout passed):
    # a distinct code so that systemd, Ansible and CI can wait and ask again.
    NO_VERDICT = 5
    # A signal before the commit point: the change in progress was rolled back (128 + the
    # signal's number, as a shell reports it; signals.py). After it the command finishes.
    HANGUP = 129  # SIGHUP
    INTERRUPTED = 130  # SIGINT, Ctrl-C
    TERMINATED = 143  # SIGTERM (systemd, Ansible)


class Sm120PatchError(Exception):
    """An expected failure: the CLI prints ``message`` (and ``hint``) and exits with ``exit_code``."""

    exit_code: ExitCode = ExitCode.FAILED

    def __init__(self, message: str, *, hint: str | None = None,
                 fix: Sequence[tuple[str, str | None]] = (), as_root: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        # Options that correct the command (value None: an option alone). The CLI prints the
        # user's own command with them applied, ``hint`` saying what it then does.
        self.fix = tuple(fix)
        # Another user owns what had to be written: the same command through sudo is a way out
        # (sm120patch as root keeps the owner's ownership of every file it writes).
        self.as_root = as_root
        self.invocation = None  # the command that failed, set by the CLI

    @property
    def hint_line(self) -> str | None:
        """The hint as printed: the corrected command first, when there is one."""
        if self.as_root and self.invocation is not None and os.geteuid() != 0:
            # `sudo sm120patch` fails where sm120patch is not on sudo's PATH (pipx: ~/.local/bin).
            words = str(self.invocation).split(" ", 1)
            command = 'sudo "$(command -v sm120patch)"' + (f" {words[1]}" if len(words) > 1 else "")
            other = self.hint and "as root" not in self.hint  # the owner is another user than root
            return f"`{command}` runs it as root" + (f"; or {self.hint}" if other else "")
        if not self.fix:
            return self.hint
        if self.invocation is not None:
            corrected = self.invocation
            for option, value in self.fix:
                corrected = corrected.replaced(option, value)
            command = str(corrected)
        else:
            command = terminal.join(word for option, value in self.fix for word in (option, value) if word is not None)
        return f"`{command}`" + (f" {self.hint}" if self.hint else "")


class UsageError(Sm120PatchError):
    """The user asked for something that cannot be done as asked."""

    exit_code = ExitCode.USAGE


class TargetError(UsageError):
    """The target interpreter, environment or checkout cannot be inspected."""


class PatchDataError(UsageError):
    """A patch set, distribution file or manifest is malformed or inconsistent."""


class RefusedError(Sm120PatchError):
    """The environment is not in a state sm120patch can safely change."""

    exit_code = ExitCode.REFUSED


class NewerFormatError(RefusedError):
    """A ledger or journal written by a newer sm120patch, in a format this one cannot honour:
    judging or changing the install with it would go by a record this version misreads (an
    older sm120patch meeting a newer one's state, after a downgrade)."""


def newer_format(what: str, path, found, known: int, written_by: str | None) -> NewerFormatError:
    """The one-line refusal, naming the sm120patch that wrote ``path`` as the record says (it
    can read it). "Install X or later" only where X is a later release than this one: a record
    that names this version or an older one came from another build (a development checkout),
    and only that build is sure to read it."""
    writer = written_by or "a newer sm120patch"
    wanted = written_by.split()[-1] if written_by and written_by.startswith("sm120patch ") else None
    if wanted is not None and not _later(wanted, __version__):
        advice = f"install the sm120patch build that patched this environment (one that reads {what} format {found})"
    elif wanted is not None:
        advice = f"install sm120patch {wanted} or later (the version that wrote it)"
    else:
        advice = "install the newer sm120patch that patched this environment"
    return NewerFormatError(
        f"{path} was written by {writer} ({what} format {found}); this sm120patch {__version__} reads format {known} "
        "and cannot honour it; nothing was changed", hint=advice + ", then run the command again")


def _later(version: str, than: str) -> bool:
    try:
        return Version(version) > Version(than)
    except InvalidVersion:  # not a version sm120patch writes: nothing says it is older
        return True


class TunedCodeError(RefusedError):
    """`apply --with tuned-limits`: the server's patched decision code raised (or did not import)
    in the target interpreter; the transaction rolled the whole apply back."""


class CheckFailedError(Sm120PatchError):
    """A check the user asked for ran and failed, or could not run."""

    exit_code = ExitCode.NOT_OK


class TransactionError(Sm120PatchError):
    """A write failed; the transaction was rolled back (the message says what is left)."""

    exit_code = ExitCode.FAILED


class BuildInterrupted(CheckFailedError):
    """A signal ended ``apply --build``'s build after the patch was committed: the patch stands,
    so the exit code is the build's failure (1), never 128 + the signal ("rolled back")."""
