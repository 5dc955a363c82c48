"""The pipeline's changing commands, ``apply``, ``revert``, ``build`` and ``diff``: after
locate (pipeline), the locks, the recovery of an interrupted run, assess, plan, the dry run's
stop, the write step, the JIT build, and the report. ``status`` (pipeline) imports none of this."""

from __future__ import annotations

import difflib
import os
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Sequence

from sm120patch import decisions, dirfd, driver, jitbuild, jitcache, signals, tunedlimits
from sm120patch.assess import Assessment, assess
from sm120patch.distributions import Registry, load_registry
from sm120patch.errors import (BuildInterrupted, NewerFormatError, RefusedError, Sm120PatchError, TunedCodeError,
                               UsageError)
from sm120patch.fileops import prune
from sm120patch.invocation import command
from sm120patch.journal import journal_at, leftover_runs, read_journal
from sm120patch.locks import install_locks
from sm120patch.pipeline import Located, Request, locate, status
from sm120patch.plan import Plan, plan_apply, plan_revert
from sm120patch.reports import ChangeReport, Left, Result
from sm120patch.state import Owner, state_root, temporaries
from sm120patch.transaction import recover
from sm120patch.write import Worktree, WriteTarget, preview, write

__all__ = ["apply", "build", "diff", "revert"]

TUNED = tunedlimits.PATCH_ID


def _nothing_installed(located: Located, registry: Registry, request: Request) -> UsageError:
    # Given --python, the user named an interpreter: the hint says it is the wrong one, not "pass --python".
    hint = ("that interpreter is not your server's: --python names the one your server runs" if request.python
            else "pass --python with the interpreter your server runs")
    return UsageError(f"none of {', '.join(registry.names)} is installed in {located.env.executable}", hint=hint)


def _hold(located: Located, request: Request) -> ExitStack:
    """The locks of every tree: an flock on each install location; on each checkout's .git."""
    stack = ExitStack()
    stack.enter_context(install_locks(located.state_dirs, on_wait=request.on_wait))
    for tree in located.checkouts:
        stack.enter_context(tree.lock(request.on_wait))
    return stack



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
    # The sets of the installed releases only, each rewriter made when it runs: reading and
    # checking every set of every distribution (and importing libcst for a revert, which runs
    # none) took a fifth of a small apply's time and 60 % of a revert's. The shipped data's own
    # checks (every set, every rewriter, the names across distributions) are the tests' and
    # `manifest build`'s.
    registry = registry or load_registry(full=False)
    located = locate(request, registry)
    if not located.trees and (request.dry_run or not located.orphans()):
        raise _nothing_installed(located, registry, request)
    _selected_ids(located, request.with_ids, registry)
    if request.build and not request.dry_run:  # before the first write: a build that cannot run refuses the apply
        _check_build(located, request)
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
        _write_or_preview(report, located, request, plans, operation="apply")
        if request.dry_run:
            return report
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
    if TUNED in request.with_ids:
        report.tuned_brought = _brought(located)
    return report


def _brought(located: Located) -> list[tuple[str, str, str]]:
    """What `--with tuned-limits` applied besides itself, per server (the patches it requires, from
    the patch data): (server, patch id, its summary)."""
    brought = []
    for tree in located.trees:
        patch_set = tree.distribution.find(tree.version) if tree.version is not None else None
        if patch_set is None or not any(p.id == TUNED for p in patch_set.patches):
            continue
        for required in patch_set.patch(TUNED).requires:
            patch = patch_set.patch(required)
            if not patch.required:
                brought.append((f"{tree.distribution.name} {tree.raw_version}", patch.id, patch.summary))
    return brought


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
                               "sources that are not patched", hint=f"run `{_apply_and_build(located, request)}`")
    _check_build(located, request)
    report.builds = _build(located, request)
    if not report.builds:
        raise UsageError(f"nothing to build in {located.target}: no installed distribution has a JIT module "
                         "sm120patch patches")
    return report


