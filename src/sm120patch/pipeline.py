"""The one pipeline every command runs, for every kind of tree:

    locate -> select -> (lock) -> recover -> assess -> plan -> (dry run stops here)
           -> write (one transaction | one commit) -> cache -> read back -> report

``status``, ``apply``, ``revert`` and ``diff`` are plain functions of a :class:`Request`; the
CLI only parses, calls one of them and renders what it returns. Judging happens under the
lock: two runs at once behave as if one ran after the other.
"""

from __future__ import annotations

import shlex
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Callable, Mapping, NamedTuple, Sequence

from packaging.version import InvalidVersion, Version

from sm120patch import jitcache, signals
from sm120patch.assess import Assessment, assess, present_by_meaning, status_exit_code
from sm120patch.distributions import ANY, Advice, Distribution, Registry, load_registry
from sm120patch.environment import Environment, start_probe
from sm120patch.errors import ExitCode, RefusedError, Sm120PatchError, UsageError
from sm120patch.fusionpath import FusionVerdict, judge
from sm120patch.hashing import sha256
from sm120patch.invocation import command
from sm120patch.journal import journal_at, read_journal
from sm120patch.locks import LOCK_TIMEOUT_S, flock, install_locks, someone_holds
from sm120patch.state import Orphan, Owner, orphans, state_root, temporaries
from sm120patch.transaction import Change, Recovery, Transaction, recover
from sm120patch.trees import CheckoutTree, InstalledTree, open_checkout

if TYPE_CHECKING:  # planning and git commits are imported by the commands that change things, not by status
    from sm120patch.checkout import Commit, Undo
    from sm120patch.plan import Plan, ReleaseBytes



class Request(NamedTuple):
    python: str | None = None  # the target interpreter (default: the one running sm120patch)
    source: str | None = None  # a git checkout instead of an environment
    selectors: Mapping[str, str] = MappingProxyType({})  # distribution -> asserted version, or ANY
    with_ids: tuple[str, ...] = ()
    force: bool = False
    dry_run: bool = False
    jit_base: str | None = None
    wheel_dir: Path | None = None
    on_wait: Callable[[str], None] | None = None
    build: bool = False  # apply --build: warm FlashInfer's JIT cache after the change
    arch: str | None = None  # --arch: FLASHINFER_CUDA_ARCH_LIST for the build
    on_build_step: Callable[[str, int, int], None] | None = None


def normalize_selector(option: str, value: str) -> str:
    """``v0.6.4`` and ``0.6.4`` name one release; anything that is not a version is refused."""
    if value == ANY:
        return ANY
    text = value.strip()
    text = text[1:] if text[:1] in ("v", "V") else text
    try:
        Version(text)
    except InvalidVersion:
        raise UsageError(f"--{option} {value}: not a version", hint=f"e.g. --{option} 0.6.4, or --{option} alone "
                                                                   "for whatever release is installed") from None
    return text


# -- locate ------------------------------------------------------------------------------------

class Located(NamedTuple):
    env: Environment | None
    trees: list  # InstalledTree | CheckoutTree, in registry order
    routed: list[tuple[str, Path]]  # editable installs, to their checkouts
    jit_base: str | None = None  # --jit-cache-base as given: commands suggested for this target keep it

    @property
    def installed(self) -> list[InstalledTree]:
        return [t for t in self.trees if isinstance(t, InstalledTree)]

    @property
    def checkouts(self) -> list[CheckoutTree]:
        return [t for t in self.trees if isinstance(t, CheckoutTree)]

    @property
    def target(self) -> str:
        return str(self.env.executable) if self.env else str(self.trees[0].root)

    @property
    def options(self) -> tuple[tuple[str, str], ...]:
        """The options that name this target on a command line (and its JIT cache base, when given)."""
        target = ("--python", str(self.env.executable)) if self.env else ("--source", str(self.trees[0].root))
        return (target, *([("--jit-cache-base", self.jit_base)] if self.jit_base else []))

    @property
    def where(self) -> str:
        """:attr:`options`, quoted for a shell."""
        return shlex.join(word for option in self.options for word in option)

    def command(self, words: str) -> str:
        """An sm120patch command for this same target, that works when copied as printed."""
        return command(words, *self.options)


