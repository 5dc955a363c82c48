"""A tree held in memory: the whole of what the planner needs of a tree (sm120patch.trees.Tree),
in a page. Its write() is the test's own: the product's writers are the transaction and the commit."""

from __future__ import annotations

from pathlib import Path

from packaging.version import Version

from sm120patch.distributions import Distribution
from sm120patch.hashing import sha256
from sm120patch.plan import Plan
from sm120patch.state import Ledger
from sm120patch.trees import FileRead, TreeWords


class MemoryTree:
    judged_by_meaning = False  # the release's hashes are given, as a RECORD gives them
    keeps_ledger = True
    dist_info = None

    def __init__(self, distribution: Distribution, raw_version: str, files: dict[str, bytes],
                 release: dict[str, str]) -> None:
        self.distribution = distribution
        self.raw_version = raw_version
        self.root = Path("/memory") / distribution.name
        self.files = dict(files)  # relpath -> bytes
        self.release = dict(release)  # relpath -> the release's sha256
        self.originals: dict[str, bytes] = {}
        self.ledger: Ledger | None = None

    @property
    def version(self) -> Version:
        return Version(self.raw_version)

    @property
    def words(self) -> TreeWords:
        label = f"{self.distribution.name} {self.raw_version} in memory"
        return TreeWords(kind="memory", label=label, heading=label, where="", reinstall_hint="make a new one",
                         present="present", absent="absent")

    def read(self, relpath: str) -> FileRead:
        return FileRead(relpath, self.root / relpath, self.files.get(relpath))

    def release_sha256(self, relpath: str) -> str | None:
        return self.release.get(relpath)

    def release_bytes(self, relpath: str, expected: str, *, wheel_dir: Path | None,
                      download: bool) -> tuple[bytes, str] | None:
        data = self.saved_original(relpath, expected)
        return (data, "saved original") if data is not None else None

    def saved_original(self, relpath: str, expected: str | None) -> bytes | None:
        data = self.originals.get(relpath)
        return data if data is not None and expected in (None, sha256(data)) else None

    def read_ledger(self) -> Ledger | None:
        return self.ledger

    def write(self, plan: Plan) -> None:
        for planned in plan.files:
            if planned.original is not None:
                self.originals.setdefault(planned.relpath, planned.original)
            self.files[planned.relpath] = planned.data
        self.ledger = plan.ledger
        if self.ledger is None:
            self.originals.clear()
