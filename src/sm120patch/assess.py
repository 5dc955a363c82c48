"""For one tree (an install or a checkout): the state of every file and patch, who made it
(sm120patch, a hand edit, another build), and the verdicts and exit codes that follow.

A file is judged by its bytes against the vendor manifest (the release's bytes and every
patched combination); sm120patch's ledger only says *who* put patched bytes there. A release
no patch set pins is judged, when asked (``apply --force``) or when sm120patch applied it that
way before, with the closest set by meaning (the semantic checks), and says so.
"""

from __future__ import annotations

import enum
from types import MappingProxyType
from typing import Mapping, NamedTuple, Sequence

from sm120patch.distributions import Distribution
from sm120patch.errors import ExitCode, PatchDataError
from sm120patch.hashing import sha256
from sm120patch.manifests import FileHashes, Manifest, load_manifest, split_key
from sm120patch.patchsets import Patch, PatchSet
from sm120patch.semantics import evaluate
from sm120patch.state import Ledger, LedgerFile
from sm120patch.trees import FileRead, Tree


class State(enum.Enum):
    """Of a file, and of a patch (the state of its file, as far as that patch goes)."""

    PRISTINE = "pristine"  # the release's bytes
    APPLIED = "applied"  # exactly the bytes of some combination of this file's patches
    DRIFTED = "drifted"  # anything else: a hand edit, another build, a half-applied patch
    MISSING = "missing"  # RECORD lists it, the file is gone


class Verdict(enum.Enum):
    PATCHED = "patched"
    PARTLY = "partly patched"
    NOT_PATCHED = "not patched"
    DRIFTED = "DRIFTED"
    FIXED_UPSTREAM = "fixed upstream"
    NO_PATCH_SET = "no patch set"
    # Every patch of the release's set is opt-in and none is applied: nothing is required, and
    # saying "patched" would claim an edit that was never made (vLLM 0.29+).
    OPT_IN_ONLY = "nothing required (opt-in patches only)"
    NOTHING_TO_PATCH = "nothing to patch"
    # A release the distribution's data names as not covered (another FlashInfer family): not an
    # unknown release, and --force does not borrow a set for it.
    NOT_COVERED = "not covered"

    @property
    def done(self) -> bool:
        return self in (Verdict.PATCHED, Verdict.FIXED_UPSTREAM, Verdict.OPT_IN_ONLY, Verdict.NOTHING_TO_PATCH)


class Origin(enum.Enum):
    SM120PATCH = "sm120patch"
    ADOPTED = "adopted"  # a hand edit equal to the patch, which apply recorded
    FORCED = "forced"  # patched by meaning with --force; no manifest vouches for the bytes
    # Written by an ordinary apply of an sm120patch whose data had another form of the patch than
    # this one's knows (no [[patch.former]] for it): the ledger vouches for the bytes, not --force.
    OTHER_FORM = "another sm120patch's form"
    BY_HAND = "by hand"  # patched or changed, and sm120patch has no record of it


class FileAssessment(NamedTuple):
    read: FileRead
    state: State
    sha256: str | None
    applied: tuple[str, ...] = ()  # ids of the patches whose combination the bytes are
    origin: Origin | None = None  # who made the bytes what they are (None: the release)
    detail: str = ""
    ledger: LedgerFile | None = None
    # Of ``applied``, the patches whose bytes are an older form of the patch (an earlier
    # sm120patch's, ``[[patch.former]]``): applied, and `apply` brings them to today's form.
    former: tuple[str, ...] = ()

    @property
    def relpath(self) -> str:
        return self.read.relpath

    @property
    def path(self):
        return self.read.path

    @property
    def link(self) -> str | None:
        return self.read.link


