"""What the commands return: plain values the renderer turns into text or --json, each with its
exit code. No I/O here, and nothing is decided after the report is made."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping, NamedTuple, Sequence

from sm120patch.assess import Assessment, status_exit_code
from sm120patch.distributions import Advice, Distribution
from sm120patch.errors import ExitCode, RefusedError, Sm120PatchError
from sm120patch.records import AotShadow, CacheBase, Commit, JitStatus, Recovery, Undo
from sm120patch.state import Orphan

if TYPE_CHECKING:
    from sm120patch.chain import Chain
    from sm120patch.plan import Plan, PlannedFile
    from sm120patch.trees import Tree


# -- status ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CheckResult:
    """One check of `verify` (and of the tuned-limits check `apply` runs before its commit point)."""
    kind: str  # static / semantic / runtime / compile / build / tuned
    subject: str
    ok: bool | None  # None: it could not run (the detail says what it needs)
    detail: str
    required: bool = True  # a check that could not run fails verify, unless it is only informative
    broken: bool = False  # the server's patched code raised or did not import: a server would crash


class TreeStatus(NamedTuple):
    assessment: Assessment
    pending: str | None = None  # an interrupted run (or one in progress), in words
    pending_blocks: bool = False  # an interrupted run: status exits 3
    by_meaning: Mapping[str, bool] = MappingProxyType({})  # patch id -> present, by its semantic check
    advice: Sequence[Advice] = ()
    pin: str | None = None
    jit: JitStatus | None = None
    routed_from: Path | None = None  # an editable install, shown as its checkout
    chain: Chain | None = None  # a server's fusion chain (chain.py)
    with_raw_version: str = ""  # the installed release of the distribution's fusion_with
    branch: str | None = None  # sm120patch's branch in a checkout
    branch_error: Sm120PatchError | None = None  # its note could not be read: the text report says so
    # vLLM: the one --compilation-config that turns its pass on and sizes it for this box, in
    # words (the value and where it comes from); advice names it as {compilation_config}.
    compilation_config: str = ""

    def advice_lines(self, *, bench: bool = False) -> list[tuple[str, str]]:
        """(level, sentence) for each piece of advice (``bench``: only what bench prints too)."""
        return [(a.level, a.render(self.assessment.raw_version, self.with_raw_version)
                 .replace("{compilation_config}", self.compilation_config))
                for a in self.advice if a.bench or not bench]

    @property
    def tree(self) -> Tree:
        return self.assessment.tree

    @property
    def distribution(self) -> Distribution:
        return self.assessment.distribution


class StatusReport(NamedTuple):
    target: str
    python_version: str | None
    trees: list[TreeStatus]
    aot: list[AotShadow]
    chosen_by: str = ""  # no --python: why this interpreter is the target
    registry_names: tuple[str, ...] = ()
    apply_command: str = "sm120patch apply"  # for this same target, as it can be copied
    verbose_command: str = "sm120patch status --verbose"  # the whole table, for this same target
    orphans: Sequence[Orphan] = ()  # state of installs that are gone, in the install locations looked at
    temporaries: Sequence[Path] = ()  # files a killed run left in the state roots
    exposed: Sequence[tuple[Path, str]] = ()  # as root: directories on the way to a target another user can change, and who

    errors = ()  # every finding is in the report

    @property
    def exit_code(self) -> ExitCode:
        return status_exit_code([t.assessment.verdict for t in self.trees],
                                interrupted=any(t.pending_blocks for t in self.trees))


# -- apply, revert, diff, build ---------------------------------------------------------------------

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
    diff_paths: Mapping[str, str] = field(default_factory=dict)  # relpath -> its path in a diff

    def diff(self, planned: PlannedFile) -> str:
        """Paths from the package root (site-packages) for an install, from the repository root
        for a checkout: `patch -p1` and `git apply` accept either where it was made."""
        return planned.diff(self.diff_paths[planned.relpath])


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
    chosen_by: str = ""  # no --python: why this interpreter is the target
    results: list[Result] = field(default_factory=list)
    left: list[Left] = field(default_factory=list)
    recovery: Recovery | None = None
    jit_removed: list[Path] = field(default_factory=list)
    jit_base: CacheBase | None = None  # set when a JIT module's sources were looked at
    jit_sources_changed: bool = False
    aot: list[AotShadow] = field(default_factory=list)
    routed: list[tuple[str, Path]] = field(default_factory=list)
    leftovers_removed: list[Path] = field(default_factory=list)
    orphans_removed: list[Orphan] = field(default_factory=list)  # state of installs that are gone
    builds: list = field(default_factory=list)  # jitbuild.BuildResult, apply --build
    chains: list = field(default_factory=list)  # each server's fusion chain once the run is over (apply)
    build_error: Sm120PatchError | None = None  # apply --build: the change was made, the build failed
    tuned: list = field(default_factory=list)  # apply --with tuned-limits: verify's tuned checks, run before the commit
    tuned_profile: object = None  # the profile those checks ran under (tunedlimits.Profile)
    tuned_brought: list = field(default_factory=list)  # (server, patch id, summary) --with tuned-limits also applied

    @property
    def errors(self) -> list[Sm120PatchError]:
        """What failed after the report's changes were made (those stand): each is printed as an error."""
        left = [RefusedError(f"{x.name} {x.version} was not reverted: {x.error.message}", hint=x.error.hint)
                for x in self.left]
        return left + ([self.build_error] if self.build_error is not None else [])

    @property
    def exit_code(self) -> ExitCode:
        if self.build_error is not None:
            # apply --build: the patch was applied; whatever stopped the build (it failed, could
            # not start, was interrupted) is a failed build, never "bad input" or "rolled back".
            return ExitCode.NOT_OK
        return ExitCode.REFUSED if self.left else ExitCode.OK

    @property
    def changed(self) -> bool:
        return bool(self.jit_removed or self.leftovers_removed or self.orphans_removed or self.recovery or any(b.compiled for b in self.builds)
                    or any((r.plan and not r.plan.empty) or r.commit or (r.undo and r.undo.changed)
                           for r in self.results))


