"""The target environment: which interpreter, which distributions, where they are installed.

sm120patch never guesses site-packages paths. It runs a small standard-library probe in the
target interpreter (``--python PATH``, default: the interpreter running sm120patch) and trusts
what that interpreter reports: where each distribution's ``.dist-info`` is. sm120patch then
reads from that RECORD only the rows of the files its patch sets touch; an install is
identified by its ``.dist-info`` directory, not by the interpreter.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Mapping, NamedTuple

from packaging.version import InvalidVersion, Version

from sm120patch.errors import Sm120PatchError, TargetError
from sm120patch.fileio import NotRegularFile, read_regular
from sm120patch.state import InstallState

# A Requires-Dist line that pins exactly: "name==X" or "name[extra]==X", no marker, no other
# specifier. packaging.requirements would parse any PEP 508 line, but its import (the marker
# grammar) is 13 ms, a tenth of `status`; every other form (a marker, a range, a URL) is not an
# unconditional exact pin, which is the only thing status reports.
_EXACT_PIN = re.compile(r"^\s*([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)\s*(?:\[[^\]]*\])?\s*\(?\s*===?\s*([^\s,;()]+)\s*\)?\s*$")

PROBE_TIMEOUT_S = 60
MINIMUM_PYTHON = (3, 8)
# Distributions sm120patch reports on without patching them, and the RECORD rows it wants.
FLASHINFER_JIT_CACHE = "flashinfer-jit-cache"
COMPANIONS = {FLASHINFER_JIT_CACHE: {"suffixes": ["/trtllm_comm/trtllm_comm.so"]}, "flashinfer-cubin": {},
              # Only its release (status compares it with a tuned-limits profile's, as the server
              # does): its RECORD, thousands of rows, is never read.
              "torch": {"record": False}}


def version_or_none(raw: str) -> Version | None:
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


class RecordEntry(NamedTuple):
    """One row of a wheel's ``RECORD``: the hash is kept as lowercase sha256 hex."""

    path: str
    sha256: str | None
    size: int | None
    algorithm: str | None = None  # as RECORD names it ("sha256"; None: the row has no hash)


def record_rows(data: bytes, files=(), suffixes=()) -> dict[str, RecordEntry]:
    """The rows of a RECORD (CSV: path,hash,size) for ``files`` and for paths ending in one of
    ``suffixes``. FlashInfer's RECORD has 2,000 rows and sm120patch needs a handful: each wanted
    path is looked up where a row can start (bare, or quoted as the csv module quotes), and only
    a suffix (a companion's .so) makes it read every row."""
    lines = []
    for path in files:
        for written in (path, '"' + path.replace('"', '""') + '"'):
            needle = written.encode("utf-8") + b","
            if data.startswith(needle):
                start = 0
            else:
                start = data.find(b"\n" + needle) + 1
                if not start:  # find gave -1
                    continue
            end = data.find(b"\n", start)
            lines.append(data[start:] if end == -1 else data[start:end])
            break
    if suffixes:
        lines += data.splitlines()
    rows, suffixes, wanted = {}, tuple(suffixes), set(files)
    for raw in lines:
        try:
            line = raw.decode("utf-8").rstrip("\r")
        except UnicodeDecodeError:
            continue
        if '"' in line:  # a quoted path (it holds a comma or a quote): the csv module's rules
            import csv

            row = next(csv.reader([line]), [])
        else:
            row = line.split(",")
        if not row or not (row[0] in wanted or (suffixes and row[0].endswith(suffixes))):
            continue
        path, hash_value, size = (row + ["", ""])[:3]
        rows[path] = RecordEntry(path=path, sha256=parse_record_hash(hash_value) if hash_value else None,
                                 size=int(size) if size.isdigit() else None,
                                 algorithm=hash_value.partition("=")[0] if hash_value else None)
    return rows


