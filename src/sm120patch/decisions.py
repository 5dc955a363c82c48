"""The tuned-limits check (`verify --tuned`, and `apply --with tuned-limits` before its commit
point): the server's own patched decision code, run in the target interpreter by _decision_probe.py
under the profile, at each TP entry's boundary sizes and at 1..TP tokens, each decision compared
with what the profile (or, where none holds, the release) says."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

from sm120patch import runas, tunedlimits
from sm120patch.reports import CheckResult, StatusReport

TUNED_PATCH = "tuned-limits"
UNTUNED_TPS = (2, 4, 8)  # where no profile holds: the TP sizes the servers fuse at, each at 1..TP tokens
UNTUNED_HIDDEN = 4096


def _module_of(relpath: str) -> str:
    return relpath[:-3].replace("/", ".").removesuffix(".__init__")


CAP_CALL = "_sm120patch_fused_max_tokens("


def _edits(patch_set, patch):
    """The edits of ``patch`` and of the patches it requires, with each one's patch."""
    for p in [patch, *(q for q in patch_set.patches if q.id in patch.requires)]:
        for edit in p.edits:
            yield p, edit


def tuned_request(distribution, patch_set, cases: list[dict], *, tuned: bool = True) -> dict | None:
    """The probe's request, from the patch data. SGLang ("sites"): each decision the tuned-limits
    patch rewrites (a replace-expression putting the release's cap X into
    ``_sm120patch_fused_max_tokens(X)``), with X as the cap there. vLLM ("tables"): the fusion
    module whose SM120 rows it narrows at import. Both: the one-shot argument the patch puts in the
    fused call (``tuned`` False: the release's own expression there, to ask a tree patched without
    tuned-limits the same questions). None: no tuned-limits patch in this set."""
    try:
        patch = patch_set.patch(TUNED_PATCH)
    except KeyError:
        return None
    sites, oneshot = [], None
    for owner, edit in _edits(patch_set, patch):
        new = edit.params.get("new")
        if not isinstance(new, str):
            continue
        if edit.rewriter == "python.replace-expression" and CAP_CALL in new:
            cap = new[new.index(CAP_CALL) + len(CAP_CALL):new.rindex(")")]
            site = {"module": _module_of(owner.file), "function": edit.params["function"], "cap": cap}
            if site not in sites:
                sites.append(site)
        elif edit.params.get("keyword") == "use_oneshot" or "oneshot" in new and "oneshot" in edit.params.get("old", ""):
            oneshot = {"module": _module_of(owner.file), "expression": new if tuned else edit.params["old"]}
    spec = distribution.verify
    request = {"oneshot": oneshot, "server_args": dict(spec.tuned_server_args), "cases": cases,
               "device_flags": dict(spec.tuned_device_flags)}
    if sites:
        return dict(request, kind="sites", sites=sites)
    return dict(request, kind="tables", module=_module_of(patch.file))


def tuned_cases(profile) -> tuple[list[dict], dict[int, object]]:
    """The sizes to ask about: for each TP entry of the profile that holds here, its fused and
    one-shot limits in tokens (limit-1, limit, limit+1) and 1..TP; without one, 1..TP at TP2/4/8."""
    entries = {e.tp: e for e in profile.entries} if profile is not None and profile.usable else {}
    cases = []
    for tp, e in sorted(entries.items()):
        per_token = e.hidden * tunedlimits.ITEMSIZE[e.dtype]
        limits = (e.fused_max_bytes // per_token, e.oneshot_max_bytes // per_token)
        sizes = {*range(1, tp + 1), *(n + d for n in limits for d in (-1, 0, 1))}
        cases.append({"tp": tp, "hidden": e.hidden, "dtype": e.dtype, "sizes": sorted(s for s in sizes if s > 0)})
    if not cases:
        cases = [{"tp": tp, "hidden": UNTUNED_HIDDEN, "dtype": "bf16", "sizes": list(range(1, tp + 1))}
                 for tp in UNTUNED_TPS]
    return cases, entries


def _expected(entry, tp: int, size: int, cap, kind: str) -> tuple[bool, bool | None]:
    """What the profile says the server does at ``size`` tokens (``entry`` None: the release's own
    rule): fused or not, and the one-shot argument (None: FlashInfer's own rule decides)."""
    within_cap = size >= 1 and (not isinstance(cap, int) or size <= cap)
    if entry is None:
        return within_cap, None
    per_token = entry.hidden * tunedlimits.ITEMSIZE[entry.dtype]
    fused = within_cap and size * per_token <= entry.fused_max_bytes
    message = size * per_token
    if kind == "tables":  # vLLM: its one-shot row, narrowed to the profile's limit, and its floor
        return fused, (message <= entry.oneshot_max_bytes or size <= tp) if fused else None
    rule = tunedlimits.ONESHOT_RULE_MIB.get(tp)
    if rule is None:
        return fused, None
    # One-shot up to the profile's limit where FlashInfer's own rule allows it (its workspace is
    # sized by that rule); two-shot needs more tokens than ranks, so no more than TP is one-shot.
    return fused, (message <= entry.oneshot_max_bytes and message * 2 * tp <= rule * 1024 * 1024) or size <= tp


def _words(fused: bool, oneshot) -> str:
    if not fused:
        return "not fused"
    return {True: "fused one-shot", False: "fused two-shot", None: "fused (FlashInfer's one-shot rule)"}[oneshot]


def _decisions(fused: dict, oneshot: dict) -> str:
    """``1-4, 16: fused one-shot; 17, 64: fused two-shot; 65: not fused``: each size under what the server does."""
    groups: dict[str, list[int]] = {}
    for size in sorted(int(s) for s in fused):
        groups.setdefault(_words(fused[str(size)], oneshot.get(str(size))), []).append(size)

    def spans(sizes: list[int]) -> str:
        runs, start = [], sizes[0]
        for a, b in zip(sizes, sizes[1:] + [None]):
            if b != a + 1:
                runs.append(str(start) if start == a else f"{start}-{a}")
                start = b
        return ", ".join(runs)

    return "; ".join(f"{spans(sizes)} tokens: {words}" for words, sizes in groups.items())


def in_force(log: list[str], tp: int) -> bool:
    """Whether the server's one line says the profile is in force at TP ``tp`` (SGLang: a line per
    TP size; vLLM: one line naming each TP size, then those it is not in force at)."""
    return any(re.search(rf"(in force |; )at TP{tp}:", line.split("; not in force at ")[0]) for line in log)


def run_tuned_probe(python: Path, request: dict) -> dict:
    script = Path(__file__).with_name("_decision_probe.py").read_text(encoding="utf-8")
    with tempfile.TemporaryDirectory(prefix="sm120patch-tuned-") as workspace:
        # The server's code is the environment's: as root on another user's environment it runs as
        # that user. FlashInfer writes its log under its workspace when imported: a check leaves no trace.
        user = runas.environment_owner(python)
        user.give(Path(workspace))
        env = user.environ(dict(os.environ, FLASHINFER_WORKSPACE_BASE=workspace))
        proc = subprocess.run([str(python), "-c", script, json.dumps(request)], capture_output=True, text=True,
                              env=env, cwd="/", timeout=600, **user.popen_args())
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"the decision probe failed: {tail}"}


