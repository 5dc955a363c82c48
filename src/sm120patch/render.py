"""Rendering: the human text and the --json documents. No decisions are made here: verdicts and
exit codes come with the reports (assess.py, pipeline.py)."""

from __future__ import annotations

import os
import re
import sys
import textwrap
from typing import TYPE_CHECKING, Sequence

import click
from packaging.version import Version

from sm120patch.assess import Origin, State, Verdict
from sm120patch.chain import Chain, NextStep, StepResult, next_step
from sm120patch.errors import ExitCode
from sm120patch.reports import ChangeReport, Result, StatusReport, TreeStatus
from sm120patch.words import counted, size_words as _size
from sm120patch.words import spec_words as _spec_words

if TYPE_CHECKING:  # each command's own module is imported by that command
    from sm120patch.bench import BenchReport, TuneReport
    from sm120patch.doctor import DoctorReport
    from sm120patch.verify import VerifyReport

AOT_HINT = (
    "FlashInfer loads this prebuilt trtllm_comm instead of compiling the patched sources, and it "
    "has no SM120 code: uninstall flashinfer-jit-cache (or remove that file) so the JIT builds it"
)


# -- the terminal ----------------------------------------------------------------------------------

_KEPT = "\ue000"  # a space that is not a break: inside a command, inside a verdict
_COMMAND = re.compile(r"`[^`]*`")
_COMMAND_OF_SM120PATCH = re.compile(r"`(sm120patch [^`]*)`")
VERDICT_COLOURS = {"will not fuse": "red", "not known": "yellow", "will fuse": "green"}
_VERDICT = re.compile("|".join(VERDICT_COLOURS))


# Set by the command line for the text it prints (cli.show); a report rendered for anything else
# (a test, a string) stays unwrapped and plain.
COLUMNS: int | None = None
COLOUR = False


def terminal_width() -> int | None:
    """The width prose is wrapped to: $COLUMNS where it is set, else the terminal's; None where
    stdout is no terminal (a pipe, a file, a log), which then gets one line per item, as grep and
    scripts want it."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    if not sys.stdout.isatty():
        return None
    try:  # os's, not shutil's: shutil is 3 ms of status's imports (environment.py)
        return os.get_terminal_size(sys.stdout.fileno()).columns or 80
    except (OSError, ValueError):
        return 80


def colour() -> bool:
    """Verdicts in colour on a terminal only, and never under NO_COLOR (no-color.org)."""
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


def fill(first: str, text: str, hang: str, *, columns: int | None = None) -> list[str]:
    """``text`` after ``first``, wrapped to the terminal's width with ``hang`` before each further
    line; a command (in backticks) and a verdict are never broken: a command that does not fit
    after ``hang`` gets a line of its own, as far in as it fits. textwrap does the wrapping
    (click.wrap_text would break a long word, and a name at its hyphens)."""
    columns = columns if columns is not None else COLUMNS
    if columns is None or len(first) + len(text) <= columns:
        return [first + text]
    kept = _COMMAND.sub(lambda m: m.group(0).replace(" ", _KEPT), _VERDICT.sub(
        lambda m: m.group(0).replace(" ", _KEPT), text))
    lines = textwrap.wrap(kept, width=columns, initial_indent=first, subsequent_indent=hang,
                          break_long_words=False, break_on_hyphens=False)
    lines = [(_closest(line.strip(), hang, columns) if len(line) > columns and line.startswith(hang) else line)
             .replace(_KEPT, " ") for line in lines]
    return _labels_kept(lines, columns)


_LABEL_ALONE = re.compile(r"( *)((?:next: +)?\d+\.|[a-z]+:)")


def _labels_kept(lines: list[str], columns: int) -> list[str]:
    """A label (``fix:``, ``check:``, ``note:``, ``next: 1.``) left alone at the end of a line
    with its command on the next: the two on one line, where the label was if they fit there,
    else four spaces in, else two (a command wider than the terminal, which the terminal folds
    anyway, too). Never the label here and its command at the terminal's right edge."""
    kept: list[str] = []
    for line in lines:
        label = _LABEL_ALONE.fullmatch(kept[-1]) if kept else None
        if label is not None and line.lstrip().startswith("`"):
            joined = f"{label.group(2)} {line.strip()}"
            at = len(label.group(1))
            indent = next((i for i in dict.fromkeys((at, min(at, 4), min(at, 2))) if i + len(joined) <= columns),
                          min(at, 2))
            kept[-1] = " " * indent + joined
            continue
        kept.append(line)
    return kept


def _closest(word: str, hang: str, columns: int) -> str:
    """A word (a command) too long to follow ``hang``: as far in as it fits, at least two spaces."""
    return " " * max(2, min(len(hang), columns - len(word))) + word


_PREFIX = re.compile(r"( *)((?:[!-] |\d+\. |(?:note|fix|check|next|verdict|step|warning): )?)")


def fit(text: str) -> str:
    """A report's text wrapped to the terminal (:data:`COLUMNS`), each line under its own marker
    (``! ``, ``note: ``, ...) or two spaces in from its first; lines that fit, and every line
    where stdout is no terminal, are left as they are."""
    columns = COLUMNS
    if columns is None:
        return text
    lines = []
    for line in text.split("\n"):
        prefix = _PREFIX.match(line).group(0)
        hang = " " * (len(prefix) + (0 if prefix.strip() else 2))
        lines += fill(prefix, line[len(prefix):], hang, columns=columns)
    return "\n".join(lines)


# A verdict to be coloured is marked by these (private-use characters: printable, so that
# terminal.visible, which the text goes through first, leaves them alone); :func:`paint` turns
# them into the terminal's colours last, so that no escape sequence but sm120patch's own is sent.
_PAINT, _PAINTED = "\ue001", "\ue002"
_MARKED = re.compile(f"{_PAINT}([^{_PAINTED}]*){_PAINTED}")


def coloured(text: str) -> str:
    """Each verdict in ``text`` marked for its colour, on a terminal (:func:`colour`); :func:`paint`
    colours it."""
    if not COLOUR:
        return text
    return _VERDICT.sub(lambda m: f"{_PAINT}{m.group(0)}{_PAINTED}", text)


def paint(text: str) -> str:
    """The verdicts :func:`coloured` marked, in their colours."""
    if _PAINT not in text:
        return text
    return _MARKED.sub(lambda m: click.style(m.group(1), fg=VERDICT_COLOURS[m.group(1)], bold=True)
                       if m.group(1) in VERDICT_COLOURS else m.group(0), text)  # (a file's own such characters: as they are)


# -- --json ----------------------------------------------------------------------------------------

COMMON_KEYS = ("command", "exit_code", "target", "next")  # every --json document's, first, error or not


def json_document(command: str, exit_code: int, body: dict) -> dict:
    """A command's --json document: the keys every command's carries (the command, its exit
    code, the interpreter or checkout it looked at, what to do next as {command, reason}), then
    its own."""
    body = dict(body)
    return {"command": command, "exit_code": int(exit_code), "target": body.pop("target", None),
            "next": body.pop("next", []), **body}


# -- status ----------------------------------------------------------------------------------------

def _patch_word(item: TreeStatus, patch) -> str:
    """A checkout, or a release no patch set pins, is judged by meaning; an install by hash."""
    a = item.assessment
    state = a.patch_state(patch) if a.patch_set is not None else State.PRISTINE
    if item.tree.judged_by_meaning or a.patch_set is None:
        words = item.tree.words
        return words.present if item.by_meaning.get(patch.id, state is State.APPLIED) else words.absent
    word = state.value
    fa = item.assessment.files.get(patch.file)
    if state is State.APPLIED and fa is not None and patch.id in fa.former:
        word += " (older form)"
    elif state is State.APPLIED and fa is not None and fa.origin in (Origin.BY_HAND, Origin.ADOPTED, Origin.FORCED,
                                                                     Origin.OTHER_FORM):
        word += f" ({fa.origin.value})"
    return word


