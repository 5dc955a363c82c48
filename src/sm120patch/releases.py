"""The maintainer's side of releases: ``sm120patch manifest build`` (:func:`build_all`: every
pinned release's manifest from its real wheel) and ``sm120patch manifest add`` (a new upstream
release, supported the day it ships).

For one release: its real wheel (downloaded, or the one given), the patch sets of the known
releases nearest to it tried in turn, and the first whose every rewriter finds its exact site
count, whose semantic checks fail on the release's bytes and pass on the result, and that binds
every name it introduces, is kept: the release is pinned to it (in that set's file when the
release extends the set's run of releases, else in a new file named after the release) and its
manifest is built from the wheel. When no set fits, nothing is written and the refusal gives the
evidence: each rewriter's site count in this release, and what the nearest known release has.

``newer()`` asks the package index for every release above the newest known one. A release the
distribution's data already accounts for (fixed upstream, nothing to patch, not covered) is
reported as such and never pinned.
"""

from __future__ import annotations

import functools
import json
import os
import re
import textwrap
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from packaging.version import InvalidVersion, Version

from sm120patch import manifests, semantics, wheels
from sm120patch.data import data_is_packaged
from sm120patch.distributions import Distribution, load_registry
from sm120patch.edits import edit_steps
from sm120patch.errors import PatchDataError, RefusedError, Sm120PatchError, UsageError
from sm120patch.fileops import atomic_write
from sm120patch.hashing import sha256
from sm120patch.patchsets import PatchSet, parse_patch_set
from sm120patch.plan import text_diff
from sm120patch.rewriters import Changed
from sm120patch.words import counted

# Where --newer asks which releases exist (PyPI's JSON API; a mirror that serves it can stand in).
INDEX_URL = os.environ.get("SM120PATCH_INDEX_URL", "https://pypi.org/pypi")
LINE = 100  # the width patch-set files keep their versions list within


@dataclass
class Attempt:
    """One patch set tried on the release: why it does not fit (empty: it fits)."""

    patch_set: PatchSet
    problems: list[str] = field(default_factory=list)
    hashes: dict[str, str] = field(default_factory=dict)  # relpath -> this release's sha256 of it


@dataclass
class FileReview:
    relpath: str
    sha256: str
    previous: str | None  # the nearest known release's pristine hash of the file (None: not in its manifest)
    diff: str

    @property
    def compared(self) -> str:
        if self.previous is None:
            return "not in the previous release's manifest"
        return "identical to the previous release's" if self.previous == self.sha256 else "changed since the previous release"


@dataclass
class Addition:
    """What ``add`` did (or, ``check``, would do) for one release."""

    distribution: str
    version: str
    outcome: str  # pinned | known | fixed-upstream | nothing-to-patch | not-covered
    reason: str = ""
    patch_set: PatchSet | None = None
    previous: str | None = None  # the nearest known release below, compared with
    new_file: bool = False
    files: list[FileReview] = field(default_factory=list)
    tried: list[Attempt] = field(default_factory=list)
    written: list[Path] = field(default_factory=list)

    @property
    def supported(self) -> bool:
        """sm120patch supports the release (already, or once this addition is written)."""
        return self.outcome != "missing"

    @functools.cached_property
    def _previous_manifest(self):
        return manifests.load_manifest(self.distribution, self.previous) if self.previous else None

    def previous_hash(self, relpath: str) -> str | None:
        previous = self._previous_manifest
        return previous.files[relpath].pristine if previous and relpath in previous.files else None


def format_versions(versions: Sequence[Version]) -> str:
    """The canonical ``versions = [...]`` line(s): one line within LINE columns, else wrapped at
    LINE with a trailing comma (so that adding a release rewrites nothing else)."""
    items = [f'"{v}"' for v in sorted(versions)]
    one = f"versions = [{', '.join(items)}]\n"
    if len(one) <= LINE + 1:
        return one
    body = textwrap.wrap(", ".join(items) + ",", width=LINE, initial_indent="    ", subsequent_indent="    ",
                         break_long_words=False, break_on_hyphens=False)
    return "versions = [\n" + "\n".join(body) + "\n]\n"


