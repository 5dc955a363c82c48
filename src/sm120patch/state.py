"""What sm120patch keeps about an install, beside it and outside every RECORD-listed directory.

    <site dir>/.sm120patch/                  the state root of one install location
      journal.json                           only while a run is changing this location
      stash/<run>/...                        that run's before-copies, for rollback
      <name>-<version>.dist-info/            one install (its .dist-info name is its identity)
        ledger.json                          what sm120patch applied: patches and hashes per file
        originals/<relpath>                  the release's bytes of each patched file, for revert

The state of an install sits with the install: two ``--target`` directories, or a venv and a
``--user`` site, never share a ledger, and a reinstall under another version starts clean.
Everything here is owned like the directory it sits in (so a root run on a service user's
environment leaves state that user can read and continue), and is mode 0700: the originals
may be copies of files root owns. ``SM120PATCH_STATE_DIR`` moves every state root under one
directory (one subdirectory per install location).
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from types import MappingProxyType
from typing import Mapping, NamedTuple

from sm120patch import __version__, dirfd, terminal
from sm120patch.errors import TransactionError, newer_format
from sm120patch.fileio import read_regular
from sm120patch.hashing import sha256
from sm120patch.words import counted

STATE_DIR_MODE = 0o700
LEDGER_FORMAT = 2


class Owner(NamedTuple):
    uid: int
    gid: int

    @classmethod
    def of(cls, path: Path) -> "Owner":
        info = path.stat()
        return cls(info.st_uid, info.st_gid)

    def apply(self, path: Path) -> None:
        """Give ``path`` this owner when sm120patch can (as root); otherwise it is ours already.
        Only for a path no other user can change (a temporary directory sm120patch made): in an
        environment, :mod:`sm120patch.dirfd` owns each new entry on its descriptor."""
        if os.geteuid() == 0 and (self.uid, self.gid) != (0, 0):
            os.chown(path, self.uid, self.gid, follow_symlinks=False)

    @property
    def user(self) -> str:
        import pwd

        try:
            return pwd.getpwuid(self.uid).pw_name
        except KeyError:
            return f"uid {self.uid}"


def permission_hint(path: Path, owner: Owner | None = None) -> str:
    """What to do about "permission denied" on ``path`` (``owner``: who owns what it is part of,
    when ``path`` does not exist yet). To a process that already runs as the owner, "run as the
    owner" is no way out: the cause is the mode, and the hint says how to change it."""
    try:
        info = path.stat()
        owner, mode = Owner(info.st_uid, info.st_gid), stat.S_IMODE(info.st_mode)
    except OSError:
        mode = None
    if owner is None:
        return "run sm120patch as the user who owns it"
    if owner.uid != os.geteuid():
        return f"run sm120patch as {owner.user}, who owns it"
    # What the owner lacks of what sm120patch needs: a file is read and replaced, a directory
    # written in (its search bit is what lets anything in it be reached).
    needed = (("r", stat.S_IRUSR, "read"), ("w", stat.S_IWUSR, "write"))
    if mode is not None and stat.S_ISDIR(info.st_mode):
        needed = (("w", stat.S_IWUSR, "write to"), ("x", stat.S_IXUSR, "enter"))
    missing = [(bit, verb) for bit, flag, verb in needed if mode is not None and not mode & flag] or [("w", "write to")]
    shown = f" is mode {mode:04o}:" if mode is not None else ":"
    return (f"{path}{shown} its owner ({owner.user}, who runs sm120patch) may not {' or '.join(v for _, v in missing)} "
            f"it; `chmod u+{''.join(b for b, _ in missing)} {terminal.quote(str(path))}`")


def state_root(site_dir: Path) -> Path:
    override = os.environ.get("SM120PATCH_STATE_DIR")
    if override:
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", str(site_dir)).strip("-")[-80:]
        return Path(override) / f"{slug}-{sha256(str(site_dir).encode())[:8]}"
    return site_dir / ".sm120patch"


