"""Tuned limits, as sm120patch sees them: where the profile `bench --tune` writes is, what it holds,
and whether it holds for this box and the installed releases. `status` says which limits are in
force through the fusion chain's ``tp`` step (chain.py).

The checks are the server's own: ``_tuned_runtime`` is the code the opt-in patch ``tuned-limits``
inserts into the servers, and this module calls the same functions, so that `status`, the tuner
and the server cannot disagree. What `status` cannot know it says: the server reads
``SM120PATCH_TUNED_LIMITS`` and the NCCL settings from its own environment, and checks the torch
release the profile names, which `status` does not read.
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


def read(versions: Mapping[str, str], environ: Mapping[str, str] | None = None) -> Profile:
    """The profile at its location, judged for this box and ``versions`` (each installed
    distribution's release, as status read them); names the profile lists that are not in
    ``versions`` (torch) are not checked, and each entry says so."""
    path, from_env = location(environ)
    document, why = runtime._sm120patch_load(path)
    if document is None:
        return Profile(path, from_env, why, (), ())
    problem = runtime._sm120patch_check_document(document)
    if problem:
        return Profile(path, from_env, f"malformed profile: {problem}", (), ())
    box = runtime._sm120patch_box()
    if document["box"] != box:
        return Profile(path, from_env, "made on another box (its GPUs, their PCIe paths or the driver differ)", (), ())
    entries, others = [], []
    for tp in sorted(document["entries"], key=int):
        raw = document["entries"][tp]
        names = raw["software"]
        seen = {n: versions.get(n, names[n]) for n in names}
        unchecked = tuple(sorted(n for n in names if n not in versions))
        # The NCCL settings are the server's (its environment, not this shell's): as tuned.
        entry, why = runtime._sm120patch_judge(document, int(tp), box, raw.get("nccl_env", {}), seen)
        if entry is None:
            others.append(f"TP{tp}: {why}")
            continue
        entries.append(Entry(int(tp), entry["oneshot_max_bytes"], entry["fused_max_bytes"], entry["hidden"],
                             entry["dtype"], entry.get("created", "?"), entry.get("verdict", ""), unchecked,
                             dict(entry.get("nccl_env", {}))))
    return Profile(path, from_env, "", tuple(entries), tuple(others))
