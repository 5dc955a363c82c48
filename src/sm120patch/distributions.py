"""The registry of supported distributions, read from data: ``patches/<name>/distribution.toml``
beside that distribution's patch sets.

Everything that differs between FlashInfer, SGLang (and any distribution added later) is
here as data: its CLI selector, how a git checkout of it is laid out, the JIT module its
sources feed, the release that fixed it upstream, what status and doctor say about turning
fusion on, and its patch sets with the releases each is pinned to. Code above this module asks
a :class:`Distribution`, never compares a distribution's name.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, NamedTuple, Sequence

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from sm120patch.data import data_dir
from sm120patch.environment import normalize_name, version_or_none
from sm120patch.errors import PatchDataError
from sm120patch.patchsets import PatchSet, parse_patch_set, read_toml, require_version

LEVELS = ("info", "warn")
# How a server creates FlashInfer's fusion workspace: trtllm_create_ipc_workspace_for_all_reduce_fusion
# (legacy) or create_allreduce_fusion_workspace(backend="trtllm") (unified).
WORKSPACE_CALLS = ("legacy", "unified")
# Files beside the patch sets that are not patch sets: the distribution's facts, and its log
# lines (read by `check-log` alone, logcheck.py).
NOT_PATCH_SETS = ("distribution.toml", "logs.toml")
# A selector given without a version (--flashinfer alone): whatever release is installed. A NUL,
# which no command-line argument can hold, so that `--flashinfer ''` is a value (refused), not this.
ANY = "\0"


class Advice(NamedTuple):
    """A sentence status and doctor show for the releases ``versions`` matches."""

    versions: SpecifierSet
    level: str  # info / warn
    text: str  # may name {version} and {with_version}
    # What the installed files say: shown only while these patches are applied / not applied
    # (vLLM's pass stays off on SM120 until fusion-table gives it a row).
    when_applied: tuple[str, ...] = ()
    unless_applied: tuple[str, ...] = ()
    # The releases of the distribution's fusion_with it needs (SGLang's PCIe-IPC allreduce needs
    # a FlashInfer that has the kernels); empty: any, or none installed.
    with_: SpecifierSet = SpecifierSet()
    bench: bool = False  # also printed by `sm120patch bench` (advice about running the server)

    def applies(self, version: Version | None, applied: frozenset[str] | None = None,
                with_version: Version | None = None) -> bool:
        if version is None or not self.versions.contains(version, prereleases=True):
            return False
        if str(self.with_) and (with_version is None or not self.with_.contains(with_version, prereleases=True)):
            return False
        if self.when_applied or self.unless_applied:
            if applied is None:  # no pinned set: what is applied is not known
                return False
            return set(self.when_applied) <= applied and not set(self.unless_applied) & applied
        return True

    def render(self, raw_version: str, with_version: str = "") -> str:
        return self.text.replace("{version}", raw_version).replace("{with_version}", with_version)


class NothingToPatch(NamedTuple):
    """Releases that need no patch of this distribution, and why (vLLM before its capability
    gate: fusion needs only FlashInfer's patch and the flag)."""

    versions: SpecifierSet
    reason: str  # may name {version}

    def render(self, raw_version: str) -> str:
        return self.reason.replace("{version}", raw_version)


class NotCovered(NamedTuple):
    """Releases sm120patch knows of and does not patch, and why (SGLang 0.4.9-0.4.10.post2 have
    the fusion flag but run another FlashInfer family): named, not "unknown"."""

    versions: SpecifierSet
    reason: str  # why, for any release of the range

    def render(self, name: str, raw_version: str) -> str:
        return f"{name} {raw_version} is not covered: {self.reason}"


class FusionFlag(NamedTuple):
    """The server option that turns fusion on in the releases ``versions`` matches."""

    versions: SpecifierSet
    flag: str
    # vLLM: the pass config's keys that turn the pass on and size it (one value in MB for every
    # TP size), and the size status names where no profile of this box holds ("": none).
    switch: str = ""
    sizing: str = ""
    untuned_mb: float | None = None

    def compilation_config(self, size_mb: float) -> str:
        """One --compilation-config that turns the pass on and sizes it, as a shell takes it."""
        return f"--compilation-config '{json.dumps({'pass_config': {self.switch: True, self.sizing: size_mb}})}'"


def _pair_matches(versions: SpecifierSet, with_: SpecifierSet, version: Version | None,
                  with_version: Version | None) -> bool:
    """A row for a server's releases ``versions`` with a kernel-library release in ``with_``:
    both releases known, and both in range."""
    return (version is not None and with_version is not None and versions.contains(version, prereleases=True)
            and with_.contains(with_version, prereleases=True))


class FusionPath(NamedTuple):
    """How the server creates FlashInfer's fusion workspace for the releases ``versions`` (with a
    release of the distribution's ``fusion_with`` in ``with_``), and what it does on a GPU
    without multicast (a PCIe box):
    it enters fusion once every patch in ``needs`` (``distribution:id``) is applied; without
    them it does ``without``."""

    versions: SpecifierSet
    with_: SpecifierSet
    workspace: str  # one of WORKSPACE_CALLS: the FlashInfer call the server makes
    path: str
    preflight: str | None = None  # "module:function": the server's own check before that call
    needs: tuple[tuple[str, str], ...] = ()
    without: str = ""

    def matches(self, version: Version | None, with_version: Version | None) -> bool:
        return (version is not None and self.versions.contains(version, prereleases=True)
                and (not str(self.with_) or (with_version is not None
                                             and self.with_.contains(with_version, prereleases=True))))


class PcieIpcPath(NamedTuple):
    """The server's own PCIe-IPC allreduce over FlashInfer's PcieIpcAllReduceWorkspace, in the
    releases ``versions`` with a release of ``fusion_with`` in ``with_``: an unfused path the
    server takes when ``switch`` is set, which `bench --tune` times beside NCCL (its column
    ``name``, one of bench.limits.UNFUSED_PATHS; ``code`` the server's class, "module:Class",
    that the tuner creates it with; ``rows`` the widest batch its workspace is sized for)."""

    versions: SpecifierSet
    with_: SpecifierSet
    name: str
    switch: str
    code: str
    rows: int

    def matches(self, version: Version | None, with_version: Version | None) -> bool:
        return _pair_matches(self.versions, self.with_, version, with_version)


class AutoEnable(NamedTuple):
    """Fusion on by default in the releases ``versions`` matches, without the server's flag
    (the ``requested`` step of chain.py): ``by`` "release" (the release does it itself on SM120
    once its gates accept it) or the id of the opt-in patch that does it."""

    versions: SpecifierSet
    by: str
    limits: str  # where it holds, in words: "at TP2, for the models SGLang auto-enables it for"


class ServerGate(NamedTuple):
    """An opt-in patch that the server needs for fusion on SM120 in the releases ``versions``
    matches, unless it is started with ``instead`` (vLLM 0.29+: fusion-table, or
    pass_config.fi_allreduce_fusion_max_size_mb)."""

    versions: SpecifierSet
    patch: str
    instead: str


class KernelPath(NamedTuple):
    """What the server's fused call needs of its kernel library's SM120 patches, for the
    releases ``versions`` with a release of ``fusion_with`` in ``with_`` (read from the code):
    ``build`` (without them the JIT module does not build for SM120), ``run`` (without them the
    kernel the server calls is wrong or empty there), ``launch`` (the kernel runs without them,
    launched as released). Every other required patch of the library's set completes upstream's
    fix of kernels this server does not call (``calls`` says which it does)."""

    versions: SpecifierSet
    with_: SpecifierSet
    calls: str
    build: tuple[str, ...] = ()
    run: tuple[str, ...] = ()
    launch: tuple[str, ...] = ()
    launch_without: str = ""  # what a launch without ``launch`` does, in words

    def matches(self, version: Version | None, with_version: Version | None) -> bool:
        return _pair_matches(self.versions, self.with_, version, with_version)


class CheckoutLayout(NamedTuple):
    """How a git checkout of the project maps the wheel's paths (RECORD paths) to its own."""

    markers: tuple[str, ...]  # paths that exist in a checkout of this project
    layout: tuple[tuple[str, str], ...]  # (installed prefix, repository prefix), most specific first
    version_file: str | None = None  # else: the newest release tag reachable from HEAD

    def repo_path(self, relpath: str) -> str | None:
        for installed, repository in self.layout:
            if relpath.startswith(installed):
                return repository + relpath[len(installed):]
            if relpath + "/" == installed:  # the directory itself (verify's include path)
                return repository.rstrip("/")
        return None

    def matches(self, root: Path) -> bool:
        return all((root / marker).exists() for marker in self.markers)


class VerifySpec(NamedTuple):
    """How `verify` exercises the distribution beyond hashes and semantic checks."""

    jit_spec: str | None = None  # "module:function" returning the JIT spec of jit_module
    arch_list: str | None = None  # FLASHINFER_CUDA_ARCH_LIST to ask it with
    expect_target: str | None = None  # what its nvcc flags must then target
    compile_header: str | None = None  # the RECORD path `verify --compile` builds PTX from
    # Its include path, as the wheel names the directories (the header's own directory first).
    compile_includes: tuple[str, ...] = ()
    # `verify --tuned` ([verify.tuned]): the server's arguments a start with fusion on gives (each
    # release takes the fields it has); the module-level device flags as an SM120 GPU sets them at
    # import (used under the stand-in device only). Each decision site's cap is the patch data's
    # own: the expression its tuned-limits edit wraps.
    tuned_server_args: Mapping[str, Any] = MappingProxyType({})
    tuned_device_flags: Mapping[str, Any] = MappingProxyType({})


class PatchSets:
    """A distribution's patch-set files, each read when first needed: ``status`` reads only the
    one for the installed release (reading all 17 took it about 8 ms). A file is
    named after the lowest release it pins and pins none at or past the next file's name
    (:meth:`all` checks it), so the set for a release can only be the last file named at or
    below it."""

    __slots__ = ("_distribution", "_named", "_check_rewriters", "_advice", "_read", "_all")

    def __init__(self, distribution: str, directory: Path, *, check_rewriters: bool = True,
                 advice: Sequence[Advice] = ()) -> None:
        named = []
        for path in directory.glob("*.toml"):
            if path.name not in NOT_PATCH_SETS:
                where = f"{distribution}/{path.name}"
                try:
                    named.append((Version(path.stem), path))
                except InvalidVersion:
                    raise PatchDataError(f"{where}: a patch set is named after the lowest release it pins "
                                         "(e.g. 0.6.4.toml)") from None
        named.sort(key=lambda item: item[0])
        for (first, a), (second, b) in zip(named, named[1:]):
            if first == second:
                raise PatchDataError(f"{distribution}/{a.name} and {b.name} are named after one release")
        self._distribution, self._named, self._check_rewriters = distribution, named, check_rewriters
        self._advice = advice  # the patch ids it names must exist in some set
        self._read: dict[Path, PatchSet] = {}
        self._all: tuple[PatchSet, ...] | None = None

    def _parse(self, path: Path) -> PatchSet:
        if path not in self._read:
            self._read[path] = parse_patch_set(path, self._distribution, check_rewriters=self._check_rewriters)
        return self._read[path]

    def for_version(self, version: Version) -> PatchSet | None:
        """The set pinned to exactly ``version`` ('0.6.4' is not '0.6.4.post1' nor '0.6.4+local')."""
        candidates = [path for named, path in self._named if named <= version]
        if not candidates:
            return None
        patch_set = self._parse(candidates[-1])
        return patch_set if any(str(version) == str(pinned) for pinned in patch_set.versions) else None

    def all(self) -> tuple[PatchSet, ...]:
        """Every set, in release order, each checked against the naming rule and the others' pins,
        and every patch id the distribution's advice names found in one of them."""
        if self._all is None:
            sets = tuple(self._parse(path) for _, path in self._named)
            seen: dict[str, PatchSet] = {}
            for patch_set in sets:
                for version in patch_set.versions:
                    if str(version) in seen:
                        raise PatchDataError(f"{patch_set.name}: {self._distribution} {version} is also pinned by "
                                             f"{seen[str(version)].name}")
                    seen[str(version)] = patch_set
            for index, (named, path) in enumerate(self._named):
                patch_set = self._read[path]
                following = self._named[index + 1][0] if index + 1 < len(self._named) else None
                if min(patch_set.versions) != named:
                    raise PatchDataError(f"{patch_set.name}: named after {named}, but the lowest release it pins is "
                                         f"{min(patch_set.versions)} (name it {min(patch_set.versions)}.toml)")
                if following is not None and max(patch_set.versions) >= following:
                    raise PatchDataError(f"{patch_set.name}: pins {max(patch_set.versions)}, at or past the next set "
                                         f"({following}.toml)")
            ids = {p.id for patch_set in sets for p in patch_set.patches}
            for index, item in enumerate(self._advice):
                unknown_ids = sorted(set(item.when_applied + item.unless_applied) - ids)
                if unknown_ids:
                    raise PatchDataError(f"{self._distribution}/distribution.toml: advice #{index + 1} names no patch "
                                         f"of {self._distribution}: {', '.join(unknown_ids)}")
            self._all = sets
        return self._all


class Distribution(NamedTuple):
    name: str
    option: str  # the selector: --<option> [VERSION]
    summary: str
    sets: PatchSets  # its patch-set files, read when needed
    fixed_in: Version | None = None
    upstream: str | None = None
    sdist_only: tuple[str, ...] = ()
    jit_module: str | None = None
    still_gated: str | None = None
    pins: str | None = None  # a distribution whose exact pin status compares with what is installed
    advice: tuple[Advice, ...] = ()
    nothing_to_patch: tuple[NothingToPatch, ...] = ()
    not_covered: tuple[NotCovered, ...] = ()
    fusion_flags: tuple[FusionFlag, ...] = ()
    fusion_paths: tuple[FusionPath, ...] = ()
    fusion_with: str | None = None  # the distribution whose release fusion_paths also depend on
    pcie_ipc: tuple[PcieIpcPath, ...] = ()
    # [fusion_chain]: what chain.py needs beyond the patch sets and the rows above.
    auto_enables: tuple[AutoEnable, ...] = ()
    server_gates: tuple[ServerGate, ...] = ()
    kernel_paths: tuple[KernelPath, ...] = ()
    tp_advice: str = ""  # may name {bench}: the bench command for the same target
    tp_untuned: str = ""  # what the release's own limits do on SM120 over PCIe (the tp step without a profile)
    checkout: CheckoutLayout | None = None
    verify: VerifySpec = VerifySpec()
    directory: Path = Path(".")

    @property
    def selector(self) -> str:
        return f"--{self.option}"

    @property
    def patch_sets(self) -> tuple[PatchSet, ...]:
        """Every patch set, in release order (reads every file: ``find`` reads one)."""
        return self.sets.all()

    def find(self, version: Version | None) -> PatchSet | None:
        """The patch set pinned to exactly ``version`` ('0.6.4' is not '0.6.4.post1' nor '0.6.4+local')."""
        return None if version is None else self.sets.for_version(version)

    def known_versions(self) -> list[Version]:
        return sorted(v for ps in self.patch_sets for v in ps.versions)

    def closest_set(self, version: Version | None) -> PatchSet | None:
        """For a release no set pins: the set of the highest known release below it, else the
        lowest above (what `apply --force` tries, by meaning)."""
        pinned = sorted(((v, ps) for ps in self.patch_sets for v in ps.versions), key=lambda item: item[0])
        if not pinned or version is None:
            return None
        below = [ps for v, ps in pinned if v < version]
        return below[-1] if below else pinned[0][1]

    def nearest(self, version: Version | None) -> str:
        """The known releases on either side of ``version``, in words, for refusals."""
        known = self.known_versions()
        if not known:
            return "sm120patch knows no release of it"
        if version is None:
            return f"sm120patch knows {known[0]} to {known[-1]}"
        below = [v for v in known if v < version]
        above = [v for v in known if v > version]
        parts = ([f"nearest known below: {below[-1]}"] if below else []) + ([f"above: {above[0]}"] if above else [])
        return ", ".join(parts) + f"; sm120patch knows {known[0]} to {known[-1]}"

    def needs_nothing(self, version: Version | None) -> NothingToPatch | None:
        if version is None:
            return None
        return next((n for n in self.nothing_to_patch if n.versions.contains(version, prereleases=True)), None)

    def fusion_path(self, version: Version | None, with_version: Version | None) -> FusionPath | None:
        """The workspace path this release takes with that release of ``fusion_with`` (the first
        row that matches)."""
        return next((row for row in self.fusion_paths if row.matches(version, with_version)), None)

    def pcie_ipc_path(self, version: Version | None, with_version: Version | None) -> PcieIpcPath | None:
        """The PCIe-IPC allreduce this release has with that release of ``fusion_with`` (None: none)."""
        return next((row for row in self.pcie_ipc if row.matches(version, with_version)), None)

    def fixed_upstream(self, version: Version | None) -> bool:
        return version is not None and self.fixed_in is not None and version >= self.fixed_in

    def not_covered_at(self, version: Version | None) -> NotCovered | None:
        if version is None:
            return None
        return next((n for n in self.not_covered if n.versions.contains(version, prereleases=True)), None)

    def fusion_flag(self, version: Version | None) -> str | None:
        """The option that turns fusion on in this release (None: the distribution names none)."""
        found = self.fusion_flag_row(version)
        return found.flag if found is not None else None

    def fusion_flag_row(self, version: Version | None) -> FusionFlag | None:
        if version is None:
            return None
        return next((f for f in self.fusion_flags if f.versions.contains(version, prereleases=True)), None)

    def advice_for(self, version: Version | None, applied: frozenset[str] | None = None,
                   with_version: Version | None = None) -> list[Advice]:
        """The advice for ``version``; ``applied``: the ids of the patches applied there (None:
        unknown, and advice that depends on them is left out); ``with_version``: the installed
        release of ``fusion_with``."""
        return [a for a in self.advice if a.applies(version, applied, with_version)]

    def patch_set_named(self, name: str) -> PatchSet | None:
        return next((ps for ps in self.patch_sets if ps.name == name or ps.path.name == name), None)

    def files_for(self, raw_version: str) -> tuple[str, ...]:
        """The files whose RECORD rows sm120patch reads for this release: those of the set pinned
        to it, or (a release no set pins: ``--force`` borrows the closest set) those of every set."""
        pinned = self.find(version_or_none(raw_version))
        if pinned is not None:
            return pinned.files
        return tuple(dict.fromkeys(f for ps in self.patch_sets for f in ps.files))


class Registry:
    """Every supported distribution, in name order (what ``load_registry`` reads)."""

    __slots__ = ("distributions",)

    def __init__(self, distributions: tuple[Distribution, ...]) -> None:
        self.distributions = distributions

    def __iter__(self):
        return iter(self.distributions)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.distributions)

    def get(self, name: str) -> Distribution:
        wanted = normalize_name(name)
        for distribution in self.distributions:
            if distribution.name == wanted:
                return distribution
        raise KeyError(name)

    @property
    def patch_sets(self) -> list[PatchSet]:
        return [ps for d in self.distributions for ps in d.patch_sets]

    def wanted_rows(self, name: str, raw_version: str) -> dict:
        """Which rows of ``name``'s RECORD sm120patch reads when ``raw_version`` is installed: the
        files its patch set touches (not the thousands of others)."""
        return {"files": list(self.get(name).files_for(raw_version))}


