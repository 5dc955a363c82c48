"""Rendering: the human tables and the --json documents. No decisions are made here."""

from __future__ import annotations


from sm120patch.actions import ChangeReport, StatusReport
from sm120patch.errors import ExitCode
from sm120patch.facts import SDIST_ONLY, sglang_auto_enables_fusion
from sm120patch.plan import DistributionAssessment, PatchState

AOT_HINT = (
    "FlashInfer loads this prebuilt trtllm_comm instead of compiling the patched sources, and it "
    "has no SM120 code: uninstall flashinfer-jit-cache (or remove that file) so the JIT builds it"
)


def overall(assessment: DistributionAssessment) -> str:
    if assessment.patch_set is None:
        return "fixed upstream" if assessment.fixed_upstream else "no patch set"
    states = {p.id: assessment.patch_state(p) for p in assessment.patch_set.patches}
    if any(s in (PatchState.DRIFTED, PatchState.MISSING) for s in states.values()):
        return "DRIFTED"
    required = [states[p.id] for p in assessment.patch_set.patches if p.required]
    if all(s is PatchState.APPLIED for s in required):
        return "patched"
    if any(s is PatchState.APPLIED for s in states.values()):
        return "partly patched"
    return "not patched"


def status_exit_code(report: StatusReport) -> ExitCode:
    verdicts = [overall(s.assessment) for s in report.distributions]
    if "DRIFTED" in verdicts or any(s.pending_journal for s in report.distributions):
        return ExitCode.REFUSED
    if not verdicts or any(v not in ("patched", "fixed upstream") for v in verdicts):
        return ExitCode.NOT_PATCHED
    return ExitCode.OK


def render_status(report: StatusReport) -> str:
    env = report.env
    lines = [f"Python {env.executable} ({env.python_version})"]
    if not report.distributions:
        lines.append("  neither flashinfer-python nor sglang is installed here")
    for status in report.distributions:
        a = status.assessment
        lines.append("")
        lines.append(f"{a.dist.name} {a.dist.raw_version}: {overall(a)}" + (f"  ({a.dist.location})"))
        if a.dist.editable:
            lines.append(f"  editable install of {a.dist.direct_url.get('url')}: `apply` patches that source tree "
                         "as a commit; `status --source PATH` shows it")
        if a.patch_set is None:
            lines.append(f"  {a.reason}")
            continue
        width = max(len(p.id) for p in a.patch_set.patches)
        for patch in a.patch_set.patches:
            state = a.patch_state(patch)
            kind = "" if patch.required else " (opt-in)"
            fixed = f"  fixed upstream in {patch.fixed_in}" if patch.fixed_in else ""
            lines.append(f"  {patch.id:<{width}}  {state.value + kind:<19} {patch.file}{fixed}")
        for fa in a.files.values():
            if fa.detail:
                lines.append(f"  ! {fa.relpath}: {fa.detail}")
        if a.dropped_by_reinstall:
            lines.append(
                f"  ! {', '.join(a.dropped_by_reinstall)} had been applied; the files are the release's again "
                "(pip reinstalled the package): run `sm120patch apply` again"
            )
        if status.pending_journal:
            lines.append(f"  ! an interrupted {status.pending_journal} was found; the next apply or revert rolls it back")
        if a.unpinned:
            lines.append(f"  ! unpinned: no patch set pins {a.dist.raw_version}; {a.patch_set.source.name} was applied "
                         "by meaning with --force, and no vendor manifest vouches for the result")
        elif a.record and a.record.unpinned:
            lines.append("  ! applied with --force to bytes no vendor manifest vouches for (unpinned)")
        if a.patch_set.fixed_in:
            lines.append(f"  upstream fix: {a.patch_set.fixed_in} ({a.patch_set.upstream})")
        if a.dist.name == "sglang" and sglang_auto_enables_fusion(a.dist.version):
            lines.append(f"  ! sglang {a.dist.raw_version} turns fusion on by itself on SM120 (is_blackwell_supported()): "
                         "with fusion-gate applied it runs without --enable-flashinfer-allreduce-fusion")
        for note in a.patch_set.notes:
            lines.append(f"  note: {note}")
    lines.append("")
    lines.append(f"JIT cache: {report.jit_base / '.cache' / 'flashinfer'}")
    if report.jit_entries:
        for entry in report.jit_entries:
            mark = "STALE (built before the last source change; remove it)" if entry in report.stale_jit else "current"
            lines.append(f"  {entry}: {mark}")
    else:
        lines.append("  no trtllm_comm entries (FlashInfer builds one on first use)")
    for shadow in report.aot:
        lines.append(f"AOT: {shadow.path} ({shadow.source})")
        lines.append(f"  ! {AOT_HINT}")
    if report.pin_mismatch:
        lines.append(f"note: {report.pin_mismatch} (sm120patch patches each as installed)")
    return "\n".join(lines)


