"""The target environment: which interpreter, which distributions, where they are installed.

sm120patch never guesses site-packages paths. It runs a small standard-library probe in the
target interpreter (``--python PATH``, default: the interpreter running sm120patch) and trusts
what that interpreter reports. The probe ships only the RECORD rows of the files sm120patch
reads; an install is identified by its ``.dist-info`` directory, not by the interpreter.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from packaging.version import InvalidVersion, Version

from sm120patch.errors import TargetError

# A Requires-Dist line that pins exactly: "name==X" or "name[extra]==X", no marker, no other
# specifier. packaging.requirements would parse any PEP 508 line, but its import (the marker
# grammar) is 13 ms, a tenth of `status`; every other form (a marker, a range, a URL) is not an
# unconditional exact pin, which is the only thing status reports.
_EXACT_PIN = re.compile(r"^\s*([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)\s*(?:\[[^\]]*\])?\s*\(?\s*===?\s*([^\s,;()]+)\s*\)?\s*$")

PROBE_TIMEOUT_S = 60
# Distributions sm120patch reports on without patching them, and the RECORD rows it wants.
FLASHINFER_JIT_CACHE = "flashinfer-jit-cache"
COMPANIONS = {FLASHINFER_JIT_CACHE: {"suffixes": ["/trtllm_comm/trtllm_comm.so"]}, "flashinfer-cubin": {}}


def parse_version(raw: str) -> Version | None:
    """A PEP 440 version, or None for a string that is not one (a fork's own scheme)."""
    try:
        return Version(raw)
    except InvalidVersion:
        return None


def normalize_name(name: str) -> str:
    """PEP 503 name normalization (packaging.utils.canonicalize_name's rule, without importing
    packaging.tags on the status path)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_record_hash(value: str) -> str | None:
    """``sha256=<urlsafe-b64, unpadded>`` (PEP 376/627) -> hex, or None for other algorithms."""
    import base64

    algorithm, _, encoded = value.partition("=")
    if algorithm != "sha256" or not encoded:
        return None
    padded = encoded + "=" * (-len(encoded) % 4)
    return base64.urlsafe_b64decode(padded).hex()


@dataclass(frozen=True)
class RecordEntry:
    """One row of a wheel's ``RECORD``: the hash is kept as lowercase sha256 hex."""

    path: str
    sha256: str | None
    size: int | None


@dataclass(frozen=True)
class InstalledDistribution:
    """One install of a distribution: its ``.dist-info`` directory is its identity."""

    name: str
    raw_version: str
    site_dir: Path  # the directory RECORD paths are relative to (site-packages, a --target dir)
    dist_info: Path
    record: Mapping[str, RecordEntry]  # only the rows sm120patch asked for
    has_record: bool = True
    direct_url: Mapping | None = None
    requires: tuple[str, ...] = ()
    installer: str | None = None  # what the INSTALLER file names: pip, uv, ...

    @property
    def version(self) -> Version | None:
        return parse_version(self.raw_version)

    @property
    def editable(self) -> bool:
        return bool((self.direct_url or {}).get("dir_info", {}).get("editable"))

    @property
    def editable_source(self) -> Path | None:
        """The source tree of an editable install (``pip install -e``)."""
        if not self.editable:
            return None
        from urllib.parse import unquote, urlparse

        return Path(unquote(urlparse(self.direct_url["url"]).path))

    def pinned_version_of(self, other: str) -> str | None:
        """The exact version this distribution pins ``other`` to (``name==X`` with no marker), if it does."""
        for line in self.requires:
            found = _EXACT_PIN.match(line)
            if found and normalize_name(found.group(1)) == normalize_name(other):
                return found.group(2)
        return None


@dataclass(frozen=True)
class Environment:
    executable: Path
    python_version: str
    prefix: Path
    user_base: Path | None
    distributions: Mapping[str, InstalledDistribution | None] = field(default_factory=dict)

    def get(self, name: str) -> InstalledDistribution | None:
        return self.distributions.get(name)

    def reinstall_command(self, dist: InstalledDistribution) -> str:
        """The command that puts the release's bytes back, for this environment's installer."""
        spec = f"{dist.name}=={dist.raw_version}"
        if dist.installer == "uv":
            return f"uv pip install --python {self.executable} --reinstall --no-deps {spec}"
        target = f" --target {dist.site_dir}" if not _on_sys_path_of(self, dist) else ""
        return f"{self.executable} -m pip install --force-reinstall --no-deps{target} {spec}"


def _on_sys_path_of(env: Environment, dist: InstalledDistribution) -> bool:
    """Whether ``dist`` sits where the interpreter itself installs (not a --target directory
    reached through PYTHONPATH)."""
    bases = [env.prefix] + ([env.user_base] if env.user_base else [])
    return any(dist.site_dir.is_relative_to(base) for base in bases)


def resolve_python(python: str | os.PathLike) -> str:
    """``--python`` as a shell would run it: a bare name is looked up on PATH; a path is made
    absolute but not resolved (a venv's python is a symlink to the base interpreter, and
    resolving it would ask the wrong environment)."""
    text = os.fspath(python)
    if os.sep not in text:
        found = shutil.which(text)
        if found is None:
            raise TargetError(f"--python {text}: not found on PATH")
        return os.path.abspath(found)
    candidate = Path(text).expanduser()
    if not candidate.exists():
        raise TargetError(f"--python {text}: no such file")
    if candidate.is_dir():
        raise TargetError(f"--python {text}: is a directory, not a Python interpreter",
                          hint=f"pass the interpreter inside it, e.g. --python {candidate / 'bin' / 'python'}")
    if not os.access(candidate, os.X_OK):
        raise TargetError(f"--python {text}: not an executable file")
    return os.path.abspath(candidate)


def _probe_source() -> str:
    return Path(__file__).with_name("_probe.py").read_text(encoding="utf-8")


@dataclass
class Probe:
    """The probe running in the target interpreter; :meth:`result` waits for it. Starting it
    before importing the rest of sm120patch overlaps the two (``status`` stays fast)."""

    executable: str
    process: subprocess.Popen | None = None
    error: TargetError | None = None

    def result(self) -> Environment:
        if self.error is not None:
            raise self.error
        try:
            stdout, stderr = self.process.communicate(timeout=PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise TargetError(f"--python {self.executable}: no answer within {PROBE_TIMEOUT_S} s") from None
        try:
            data = json.loads(stdout)
            data["distributions"]
        except (ValueError, TypeError, KeyError):
            # Not a Python, or one too old to run the probe: say so without echoing what it
            # printed (a program that is not Python prints anything at all).
            raise TargetError(f"--python {self.executable}: not a usable Python interpreter (3.8 or newer)") from None
        return Environment(
            executable=Path(data["executable"] or self.executable),
            python_version=data["python_version"],
            prefix=Path(data["prefix"]),
            user_base=Path(data["user_base"]) if data["user_base"] else None,
            distributions={name: _from_probe(name, raw) if raw else None for name, raw in data["distributions"].items()},
        )


def start_probe(python: str | os.PathLike | None, wanted: Mapping[str, Mapping]) -> Probe:
    """Start asking ``python`` (default: this interpreter) about the distributions ``wanted``
    ({name: {"files": [...], "suffixes": [...]}}); companions are always asked about."""
    try:
        executable = resolve_python(python) if python is not None else sys.executable
    except TargetError as exc:
        return Probe(os.fspath(python), error=exc)
    request = {**COMPANIONS, **wanted}
    try:
        process = subprocess.Popen(
            [executable, "-c", _probe_source(), json.dumps(request)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True,
            cwd="/",  # keep the caller's working directory off the target's sys.path
        )
    except OSError as exc:
        return Probe(executable, error=TargetError(f"--python {executable}: could not run it ({exc.strerror or exc})"))
    return Probe(executable, process)


def _from_probe(name: str, raw: Mapping) -> InstalledDistribution:
    record = {}
    for path, hash_value, size in raw["record"]:
        record[path] = RecordEntry(path=path, sha256=parse_record_hash(hash_value) if hash_value else None,
                                   size=int(size) if size.isdigit() else None)
    return InstalledDistribution(
        name=name,  # the normalized name asked for, not the metadata's spelling
        raw_version=raw["version"],
        site_dir=Path(raw["site_dir"]),
        dist_info=Path(raw["dist_info"]),
        record=record,
        has_record=raw.get("has_record", True),
        direct_url=raw["direct_url"],
        requires=tuple(raw["requires"]),
        installer=raw.get("installer"),
    )
