"""For one installed distribution: what state each patched file is in, and what apply or
revert would write, with the expected before/after hashes, or a refusal that says why."""

from __future__ import annotations

import difflib
import enum
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from sm120patch.environment import InstalledDistribution, InstalledFiles, TargetEnvironment
from sm120patch.errors import PatchDataError, RefusedError
from sm120patch.facts import SDIST_ONLY
from sm120patch.manifests import FileHashes, Manifest, apply_edits, combination_key, load_manifest
from sm120patch.patchsets import Catalog, Patch, PatchSet
from sm120patch.state import AppliedFile, AppliedRecord, DistributionState


class FileState(enum.Enum):
    PRISTINE = "pristine"  # the release's bytes (RECORD and manifest agree)
    APPLIED = "applied"  # exactly the bytes the manifest expects for some patch combination
    DRIFTED = "drifted"  # anything else: edited by hand, another build, a half-applied patch
    MISSING = "missing"  # RECORD lists it, the file is gone


class PatchState(enum.Enum):
    PRISTINE = "pristine"
    APPLIED = "applied"
    DRIFTED = "drifted"
    MISSING = "missing"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class FileAssessment:
    relpath: str
    path: Path
    state: FileState
    sha256: str | None
    applied: tuple[str, ...] = ()  # patch ids whose combination the bytes match
    detail: str = ""


@dataclass
class DistributionAssessment:
    env: TargetEnvironment
    dist: InstalledDistribution
    patch_set: PatchSet | None
    manifest: Manifest | None
    files: dict[str, FileAssessment] = field(default_factory=dict)
    record: AppliedRecord | None = None
    fixed_upstream: bool = False
    reason: str = ""  # why there is nothing to patch
    unpinned: bool = False  # a release no set pins, handled with the closest set (apply --force)

    @property
    def state(self) -> DistributionState:
        return DistributionState(self.env.state_root(self.dist) / self.dist.name)

    @property
    def tree(self) -> InstalledFiles:
        return InstalledFiles(self.dist)

    def patch_state(self, patch: Patch) -> PatchState:
        assessment = self.files[patch.file]
        if assessment.state is FileState.APPLIED:
            return PatchState.APPLIED if patch.id in assessment.applied else PatchState.PRISTINE
        return PatchState(assessment.state.value)

    @property
    def dropped_by_reinstall(self) -> list[str]:
        """Patches the applied record lists whose files are pristine again (pip reinstalled)."""
        if self.record is None:
            return []
        return [
            patch_id
            for rel, applied in self.record.files.items()
            if rel in self.files and self.files[rel].state is FileState.PRISTINE
            for patch_id in applied.patches
        ]


def assess(env: TargetEnvironment, dist: InstalledDistribution, catalog: Catalog, *,
           force_unknown: bool = False) -> DistributionAssessment:
    """Each patched file's state. A release no patch set pins is assessed with the closest set
    when ``force_unknown`` (apply --force) or when an earlier forced apply recorded one."""
    patch_set = catalog.find(dist.name, dist.version)
    fixed_in = catalog.fixed_in(dist.name)
    result = DistributionAssessment(env=env, dist=dist, patch_set=patch_set, manifest=None)
    if patch_set is None:
        if dist.version is not None and fixed_in is not None and dist.version >= fixed_in:
            result.fixed_upstream = True
            still_gated = " ".join(n for ps in catalog.for_distribution(dist.name) for n in ps.notes if "gated" in n)
            result.reason = (f"{dist.name} {dist.raw_version} supports SM120 here natively (fixed upstream in {fixed_in})"
                             + (f". {still_gated}" if still_gated else ""))
        elif dist.raw_version in SDIST_ONLY.get(dist.name, ()):
            result.reason = (f"{dist.name} {dist.raw_version} was published as an sdist only: there is no wheel RECORD "
                             "to check its files against; upgrade to a release sm120patch knows (see `sm120patch list`)")
        else:
            result.reason = f"no patch set is pinned to {dist.name} {dist.raw_version} ({catalog.nearest(dist.name, dist.version)})"
            return _assess_unpinned(result, catalog, force_unknown)
        return result
    result.manifest = load_manifest(dist.name, str(dist.version))
    if result.manifest is None:
        raise PatchDataError(f"no vendor manifest for {dist.name} {dist.raw_version}; run `make manifests`")
    result.record = result.state.read_applied()
    tree = result.tree
    for relpath in patch_set.files:
        result.files[relpath] = _assess_file(tree, relpath, result.manifest)
    return result


