"""The tuned-limits profile `bench --tune` writes: one JSON file per box, one entry per TP size.

The format, the box's fingerprint and the checks are ``_tuned_runtime.py``'s (the code the
servers run): a profile is written only when that code accepts it for this box, so what the
tuner says is in force is what the server will take. Where it lives: ``$SM120PATCH_TUNED_LIMITS``,
else /etc/sm120patch/tuned-limits.json, else the path ``--profile`` names (docs/tuning.md).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Mapping, Sequence

from sm120patch import __version__
from sm120patch import _tuned_runtime as runtime
from sm120patch.bench.limits import Limits
from sm120patch.errors import CheckFailedError, RefusedError, Sm120PatchError, UsageError
from sm120patch.fileio import NotRegularFile, read_regular
from sm120patch.fileops import atomic_write

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


def write(path: Path, *, box: dict, tp: int, new_entry: dict) -> Written:
    """Merge ``new_entry`` into the profile at ``path`` (this TP's entry replaced, the others kept
    when the file was made on this box; a profile from another box is replaced whole) and write
    it atomically (a temporary file beside it, renamed over it). A file there that is not a
    profile this sm120patch can read is refused, never overwritten."""
    document, other_box = {"kind": KIND, "format": runtime._SM120PATCH_PROFILE_FORMAT, "box": box, "entries": {}}, False
    like = None
    try:
        old = json.loads(read_regular(path))
        like = path.stat()
    except (FileNotFoundError, NotADirectoryError):  # nothing there yet (a parent that is a file: the write says)
        old = None
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
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, data, like=like)
        if like is None:  # a new file: readable by the server's user (atomic_write makes 0600)
            path.chmod(0o644)
    except OSError as exc:
        raise _cannot_write(path, exc) from None
    kept = tuple(k for k in document["entries"] if k != str(tp))
    return Written(path, replaced, other_box, kept, path.absolute() == default_path().absolute())


def _cannot_write(path: Path, exc: OSError) -> Sm120PatchError:
    return Sm120PatchError(
        f"cannot write the profile at {path} ({exc.strerror or exc.__class__.__name__}); nothing was written",
        fix=[("--profile", str(Path.home() / ".config" / "sm120patch" / "tuned-limits.json"))],
        hint="writes it there; then set SM120PATCH_TUNED_LIMITS to that path in the server's environment "
             "(or run the tuner as root to write the default path)")
