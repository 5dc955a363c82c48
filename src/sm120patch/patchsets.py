"""Patch sets: TOML data that pins exact releases to the edits they need.

A patch set lives in ``patches/<distribution>/<first release>.toml`` and names the exact
versions it is pinned to; each patch names one file (a RECORD path), whether it is required or
opt-in, its provenance, the semantic check that proves it is present (``semantics.py``), and
a list of edits, each a registered rewriter with its parameters and the exact number of sites.
Nothing in this data is executed; rewriter parameters are only parsed.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any, Mapping, NamedTuple, Sequence

from packaging.version import InvalidVersion, Version

from sm120patch.data import toml
from sm120patch.errors import PatchDataError, UsageError
from sm120patch.rewriters import create
from sm120patch.semantics import CHECKS


def normalize_relpath(relpath: str) -> str:
    """A RECORD-style relative path, or ValueError for one that could escape its root."""
    path = PurePosixPath(relpath)
    if not relpath or path.is_absolute() or ".." in path.parts or "\\" in relpath:
        raise ValueError(f"not a safe relative path: {relpath!r}")
    return str(path)


class Edit(NamedTuple):
    rewriter: str
    sites: int
    params: Mapping[str, Any]


class Former(NamedTuple):
    """An applied form a patch had in an earlier sm120patch (``[[patch.former]]``). It stays in
    the data for good: an environment patched with it is recognised by its hashes (the vendor
    manifest has them, keyed ``<id>@<form>``), shown as the older form, brought to today's form
    by ``apply`` and reverted exactly."""

    form: str  # its name, unique within the patch ("ungated")
    summary: str  # what it did, and until when
    check: str  # its semantic check
    edits: tuple[Edit, ...]


class Patch(NamedTuple):
    id: str
    file: str
    required: bool
    summary: str
    check: str  # the semantic check (semantics.CHECKS) that tells whether the change is there
    edits: tuple[Edit, ...]
    upstream: str | None = None
    fixed_in: str | None = None
    formers: tuple[Former, ...] = ()
    # Opt-in patches this one cannot work without (vLLM 0.29+'s tuned limits wrap the 120 row
    # that fusion-table adds): `--with` this one applies them too.
    requires: tuple[str, ...] = ()

    def former(self, form: str) -> "Patch":
        """This patch as its older form ``form`` made it (its edits and check): what the
        manifest builder runs to know that form's bytes."""
        for former in self.formers:
            if former.form == form:
                return self._replace(edits=former.edits, check=former.check, formers=())
        raise KeyError(form)


_FORM = __import__("re").compile(r"^[a-z0-9][a-z0-9-]*$")  # no '+' or '@': manifest keys join ids with them


class PatchSet(NamedTuple):
    distribution: str
    versions: tuple[Version, ...]
    summary: str
    patches: tuple[Patch, ...]
    path: Path  # the TOML file it was read from
    notes: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """How manifests and messages name this set: ``<distribution>/<file>``."""
        return f"{self.distribution}/{self.path.name}"

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

    @property
    def opt_in(self) -> tuple[str, ...]:
        return tuple(p.id for p in self.patches if not p.required)

    def select(self, with_ids: Sequence[str] = ()) -> tuple[Patch, ...]:
        """The required patches plus the named opt-in ones, in patch-set order."""
        known = {p.id: p for p in self.patches}
        offered = ", ".join(self.opt_in) or "none"
        unknown = [i for i in with_ids if i not in known]
        if unknown:
            raise UsageError(f"--with {','.join(unknown)}: no such patch for {self.distribution} "
                             f"(opt-in patches here: {offered})")
        required = [i for i in with_ids if known[i].required]
        if required:
            raise UsageError(f"--with {','.join(required)}: required, so always applied; --with names opt-in patches "
                             f"(for {self.distribution}: {offered})")
        chosen = set(with_ids)
        for patch_id in with_ids:  # and what those require, each once
            pending = list(known[patch_id].requires)
            while pending:
                needed = pending.pop()
                if needed not in chosen:
                    chosen.add(needed)
                    pending.extend(known[needed].requires)
        return tuple(p for p in self.patches if p.required or p.id in chosen)