def _str_list(doc: dict, key: str, where: str) -> tuple[str, ...]:
    value = doc.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise PatchDataError(f"{where}: '{key}' must be a list of strings")
    return tuple(value)


def _optional_str(doc: dict, key: str, where: str) -> str | None:
    value = doc.get(key)
    if value is not None and not isinstance(value, str):
        raise PatchDataError(f"{where}: '{key}' must be a string")
    return value


def specifier(value: object, where: str) -> SpecifierSet:
    """A PEP 440 range from the data (``where`` names the row for the error)."""
    if not isinstance(value, str):
        raise PatchDataError(f"{where}: versions must be a version specifier string")
    try:
        return SpecifierSet(value)
    except InvalidSpecifier:
        raise PatchDataError(f"{where}: {value!r} is not a version specifier") from None


def parse_distribution(directory: Path, *, full: bool = True) -> Distribution:
    """``full``: read and check every patch set now (each rewriter constructed; pins across
    sets and the patch ids advice names: :meth:`PatchSets.all`). Without it (the commands) a set
    is read when first needed, and its rewriters are constructed only when an edit runs them."""
    where = f"{directory.name}/distribution.toml"
    doc = read_toml(directory / "distribution.toml", where)
    for key in ("name", "option", "summary"):
        if not isinstance(doc.get(key), str) or not doc[key]:
            raise PatchDataError(f"{where}: missing '{key}'")
    name = normalize_name(doc["name"])
    if name != directory.name:
        raise PatchDataError(f"{where}: names {name!r}, but lives in patches/{directory.name}/")
    advice = []
    for index, raw in enumerate(doc.get("advice", [])):
        awhere = f"{where}: advice #{index + 1}"
        if raw.get("level") not in LEVELS or not isinstance(raw.get("text"), str):
            raise PatchDataError(f"{awhere}: needs level ({' or '.join(LEVELS)}) and text")
        versions = specifier(raw.get("versions", ""), awhere)
        conditions = {key: _str_list(raw, key, awhere) for key in ("when_applied", "unless_applied")}
        if not isinstance(raw.get("bench", False), bool):
            raise PatchDataError(f"{awhere}: bench is true or false")
        if not isinstance(raw.get("with", ""), str):
            raise PatchDataError(f"{awhere}: with is a version specifier")
        if raw.get("with") and not doc.get("fusion_with"):
            raise PatchDataError(f"{awhere}: with needs fusion_with (the distribution it names releases of)")
        advice.append(Advice(versions, raw["level"], raw["text"], **conditions,
                             with_=specifier(raw.get("with", ""), awhere), bench=raw.get("bench", False)))
    nothing = []
    for index, raw in enumerate(doc.get("nothing_to_patch", [])):
        nwhere = f"{where}: nothing_to_patch #{index + 1}"
        if not isinstance(raw.get("reason"), str) or not isinstance(raw.get("versions"), str):
            raise PatchDataError(f"{nwhere}: needs versions (a version specifier) and reason")
        nothing.append(NothingToPatch(specifier(raw["versions"], nwhere), raw["reason"]))
    not_covered = []
    for index, raw in enumerate(doc.get("not_covered", [])):
        cwhere = f"{where}: not_covered #{index + 1}"
        if not isinstance(raw.get("reason"), str) or not isinstance(raw.get("versions"), str) or not raw["versions"]:
            raise PatchDataError(f"{cwhere}: needs versions (a version specifier) and reason")
        not_covered.append(NotCovered(specifier(raw["versions"], cwhere), raw["reason"]))
    flags = []
    for index, raw in enumerate(doc.get("fusion_flag", [])):
        gwhere = f"{where}: fusion_flag #{index + 1}"
        if not isinstance(raw.get("flag"), str) or not raw["flag"] or not isinstance(raw.get("versions"), str):
            raise PatchDataError(f"{gwhere}: needs versions (a version specifier) and flag")
        sized = {key: raw.get(key, "") for key in ("switch", "sizing")}
        untuned = raw.get("untuned_mb")
        if not all(isinstance(v, str) for v in sized.values()) or bool(sized["switch"]) != bool(sized["sizing"]) or (
                sized["sizing"] and (isinstance(untuned, bool) or not isinstance(untuned, (int, float)) or untuned <= 0)):
            raise PatchDataError(f"{gwhere}: switch and sizing are pass config keys, given together, with untuned_mb "
                                 "(a size in MB above 0)")
        flags.append(FusionFlag(specifier(raw["versions"], gwhere), raw["flag"], **sized,
                                untuned_mb=float(untuned) if untuned is not None else None))
    paths = []
    for index, raw in enumerate(doc.get("fusion_path", [])):
        fwhere = f"{where}: fusion_path #{index + 1}"
        if not all(isinstance(raw.get(key), str) for key in ("versions", "with", "path")):
            raise PatchDataError(f"{fwhere}: needs versions and with (version specifiers) and path")
        if raw.get("workspace") not in WORKSPACE_CALLS:
            raise PatchDataError(f"{fwhere}: workspace must be one of {', '.join(WORKSPACE_CALLS)}")
        preflight = _optional_str(raw, "preflight", fwhere)
        module, _, function = (preflight or "").partition(":")
        if preflight is not None and not (all(p.isidentifier() for p in module.split(".")) and function.isidentifier()):
            raise PatchDataError(f"{fwhere}: preflight names module:function, not {preflight!r}")
        needs = []
        for item in _str_list(raw, "needs", fwhere):
            owner, _, patch_id = item.partition(":")
            if not owner or not patch_id:
                raise PatchDataError(f"{fwhere}: needs names distribution:patch-id, not {item!r}")
            needs.append((owner, patch_id))
        if needs and not isinstance(raw.get("without"), str):
            raise PatchDataError(f"{fwhere}: a path that needs patches says what happens without them (without)")
        paths.append(FusionPath(specifier(raw["versions"], fwhere), specifier(raw["with"], fwhere), raw["workspace"],
                                raw["path"], preflight, tuple(needs), raw.get("without", "")))
    fusion_with = _optional_str(doc, "fusion_with", where)
    pcie_ipc = []
    for index, raw in enumerate(doc.get("pcie_ipc", [])):
        pwhere = f"{where}: pcie_ipc #{index + 1}"
        if not all(isinstance(raw.get(key), str) and raw[key] for key in ("versions", "with", "name", "switch", "code")):
            raise PatchDataError(f"{pwhere}: needs versions, with, name, switch and code")
        module, _, cls = raw["code"].partition(":")
        if not (all(p.isidentifier() for p in module.split(".")) and cls.isidentifier()):
            raise PatchDataError(f"{pwhere}: code names module:Class, not {raw['code']!r}")
        rows = raw.get("rows")
        if not isinstance(rows, int) or isinstance(rows, bool) or rows <= 0:
            raise PatchDataError(f"{pwhere}: rows is a positive number of tokens")
        if not fusion_with:
            raise PatchDataError(f"{pwhere}: needs fusion_with (the distribution whose release it also depends on)")
        pcie_ipc.append(PcieIpcPath(specifier(raw["versions"], pwhere), specifier(raw["with"], pwhere), raw["name"],
                                    raw["switch"], raw["code"], rows))
    auto_enables, server_gates, kernel_paths, tp_advice, tp_untuned = _fusion_chain(doc, where)
    if (auto_enables or server_gates or kernel_paths or tp_advice) and not paths:
        raise PatchDataError(f"{where}: fusion_chain is for a server (a distribution with fusion_path rows)")
    if paths and not fusion_with:
        raise PatchDataError(f"{where}: fusion_path rows need fusion_with (the distribution whose release they also depend on)")
    checkout = None
    if "checkout" in doc:
        raw = doc["checkout"]
        layout = raw.get("layout", [])
        if not layout or not all(isinstance(pair, list) and len(pair) == 2 for pair in layout):
            raise PatchDataError(f"{where}: checkout.layout must be a list of [installed prefix, repository prefix]")
        checkout = CheckoutLayout(markers=_str_list(raw, "markers", where), layout=tuple(tuple(p) for p in layout),
                                  version_file=_optional_str(raw, "version_file", where))
    raw_verify = doc.get("verify", {})
    includes = raw_verify.get("compile_includes", [])
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise PatchDataError(f"{where}: 'compile_includes' must be a list of strings")
    tuned = raw_verify.get("tuned", {})
    if not isinstance(tuned, dict) or set(tuned) - {"server_args", "device_flags"} or not all(
            isinstance(tuned.get(key, {}), dict) for key in ("server_args", "device_flags")):
        raise PatchDataError(f"{where}: [verify.tuned] holds a server_args table and a device_flags table")
    verify = VerifySpec(**{key: _optional_str(raw_verify, key, where)
                           for key in ("jit_spec", "arch_list", "expect_target", "compile_header")},
                        compile_includes=tuple(includes), tuned_server_args=MappingProxyType(tuned.get("server_args", {})),
                        tuned_device_flags=MappingProxyType(tuned.get("device_flags", {})))
    unknown = set(raw_verify) - {"jit_spec", "arch_list", "expect_target", "compile_header", "compile_includes", "tuned"}
    if unknown:
        raise PatchDataError(f"{where}: unknown verify key(s) {', '.join(sorted(unknown))}")
    fixed_in = _optional_str(doc, "fixed_in", where)
    sets = PatchSets(name, directory, check_rewriters=full, advice=advice)
    if full:
        sets.all()
    return Distribution(
        name=name, option=doc["option"], summary=doc["summary"], sets=sets,
        fixed_in=require_version(fixed_in, where) if fixed_in else None,
        upstream=_optional_str(doc, "upstream", where), sdist_only=_str_list(doc, "sdist_only", where),
        jit_module=_optional_str(doc, "jit_module", where), still_gated=_optional_str(doc, "still_gated", where),
        pins=_optional_str(doc, "pins", where), advice=tuple(advice), nothing_to_patch=tuple(nothing),
        not_covered=tuple(not_covered), fusion_flags=tuple(flags),
        fusion_paths=tuple(paths), fusion_with=fusion_with, pcie_ipc=tuple(pcie_ipc), auto_enables=auto_enables, server_gates=server_gates,
        kernel_paths=kernel_paths, tp_advice=tp_advice, tp_untuned=tp_untuned, checkout=checkout, verify=verify,
        directory=directory,
    )