# -- list, export and the maintainer's commands ----------------------------------------------------

class ListReport(NamedTuple):
    """`list`: every release sm120patch knows; with --python, what is installed in the target."""

    registry: object  # distributions.Registry
    installed: Mapping[str, object] | None = None  # name -> the installed distribution (--python)
    target: str | None = None
    errors = ()
    exit_code = ExitCode.OK


class ExportReport(NamedTuple):
    """`export`: the patch files written."""

    written: Sequence[Path]
    errors = ()
    exit_code = ExitCode.OK


class ManifestReport(NamedTuple):
    """`manifest build`: each manifest written, or (``check``) whether the committed one is identical."""

    results: Sequence[tuple[Path, bool]]
    check: bool
    errors = ()

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode.NOT_OK if self.check and not all(same for _, same in self.results) else ExitCode.OK


class AdditionReport(NamedTuple):
    """`manifest add`: what was (``check``: would be) done for each release asked about; the
    refusal when no set fits one of them."""

    distribution: str
    results: Sequence[object]  # releases.Addition
    check: bool
    newer: bool
    errors: Sequence[Sm120PatchError] = ()

    @property
    def exit_code(self) -> ExitCode:
        if self.errors:
            return self.errors[0].exit_code
        return ExitCode.NOT_OK if self.check and any(r.outcome == "pinned" for r in self.results) else ExitCode.OK


# -- check-log -------------------------------------------------------------------------------------

# The verdicts `check-log` gives (logcheck.py decides; the README's "Is it fusing?" lists them).
FUSED, FELL_BACK, CRASHED, STARTING, NOT_REQUESTED, UNKNOWN_RELEASE = (
    "fused", "fell-back", "crashed", "starting", "not-requested", "unknown-release")


class Crash(NamedTuple):
    """The exception a process of the server died of, as its log shows it."""

    marker: str  # the server's own line saying the process is going down
    exception: str | None = None  # the last exception line of its traceback
    frame: str | None = None  # its last frame: 'File "...", line N, in f'
    frame_file: str | None = None
    patched_by: str | None = None  # "sglang: backend-resolve, ..." when sm120patch patches that file
    printed_by: str | None = None  # a death outside Python: who prints the line (libtorch, the shell)


class RankVerdict(NamedTuple):
    """One process of the server (an SGLang TP rank, a vLLM worker) and what its lines say."""

    rank: str  # as the log names it: "TP3", "Worker_TP1"
    verdict: str
    detail: str  # the line (or the stage) the verdict rests on


@dataclass
class LogCheckReport:
    """`check-log`: the verdict a server's log gives, per rank and overall."""

    source: str  # the file read, or "-"
    server: str | None
    version: str | None
    version_from: str  # "--version", "--python", "the log", or "" (not known)
    verdict: str
    summary: str  # the overall line, in words
    final: bool  # nothing later in the log can change it (else: still starting, or --follow timed out)
    step: str | None = None  # the chain step that explains a fall-back or crash
    fix: str | None = None
    message: str | None = None  # the server's own line behind the verdict
    backend: str | None = None
    ranks: Sequence[RankVerdict] = ()
    expected_ranks: int | None = None  # the TP size the settings line gives
    crash: Crash | None = None
    notes: Sequence[str] = ()
    seen: Sequence[str] = ()  # an unknown release: the fusion-related lines that were there
    lines: int = 0
    timed_out: bool = False
    run: int = 1  # the run of the server the verdict is about (the newest in the log) ...
    runs: int = 1  # ... of how many the log holds
    run_line: int = 1  # the line that run begins at
    predicted: Chain | None = None  # --python: what status judges for this server's environment
    replica: str | None = None  # the stream's name for the replica (kubectl --prefix: "pod/NAME/CONTAINER")
    replicas: Sequence["LogCheckReport"] = ()  # several replicas in one stream: each one's report (this is the worst's)
    errors = ()

    @property
    def exit_code(self) -> ExitCode:
        if self.verdict == FUSED:
            return ExitCode.OK
        if self.verdict == UNKNOWN_RELEASE:
            return ExitCode.REFUSED
        if self.verdict == STARTING:
            return ExitCode.NO_VERDICT
        return ExitCode.NOT_OK
