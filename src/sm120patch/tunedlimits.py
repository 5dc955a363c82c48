"""Tuned limits, as sm120patch sees them: where the profile `bench --tune` writes is, what it holds,
and whether it holds for this box and the installed releases. `status` says which limits are in
force through the fusion chain's ``tp`` step (chain.py).

The checks are the server's own: ``_tuned_runtime`` is the code the opt-in patch ``tuned-limits``
inserts into the servers, and this module calls the same functions, so that `status`, the tuner
and the server cannot disagree. The releases are the target interpreter's, torch's included (the
probe reads each one's metadata, as the server's importlib.metadata does). What `status` cannot
know it says: the server reads ``SM120PATCH_TUNED_LIMITS`` and the NCCL settings from its own
environment.

A profile is a file anyone with write access to its path can fill: whatever it holds, reading it
here is one reason (``load``, ``problem``), never a traceback, and the same reasons refuse it to
the tuner before it measures (bench/__init__.py).
"""

from __future__ import annotations

import os
from typing import Mapping, NamedTuple

from sm120patch import _tuned_runtime as runtime
from sm120patch.invocation import Invocation

PATCH_ID = "tuned-limits"  # the opt-in patch of each server that reads the profile
ENV = "SM120PATCH_TUNED_LIMITS"
DEFAULT = runtime._SM120PATCH_PROFILE_DEFAULT
ITEMSIZE = runtime._SM120PATCH_ITEMSIZE
ONESHOT_RULE_MIB = runtime._SM120PATCH_ONESHOT_RULE_MIB  # FlashInfer's one-shot rule, MiB per TP size


class Entry(NamedTuple):
    """One TP size's limits, as the profile has them."""

    tp: int
    oneshot_max_bytes: int
    fused_max_bytes: int
    hidden: int
    dtype: str
    created: str
    verdict: str
    unchecked: tuple[str, ...]  # releases the profile names that status cannot read (torch)
    nccl_env: dict

    @property
    def fused_tokens(self) -> int:
        return self.fused_max_bytes // (self.hidden * ITEMSIZE[self.dtype])

    def words(self) -> str:
        if self.fused_max_bytes == 0:
            return f"TP{self.tp}: never fused (unfused wins at every size measured)"
        return (f"TP{self.tp}: fused up to {size(self.fused_max_bytes)} per rank ({self.fused_tokens} tokens at hidden "
                f"{self.hidden}, {self.dtype}), one-shot up to {size(self.oneshot_max_bytes)}")


class Profile(NamedTuple):
    path: str
    from_env: bool  # named by SM120PATCH_TUNED_LIMITS in sm120patch's own environment
    problem: str  # why it cannot be used at all ("" when it can): absent, unreadable, malformed, another box
    entries: tuple[Entry, ...]  # the TP sizes it holds for here
    others: tuple[str, ...]  # why each other TP size's entry does not

    @property
    def usable(self) -> bool:
        return not self.problem and bool(self.entries)


def size(n: int) -> str:
    """Bytes for a person: 131072 -> '128 KiB'."""
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            value = n / scale
            return f"{value:.4g} {unit}"
    return f"{n} B"


def location(environ: Mapping[str, str] | None = None) -> tuple[str, bool]:
    environ = os.environ if environ is None else environ
    return (environ[ENV], True) if environ.get(ENV) else (DEFAULT, False)


# What `bench --tune` is printed with where sm120patch cannot know the model the server runs (a
# guessed hidden size would write limits the server then trusts, for the wrong shapes): the one
# word the user replaces, with the directory the server's --model-path / --model names.
MODEL_PLACEHOLDER = "YOUR_MODEL_DIR"
# sudo's PATH has no pipx or venv install in it: the user's shell finds sm120patch before sudo runs.
AS_ROOT = 'sudo "$(command -v sm120patch)"'


def needs_root(path: str) -> bool:
    """Whether writing the profile at ``path`` takes root here: this process is not root and
    cannot replace the file (a new one goes in beside it, then over it) or make its directory."""
    if os.geteuid() == 0:
        return False
    directory = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(directory) and os.path.dirname(directory) != directory:
        directory = os.path.dirname(directory)  # the tuner makes the directories that are missing
    return not os.access(directory, os.W_OK | os.X_OK)


def tune_command(options: tuple[tuple[str, str | None], ...], profile: Profile | None,
                 environ: Mapping[str, str] | None = None, *, hidden: int | None = None) -> str:
    """`bench --tune` for this target, as it runs when pasted: ``hidden`` where the caller knows
    it, the model's hidden size where a profile for this box already has one (measured again, for
    the same model), else :data:`MODEL_PLACEHOLDER`; through sudo where this user cannot write
    the profile (with --profile when SM120PATCH_TUNED_LIMITS names it, which sudo does not pass on)."""
    path, from_env = location(environ)
    if hidden is None and profile is not None and profile.usable:
        hidden = profile.entries[0].hidden
    model = (("--hidden", str(hidden)),) if hidden is not None else (("--model", MODEL_PLACEHOLDER),)
    root = needs_root(path)
    where = (("--profile", path),) if root and from_env else ()
    line = str(Invocation("bench --tune", (*model, *options, *where)))
    return f"{AS_ROOT} {line.partition(' ')[2]}" if root else line


