"""One exception base for every expected failure, each carrying its documented exit code."""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """Process exit codes, documented in the README ("Exit codes")."""

    OK = 0
    NOT_PATCHED = 1  # status/verify: something selected is not (fully) patched
    USAGE = 2  # bad input: options, --python, version selectors, patch-set data
    REFUSED = 3  # a file is not the release's bytes (drift), or no pinned patch set
    FAILED = 4  # an operation failed (I/O, lock held); everything was rolled back


class Sm120PatchError(Exception):
    """An expected failure: the CLI prints ``message`` (and ``hint``) and exits with ``exit_code``."""

    exit_code: ExitCode = ExitCode.FAILED

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class UsageError(Sm120PatchError):
    """The user asked for something that cannot be done as asked."""

    exit_code = ExitCode.USAGE


class TargetError(UsageError):
    """The target interpreter or environment cannot be inspected."""


class PatchDataError(UsageError):
    """A patch set or manifest is malformed or inconsistent."""


class RefusedError(Sm120PatchError):
    """The environment is not in a state we can safely change."""

    exit_code = ExitCode.REFUSED


class CheckFailedError(Sm120PatchError):
    """A check the user asked for ran and failed (bench: a fused result off the reference)."""

    exit_code = ExitCode.NOT_PATCHED


class TransactionError(Sm120PatchError):
    """A write failed; the transaction was rolled back."""

    exit_code = ExitCode.FAILED