def locate(request: Request, registry: Registry, *, probe=None) -> Located:
    """The trees to act on: a checkout (``--source``), or the selected distributions of the
    target environment (an editable install is its checkout)."""
    named = {registry.get(name).name: version for name, version in request.selectors.items()}
    if request.source:
        tree = open_checkout(request.source, registry)
        other = [n for n in named if n != tree.distribution.name]
        if other:
            raise UsageError(f"--source {request.source} is a {tree.distribution.name} checkout; "
                             f"{registry.get(other[0]).selector} does not apply to it")
        _check_version(tree, named.get(tree.distribution.name, ANY), request)
        return Located(None, [tree], [])
    env = (probe or start_probe(request.python, registry.names)).result(registry.wanted_rows)
    located = Located(env, [], [], jit_base=request.jit_base)
    for distribution in registry:
        if named and distribution.name not in named:
            continue
        dist = env.get(distribution.name)
        if dist is None:
            if distribution.name in named:
                raise UsageError(f"{distribution.name} is not installed in {env.executable}")
            continue
        if dist.raw_version is None:
            raise _no_version(env, dist)
        if dist.editable_source is not None:
            tree = open_checkout(dist.editable_source, registry)
            located.routed.append((distribution.name, dist.editable_source))
        else:
            tree = InstalledTree(env, dist, distribution)
        _check_version(tree, named.get(distribution.name, ANY), request, python=str(env.executable))
        located.trees.append(tree)
    return located


def _no_version(env: Environment, dist) -> RefusedError:
    """METADATA without a Version: field: a damaged install, whose release (so its patch set, its
    manifest, its JIT cache entries) cannot be known."""
    named = dist.dist_info.name[:-len(".dist-info")].rpartition("-")[2]  # <name>-<version>.dist-info
    hint = None
    if named and named[0].isdigit():
        hint = f"reinstall it: `{env.reinstall_command(dist._replace(raw_version=named))}`"
    return RefusedError(f"{dist.name} in {dist.site_dir} has no version: {dist.dist_info / 'METADATA'} has no "
                        "Version: field (a damaged install)", hint=hint)


def _check_version(tree, wanted: str, request: Request, *, python: str | None = None) -> None:
    if wanted == ANY:
        return
    try:
        same = Version(wanted) == Version(tree.raw_version)
    except InvalidVersion:
        same = wanted == tree.raw_version
    if not same:
        option = tree.distribution.selector
        raise UsageError(f"{option} {wanted}: {python or tree.root} has {tree.distribution.name} {tree.raw_version}",
                         fix=[(option, tree.raw_version)], hint="does the same for the installed release")


def _nothing_installed(located: Located, registry: Registry) -> UsageError:
    return UsageError(f"none of {', '.join(registry.names)} is installed in {located.env.executable}",
                      hint="pass --python with the interpreter your server runs")


def _hold(located: Located, request: Request) -> ExitStack:
    """The locks of every tree: an flock on each install location; on each checkout's .git."""
    stack = ExitStack()
    stack.enter_context(install_locks([t.dist.site_dir for t in located.installed], on_wait=request.on_wait))
    for tree in located.checkouts:
        stack.enter_context(flock(Path(tree.repo.git_dir), what="checkout", timeout=LOCK_TIMEOUT_S, on_wait=request.on_wait,
                                  busy=f"another sm120patch is changing {tree.root}", hint="run again when it has finished"))
    return stack


# -- the release's bytes ---------------------------------------------------------------------------

