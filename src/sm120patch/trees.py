"""What sm120patch knows of a tree's files, behind one small interface: the bottom of the house.

A tree is one install of a distribution in an environment (``installed.InstalledTree``: its
files are where its ``RECORD`` says, which gives the release's hash of each) or a git checkout
of the project (``checkout.CheckoutTree``: the wheel's paths map onto the repository's layout,
and the vendor manifest gives the release's hash of each). Assessment and planning read a tree
through :class:`Tree` alone; what the screen says about it is the plain value :class:`TreeWords`.
Writing, the commands' questions and the JIT cache live with each kind, above the planner.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Protocol

from packaging.version import Version

from sm120patch.distributions import Distribution
from sm120patch.fileio import read_regular
from sm120patch.state import Ledger


class FileRead(NamedTuple):
    """A tree's file as sm120patch found it."""

    relpath: str
    path: Path
    data: bytes | None  # None: missing (or unreadable, see problem)
    link: str | None = None  # the entry is a symbolic link to this target (data: the target's bytes)
    problem: str | None = None  # why sm120patch will not touch it, whatever its bytes


class TreeWords(NamedTuple):
    """What the screen says about a tree; render turns it into sentences, nothing branches on it."""

    kind: str  # the word the --json documents use ("environment", "checkout")
    label: str  # "flashinfer-python 0.6.4 in /srv/venv/lib/python3.12/site-packages"
    heading: str  # status's head line, before the verdict
    where: str  # status's head line, after the verdict
    reinstall_hint: str  # how to get the release's files back without sm120patch
    present: str  # a patch that is there ("present", "in HEAD")
    absent: str
    shared_with: str | None = None  # who else reads these files, when not this tree's environment alone
    # The command that reinstalls with copies instead of links, without the requirement (None: none).
    copy_reinstall: tuple[str, ...] | None = None


class Tree(Protocol):
    """What the planner knows of a tree: its release, its files, the release's hash and bytes of
    each, what sm120patch saved of them, and its ledger."""

    distribution: Distribution
    raw_version: str
    root: Path  # every file's path is under it; a diff is written from here
    judged_by_meaning: bool  # its files are judged by each patch's semantic check, not by the release's hashes

    @property
    def version(self) -> Version | None: ...
    @property
    def dist_info(self) -> Path | None: ...  # where the release's RECORD is (the ledger records it)
    @property
    def words(self) -> TreeWords: ...

    def read(self, relpath: str) -> FileRead: ...
    def release_sha256(self, relpath: str) -> str | None: ...
    def release_bytes(self, relpath: str, expected: str, *, wheel_dir: Path | None,
                      download: bool) -> tuple[bytes, str] | None: ...
    def saved_original(self, relpath: str, expected: str | None) -> bytes | None: ...
    def read_ledger(self) -> Ledger | None: ...


def read_or_none(path: Path) -> bytes | None:
    """A regular file's bytes; None when there is nothing there."""
    try:
        return read_regular(path)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