def _file_notes(item: TreeStatus, report: StatusReport) -> list[str]:
    a = item.assessment
    lines = []
    for fa in a.files.values():
        if fa.link is not None:
            where = {State.PRISTINE: "holds the release's bytes", State.APPLIED: "holds patched bytes"}.get(
                fa.state, "does not hold the release's bytes")
            lines.append(f"  ! {fa.relpath} is a symbolic link to {fa.link} (uv --link-mode=symlink?); it {where}. "
                         "sm120patch never writes through a link: reinstall with --link-mode=copy, or `apply --force` "
                         "replaces it by a patched regular file")
        if fa.state is State.APPLIED and fa.origin is Origin.BY_HAND:
            lines.append(f"  ! {fa.relpath}: patched by hand, identical to {', '.join(fa.applied)}; sm120patch has no "
                         "record of it: `apply` adopts it, `revert` restores the release's bytes")
        elif fa.state is State.APPLIED and fa.origin is Origin.OTHER_FORM:
            lines.append(f"  ! {fa.relpath}: written by another sm120patch, whose data has another form of "
                         f"{', '.join(fa.applied)} than this one's (its ledger vouches for the bytes): "
                         f"`{report.apply_command}` writes this one's form from the saved original, `revert` restores the release's bytes")
        elif fa.detail:
            lines.append(f"  ! {fa.relpath}: {fa.detail}")
    for patch_id in a.former_ids:
        lines.append(f"  ! {patch_id}: applied (older form): `{report.apply_command}` updates it to today's "
                     f"({a.patch_set.patch(patch_id).summary})")
    for fa in a.unknown.values():  # the ledger's, unknown to this sm120patch's data (a newer one patched it)
        if fa.state is State.APPLIED:
            lines.append(f"  ! {fa.relpath}: patched by an sm120patch whose data has {', '.join(fa.applied)}, which this "
                         "one's does not: `revert` restores the release's bytes from the saved original")
        elif fa.detail:
            lines.append(f"  ! {fa.relpath}: {fa.detail}")
    if a.dropped_by_reinstall:
        lines.append(f"  ! {', '.join(a.dropped_by_reinstall)} had been applied; the files are the release's again "
                     f"(the package was reinstalled): run `{report.apply_command}` again")
    if item.pending:
        rolls = "; the next apply or revert rolls it back" if item.pending_blocks and item.pending.startswith("an interrupted") else ""
        lines.append(f"  ! {item.pending} was found{rolls}" if item.pending.startswith("an interrupted")
                     else f"  ! {item.pending}")
    if a.unpinned:
        lines.append(f"  ! unpinned: no patch set pins {a.raw_version}; {a.patch_set.name} was applied by meaning with "
                     "--force, and no vendor manifest vouches for the result")
    elif a.ledger and a.ledger.unpinned:
        lines.append("  ! applied with --force to bytes no vendor manifest vouches for (unpinned)")
    return lines


def _chain_lines(chain: Chain) -> list[str]:
    """The fusion chain under its server, one step a line (the headline is at the top)."""
    lines = ["  fusion chain:"]
    width = max(len(step.id) for step in chain.steps)
    column = f"    {'':<{width}}  {'':<7}  "  # each step's words, under one another
    for step in chain.steps:
        lines += fill(f"    {step.id:<{width}}  {step.result.value:<7}  ", step.text, column)
        if step.result is not StepResult.OK and step.fix:
            # What ends a block fixes it; what ends an unknown reads what is not known (fill
            # keeps the label on its command's line).
            word = "fix" if step.result is StepResult.BLOCKS else "check"
            lines += fill(column, f"{word}: `{step.fix}`", column)
        if step.note:
            lines += fill(column, f"note: {step.note}", column)
    return lines


def chain_json(chain: Chain) -> dict:
    fusion = chain.fusion
    return {
        "verdict": chain.verdict,
        "headline": chain.headline,
        "conditions": chain.conditions,
        "steps": [{"id": s.id, "result": s.result.value, "text": s.text, "fix": s.fix or None,
                   "condition": s.condition or None, "note": s.note or None} for s in chain.steps],
        "workspace": None if fusion is None else {
            "with": fusion.with_ if fusion.installed else None,
            "path": fusion.path.path if fusion.path else None,
            "missing": list(fusion.missing),
            "unknown": list(fusion.unknown),
        },
    }


def _answer_lines(report: StatusReport) -> list[str]:
    """What both views of status begin with: the target, and every server's verdict over the
    whole chain."""
    lines = [f"Python {report.target} ({report.python_version})" if report.python_version else f"Checkout {report.target}"]
    if report.chosen_by:
        lines.append(f"  (no --python given: {report.chosen_by}; --python names your server's interpreter)")
    chains = [item.chain for item in report.trees if item.chain is not None]
    if chains:
        lines.append("")
        lines.append("Will it fuse?")
        lines += [f"  {'!' if c.verdict == 'will not fuse' else '-'} {c.headline}" for c in chains]
    if not report.trees:
        lines.append(f"  none of the distributions sm120patch patches ({', '.join(report.registry_names)}) is installed here: "
                     "nothing here is patched (exit code 1); --python names the interpreter your server runs")
    return lines


def _in_the_way(item: TreeStatus) -> str:
    """One distribution in one line: version, patched or not, and what stands in the way (the
    required patches not applied, by their state; the server's chain steps that block or are not
    known; stale JIT entries)."""
    a = item.assessment
    said = [a.verdict.value]
    if a.patch_set is None and a.reason:
        said.append(a.reason)
    elif a.patch_set is not None:
        by_state: dict[str, list[str]] = {}
        for patch in a.patch_set.patches:
            if item.tree.judged_by_meaning:  # a checkout: what its files have, by meaning (as --verbose)
                state = State.APPLIED if item.by_meaning.get(patch.id, False) else State.PRISTINE
            else:
                state = a.patch_state(patch)
            if patch.required and state is not State.APPLIED:
                by_state.setdefault(state.value, []).append(patch.id)
        for state, ids in by_state.items():
            if state == State.PRISTINE.value and len(ids) > 3:
                said.append(f"{len(ids)} patches to apply")
            else:
                said.append(f"{', '.join(ids)} {'to apply' if state == State.PRISTINE.value else state}")
    if item.chain is not None:
        for result, word in ((StepResult.BLOCKS, "blocked at"), (StepResult.UNKNOWN, "not known")):
            # The GPUs are never read by status (the headline names doctor, which reads them).
            steps = [step.id for step in item.chain.steps if step.result is result and step.id != "device"]
            if steps:
                said.append(f"fusion {word}: {', '.join(steps)}")
    if item.jit is not None and item.jit.stale:
        said.append(f"{counted(len(item.jit.stale), 'stale JIT entry', 'stale JIT entries')}")
    words = item.tree.words
    return f"  {words.heading}: {'; '.join(said)}"