class Assessment(NamedTuple):
    tree: Tree
    distribution: Distribution
    patch_set: PatchSet | None
    manifest: Manifest | None
    files: Mapping[str, FileAssessment] = MappingProxyType({})
    ledger: Ledger | None = None
    fixed_upstream: bool = False
    not_needed: bool = False  # a release the distribution's data says needs no patch
    not_covered: bool = False  # a release the distribution's data says sm120patch does not patch
    reason: str = ""  # why there is nothing to patch
    unpinned: bool = False  # no set pins this release: the closest set, by meaning
    # Files the ledger lists that this sm120patch's patch set does not (patched by a newer
    # sm120patch whose data has a patch this one's lacks, or for a release this one does not
    # pin): revert restores them from the ledger all the same, whatever today's data knows.
    unknown: Mapping[str, FileAssessment] = MappingProxyType({})

    @property
    def name(self) -> str:
        return self.distribution.name

    @property
    def applied_ids(self) -> frozenset[str] | None:
        """The ids of the patches applied here; None without a patch set (not known)."""
        if self.patch_set is None:
            return None
        return frozenset(p.id for p in self.patch_set.patches if self.patch_state(p) is State.APPLIED)

    @property
    def former_ids(self) -> tuple[str, ...]:
        """The patches applied here in an older form (an earlier sm120patch's): `apply` updates them."""
        return tuple(i for fa in self.files.values() for i in fa.former)

    @property
    def nothing_needed(self) -> bool:
        return self.fixed_upstream or self.not_needed

    @property
    def raw_version(self) -> str:
        return self.tree.raw_version

    def patch_state(self, patch: Patch) -> State:
        fa = self.files[patch.file]
        if fa.state is State.APPLIED:
            return State.APPLIED if patch.id in fa.applied else State.PRISTINE
        return State(fa.state.value)

    @property
    def verdict(self) -> Verdict:
        if self.patch_set is None:
            if self.fixed_upstream:
                return Verdict.FIXED_UPSTREAM
            if self.not_covered:
                return Verdict.NOT_COVERED
            return Verdict.NOTHING_TO_PATCH if self.not_needed else Verdict.NO_PATCH_SET
        states = {p.id: self.patch_state(p) for p in self.patch_set.patches}
        if any(s in (State.DRIFTED, State.MISSING) for s in states.values()):
            return Verdict.DRIFTED
        if not any(p.required for p in self.patch_set.patches) and State.APPLIED not in states.values():
            return Verdict.OPT_IN_ONLY
        if all(states[p.id] is State.APPLIED for p in self.patch_set.patches if p.required):
            return Verdict.PATCHED
        if any(s is State.APPLIED for s in states.values()):
            return Verdict.PARTLY
        return Verdict.NOT_PATCHED

    @property
    def dropped_by_reinstall(self) -> list[str]:
        """Patches the ledger lists whose files are the release's again (a reinstall)."""
        if self.ledger is None or self.patch_set is None:
            return []
        listed = {i for rel, entry in self.ledger.files.items()
                  if rel in self.files and self.files[rel].state is State.PRISTINE for i in entry.patches}
        return [p.id for p in self.patch_set.patches if p.id in listed]

    @property
    def links(self) -> list[FileAssessment]:
        return [fa for fa in self.files.values() if fa.link is not None]


def assess(tree: Tree, distribution: Distribution, *, ledger: Ledger | None = None, force_unknown: bool = False) -> Assessment:
    """Each patched file's state. A release no patch set pins is assessed with the closest
    set when ``force_unknown`` (apply --force) or when the ledger says a forced apply used one."""
    result = _assess(tree, distribution, ledger=ledger, force_unknown=force_unknown)
    return result._replace(unknown=_ledger_only(tree, ledger, result))


def _ledger_only(tree: Tree, ledger: Ledger | None, result: Assessment) -> Mapping[str, FileAssessment]:
    """The files ``ledger`` lists that ``result`` does not judge, each judged by the ledger's own
    hashes: what sm120patch wrote there (patched) and what it replaced (the release's bytes, as
    the installed RECORD has them when it lists the file)."""
    if ledger is None or ledger.version != tree.raw_version:
        return MappingProxyType({})
    found = {}
    for relpath, entry in ledger.files.items():
        if relpath in result.files:
            continue
        found[relpath] = assess_file(tree, relpath, _ledger_hashes(tree, relpath, entry), None, entry)
    return MappingProxyType(found)


