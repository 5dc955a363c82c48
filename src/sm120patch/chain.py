"""Will this server fuse? The whole chain from the GPU to the first fused call, one step at a
time, evaluated once per server and read by ``status``, ``status --json``, ``doctor``,
``bench``'s refusal and ``check-log``.

The steps, in the order a start-up meets them (their ids are also the ``step`` of
``check-log``'s fell-back and crash lines, ``patches/*/logs.toml``):

``device``        the GPUs: SM120 or not, multicast, peer access (doctor reads the driver;
                  status does not, so the step is ``unknown`` there and says what it depends on)
``kernel-gates``  the kernel library's gates (JIT gate, ``__CUDA_ARCH__`` bounds, lamport
                  stride, cluster clamp): the required patches of its pinned set that no
                  ``[[fusion_path]]`` names, or nothing once it is fixed upstream
``server-gates``  the server's own gates: its set's required patches that no fusion path names
                  (and, where ``[[fusion_chain.server_gate]]`` says so, an opt-in patch that an
                  option of the server can stand in for)
``requested``     whether fusion is asked for: the release's flag (``[[fusion_flag]]``), or the
                  release or an applied opt-in patch turns it on by default
                  (``[[fusion_chain.auto_enable]]``), within its limits
``workspace``     the workspace path on a GPU without multicast (``fusionpath.judge``)
``jit``           the JIT entry: built, stale, shadowed by a prebuilt module, or built on first use
``tp``            what the TP size does (``[fusion_chain] tp``): advice, never a block

Each step is ``ok``, ``blocks`` or ``unknown``, with its reason and, where it blocks, the
command that fixes it. The headline is one sentence; it never says "will fuse" while any step
blocks or is unknown, and while the GPUs are not known (status never reads them) it says "will fuse
on an SM120 GPU" and names the command that reads this machine's (doctor).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, NamedTuple, Sequence

from sm120patch.fusionpath import FusionVerdict, judge

if TYPE_CHECKING:
    from sm120patch.assess import Assessment
    from sm120patch.distributions import Distribution
    from sm120patch.driver import DriverFacts
    from sm120patch.environment import InstalledDistribution
    from sm120patch.jitcache import AotShadow, JitStatus

STEPS = ("device", "kernel-gates", "server-gates", "requested", "workspace", "jit", "tp")
SM120_MAJOR = 12  # compute capability 12.x: RTX PRO 6000 Blackwell, RTX 5090 (and DGX Spark's 12.1)
UPSTREAM_MAJORS = (9, 10)  # what upstream FlashInfer and the servers fuse on without a patch


class StepResult(enum.Enum):
    OK = "ok"
    BLOCKS = "blocks"
    UNKNOWN = "unknown"


class Step(NamedTuple):
    id: str  # one of STEPS
    result: StepResult
    text: str  # what holds, in words
    fix: str = ""  # a command, as it can be copied; "" when there is nothing to do (on an ok step: optional)
    condition: str = ""  # an ok that holds only when the server is started so: "--enable-…"
    note: str = ""  # an ok with something to know: the first start compiles, the TP advice


class Commands(NamedTuple):
    """The sm120patch commands a step suggests, for the same target, as they can be copied."""

    apply: str
    build: str
    doctor: str
    bench: str
    status: str
    diff: str


class Chain(NamedTuple):
    server: str  # "sglang 0.5.9"
    steps: tuple[Step, ...]
    fusion: FusionVerdict | None  # the workspace step's judgement (bench reads its path)
    upstream_device: str = ""  # the GPUs are SM90/SM100 ("SM90"): upstream fuses there without a patch

    def step(self, step_id: str) -> Step:
        return next(s for s in self.steps if s.id == step_id)

    @property
    def blocking(self) -> Step | None:
        return next((s for s in self.steps if s.result is StepResult.BLOCKS), None)

    @property
    def unknown(self) -> Step | None:
        """The first step not known, the device aside: status never reads it, and the headline
        speaks of SM120 instead."""
        return next((s for s in self.steps if s.result is StepResult.UNKNOWN and s.id != "device"), None)

    @property
    def verdict(self) -> str:
        """``will fuse`` / ``will not fuse`` / ``not known`` (the --json value; the headline in words)."""
        if self.blocking is not None:
            return "will not fuse"
        if self.unknown is not None:
            return "not known"
        return "will fuse"

    @property
    def conditions(self) -> list[str]:
        return [s.condition for s in self.steps if s.result is StepResult.OK and s.condition]

    @property
    def headline(self) -> str:
        where = f"on these GPUs ({self.upstream_device})" if self.upstream_device else "on SM120"
        blocking = self.blocking
        if blocking is not None:
            sentence = f"{self.server} will not fuse {where}: {blocking.text}"
            return sentence + (f" — `{blocking.fix}`" if blocking.fix else "")
        unknown = self.unknown
        if unknown is not None:
            sentence = f"{self.server}: whether it fuses {where} is not known: {unknown.text}"
            return sentence + (f" — `{unknown.fix}`" if unknown.fix else "")
        conditions = self.conditions
        # An option is quoted as it can be copied; a condition in words (vLLM's pass-config size) is not.
        when = (f" when started with {' and '.join(f'`{c}`' if c.startswith('-') else c for c in conditions)}"
                if conditions else "")
        device = self.step("device")
        if device.result is StepResult.UNKNOWN:
            # Every step but the GPUs holds: the sentence is about an SM120 GPU, and says where this
            # machine's are read (status never reads them; doctor does, when the driver answers).
            where = "on an SM120 GPU"
        sentence = f"{self.server} will fuse {where}{when}"
        if not conditions:
            sentence += f" without a flag: {self.step('requested').text}"
        jit = self.step("jit")
        sentence += f"; {jit.note}" if jit.note else ""
        if device.result is StepResult.UNKNOWN:
            sentence += (f" — this machine's GPUs: `{device.fix}`" if device.fix
                         else f" — this machine's GPUs are not known: {device.text}")
        return sentence


class NextStep(NamedTuple):
    """One thing to do next: the command to run (None where it is not an sm120patch command, such
    as restarting the server), why, and the words the screen says it in (``--json`` has the first two)."""

    command: str | None
    reason: str
    words: str


def next_step(chains: Sequence[Chain]) -> tuple[NextStep, ...]:
    """What to do next, in order, from the first server's chain that is not done (empty: no
    server is installed): the fix of what blocks, what reads what is not known, else the build
    a cold JIT cache wants, the start, and the log check. Each is its own line on the screen, so
    a long command is never wrapped inside a sentence."""
    for item in chains:
        step = item.blocking or item.unknown
        if step is not None:
            reason = f"{item.server}: {step.text}"
            return (NextStep(step.fix, reason, f"`{step.fix}`") if step.fix else NextStep(None, reason, reason),)
    if not chains:
        return ()
    item = chains[0]
    jit = item.step("jit")
    flags = " and ".join(item.conditions)
    start = ("restart the server with " + " and ".join(f"`{c}`" if c.startswith("-") else c for c in item.conditions)
             if item.conditions else "restart the server")
    build = "compiles trtllm_comm now, so that the start does not"
    return ((NextStep(jit.fix, build, f"`{jit.fix}` ({build})"),) if jit.fix else ()) + (
        NextStep(None, f"restart the server with {flags}" if flags else "restart the server", start),
        NextStep(None, "check-log on its log says whether it fused",
                 "check-log on its log says whether it fused (`sm120patch check-log --help`)"))


def evaluate(server: Assessment, kernels: Assessment | None, other: InstalledDistribution | None, *,
             jit: JitStatus | None, aot: Sequence[AotShadow], assessed: Sequence[Assessment],
             commands: Commands, device: DriverFacts | None = None) -> Chain:
    """The chain of the server ``server``. ``kernels``: the assessment of the distribution it
    fuses with, when this run assessed it (None: not installed, or left out by a selector);
    ``other``: that distribution as installed; ``jit``: its JIT entries; ``aot``: prebuilt
    modules that shadow its sources; ``assessed``: every assessment of this run (the workspace
    step reads the patches applied to each); ``device``: the driver's answers (doctor), None
    where they were not read (status)."""
    distribution = server.distribution
    version = server.tree.version
    applied = {a.name: a.applied_ids for a in assessed}
    fusion = judge(distribution, server.raw_version, version, other, applied)
    workspace_ids = {pair for row in distribution.fusion_paths for pair in row.needs}
    name = f"{distribution.name} {server.raw_version}"
    steps = [
        _device(device, commands),
        _kernel_gates(distribution.fusion_with or "", other, kernels, workspace_ids, commands),
        _server_gates(server, workspace_ids, commands),
        _requested(server),
        workspace_step(fusion, device, commands),
        _jit(kernels, jit, aot, commands),
        _tp(distribution, server, commands),
    ]
    upstream = ""
    if device is not None and device.devices:
        majors = {d.capability[0] for d in device.devices}
        if majors <= set(UPSTREAM_MAJORS):
            upstream = "SM" + "/SM".join(f"{m}0" for m in sorted(majors))
            # Upstream fuses here: neither library's SM120 gates stand in the way.
            steps = [s._replace(result=StepResult.OK, fix="", text=f"not needed on {upstream}: upstream supports it")
                     if s.id in ("kernel-gates", "server-gates") else s for s in steps]
    return Chain(name, tuple(steps), fusion, upstream)


# -- the steps ---------------------------------------------------------------------------------

def _device(device: DriverFacts | None, commands: Commands) -> Step:
    if device is None:
        return Step("device", StepResult.UNKNOWN, "not read by status: on SM90/SM100 upstream fuses without any patch, "
                    "and the workspace path below is the one for a GPU without multicast (PCIe, what SM120 boxes are)",
                    fix=commands.doctor)
    if not device.devices:
        return Step("device", StepResult.UNKNOWN, f"the driver was not read ({device.error})")
    sms = sorted({d.sm for d in device.devices})
    text = f"{len(device.devices)} GPU{'s' if len(device.devices) != 1 else ''}, compute capability {', '.join(sms)}"
    text += "; multicast" if device.multicast else "; no multicast"
    majors = {d.capability[0] for d in device.devices}
    if not majors <= {SM120_MAJOR, *UPSTREAM_MAJORS}:
        return Step("device", StepResult.BLOCKS, text + ": FlashInfer's fused allreduce runs on SM90, SM100 and (patched) SM120 only")
    if device.peers_ok is False:
        missing = sorted(f"GPU{i}->GPU{j}" for (i, j), ok in device.peer_access.items() if not ok)
        return Step("device", StepResult.BLOCKS, text + f"; no peer access {', '.join(missing)}: every fusion workspace "
                    "maps the other GPUs' memory", fix="nvidia-smi topo -p2p r")
    return Step("device", StepResult.OK, text + ("; peer access between every pair" if device.peers_ok else ""))


def _gate_text(a: Assessment, missing: list[str]) -> str:
    return f"{a.name} {a.raw_version}'s SM120 gates are closed ({a.verdict.value}: {', '.join(missing)} not applied)"


def _kernel_gates(name: str, other: InstalledDistribution | None, kernels: Assessment | None,
                  workspace_ids: set[tuple[str, str]], commands: Commands) -> Step:
    if other is None:
        return Step("kernel-gates", StepResult.BLOCKS, f"{name} is not installed in this environment (the server "
                    "imports it for fusion; install the release the server pins)")
    if kernels is None:
        return Step("kernel-gates", StepResult.UNKNOWN, f"{name} {other.raw_version} was not assessed in this run "
                    "(a selector left it out)", fix=commands.status)
    return _gates("kernel-gates", kernels, workspace_ids, commands)


def _server_gates(server: Assessment, workspace_ids: set[tuple[str, str]], commands: Commands) -> Step:
    step = _gates("server-gates", server, workspace_ids, commands)
    if step.result is not StepResult.OK:
        return step
    version = server.tree.version
    applied = server.applied_ids or frozenset()
    for row in server.distribution.server_gates:
        if version is not None and row.versions.contains(version, prereleases=True) and row.patch not in applied:
            return step._replace(text=f"{server.name} {server.raw_version} as installed gates fusion off on SM120 "
                                      f"unless {row.instead} (or `--with {row.patch}`)",
                                 condition=row.instead)
    return step


def _gates(step_id: str, a: Assessment, workspace_ids: set[tuple[str, str]], commands: Commands) -> Step:
    """The required patches of ``a``'s pinned set, less those a fusion path names (the workspace
    step judges those)."""
    owned = {patch_id for owner, patch_id in workspace_ids if owner == a.name}
    if a.fixed_upstream:
        return Step(step_id, StepResult.OK, f"{a.name} {a.raw_version} is fixed upstream: no patch needed")
    if a.not_needed:
        return Step(step_id, StepResult.OK, f"{a.name} {a.raw_version} needs no patch")
    if a.not_covered or a.patch_set is None:
        return Step(step_id, StepResult.BLOCKS if a.not_covered else StepResult.UNKNOWN,
                    f"{a.name} {a.raw_version}: {a.verdict.value}" + (f" ({a.reason})" if a.reason else ""))
    gates = [p for p in a.patch_set.patches if p.required and p.id not in owned]
    states = {p.id: a.patch_state(p).value for p in gates}
    if any(s in ("drifted", "missing") for s in states.values()):
        odd = [f"{i} {s}" for i, s in states.items() if s in ("drifted", "missing")]
        return Step(step_id, StepResult.UNKNOWN, f"{a.name} {a.raw_version}'s files are not the release's bytes nor the "
                    f"patch's ({', '.join(odd)}): sm120patch cannot say what they do",
                    fix=commands.diff)
    missing = [i for i, s in states.items() if s != "applied"]
    if missing:
        return Step(step_id, StepResult.BLOCKS, _gate_text(a, missing), fix=commands.apply)
    if not gates:
        return Step(step_id, StepResult.OK, f"{a.name} {a.raw_version}: no gate to open")
    return Step(step_id, StepResult.OK, f"{a.name} {a.raw_version}'s SM120 gates are open ({', '.join(states)} applied)")


def _requested(server: Assessment) -> Step:
    distribution, version = server.distribution, server.tree.version
    applied = server.applied_ids or frozenset()
    flag = distribution.fusion_flag(version)
    for row in distribution.auto_enables:
        if version is None or not row.versions.contains(version, prereleases=True):
            continue
        if row.by == "release":
            return Step("requested", StepResult.OK, f"{server.name} {server.raw_version} turns fusion on by itself on SM120 "
                        f"{row.limits}")
        if row.by in applied:
            return Step("requested", StepResult.OK, f"{row.by} applied, on by default {row.limits}"
                        + (f"; otherwise with {flag}" if flag else ""))
        if flag:
            return Step("requested", StepResult.OK, f"on when started with {flag}, or by default with "
                        f"`--with {row.by}` ({row.limits})", condition=flag)
    if flag:
        return Step("requested", StepResult.OK, f"on when started with {flag}", condition=flag)
    return Step("requested", StepResult.UNKNOWN, f"sm120patch does not know {server.name} {server.raw_version}'s fusion option")


def workspace_step(fusion: FusionVerdict, device: DriverFacts | None, commands: Commands) -> Step:
    multicast = device.multicast if device is not None and device.devices else None
    if fusion.path is None:
        return Step("workspace", StepResult.UNKNOWN, fusion.render(), fix="")
    if multicast is True:
        return Step("workspace", StepResult.OK, f"these GPUs report multicast: the {fusion.path.path}")
    if fusion.missing:
        return Step("workspace", StepResult.BLOCKS, f"on a GPU without multicast it falls back to unfused allreduce "
                    f"({fusion.path.without}) until {', '.join(fusion.missing)} is applied", fix=commands.apply)
    if fusion.unknown:
        return Step("workspace", StepResult.UNKNOWN, f"it needs {', '.join(fusion.unknown)}, which this run did not assess",
                    fix=commands.status)
    return Step("workspace", StepResult.OK, fusion.path.path)


def _jit(kernels: Assessment | None, jit: JitStatus | None, aot: Sequence[AotShadow], commands: Commands) -> Step:
    if aot:
        return Step("jit", StepResult.BLOCKS, f"a prebuilt trtllm_comm shadows the patched sources ({aot[0].path}): "
                    "FlashInfer loads it and never compiles them", fix="pip uninstall flashinfer-jit-cache")
    if kernels is None or jit is None:
        return Step("jit", StepResult.UNKNOWN, "the kernel library's JIT cache was not read in this run", fix=commands.status)
    module = kernels.distribution.jit_module
    if jit.stale:
        return Step("jit", StepResult.BLOCKS, f"{jit.stale[0]} was built before its sources last changed, and FlashInfer "
                    "loads it as it is", fix=commands.apply)
    built = [e for e in jit.entries if e not in jit.incomplete]
    if not built:
        what = (f"{module} in {jit.incomplete[0]} is incomplete (no {module}.so: a build that did not finish)"
                if jit.incomplete else f"no {module} built for {kernels.raw_version} in {jit.base.cache_dir}")
        return Step("jit", StepResult.OK, what,
                    note=f"its first start compiles {module} (minutes per rank's first call): `{commands.build}` builds it now",
                    fix=commands.build)  # optional on an ok step: what saves the first start its minutes
    archs = ", ".join(e.parent.parent.name for e in built)
    # FlashInfer names each arch directory after the architectures it built for ("120a", "90a_120a").
    return Step("jit", StepResult.OK, f"{module} built in {jit.base.cache_dir} for {archs}")


def _tp(distribution: Distribution, server: Assessment, commands: Commands) -> Step:
    text = distribution.tp_advice.replace("{bench}", commands.bench) if distribution.tp_advice else "no TP limit known"
    return Step("tp", StepResult.OK, text)