def render_status(report: StatusReport) -> str:
    """`status`: the answer per server, one line per distribution (and its warnings), and what to
    do next: a screen. Every patch, the fusion chain's steps and the JIT cache: --verbose."""
    lines = _answer_lines(report)
    if report.trees:
        lines.append("")
    for item in report.trees:
        lines.append(_in_the_way(item))
        if item.tree.words.shared_with:  # a copy the interpreter finds through PYTHONPATH: which one a server gets
            lines.append(f"    ! installed in {item.tree.words.shared_with}")
        if item.routed_from is not None:
            lines.append(f"    editable install of {item.routed_from}: `apply` patches that checkout as a commit")
        if item.assessment.patch_set is not None:
            lines += [f"  {line}" for line in _file_notes(item, report)]
        lines += [f"    ! {text}" for level, text in item.advice_lines() if level == "warn"]
        if item.branch_error is not None:
            raise item.branch_error
    for shadow in report.aot:
        lines.append(f"  ! AOT: {shadow.path} ({shadow.source}): {AOT_HINT}")
    for directory, who in report.exposed:  # as root: said in both views (--verbose says how the writes go there)
        lines.append(f"  note: run as root, {directory} and below: {who} can change them")
    if report.orphans or report.temporaries:
        lines.append(f"  ! left behind: {counted(len(report.orphans) + len(report.temporaries), 'item')} "
                     f"(`{report.apply_command}` or a revert removes it)")
    following = status_next(report)
    if following:
        lines.append("")
        lines.extend(_next_lines(following))
    if report.trees:
        lines.append(f"every patch, the fusion chain and the JIT cache: `{report.verbose_command}`")
    return coloured(fit("\n".join(lines)))


def render_status_verbose(report: StatusReport) -> str:
    """`status --verbose`: the answer, then every distribution's whole table."""
    columns = COLUMNS
    lines = _answer_lines(report)
    for item in report.trees:
        a, tree, distribution = item.assessment, item.tree, item.distribution
        lines.append("")
        words = tree.words
        lines.append(f"{words.heading}: {a.verdict.value}{words.where}")
        if words.shared_with:
            lines.append(f"  ! installed in {words.shared_with}")
        if item.routed_from is not None:
            lines.append(f"  editable install of {item.routed_from}: `apply` patches that checkout as a commit")
        shown = a.patch_set or (distribution.closest_set(tree.version) if item.by_meaning else None)
        if a.patch_set is None:
            lines.append(f"  {a.reason}")
        if shown is not None and (a.patch_set is not None or item.by_meaning):
            width = max(len(p.id) for p in shown.patches)
            for patch in shown.patches:
                word = _patch_word(item, patch)
                kind = "" if patch.required else " (opt-in)"
                fixed = f"  fixed upstream in {patch.fixed_in}" if patch.fixed_in else ""
                row = f"  {patch.id:<{width}}  {word + kind:<19} {patch.file}{fixed}"
                if len(row) > (columns or len(row)):  # a narrow terminal: the file on a line of its own
                    row = f"  {patch.id:<{width}}  {word + kind:<19}{fixed}\n    {patch.file}"
                lines.append(row)
                if not patch.required and a.patch_set is not None:
                    # What an opt-in changes in this release, in the set's own words.
                    lines.append(f"  {'':<{width}}  --with {patch.id}: {patch.summary}")
        if a.patch_set is not None:
            lines += _file_notes(item, report)
            if distribution.fixed_in:
                lines.append(f"  upstream fix: {distribution.fixed_in} ({distribution.upstream})")
            if distribution.still_gated:
                lines.append(f"  note: {distribution.still_gated}")
        for note in (a.patch_set.notes if a.patch_set else ()):
            lines.append(f"  note: {note}")
        for level, text in item.advice_lines():
            lines.append(f"  {'!' if level == 'warn' else 'note:'} {text}")
        if item.pin:
            lines.append(f"  note: {item.pin} (sm120patch patches each as installed)")
        if item.chain is not None:
            lines += _chain_lines(item.chain)
        if item.branch_error is not None:
            raise item.branch_error
        if item.branch:
            lines.append(f"  sm120patch's branch: {item.branch}")
        if item.jit is not None:
            lines += _jit_lines(item, report)
    for shadow in report.aot:
        lines.append("")
        lines.append(f"AOT: {shadow.path} ({shadow.source})")
        lines.append(f"  ! {AOT_HINT}")
    if report.exposed:
        lines.append("")
        lines.append("Run as root where another user can change the directories (sm120patch writes there by directory "
                     "descriptors only, never following a link they could plant, and runs that environment's programs "
                     "as its owner):")
    for directory, who in report.exposed:
        lines.append(f"  note: {directory} and below: {who} can change them")
    if report.orphans or report.temporaries:
        lines.append("")
        lines.append(f"Left behind (`{report.apply_command}` or a revert removes it):")
    for orphan in report.orphans:
        lines.append(f"  ! {orphan.state.root}: sm120patch's state of {orphan.name} ({orphan.describe()}); that install "
                     "is gone (uninstalled, or another version now)")
    for path in report.temporaries:
        lines.append(f"  ! {path}: a temporary file of a run that was killed")
    following = status_next(report)
    if following:
        lines.append("")
        lines.extend(_next_lines(following))
    return coloured(fit("\n".join(lines)))


def render_brief(report: StatusReport) -> str:
    """`status --brief`: one answer per server (its headline), or, where no server is installed,
    per distribution; wrapped on a terminal, a command never broken."""
    chains = [item.chain for item in report.trees if item.chain is not None]
    if chains:
        answers = [c.headline for c in chains]
    else:
        answers = [f"{item.assessment.name} {item.assessment.raw_version}: {item.assessment.verdict.value}"
                   + (f" ({item.assessment.reason})" if item.assessment.reason else "") for item in report.trees]
    if not report.trees:
        answers = [f"none of the distributions sm120patch patches ({', '.join(report.registry_names)}) is installed "
                   "here; --python names the interpreter your server runs"]
    return coloured("\n".join(line for answer in answers for line in fill("", answer, "  ")))


def brief_note(report: StatusReport, text: str) -> str | None:  # noqa: ARG001 - show()'s note signature
    """`status --brief` without --python: which interpreter it looked at, on stderr."""
    return f"sm120patch: Python {report.target} (no --python given: {report.chosen_by})" if report.chosen_by else None


def status_next(report: StatusReport) -> tuple[NextStep, ...]:
    """What status says to do next: the chain's steps, else the apply command where something
    is not patched."""
    chains = [item.chain for item in report.trees if item.chain is not None]
    if chains:
        return next_step(chains)
    if report.exit_code == ExitCode.OK or not report.trees:
        return ()
    return (NextStep(report.apply_command, "something here is not patched", f"`{report.apply_command}`"),)


def _next_lines(steps: Sequence[NextStep]) -> list[str]:
    """One ``next:`` line, or numbered lines when there are several steps."""
    if len(steps) == 1:
        return fill("next: ", steps[0].words, "      ")
    return [line for i, step in enumerate(steps, 1)
            for line in fill(f"{'next:' if i == 1 else '':<5} {i}. ", step.words, " " * 9)]


def next_json(steps: Sequence[NextStep]) -> list[dict]:
    """``next`` in every --json document: what to run (null where it is no sm120patch command) and why."""
    return [{"command": step.command, "reason": step.reason} for step in steps]