_VERSIONS = re.compile(r"^versions = \[[^\]]*\]\n", re.M)


def with_versions(text: str, versions: Sequence[Version], where: str) -> str:
    """``text`` (a patch-set file) with its versions list replaced; everything else byte for byte."""
    found = _VERSIONS.findall(text)
    if len(found) != 1:
        raise PatchDataError(f"{where}: expected one 'versions = [...]' list, found {len(found)}")
    return _VERSIONS.sub(lambda _: format_versions(versions), text, count=1)


def _atomic_write(path: Path, data: str) -> None:
    atomic_write(path, data.encode("utf-8"))


def build_all(wheel_cache: Path | None, out: Path | None, *, check: bool,
              progress=None, names: Sequence[str] = ()) -> list[tuple[Path, bool]]:
    """Every pinned release's manifest from its real wheel (downloaded once into the cache):
    written (or, ``check``, compared with the committed one). Returns (path, identical)."""
    cache = wheel_cache or wheels.default_cache()
    results = []
    registry = load_registry()
    chosen = ([_distribution(registry, name, option="--distribution ") for name in names] if names
              else list(registry.distributions))
    pins = [(ps, v) for d in chosen for ps in d.patch_sets for v in ps.versions]
    for index, (patch_set, version) in enumerate(pins, 1):
        if progress:
            progress(f"[{index}/{len(pins)}] {patch_set.distribution} {version}")
        wheel = wheels.fetch_wheel(patch_set.distribution, str(version), cache)
        document = manifests.build_manifest(wheel, patch_set)
        if check:
            path = manifests.manifest_path(patch_set.distribution, str(version))
            same = path.exists() and path.read_text(encoding="utf-8") == manifests.manifest_text(document)
            results.append((path, same))
        else:
            results.append((manifests.write_manifest(document, out), True))
    return results


def _known(distribution: Distribution) -> list[tuple[Version, PatchSet]]:
    return sorted(((v, ps) for ps in distribution.patch_sets for v in ps.versions), key=lambda item: item[0])


def candidates(distribution: Distribution, version: Version) -> list[PatchSet]:
    """The patch sets to try, nearest release first: below (newest first), then above."""
    known = _known(distribution)
    below = [ps for v, ps in reversed(known) if v < version]
    above = [ps for v, ps in known if v > version]
    ordered: list[PatchSet] = []
    for ps in [*below, *above]:
        if all(ps.path != seen.path for seen in ordered):
            ordered.append(ps)
    return ordered


def _try(patch_set: PatchSet, archive, record: dict) -> tuple[Attempt, dict[str, tuple[bytes, bytes]]]:
    """Whether ``patch_set`` fits the wheel's files exactly: (attempt, relpath -> (pristine, patched))."""
    attempt, results = Attempt(patch_set), {}
    names = set(record)
    for relpath in patch_set.files:
        if relpath not in record:
            same_name = sorted(n for n in names if n.rsplit("/", 1)[-1] == relpath.rsplit("/", 1)[-1])
            attempt.problems.append(f"{relpath} is not in the wheel (moved or vanished"
                                    + (f"; a file of that name: {', '.join(same_name)}" if same_name else "") + ")")
            continue
        pristine = wheels.read_member(archive, relpath)
        attempt.hashes[relpath] = sha256(pristine)
        if record[relpath] is not None and sha256(pristine) != record[relpath]:
            attempt.problems.append(f"{relpath} does not match the wheel's RECORD")
            continue
        data = pristine
        # Every edit is tried, so that the review lists every problem, not only the first.
        for patch, edit, result, data in edit_steps(pristine, patch_set.patches_for(relpath)):
            if not isinstance(result, Changed):
                reason = getattr(result, "reason", f"all {counted(edit.sites, 'site')} already patched in the release's bytes")
                attempt.problems.append(f"{patch.id} ({edit.rewriter}) in {relpath}: {reason}")
        for patch in patch_set.patches_for(relpath):
            before, why_before = semantics.evaluate(patch.check, pristine)
            after, why = semantics.evaluate(patch.check, data)
            if before:
                attempt.problems.append(f"{patch.id}: its check already passes on the release's bytes "
                                        f"(fixed upstream here?): {why_before}")
            elif not after and data != pristine:
                attempt.problems.append(f"{patch.id}: its check fails on the result: {why}")
        if relpath.endswith(".py") and data != pristine:
            try:
                unbound = sorted(set(semantics.unbound_names(data.decode("utf-8")))
                                 - set(semantics.unbound_names(pristine.decode("utf-8"))))
            except (SyntaxError, ValueError):
                unbound = []
            if unbound:
                attempt.problems.append(f"{relpath}: the result uses {', '.join(unbound)} without binding it")
        results[relpath] = (pristine, data)
    return attempt, results