class InstalledDistribution(NamedTuple):
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
    record_error: str | None = None  # RECORD is there but cannot be read (permission denied, ...)

    @property
    def version(self) -> Version | None:
        return version_or_none(self.raw_version)

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


class Environment(NamedTuple):
    executable: Path
    python_version: str
    prefix: Path
    user_base: Path | None
    distributions: Mapping[str, InstalledDistribution | None] = MappingProxyType({})
    base_prefix: Path | None = None  # sys.base_prefix: a venv's base interpreter
    search_path: tuple[Path, ...] = ()  # the directories on its sys.path: install locations
    chosen_by: str = ""  # no --python was given: why this is the target, in words

    def shares_base(self, dist: InstalledDistribution) -> bool:
        """Whether ``dist`` is installed in the base interpreter's site-packages, which this venv
        sees through --system-site-packages (so every environment on that base shares it)."""
        if self.base_prefix is None or self.base_prefix == self.prefix:
            return False
        return dist.site_dir.is_relative_to(self.base_prefix) and not dist.site_dir.is_relative_to(self.prefix)

    def get(self, name: str) -> InstalledDistribution | None:
        return self.distributions.get(name)

    def reinstall_command(self, dist: InstalledDistribution) -> str:
        """The command that puts the release's bytes back, for this environment's installer."""
        import shlex

        spec = f"{dist.name}=={dist.raw_version}"
        if dist.installer == "uv":
            return shlex.join(["uv", "pip", "install", "--python", str(self.executable), "--reinstall", "--no-deps", spec])
        target = ["--target", str(dist.site_dir)] if not _on_sys_path_of(self, dist) else []
        return shlex.join([str(self.executable), "-m", "pip", "install", "--force-reinstall", "--no-deps", *target, spec])


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
    shown = text if len(text) <= 200 else text[:100] + "..." + text[-40:]
    try:
        return _resolve(text)
    except OSError as exc:  # a name too long, a loop of links: not a path to an interpreter
        raise TargetError(f"--python {shown}: {exc.strerror or exc}") from None
    except TargetError as exc:
        if shown != text:
            exc.message = exc.message.replace(text, shown)
        raise


def _resolve(text: str) -> str:
    if os.sep not in text and not Path(text).expanduser().is_dir():  # `--python envA` names the venv here
        import shutil  # here, not at the top: its import (the archive modules) is 3 ms of `status`

        found = shutil.which(text)
        if found is None:
            raise TargetError(f"--python {text}: not found on PATH")
        return os.path.abspath(found)
    candidate = Path(text).expanduser()
    if not candidate.exists():
        raise TargetError(f"--python {text}: no such file")
    if candidate.is_dir():
        inside = _interpreter_in(candidate)
        if inside is not None and inside.parent.parent == candidate:  # the environment's own directory, as --help says
            return os.path.abspath(inside)
        if inside is None:
            raise TargetError(f"--python {text}: is a directory, not a Python interpreter",
                              hint="pass the interpreter itself, e.g. --python /srv/venv/bin/python3")
        raise TargetError(f"--python {text}: is a directory, not a Python interpreter",
                          fix=[("--python", str(inside))], hint="runs the environment's own interpreter")
    if not os.access(candidate, os.X_OK):
        raise TargetError(f"--python {text}: not an executable file")
    return os.path.abspath(candidate)


def _interpreter_in(directory: Path) -> Path | None:
    """The interpreter of the environment ``directory`` belongs to (its root, its bin/, its
    lib/pythonX.Y/site-packages): the first executable python3 (or python) in a bin/ at or above it
    (a Windows environment: Scripts/python.exe)."""
    parts = directory.parts
    if directory.name == "bin":
        place = directory
    elif "lib" in parts or "lib64" in parts:  # .../lib/python3.12/site-packages: the prefix holds it
        index = max(i for i, part in enumerate(parts) if part in ("lib", "lib64"))
        place = Path(*parts[:index]) / "bin"
    else:
        place = directory / "bin"
    for found in (place / "python3", place / "python", place.with_name("Scripts") / "python.exe"):
        if found.is_file() and os.access(found, os.X_OK):
            return found
    return None