def _jit_lines(item: TreeStatus, report: StatusReport) -> list[str]:
    jit = item.jit
    lines = [f"  JIT cache: {jit.base.cache_dir} (base: {jit.base.reason})"]
    if not jit.entries:
        lines.append(f"    no {item.distribution.jit_module} entries for {item.assessment.raw_version} "
                     "(FlashInfer builds one on first use)")
    module = item.distribution.jit_module
    incomplete = (f"incomplete (no {module}.so: a build that did not finish); the next start rebuilds it")
    building = (f"being built now (FlashInfer's lock cached_ops/tmp/{module}.lock is held, no {module}.so yet): a "
                "server's first start or `sm120patch build` is compiling it")
    for entry in jit.entries:
        if entry in jit.foreign:
            mark = (f"built from another environment's sources ({jit.foreign[entry]}): environments that share one JIT "
                    "cache share this entry, and a patch or revert in either one invalidates it"
                    + (f"; {building}" if entry in jit.building else
                       f"; {incomplete}" if entry in jit.incomplete else ""))
        elif entry in jit.stale:
            mark = f"STALE: built before the last change of its sources; `{report.apply_command}` removes it"
        elif entry in jit.building:
            mark = building
        elif entry in jit.incomplete:
            mark = incomplete
        else:
            mark = "current"
        lines.append(f"    {entry}: {mark}")
    for aside in jit.asides:
        lines.append(f"    {aside}: moved aside by an sm120patch run; the next apply or revert deletes it")
    return lines


def status_json(report: StatusReport) -> dict:
    out = {
        "target": report.target,
        "target_chosen_by": report.chosen_by or None,
        "python_version": report.python_version,
        "distributions": [],
        "aot_shadowing": [{"path": s.path, "source": s.source} for s in report.aot],
        "orphaned_state": [{"state": str(o.state.root), "install": o.name, "files": [str(f) for f in o.files]}
                           for o in report.orphans],
        "leftover_temporaries": [str(p) for p in report.temporaries],
        "changeable_by_others": [{"path": str(d), "by": who} for d, who in report.exposed],
        "next": next_json(status_next(report)),
    }
    for item in report.trees:
        a, tree = item.assessment, item.tree
        entry = {
            "name": a.name,
            "version": a.raw_version,
            "kind": tree.words.kind,
            "location": str(tree.root),
            "dist_info": str(tree.dist_info) if tree.dist_info is not None else None,
            "editable_checkout": str(item.routed_from) if item.routed_from else None,
            "state": a.verdict.value,
            "patch_set": a.patch_set.name if a.patch_set else None,
            "reason": a.reason or None,
            "fixed_in": str(item.distribution.fixed_in) if item.distribution.fixed_in else None,
            "interrupted_transaction": item.pending if item.pending_blocks else None,
            "in_progress": item.pending if item.pending and not item.pending_blocks else None,
            "dropped_by_reinstall": a.dropped_by_reinstall,
            "unpinned": bool(a.unpinned or (a.ledger and a.ledger.unpinned)),
            "pin_mismatch": item.pin,
            "advice": [{"level": level, "text": text} for level, text in item.advice_lines()],
            "fusion": None if item.chain is None else chain_json(item.chain),
            "patches": [],
            "jit_cache": None if item.jit is None else {
                "base": str(item.jit.base.path),
                "base_reason": item.jit.base.reason,
                "entries": [str(e) for e in item.jit.entries],
                "stale": [str(e) for e in item.jit.stale],
                "foreign": {str(k): str(v) for k, v in item.jit.foreign.items()},
                "asides": [str(e) for e in item.jit.asides],
                "incomplete": [str(e) for e in item.jit.incomplete],
                "building": [str(e) for e in item.jit.building],
            },
        }
        if a.patch_set:
            for patch in a.patch_set.patches:
                fa = a.files[patch.file]
                entry["patches"].append({
                    "id": patch.id, "file": patch.file, "required": patch.required,
                    "state": a.patch_state(patch).value,
                    "origin": fa.origin.value if fa.origin and a.patch_state(patch) is not State.PRISTINE else None,
                    "link": fa.link, "sha256": fa.sha256, "upstream": patch.upstream, "fixed_in": patch.fixed_in,
                    "detail": fa.detail or None,
                    "older_form": patch.id in fa.former,
                    "in_head": item.by_meaning.get(patch.id) if tree.judged_by_meaning else None,
                })
        elif item.by_meaning:
            entry["present_by_meaning"] = item.by_meaning
        out["distributions"].append(entry)
    return out


# -- apply / revert ---------------------------------------------------------------------------------

def render_change(report: ChangeReport) -> str:
    verb = {"apply": "patched", "revert": "restored", "build": "built"}[report.operation]
    lines = []
    if report.chosen_by:
        # Without --python the target was chosen for the user: say which one before what changed in it.
        lines.append(f"Python {report.target} (no --python given: {report.chosen_by})")
    if report.recovery:
        r = report.recovery
        lines.append(f"finished an interrupted {r.operation} (every change had been made)" if r.finished else
                     f"rolled back an interrupted {r.operation} ({counted(len(r.restored), 'change')} undone)"
                     if r.operation != "unknown" else "removed an unreadable journal (--force)")
    for name, path in report.routed:
        lines.append(f"{name} is an editable install of {path}: patching that checkout as a commit instead")
    for path in report.leftovers_removed:
        lines.append(f"removed {path}, left by an earlier run that was killed")
    for orphan in report.orphans_removed:
        lines.append(f"{'would remove' if report.dry_run else 'removed'} sm120patch's state of {orphan.name} "
                     f"({orphan.describe()}): that install is gone "
                     "(uninstalled, or another version now)")
    for result in report.results:
        lines += _result_lines(report, result, verb)
    if report.jit_base and (report.jit_removed or report.jit_sources_changed):
        base = report.jit_base
        lines.append(f"JIT cache base: {base.path} ({base.reason})")
        for path in report.jit_removed:
            lines.append(f"  {'would remove' if report.dry_run else 'removed'} stale entry {path}")
        if not report.jit_removed:
            lines.append("  no trtllm_comm entries to remove (FlashInfer builds one on first use)")
    for shadow in report.aot:
        lines.append(f"warning: prebuilt {shadow.path} ({shadow.source}): {AOT_HINT}")
    for built in report.builds:
        lines.append(f"built {built.module} for {built.archs} in {built.seconds:.0f} s: {built.entry}" if built.compiled
                     else f"{built.module} for {built.archs} was up to date (nothing compiled): {built.entry}")
        lines.append(f"  {built.proof}")
        if built.note:
            lines.append(f"  note: {built.note}")
        if built.libcuda:
            lines.append(f"  note: {built.libcuda}")
    lines += _tuned_lines(report)
    following = next_step(report.chains) if report.chains else ()
    if following and not report.dry_run:
        lines.extend(_next_lines(following))
    return "\n".join(lines) if report.dry_run else coloured(fit("\n".join(lines)))  # a diff is never wrapped


def _tuned_lines(report: ChangeReport) -> list[str]:
    """`apply --with tuned-limits`: what else it applied, the server's decisions as checked before
    the commit (or why they could not be), and which limits the server keeps (the tp step)."""
    lines = []
    if report.dry_run or not (report.tuned_brought or report.tuned):
        return lines
    for server, patch_id, summary in report.tuned_brought:
        lines += fill("", f"{server}: tuned-limits also applied {patch_id}: {summary}", "  ")
    for r in report.tuned:
        if r.required or r.ok is not True:
            state = {True: "checked", False: "FAILED", None: "not checked"}[r.ok]
            lines += fill("", f"{state}: {r.subject}: {r.detail}", "  ")
        else:  # the device the decisions were asked on
            lines += fill("", f"decisions checked in the target interpreter on a {r.detail}", "  ")
    for chain in report.chains:
        tp = chain.step("tp")
        if tp.result is StepResult.WARN:
            lines += fill("", f"{chain.server}: {tp.text}", "  ")
    return lines


def _result_lines(report: ChangeReport, result: Result, verb: str) -> list[str]:
    lines = _changed_lines(report, result, verb)
    tree = result.plan.assessment.tree if result.plan is not None else None
    if tree is not None and tree.words.shared_with and result.plan.files:
        lines.append(f"  note: {result.name} is installed in {tree.words.shared_with}")
    return lines