def _fusion_chain(doc: dict, where: str) -> tuple[tuple[AutoEnable, ...], tuple[ServerGate, ...],
                                                  tuple[KernelPath, ...], str, str]:
    raw = doc.get("fusion_chain", {})
    cwhere = f"{where}: fusion_chain"
    if not isinstance(raw, dict):
        raise PatchDataError(f"{cwhere} is a table")
    unknown = set(raw) - {"auto_enable", "server_gate", "kernel_path", "tp", "untuned"}
    if unknown:
        raise PatchDataError(f"{cwhere}: unknown key(s) {', '.join(sorted(unknown))}")
    autos = []
    for index, row in enumerate(raw.get("auto_enable", [])):
        awhere = f"{cwhere}.auto_enable #{index + 1}"
        if not all(isinstance(row.get(key), str) and row[key] for key in ("versions", "by", "limits")):
            raise PatchDataError(f"{awhere}: needs versions, by (\"release\" or a patch id) and limits")
        autos.append(AutoEnable(specifier(row["versions"], awhere), row["by"], row["limits"]))
    gates = []
    for index, row in enumerate(raw.get("server_gate", [])):
        gwhere = f"{cwhere}.server_gate #{index + 1}"
        if not all(isinstance(row.get(key), str) and row[key] for key in ("versions", "patch", "instead")):
            raise PatchDataError(f"{gwhere}: needs versions, patch and instead")
        gates.append(ServerGate(specifier(row["versions"], gwhere), row["patch"], row["instead"]))
    kernels = []
    for index, row in enumerate(raw.get("kernel_path", [])):
        kwhere = f"{cwhere}.kernel_path #{index + 1}"
        if not all(isinstance(row.get(key), str) and row[key] for key in ("versions", "with", "calls")):
            raise PatchDataError(f"{kwhere}: needs versions, with and calls")
        launch = _str_list(row, "launch", kwhere)
        if launch and not isinstance(row.get("launch_without"), str):
            raise PatchDataError(f"{kwhere}: a path with launch patches says what a launch without them does (launch_without)")
        kernels.append(KernelPath(specifier(row["versions"], kwhere), specifier(row["with"], kwhere), row["calls"],
                                  _str_list(row, "build", kwhere), _str_list(row, "run", kwhere), launch,
                                  row.get("launch_without", "")))
    tp, untuned = raw.get("tp", ""), raw.get("untuned", "")
    if not isinstance(tp, str) or not isinstance(untuned, str):
        raise PatchDataError(f"{cwhere}: tp and untuned are sentences")
    return tuple(autos), tuple(gates), tuple(kernels), tp, untuned