def _probe_source() -> str:
    return Path(__file__).with_name("_probe.py").read_text(encoding="utf-8")


class Probe(NamedTuple):
    """The probe running in the target interpreter; :meth:`result` waits for it. It needs only
    distribution names: started before the patch data is read and the rest of sm120patch is
    imported, it runs while they are (``status`` stays fast)."""

    executable: str
    process: subprocess.Popen | None = None
    error: TargetError | None = None
    chosen_by: str = ""  # no --python: why this interpreter is the target (default_target)

    def stop(self) -> None:
        """Kill the probe and whatever it started (a wrapper script's children): its own session."""
        import signal

        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except OSError:
            pass
        self.process.wait()

    def result(self, wanted: Callable[[str, str], Mapping] | None = None) -> Environment:
        """Wait for the probe. ``wanted(name, version)`` says which rows of an installed
        distribution's RECORD to read ({"files": [...], "suffixes": [...]}); a companion's rows
        are always read."""
        if self.error is not None:
            raise self.error
        try:
            stdout, stderr = self.process.communicate(timeout=PROBE_TIMEOUT_S)
        except BaseException as exc:  # no answer in time, or a signal: nothing it started may outlive it
            self.stop()
            if isinstance(exc, subprocess.TimeoutExpired):
                raise TargetError(f"--python {self.executable}: no answer within {PROBE_TIMEOUT_S} s") from None
            raise
        try:
            data = ast.literal_eval(stdout)  # the probe answers with a Python literal (no json there)
            data["distributions"].items()
            version = tuple(int(part) for part in data["python_version"].split("."))
        except (ValueError, TypeError, KeyError, SyntaxError, MemoryError, RecursionError, AttributeError):
            # Not a Python, or one too old to run the probe: say so without echoing what it
            # printed (a program that is not Python prints anything at all).
            raise TargetError(f"--python {self.executable}: not a usable Python interpreter (3.8 or newer)") from None
        if version < MINIMUM_PYTHON:  # no FlashInfer, SGLang or vLLM release sm120patch knows runs there
            raise TargetError(f"--python {self.executable} is Python {data['python_version']}: the servers sm120patch "
                              f"patches run on Python {'.'.join(map(str, MINIMUM_PYTHON))} or newer")

        def rows(name: str, raw: Mapping) -> Mapping:
            if name in COMPANIONS:
                return COMPANIONS[name]
            return wanted(name, raw["version"] or "") if wanted else {}

        return Environment(
            executable=Path(data["executable"] or self.executable),
            python_version=data["python_version"],
            prefix=Path(data["prefix"]),
            base_prefix=Path(data.get("base_prefix") or data["prefix"]),
            user_base=Path(data["user_base"]) if data["user_base"] else None,
            distributions={name: _from_probe(name, raw, rows(name, raw)) if raw else None
                           for name, raw in data["distributions"].items()},
            search_path=tuple(dict.fromkeys(Path(entry) for entry in data.get("path", ()))),
            chosen_by=self.chosen_by,
        )


def default_target(names) -> tuple[str, str]:
    """The interpreter a command without --python means, and why, in words for the report's
    first line. With pipx or ``uv tool`` sm120patch's own interpreter is never the server's, so
    it is the target only when it has one of ``names`` installed (sm120patch installed into the
    server's environment) or nothing else is there: the activated environment comes first, then
    ``python3`` on PATH (the system interpreter that container images install into)."""
    own = Path(sys.prefix)
    for variable in ("VIRTUAL_ENV", "CONDA_PREFIX"):
        root = os.environ.get(variable)
        if root and Path(root).is_dir():
            found = _interpreter_in(Path(root))
            if found is not None:
                why = "the activated environment" if variable == "VIRTUAL_ENV" else "the activated conda environment"
                return os.path.abspath(found), f"${variable}: {why}"
    from importlib import metadata

    for name in names:
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        return sys.executable, f"sm120patch's own interpreter, which has {name} installed"
    import shutil  # here, not at the top: see _resolve

    found = shutil.which("python3")
    # Not resolved: a venv's python3 is a link to the base interpreter, and the venv is the point.
    if found is not None and Path(os.path.abspath(found)).parent.parent != own:
        return os.path.abspath(found), "python3 on PATH (no environment is activated)"
    return sys.executable, "sm120patch's own interpreter (no environment is activated)"