def tuned_checks_for(python: Path, server: str, distribution, patch_set, profile) -> list[CheckResult]:
    """The tuned check of one server (``server``: "sglang 0.5.9") whose tuned-limits is applied."""
    cases, entries = tuned_cases(profile)
    request = tuned_request(distribution, patch_set, cases)
    subject = f"{server} decisions"
    if request is None:
        return [CheckResult("tuned", subject, None, f"not run: {server} has no tuned-limits patch")]
    out = run_tuned_probe(python, request)
    device = out.get("device")
    if "skipped" in out:
        return [CheckResult("tuned", subject, None, f"not run: {out['skipped']}")]
    if "error" in out:
        return [CheckResult("tuned", subject, False, out["error"] + "; a server with this patch fails the same way "
                            "at its first forward", broken=True)]
    results = [CheckResult("tuned", f"{server} device", True, device, required=False)]
    caps = out.get("caps", {})
    for row in out["cases"]:
        tp = row["tp"]
        subject = f"{server} at TP{tp}"
        if "error" in row:
            results.append(CheckResult("tuned", subject, False, row["error"] + "; a server with this patch fails the "
                                       "same way at its first forward", broken=True))
            continue
        if "skipped" in row:
            results.append(CheckResult("tuned", subject, None, f"not run: {row['skipped']}"))
            continue
        forced = in_force(row["log"], tp)
        expected_entry = entries.get(tp)
        entry = expected_entry if forced else None
        wrong, lines = [], {}
        # vLLM without a profile in force: its own rows decide, reported as they are.
        compared = entry is not None or request["kind"] != "tables"
        for site, fused in row["sites"].items():
            for size in sorted(int(s) for s in fused) if compared else ():
                want = _expected(entry, tp, size, caps.get(site), request["kind"])
                got = (fused[str(size)], row["oneshot"].get(str(size)))
                if got != want:
                    wrong.append(f"{size} tokens ({site}): {_words(*got)}, the "
                                 f"{'profile' if entry else 'release'} says {_words(*want)}")
            lines.setdefault(_decisions(fused, row["oneshot"]), []).append(site)
        said = row["log"][0] if row["log"] else "the server logged nothing about the profile"
        if expected_entry is not None and not forced:
            results.append(CheckResult("tuned", subject, False, f"the server does not use the profile: {said}"))
        elif wrong:
            results.append(CheckResult("tuned", subject, False, "decides otherwise: " + "; ".join(wrong[:3])))
        else:
            whose = "as the profile says" if entry else "no profile holds: the release's own limits"
            shown = (next(iter(lines)) if len(lines) == 1
                     else " | ".join(f"{', '.join(sites)}: {text}" for text, sites in lines.items()))
            results.append(CheckResult("tuned", subject, True, f"{shown} — {whose}"))
    return results


def tuned_checks(python: Path, report: StatusReport) -> list[CheckResult]:
    """The tuned check of every server of the report whose tuned-limits is applied."""
    profile = None
    results = []
    for item in report.trees:
        a = item.assessment
        if a.patch_set is None or TUNED_PATCH not in (a.applied_ids or ()):
            continue
        if profile is None:
            profile = tunedlimits.read({t.assessment.name: t.assessment.raw_version for t in report.trees})
        results += tuned_checks_for(python, f"{a.name} {a.raw_version}", item.distribution, a.patch_set, profile)
    if not results:
        results.append(CheckResult("tuned", "tuned-limits", None, "not run: no server here has tuned-limits applied "
                                   "(`sm120patch apply --with tuned-limits`)"))
    return results