def _changed_lines(report: ChangeReport, result: Result, verb: str) -> list[str]:
    head = f"{result.name} {result.version}"
    if result.undo is not None:
        return [f"{head}: {result.undo.message}"]
    if result.plan is None:
        return [f"{head}: nothing to do: {result.message}"]
    plan = result.plan
    if not plan.files and not plan.adopted and plan.assessment.verdict is Verdict.OPT_IN_ONLY:
        opt_in = ", ".join(plan.assessment.patch_set.opt_in)
        return [f"{head}: nothing to change: every patch for this release is opt-in ({opt_in}; add --with)"]
    if report.dry_run:
        if not plan.files:
            return [f"{head}: already {verb}, nothing would change"]
        return [result.diff(p).rstrip("\n") for p in plan.files]
    lines = []
    for relpath in plan.adopted:
        lines.append(f"{head}: {relpath} was patched by hand, identical to the patch: recorded as applied "
                     "(revert restores the release's bytes)")
    if not plan.files:
        if not plan.adopted and report.operation == "revert" and plan.assessment.ledger is None:
            lines.append(f"{head}: nothing to revert (not patched)")
        elif not plan.adopted and report.operation == "revert" and plan.ledger_changes:
            lines.append(f"{head}: the files hold the release's bytes already (a reinstall put them back); removed "
                         "sm120patch's ledger and saved originals of them")
        elif not plan.adopted:
            lines.append(f"{head}: nothing to change (already {verb})")
        return lines
    if plan.assessment.unpinned and report.operation == "apply":
        lines.append(f"{head}: no patch set pins this release; applied {plan.assessment.patch_set.name} by meaning "
                     "(--force), recorded as unpinned:")
        lines += [result.diff(p).rstrip("\n") for p in plan.files]
    if result.commit is not None:
        lines.append(f"{head}: committed {result.commit.sha[:12]} on {result.commit.branch} "
                     f"({counted(len(result.commit.files), 'file')})"
                     + ("" if not plan.assessment.unpinned else "; unpinned: the files were not the release's bytes"))
        return lines
    lines.append(f"{head}: {verb} {counted(len(plan.files), 'file')}")
    for planned in plan.files:
        ids = ", ".join(planned.patches) if planned.patches else (planned.restore_from or "release bytes")
        if planned.relink:
            ids = f"symbolic link to {planned.relink} put back"
        before = planned.before[:12] if planned.before else "missing"
        extra = f"; was a symbolic link to {planned.replaces_link}" if planned.replaces_link else ""
        lines.append(f"  {planned.relpath}  [{ids}]  sha256 {before} -> {planned.after[:12]}{extra}")
    return lines


def change_json(report: ChangeReport) -> dict:
    return {
        "operation": report.operation,
        "dry_run": report.dry_run,
        "target": report.target,
        "target_chosen_by": report.chosen_by or None,
        "next": next_json(next_step(report.chains)) if report.chains and not report.dry_run else [],
        "changed": report.changed if not report.dry_run else False,
        # Whatever the run would count as a change (Ansible's check mode reports it as changed).
        "would_change": (any((r.plan and not r.plan.empty) or (r.undo and r.undo.changed) for r in report.results)
                         or bool(report.orphans_removed)
                         or bool(report.jit_removed)) if report.dry_run else None,
        "recovered": None if report.recovery is None else {
            "operation": report.recovery.operation, "undone": list(report.recovery.restored),
            "finished": report.recovery.finished},
        "routed": [{"name": n, "checkout": str(p)} for n, p in report.routed],
        # apply --with tuned-limits: what it also applied, and the server's decisions checked before the commit.
        "tuned": {"also_applied": [{"server": s, "patch": i, "summary": t} for s, i, t in report.tuned_brought],
                  "checks": [{"subject": r.subject, "ok": r.ok, "detail": r.detail} for r in report.tuned]}
        if report.tuned_brought or report.tuned else None,
        "leftovers_removed": [str(p) for p in report.leftovers_removed],
        "orphans_removed": [{"state": str(o.state.root), "files": [str(f) for f in o.files]}
                            for o in report.orphans_removed],
        "results": [
            {
                "name": r.name,
                "version": r.version,
                "kind": r.kind,
                "message": r.message or None,
                "commit": None if r.commit is None else {"branch": r.commit.branch, "sha": r.commit.sha,
                                                         "files": list(r.commit.files)},
                "undo": r.undo.message if r.undo else None,
                "adopted": list(r.plan.adopted) if r.plan else [],
                "files": [
                    {"file": f.relpath, "patches": list(f.patches), "before": f.before, "after": f.after,
                     "diff": r.diff(f) if report.dry_run else None}
                    for f in (r.plan.files if r.plan else ())
                ],
            }
            for r in report.results
        ],
        "left": [{"name": x.name, "version": x.version, "error": x.error.message, "hint": x.error.hint}
                 for x in report.left],
        "jit_cache_removed": [str(p) for p in report.jit_removed] if not report.dry_run else [],
        "jit_cache_would_remove": [str(p) for p in report.jit_removed] if report.dry_run else [],
        "jit_cache_base": str(report.jit_base.path) if report.jit_base else None,
        "aot_shadowing": [{"path": s.path, "source": s.source} for s in report.aot],
        "build_error": report.build_error.message if report.build_error else None,
        "builds": [{"module": b.module, "entry": str(b.entry), "archs": b.archs, "seconds": round(b.seconds, 1),
                    "compiled": b.compiled,
                    "proof": b.proof, "note": b.note, "libcuda_stub": b.libcuda} for b in report.builds],
    }


def render_diff(report: ChangeReport) -> str:
    return "".join(r.diff(p) for r in report.results for p in (r.plan.files if r.plan else ()))


def diff_note(report: ChangeReport, diff: str) -> str | None:
    """Said on stderr when there is no diff (stdout stays a patch file, empty)."""
    if diff:
        return None
    return "sm120patch: nothing to apply: " + "; ".join(
        f"{r.name} {r.version} is {'already patched' if r.plan else r.message}" for r in report.results)


# -- list -----------------------------------------------------------------------------------------

def _lowest(versions) -> Version:
    """A range's lowest release (0 where it has no lower bound: "before 0.10.0")."""
    return min((Version(s.version) for s in versions if s.operator in (">=", ">", "==", "~=")), default=Version("0"))


def _ranges(versions) -> str:
    return f"{versions[0]}" if len(versions) == 1 else f"{versions[0]} to {versions[-1]}"


def _installed_line(distribution, installed: dict) -> str:
    dist = installed.get(distribution.name)
    if dist is None:
        return "  installed there: none"
    patch_set = distribution.find(dist.version)
    pinned = f"patch set {patch_set.name}" if patch_set is not None else "no patch set pins it: `status` says why"
    return f"  installed there: {dist.raw_version} ({pinned})"