def status_json(report: StatusReport) -> dict:
    out = {
        "python": str(report.env.executable),
        "python_version": report.env.python_version,
        "exit_code": int(status_exit_code(report)),
        "distributions": [],
        "jit_cache": {
            "base": str(report.jit_base),
            "trtllm_comm_entries": [str(e) for e in report.jit_entries],
            "stale": [str(e) for e in report.stale_jit],
        },
        "aot_shadowing": [{"path": s.path, "source": s.source} for s in report.aot],
        "pin_mismatch": report.pin_mismatch,
    }
    for status in report.distributions:
        a = status.assessment
        entry = {
            "name": a.dist.name,
            "version": a.dist.raw_version,
            "location": str(a.dist.location),
            "editable": a.dist.editable,
            "state": overall(a),
            "patch_set": a.patch_set.source.name if a.patch_set else None,
            "reason": a.reason or None,
            "fixed_in": str(a.patch_set.fixed_in) if a.patch_set and a.patch_set.fixed_in else None,
            "interrupted_transaction": status.pending_journal,
            "dropped_by_reinstall": a.dropped_by_reinstall,
            "unpinned": bool(a.unpinned or (a.record and a.record.unpinned)),
            "patches": [],
        }
        if a.patch_set:
            for patch in a.patch_set.patches:
                fa = a.files[patch.file]
                entry["patches"].append(
                    {
                        "id": patch.id,
                        "file": patch.file,
                        "required": patch.required,
                        "state": a.patch_state(patch).value,
                        "sha256": fa.sha256,
                        "upstream": patch.upstream,
                        "fixed_in": patch.fixed_in,
                        "detail": fa.detail or None,
                    }
                )
        out["distributions"].append(entry)
    return out


def render_change(report: ChangeReport) -> str:
    verb = {"apply": "patched", "revert": "restored"}[report.operation]
    lines = []
    for result in report.results:
        if result.recovery:
            lines.append(
                f"{result.name}: rolled back an interrupted {result.recovery.operation} "
                f"({len(result.recovery.restored)} file(s) restored)"
            )
        if result.plan is None:
            lines.append(f"{result.name} {result.version}: nothing to do: {result.message}")
            continue
        root = result.plan.assessment.dist.location
        if report.dry_run:
            if not result.plan.files:
                lines.append(f"{result.name} {result.version}: already patched, nothing would change")
            for planned in result.plan.files:
                lines.append(planned.diff(root).rstrip("\n"))
            continue
        if not result.plan.files:
            lines.append(f"{result.name} {result.version}: nothing to change (already {verb})")
            continue
        if result.plan.assessment.unpinned and report.operation == "apply":
            lines.append(f"{result.name} {result.version}: no patch set pins this release; applied "
                         f"{result.plan.assessment.patch_set.source.name} by meaning (--force), recorded as unpinned:")
            lines += [planned.diff(root).rstrip("\n") for planned in result.plan.files]
        lines.append(f"{result.name} {result.version}: {verb} {len(result.plan.files)} file(s)")
        for planned in result.plan.files:
            ids = ", ".join(planned.patches) if planned.patches else "release bytes"
            lines.append(f"  {planned.relpath}  [{ids}]  sha256 {planned.before[:12]} -> {planned.after[:12]}")
    if not report.dry_run:
        for path in report.jit_removed:
            lines.append(f"removed stale JIT cache entry {path}")
    for shadow in report.aot:
        lines.append(f"warning: prebuilt {shadow.path} ({shadow.source}): {AOT_HINT}")
    return "\n".join(lines)


def change_json(report: ChangeReport) -> dict:
    return {
        "operation": report.operation,
        "dry_run": report.dry_run,
        "python": str(report.env.executable),
        "results": [
            {
                "name": r.name,
                "version": r.version,
                "message": r.message or None,
                "recovered": r.recovery.operation if r.recovery else None,
                "files": [
                    {"file": f.relpath, "patches": list(f.patches), "before": f.before, "after": f.after}
                    for f in (r.plan.files if r.plan else ())
                ],
            }
            for r in report.results
        ],
        "jit_cache_removed": [str(p) for p in report.jit_removed],
        "aot_shadowing": [{"path": s.path, "source": s.source} for s in report.aot],
    }