def release_bytes(tree, request: Request, *, download: bool) -> ReleaseBytes | None:
    """Saved originals first, then the release wheel: in --wheel-dir, in sm120patch's wheel
    cache, or (``download``) fetched into that cache. A wheel's file is used only when it
    hashes to what the installed RECORD (or the ledger) expects."""
    if not isinstance(tree, InstalledTree):
        return None
    state = tree.state

    def get(relpath: str, expected: str) -> tuple[bytes, str] | None:
        data = state.saved_original(relpath, expected)
        if data is not None:
            return data, "saved original"
        from sm120patch import wheels

        wheel = wheels.find_wheel(tree.dist.name, tree.raw_version, request.wheel_dir, download=download)
        if wheel is None:
            return None
        try:
            data, listed = wheels.wheel_file(wheel, relpath)
        except Sm120PatchError:
            return None
        return (data, f"release wheel {wheel.name}") if sha256(data) == expected == listed else None

    return get


# -- status ----------------------------------------------------------------------------------------

class JitStatus(NamedTuple):
    base: jitcache.CacheBase
    entries: list[Path]
    stale: list[Path]
    foreign: Mapping[Path, Path]  # entry -> a source of another environment
    asides: list[Path]


class TreeStatus(NamedTuple):
    assessment: Assessment
    pending: str | None = None  # an interrupted run (or one in progress), in words
    pending_blocks: bool = False  # an interrupted run: status exits 3
    by_meaning: Mapping[str, bool] = MappingProxyType({})  # patch id -> present, by its semantic check
    advice: Sequence[Advice] = ()
    pin: str | None = None
    jit: JitStatus | None = None
    routed_from: Path | None = None  # an editable install, shown as its checkout
    fusion: FusionVerdict | None = None  # past the gate, on a GPU without multicast
    with_raw_version: str = ""  # the installed release of the distribution's fusion_with

    def advice_lines(self, *, bench: bool = False) -> list[tuple[str, str]]:
        """(level, sentence) for each piece of advice (``bench``: only what bench prints too)."""
        return [(a.level, a.render(self.assessment.raw_version, self.with_raw_version))
                for a in self.advice if a.bench or not bench]

    @property
    def tree(self):
        return self.assessment.tree

    @property
    def distribution(self) -> Distribution:
        return self.assessment.distribution


class StatusReport(NamedTuple):
    target: str
    python_version: str | None
    trees: list[TreeStatus]
    aot: list[jitcache.AotShadow]
    registry_names: tuple[str, ...] = ()
    apply_command: str = "sm120patch apply"  # for this same target, as it can be copied
    orphans: Sequence[Orphan] = ()  # state of installs that are gone, in the install locations looked at
    temporaries: Sequence[Path] = ()  # files a killed run left in the state roots

    @property
    def exit_code(self) -> ExitCode:
        return status_exit_code([t.assessment.verdict for t in self.trees],
                                interrupted=any(t.pending_blocks for t in self.trees))


def status(request: Request, registry: Registry | None = None, *, probe=None) -> StatusReport:
    """``probe``: the target probe already started (by the CLI, before the rest of sm120patch
    is imported, so that the two overlap: status stays fast)."""
    registry = registry or load_registry(full=False)
    located = locate(request, registry, probe=probe)
    trees, aot = [], []
    routed = dict(located.routed)
    for tree in located.trees:
        installed = isinstance(tree, InstalledTree)
        ledger, pending, blocks = None, None, False
        if installed:
            try:
                ledger = tree.state.read_ledger()
            except Sm120PatchError as exc:
                pending, blocks = f"unreadable ledger ({exc.message})", True
            pending, blocks = _pending(tree, pending, blocks, located.command("revert --force"))
        a = assess(tree, tree.distribution, ledger=ledger)
        shown = a.patch_set or tree.distribution.closest_set(tree.version)
        by_meaning = {}
        if shown is not None and (not installed or a.patch_set is None) and not (a.not_needed or a.not_covered):
            by_meaning = {p.id: present_by_meaning(tree, p) for p in shown.patches}
        pin = jit = None
        if installed:
            pin = _pin_mismatch(located.env, tree)
            if tree.distribution.jit_module:
                jit = _jit_status(tree, a, request)
                aot += jitcache.aot_shadows(located.env, tree.dist, tree.distribution.jit_module)
        with_version = _fusion_with(located, tree)
        trees.append(TreeStatus(a, pending, blocks, by_meaning=by_meaning, pin=pin, jit=jit,
                                advice=tree.distribution.advice_for(tree.version, a.applied_ids, with_version.version if with_version else None),
                                with_raw_version=with_version.raw_version if with_version else "",
                                routed_from=routed.get(tree.distribution.name)))
    trees = _fusion_verdicts(trees, located)
    site_dirs = list(dict.fromkeys(t.dist.site_dir for t in located.installed))
    return StatusReport(located.target, located.env.python_version if located.env else None, trees, aot,
                        registry_names=registry.names, apply_command=located.command("apply"),
                        orphans=[o for d in site_dirs for o in orphans(d)],
                        temporaries=[p for d in site_dirs if not journal_at(d).exists() for p in temporaries(d)])


