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
from typing import Callable, Mapping, NamedTuple, Sequence

from packaging.version import InvalidVersion, Version

from sm120patch import chain, jitcache, signals
from sm120patch.assess import Assessment, assess, present_by_meaning
from sm120patch.distributions import ANY, Registry, load_registry
from sm120patch.environment import Environment, Probe, start_probe
from sm120patch.errors import BuildInterrupted, NewerFormatError, RefusedError, Sm120PatchError, UsageError
from sm120patch.invocation import command
from sm120patch.journal import journal_at, read_journal
from sm120patch.locks import install_locks
from sm120patch.reports import ChangeReport, JitStatus, Left, Result, StatusReport, TreeStatus
from sm120patch.state import Owner, orphans, state_root, temporaries
from sm120patch.transaction import recover
from sm120patch.checkout import CheckoutTree, open_checkout
from sm120patch.fileops import prune
from sm120patch.installed import InstalledTree
from sm120patch.journal import leftover_runs
from sm120patch.plan import plan_apply, plan_revert
from sm120patch.write import Worktree, WriteTarget, preview, write

__all__ = ["ChangeReport", "JitStatus", "Left", "Request", "Result", "StatusReport", "TreeStatus",
           "apply", "build", "diff", "locate", "revert", "status"]


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
    probe: Probe | None = None  # the target's probe, started before the rest of sm120patch was imported


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

@dataclass
class Located:
    env: Environment | None
    trees: list[Worktree] = field(default_factory=list)  # in registry order
    routed: list[tuple[str, Path]] = field(default_factory=list)  # editable installs, to their checkouts
    jit_base: str | None = None  # --jit-cache-base as given: commands suggested for this target keep it
    # The same trees as locate made them: the installs share the environment's locks, journal,
    # JIT cache and one transaction; each checkout has its own lock and commit.
    installed: list[InstalledTree] = field(default_factory=list)
    checkouts: list[CheckoutTree] = field(default_factory=list)

    @property
    def target(self) -> str:
        return str(self.env.executable) if self.env else str(self.trees[0].root)

    @property
    def chosen_by(self) -> str:
        """No --python was given: why this interpreter is the target ("" when it was named)."""
        return self.env.chosen_by if self.env else ""

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

    @property
    def state_dirs(self) -> list[Path]:
        """The install locations whose sm120patch state this run reports and may clean: those of
        the installs it acts on; with none installed (every patched distribution uninstalled),
        each directory on the target's sys.path that still has a state root, so that the state
        of installs that are all gone is shown and removed too, not left forever."""
        dirs = list(dict.fromkeys(t.dist.site_dir for t in self.installed))
        if dirs or self.env is None:
            return dirs
        return [d for d in self.env.search_path if state_root(d).is_dir()]

    def orphans(self) -> list:
        return [o for d in self.state_dirs for o in orphans(d)]


def locate(request: Request, registry: Registry) -> Located:
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
        return Located(None, [tree], checkouts=[tree])
    env = (request.probe or start_probe(request.python, registry.names)).result(registry.wanted_rows)
    located = Located(env, jit_base=request.jit_base)
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
            located.checkouts.append(tree)
        else:
            tree = InstalledTree(env, dist, distribution)
            located.installed.append(tree)
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


def _check_version(tree: Worktree, wanted: str, request: Request, *, python: str | None = None) -> None:
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
    stack.enter_context(install_locks(located.state_dirs, on_wait=request.on_wait))
    for tree in located.checkouts:
        stack.enter_context(tree.lock(request.on_wait))
    return stack


# -- status ----------------------------------------------------------------------------------------

def status(request: Request, registry: Registry | None = None, *, device=None,
           located: Located | None = None) -> StatusReport:
    """``device``: the driver's answers (``driver.DriverFacts``, doctor reads them first), for the
    fusion chain's device step; None: status leaves the driver alone. ``located``: the trees a
    run already found (apply, judging the chain once its change stands: no second probe)."""
    registry = registry or load_registry(full=False)
    located = located or locate(request, registry)
    trees, aot = [], []
    routed = dict(located.routed)
    for tree in located.trees:
        pending, blocks = None, False
        try:
            ledger = tree.read_ledger()
        except NewerFormatError as exc:  # readable, by the newer sm120patch it names
            ledger, pending, blocks = None, exc.message, True
        except Sm120PatchError as exc:
            ledger, pending, blocks = None, f"unreadable ledger ({exc.message})", True
        run = tree.pending(located.command("revert --force"))
        if run[0] is not None:
            pending, blocks = run
        a = assess(tree, tree.distribution, ledger=ledger)
        shown = a.patch_set or tree.distribution.closest_set(tree.version)
        by_meaning = {}
        if shown is not None and (tree.judged_by_meaning or a.patch_set is None) and not (a.not_needed or a.not_covered):
            by_meaning = {p.id: present_by_meaning(tree, p) for p in shown.patches}
        jit = tree.jit_status(request.jit_base, [fa.path for fa in a.files.values()])
        aot += tree.aot_shadows()
        branch, branch_error = None, None
        try:
            branch = tree.branch()
        except Sm120PatchError as exc:  # only the text report shows the branch, so only it fails
            branch_error = exc
        with_version = _fusion_with(located, tree)
        trees.append(TreeStatus(a, pending, blocks, by_meaning=by_meaning, pin=tree.pin_mismatch(), jit=jit,
                                advice=tree.distribution.advice_for(tree.version, a.applied_ids, with_version.version if with_version else None),
                                with_raw_version=with_version.raw_version if with_version else "",
                                routed_from=routed.get(tree.distribution.name), branch=branch,
                                branch_error=branch_error))
    trees = _chains(trees, located, aot, device)
    site_dirs = located.state_dirs
    return StatusReport(located.target, located.env.python_version if located.env else None, trees, aot,
                        chosen_by=located.chosen_by,
                        registry_names=registry.names, apply_command=located.command("apply"),
                        orphans=[o for d in site_dirs for o in orphans(d)],
                        temporaries=[p for d in site_dirs if not journal_at(d).exists() for p in temporaries(d)])


