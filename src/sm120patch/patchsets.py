"""Patch sets: TOML data in ``patches/`` that pin exact releases to the edits they need.

A patch set names one distribution and the exact versions it is pinned to; each patch names
one file (a RECORD path), whether it is required or opt-in, its provenance, and a list of
edits, each a registered rewriter with its parameters and the exact number of sites.
Nothing in this data is executed; rewriter parameters are only parsed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from packaging.version import InvalidVersion, Version

from sm120patch.data import data_dir, toml
from sm120patch.environment import normalize_name, normalize_relpath
from sm120patch.errors import PatchDataError


@dataclass(frozen=True)
class Edit:
    rewriter: str
    sites: int
    params: Mapping[str, Any]


@dataclass(frozen=True)
class Patch:
    id: str
    file: str
    required: bool
    summary: str
    edits: tuple[Edit, ...]
    upstream: str | None = None
    fixed_in: str | None = None


@dataclass(frozen=True)
class PatchSet:
    distribution: str
    versions: tuple[Version, ...]
    summary: str
    patches: tuple[Patch, ...]
    source: Path
    fixed_in: Version | None = None
    upstream: str | None = None
    notes: tuple[str, ...] = ()

    def patch(self, patch_id: str) -> Patch:
        for patch in self.patches:
            if patch.id == patch_id:
                return patch
        raise KeyError(patch_id)

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.file for p in self.patches))

    def patches_for(self, relpath: str) -> tuple[Patch, ...]:
        return tuple(p for p in self.patches if p.file == relpath)

    def select(self, with_ids: Sequence[str] = ()) -> tuple[Patch, ...]:
        """The required patches plus the named opt-in ones, in patch-set order."""
        known = {p.id for p in self.patches}
        unknown = [i for i in with_ids if i not in known]
        if unknown:
            from sm120patch.errors import UsageError

            optional = ", ".join(p.id for p in self.patches if not p.required) or "none"
            raise UsageError(
                f"--with {','.join(unknown)}: no such patch for {self.distribution} "
                f"(opt-in patches: {optional})"
            )
        return tuple(p for p in self.patches if p.required or p.id in with_ids)


def _require(table: Mapping, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in table:
        raise PatchDataError(f"{where}: missing '{key}'")
    value = table[key]
    if not isinstance(value, kind):
        raise PatchDataError(f"{where}: '{key}' has the wrong type ({type(value).__name__})")
    return value


def _version(text: str, where: str) -> Version:
    try:
        return Version(text)
    except InvalidVersion:
        raise PatchDataError(f"{where}: {text!r} is not a version") from None


def parse_patch_set(path: Path, *, check_rewriters: bool = True) -> PatchSet:
    """Read and validate one patch-set file. With ``check_rewriters`` (the default) each
    edit's rewriter is constructed, which validates its name and parameters; ``status``
    skips that to stay fast (it never runs a rewriter)."""
    where = path.name
    try:
        doc = toml.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise PatchDataError(f"{where}: cannot read ({exc})") from None
    except toml.TOMLDecodeError as exc:
        raise PatchDataError(f"{where}: not valid TOML ({exc})") from None

    patches = []
    seen: set[str] = set()
    for index, raw in enumerate(_require(doc, "patch", list, where)):
        pwhere = f"{where}: patch #{index + 1}"
        patch_id = _require(raw, "id", str, pwhere)
        pwhere = f"{where}: patch {patch_id}"
        if patch_id in seen:
            raise PatchDataError(f"{pwhere}: duplicate id")
        seen.add(patch_id)
        try:
            file = normalize_relpath(_require(raw, "file", str, pwhere))
        except ValueError as exc:
            raise PatchDataError(f"{pwhere}: {exc}") from None
        edits = []
        for raw_edit in _require(raw, "edit", list, pwhere):
            sites = _require(raw_edit, "sites", int, pwhere)
            if sites < 1:
                raise PatchDataError(f"{pwhere}: sites must be at least 1")
            edit = Edit(
                rewriter=_require(raw_edit, "rewriter", str, pwhere),
                sites=sites,
                params=dict(_require(raw_edit, "params", dict, pwhere)),
            )
            if check_rewriters:
                from sm120patch.rewriters import create

                create(edit.rewriter, edit.params)
            edits.append(edit)
        if not edits:
            raise PatchDataError(f"{pwhere}: no edits")
        patches.append(
            Patch(
                id=patch_id,
                file=file,
                required=_require(raw, "required", bool, pwhere),
                summary=_require(raw, "summary", str, pwhere),
                edits=tuple(edits),
                upstream=raw.get("upstream"),
                fixed_in=raw.get("fixed_in"),
            )
        )
    versions = tuple(_version(v, where) for v in _require(doc, "versions", list, where))
    if not versions:
        raise PatchDataError(f"{where}: 'versions' is empty")
    fixed_in = doc.get("fixed_in")
    return PatchSet(
        distribution=normalize_name(_require(doc, "distribution", str, where)),
        versions=versions,
        summary=_require(doc, "summary", str, where),
        patches=tuple(patches),
        source=path,
        fixed_in=_version(fixed_in, where) if fixed_in else None,
        upstream=doc.get("upstream"),
        notes=tuple(doc.get("notes", ())),
    )


@dataclass
class Catalog:
    """Every patch set, indexed by distribution and pinned version."""

    patch_sets: list[PatchSet] = field(default_factory=list)

    def for_distribution(self, name: str) -> list[PatchSet]:
        name = normalize_name(name)
        return [ps for ps in self.patch_sets if ps.distribution == name]

    def find(self, name: str, version: Version | None) -> PatchSet | None:
        if version is None:
            return None
        for patch_set in self.for_distribution(name):
            # Exact pins: '0.6.4' is not '0.6.4.post1' nor '0.6.4+local'.
            if any(str(version) == str(pinned) for pinned in patch_set.versions):
                return patch_set
        return None

    def known_versions(self, name: str) -> list[Version]:
        return sorted(v for ps in self.for_distribution(name) for v in ps.versions)

    def by_source(self, filename: str) -> PatchSet | None:
        return next((ps for ps in self.patch_sets if ps.source.name == filename), None)

    def closest_set(self, name: str, version: Version | None) -> PatchSet | None:
        """For a release no set pins: the set of the highest known release below it, else the
        lowest above (what `apply --force` tries, by meaning)."""
        pinned = sorted((v, ps) for ps in self.for_distribution(name) for v in ps.versions)
        if not pinned or version is None:
            return None
        below = [ps for v, ps in pinned if v < version]
        return below[-1] if below else pinned[0][1]

    def nearest(self, name: str, version: Version | None) -> str:
        """The known releases on either side of ``version``, in words, for refusals."""
        known = self.known_versions(name)
        if not known:
            return "sm120patch knows no release of it"
        if version is None:
            return f"known releases: {known[0]} to {known[-1]}"
        below = [v for v in known if v < version]
        above = [v for v in known if v > version]
        parts = ([f"nearest known below: {below[-1]}"] if below else []) + ([f"above: {above[0]}"] if above else [])
        return ", ".join(parts) + f"; sm120patch knows {known[0]} to {known[-1]}"

    def fixed_in(self, name: str) -> Version | None:
        fixes = [ps.fixed_in for ps in self.for_distribution(name) if ps.fixed_in]
        return min(fixes) if fixes else None


def load_catalog(directory: Path | None = None, *, check_rewriters: bool = True) -> Catalog:
    directory = directory or data_dir("patches")
    catalog = Catalog()
    seen: dict[tuple[str, str], Path] = {}
    for path in sorted(directory.glob("*.toml")):
        patch_set = parse_patch_set(path, check_rewriters=check_rewriters)
        for version in patch_set.versions:
            key = (patch_set.distribution, str(version))
            if key in seen:
                raise PatchDataError(f"{path.name}: {key[0]} {key[1]} is also pinned by {seen[key].name}")
            seen[key] = path
        catalog.patch_sets.append(patch_set)
    return catalog
