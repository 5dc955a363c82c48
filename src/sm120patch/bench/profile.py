"""The tuned-limits profile `bench --tune` writes: one JSON file per box, one entry per TP size.

The format, the box's fingerprint and the checks are ``_tuned_runtime.py``'s (the code the
servers run): a profile is written only when that code accepts it for this box, so what the
tuner says is in force is what the server will take. Where it lives: ``$SM120PATCH_TUNED_LIMITS``,
else /etc/sm120patch/tuned-limits.json, else the path ``--profile`` names (docs/tuning.md).
"""

from __future__ import annotations

import json
import os
import stat
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, Mapping, Sequence

from sm120patch import __version__, dirfd, signals, tunedlimits
from sm120patch import _tuned_runtime as runtime
from sm120patch.bench.limits import Limits
from sm120patch.errors import CheckFailedError, RefusedError, Sm120PatchError, UsageError
from sm120patch.fileio import NotRegularFile, read_regular
from sm120patch.locks import flock
from sm120patch.state import TEMPORARY

KIND = "sm120patch tuned limits"
# For tests only: write a profile even from ranks that share a GPU (their figures measure one GPU
# taking turns, not the link between GPUs).
ALLOW_SHARED = "SM120PATCH_TUNE_ALLOW_SHARED_GPU"
DTYPES = {"bfloat16": "bf16", "float16": "fp16"}


def default_path() -> Path:
    """Where the servers look: $SM120PATCH_TUNED_LIMITS, else /etc/sm120patch/tuned-limits.json."""
    return Path(runtime._sm120patch_profile_path())


def read_model(path: Path) -> tuple[int, str | None]:
    """(hidden size, dtype or None) from a Hugging Face config.json (a directory holding one too):
    hidden_size, or text_config.hidden_size for the multimodal ones; torch_dtype (or dtype)."""
    if str(path) == tunedlimits.MODEL_PLACEHOLDER and not path.exists():  # status's line, pasted unfilled
        raise UsageError(f"--model {path} is the one word of the printed line to fill in: the directory of the model "
                         "your server serves (or its config.json)",
                         hint="--model ~/models/NAME (the model's directory), or --hidden N (its hidden size)")
    path = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(read_regular(path))
    except (OSError, ValueError) as exc:
        raise UsageError(f"--model {path}: cannot read it as a model's config.json ({exc.__class__.__name__})",
                         hint="give the path of the model's config.json, or --hidden N") from None
    config = config if isinstance(config, dict) else {}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    hidden = config.get("hidden_size", text.get("hidden_size"))
    if not isinstance(hidden, int) or isinstance(hidden, bool) or hidden <= 0:
        raise UsageError(f"--model {path}: no hidden_size (nor text_config.hidden_size) in it", hint="pass --hidden N")
    dtype = config.get("torch_dtype", config.get("dtype", text.get("torch_dtype")))
    return hidden, DTYPES.get(dtype) if isinstance(dtype, str) else None


def refuse_shared_gpus(gpus: Sequence[Mapping]) -> None:
    """Ranks on one physical GPU (the same PCI bus id: time-sliced, or MIG slices of one GPU) time
    that GPU taking turns, not the link a server's ranks talk over: no profile from them."""
    seen: dict[str, int] = {}
    for rank, gpu in enumerate(gpus):
        bus = gpu.get("bus_id") or gpu.get("uuid")  # a torch without the bus id: the UUID still tells
        if bus is None:
            continue
        if bus in seen and os.environ.get(ALLOW_SHARED) != "1":
            raise RefusedError(
                f"ranks {seen[bus]} and {rank} ran on one GPU ({bus}): their timings measure one GPU taking turns, "
                "not the PCIe link between the server's GPUs; no profile was written",
                hint="run the tuner with one GPU per rank, as the server runs (check CUDA_VISIBLE_DEVICES)")
        seen.setdefault(bus, rank)


def entry(limits: Limits, *, rows: Sequence[Mapping], software: Mapping[str, str], nccl_env: Mapping[str, str],
          dtype: str, hidden: int, model: Path | None, gpus: Sequence[Mapping], now: datetime | None = None) -> dict:
    """One TP size's entry of the profile (the contract in _tuned_runtime.py)."""
    now = now or datetime.now(timezone.utc)
    return {
        "created": now.strftime("%Y-%m-%dT%H:%M:%SZ"), "written_by": f"sm120patch {__version__}",
        "software": dict(software), "nccl_env": dict(nccl_env), "dtype": dtype, "hidden": hidden,
        "model": str(model) if model is not None else None, "gpus_used": [g.get("bus_id") for g in gpus],
        "oneshot_max_bytes": limits.oneshot_max_bytes, "fused_max_bytes": limits.fused_max_bytes,
        "unfused": limits.unfused, "table": [dict(row) for row in rows], "ties": list(limits.ties),
        "verdict": limits.verdict,
    }


@dataclass(frozen=True)
class Written:
    path: Path
    replaced_tp: bool  # this TP size had an entry, now replaced
    other_box: bool  # the file held a profile made on another box: replaced whole
    kept: tuple[str, ...]  # the other TP sizes' entries kept (same box)
    where_servers_look: bool  # the path the servers read without being told (default_path())
    foreign_owner: str | None = None  # the file there was another user's: replaced whole, nothing of it kept


PROFILE_MODE = 0o644  # the server's user (not the tuner's) reads it
DIRECTORY_MODE = 0o755