def _fusion_verdicts(trees: list[TreeStatus], located: Located) -> list[TreeStatus]:
    """Each server's path past the gate, judged with the patches applied to it and to the
    distribution it fuses with (when that one is assessed in this run too)."""
    if located.env is None:
        return trees
    applied = {t.distribution.name: t.assessment.applied_ids for t in trees}
    judged = []
    for item in trees:
        d = item.distribution
        if d.fusion_paths:
            item = item._replace(fusion=judge(d, item.assessment.raw_version, item.tree.version,
                                              located.env.get(d.fusion_with), applied, target=located.where))
        judged.append(item)
    return judged


def _pending(tree: InstalledTree, pending: str | None, blocks: bool, revert_command: str) -> tuple[str | None, bool]:
    site_dir = tree.dist.site_dir
    try:
        journal = read_journal(journal_at(site_dir), revert_command=revert_command)
    except Sm120PatchError as exc:
        return exc.message, True  # in its own words: unreadable, or not even readable by this user
    if journal is None:
        return pending, blocks
    running = someone_holds(site_dir)
    return journal.describe(running=running), not running


def _fusion_with(located: Located, tree):
    """The installed distribution ``tree``'s fusion depends on (None: none, or not a known one)."""
    other = tree.distribution.fusion_with
    return located.env.get(other) if other and located.env is not None else None


def _pin_mismatch(env: Environment, tree: InstalledTree) -> str | None:
    other = tree.distribution.pins
    if not other or env.get(other) is None:
        return None
    pinned = tree.dist.pinned_version_of(other)
    installed = env.get(other).raw_version
    if pinned and pinned != installed:
        return f"{tree.dist.name} {tree.raw_version} pins {other}=={pinned}; {installed} is installed"
    return None


def _jit_status(tree: InstalledTree, a: Assessment, request: Request) -> JitStatus:
    module = tree.distribution.jit_module
    base = jitcache.cache_base(request.jit_base, owner=tree.owner)
    entries = jitcache.entries(tree.raw_version, base.path, module)
    sources = [fa.path for fa in a.files.values()]
    foreign = {}
    for entry in entries:
        other = jitcache.foreign_entry(entry, tree.dist.site_dir)
        if other is not None:
            foreign[entry] = other
    return JitStatus(base, entries, stale=[e for e in entries if jitcache.is_stale(e, sources)], foreign=foreign,
                     asides=jitcache.asides(tree.raw_version, base.path, module))


# -- apply, revert, diff ---------------------------------------------------------------------------

@dataclass
class Result:
    name: str
    version: str
    label: str
    kind: str  # environment / checkout
    plan: Plan | None = None
    message: str = ""  # why there is nothing to do
    commit: Commit | None = None
    undo: Undo | None = None


@dataclass
class Left:
    """A distribution revert could not do (the others were done)."""

    name: str
    version: str
    error: Sm120PatchError