def _chains(trees: list[TreeStatus], located: Located, aot: list, device) -> list[TreeStatus]:
    """Each server's fusion chain, judged once from every assessment of this run (the patches
    applied to it and to the distribution it fuses with, that one's JIT entries)."""
    if located.env is None:
        return trees
    assessed = [t.assessment for t in trees]
    by_name = {t.distribution.name: t for t in trees}
    commands = chain.Commands(apply=located.command("apply"), build=located.command("build"),
                              doctor=located.command("doctor"), bench=located.command("bench"),
                              status=located.command("status"), diff=command("diff", located.options[0]))
    judged = []
    for item in trees:
        d = item.distribution
        if d.fusion_paths:
            kernels = by_name.get(d.fusion_with)
            item = item._replace(chain=chain.evaluate(
                item.assessment, kernels.assessment if kernels else None, located.env.get(d.fusion_with),
                jit=kernels.jit if kernels else None, aot=aot, assessed=assessed, commands=commands, device=device))
        judged.append(item)
    return judged


def _fusion_with(located: Located, tree: Worktree):
    """The installed distribution ``tree``'s fusion depends on (None: none, or not a known one)."""
    other = tree.distribution.fusion_with
    return located.env.get(other) if other and located.env is not None else None


# -- apply, revert, diff ---------------------------------------------------------------------------

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
    import difflib

    ids = sorted({p.id for ps in sets.values() for p in ps.patches if not p.required})
    meant = [next(iter(difflib.get_close_matches(i, ids, n=1)), None) for i in unknown]
    fixed = ([i for i in with_ids if i not in unknown] + meant) if all(meant) else None
    raise UsageError(f"--with {','.join(unknown)}: no such patch (opt-in patches here: {offered or 'none'})",
                     fix=[("--with", ",".join(dict.fromkeys(fixed)))] if fixed else (),
                     hint=f"uses {', '.join(meant)}, the nearest opt-in patch" if fixed else None)


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
    registry = registry or load_registry()
    located = locate(request, registry)
    if not located.trees and (request.dry_run or not located.orphans()):
        raise _nothing_installed(located, registry)
    _selected_ids(located, request.with_ids, registry)
    report = ChangeReport("apply", located.target, dry_run=request.dry_run, routed=located.routed,
                          chosen_by=located.chosen_by)
    with _hold(located, request):
        if request.dry_run:
            _refuse_pending(located)
        else:
            report.recovery = recover(located.state_dirs, revert_command=located.command("revert --force"))
            _clean_leftovers(located, request, report)
        plans = []
        for tree in located.trees:
            a = _assess(tree, force_unknown=request.force)
            if a.patch_set is None:
                if a.nothing_needed:
                    report.results.append(Result(a.name, a.raw_version, tree.words.label, tree.words.kind, message=a.reason))
                    continue
                raise _no_set(a)
            ids = [i for i in request.with_ids if any(p.id == i for p in a.patch_set.patches)]
            plan = plan_apply(a, a.patch_set.select(ids), force=request.force, wheel_dir=request.wheel_dir,
                              download=not request.dry_run)
            if not request.dry_run:
                tree.refuse_unwritable(plan)
            plans.append(plan)
            report.results.append(_planned(plan))
        report.aot = _aot(located)
        if request.dry_run:
            preview(report, _write_target(located, request), plans, operation="apply")
            return report
        write(report, _write_target(located, request), plans, operation="apply")
    if request.build and signals.late() is None:  # after the lock: FlashInfer's own lock guards a build
        try:
            # A build takes minutes: a signal may end it, even after the commit point. Once it
            # is over, signals are only noted again, so that the report is printed whole.
            with signals.interruptible():
                report.builds = _build(located, request)
        except Sm120PatchError as exc:  # the patch stands; the report says so, then the error
            report.build_error = exc
        except signals.Interrupted as exc:
            if signals.STATE.committed is None:  # nothing was written by this run: nothing stands
                raise
            report.build_error = BuildInterrupted(
                f"the build was interrupted ({signals.name(exc.signum)}); the patch stands",
                hint=f"`{located.command('build')}` builds it")
    if located.env is not None:
        # What to do next comes from the whole chain as it now stands (status's own judgement).
        try:
            # The trees this run found (no second probe of the target): with a selector, a chain
            # whose other distribution was left out says that step is not known, and so does next.
            after = status(request, registry, located=located)
        except Sm120PatchError:  # the change stands and is reported; only the advice is missing
            after = None
        report.chains = [t.chain for t in after.trees if t.chain is not None] if after else []
    return report