def render_list(registry, installed: dict | None = None, target: str | None = None) -> str:
    """The support matrix: release ranges -> patch ids (required / opt-in) -> upstream fix;
    ``installed``: name -> the distribution installed in the environment asked about (``target``)."""
    lines = [f"Python {target}: what is installed there is marked \"installed there\"", ""] if target else []
    for distribution in registry:
        sets = sorted(distribution.patch_sets, key=lambda ps: min(ps.versions))
        fixed = distribution.fixed_in
        lines.append(f"{distribution.name} ({distribution.selector})"
                     + (f"  fixed upstream from {fixed}: {distribution.upstream}" if fixed else "  no upstream release fixes it"))
        if installed is not None:
            lines.append(_installed_line(distribution, installed))
        # The columns line up within a distribution: its longest range and its longest list set them.
        rows = [(_ranges(sorted(ps.versions)), counted(len(ps.versions), "release"),
                 ", ".join(p.id for p in ps.patches if p.required) or "none", ", ".join(ps.opt_in) or "none")
                for ps in sets]
        width = max([28, *(len(r[0]) for r in rows)])
        listed = max([4, *(len(r[2]) for r in rows)])
        # Every row in release order (a patch set's first release, a range's lowest bound), so that
        # the releases too old for a wheel come first, not after the newest patch set.
        ordered = [(min(ps.versions), f"  {span:<{width}} {count:<12} {required:<{listed}}  opt-in: {optional}")
                   for ps, (span, count, required, optional) in zip(sets, rows)]
        ordered += [(Version(version), f"  {version:<{width}}  sdist only: not supported (no RECORD to check against)")
                    for version in distribution.sdist_only]
        ordered += [(_lowest(uncovered.versions), f"  {_spec_words(uncovered.versions):<{width}}  not covered: "
                     f"{uncovered.reason}") for uncovered in distribution.not_covered]
        ordered += [(_lowest(exempt.versions), f"  {_spec_words(exempt.versions):<{width}}  nothing to patch: "
                     f"{exempt.reason.replace(' {version}', '')}") for exempt in distribution.nothing_to_patch]
        if fixed:
            ordered.append((Version(str(fixed)), f"  {str(fixed) + ' and later':<{width}}  native SM120 support: "
                            "nothing to patch"))
        lines += [line for _, line in sorted(ordered, key=lambda row: row[0])]
    return fit("\n".join(lines))


def list_json(registry, installed: dict | None = None) -> dict:
    return {
        d.name: {
            "selector": d.selector,
            **({"installed": getattr(installed.get(d.name), "raw_version", None)} if installed is not None else {}),
            "fixed_in": str(d.fixed_in) if d.fixed_in else None,
            "sdist_only": list(d.sdist_only),
            "nothing_to_patch": [{"versions": str(n.versions), "reason": n.reason} for n in d.nothing_to_patch],
            "not_covered": [{"versions": str(n.versions), "reason": n.reason} for n in d.not_covered],
            "releases": {
                str(v): {
                    "patch_set": ps.name,
                    "required": [p.id for p in ps.patches if p.required],
                    "opt_in": list(ps.opt_in),
                    "upstream": {p.id: {"reference": p.upstream, "fixed_in": p.fixed_in} for p in ps.patches},
                }
                for ps in d.patch_sets for v in sorted(ps.versions)
            },
        }
        for d in registry
    }



# -- verify ----------------------------------------------------------------------------------------

def render_verify(verified: VerifyReport) -> str:
    report, results = verified.status, verified.results
    lines = [f"Python {report.target} ({report.python_version})"]
    if not results:
        lines.append("  nothing to verify: none of the distributions sm120patch patches is installed here; --python names "
                     "the interpreter your server runs")
    for r in results:
        mark = {True: "PASS", False: "FAIL", None: "SKIP" if not r.required else "NOT RUN"}[r.ok]
        lines.append(f"{mark:<4}  {r.kind:<8} {r.subject}: {r.detail}")
    code = verified.exit_code
    failed = sum(1 for r in results if r.ok is False)
    not_run = sum(1 for r in results if r.ok is None and r.required)
    counts = [f"{counted(failed, 'check')} failed"] * bool(failed) + [f"{counted(not_run, 'check')} you asked for could not run"] * bool(not_run)
    lines.append("verified" if code is ExitCode.OK else "NOT verified" + (f": {', '.join(counts)}" if counts else ""))
    return fit("\n".join(lines))


def verify_json(verified: VerifyReport) -> dict:
    report, results = verified.status, verified.results
    return {
        "target": report.target,
        "verified": verified.exit_code is ExitCode.OK,
        "checks": [{"kind": r.kind, "subject": r.subject, "ok": r.ok, "ran": r.ok is not None,
                    "required": r.required, "detail": r.detail} for r in results],
    }


def render_addition(result, *, check: bool) -> str:
    """`manifest add`: the review summary of one release (what was, or would be, written), or
    the evidence why no set fits."""
    head = f"{result.distribution} {result.version}"
    if result.outcome != "pinned" and result.outcome != "missing":
        return f"{head}: {result.reason}"
    lines = []
    if result.outcome == "pinned":
        ps = result.patch_set
        where = f"new file {ps.path.with_name(result.version + '.toml').name} (a copy of {ps.name})" if result.new_file \
            else ps.name
        verb = "would pin it to" if check else "pinned to"
        lines.append(f"{head}: {verb} {where}; every rewriter found its pinned sites and every check passes")
        previous = f"{result.distribution} {result.previous}" if result.previous else "no earlier release"
        for review in result.files:
            lines.append(f"  {review.relpath}  sha256 {review.sha256[:16]}…  {review.compared} ({previous})")
        for path in result.written:
            lines.append(f"  wrote {path}")
        for review in result.files:
            lines.append("")
            lines.append(review.diff.rstrip("\n"))
        return "\n".join(lines)
    lines.append(f"{head}: no patch set fits; nothing was written")
    for attempt in result.tried:
        lines.append(f"  {attempt.patch_set.name} (pinned to {_ranges(sorted(attempt.patch_set.versions))}):")
        lines.extend(f"    {problem}" for problem in attempt.problems)
        if attempt is result.tried[0] and result.previous:
            for relpath, digest in attempt.hashes.items():
                before = result.previous_hash(relpath)
                if before is not None:
                    same = "identical to" if before == digest else "changed since"
                    lines.append(f"    {relpath}: {same} {result.distribution} {result.previous}, where every "
                                 "rewriter finds its pinned count")
    return "\n".join(lines)


# -- doctor ---------------------------------------------------------------------------------------

def render_doctor(report: DoctorReport) -> str:
    marks = {"ok": "ok  ", "info": "info", "warn": "WARN"}
    # The first line says which interpreter the environment's lines are about.
    head = [] if report.target is None else fill("", f"Python {report.target}" + (
        f" ({report.python_version})" if report.python_version else "") + (
        f" (no --python given: {report.chosen_by})" if report.chosen_by else ""), "  ")
    return coloured("\n".join(head) + "\n" * bool(head) + "\n".join(line for f in report.findings for line in fill(f"{marks[f.level]}  ", f.text, " " * 6)))


def doctor_json(report: DoctorReport) -> dict:
    facts = report.driver
    return {
        "target": report.target,
        "target_chosen_by": report.chosen_by or None,
        "gpus": [g.__dict__ for g in report.gpus],
        "driver": None if facts is None else {
            "error": facts.error,
            "version": facts.version_text,
            "devices": [{"index": d.index, "name": d.name, "capability": d.sm, "multicast": d.multicast,
                         "posix_fd_handles": d.posix_fd_handles, "fabric_handles": d.fabric_handles}
                        for d in facts.devices],
            "peer_access": {f"{i}-{j}": ok for (i, j), ok in facts.peer_access.items()},
        },
        "libcuda": None if report.libcuda is None else {
            "kind": report.libcuda.kind, "path": str(report.libcuda.path) if report.libcuda.path else None,
            "cuda_home": str(report.libcuda.cuda_home)},
        "topology": None if report.topology is None else {
            "gpus": report.topology.gpus,
            "pcie_only": report.topology.pcie_only,
            "links": {f"{a}-{b}": link for (a, b), link in report.topology.links.items()},
        },
        "findings": [f.__dict__ for f in report.findings],
    }