@dataclass
class ChangeReport:
    operation: str  # apply / revert
    target: str
    dry_run: bool = False
    results: list[Result] = field(default_factory=list)
    left: list[Left] = field(default_factory=list)
    recovery: Recovery | None = None
    jit_removed: list[Path] = field(default_factory=list)
    jit_base: jitcache.CacheBase | None = None  # set when a JIT module's sources were looked at
    jit_sources_changed: bool = False
    aot: list[jitcache.AotShadow] = field(default_factory=list)
    routed: list[tuple[str, Path]] = field(default_factory=list)
    leftovers_removed: list[Path] = field(default_factory=list)
    orphans_removed: list[Orphan] = field(default_factory=list)  # state of installs that are gone
    builds: list = field(default_factory=list)  # jitbuild.BuildResult, apply --build
    build_error: Sm120PatchError | None = None  # apply --build: the change was made, the build failed

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode.REFUSED if self.left else ExitCode.OK

    @property
    def changed(self) -> bool:
        return bool(self.jit_removed or self.leftovers_removed or self.orphans_removed or self.recovery or any(b.compiled for b in self.builds)
                    or any((r.plan and not r.plan.empty) or r.commit or (r.undo and r.undo.changed)
                           for r in self.results))


def _selected_ids(located: Located, with_ids: Sequence[str], registry: Registry) -> None:
    """Every --with id must be a patch of some selected distribution's pinned set; one of a
    distribution installed here but left out by the selectors is named, with the selector that
    takes it in."""
    if not with_ids:
        return
    sets = {}
    for tree in located.trees:
        patch_set = tree.distribution.find(tree.version) or tree.distribution.closest_set(tree.version)
        if patch_set is not None:
            sets[tree.distribution.name] = patch_set
    unknown = [i for i in with_ids if not any(p.id == i for ps in sets.values() for p in ps.patches)]
    if not unknown:
        return
    for distribution in registry:
        dist = located.env.get(distribution.name) if located.env else None
        if distribution.name in sets or dist is None:
            continue
        patch_set = distribution.find(dist.version) or distribution.closest_set(dist.version)
        theirs = [i for i in unknown if patch_set is not None and any(p.id == i for p in patch_set.patches)]
        if theirs:
            raise UsageError(f"--with {','.join(theirs)}: a patch of {distribution.name} {dist.raw_version}, which the "
                             f"selectors leave out ({', '.join(registry.get(n).selector for n in sets) or 'none'})",
                             fix=[(distribution.selector, None)], hint=f"takes {distribution.name} in")
    offered = "; ".join(f"{name}: {', '.join(sorted(ps.opt_in)) or 'none'}" for name, ps in sets.items())
    raise UsageError(f"--with {','.join(unknown)}: no such patch (opt-in patches here: {offered or 'none'})")


def _no_set(a: Assessment) -> RefusedError:
    if a.not_covered:
        return RefusedError(a.reason, hint="use a release `sm120patch list` shows")
    closest = a.distribution.closest_set(a.tree.version)
    return RefusedError(
        a.reason,
        hint="use a release `sm120patch list` shows, or wait for an sm120patch that knows this one"
        + (f"; `--force` applies the closest set ({closest.name}) by meaning, prints the diff and records the result "
           "as unpinned" if closest else ""),
    )


def apply(request: Request, registry: Registry | None = None) -> ChangeReport:
    from sm120patch.checkout import refuse_dirty
    from sm120patch.plan import plan_apply

    registry = registry or load_registry()
    located = locate(request, registry)
    if not located.trees:
        raise _nothing_installed(located, registry)
    _selected_ids(located, request.with_ids, registry)
    report = ChangeReport("apply", located.target, dry_run=request.dry_run, routed=located.routed)
    with _hold(located, request):
        if request.dry_run:
            _refuse_pending(located)
        else:
            report.recovery = recover([t.dist.site_dir for t in located.installed],
                                      revert_command=located.command("revert --force"))
            _clean_leftovers(located, request, report)
        plans = []
        for tree in located.trees:
            a = _assess(tree, force_unknown=request.force)
            if a.patch_set is None:
                if a.nothing_needed:
                    report.results.append(Result(a.name, a.raw_version, tree.label, tree.kind, message=a.reason))
                    continue
                raise _no_set(a)
            ids = [i for i in request.with_ids if any(p.id == i for p in a.patch_set.patches)]
            plan = plan_apply(a, a.patch_set.select(ids), force=request.force,
                              release=release_bytes(tree, request, download=not request.dry_run))
            if isinstance(tree, CheckoutTree) and plan.files and not request.dry_run:
                refuse_dirty(tree)
            plans.append(plan)
            report.results.append(Result(a.name, a.raw_version, tree.label, tree.kind, plan))
        report.aot = _aot(located)
        if request.dry_run:
            return report
        _write(report, located, plans, request, operation="apply")
    signals.resume()  # the write and its cleanup are over: a build (minutes) can be interrupted
    if request.build and signals.late() is None:  # after the lock: FlashInfer's own lock guards a build
        try:
            report.builds = _build(located, request)
        except Sm120PatchError as exc:  # the patch stands; the report says so, then the error
            report.build_error = exc
    return report