def _require(table: Mapping, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in table:
        raise PatchDataError(f"{where}: missing '{key}'")
    value = table[key]
    if not isinstance(value, kind):
        raise PatchDataError(f"{where}: '{key}' has the wrong type ({type(value).__name__})")
    return value


def require_version(text: str, where: str) -> Version:
    try:
        return Version(text)
    except InvalidVersion:
        raise PatchDataError(f"{where}: {text!r} is not a version") from None


def read_toml(path: Path, where: str) -> dict:
    try:
        return toml.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise PatchDataError(f"{where}: cannot read ({exc})") from None
    except toml.TOMLDecodeError as exc:
        raise PatchDataError(f"{where}: not valid TOML ({exc})") from None


def _edits(raw: Mapping, where: str, check_rewriters: bool) -> tuple[Edit, ...]:
    edits = []
    for raw_edit in _require(raw, "edit", list, where):
        sites = _require(raw_edit, "sites", int, where)
        if sites < 1:
            raise PatchDataError(f"{where}: sites must be at least 1")
        edit = Edit(rewriter=_require(raw_edit, "rewriter", str, where), sites=sites,
                    params=dict(_require(raw_edit, "params", dict, where)))
        if check_rewriters:
            create(edit.rewriter, edit.params)
        edits.append(edit)
    if not edits:
        raise PatchDataError(f"{where}: no edits")
    return tuple(edits)


def parse_patch_set(path: Path, distribution: str, *, check_rewriters: bool = True) -> PatchSet:
    """Read and validate one patch-set file of ``distribution``. With ``check_rewriters`` (the
    default) each edit's rewriter is constructed, which validates its name and parameters;
    the commands skip that (an edit's rewriter is constructed when it runs, before any write)."""
    where = f"{distribution}/{path.name}"
    doc = read_toml(path, where)
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
        check = _require(raw, "check", str, pwhere)
        if check not in CHECKS:
            raise PatchDataError(f"{pwhere}: no semantic check named {check!r} (known: {', '.join(sorted(CHECKS))})")
        edits = _edits(raw, pwhere, check_rewriters)
        formers = []
        for findex, raw_former in enumerate(_require(raw, "former", list, pwhere) if "former" in raw else []):
            fwhere = f"{pwhere}: former #{findex + 1}"
            form = _require(raw_former, "form", str, fwhere)
            if not _FORM.match(form) or any(f.form == form for f in formers):
                raise PatchDataError(f"{fwhere}: form {form!r} must be a unique name of lower-case letters, digits "
                                     "and '-'")
            fcheck = _require(raw_former, "check", str, fwhere)
            if fcheck not in CHECKS:
                raise PatchDataError(f"{fwhere}: no semantic check named {fcheck!r}")
            unknown = set(raw_former) - {"form", "summary", "check", "edit"}
            if unknown:
                raise PatchDataError(f"{fwhere}: unknown key(s) {', '.join(sorted(unknown))}")
            former_edits = _edits(raw_former, f"{pwhere}: former {form}", check_rewriters)
            if former_edits == edits:
                raise PatchDataError(f"{pwhere}: former {form} has today's edits: it is not an older form")
            formers.append(Former(form, _require(raw_former, "summary", str, fwhere), fcheck, former_edits))
        patches.append(Patch(
            id=patch_id, file=file, required=_require(raw, "required", bool, pwhere),
            summary=_require(raw, "summary", str, pwhere), check=check, edits=edits,
            upstream=raw.get("upstream"), fixed_in=raw.get("fixed_in"), formers=tuple(formers),
            requires=tuple(_require(raw, "requires", list, pwhere)) if "requires" in raw else (),
        ))
    ids = {p.id: p for p in patches}
    for patch in patches:
        for needed in patch.requires:
            if needed not in ids or needed == patch.id:
                raise PatchDataError(f"{where}: patch {patch.id} requires {needed!r}, which is not another patch of this set")
            if patch.required:
                raise PatchDataError(f"{where}: patch {patch.id} requires {needed!r}: a required patch is always "
                                     "applied, so only an opt-in one may require another")
    versions = tuple(require_version(v, where) for v in _require(doc, "versions", list, where))
    if not versions:
        raise PatchDataError(f"{where}: 'versions' is empty")
    return PatchSet(
        distribution=distribution, versions=versions, summary=_require(doc, "summary", str, where),
        patches=tuple(patches), path=path, notes=tuple(doc.get("notes", ())),
    )