def write(path: Path, *, box: dict, tp: int, new_entry: dict) -> Written:
    """Merge ``new_entry`` into the profile at ``path`` (this TP's entry replaced, the others kept
    when the file was made on this box; a profile from another box is replaced whole) and write
    it atomically. A file there that is not a profile this sm120patch can read is refused, never
    overwritten; so is a symbolic link (the link would be replaced, or followed by a server).

    Root writes where servers of other users read it: the new file is created O_EXCL|O_NOFOLLOW
    under a random name, given mode 0644 and the tuner's own owner on its descriptor (before the
    rename: a kill never leaves a profile the server's user cannot read), renamed by directory
    descriptor (sm120patch.dirfd); a file another user put there gives neither its owner, its
    mode nor its entries. Two tuners on one profile take turns (an flock on its directory), so
    the second merges into what the first wrote; the temporary file of a tuner that was killed
    is removed under that lock."""
    path = Path(os.path.abspath(path))
    try:
        made = dirfd.makedirs(path.parent, mode=DIRECTORY_MODE)
    except OSError as exc:
        raise _cannot_write(path, exc) from None
    try:
        with flock(path.parent, what="the profile's directory", timeout=None, on_wait=None,
                   busy=f"another sm120patch is writing a profile in {path.parent}",
                   hint="run again when it has finished"):
            return _write_locked(path, box=box, tp=tp, new_entry=new_entry)
    except BaseException:
        for directory in reversed(made):  # nothing written: no directory of ours left either
            try:
                dirfd.rmdir(directory)
            except OSError:
                break
        raise


def _leftovers(path: Path) -> None:
    """Temporary files of earlier tuners on ``path`` (killed between making one and renaming it):
    under the lock no other tuner has one in flight."""
    prefix = f".{path.name}{dirfd.TEMPORARY_MARK}"
    try:
        names = dirfd.listdir(path.parent)
    except OSError:
        return
    for name in names:
        if name.startswith(prefix) and TEMPORARY.match(name):
            dirfd.unlink(path.parent / name, missing_ok=True)


def _write_locked(path: Path, *, box: dict, tp: int, new_entry: dict) -> Written:
    document, other_box = {"kind": KIND, "format": runtime._SM120PATCH_PROFILE_FORMAT, "box": box, "entries": {}}, False
    _leftovers(path)
    mode, foreign = PROFILE_MODE, None
    try:
        info = dirfd.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        info = None
    except OSError as exc:
        raise _cannot_write(path, exc) from None
    if info is not None and stat.S_ISLNK(info.st_mode):
        raise RefusedError(f"{path} is a symbolic link; nothing was written (sm120patch neither replaces it nor "
                           "writes through it)", hint="remove the link, or pass --profile with the file's own path")
    old = None
    if info is not None and info.st_uid not in (0, os.geteuid()):
        foreign = _user(info.st_uid)  # planted, or left by someone else: nothing of it is trusted
    elif info is not None:
        try:
            fd = dirfd.open_file(path, os.O_RDONLY | os.O_NONBLOCK)
            try:
                if stat.S_ISDIR(os.fstat(fd).st_mode):
                    raise IsADirectoryError(21, "Is a directory", str(path))
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise NotRegularFile(f"{path} is not a regular file")
                data = b"".join(iter(lambda: os.read(fd, 1 << 20), b""))
            finally:
                os.close(fd)
            old = json.loads(data)
            mode = stat.S_IMODE(info.st_mode) | 0o444  # its mode kept, but readable by the server's user
        except (ValueError, IsADirectoryError, NotRegularFile) as exc:
            raise RefusedError(f"{path} holds something that is not a tuned-limits profile ({exc.__class__.__name__}); "
                               "nothing was written", hint="move it away, or pass --profile with another path") from None
        except OSError as exc:
            raise _cannot_write(path, exc) from None
    if old is not None:
        problem = runtime._sm120patch_check_document(old)
        if problem:
            raise RefusedError(f"{path}: {problem}; nothing was written",
                               hint="move it away, or pass --profile with another path")
        if old["box"] == box:
            document["entries"] = dict(old["entries"])
        else:
            other_box = True
    replaced = str(tp) in document["entries"]
    document["entries"][str(tp)] = new_entry
    document["entries"] = {k: document["entries"][k] for k in sorted(document["entries"], key=int)}
    problem = runtime._sm120patch_check_document(document)
    if problem:  # the tuner's own output: a bug, said before anything is written
        raise CheckFailedError(f"the profile the tuner made fails its own check ({problem}); nothing was written")
    data = (json.dumps(document, indent=1) + "\n").encode()
    try:
        # The rename is the profile's commit point: from it on a signal is only noted, and the
        # command reports the profile it wrote (signals.commit_point), never "changes nothing".
        dirfd.write_file(path, data, mode=mode, owner=(os.geteuid(), os.getegid()), committing=_committing)
    except OSError as exc:
        raise _cannot_write(path, exc) from None
    kept = tuple(k for k in document["entries"] if k != str(tp))
    return Written(path, replaced, other_box, kept, path.absolute() == default_path().absolute(), foreign)


@contextmanager
def _committing() -> Iterator[None]:
    """The rename: no signal cuts it, and once it is done the profile stands (a signal that
    comes after it is only noted, and the command reports what it wrote)."""
    with signals.held():
        yield
        signals.commit_point("tuned-limits profile write")
        # One that came during the rename came when nothing could be undone any more: a late
        # one, reported as such (the exit code says the profile stands).
        signals.STATE.late.extend(signals.STATE.noted)
        signals.STATE.noted.clear()


def _user(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _cannot_write(path: Path, exc: OSError) -> Sm120PatchError:
    return Sm120PatchError(
        f"cannot write the profile at {path} ({exc.strerror or exc.__class__.__name__}); nothing was written",
        fix=[("--profile", str(Path.home() / ".config" / "sm120patch" / "tuned-limits.json"))],
        hint="writes it there; then set SM120PATCH_TUNED_LIMITS to that path in the server's environment "
             "(or run the tuner as root to write the default path)")