def selectors(directory: Path | None = None) -> list[tuple[str, str]]:
    """(option, name) of every distribution, from its distribution.toml alone: the CLI builds
    its --<option> [VER] selectors from this, so a new distribution needs no code there."""
    directory = directory or data_dir("patches")
    found = []
    for path in sorted(directory.glob("*/distribution.toml")):
        doc = read_toml(path, f"{path.parent.name}/distribution.toml")
        if isinstance(doc.get("option"), str) and isinstance(doc.get("name"), str):
            found.append((doc["option"], doc["name"]))
    return found


def load_registry(directory: Path | None = None, *, full: bool = True) -> Registry:
    """Every distribution under ``patches/`` (or ``directory``), in name order. ``full=False``
    is what the commands read: each patch set when first needed, its rewriters made when they
    run (see :func:`parse_distribution`); ``full`` checks all of the data at once (the tests and
    ``manifest build``/``add``, which write it)."""
    directory = directory or data_dir("patches")
    found = sorted(p.parent for p in directory.glob("*/distribution.toml"))
    if not found:
        raise PatchDataError(f"no distributions under {directory} (patches/<name>/distribution.toml)")
    distributions = tuple(parse_distribution(d, full=full) for d in found)
    options = [d.option for d in distributions]
    if len(set(options)) != len(options):
        raise PatchDataError(f"two distributions share one selector: {options}")
    registry = Registry(distributions)
    if full:
        ids = {d.name: {p.id for ps in d.patch_sets for p in ps.patches} for d in distributions}
        for d in distributions:
            if d.fusion_paths and d.fusion_with not in ids:
                raise PatchDataError(f"{d.name}/distribution.toml: fusion_with names no distribution of sm120patch: "
                                     f"{d.fusion_with}")
            own = ids.get(d.name, set())
            named = [(f"auto_enable #{i + 1}", r.by) for i, r in enumerate(d.auto_enables) if r.by != "release"]
            named += [(f"server_gate #{i + 1}", r.patch) for i, r in enumerate(d.server_gates)]
            for label, patch_id in named:
                if patch_id not in own:
                    raise PatchDataError(f"{d.name}/distribution.toml: fusion_chain.{label} names no patch of {d.name}: "
                                         f"{patch_id}")
            for index, row in enumerate(d.kernel_paths):
                unknown = [i for i in row.build + row.run + row.launch if i not in ids.get(d.fusion_with or "", ())]
                if unknown:
                    raise PatchDataError(f"{d.name}/distribution.toml: fusion_chain.kernel_path #{index + 1} names no patch "
                                         f"of {d.fusion_with}: {', '.join(unknown)}")
            for index, row in enumerate(d.fusion_paths):
                unknown = [f"{owner}:{patch_id}" for owner, patch_id in row.needs if patch_id not in ids.get(owner, ())]
                if unknown:
                    raise PatchDataError(f"{d.name}/distribution.toml: fusion_path #{index + 1} needs no known patch "
                                         f"{', '.join(unknown)}")
    return registry