def verify_exit_code(results) -> ExitCode:
    ran = [r for r in results if r.ok is not None]
    return ExitCode.OK if ran and all(r.ok for r in ran) else ExitCode.NOT_PATCHED


def render_verify(env, results) -> str:
    lines = [f"Python {env.executable} ({env.python_version})"]
    if not results:
        lines.append("  nothing to verify: neither flashinfer-python nor sglang is installed here")
    for r in results:
        mark = {True: "PASS", False: "FAIL", None: "SKIP"}[r.ok]
        lines.append(f"{mark}  {r.kind:<8} {r.subject}: {r.detail}")
    code = verify_exit_code(results)
    lines.append("verified" if code is ExitCode.OK else "NOT verified")
    return "\n".join(lines)


def verify_json(env, results) -> dict:
    return {
        "python": str(env.executable),
        "verified": verify_exit_code(results) is ExitCode.OK,
        "checks": [{"kind": r.kind, "subject": r.subject, "ok": r.ok, "detail": r.detail} for r in results],
    }


def _ranges(versions) -> str:
    return f"{versions[0]}" if len(versions) == 1 else f"{versions[0]} to {versions[-1]}"


def render_list(catalog) -> str:
    """The support matrix: release ranges -> patch ids (required / opt-in) -> upstream fix."""
    lines = []
    for name in ("flashinfer-python", "sglang"):
        sets = sorted(catalog.for_distribution(name), key=lambda ps: min(ps.versions))
        fixed = catalog.fixed_in(name)
        lines.append(f"{name}" + (f"  (fixed upstream from {fixed}: {sets[0].upstream})" if fixed else "  (no upstream release fixes it)"))
        for ps in sets:
            versions = sorted(ps.versions)
            required = ", ".join(p.id for p in ps.patches if p.required)
            optional = ", ".join(p.id for p in ps.patches if not p.required) or "none"
            lines.append(f"  {_ranges(versions):<28} {len(versions):>2} release(s)  {required:<36} opt-in: {optional}")
        for version in SDIST_ONLY.get(name, ()):
            lines.append(f"  {version:<28}  sdist only: not supported (no RECORD to check against)")
        if fixed:
            lines.append(f"  {str(fixed) + ' and later':<28}  native SM120 support: nothing to patch")
    return "\n".join(lines)


def list_json(catalog) -> dict:
    return {
        name: {
            "fixed_in": str(catalog.fixed_in(name)) if catalog.fixed_in(name) else None,
            "sdist_only": list(SDIST_ONLY.get(name, ())),
            "releases": {
                str(v): {
                    "patch_set": ps.source.name,
                    "required": [p.id for p in ps.patches if p.required],
                    "opt_in": [p.id for p in ps.patches if not p.required],
                    "upstream": {p.id: {"reference": p.upstream, "fixed_in": p.fixed_in} for p in ps.patches},
                }
                for ps in catalog.for_distribution(name) for v in sorted(ps.versions)
            },
        }
        for name in ("flashinfer-python", "sglang")
    }


def render_source_status(status) -> str:
    tree = status.tree
    lines = [f"{tree.distribution} {tree.raw_version} source tree at {tree.root}"]
    if status.patch_set is None:
        lines.append("  sm120patch knows no patch set for it")
        return "\n".join(lines)
    for patch in status.patch_set.patches:
        kind = "" if patch.required else " (opt-in)"
        lines.append(f"  {patch.id:<16} {'in HEAD' if status.in_head[patch.id] else 'not in HEAD'}{kind}")
    if status.branch:
        lines.append(f"  sm120patch's branch: {status.branch}")
    return "\n".join(lines)


def source_status_exit_code(status) -> ExitCode:
    """0 when HEAD has every required patch, like `status` for an installed environment."""
    if status.patch_set is None:
        return ExitCode.NOT_PATCHED
    required = [p.id for p in status.patch_set.patches if p.required]
    return ExitCode.OK if all(status.in_head[i] for i in required) else ExitCode.NOT_PATCHED


def source_status_json(status) -> dict:
    return {
        "root": str(status.tree.root),
        "distribution": status.tree.distribution,
        "version": status.tree.raw_version,
        "patch_set": status.patch_set.source.name if status.patch_set else None,
        "in_head": status.in_head,
        "branch": status.branch,
    }