def _ledger_hashes(tree: Tree, relpath: str, entry: LedgerFile) -> FileHashes:
    """A file's hashes as the ledger has them (what sm120patch wrote), the release's from the
    installed RECORD when it lists the file."""
    return FileHashes(pristine=tree.release_sha256(relpath) or entry.pristine,
                      patched={"+".join(entry.patches): entry.patched})


def _expected(tree: Tree, relpath: str, manifest: Manifest, patch_set: PatchSet, ledger: Ledger | None) -> FileHashes:
    """The hashes a patched file is judged by: the vendor manifest's; for a file it lacks (data
    of an older sm120patch than the one that patched it, or data edited by hand), the ledger's,
    so that what sm120patch wrote is still recognised and reverted. Without either, nothing
    vouches for the file's bytes: the data is refused (never patched unchecked)."""
    if relpath in manifest.files:
        return manifest.files[relpath]
    entry = ledger.files.get(relpath) if ledger else None
    if entry is not None:
        return _ledger_hashes(tree, relpath, entry)
    raise PatchDataError(f"the vendor manifest of {manifest.distribution} {manifest.version} has no hashes for "
                         f"{relpath}, which the patch set {patch_set.name} patches",
                         hint="reinstall sm120patch (its data is incomplete), or run `make manifests` in a checkout")


def _assess(tree: Tree, distribution: Distribution, *, ledger: Ledger | None, force_unknown: bool) -> Assessment:
    version = tree.version
    patch_set = distribution.find(version)
    result = Assessment(tree=tree, distribution=distribution, patch_set=patch_set, manifest=None, ledger=ledger)
    if patch_set is None:
        exempt = distribution.needs_nothing(version)
        if exempt is not None:
            return result._replace(not_needed=True, reason=exempt.render(tree.raw_version))
        if distribution.fixed_upstream(version):
            return result._replace(fixed_upstream=True, reason=(
                f"{distribution.name} {tree.raw_version} supports SM120 here natively (fixed upstream in "
                f"{distribution.fixed_in})" + (f". {distribution.still_gated}" if distribution.still_gated else "")))
        if tree.raw_version in distribution.sdist_only:
            return result._replace(reason=(
                f"{distribution.name} {tree.raw_version} was published as an sdist only: there is no wheel RECORD to "
                "check its files against; upgrade to a release sm120patch knows (see `sm120patch list`)"))
        uncovered = distribution.not_covered_at(version)
        if uncovered is not None:
            return result._replace(not_covered=True, reason=uncovered.render(distribution.name, tree.raw_version))
        result = result._replace(reason=f"no patch set is pinned to {distribution.name} {tree.raw_version} "
                                        f"({distribution.nearest(version)})")
        borrowed = None
        if ledger is not None and ledger.unpinned and ledger.patch_set and ledger.version == tree.raw_version:
            borrowed = distribution.patch_set_named(ledger.patch_set)
        elif force_unknown:
            borrowed = distribution.closest_set(version)
        if borrowed is None:
            return result
        manifest = _unpinned_manifest(tree, borrowed, ledger)
        result = result._replace(patch_set=borrowed, unpinned=True)
    else:
        manifest = load_manifest(distribution.name, str(version))
        if manifest is None:
            raise PatchDataError(f"no vendor manifest for {distribution.name} {tree.raw_version}; run `make manifests`")
    files = {relpath: assess_file(tree, relpath, _expected(tree, relpath, manifest, result.patch_set, ledger),
                                  result.patch_set, ledger.files.get(relpath) if ledger else None)
             for relpath in result.patch_set.files}
    return result._replace(manifest=manifest, files=files)