# -- bench ----------------------------------------------------------------------------------------

def render_bench(report: BenchReport) -> str:
    meta = report.meta
    lines = [
        f"{report.request.kernels} {meta.get('flashinfer')} · torch {meta.get('torch')} (CUDA {meta.get('cuda')}) · "
        f"{report.world_size} × {meta.get('device')} (compute capability {meta.get('capability')}) · {report.request.dtype}",
        f"check: fused allreduce + residual + RMSNorm vs NCCL allreduce + float32 RMSNorm, "
        f"|err| <= {report.atol:g} + {report.rtol:g}·|ref| (norm and residual outputs, every rank)",
    ]
    for path in meta.get("server_paths", ()):
        lines.append(f"server path: {path['server']}: " + _server_path_text(path))
    timed = report.timed
    for series in report.series():
        lines.append("")
        lines.append(f"hidden {series.hidden}, {series.strategy}")
        header = f"  {'tokens':>6}  {'size':>8}  {'path':<8}  {'check':<5}  {'max err':>8}"
        if timed:
            header += f"  {'fused µs':>9}  {'NCCL+norm µs':>12}  {'speedup':>7}"
        lines.append(header)
        for c in series.cases:
            row = (f"  {c.tokens:>6}  {_size(c.bytes):>8}  {c.effective_strategy:<8}  {'ok' if c.ok else 'FAIL':<5}"
                   f"  {max(c.max_err_norm, c.max_err_residual):>8.4g}")
            if timed and c.fused_us is not None:
                row += f"  {c.fused_us:>9.1f}  {c.unfused_us:>12.1f}  {c.speedup:>6.2f}×"
            lines.append(row + ("" if c.ranks_agree else "  ranks disagree"))
        if timed:
            win, loss = series.wins_up_to, series.first_loss
            if win is None:
                lines.append("  crossover: unfused is faster from the smallest size")
            elif loss is None:
                lines.append(f"  crossover: none measured; fused is faster up to {counted(win.tokens, 'token')} ({_size(win.bytes)})")
            else:
                lines.append(f"  crossover: fused is faster up to {counted(win.tokens, 'token')} ({_size(win.bytes)}), "
                             f"slower from {counted(loss.tokens, 'token')} ({_size(loss.bytes)})")
    graphs = [c.graphs for c in report.cases if c.graphs is not None]
    if graphs:
        lines.append("")
        lines.append("timing: median of CUDA-graph replays" if all(graphs) else
                     "timing: median of eager launches (some calls could not be captured in a CUDA graph)")
    recommendation = report.recommendation()
    if recommendation:
        lines.append("")
        lines.append("Recommendation for this machine (unfused = NCCL; SGLang's own custom allreduce can beat NCCL "
                     "on small messages, so treat a narrow fused win as a tie):")
        lines.append(f"  SGLang: {recommendation.sglang_text}")
        lines.append(f"  vLLM:   {recommendation.vllm_text}")
    if report.advice:
        lines.append("")
        lines.append("When you run the server:")
        lines.extend(f"  {'!' if level == 'warn' else 'note:'} {text}" for _, level, text in report.advice)
    return "\n".join(lines)


def _server_path_text(path: dict) -> str:
    made = ("FlashInfer's unified workspace created as the server creates it" if path["workspace"] == "unified"
            else "the legacy call (trtllm_create_ipc_workspace_for_all_reduce_fusion), the one bench itself makes")
    return made + (f"; its own preflight: {path['preflight']}" if path.get("preflight") else "")


def bench_json(report: BenchReport) -> dict:
    recommendation = report.recommendation()
    return {
        "target": str(report.request.python) if report.request.python else None,
        "python": str(report.request.python),
        "world_size": report.world_size,
        "dtype": report.request.dtype,
        **{k: report.meta.get(k) for k in ("flashinfer", "torch", "cuda", "nccl", "device", "capability")},
        "tolerance": {"atol": report.atol, "rtol": report.rtol},
        "server_paths": report.meta.get("server_paths", []),
        "ok": not report.failed,
        "cases": [dict(c.__dict__, speedup=c.speedup) for c in report.cases],
        "advice": [{"distribution": name, "level": level, "text": text} for name, level, text in report.advice],
        "recommendation": None if recommendation is None else {
            "sglang_enable_fusion": recommendation.sglang,
            "sglang": recommendation.sglang_text,
            "vllm_fi_allreduce_fusion_max_size_mb": recommendation.vllm_max_size_mb,
            "vllm": recommendation.vllm_text,
        },
    }


def _timing(row: dict, column: str) -> str:
    median = row.get(f"{column}_us")
    if median is None:
        return "-"
    q1, q3 = row.get(f"{column}_iqr_us") or (median, median)
    return f"{median:.1f} [{q1:.1f}-{q3:.1f}]"


def render_tune(report: TuneReport) -> str:
    meta, entry, limits = report.meta, report.entry, report.limits
    world = report.world_size
    hidden, dtype = entry["hidden"], entry["dtype"]
    pairs = world * (world - 1) // 2
    rows = meta["tune"]["rows"]
    names = {"oneshot": "one-shot", "twoshot": "two-shot", "nccl": "NCCL+norm", "sglang-pcie-ipc": "SGLang PCIe-IPC",
             "vllm-pcie-ipc": "vLLM PCIe-IPC"}
    servers = meta["tune"].get("pcie_ipc", [])
    timed = [s for s in servers if any(f"{s['column']}_us" in row for row in rows)]  # made, and run at some size
    checked = ["one-shot", "two-shot", "NCCL + fused_add_rmsnorm"] + [f"{names[s['name']]} + fused_add_rmsnorm"
                                                                       for s in timed]
    lines = [
        f"{report.request.kernels} {meta.get('flashinfer')} · torch {meta.get('torch')} (CUDA {meta.get('cuda')}) · "
        f"{world} × {meta.get('device')} (compute capability {meta.get('capability')}) · {dtype} · hidden {hidden}",
        f"pairs: every pair of ranks completed a fused call and matched the reference ({counted(pairs, 'pair')})",
        f"check: {', '.join(checked[:-1])} and {checked[-1]} each matched NCCL allreduce + float32 RMSNorm "
        "at every size where it ran, before it was timed",
        f"timing: µs per call, median [interquartile range] of {counted(report.request.repeats, 'repetition')} "
        "(each the slowest rank's), in CUDA graphs" if all(r.get("graphs") for r in rows) else
        f"timing: µs per call, median [interquartile range] of {counted(report.request.repeats, 'repetition')} "
        "(each the slowest rank's), some as eager launches (not capturable in a CUDA graph)",
    ]
    if meta.get("collectives", "nccl") != "nccl":  # the test-only SM120PATCH_TUNE_ONE_GPU
        lines.append("ranks: every rank on GPU 0 (SM120PATCH_TUNE_ONE_GPU, for tests): the collectives went over gloo "
                     "through host memory, so NCCL below means gloo, and the ranks took turns on the GPU: no figure "
                     "here is a server's")
    for server in servers:
        said = f"{server['server']}'s PCIe-IPC allreduce ({server['switch']}, fusion off)"
        if server["error"]:
            lines.append(f"warning: {said} could not be made here: {server['error']}; a server started with "
                         f"{server['switch']} would not run it either: tuned without it")
            continue
        skipped = [r["tokens"] for r in rows if server["name"] in r.get("not_run", ())]
        lines.append(f"{names[server['name']]}: {said}, made with {server['how']}, its workspace sized for "
                     f"{counted(server['rows'], 'token')}" + (
                         f"; not run at {', '.join(map(str, skipped))} tokens (the server sends those to NCCL)"
                         if skipped else ""))
    columns = [("one-shot", "oneshot"), ("two-shot", "twoshot"), ("NCCL+norm", "unfused")] + [
        (names[s["name"]], s["column"]) for s in timed]
    lines += ["", f"  {'tokens':>6}  {'size':>8}" + "".join(f"  {title:>22}" for title, _ in columns)]
    for row in rows:
        tokens = f"{row['tokens']}*" if row.get("probe") else str(row["tokens"])
        lines.append(f"  {tokens:>6}  {_size(row['bytes']):>8}" + "".join(
            f"  {_timing(row, column):>22}" for _, column in columns))
    if any(row.get("probe") for row in rows):
        lines.append("  * measured to narrow a limit down (between two sizes asked for, the same checks and "
                     "repetitions)")
    for tie in limits.ties:
        lines.append(f"  tie at {_size(tie['bytes'])}: {' and '.join(names.get(p, p) for p in tie['paths'])} are within "
                     "the noise of the repetitions (their interquartile ranges and their medians' notches overlap)")
    lines.append("")
    last_fused = max((r["tokens"] for r in rows if r["bytes"] <= limits.fused_max_bytes), default=0)
    if limits.never_fused:
        lines.append(f"limits at TP{world}: never fused")
    else:
        lines.append(f"limits at TP{world}: one-shot up to {_size(limits.oneshot_max_bytes)} per rank, fused up to "
                     f"{_size(limits.fused_max_bytes)} ({counted(last_fused, 'token')} at hidden {hidden}), unfused beyond")
    lines.append(f"verdict: {limits.verdict}")
    written = report.profile
    if written is not None:
        done = [f"wrote the TP{world} limits into {written.path}"]
        if written.foreign_owner:
            done.append(f"replacing a file {written.foreign_owner} owned (nothing of it kept)")
        elif written.other_box:
            done.append("replacing a profile made on another box")
        elif written.replaced_tp:
            done.append(f"replacing its earlier TP{world} entry")
        if written.kept:
            done.append("keeping " + ", ".join(f"TP{tp}" for tp in written.kept))
        lines.append("profile: " + "; ".join(done))
        lines.append("  it holds for this box (its GPUs, PCIe paths, driver), these releases and NCCL settings; "
                     "servers patched with tuned-limits read it at start" + (
                         "" if written.where_servers_look else
                         f" if their environment has SM120PATCH_TUNED_LIMITS={written.path}"))
    else:
        lines.append("profile: not written (below)")
    return "\n".join(lines)


