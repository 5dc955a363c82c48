"""Vendor manifests: for one release, the sha256 of each file a patch set touches, pristine
and patched (for every combination of that file's patches), built by :func:`build_manifest`
from the real upstream wheel and checked there against the wheel's own RECORD.

Layout: ``vendor-manifests/<distribution>/<version>.json``. A file's patched hashes are keyed
by the ids of the patches applied to it, joined with ``+`` in patch-set order.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Mapping, NamedTuple, Sequence

from sm120patch.data import data_dir
from sm120patch.edits import apply_edits
from sm120patch.errors import PatchDataError
from sm120patch.hashing import sha256
from sm120patch.patchsets import Patch, PatchSet
from sm120patch.wheels import check_release, damaged, read_member, read_wheel

FORMAT = 1


def combination_key(patches: Sequence[Patch], forms: Sequence[str | None] = ()) -> str:
    """``jit-gate+pdl-gates``; a patch in an older form is ``<id>@<form>`` (``auto-enable@ungated``)."""
    forms = list(forms) or [None] * len(patches)
    return "+".join(p.id + (f"@{form}" if form else "") for p, form in zip(patches, forms))


def split_key(key: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the ids of a combination key, those of them applied in an older form)."""
    parts = key.split("+")
    return tuple(p.partition("@")[0] for p in parts), tuple(p.partition("@")[0] for p in parts if "@" in p)


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


def build_manifest(wheel: Path, patch_set: PatchSet) -> dict:
    """The manifest document for ``wheel`` (a real upstream wheel) under ``patch_set``."""
    from packaging.utils import parse_wheel_filename  # slow import (packaging.tags): only here

    name, version, _, _ = parse_wheel_filename(wheel.name)
    if name != patch_set.distribution or version not in patch_set.versions:
        raise PatchDataError(f"{wheel.name} is not pinned by {patch_set.name}")
    archive, record = read_wheel(wheel)
    files = {}
    with archive, damaged(wheel):
        check_release(archive, wheel)  # its METADATA is that release too: a renamed wheel is not
        for relpath in patch_set.files:
            if relpath not in record:
                raise PatchDataError(f"{wheel.name}: {relpath} is not in the wheel's RECORD")
            pristine = read_member(archive, relpath)
            if sha256(pristine) != record[relpath]:
                raise PatchDataError(f"{wheel.name}: {relpath} does not match the wheel's RECORD")
            patches = patch_set.patches_for(relpath)
            patched = {}
            for size in range(1, len(patches) + 1):
                for combo in itertools.combinations(patches, size):
                    ids = {p.id for p in combo}
                    if any(needed not in ids for p in combo for needed in p.requires
                           if patch_set.patch(needed).file == relpath):
                        continue  # a patch without one it requires in the same file: never made
                    # Each patch as today's data has it, and in every older form it ever had
                    # (an environment an earlier sm120patch patched is recognised by these).
                    for forms in itertools.product(*[[None, *(f.form for f in p.formers)] for p in combo]):
                        made = [p.former(form) if form else p for p, form in zip(combo, forms)]
                        result = apply_edits(pristine, made, where=f"{wheel.name}: {relpath}")
                        patched[combination_key(combo, forms)] = sha256(result)
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


def manifest_text(document: dict) -> str:
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


def write_manifest(document: dict, root: Path | None = None) -> Path:
    path = manifest_path(document["distribution"], document["version"], root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(manifest_text(document), encoding="utf-8")
    return path
