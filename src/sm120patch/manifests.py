"""Vendor manifests: for one release, the sha256 of each file a patch set touches, pristine
and patched (for every combination of that file's patches), built by :func:`build_manifest`
from the real upstream wheel and checked there against the wheel's own RECORD.

Layout: ``vendor-manifests/<distribution>/<version>.json``. A file's patched hashes are keyed
by the ids of the patches applied to it, joined with ``+`` in patch-set order.
"""

from __future__ import annotations

import csv
import hashlib
import io
import itertools
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from packaging.utils import parse_wheel_filename

from sm120patch.data import data_dir
from sm120patch.environment import parse_record_hash
from sm120patch.errors import PatchDataError
from sm120patch.patchsets import Patch, PatchSet

FORMAT = 1


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def combination_key(patches: Sequence[Patch]) -> str:
    return "+".join(p.id for p in patches)


@dataclass(frozen=True)
class FileHashes:
    pristine: str
    patched: Mapping[str, str]  # combination key -> sha256

    def combination_of(self, digest: str) -> str | None:
        for key, value in self.patched.items():
            if value == digest:
                return key
        return None


@dataclass(frozen=True)
class Manifest:
    distribution: str
    version: str
    wheel: str
    wheel_sha256: str
    files: Mapping[str, FileHashes]


def manifest_path(distribution: str, version: str, root: Path | None = None) -> Path:
    return (root or data_dir("vendor-manifests")) / distribution / f"{version}.json"


def load_manifest(distribution: str, version: str, root: Path | None = None) -> Manifest | None:
    path = manifest_path(distribution, version, root)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        return Manifest(
            distribution=doc["distribution"],
            version=doc["version"],
            wheel=doc["wheel"]["filename"],
            wheel_sha256=doc["wheel"]["sha256"],
            files={
                rel: FileHashes(pristine=entry["pristine"], patched=dict(entry["patched"]))
                for rel, entry in doc["files"].items()
            },
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PatchDataError(f"{path}: malformed manifest ({exc})") from None


def apply_edits(source: bytes, patches: Sequence[Patch], *, where: str, by_meaning: bool = False) -> bytes:
    """Run every edit of ``patches`` on ``source``. Pinned use (the default): the source must be
    pristine for all of them, anything else is inconsistent patch data. ``by_meaning`` (--force,
    unpinned releases, source trees): edits already present are skipped, and a rewriter that
    finds another site count refuses the file; exact site counts hold either way."""
    from sm120patch.errors import RefusedError
    from sm120patch.rewriters import AlreadyApplied, Changed, create

    for patch in patches:
        for edit in patch.edits:
            result = create(edit.rewriter, edit.params).rewrite(source, sites=edit.sites)
            if isinstance(result, Changed):
                source = result.source
            elif by_meaning and isinstance(result, AlreadyApplied):
                continue
            elif by_meaning:
                raise RefusedError(f"--force: cannot apply {patch.id} to {where}: {result.reason}")
            else:
                detail = getattr(result, "reason", "already applied in the pristine file")
                raise PatchDataError(f"{where}: patch {patch.id} ({edit.rewriter}): {detail}")
    return source


def read_wheel(wheel: Path) -> tuple[zipfile.ZipFile, dict[str, str | None]]:
    archive = zipfile.ZipFile(wheel)
    records = [n for n in archive.namelist() if n.endswith(".dist-info/RECORD") and n.count("/") == 1]
    if len(records) != 1:
        raise PatchDataError(f"{wheel.name}: expected one .dist-info/RECORD, found {len(records)}")
    rows = csv.reader(io.StringIO(archive.read(records[0]).decode("utf-8")))
    return archive, {row[0]: parse_record_hash(row[1]) if row[1] else None for row in rows if row}


def build_manifest(wheel: Path, patch_set: PatchSet) -> dict:
    """The manifest document for ``wheel`` (a real upstream wheel) under ``patch_set``."""
    name, version, _, _ = parse_wheel_filename(wheel.name)
    if name != patch_set.distribution or version not in patch_set.versions:
        raise PatchDataError(f"{wheel.name} is not pinned by {patch_set.source.name}")
    archive, record = read_wheel(wheel)
    files = {}
    with archive:
        for relpath in patch_set.files:
            if relpath not in record:
                raise PatchDataError(f"{wheel.name}: {relpath} is not in the wheel's RECORD")
            pristine = archive.read(relpath)
            if sha256(pristine) != record[relpath]:
                raise PatchDataError(f"{wheel.name}: {relpath} does not match the wheel's RECORD")
            patches = patch_set.patches_for(relpath)
            patched = {}
            for size in range(1, len(patches) + 1):
                for combo in itertools.combinations(patches, size):
                    result = apply_edits(pristine, combo, where=f"{wheel.name}: {relpath}")
                    patched[combination_key(combo)] = sha256(result)
            files[relpath] = {"pristine": record[relpath], "patched": patched}
    return {
        "format": FORMAT,
        "generated_by": "sm120patch manifest build",
        "distribution": patch_set.distribution,
        "version": str(version),
        "patch_set": patch_set.source.name,
        "wheel": {"filename": wheel.name, "sha256": sha256(wheel.read_bytes())},
        "files": files,
    }


def render(document: dict) -> str:
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


def write_manifest(document: dict, root: Path | None = None) -> Path:
    path = manifest_path(document["distribution"], document["version"], root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(document), encoding="utf-8")
    return path
