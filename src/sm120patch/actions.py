"""The three user-facing operations as plain functions (the CLI only parses and renders):
locate -> select patch set -> plan -> transaction -> cache invalidation -> verify -> report."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from sm120patch import jitcache
from sm120patch.environment import FLASHINFER, PATCHABLE, TargetEnvironment
from sm120patch.errors import RefusedError, UsageError
from sm120patch.patchsets import Catalog
from sm120patch.state import read_journal
from sm120patch.plan import DistributionAssessment, Plan, assess, plan_apply, plan_revert, sha256

if TYPE_CHECKING:
    from sm120patch.transaction import Recovery


@dataclass
class DistributionStatus:
    assessment: DistributionAssessment
    pending_journal: str | None = None  # operation of an interrupted transaction, if any


@dataclass
class StatusReport:
    env: TargetEnvironment
    distributions: list[DistributionStatus]
    jit_base: Path
    jit_entries: list[Path]
    stale_jit: list[Path]
    aot: list[jitcache.AotShadow]
    pin_mismatch: str | None = None


def collect_status(env: TargetEnvironment, catalog: Catalog, *, jit_base: Path) -> StatusReport:
    statuses = []
    for name in PATCHABLE:
        dist = env.get(name)
        if dist is None:
            continue
        assessment = assess(env, dist, catalog)
        pending = None
        if assessment.patch_set is not None:
            try:
                journal = read_journal(assessment.state)
                pending = journal["operation"] if journal else None
            except Exception as exc:  # a corrupt journal is itself something to report
                pending = f"unreadable journal ({getattr(exc, 'message', exc)})"
        statuses.append(DistributionStatus(assessment, pending))
    flashinfer = env.get(FLASHINFER)
    entries = jitcache.entries(flashinfer.raw_version, jit_base) if flashinfer else []
    sources = [fa.path for s in statuses if s.assessment.dist.name == FLASHINFER for fa in s.assessment.files.values()]
    stale = [entry for entry in entries if jitcache.is_stale(entry, sources)]
    return StatusReport(env, statuses, jit_base, entries, stale, jitcache.aot_shadows(env), _pin_mismatch(env))


def _pin_mismatch(env: TargetEnvironment) -> str | None:
    sglang, flashinfer = env.get("sglang"), env.get(FLASHINFER)
    if not (sglang and flashinfer):
        return None
    pinned = sglang.pinned_version_of(FLASHINFER)
    if pinned and pinned != flashinfer.raw_version:
        return f"sglang {sglang.raw_version} pins flashinfer-python=={pinned}; {flashinfer.raw_version} is installed"
    return None


@dataclass
class DistributionResult:
    name: str
    version: str
    plan: Plan | None
    recovery: Recovery | None = None
    message: str = ""


@dataclass
class ChangeReport:
    operation: str  # "apply" or "revert"
    env: TargetEnvironment
    results: list[DistributionResult] = field(default_factory=list)
    jit_removed: list[Path] = field(default_factory=list)
    aot: list[jitcache.AotShadow] = field(default_factory=list)
    dry_run: bool = False


def installed_targets(env: TargetEnvironment, selectors: dict[str, str | bool | None], *,
                      skip: set[str] = frozenset()) -> list[str]:
    named = {name for name, value in selectors.items() if value}
    return [n for n in PATCHABLE if env.get(n) and n not in skip and (not named or n in named)]


def _targets(env: TargetEnvironment, selectors: dict[str, str | bool | None], *,
             skip: set[str] = frozenset()) -> list[tuple[str, str | None]]:
    """Which distributions to act on: the named ones (checking an asserted version), else all found."""
    named = {name: value for name, value in selectors.items() if value}
    chosen = []
    for name in PATCHABLE:
        if (named and name not in named) or name in skip:
            continue
        dist = env.get(name)
        wanted = named.get(name)
        if dist is None:
            if wanted:
                raise UsageError(f"{name} is not installed in {env.executable}")
            continue
        if isinstance(wanted, str) and wanted != dist.raw_version:
            raise UsageError(
                f"--{name.split('-')[0]} {wanted}: {env.executable} has {name} {dist.raw_version}",
                hint=f"run `sm120patch apply --{name.split('-')[0]} {dist.raw_version}` to patch the installed release",
            )
        chosen.append((name, wanted if isinstance(wanted, str) else None))
    if not chosen:
        raise UsageError(f"neither flashinfer-python nor sglang is installed in {env.executable}")
    return chosen


def editable_sources(env: TargetEnvironment, selectors: dict[str, str | bool | None]) -> list[tuple[str, Path]]:
    """Selected distributions installed in editable mode, with their source trees: those are
    patched as a commit there, not in site-packages."""
    from urllib.parse import unquote, urlparse

    named = {name for name, value in selectors.items() if value}
    found = []
    for name in PATCHABLE:
        dist = env.get(name)
        if dist is not None and dist.editable and (not named or name in named):
            found.append((name, Path(unquote(urlparse(dist.direct_url["url"]).path))))
    return found


def run_apply(
    env: TargetEnvironment,
    catalog: Catalog,
    *,
    selectors: dict[str, str | None],
    skip: set[str] = frozenset(),
    with_ids: Sequence[str] = (),
    force: bool = False,
    dry_run: bool = False,
    jit_base: Path,
    on_wait: Callable[[str], None] | None = None,
) -> ChangeReport:
    report = ChangeReport("apply", env, dry_run=dry_run, aot=jitcache.aot_shadows(env))
    targets = _targets(env, selectors, skip=skip)
    unknown = set(with_ids) - {p.id for n, _ in targets for ps in catalog.for_distribution(n) for p in ps.patches}
    if unknown:
        raise UsageError(f"--with {','.join(sorted(unknown))}: no such patch for {', '.join(n for n, _ in targets)}")
    work = []
    for name, _ in targets:
        assessment = assess(env, env.get(name), catalog, force_unknown=force)
        if assessment.patch_set is None:
            if assessment.fixed_upstream:
                report.results.append(DistributionResult(name, assessment.dist.raw_version, None, message=assessment.reason))
                continue
            closest = catalog.closest_set(name, assessment.dist.version)
            raise RefusedError(
                assessment.reason,
                hint="use a release `sm120patch list` shows, or wait for an sm120patch that knows this one"
                + (f"; `--force` applies the closest set ({closest.source.name}) by meaning, prints the diff and "
                   "records the result as unpinned" if closest else ""),
            )
        ids = [i for i in with_ids if any(p.id == i for p in assessment.patch_set.patches)]
        work.append((assessment, assessment.patch_set.select(ids)))
    selected_by_name = {a.dist.name: selected for a, selected in work}
    if dry_run:
        for assessment, selected in work:
            plan = plan_apply(assessment, selected, force=force)
            report.results.append(DistributionResult(assessment.dist.name, assessment.dist.raw_version, plan))
        return report
    if work:
        report.results += _change(env, catalog, [a for a, _ in work], operation="apply", jit_base=jit_base,
                                  planner=lambda a: plan_apply(a, selected_by_name[a.dist.name], force=force),
                                  on_wait=on_wait, report=report)
    return report


def run_revert(
    env: TargetEnvironment,
    catalog: Catalog,
    *,
    selectors: dict[str, bool],
    force: bool = False,
    jit_base: Path,
    on_wait: Callable[[str], None] | None = None,
) -> ChangeReport:
    report = ChangeReport("revert", env, aot=jitcache.aot_shadows(env))
    assessments = []
    for name, _ in _targets(env, selectors):
        assessment = assess(env, env.get(name), catalog)
        if assessment.patch_set is None:
            report.results.append(DistributionResult(name, assessment.dist.raw_version, None, message=assessment.reason))
            continue
        assessments.append(assessment)
    if assessments:
        report.results += _change(env, catalog, assessments, operation="revert", jit_base=jit_base,
                                  planner=lambda a: plan_revert(a, force=force), on_wait=on_wait, report=report)
    return report


def _change(
    env: TargetEnvironment,
    catalog: Catalog,
    assessments: list[DistributionAssessment],
    *,
    operation: str,
    planner: Callable[[DistributionAssessment], Plan],
    jit_base: Path,
    on_wait: Callable[[str], None] | None,
    report: ChangeReport,
) -> list[DistributionResult]:
    """Under the environment lock: finish any interrupted run, plan again, and carry out each
    plan as one transaction. FlashInfer's trtllm_comm JIT entries go *before* its files change:
    a kill in between leaves pristine files and no cache entry (a rebuild), never patched
    files beside a module built from the old sources."""
    from sm120patch.transaction import check_writable, environment_lock, recover

    results = []
    with environment_lock(env.state_root(assessments[0].dist), on_wait=on_wait):
        for assessment in assessments:
            recovery = recover(assessment.state)
            if recovery:
                assessment = assess(env, assessment.dist, catalog, force_unknown=assessment.unpinned)
            plan = planner(assessment)
            check_writable([f.path for f in plan.files])
            if assessment.dist.name == FLASHINFER:
                report.jit_removed += _invalidate_jit(assessment, jit_base, sources_changing=bool(plan.files))
            _execute(plan, operation)
            results.append(DistributionResult(assessment.dist.name, assessment.dist.raw_version, plan, recovery))
            _check_after(plan)
    return results


def _execute(plan: Plan, operation: str) -> None:
    assessment = plan.assessment
    if not plan.files and (operation == "apply" or assessment.record is None):
        return
    from sm120patch.transaction import FileChange, Transaction

    changes = [FileChange(f.relpath, f.path, f.before, f.after, f.data) for f in plan.files]
    Transaction(
        assessment.state,
        operation=operation,
        changes=changes,
        new_record=plan.new_record,
        keep_originals={f.relpath: f.original for f in plan.files if f.original is not None},
        drop_originals=list(assessment.record.files) if operation == "revert" and assessment.record else (),
    ).run()


def _check_after(plan: Plan) -> None:
    """Read every written file back: it must hash to what the plan promised; after revert
    that is the installed RECORD's hash, checked again here."""
    tree = plan.assessment.tree
    for planned in plan.files:
        actual = sha256(planned.path.read_bytes())
        if actual != planned.after:
            raise RefusedError(f"{planned.path} does not hold the expected bytes after writing it")
        if plan.new_record is None and tree.release_sha256(planned.relpath) not in (actual, None) \
                and not (plan.assessment.record and plan.assessment.record.unpinned):
            raise RefusedError(f"{planned.path} was restored but does not match the installed RECORD")


def _invalidate_jit(assessment: DistributionAssessment, jit_base: Path, *, sources_changing: bool) -> list[Path]:
    """Remove trtllm_comm entries of this FlashInfer version: all of them when its sources are
    about to change; otherwise those older than the sources (left by an earlier run that was
    killed after its files changed, or built under another cache base and copied)."""
    version = assessment.dist.raw_version
    if sources_changing:
        return jitcache.invalidate(version, jit_base)
    sources = [fa.path for fa in assessment.files.values()]
    return jitcache.invalidate(version, jit_base, only=lambda entry: jitcache.is_stale(entry, sources))
