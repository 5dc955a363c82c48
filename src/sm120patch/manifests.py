"""Vendor manifests: for one release, the sha256 of each file a patch set touches, pristine
and patched (for every combination of that file's patches), built by :func:`build_manifest`
from the real upstream wheel and checked there against the wheel's own RECORD.

Layout: ``vendor-manifests/<distribution>/<version>.json``. A file's patched hashes are keyed
by the ids of the patches applied to it, joined with ``+`` in patch-set order.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, NamedTuple, Sequence

from sm120patch.data import data_dir
from sm120patch.environment import parse_record_hash
from sm120patch.errors import PatchDataError
from sm120patch.hashing import sha256
from sm120patch.patchsets import Patch, PatchSet

if TYPE_CHECKING:
    import zipfile

FORMAT = 1


def combination_key(patches: Sequence[Patch]) -> str:
    return "+".join(p.id for p in patches)


class FileHashes(NamedTuple):
    pristine: str
    patched: Mapping[str, str]  # combination key -> sha256

    def combination_of(self, digest: str) -> str | None:
        for key, value in self.patched.items():
            if value == digest:
                return key
        return None


class Manifest(NamedTuple):
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


def apply_edits(data: bytes, patches: Sequence[Patch], *, where: str, by_meaning: bool = False) -> bytes:
    """Run every edit of ``patches`` on ``data``. Pinned use (the default): ``data`` must be
    pristine for all of them, anything else is inconsistent patch data. ``by_meaning`` (--force,
    unpinned releases, source trees): edits already present are skipped, and a rewriter that
    finds another site count refuses the file; exact site counts hold either way."""
    from sm120patch.errors import RefusedError
    from sm120patch.rewriters import AlreadyApplied, Changed, create

    for patch in patches:
        for edit in patch.edits:
            result = create(edit.rewriter, edit.params).rewrite(data, sites=edit.sites)
            if isinstance(result, Changed):
                data = result.data
            elif by_meaning and isinstance(result, AlreadyApplied):
                continue
            elif by_meaning:
                raise RefusedError(f"--force: cannot apply {patch.id} to {where}: {result.reason}")
            else:
                detail = getattr(result, "reason", "already applied in the pristine file")
                raise PatchDataError(f"{where}: patch {patch.id} ({edit.rewriter}): {detail}")
    return data


def wheel_file(wheel: Path, relpath: str) -> tuple[bytes, str | None]:
    """One file of a wheel and the hash the wheel's own RECORD gives it."""
    archive, record = read_wheel(wheel)
    with archive:
        try:
            return archive.read(relpath), record.get(relpath)
        except KeyError:
            raise PatchDataError(f"{wheel.name} has no {relpath}") from None


def read_wheel(wheel: Path) -> tuple[zipfile.ZipFile, dict[str, str | None]]:
    import zipfile

    archive = zipfile.ZipFile(wheel)
    records = [n for n in archive.namelist() if n.endswith(".dist-info/RECORD") and n.count("/") == 1]
    if len(records) != 1:
        raise PatchDataError(f"{wheel.name}: expected one .dist-info/RECORD, found {len(records)}")
    rows = csv.reader(io.StringIO(archive.read(records[0]).decode("utf-8")))
    return archive, {row[0]: parse_record_hash(row[1]) if row[1] else None for row in rows if row}


def build_manifest(wheel: Path, patch_set: PatchSet) -> dict:
    """The manifest document for ``wheel`` (a real upstream wheel) under ``patch_set``."""
    from packaging.utils import parse_wheel_filename  # slow import (packaging.tags): only here

    name, version, _, _ = parse_wheel_filename(wheel.name)
    if name != patch_set.distribution or version not in patch_set.versions:
        raise PatchDataError(f"{wheel.name} is not pinned by {patch_set.name}")
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
        "patch_set": patch_set.name,
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


def build_all(wheel_cache: Path | None, out: Path | None, *, check: bool,
              progress=None, names: Sequence[str] = ()) -> list[tuple[Path, bool]]:
    """Every pinned release's manifest from its real wheel (downloaded once into the cache):
    written (or, ``check``, compared with the committed one). Returns (path, identical)."""
    from sm120patch import wheels
    from sm120patch.distributions import load_registry

    cache = wheel_cache or wheels.default_cache()
    results = []
    registry = load_registry()
    try:
        chosen = [registry.get(name) for name in names] if names else list(registry.distributions)
    except KeyError as exc:
        from sm120patch.errors import UsageError

        known = ", ".join(d.name for d in registry.distributions)
        raise UsageError(f"--distribution {exc.args[0]}: not a distribution sm120patch knows ({known})") from None
    releases = [(ps, v) for d in chosen for ps in d.patch_sets for v in ps.versions]
    for index, (patch_set, version) in enumerate(releases, 1):
        if progress:
            progress(f"[{index}/{len(releases)}] {patch_set.distribution} {version}")
        wheel = wheels.fetch_wheel(patch_set.distribution, str(version), cache)
        document = build_manifest(wheel, patch_set)
        if check:
            path = manifest_path(patch_set.distribution, str(version))
            results.append((path, path.exists() and path.read_text(encoding="utf-8") == render(document)))
        else:
            results.append((write_manifest(document, out), True))
    return results