def missing_parents(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist, outermost first (what a mkdir -p
    would create)."""
    missing = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    return missing[::-1]


def ensure_dir(path: Path, owner: Owner) -> None:
    """Create ``path`` and its missing parents (mode 0700, owned by ``owner``, both set on the
    new directory's descriptor: dirfd.mkdir); refuse a state directory that other users can
    write to."""
    for directory in missing_parents(path):
        try:
            dirfd.mkdir(directory, mode=STATE_DIR_MODE, owner=tuple(owner))
        except FileExistsError:
            continue
        except PermissionError:
            raise TransactionError(
                f"cannot create sm120patch's state directory {directory}: permission denied; nothing was changed",
                hint=f"{permission_hint(directory.parent, owner)}, or set SM120PATCH_STATE_DIR",
            ) from None
        except OSError as exc:
            raise TransactionError(f"cannot create sm120patch's state directory {directory}: {exc.strerror}; "
                                   "nothing was changed") from None
    mode = path.stat().st_mode
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise TransactionError(f"state directory {path} is writable by other users", hint=f"chmod go-w {terminal.quote(str(path))}")


class LedgerFile(NamedTuple):
    """One file sm120patch changed: which patches, and the release's and the patched hashes."""

    patches: tuple[str, ...]
    pristine: str
    patched: str
    origin: str = "sm120patch"  # sm120patch / adopted (a hand edit equal to the patch) / forced
    link: str | None = None  # the file was a symlink to this path before sm120patch replaced it


class Ledger(NamedTuple):
    """What is applied to one install (``ledger.json``)."""

    distribution: str
    version: str
    dist_info: str
    files: Mapping[str, LedgerFile] = MappingProxyType({})
    unpinned: bool = False  # applied by meaning to a release no patch set pins (--force)
    patch_set: str | None = None

    def to_bytes(self) -> bytes:
        document = {
            "format": LEDGER_FORMAT,
            # Who wrote it: an older sm120patch that cannot read a newer format names this one.
            "written_by": f"sm120patch {__version__}",
            "distribution": self.distribution,
            "version": self.version,
            "dist_info": self.dist_info,
            "unpinned": self.unpinned,
            "patch_set": self.patch_set,
            "files": {
                rel: {"patches": list(f.patches), "pristine": f.pristine, "patched": f.patched,
                      "origin": f.origin, "link": f.link}
                for rel, f in sorted(self.files.items())
            },
        }
        return (json.dumps(document, indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: Path) -> "Ledger":
        try:
            doc = json.loads(data)
            found = doc.get("format")
            if isinstance(found, int) and not isinstance(found, bool) and found > LEDGER_FORMAT:
                written_by = doc.get("written_by")
                raise newer_format("ledger", where, found, LEDGER_FORMAT,
                                   written_by if isinstance(written_by, str) else None)
            if doc.get("format") != LEDGER_FORMAT:
                raise ValueError(f"format {doc.get('format')!r}, this sm120patch reads {LEDGER_FORMAT}")
            return cls(
                distribution=doc["distribution"], version=doc["version"], dist_info=doc["dist_info"],
                unpinned=bool(doc.get("unpinned", False)), patch_set=doc.get("patch_set"),
                files={rel: LedgerFile(tuple(f["patches"]), f["pristine"], f["patched"], f.get("origin", "sm120patch"),
                                       f.get("link")) for rel, f in doc["files"].items()},
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise TransactionError(
                f"{where} is unreadable ({exc})",
                hint=f"move it aside (`mv {terminal.quote(str(where))} {terminal.quote(str(where) + '.bad')}`); sm120patch then judges files by their hashes alone",
            ) from None


class InstallState(NamedTuple):
    """sm120patch's state for one install (one ``.dist-info``)."""

    root: Path  # <state root>/<dist-info name>

    @classmethod
    def for_install(cls, site_dir: Path, dist_info: Path) -> "InstallState":
        return cls(state_root(site_dir) / dist_info.name)

    @property
    def ledger_path(self) -> Path:
        return self.root / "ledger.json"

    def original(self, relpath: str) -> Path:
        return self.root / "originals" / relpath

    def read_ledger(self) -> Ledger | None:
        try:
            data = read_regular(self.ledger_path)
        except FileNotFoundError:
            return None
        except PermissionError:
            raise TransactionError(f"{self.ledger_path} is not readable by this user (uid {os.geteuid()})",
                                   hint=f"run sm120patch as the owner of {self.root}") from None
        return Ledger.from_bytes(data, self.ledger_path)

    def saved_original(self, relpath: str, expected: str) -> bytes | None:
        """The saved release bytes of ``relpath`` when they hash to ``expected``."""
        try:
            data = read_regular(self.original(relpath))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        return data if sha256(data) == expected else None

    def files(self) -> list[Path]:
        """Every file this install's state holds (its ledger, its saved originals)."""
        return sorted(p for p in self.root.rglob("*") if p.is_file() or p.is_symlink()) if self.root.is_dir() else []


class Orphan(NamedTuple):
    """The state of an install that is gone: uninstalled, or upgraded to another version (its
    .dist-info went with it)."""

    state: InstallState
    files: tuple[Path, ...]

    @property
    def name(self) -> str:
        return self.state.root.name  # the .dist-info it belonged to

    def describe(self) -> str:
        originals = sum(1 for f in self.files if "originals" in f.relative_to(self.state.root).parts)
        parts = (["ledger"] if self.state.ledger_path in self.files else []) + (
            [f"{originals} saved original{'s' if originals != 1 else ''}"] if originals else [])
        return ", ".join(parts) or counted(len(self.files), "file")


def orphans(site_dir: Path) -> list[Orphan]:
    """The states in ``site_dir``'s state root whose .dist-info is no longer installed there."""
    root = state_root(site_dir)
    try:
        children = sorted(root.iterdir()) if root.is_dir() else []
    except OSError:
        return []
    found = []
    for child in children:
        if child.name.endswith(".dist-info") and child.is_dir() and not (site_dir / child.name).is_dir():
            state = InstallState(child)
            found.append(Orphan(state, tuple(state.files())))
    return found


TEMPORARY_SUFFIXES = ("tmp", "link")  # a file's new bytes; a symbolic link's new target


def temporary(path: Path, suffix: str = "tmp", pid: int | None = None) -> Path:
    """A name of a temporary file beside ``path`` that a process (default: this one) replaces
    it with: its pid and a random part (dirfd.temporary_name, which makes them). Named here, with
    the pattern that finds them, so the two cannot drift."""
    if suffix not in TEMPORARY_SUFFIXES:  # a name the cleanup would never find
        raise ValueError(f"not a temporary suffix: {suffix!r}")
    return path.with_name(f".{path.name}.sm120patch-{os.getpid() if pid is None else pid}-{dirfd.unique()}.{suffix}")


def temporaries_of(path: Path, pid: int) -> list[Path]:
    """The temporary files process ``pid`` made beside ``path`` (a run killed before it renamed
    them)."""
    try:
        names = os.listdir(path.parent)
    except OSError:
        return []
    prefix = f".{path.name}.sm120patch-{pid}-"
    return [path.with_name(n) for n in names if n.startswith(prefix) and TEMPORARY.match(n)]


# temporary()'s names (and those of sm120patch releases before the random part)
TEMPORARY = re.compile(r"^\..+\.sm120patch-\d+(-[0-9a-f]{8})?\.(%s)$" % "|".join(TEMPORARY_SUFFIXES))


def stash_root(root: Path) -> Path:
    """Where the runs of a state root keep their before-copies (``stash/<run>/``)."""
    return root / "stash"


def temporaries(site_dir: Path) -> list[Path]:
    """Temporary files a killed run left in ``site_dir``'s state root (a run that dies between
    creating one and renaming it has no chance to remove it)."""
    root = state_root(site_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.rglob(".*.sm120patch-*") if TEMPORARY.match(p.name) and not p.is_dir())