def _unpinned_manifest(tree: Tree, patch_set: PatchSet, ledger: Ledger | None) -> Manifest:
    """No vendor manifest vouches for this release: its own RECORD gives the release's hashes,
    and what sm120patch wrote (the ledger) the patched ones."""
    files = {}
    for rel in patch_set.files:
        entry = ledger.files.get(rel) if ledger else None
        files[rel] = FileHashes(pristine=tree.release_sha256(rel) or "",
                                patched={"+".join(entry.patches): entry.patched} if entry else {})
    return Manifest(distribution=patch_set.distribution, version=tree.raw_version, wheel="", wheel_sha256="", files=files)


def assess_file(tree: Tree, relpath: str, expected: FileHashes, patch_set: PatchSet | None,
                ledger: LedgerFile | None) -> FileAssessment:
    read = tree.read(relpath)
    if read.problem:
        return FileAssessment(read, State.DRIFTED, None, detail=read.problem)
    if read.data is None:
        return FileAssessment(read, State.MISSING, None, ledger=ledger,
                              detail="a symbolic link to a file that is gone" if read.link else "")
    digest = sha256(read.data)
    release = tree.release_sha256(relpath)
    if release is not None and expected.pristine and release != expected.pristine:
        return FileAssessment(read, State.DRIFTED, digest, ledger=ledger,
                              detail="the installed RECORD does not describe the release sm120patch knows (another build?)")
    if digest == expected.pristine:
        return FileAssessment(read, State.PRISTINE, digest, ledger=ledger)
    combination = expected.combination_of(digest)
    if combination is not None:
        if ledger is not None and ledger.patched == digest:
            origin = Origin(ledger.origin) if ledger.origin in {o.value for o in Origin} else Origin.SM120PATCH
        else:
            origin = Origin.BY_HAND
        ids, former = split_key(combination)
        return FileAssessment(read, State.APPLIED, digest, ids, origin, ledger=ledger, former=former)
    if ledger is not None and ledger.patched == digest:  # the ledger vouches for the bytes it wrote
        origin = Origin.FORCED if ledger.origin == Origin.FORCED.value else Origin.OTHER_FORM
        return FileAssessment(read, State.APPLIED, digest, ledger.patches, origin, ledger=ledger)
    return FileAssessment(read, State.DRIFTED, digest, origin=Origin.BY_HAND, ledger=ledger,
                          detail=_drift_detail(read.data, patch_set.patches_for(relpath) if patch_set else (),
                                               ledger is not None))


def _drift_detail(data: bytes, patches: Sequence[Patch], edited_after_patching: bool) -> str:
    """What a hand edit did, in the words of the semantic checks (a partial `sed` of the gates
    is the common case)."""
    head = ("changed after sm120patch patched it" if edited_after_patching else "changed by hand")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return f"{head}: not the release's bytes, not UTF-8 text"
    found = []
    for patch in patches:
        ok, detail = evaluate(patch.check, data)
        found.append(f"{patch.id}: cannot parse ({detail})" if ok is None
                     else f"{patch.id} {'present' if ok else 'absent'} ({detail})")
    return f"{head}, not the release's bytes: " + "; ".join(found)


def present_by_meaning(tree: Tree, patch: Patch) -> bool:
    """Whether ``patch``'s change is in the tree's file, by its semantic check alone."""
    read = tree.read(patch.file)
    if read.data is None:
        return False
    return evaluate(patch.check, read.data)[0] is True


# -- exit codes -------------------------------------------------------------------------------

def status_exit_code(verdicts: Sequence[Verdict], *, interrupted: bool = False) -> ExitCode:
    """0 when everything installed is patched (or fixed upstream); 3 for drift or an
    interrupted run; else 1."""
    if Verdict.DRIFTED in verdicts or interrupted:
        return ExitCode.REFUSED
    if not verdicts or not all(v.done for v in verdicts):
        return ExitCode.NOT_OK
    return ExitCode.OK
