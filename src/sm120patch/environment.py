"""The target environment: which interpreter, which distributions, what their RECORD says.

sm120patch never guesses site-packages paths. It runs a small standard-library probe in the
target interpreter (``--python PATH``, default: the interpreter running sm120patch) and
trusts what that interpreter's ``importlib.metadata`` reports.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Mapping

from packaging.version import InvalidVersion, Version

from sm120patch.errors import RefusedError, TargetError

FLASHINFER = "flashinfer-python"
SGLANG = "sglang"
# Distributions sm120patch patches, and the ones it only reports on.
PATCHABLE = (FLASHINFER, SGLANG)
FLASHINFER_JIT_CACHE = "flashinfer-jit-cache"
COMPANIONS = (FLASHINFER_JIT_CACHE, "flashinfer-cubin")

PROBE_TIMEOUT_S = 60


def parse_version(raw: str) -> Version | None:
    """A PEP 440 version, or None for a string that is not one (a fork's own scheme)."""
    try:
        return Version(raw)
    except InvalidVersion:
        return None


def normalize_name(name: str) -> str:
    """PEP 503 name normalization (what packaging.utils.canonicalize_name does, without
    importing packaging.tags on the status path)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class RecordEntry:
    """One row of a wheel's ``RECORD``: the hash is kept as lowercase sha256 hex."""

    path: str
    sha256: str | None
    size: int | None


def parse_record_hash(value: str) -> str | None:
    """``sha256=<urlsafe-b64, unpadded>`` (PEP 376/627) -> hex, or None for other algorithms."""
    algorithm, _, encoded = value.partition("=")
    if algorithm != "sha256" or not encoded:
        return None
    padded = encoded + "=" * (-len(encoded) % 4)
    return base64.urlsafe_b64decode(padded).hex()


def normalize_relpath(relpath: str) -> str:
    """A RECORD-style relative path, or ValueError for one that could escape its root."""
    path = PurePosixPath(relpath)
    if not relpath or path.is_absolute() or ".." in path.parts or "\\" in relpath:
        raise ValueError(f"not a safe relative path: {relpath!r}")
    return str(path)


@dataclass(frozen=True)
class InstalledDistribution:
    name: str
    raw_version: str
    location: Path  # the directory RECORD paths are relative to (site-packages)
    metadata_dir: Path
    record: Mapping[str, RecordEntry]
    direct_url: Mapping | None = None
    requires: tuple[str, ...] = ()

    @property
    def version(self) -> Version | None:
        return parse_version(self.raw_version)

    @property
    def editable(self) -> bool:
        return bool((self.direct_url or {}).get("dir_info", {}).get("editable"))

    def pinned_version_of(self, other: str) -> str | None:
        """The exact version this distribution pins ``other`` to (``==X``), if it does."""
        from packaging.requirements import InvalidRequirement, Requirement  # slow import: only here

        for line in self.requires:
            try:
                req = Requirement(line)
            except InvalidRequirement:
                continue
            if normalize_name(req.name) != normalize_name(other) or req.marker:
                continue
            for spec in req.specifier:
                if spec.operator in ("==", "==="):
                    return spec.version
        return None


@dataclass(frozen=True)
class InstalledFiles:
    """Where an installed distribution's files are, and what the release's bytes hash to.

    This is the one place that maps a patch's file (a RECORD path) to a real path, and it
    confines every edit to files the distribution's RECORD lists, inside its location.
    A git source tree (another kind of target) provides the same three methods.
    """

    dist: InstalledDistribution

    @property
    def label(self) -> str:
        return f"{self.dist.name} {self.dist.raw_version} in {self.dist.location}"

    def release_sha256(self, relpath: str) -> str | None:
        entry = self.dist.record.get(relpath)
        return entry.sha256 if entry else None

    def absolute(self, relpath: str) -> Path:
        try:
            relpath = normalize_relpath(relpath)
        except ValueError as exc:
            raise RefusedError(str(exc)) from None
        if relpath not in self.dist.record:
            raise RefusedError(
                f"{relpath} is not listed in {self.dist.name}'s RECORD; "
                "sm120patch only edits files the installed release owns"
            )
        root = self.dist.location
        path = root / relpath
        if path.is_symlink():
            raise RefusedError(
                f"{path} is a symbolic link, not the file the wheel installed",
                hint=f"reinstall {self.dist.name}=={self.dist.raw_version} to restore it",
            )
        if not path.resolve().is_relative_to(root.resolve()):
            raise RefusedError(f"{path} resolves outside {root}")
        return path


@dataclass(frozen=True)
class TargetEnvironment:
    executable: Path
    python_version: str
    prefix: Path
    user_base: Path | None
    distributions: Mapping[str, InstalledDistribution | None] = field(default_factory=dict)

    def get(self, name: str) -> InstalledDistribution | None:
        return self.distributions.get(name)

    def state_root(self, dist: InstalledDistribution) -> Path:
        """Where sm120patch keeps journal and backups for ``dist``: outside every RECORD-listed
        directory (pip never removes or trips over it), next to the environment that owns it."""
        override = os.environ.get("SM120PATCH_STATE_DIR")
        if override:
            return Path(override)
        base = self.prefix
        if self.user_base and dist.location.is_relative_to(self.user_base) and not dist.location.is_relative_to(self.prefix):
            base = self.user_base
        return base / "share" / "sm120patch"


def _probe_source() -> str:
    return (Path(__file__).with_name("_probe.py")).read_text(encoding="utf-8")


@dataclass
class Probe:
    """The probe running in the target interpreter; :meth:`result` waits for it. Starting it
    before importing the rest of sm120patch overlaps the two (``status`` stays fast)."""

    executable: str
    process: subprocess.Popen | None = None
    error: str | None = None

    def result(self) -> TargetEnvironment:
        if self.error or self.process is None:
            raise TargetError(f"--python {self.executable}: {self.error}")
        try:
            stdout, stderr = self.process.communicate(timeout=PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise TargetError(f"--python {self.executable}: no answer within {PROBE_TIMEOUT_S} s") from None
        try:
            data = json.loads(stdout)
        except ValueError:
            detail = (stderr or stdout).strip().splitlines()[-1:] or ["no output"]
            raise TargetError(f"--python {self.executable}: not a usable Python interpreter ({detail[0]})") from None
        if "error" in data:
            raise TargetError(f"--python {self.executable}: {data['error']}")
        return TargetEnvironment(
            executable=Path(data["executable"] or self.executable),
            python_version=data["python_version"],
            prefix=Path(data["prefix"]),
            user_base=Path(data["user_base"]) if data["user_base"] else None,
            distributions={
                name: _distribution_from_probe(name, raw) if raw else None
                for name, raw in data["distributions"].items()
            },
        )


def start_probe(python: str | os.PathLike | None = None) -> Probe:
    """Start asking ``python`` (default: this interpreter) about itself and our distributions."""
    executable = str(python) if python is not None else sys.executable
    if python is not None:
        candidate = Path(executable).expanduser()
        if not candidate.exists():
            return Probe(executable, error="no such file")
        if candidate.is_dir() or not os.access(candidate, os.X_OK):
            return Probe(executable, error="not an executable file")
        # Absolute, but not resolved: a venv's python is a symlink to the base interpreter,
        # and resolving it would ask the wrong environment.
        executable = os.path.abspath(candidate)
    try:
        process = subprocess.Popen(
            [executable, "-c", _probe_source(), *PATCHABLE, *COMPANIONS],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            cwd="/",  # keep the caller's working directory off the target's sys.path
        )
    except OSError as exc:
        return Probe(executable, error=f"could not run it ({exc.strerror or exc})")
    return Probe(executable, process)


def locate(python: str | os.PathLike | None = None) -> TargetEnvironment:
    """Ask ``python`` (default: this interpreter) about itself and the distributions we handle."""
    return start_probe(python).result()


def _distribution_from_probe(name: str, raw: Mapping) -> InstalledDistribution:
    record = {}
    for path, hash_value, size in raw["record"]:
        record[path] = RecordEntry(
            path=path,
            sha256=parse_record_hash(hash_value) if hash_value else None,
            size=int(size) if size.isdigit() else None,
        )
    return InstalledDistribution(
        name=name,  # the normalized name we asked for, not the metadata's spelling
        raw_version=raw["version"],
        location=Path(raw["location"]),
        metadata_dir=Path(raw["metadata_dir"]),
        record=record,
        direct_url=raw["direct_url"],
        requires=tuple(raw["requires"]),
    )
