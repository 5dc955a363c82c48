"""What bench measured, and the recommendation it turns that into."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sm120patch.bench.limits import Limits
from sm120patch.bench.preflight import BenchRequest
from sm120patch.errors import CheckFailedError, ExitCode
from sm120patch.invocation import Invocation
from sm120patch.tunedlimits import tune_command
from sm120patch.words import counted

# SGLang uses the fused path for batches of up to this many tokens (FUSE_ALLREDUCE_MAX_BATCH_SIZE).
SGLANG_MAX_FUSED_TOKENS = 2048


@dataclass
class Case:
    tokens: int
    hidden: int
    strategy: str
    effective_strategy: str
    bytes: int
    ok: bool
    max_err_norm: float
    max_err_residual: float
    worst_ratio: float
    ranks_agree: bool
    digests: dict
    fused_us: float | None = None
    unfused_us: float | None = None
    graphs: bool | None = None

    @property
    def speedup(self) -> float | None:
        if self.fused_us and self.unfused_us:
            return self.unfused_us / self.fused_us
        return None


@dataclass
class Series:
    """One hidden size and strategy, by ascending token count, with where fusion stops winning."""

    hidden: int
    strategy: str
    cases: list[Case]

    @property
    def wins_up_to(self) -> Case | None:
        """The largest case such that the fused call is faster at it and at every smaller one."""
        best = None
        for case in self.cases:
            if case.speedup is None or case.speedup <= 1.0:
                break
            best = case
        return best

    @property
    def first_loss(self) -> Case | None:
        return next((c for c in self.cases if c.speedup is not None and c.speedup <= 1.0), None)


@dataclass
class Recommendation:
    sglang: bool | None  # None: decode-only win; the text says where
    sglang_text: str
    vllm_max_size_mb: float | None
    vllm_text: str


@dataclass
class BenchReport:
    request: BenchRequest
    world_size: int
    meta: dict
    cases: list[Case] = field(default_factory=list)
    atol: float = 0.0
    rtol: float = 0.0
    # SGLang's option that turns fusion on (the installed release's, else each release range's).
    sglang_flag: str = "--enable-flashinfer-allreduce-fusion"
    # (server, level, sentence): the installed servers' advice about running them
    advice: list = field(default_factory=list)

    @property
    def failed(self) -> list[Case]:
        return [c for c in self.cases if not c.ok]

    @property
    def errors(self) -> list[CheckFailedError]:
        """A failed check, said after the table is printed."""
        failed = failure(self)
        return [failed] if failed else []

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode.NOT_OK if self.failed else ExitCode.OK

    @property
    def timed(self) -> bool:
        return any(c.fused_us is not None for c in self.cases)

    def series(self) -> list[Series]:
        keys = dict.fromkeys((c.hidden, c.strategy) for c in self.cases)
        return [Series(h, s, sorted((c for c in self.cases if (c.hidden, c.strategy) == (h, s)), key=lambda c: c.tokens))
                for h, s in keys]

    def recommendation(self) -> Recommendation | None:
        """From the series SGLang would run (strategy auto, else what was measured)."""
        if not self.timed or self.failed:
            return None
        series = [s for s in self.series() if s.strategy == "auto"] or self.series()
        loses_at_start = [s for s in series if s.cases and (s.cases[0].speedup or 0) <= 1.0]
        limits = [s.wins_up_to for s in series]
        if loses_at_start:
            s = loses_at_start[0]
            sglang = (False, f"leave {self.sglang_flag} off: unfused is faster already at "
                             f"{counted(s.cases[0].tokens, 'token')}, hidden {s.hidden}")
        elif all(s.first_loss is None for s in series) and all(
                max(c.tokens for c in s.cases) >= min(SGLANG_MAX_FUSED_TOKENS, max(self.request.tokens)) for s in series):
            sglang = (True, f"turn {self.sglang_flag} on: fused is faster at every measured "
                            f"batch size (SGLang fuses batches of up to {SGLANG_MAX_FUSED_TOKENS} tokens)")
        else:
            cut = min((limit for limit in limits if limit), key=lambda c: c.tokens)
            target = (("--python", str(self.request.python)),) if self.request.python else ()
            target += (("--jit-cache-base", str(self.request.jit_base)),) if self.request.jit_base else ()
            tune = tune_command(target, None, hidden=cut.hidden)
            sglang = (None, f"fused wins up to {counted(cut.tokens, 'token')} (decode, speculative verify) and loses "
                            f"beyond, but SGLang fuses batches of up to {SGLANG_MAX_FUSED_TOKENS} tokens: `{tune}` "
                            f"measures the limits at hidden {cut.hidden} (another model: --model its directory instead) and "
                            f"`{str(Invocation('apply --with tuned-limits', target[:1]))}` makes SGLang fuse "
                            f"only up to them; without that, turn {self.sglang_flag} on only if your batches stay there")
        smallest = min((limit for limit in limits if limit), key=lambda c: c.bytes, default=None)
        if smallest is None or loses_at_start:
            vllm = (None, "leave vLLM's fuse_allreduce_rms pass off on this machine")
        else:
            mb = math.floor(smallest.bytes / 2 ** 20 * 100) / 100
            mb = mb if mb > 0 else round(smallest.bytes / 2 ** 20, 4)
            reach = ("the largest size measured; fused may win beyond it" if all(s.first_loss is None for s in series)
                     else "where fused stops winning")
            vllm = (mb, f"-cc.pass_config.fuse_allreduce_rms=true -cc.pass_config.fi_allreduce_fusion_max_size_mb={mb:g}"
                        f" ({counted(smallest.tokens, 'token')} at hidden {smallest.hidden}: {reach}; vLLM 0.12+; "
                        f"before: -O.pass_config.enable_fi_allreduce_fusion=true -O.pass_config.fi_allreduce_fusion_max_size_mb={mb:g})")
        return Recommendation(sglang[0], sglang[1], vllm[0], vllm[1])




def failure(report: BenchReport) -> CheckFailedError | None:
    """The error to exit with when a check failed (the table has already been printed)."""
    if not report.failed:
        return None
    worst = max(report.failed, key=lambda c: c.worst_ratio)
    reason = ("the ranks computed different results" if not worst.ranks_agree else
              f"max error {max(worst.max_err_norm, worst.max_err_residual):.4g}, over the tolerance "
              f"{report.atol:g} + {report.rtol:g}·|ref| by {worst.worst_ratio:.3g}×")
    return CheckFailedError(
        f"fused allreduce + RMSNorm differs from NCCL + RMSNorm in {len(report.failed)} of "
        f"{counted(len(report.cases), 'case')}; worst: tokens {worst.tokens}, hidden {worst.hidden}, {worst.effective_strategy}: {reason}",
        hint="do not turn fusion on; `sm120patch verify --compile` shows whether the lamport kernel body is there",
    )


@dataclass
class TuneReport:
    """What `bench --tune` measured, the limits derived from it and where the profile went."""

    request: BenchRequest
    world_size: int
    meta: dict  # the workers' document: versions, devices, and "tune" (box, GPUs, rows)
    limits: Limits
    entry: dict  # the profile's entry for this TP size (written or not)
    profile: object = None  # bench.profile.Written, or None when nothing was written
    errors: list = field(default_factory=list)  # said after the table (a profile refused)

    @property
    def exit_code(self) -> ExitCode:
        return self.errors[0].exit_code if self.errors else ExitCode.OK