def load(path: str) -> tuple[dict | None, str]:
    """The server's reader (``_sm120patch_load``: (document, '') or (None, why)): it says in words
    what it cannot read or trust (a FIFO, a file others may write, JSON nested past the parser's
    depth) and never raises, so status reads the profile exactly as the server does."""
    return runtime._sm120patch_load(path)


def parse(data: bytes) -> tuple[object, str]:
    """(document, '') from a profile's bytes, or (None, why not): the JSON error's name, or that it
    is nested too deeply for json to read (a RecursionError)."""
    import json

    try:
        return json.loads(data), ""
    except RecursionError:
        return None, "nested too deeply"
    except ValueError as exc:
        return None, exc.__class__.__name__


def problem(document) -> str:
    """'' when sm120patch can read and merge every part of ``document``, else what is wrong: the
    servers' own check (``_sm120patch_check_document``), which raises on a part of the wrong type
    (a dtype that is a list) and lets through what sm120patch's readers then stumble on: a TP key
    of digits that int() refuses ("²" is a digit to str.isdigit), NCCL settings or releases that
    are not names and strings."""
    try:
        found = runtime._sm120patch_check_document(document)
    except Exception as exc:  # noqa: BLE001 - a part of the wrong type: the server cannot judge it either
        return f"a part of it is not of the type a profile holds ({exc.__class__.__name__})"
    if found:
        return found
    for tp, entry in document["entries"].items():
        wrong = _entry_problem(tp, entry)
        if wrong:
            return wrong
    return ""


def _entry_problem(tp: str, entry: dict) -> str:
    if not (tp.isascii() and tp.isdigit()):
        return f"entry {tp!r} is not a TP size"
    if str(int(tp)) != tp:  # the server looks up str(its TP size): "04" is never found
        return f"entry {tp!r} is not a TP size as the server looks it up ({int(tp)})"
    if not _names_and_strings(entry.get("nccl_env", {})):
        return f"TP{tp}: its NCCL settings are not names and values"
    if not _names_and_strings(entry["software"]):
        return f"TP{tp}: its releases are not names and versions"
    return ""


def _names_and_strings(value) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def _text(value, default: str) -> str:
    """A free-text field of the profile (when it was made, its verdict), as text or not at all."""
    return value if isinstance(value, str) else default


def _tp_order(tp: str) -> tuple:
    return (0, int(tp), "") if tp.isascii() and tp.isdigit() else (1, 0, tp)


def read(versions: Mapping[str, str | None], environ: Mapping[str, str] | None = None) -> Profile:
    """The profile at its location, judged for this box and ``versions`` (each installed
    distribution's release, as status read them; torch's too where the probe found it, None
    where it is not installed); names the profile lists that are not in ``versions`` are not
    checked, and each entry says so. Whatever the file holds, the answer is a Profile: what the
    server would make of it, in words."""
    path, from_env = location(environ)
    document, why = load(path)
    if document is None:
        return Profile(path, from_env, why, (), ())
    try:
        wrong = runtime._sm120patch_check_document(document)
    except Exception as exc:  # noqa: BLE001 - the server's own check raises here: it never takes the profile
        wrong = f"a part of it is not of the type a profile holds ({exc.__class__.__name__})"
    if wrong:
        return Profile(path, from_env, f"malformed profile: {wrong}", (), ())
    box = runtime._sm120patch_box()
    if document["box"] != box:
        return Profile(path, from_env, "made on another box (its GPUs, their PCIe paths or the driver differ)", (), ())
    entries, others = [], []
    for tp in sorted(document["entries"], key=_tp_order):
        raw = document["entries"][tp]
        wrong = _entry_problem(tp, raw)
        if wrong:  # the server never matches such an entry: its TP size or NCCL settings cannot equal its own
            others.append(wrong + " (the server never takes it)" if wrong.startswith("TP") else wrong + " (ignored)")
            continue
        names = raw["software"]
        seen = {n: versions.get(n) if n in versions else names[n] for n in names}
        unchecked = tuple(sorted(n for n in names if n not in versions))
        # The NCCL settings are the server's (its environment, not this shell's): as tuned.
        try:
            entry, why = runtime._sm120patch_judge(document, int(tp), box, raw.get("nccl_env", {}), seen)
        except Exception as exc:  # noqa: BLE001 - the server's judge raises: it keeps the release's limits
            entry, why = None, f"the server cannot judge it ({exc.__class__.__name__})"
        if entry is None:
            others.append(f"TP{tp}: {why}")
            continue
        entries.append(Entry(int(tp), entry["oneshot_max_bytes"], entry["fused_max_bytes"], entry["hidden"],
                             entry["dtype"], _text(entry.get("created"), "?"), _text(entry.get("verdict"), ""),
                             unchecked, dict(entry.get("nccl_env", {}))))
    return Profile(path, from_env, "", tuple(entries), tuple(others))