def _fits_its_file(patch_set: PatchSet, version: Version, distribution: Distribution) -> bool:
    """The naming rule: a set's file is named after its first release and holds one run of
    consecutive known releases. The release joins the file when it stays so."""
    low, high = min(*patch_set.versions, version), max(*patch_set.versions, version)
    if patch_set.path.name != f"{low}.toml":
        return False
    return not any(low < v < high for v, ps in _known(distribution) if ps.path != patch_set.path)


def add(name: str, raw_version: str, *, wheel: Path | None = None, check: bool = False,
        wheel_cache: Path | None = None) -> Addition:
    """Support ``name`` ``raw_version``: see the module's docstring. ``check``: write nothing."""
    registry = load_registry()
    distribution = _distribution(registry, name)
    try:
        version = Version(raw_version)
    except InvalidVersion:
        raise UsageError(f"{raw_version!r} is not a version (PEP 440: e.g. 0.5.24 or 0.7.0.post1)") from None
    result = Addition(distribution.name, raw_version, "missing")
    pinned = distribution.find(version)
    if pinned is not None:
        result.outcome, result.patch_set = "known", pinned
        result.reason = f"already pinned by {pinned.name}"
        return result
    for outcome, row in (("fixed-upstream", distribution.fixed_upstream(version) or None),
                         ("nothing-to-patch", distribution.needs_nothing(version)),
                         ("not-covered", distribution.not_covered_at(version))):
        if row is not None:
            result.outcome = outcome
            result.reason = (f"fixed upstream from {distribution.fixed_in}: nothing to pin" if outcome == "fixed-upstream"
                             else row.render(raw_version) if outcome == "nothing-to-patch"
                             else row.render(distribution.name, raw_version))
            return result
    if wheel is None:
        wheel = wheels.fetch_wheel(distribution.name, raw_version, wheel_cache or wheels.default_cache())
    elif not _wheel_of(wheel, distribution.name, version):
        raise UsageError(f"--wheel {wheel}: not a wheel of {distribution.name} {raw_version}")
    below = [v for v, _ in _known(distribution) if v < version]
    result.previous = str(below[-1]) if below else None
    archive, record = wheels.read_wheel(wheel)
    with archive, wheels.damaged(wheel):
        # The release is the one the wheel's METADATA names, not its file name alone (which
        # names this release: _wheel_of, the cache): a wheel renamed to another release would
        # pin that release to these bytes.
        wheels.check_release(archive, wheel)
        for patch_set in candidates(distribution, version):
            attempt, files = _try(patch_set, archive, record)
            result.tried.append(attempt)
            if not attempt.problems:
                break
        else:
            return result
    kept = result.tried[-1].patch_set
    for relpath, (pristine, patched) in files.items():
        result.files.append(FileReview(relpath, sha256(pristine), result.previous_hash(relpath),
                                       text_diff(pristine, patched, f"a/{relpath}", f"b/{relpath}")))
    result.outcome, result.patch_set = "pinned", kept
    result.new_file = not _fits_its_file(kept, version, distribution)
    if check:
        return result
    if data_is_packaged():
        raise UsageError(f"{distribution.name} {raw_version} fits {kept.name}, but this sm120patch runs from an installed "
                         "wheel: `manifest add` writes a checkout's patches/ and vendor-manifests/",
                         hint="run it from an sm120patch checkout (`make install`), or set SM120PATCH_DATA_DIR to one")
    result.written = _record(distribution, kept, version, wheel, result.new_file)
    return result


