"""From an assessment to the exact edits apply or revert would make, each with its
before/after hashes, or a refusal that says why and what to run. Tree-agnostic: the same plan
is written by a transaction (an environment) or as a commit (a checkout), or only shown (a
dry run)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Sequence

from sm120patch import terminal
from sm120patch.assess import Assessment, FileAssessment, State, Origin
from sm120patch.errors import PatchDataError, RefusedError
from sm120patch.hashing import sha256
from sm120patch.manifests import combination_key
from sm120patch.patchsets import Patch
from sm120patch.edits import apply_edits
from sm120patch.state import Ledger, LedgerFile
from sm120patch.trees import Tree

def text_diff(before: bytes, after: bytes, before_label: str, after_label: str) -> str:
    return "".join(difflib.unified_diff(
        before.decode("utf-8", "replace").splitlines(keepends=True),
        after.decode("utf-8", "replace").splitlines(keepends=True),
        fromfile=before_label, tofile=after_label,
    ))


@dataclass(frozen=True)
class PlannedFile:
    relpath: str
    path: Path
    before: str | None  # sha256 of what is there now (None: missing)
    after: str
    data: bytes  # the new bytes
    current: bytes | None
    patches: tuple[str, ...]  # the patches the new bytes carry (none: the release's bytes)
    original: bytes | None = None  # the release's bytes, to save (the first patch of a file)
    restore_from: str = ""  # revert: where the release's bytes come from (saved original, wheel)
    replaces_link: str | None = None  # the file is a symlink to this target; it becomes a regular file
    relink: str | None = None  # revert: put this symlink back instead of writing data

    def diff(self, label: str) -> str:
        return text_diff(self.current or b"", self.data, f"a/{label}", f"b/{label}")


@dataclass(frozen=True)
class Plan:
    assessment: Assessment
    files: tuple[PlannedFile, ...]  # only what changes; files already as wanted are left out
    ledger: Ledger | None  # what the ledger will say (None: nothing applied, the ledger goes)
    adopted: tuple[str, ...] = ()  # hand edits equal to the patch, recorded without a change

    @property
    def ledger_changes(self) -> bool:
        return self.ledger != self.assessment.ledger

    @property
    def empty(self) -> bool:
        return not self.files and not self.ledger_changes


class Writes:
    """One write step, gathered from every tree: the plans that join the one transaction
    (installs), and how to undo what was committed already (checkouts) when it fails."""

    def __init__(self) -> None:
        self.transaction: list[tuple[Tree, Plan]] = []
        self.undo: list[Callable[[], object]] = []


def _reinstall_hint(assessment: Assessment) -> str:
    return assessment.tree.words.reinstall_hint


def _refuse_drift(assessment: Assessment, fa: FileAssessment, verb: str, release: Callable[[str, str], tuple[bytes, str] | None],
                  *, force_offered: bool) -> RefusedError:
    name, version = assessment.name, assessment.raw_version
    if fa.state is State.MISSING:
        what = "is missing" + (f" ({fa.detail})" if fa.detail else "")
    else:
        what = f"is not the {version} release's bytes ({fa.detail})" if fa.detail else f"is not the {version} release's bytes"
    diff = ""
    expected = assessment.manifest.files[fa.relpath].pristine if assessment.manifest else None
    if fa.read.data is not None and expected:
        found = release(fa.relpath, expected)
        if found is not None:
            diff = text_diff(found[0], fa.read.data, f"release/{fa.relpath}", f"installed/{fa.relpath}")
    return RefusedError(
        f"refusing to {verb} {name}: {fa.path} {what}",
        hint=(diff + "\n" if diff else "") + _reinstall_hint(assessment)
        + (", or pass --force to patch it as it is" if force_offered else ""),
    )


def _refuse_link(assessment: Assessment, fa: FileAssessment) -> RefusedError:
    prefix = assessment.tree.words.copy_reinstall
    uv = terminal.join([*prefix, f"{assessment.name}=={assessment.raw_version}"]) if prefix else ""
    state = {State.PRISTINE: "holds the release's bytes", State.APPLIED: "holds patched bytes"}.get(
        fa.state, "does not hold the release's bytes")
    return RefusedError(
        f"{fa.path} is a symbolic link to {fa.link} (uv --link-mode=symlink?); it {state}, and sm120patch never "
        "writes through a link (that would change the shared cache)",
        hint=(f"reinstall with copies: `{uv}`; or " if uv else "") + "pass --force to replace the link by a patched "
             "regular file (revert puts the link back)",
    )


def plan_apply(assessment: Assessment, selected: Sequence[Patch], *, force: bool = False,
               wheel_dir: Path | None = None, download: bool = False) -> Plan:
    patch_set, manifest = assessment.patch_set, assessment.manifest
    release = partial(assessment.tree.release_bytes, wheel_dir=wheel_dir, download=download)
    assert patch_set is not None and manifest is not None
    ledger_files: dict[str, LedgerFile] = dict(assessment.ledger.files) if assessment.ledger else {}
    planned, adopted = [], []
    unpinned = assessment.unpinned or bool(assessment.ledger and assessment.ledger.unpinned)
    # The files of the selected patches, and every file with a patch in an older form (an
    # earlier sm120patch's): apply brings it to today's form, in the same transaction, even when
    # that patch is opt-in and not named again with --with.
    older = [rel for rel, fa in assessment.files.items() if fa.former and fa.state is State.APPLIED]
    for relpath in dict.fromkeys([*(p.file for p in selected), *older]):
        fa = assessment.files[relpath]
        wanted_ids = {p.id for p in selected if p.file == relpath} | set(fa.applied)
        wanted = [p for p in patch_set.patches_for(relpath) if p.id in wanted_ids]
        expected = manifest.files[relpath]
        if fa.read.problem:
            raise RefusedError(f"refusing to patch {assessment.name}: {fa.path}: {fa.read.problem}",
                               hint=_reinstall_hint(assessment))
        if fa.state is State.MISSING:
            raise _refuse_drift(assessment, fa, "patch", release, force_offered=False)
        if fa.link is not None and not force:
            raise _refuse_link(assessment, fa)
        if fa.state is State.DRIFTED and not force:
            raise _refuse_drift(assessment, fa, "patch", release, force_offered=True)
        if (fa.state is State.APPLIED and set(fa.applied) == wanted_ids and fa.link is None and not fa.former
                and fa.origin is not Origin.OTHER_FORM):  # (another sm120patch's form: today's is written)
            # A hand edit equal to the patch: adopted in the ledger; where there is none (a
            # checkout) it is left as it is, and nothing changes (Ansible reports no change).
            if fa.origin is Origin.BY_HAND and assessment.tree.keeps_ledger:
                ledger_files[relpath] = LedgerFile(tuple(p.id for p in wanted), expected.pristine, fa.sha256,
                                                   origin=Origin.ADOPTED.value)
                adopted.append(relpath)
            continue
        current = fa.read.data
        if fa.state is State.DRIFTED:  # --force: patch whatever is there, by meaning
            data = apply_edits(current, wanted, where=str(fa.path), by_meaning=True)
            if data == current and fa.link is None:
                continue
            planned.append(PlannedFile(relpath, fa.path, fa.sha256, sha256(data), data, current,
                                       tuple(p.id for p in wanted), original=current, replaces_link=fa.link))
            ledger_files[relpath] = LedgerFile(tuple(p.id for p in wanted), fa.sha256, sha256(data),
                                               origin=Origin.FORCED.value, link=fa.link)
            unpinned = True
            continue
        if fa.state is State.PRISTINE:
            pristine, original = current, current
        else:  # applied with fewer patches (or a link to patched bytes): rebuild from the release's bytes
            found = release(relpath, expected.pristine)
            if found is None:
                raise RefusedError(f"cannot add patches to {fa.path}: the release's bytes of it are neither saved by "
                                   "sm120patch nor in a wheel it can read", hint=_reinstall_hint(assessment)
                                   + ", or pass --wheel-dir with the release's wheel")
            pristine, original = found[0], (None if fa.ledger else found[0])
        if assessment.unpinned:  # no manifest: the rewriters' exact site counts are the check
            data = apply_edits(pristine, wanted, where=str(fa.path), by_meaning=True)
        else:
            data = apply_edits(pristine, wanted, where=str(fa.path))
            if sha256(data) != expected.patched.get(combination_key(wanted)):
                raise PatchDataError(f"{fa.path}: the rewriters produced bytes the vendor manifest does not expect "
                                     f"({combination_key(wanted)})")
        planned.append(PlannedFile(relpath, fa.path, fa.sha256, sha256(data), data, current,
                                   tuple(p.id for p in wanted), original=original, replaces_link=fa.link))
        ledger_files[relpath] = LedgerFile(tuple(p.id for p in wanted), expected.pristine, sha256(data),
                                           origin=Origin.SM120PATCH.value if not assessment.unpinned else Origin.FORCED.value,
                                           link=fa.link or (fa.ledger.link if fa.ledger else None))
    dist_info = assessment.tree.dist_info
    ledger = Ledger(assessment.name, assessment.raw_version, str(dist_info) if dist_info is not None else "",
                    ledger_files, unpinned, patch_set.name) if ledger_files else None
    return Plan(assessment, tuple(planned), ledger, tuple(adopted))


def plan_revert(assessment: Assessment, *, force: bool = False, wheel_dir: Path | None = None,
                download: bool = False) -> Plan:
    """The bytes sm120patch replaced back in every file it changed, and (with ``force``, or for
    a file sm120patch has no record of) the release's bytes in every file that is not the
    release's: from the saved original, else from the release wheel (its hash checked against
    the installed RECORD)."""
    ledger = assessment.ledger
    release = partial(assessment.tree.release_bytes, wheel_dir=wheel_dir, download=download)
    planned = []
    # The ledger's files too, not only the patch set's: a file a newer sm120patch patched with a
    # patch this one's data lacks has its original saved all the same, and a revert that left
    # it patched (and then removed that original with the ledger) would lose the release's bytes.
    for relpath, fa in {**assessment.files, **assessment.unknown}.items():
        entry = ledger.files.get(relpath) if ledger else None
        if fa.read.problem:
            raise RefusedError(f"refusing to revert {assessment.name}: {fa.path}: {fa.read.problem}",
                               hint=_reinstall_hint(assessment))
        if fa.state is State.PRISTINE and fa.link is None and not (entry and entry.link):
            continue
        if fa.state is State.PRISTINE and entry and entry.link and fa.link == entry.link:
            continue  # the link is back already
        if fa.state in (State.DRIFTED, State.MISSING) and not force:
            raise _refuse_drift(assessment, fa, "revert", release, force_offered=False)
        expected = _revert_target(assessment, relpath, entry, force=force)
        found = release(relpath, expected) if expected else None
        if found is None:
            raise RefusedError(
                f"cannot revert {fa.path}: the release's bytes of it are neither saved by sm120patch nor in a wheel "
                "sm120patch can read",
                hint=_reinstall_hint(assessment) + ", or pass --wheel-dir with the release's wheel",
            )
        data, where = found
        relink = entry.link if entry and entry.link and _link_holds(fa.path, entry.link, expected) else None
        planned.append(PlannedFile(relpath, fa.path, fa.sha256, expected, data, fa.read.data, (),
                                   restore_from=where, relink=relink))
    return Plan(assessment, tuple(planned), None)


def _revert_target(assessment: Assessment, relpath: str, entry: LedgerFile | None, *, force: bool) -> str | None:
    """What revert restores: exactly what sm120patch replaced (its ledger says), else, and with
    --force always, the release's bytes (the installed RECORD says)."""
    if entry is not None and not force:
        return entry.pristine
    released = assessment.tree.release_sha256(relpath)
    if released:
        return released
    if entry is not None:
        return entry.pristine
    return assessment.manifest.files[relpath].pristine if assessment.manifest else None


def _link_holds(path: Path, target: str, expected: str) -> bool:
    """Whether a symlink to ``target`` (as the installer made it) would hold the release's bytes."""
    resolved = (path.parent / target) if not Path(target).is_absolute() else Path(target)
    try:
        return sha256(resolved.read_bytes()) == expected
    except OSError:
        return False