def start_probe(python: str | os.PathLike | None, names) -> Probe:
    """Start asking ``python`` (default: :func:`default_target`) where the distributions
    ``names`` are installed; companions are always asked about."""
    chosen_by = ""
    try:
        if python is None:
            executable, chosen_by = default_target(names)
        else:
            executable = resolve_python(python)
    except TargetError as exc:
        return Probe(os.fspath(python), error=exc)
    # Normalized: the probe's answer is keyed by the names asked, and sm120patch looks them up so.
    request = list(dict.fromkeys(normalize_name(name) for name in [*COMPANIONS, *names]))
    try:
        process = subprocess.Popen(
            [executable, "-c", _probe_source(), *request],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True,
            cwd="/",  # keep the caller's working directory off the target's sys.path
            start_new_session=True,  # a process group of its own, killed whole if it does not answer
        )
    except OSError as exc:
        return Probe(executable, error=TargetError(f"--python {executable}: could not run it ({exc.strerror or exc})"))
    return Probe(executable, process, chosen_by=chosen_by)


def _json_or_none(text: str | None) -> Mapping | None:
    """direct_url.json's document; None when there is none or it is not JSON (then the install
    is not known to be editable)."""
    try:
        value = json.loads(text) if text else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _ledger_files(site_dir: Path, dist_info: Path) -> tuple[str, ...]:
    """The files sm120patch's ledger of this install lists: their RECORD rows are read too, so
    that a file another sm120patch patched (one whose data has a patch this one's lacks) is
    checked against the RECORD and reverted like the others. A ledger that cannot be read adds
    nothing here; reading it for the run says why."""
    try:
        ledger = InstallState.for_install(site_dir, dist_info).read_ledger()
    except (Sm120PatchError, OSError):
        return ()
    return tuple(ledger.files) if ledger is not None else ()


def _from_probe(name: str, raw: Mapping, wanted: Mapping) -> InstalledDistribution:
    record_error = None
    if wanted.get("record") is False:  # only its release is wanted
        data = None
    elif "record_text" in raw:  # found by importlib.metadata in the target (a zip, an egg)
        data = raw["record_text"].encode("utf-8", "surrogateescape") if raw["record_text"] is not None else None
    else:
        try:
            data = read_regular(Path(raw["dist_info"], "RECORD"))
        except FileNotFoundError:  # no RECORD: nothing is known of its files
            data = None
        except OSError as exc:  # there, but unreadable: every file check needs it
            data, record_error = None, exc.strerror or str(exc)
        except NotRegularFile as exc:
            data, record_error = None, exc.message
    files = (*wanted.get("files", ()), *_ledger_files(Path(raw["site_dir"]), Path(raw["dist_info"])))
    record = record_rows(data, files, wanted.get("suffixes", ())) if data is not None else {}
    return InstalledDistribution(
        name=name,  # the normalized name asked for, not the metadata's spelling
        raw_version=raw["version"],
        site_dir=Path(raw["site_dir"]),
        dist_info=Path(raw["dist_info"]),
        record=record,
        has_record=data is not None,
        direct_url=_json_or_none(raw["direct_url"]),
        requires=tuple(raw["requires"]),
        installer=raw.get("installer"),
        record_error=record_error,
    )