def _record(distribution: Distribution, kept: PatchSet, version: Version, wheel: Path, new_file: bool) -> list[Path]:
    """Write the pin, then the manifest built from the wheel under the pinned set; the pin is
    put back when the manifest cannot be built (nothing half-written is left)."""
    if new_file:
        path = kept.path.with_name(f"{version}.toml")
        if path.exists():
            raise RefusedError(f"{path} exists and does not pin {version}: look at it by hand")
        old = None
        text = with_versions(kept.path.read_text(encoding="utf-8"), [version], kept.name)
    else:
        path = kept.path
        old = path.read_text(encoding="utf-8")
        text = with_versions(old, [*kept.versions, version], kept.name)
    _atomic_write(path, text)
    try:
        pinned = parse_patch_set(path, distribution.name)
        document = manifests.build_manifest(wheel, pinned)
        manifest = manifests.write_manifest(document)
    except BaseException:
        if old is None:
            path.unlink(missing_ok=True)
        else:
            _atomic_write(path, old)
        raise
    return [path, manifest]


def _distribution(registry, name: str, *, option: str = "") -> Distribution:
    """The distribution ``name`` (``option``: how the command line gave it, for the refusal)."""
    try:
        return registry.get(name)
    except KeyError:
        import difflib

        names = [d.name for d in registry.distributions]
        # The selector's word (`flashinfer` for flashinfer-python) first, then the nearest spelling.
        near = next((d.name for d in registry.distributions if d.option == name), None) \
            or next(iter(difflib.get_close_matches(name, names, n=1)), None)
        raise UsageError(f"{option}{name}: not a distribution sm120patch knows ({', '.join(names)})",
                         hint=f"did you mean {near}?" if near else None) from None


def _wheel_of(wheel: Path, name: str, version: Version) -> bool:
    from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

    try:
        wheel_name, wheel_version, _, _ = parse_wheel_filename(wheel.name)
    except InvalidWheelFilename:
        return False
    return wheel_name == canonicalize_name(name) and wheel_version == version


def released(name: str, *, opener: Callable = urllib.request.urlopen) -> list[Version]:
    """Every final release of ``name`` on the index that has a wheel and is not yanked."""
    url = f"{INDEX_URL.rstrip('/')}/{name}/json"
    try:
        with opener(url, timeout=60) as response:
            document = json.load(response)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise Sm120PatchError(f"could not read the release list of {name} from {url}: {exc}") from None
    found = []
    for raw, files in document.get("releases", {}).items():
        try:
            version = Version(raw)
        except InvalidVersion:
            continue
        if version.is_prerelease or version.is_devrelease:
            continue
        if any(f.get("packagetype") == "bdist_wheel" and not f.get("yanked") for f in files):
            found.append(version)
    return sorted(found)


def newer(name: str, *, check: bool = False, wheel_cache: Path | None = None,
          progress: Callable[[str], None] | None = None, available: Sequence[Version] | None = None) -> list[Addition]:
    """Every release on the index newer than the newest known one, each through :func:`add`
    (``available``: the index's answer, when the caller has it)."""
    distribution = _distribution(load_registry(), name)
    known = distribution.known_versions()
    newest = known[-1] if known else None
    releases = [v for v in (available if available is not None else released(distribution.name))
                if newest is None or v > newest]
    results = []
    for index, version in enumerate(releases, 1):
        if progress:
            progress(f"[{index}/{len(releases)}] {distribution.name} {version}")
        results.append(add(distribution.name, str(version), check=check, wheel_cache=wheel_cache))
    return results


def refusal(result: Addition) -> RefusedError:
    """No set fits (the evidence is the report's): the error the command ends with."""
    nearest = result.tried[0].patch_set.name if result.tried else "none"
    return RefusedError(
        f"{result.distribution} {result.version}: no patch set fits (nearest: {nearest}); nothing was written",
        hint="a new rewriter or new sites is a maintainer's change: copy the nearest set to "
             f"patches/{result.distribution}/{result.version}.toml, adjust it, then run `sm120patch manifest build "
             f"--distribution {result.distribution}`",
    )