def _assess_unpinned(result: DistributionAssessment, catalog: Catalog, force_unknown: bool) -> DistributionAssessment:
    record = result.state.read_applied()
    borrowed = None
    if record is not None and record.unpinned and record.patch_set and record.version == result.dist.raw_version:
        borrowed = catalog.by_source(record.patch_set)
    elif force_unknown:
        borrowed = catalog.closest_set(result.dist.name, result.dist.version)
    if borrowed is None:
        return result
    result.patch_set, result.unpinned, result.record = borrowed, True, record
    # No vendor manifest vouches for this release: its own RECORD gives the pristine hashes,
    # and what sm120patch wrote (the applied record) gives the patched ones.
    tree = result.tree
    result.manifest = Manifest(
        distribution=result.dist.name, version=result.dist.raw_version, wheel="", wheel_sha256="",
        files={
            rel: FileHashes(
                pristine=tree.release_sha256(rel) or "",
                patched={"+".join(record.files[rel].patches): record.files[rel].patched} if record and rel in record.files else {},
            )
            for rel in borrowed.files
        },
    )
    for relpath in borrowed.files:
        result.files[relpath] = _assess_file(tree, relpath, result.manifest)
    return result


def _assess_file(tree: InstalledFiles, relpath: str, manifest: Manifest) -> FileAssessment:
    try:
        path = tree.absolute(relpath)
    except RefusedError as exc:
        return FileAssessment(relpath, tree.dist.location / relpath, FileState.DRIFTED, None, detail=exc.message)
    expected = manifest.files[relpath]
    try:
        digest = sha256(path.read_bytes())
    except FileNotFoundError:
        return FileAssessment(relpath, path, FileState.MISSING, None)
    release = tree.release_sha256(relpath)
    if release != expected.pristine:
        return FileAssessment(
            relpath, path, FileState.DRIFTED, digest,
            detail="the installed RECORD does not describe the release sm120patch knows (another build?)",
        )
    if digest == expected.pristine:
        return FileAssessment(relpath, path, FileState.PRISTINE, digest)
    combination = expected.combination_of(digest)
    if combination is not None:
        return FileAssessment(relpath, path, FileState.APPLIED, digest, tuple(combination.split("+")))
    return FileAssessment(relpath, path, FileState.DRIFTED, digest, detail="bytes match neither the release nor a patched form")


def text_diff(before: bytes, after: bytes, before_label: str, after_label: str) -> str:
    return "".join(
        difflib.unified_diff(
            before.decode("utf-8", "replace").splitlines(keepends=True),
            after.decode("utf-8", "replace").splitlines(keepends=True),
            fromfile=before_label,
            tofile=after_label,
        )
    )


@dataclass(frozen=True)
class PlannedFile:
    relpath: str
    path: Path
    before: str
    after: str
    data: bytes
    current: bytes
    patches: tuple[str, ...]
    original: bytes | None  # the bytes revert will restore, when first saved by this apply

    def diff(self, root: Path) -> str:
        label = self.path.relative_to(root).as_posix()
        return text_diff(self.current, self.data, f"a/{label}", f"b/{label}")


@dataclass(frozen=True)
class Plan:
    assessment: DistributionAssessment
    files: tuple[PlannedFile, ...]  # only what changes; files already as wanted are left out
    new_record: AppliedRecord | None


def _drift_refusal(assessment: DistributionAssessment, fa: FileAssessment, verb: str) -> RefusedError:
    dist = assessment.dist
    diff = ""
    original = assessment.state.original(fa.relpath)
    if original.exists() and fa.state is FileState.DRIFTED:
        diff = text_diff(original.read_bytes(), fa.path.read_bytes(), f"release/{fa.relpath}", f"installed/{fa.relpath}")
    what = "is missing" if fa.state is FileState.MISSING else f"is not the {dist.raw_version} release's bytes ({fa.detail})"
    error = RefusedError(
        f"refusing to {verb} {dist.name}: {fa.path} {what}",
        hint=(diff + "\n" if diff else "")
        + f"reinstall with `pip install --force-reinstall --no-deps {dist.name}=={dist.raw_version}`"
        + (" or pass --force to patch it as it is" if fa.state is FileState.DRIFTED and verb == "patch" else ""),
    )
    return error