def build(request: Request, registry: Registry | None = None) -> ChangeReport:
    """``sm120patch build``: warm the JIT cache of an environment that is patched already."""
    registry = registry or load_registry(full=False)
    located = locate(request, registry)
    report = ChangeReport("build", located.target)
    for tree in located.installed:
        if not tree.distribution.jit_module:
            continue
        a = _assess(tree)
        if not a.verdict.done:
            raise RefusedError(f"{a.name} {a.raw_version} is {a.verdict.value}: its JIT module would be built from "
                               "sources that are not patched", hint=f"run `{located.command('apply --build')}`")
    report.builds = _build(located, request)
    if not report.builds:
        raise UsageError(f"nothing to build in {located.target}: no installed distribution has a JIT module "
                         "sm120patch patches")
    return report


def _build(located: Located, request: Request) -> list:
    from sm120patch import jitbuild

    results = []
    for tree in located.installed:
        spec, module = tree.distribution.verify.jit_spec, tree.distribution.jit_module
        if not spec or not module:
            continue
        base = jitcache.cache_base(request.jit_base, owner=tree.owner)
        owner = Owner.of(base.path) if base.path.exists() else tree.owner
        results.append(jitbuild.build(located.env.executable, spec=spec, module=module, base=base.path,
                                      arch=request.arch, owner=owner, progress=request.on_build_step))
    return results


def revert(request: Request, registry: Registry | None = None) -> ChangeReport:
    from sm120patch.checkout import revert_checkout
    from sm120patch.plan import plan_revert

    registry = registry or load_registry()
    located = locate(request, registry)
    if not located.trees:
        raise _nothing_installed(located, registry)
    report = ChangeReport("revert", located.target, routed=located.routed)
    with _hold(located, request):
        report.recovery = recover([t.dist.site_dir for t in located.installed], force=request.force,
                                  revert_command=located.command("revert --force"))
        _clean_leftovers(located, request, report)
        plans = []
        for tree in located.trees:
            if isinstance(tree, CheckoutTree):
                report.results.append(Result(tree.distribution.name, tree.raw_version, tree.label, tree.kind,
                                             undo=revert_checkout(tree)))
                continue
            try:
                a = _assess(tree)
                if a.patch_set is None:
                    report.results.append(Result(a.name, a.raw_version, tree.label, tree.kind, message=a.reason))
                    continue
                plan = plan_revert(a, force=request.force, release=release_bytes(tree, request, download=True))
            except RefusedError as exc:
                report.left.append(Left(tree.distribution.name, tree.raw_version, exc))
                continue
            plans.append(plan)
            report.results.append(Result(a.name, a.raw_version, tree.label, tree.kind, plan))
        report.aot = _aot(located)
        _write(report, located, plans, request, operation="revert")
    return report