def build(request: Request, registry: Registry | None = None) -> ChangeReport:
    """``sm120patch build``: warm the JIT cache of an environment that is patched already."""
    registry = registry or load_registry(full=False)
    located = locate(request, registry)
    report = ChangeReport("build", located.target, chosen_by=located.chosen_by)
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


def _write_target(located: Located, request: Request) -> WriteTarget:
    return WriteTarget(located.installed, located.state_dirs, located.command("revert --force"),
                       jit_base=request.jit_base, on_wait=request.on_wait)


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
    registry = registry or load_registry()
    located = locate(request, registry)
    if not located.trees and not located.orphans():  # (with orphans: the revert removes them)
        raise _nothing_installed(located, registry)
    if request.dry_run and located.checkouts:
        raise UsageError("revert --dry-run reads installed environments; in a checkout, sm120patch's change is its "
                         "commit on its own branch", hint="`git log -1 -p` on that branch shows it")
    report = ChangeReport("revert", located.target, dry_run=request.dry_run, routed=located.routed,
                          chosen_by=located.chosen_by)
    with _hold(located, request):
        if request.dry_run:
            _refuse_pending(located)
        else:
            report.recovery = recover(located.state_dirs, force=request.force,
                                      revert_command=located.command("revert --force"))
            _clean_leftovers(located, request, report)
        plans = []
        for tree in located.trees:
            undo = tree.revert_by_record()
            if undo is not None:
                report.results.append(Result(tree.distribution.name, tree.raw_version, tree.words.label, tree.words.kind,
                                             undo=undo))
                continue
            try:
                a = _assess(tree)
                if a.patch_set is None and not a.unknown:  # (a ledger's files are reverted without a set)
                    report.results.append(Result(a.name, a.raw_version, tree.words.label, tree.words.kind, message=a.reason))
                    continue
                plan = plan_revert(a, force=request.force, wheel_dir=request.wheel_dir, download=not request.dry_run)
            except RefusedError as exc:
                report.left.append(Left(tree.distribution.name, tree.raw_version, exc))
                continue
            plans.append(plan)
            report.results.append(_planned(plan))
        report.aot = _aot(located)
        if request.dry_run:
            preview(report, _write_target(located, request), plans, operation="revert")
            return report
        write(report, _write_target(located, request), plans, operation="revert")
    return report


def _clean_leftovers(located: Located, request: Request, report: ChangeReport) -> None:
    """Finish the cleanup of a run killed after its commit point: its stash, and the JIT
    entries it had moved aside (they carry its run id)."""
    import shutil

    runs = {run for site_dir in located.state_dirs for run in leftover_runs(site_dir)}
    for site_dir in located.state_dirs:  # temporaries and empty directories a killed run left
        if not journal_at(site_dir).exists():
            for temporary in temporaries(site_dir):
                temporary.unlink(missing_ok=True)
                report.leftovers_removed.append(temporary)
            prune(state_root(site_dir))
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


def _assess(tree: Worktree, *, force_unknown: bool = False) -> Assessment:
    return assess(tree, tree.distribution, ledger=tree.read_ledger(), force_unknown=force_unknown)


def _aot(located: Located) -> list[jitcache.AotShadow]:
    return [shadow for tree in located.installed for shadow in tree.aot_shadows()]


def _planned(plan) -> Result:
    """A plan's result, with each file's path as a diff names it (the tree says where from)."""
    a = plan.assessment
    # A diff is written from the tree's root: site-packages (`patch -p1` there), or the
    # repository's root (`git apply` there).
    return Result(a.name, a.raw_version, a.tree.words.label, a.tree.words.kind, plan,
                  diff_paths={p.relpath: p.path.relative_to(a.tree.root).as_posix() for p in plan.files})


# -- diff ----------------------------------------------------------------------------------------

def diff(request: Request, registry: Registry | None = None) -> ChangeReport:
    """What apply would write, for every selected distribution: a dry run."""
    return apply(request._replace(dry_run=True), registry)