def tune_json(report: TuneReport) -> dict:
    return {
        "python": str(report.request.python),
        "world_size": report.world_size,
        **{k: report.meta.get(k) for k in ("flashinfer", "torch", "cuda", "nccl", "collectives", "device",
                                           "capability")},
        "entry": report.entry,
        "profile": None if report.profile is None else {
            "path": str(report.profile.path), "replaced_tp": report.profile.replaced_tp,
            "other_box": report.profile.other_box, "kept": list(report.profile.kept),
            "foreign_owner": report.profile.foreign_owner},
        "pcie_ipc": report.meta["tune"].get("pcie_ipc", []),
        "errors": [error.message for error in report.errors],
    }


def render_list_report(report) -> str:
    return render_list(report.registry, report.installed, report.target)


def list_report_json(report) -> dict:
    return {"target": report.target, "distributions": list_json(report.registry, report.installed)}


def render_export(report) -> str:
    return "\n".join(f"wrote {path}" for path in report.written)


def render_manifests(report) -> str:
    return "\n".join(f"{'ok     ' if same else 'DIFFERS'} {path}" if report.check else f"wrote {path}"
                     for path, same in report.results)


def render_additions(report) -> str:
    if report.newer and not report.results:
        return f"{report.distribution}: no release on the index is newer than the newest sm120patch knows"
    return "\n\n".join(render_addition(result, check=report.check) for result in report.results)


# -- check-log ---------------------------------------------------------------------------------------

def render_log_check(report) -> str:
    if report.replicas:  # several replicas in one stream: each one's block, then the worst verdict
        blocks = [_log_check_lines(r) for r in report.replicas]
        overall = [f"{report.source}: {counted(len(report.replicas), 'replica')}, {counted(report.lines, 'line')} "
                   f"read; each replica's newest run decides its verdict, the worst decides the exit code",
                   f"verdict: {report.summary}"]
        if report.fix:
            overall.append(f"  fix ({report.replica}): {report.fix}")
        return coloured(fit("\n\n".join("\n".join(b) for b in [*blocks, overall])))
    return coloured(fit("\n".join(_log_check_lines(report))))


def _log_check_lines(report) -> list[str]:
    what = report.server or "the server"
    release = f"{what} {report.version} (from {report.version_from})" if report.version else what
    named = f"{report.source} ({report.replica})" if report.replica else report.source
    lines = [f"{named}: {release}, {counted(report.lines, 'line')} read"]
    if report.runs > 1:
        lines.append(f"run {report.run} of {report.runs} (from line {report.run_line}): the newest run decides")
    if report.ranks:
        expected = f" of {report.expected_ranks}" if report.expected_ranks is not None else ""
        lines.append(f"ranks ({len(report.ranks)}{expected} seen):")
        lines += [f"  {r.rank}: {r.verdict}: {r.detail}" for r in report.ranks]
    if report.crash is not None:
        c = report.crash
        lines.append(f"  the server's line: {c.marker}" if c.printed_by is None
                     else f"  the line ({c.printed_by}): {c.marker}")
        if c.exception:
            lines.append(f"  exception: {c.exception}")
        if c.frame:
            lines.append(f"  last frame: {c.frame}")
            # Not patched here, yet a fix may still be sm120patch's: the gate that led to this frame.
            lines.append(f"    sm120patch patches this file ({c.patched_by})" if c.patched_by
                         else "    a file sm120patch does not patch; the fix below patches the gate that leads here"
                         if "sm120patch apply" in (report.fix or "") else "    a file sm120patch does not patch")
    for seen in report.seen:
        lines.append(f"  seen: {seen}")
    for note in report.notes:
        lines.append(f"  note: {note}")
    if report.predicted is not None:
        lines.append(f"  status predicted: {report.predicted.headline}")
    lines.append(f"verdict: {report.summary}")
    if report.step:
        lines.append(f"  step: {report.step}")
    if report.fix:
        lines.append(f"  fix: {report.fix}")
    if report.timed_out:
        lines.append("  (--follow: the timeout passed before a final verdict)")
    elif not report.final and report.verdict != "starting":
        lines.append("  (not final: later lines may change it)")
    return lines


def log_check_json(report) -> dict:
    crash = report.crash._asdict() if report.crash is not None else None
    return {"source": report.source, "server": report.server, "version": report.version,
            "version_from": report.version_from or None, "verdict": report.verdict, "final": report.final,
            "summary": report.summary, "step": report.step, "fix": report.fix, "message": report.message,
            "backend": report.backend, "expected_ranks": report.expected_ranks,
            "ranks": [r._asdict() for r in report.ranks], "crash": crash, "notes": list(report.notes),
            "seen": list(report.seen), "lines": report.lines, "timed_out": report.timed_out,
            "run": report.run, "runs": report.runs, "run_line": report.run_line,
            "predicted": chain_json(report.predicted) if report.predicted is not None else None,
            "replica": report.replica, "replicas": [log_check_json(r) for r in report.replicas],
            "next": [{"command": command, "reason": report.summary}
                     for command in _COMMAND_OF_SM120PATCH.findall(report.fix or "")[-1:]]}