def _check_build(located: Located, request: Request) -> None:
    """What the build needs (torch, ninja, nvcc, an arch), checked before anything is written or
    announced: a build that cannot run is refused in one line, changing nothing."""
    for tree in located.installed:
        if tree.distribution.verify.jit_spec and tree.distribution.jit_module:
            given = request.arch or os.environ.get("FLASHINFER_CUDA_ARCH_LIST")
            jitbuild.check_build(located.env.executable, tree.distribution.jit_module, request.arch,
                                 gpus=0 if given else len(driver.query().devices))


def _apply_and_build(located: Located, request: Request) -> str:
    """`apply --build` for this target, with the --arch given to build (on an image build without
    a GPU, a build without it would be for no GPU)."""
    return command("apply --build", *located.options, *((("--arch", request.arch),) if request.arch else ()))


def _write_target(located: Located, request: Request, report: ChangeReport | None = None,
                  plans: Sequence[Plan] = ()) -> WriteTarget:
    check = None
    if report is not None and located.env is not None and TUNED in request.with_ids:
        check = partial(tuned_check, located, plans, report)
    return WriteTarget(located.installed, located.state_dirs, located.command("revert --force"),
                       jit_base=request.jit_base, on_wait=request.on_wait, check=check)


def tuned_check(located: Located, plans: Sequence[Plan], report: ChangeReport) -> None:
    """`apply --with tuned-limits`, once the files are written and before the commit point: the
    server's own decision code under the profile (verify --tuned), in the target interpreter. Code
    that raises or does not import refuses the apply, and the transaction rolls it back; the
    results land in the report (a check that could not run there says why, and the apply stands)."""
    servers = [p for p in plans if p.assessment.patch_set is not None and p.assessment.tree in located.installed
               and any(patch.id == TUNED for patch in p.assessment.patch_set.patches)]
    if not servers:
        return
    profile = tunedlimits.read({t.distribution.name: t.raw_version for t in located.trees})
    report.tuned_profile = profile
    for plan in servers:
        a = plan.assessment
        found = decisions.tuned_checks_for(Path(located.target), f"{a.name} {a.raw_version}", a.distribution,
                                        a.patch_set, profile)
        report.tuned += found
        broken = next((r for r in found if r.broken), None)
        if broken is not None:
            raise TunedCodeError(f"refused: {broken.subject}: {broken.detail}; rolled back, the environment is as it was",
                                 hint=f"`{located.command('apply')}` applies the rest without tuned-limits")


def _build(located: Located, request: Request) -> list:
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
    registry = registry or load_registry(full=False)  # as apply reads it
    located = locate(request, registry)
    if not located.trees and not located.orphans():  # (with orphans: the revert removes them)
        raise _nothing_installed(located, registry, request)
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
            undo = tree.revert_by_record(dry_run=request.dry_run)
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
            except NewerFormatError:  # a record this sm120patch misreads: the whole run stops, nothing changes
                raise
            except RefusedError as exc:
                report.left.append(Left(tree.distribution.name, tree.raw_version, exc))
                continue
            plans.append(plan)
            report.results.append(_planned(plan))
        _write_or_preview(report, located, request, plans, operation="revert")
    return report


def _write_or_preview(report: ChangeReport, located: Located, request: Request, plans: list[Plan], *,
                      operation: str) -> None:
    """The plans written as one unit, or (a dry run) shown: the same target either way, so that a
    dry run refuses what the run would refuse."""
    report.aot = _aot(located)
    (preview if request.dry_run else write)(report, _write_target(located, request, report, plans), plans,
                                            operation=operation)


def _clean_leftovers(located: Located, request: Request, report: ChangeReport) -> None:
    """Finish the cleanup of a run killed after its commit point: its stash, and the JIT
    entries it had moved aside (they carry its run id)."""
    runs = {run for site_dir in located.state_dirs for run in leftover_runs(site_dir)}
    for site_dir in located.state_dirs:  # temporaries and empty directories a killed run left
        if not journal_at(site_dir).exists():
            for temporary in temporaries(site_dir):
                dirfd.unlink(temporary, missing_ok=True)
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
                    dirfd.rmtree(aside)
                    report.leftovers_removed.append(aside)
    for run in sorted(runs):
        dirfd.rmtree(run)
        report.leftovers_removed.append(run)
        prune(run.parent.parent)


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