def _clean_leftovers(located: Located, request: Request, report: ChangeReport) -> None:
    """Finish the cleanup of a run killed after its commit point: its stash, and the JIT
    entries it had moved aside (they carry its run id)."""
    import shutil

    from sm120patch.fileops import prune
    from sm120patch.journal import leftover_runs

    runs = {run for tree in located.installed for run in leftover_runs(tree.dist.site_dir)}
    for tree in located.installed:  # temporaries and empty directories a killed run left
        if not journal_at(tree.dist.site_dir).exists():
            for temporary in temporaries(tree.dist.site_dir):
                temporary.unlink(missing_ok=True)
                report.leftovers_removed.append(temporary)
            prune(state_root(tree.dist.site_dir))
    if not runs:
        return
    ids = {run.name for run in runs}
    for tree in located.installed:
        module = tree.distribution.jit_module
        if module:
            base = jitcache.cache_base(request.jit_base, owner=tree.owner)
            for aside in jitcache.asides(tree.raw_version, base.path, module):
                if aside.name.rsplit("-", 1)[-1] in ids:
                    shutil.rmtree(aside, ignore_errors=True)
                    report.leftovers_removed.append(aside)
    for run in sorted(runs):
        shutil.rmtree(run, ignore_errors=True)
        report.leftovers_removed.append(run)
        prune(run.parent.parent)


def _refuse_pending(located: Located) -> None:
    """A dry run changes nothing, so it cannot roll back an interrupted run first: it says so."""
    for tree in located.installed:
        journal = read_journal(journal_at(tree.dist.site_dir), revert_command=located.command("revert --force"))
        if journal is not None:
            raise RefusedError(f"an interrupted {journal.operation} is pending in {tree.dist.site_dir}; "
                               "a dry run would describe a half-changed environment",
                               hint=f"`{located.command('apply')}` rolls it back first")


def _assess(tree, *, force_unknown: bool = False) -> Assessment:
    ledger = tree.state.read_ledger() if isinstance(tree, InstalledTree) else None
    return assess(tree, tree.distribution, ledger=ledger, force_unknown=force_unknown)


def _aot(located: Located) -> list[jitcache.AotShadow]:
    return [shadow for tree in located.installed if tree.distribution.jit_module
            for shadow in jitcache.aot_shadows(located.env, tree.dist, tree.distribution.jit_module)]


def _write(report: ChangeReport, located: Located, plans: list[Plan], request: Request, *, operation: str) -> None:
    """Checkouts: one commit each (a commit rolls itself back on failure). Installs: one
    transaction over every distribution, with FlashInfer's stale JIT entries moved aside under
    FlashInfer's own lock. When the transaction fails after a commit, the commit is undone."""
    from sm120patch.checkout import commit_plan, revert_checkout

    commits = []
    for plan in plans:
        tree = plan.assessment.tree
        if isinstance(tree, CheckoutTree) and plan.files:
            commit = commit_plan(tree, plan)
            commits.append(tree)
            next(r for r in report.results if r.plan is plan).commit = commit
    installed = [p for p in plans if isinstance(p.assessment.tree, InstalledTree)]
    if not located.installed:
        return
    try:
        with ExitStack() as locks:
            changes, roots, owners = [], [], {}
            for tree in located.installed:
                root = state_root(tree.dist.site_dir)
                if root not in roots:
                    roots.append(root)
                    owners[root] = tree.owner
            # Stale JIT entries first: moved aside before any source changes, so no server
            # can load an entry built from sources that are about to change.
            for tree in located.installed:
                changes += _jit_changes(tree, installed, request, report, locks, roots[0])
            for plan in installed:
                changes += _changes(plan, operation)
            changes += _orphan_changes(located, report)
            if not changes:
                return
            Transaction(operation, roots, owners, changes,
                        revert_command=located.command("revert --force")).run_all()
    except BaseException:
        for tree in commits:
            revert_checkout(tree)
        raise


def _orphan_changes(located: Located, report: ChangeReport) -> list[Change]:
    """The state of installs that are gone (uninstalled, or another version now), removed in the
    same transaction: a full revert then leaves no .sm120patch/ behind."""
    changes = []
    for site_dir in dict.fromkeys(t.dist.site_dir for t in located.installed):
        for orphan in orphans(site_dir):
            report.orphans_removed.append(orphan)
            changes += [Change("remove", path, state_root(site_dir), label=f"state of {orphan.name}")
                        for path in orphan.files]
    return changes