def plan_apply(assessment: DistributionAssessment, selected: Sequence[Patch], *, force: bool = False) -> Plan:
    patch_set, manifest = assessment.patch_set, assessment.manifest
    assert patch_set is not None and manifest is not None
    record_files: dict[str, AppliedFile] = dict(assessment.record.files) if assessment.record else {}
    planned = []
    unpinned = bool(assessment.record and assessment.record.unpinned)
    for relpath in dict.fromkeys(p.file for p in selected):
        fa = assessment.files[relpath]
        wanted_ids = {p.id for p in selected if p.file == relpath} | set(fa.applied)
        wanted = [p for p in patch_set.patches_for(relpath) if p.id in wanted_ids]
        key = combination_key(wanted)
        expected = manifest.files[relpath]
        if fa.state is FileState.MISSING or (fa.state is FileState.DRIFTED and not force):
            raise _drift_refusal(assessment, fa, "patch")
        if fa.state is FileState.APPLIED and set(fa.applied) == wanted_ids:
            continue
        current = fa.path.read_bytes()
        if fa.state is FileState.DRIFTED:  # --force: patch whatever is there, semantically
            data = apply_edits(current, wanted, where=str(fa.path), by_meaning=True)
            base, unpinned = current, True
            if data == current:
                continue
            planned.append(PlannedFile(relpath, fa.path, fa.sha256, sha256(data), data, current,
                                       tuple(p.id for p in wanted), current))
            record_files[relpath] = AppliedFile(tuple(p.id for p in wanted), sha256(base), sha256(data))
            continue
        if fa.state is FileState.PRISTINE:
            pristine, original = current, current
        else:  # applied with fewer patches: rebuild from the saved original
            pristine = _saved_original(assessment, fa, expected.pristine, "add patches to")
            original = None
        if assessment.unpinned:  # no manifest: the rewriters' exact site counts are the check
            data, unpinned = apply_edits(pristine, wanted, where=str(fa.path), by_meaning=True), True
        else:
            data = apply_edits(pristine, wanted, where=str(fa.path))
            if sha256(data) != expected.patched.get(key):
                raise PatchDataError(f"{fa.path}: the rewriters produced bytes the vendor manifest does not expect ({key})")
        planned.append(PlannedFile(relpath, fa.path, fa.sha256, sha256(data), data, current,
                                   tuple(p.id for p in wanted), original))
        record_files[relpath] = AppliedFile(tuple(p.id for p in wanted), expected.pristine, sha256(data))
    record = AppliedRecord(assessment.dist.name, assessment.dist.raw_version, record_files, unpinned,
                           patch_set.source.name)
    return Plan(assessment, tuple(planned), record)


def _saved_original(assessment: DistributionAssessment, fa: FileAssessment, expected: str, verb: str) -> bytes:
    """The release's bytes sm120patch saved for ``fa``, checked against ``expected``."""
    saved = assessment.state.original(fa.relpath)
    data = saved.read_bytes() if saved.exists() else None
    if data is None or sha256(data) != expected:
        raise RefusedError(
            f"cannot {verb} {fa.path}: sm120patch's saved original is missing or corrupt",
            hint=f"restore it with `pip install --force-reinstall --no-deps {assessment.dist.name}=={assessment.dist.raw_version}`",
        )
    return data


def plan_revert(assessment: DistributionAssessment, *, force: bool = False) -> Plan:
    record = assessment.record
    planned = []
    for relpath, fa in assessment.files.items():
        applied = record.files.get(relpath) if record else None
        if fa.state is FileState.PRISTINE:
            continue
        if applied is None:
            if fa.state is FileState.APPLIED:
                raise RefusedError(
                    f"{fa.path} is patched, but sm120patch has no record or saved original of it",
                    hint=f"restore it with `pip install --force-reinstall --no-deps {assessment.dist.name}=={assessment.dist.raw_version}`",
                )
            raise _drift_refusal(assessment, fa, "revert")
        if fa.sha256 != applied.patched and not force:
            raise _drift_refusal(assessment, fa, "revert")
        data = _saved_original(assessment, fa, applied.pristine, "revert")
        current = fa.path.read_bytes()
        planned.append(PlannedFile(relpath, fa.path, sha256(current), applied.pristine, data, current, (), None))
    return Plan(assessment, tuple(planned), None)
