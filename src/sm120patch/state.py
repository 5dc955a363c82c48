"""What sm120patch keeps about an environment, outside every RECORD-listed directory.

    <state root>/                 (see TargetEnvironment.state_root)
      lock                        one writer per environment at a time
      <distribution>/
        applied.json              what is applied: version, patches, hashes per file
        originals/<relpath>       the release's bytes of each patched file (for revert)
        journal.json              only while a transaction runs (see transaction.py)
        stash/<relpath>           a transaction's before-bytes, for rollback
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from sm120patch.errors import TransactionError

STATE_DIR_MODE = 0o700  # backups of files root may own: not for other users' eyes or hands


@dataclass(frozen=True)
class AppliedFile:
    patches: tuple[str, ...]
    pristine: str
    patched: str


@dataclass(frozen=True)
class AppliedRecord:
    distribution: str
    version: str
    files: Mapping[str, AppliedFile] = field(default_factory=dict)
    unpinned: bool = False  # applied with --force to bytes no manifest vouches for
    patch_set: str | None = None  # the patch-set file used (for an unpinned release: borrowed)

    @property
    def patch_ids(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p for f in self.files.values() for p in f.patches))


@dataclass(frozen=True)
class DistributionState:
    root: Path  # <state root>/<distribution>

    @property
    def applied_path(self) -> Path:
        return self.root / "applied.json"

    @property
    def journal_path(self) -> Path:
        return self.root / "journal.json"

    def original(self, relpath: str) -> Path:
        return self.root / "originals" / relpath

    def stash(self, relpath: str) -> Path:
        return self.root / "stash" / relpath

    def read_applied(self) -> AppliedRecord | None:
        try:
            doc = json.loads(self.applied_path.read_text(encoding="utf-8"))
            return AppliedRecord(
                distribution=doc["distribution"],
                version=doc["version"],
                unpinned=bool(doc.get("unpinned", False)),
                patch_set=doc.get("patch_set"),
                files={
                    rel: AppliedFile(tuple(f["patches"]), f["pristine"], f["patched"])
                    for rel, f in doc["files"].items()
                },
            )
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise TransactionError(
                f"{self.applied_path} is unreadable ({exc})",
                hint="move it aside; `sm120patch status` then judges files by their hashes alone",
            ) from None


def applied_document(record: AppliedRecord) -> dict:
    return {
        "distribution": record.distribution,
        "version": record.version,
        "unpinned": record.unpinned,
        "patch_set": record.patch_set,
        "files": {
            rel: {"patches": list(f.patches), "pristine": f.pristine, "patched": f.patched}
            for rel, f in sorted(record.files.items())
        },
    }


def ensure_private_dir(path: Path) -> None:
    """Create ``path`` (mode 0700) and refuse one that other users could write to."""
    try:
        path.mkdir(parents=True, exist_ok=True, mode=STATE_DIR_MODE)
    except PermissionError:
        raise TransactionError(
            f"cannot create sm120patch's state directory {path}: permission denied; nothing was changed",
            hint="run sm120patch as the user who owns this environment, or set SM120PATCH_STATE_DIR",
        ) from None
    except OSError as exc:
        raise TransactionError(f"cannot create sm120patch's state directory {path}: {exc.strerror}; nothing was changed") from None
    mode = path.stat().st_mode
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise TransactionError(
            f"state directory {path} is writable by other users",
            hint=f"chmod go-w {path}",
        )


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_journal(state: DistributionState) -> dict | None:
    try:
        doc = json.loads(state.journal_path.read_text(encoding="utf-8"))
        for entry in doc["files"]:
            entry["relpath"], entry["path"], entry["before"]  # noqa: B018 - shape check
        doc["operation"]
        return doc
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TransactionError(
            f"the journal {state.journal_path} of an interrupted sm120patch run is unreadable ({exc}); "
            "nothing was changed",
            hint="`sm120patch status` shows each file's state by its hash; if every file is pristine or "
            "patched, remove the journal; otherwise reinstall the package with pip",
        ) from None