def _changes(plan: Plan, operation: str) -> list[Change]:
    tree: InstalledTree = plan.assessment.tree
    state, owner = tree.state, tree.owner
    root = state.root.parent
    changes = []
    for planned in plan.files:
        if operation == "apply" and planned.original is not None and state.saved_original(
                planned.relpath, sha256(planned.original)) is None:
            if planned.replaces_link is None and planned.current == planned.original:
                # The file being replaced is the original: keep its inode (a hard link, no new space).
                changes.append(Change("restore", state.original(planned.relpath), root, source=planned.path,
                                      owner=owner, label=f"original of {planned.relpath}"))
            else:
                changes.append(Change("write", state.original(planned.relpath), root, data=planned.original,
                                      owner=owner, label=f"original of {planned.relpath}"))
        if planned.relink is not None:
            changes.append(Change("symlink", planned.path, root, target=planned.relink, label=planned.relpath))
        elif planned.restore_from == "saved original":
            changes.append(Change("restore", planned.path, root, source=state.original(planned.relpath),
                                  label=planned.relpath))
        else:
            changes.append(Change("write", planned.path, root, data=planned.data, owner=owner, label=planned.relpath))
        if operation == "revert" and state.original(planned.relpath).exists():
            # Journaled like every other change: a kill never leaves a ledger-less original.
            changes.append(Change("remove", state.original(planned.relpath), root,
                                  label=f"original of {planned.relpath}"))
    if plan.ledger_changes:
        if plan.ledger is not None:
            changes.append(Change("write", state.ledger_path, root, data=plan.ledger.to_bytes(), owner=owner,
                                  label=f"{plan.assessment.name} ledger"))
        elif state.ledger_path.exists():
            changes.append(Change("remove", state.ledger_path, root, label=f"{plan.assessment.name} ledger"))
            # With the ledger, every original it kept goes (a reinstall put the release's bytes back
            # without sm120patch: nothing to restore, but the state is still there).
            removed = {c.path for c in changes}
            changes += [Change("remove", path, root, label=f"original {path.relative_to(state.root / 'originals')}")
                        for path in state.files() if path != state.ledger_path and path not in removed]
    return changes


def _jit_changes(tree: InstalledTree, plans: list[Plan], request: Request, report: ChangeReport,
                 locks: ExitStack, root: Path) -> list[Change]:
    """Move aside the module's entries of this version: all of them when its sources change;
    otherwise those older than the sources (a run killed after its files changed, an entry
    built under another base and copied)."""
    module = tree.distribution.jit_module
    plan = next((p for p in plans if p.assessment.tree is tree), None)
    if not module or plan is None:
        return []
    base = jitcache.cache_base(request.jit_base, owner=tree.owner)
    report.jit_base = base
    report.jit_sources_changed = report.jit_sources_changed or bool(plan.files)
    entries = jitcache.entries(tree.raw_version, base.path, module)
    if not plan.files:
        sources = [fa.path for fa in plan.assessment.files.values()]
        entries = [e for e in entries if jitcache.is_stale(e, sources)]
    if not entries:
        return []
    locks.enter_context(jitcache.module_locks(entries, module, owner=Owner.of(base.path), on_wait=request.on_wait))
    report.jit_removed += entries
    return [Change("aside", entry, root, label=f"JIT entry {entry}") for entry in entries]


# -- diff ----------------------------------------------------------------------------------------

def diff(request: Request, registry: Registry | None = None) -> ChangeReport:
    """What apply would write, for every selected distribution: a dry run."""
    return apply(request._replace(dry_run=True), registry)


def diff_label(result: Result, planned) -> str:
    """Paths from the package root (site-packages) for an install, from the repository root
    for a checkout: `patch -p1` and `git apply` accept either where it was made."""
    tree = result.plan.assessment.tree
    return planned.relpath if result.kind == "environment" else tree.repo_path(planned.relpath)


