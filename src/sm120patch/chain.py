"""Will this server fuse? The whole chain from the GPU to the first fused call, one step at a
time, evaluated once per server and read by ``status``, ``status --json``, ``doctor``,
``bench``'s refusal and ``check-log``.

The steps, in the order a start-up meets them (their ids are also the ``step`` of
``check-log``'s fell-back and crash lines, ``patches/*/logs.toml``):

``device``        the GPUs: SM120 or not, multicast, peer access (doctor reads the driver;
                  status does not, so the step is ``unknown`` there and says what it depends on)
``kernel-gates``  the kernel library's gates (JIT gate, ``__CUDA_ARCH__`` bounds, lamport
                  stride, cluster clamp): the required patches of its pinned set that no
                  ``[[fusion_path]]`` names, or nothing once it is fixed upstream; where the
                  server's ``[[fusion_chain.kernel_path]]`` says what its fused call needs, only
                  those (to build, to run) block, and a missing launch patch or one of kernels
                  the server never calls is a note (a hand fix of the JIT gate fuses)
``server-gates``  the server's own gates: its set's required patches that no fusion path names
                  (and, where ``[[fusion_chain.server_gate]]`` says so, an opt-in patch that an
                  option of the server can stand in for)
``requested``     whether fusion is asked for: the release's flag (``[[fusion_flag]]``), or the
                  release or an applied opt-in patch turns it on by default
                  (``[[fusion_chain.auto_enable]]``), within its limits
``workspace``     the workspace path on a GPU without multicast (``fusionpath.judge``)
``jit``           the JIT entry: built, stale, shadowed by a prebuilt module, or built on first use
``tp``            which limits the server fuses by: tuned on this box (the profile `bench --tune`
                  wrote, read by the opt-in patch tuned-limits) or the release's own
                  (``[fusion_chain] untuned``): advice, never a block; ``warn`` where tuned-limits
                  is applied and no profile holds (the release's B200 limits apply). "Tuned" is
                  only what status can know without running the server: `verify --tuned` runs
                  its decision code

Each step is ``ok``, ``blocks`` or ``unknown``, with its reason and, where it blocks, the
command that fixes it. The headline is one sentence; it never says "will fuse" while any step
blocks or is unknown, and while the GPUs are not known (status never reads them) it says "will fuse
on an SM120 GPU" and names the command that reads this machine's (doctor).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, NamedTuple, Sequence

from sm120patch.fusionpath import FusionVerdict, judge
from sm120patch.tunedlimits import PATCH_ID as TUNED

if TYPE_CHECKING:
    from sm120patch.assess import Assessment
    from sm120patch.distributions import Distribution, KernelPath
    from sm120patch.driver import DriverFacts
    from sm120patch.environment import InstalledDistribution
    from sm120patch.jitcache import AotShadow, JitStatus
    from sm120patch.tunedlimits import Profile

STEPS = ("device", "kernel-gates", "server-gates", "requested", "workspace", "jit", "tp")
SM120_MAJOR = 12  # compute capability 12.x: RTX PRO 6000 Blackwell, RTX 5090 (and DGX Spark's 12.1)
UPSTREAM_MAJORS = (9, 10)  # what upstream FlashInfer and the servers fuse on without a patch


class StepResult(enum.Enum):
    OK = "ok"
    BLOCKS = "blocks"
    UNKNOWN = "unknown"
    WARN = "warn"  # it fuses, but not as the user asked for (tuned-limits applied, no profile holds)


class Step(NamedTuple):
    id: str  # one of STEPS
    result: StepResult
    text: str  # what holds, in words
    fix: str = ""  # a command, as it can be copied; "" when there is nothing to do (on an ok step: optional)
    condition: str = ""  # an ok that holds only when the server is started so: "--enable-…"
    note: str = ""  # an ok with something to know: the first start compiles, the TP advice
    summary: str = ""  # the few words the headline says of this step ("" for none)


class Commands(NamedTuple):
    """The sm120patch commands a step suggests, for the same target, as they can be copied."""

    apply: str
    build: str
    doctor: str
    bench: str
    status: str
    diff: str
    tune: str = ""  # bench --tune: measures where fusion wins on these GPUs and writes the profile
    apply_tuned: str = ""  # apply --with tuned-limits: the server keeps to the profile
    verify_tuned: str = ""  # verify --tuned: runs the server's decision code under the profile


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
        # nvidia-smi named the GPUs (SM90/SM100) though the driver answered nothing: the sentence is
        # about them, as read.
        unread = device.result is StepResult.UNKNOWN and not self.upstream_device
        if unread:
            # Every step but the GPUs holds: the sentence is about an SM120 GPU, and says where this
            # machine's are read (status never reads them; doctor does, when the driver answers).
            where = "on an SM120 GPU"
        sentence = f"{self.server} will fuse {where}{when}"
        if not conditions:
            sentence += f" without a flag: {self.step('requested').text}"
        kernel, jit = self.step("kernel-gates"), self.step("jit")
        # A hand fix that builds and runs the fused kernel: it fuses, and what is missing is said.
        sentence += "".join(f"; {s.note}" for s in (kernel, jit) if s.note)
        tp = self.step("tp")
        if tp.summary:  # tuned-limits applied: by which limits it fuses
            sentence += f"; {tp.summary}"
        if unread:
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
    kernel, jit, tp = item.step("kernel-gates"), item.step("jit"), item.step("tp")
    flags = " and ".join(item.conditions)
    start = ("restart the server with " + " and ".join(f"`{c}`" if c.startswith("-") else c for c in item.conditions)
             if item.conditions else "restart the server")
    def run(command: str, reason: str) -> NextStep:
        return NextStep(command, reason, f"`{command}` ({reason})")

    steps = []
    # A hand fix that fuses as it is: completing it comes first, before the first build.
    if kernel.note and kernel.fix:
        steps.append(run(kernel.fix, "completes the partial patch: the kernel-gates step says what is missing"))
    if jit.fix:
        steps.append(run(jit.fix, "compiles trtllm_comm now, so that the start does not"))
    # Measuring comes before the restart: the release's own limits were tuned for NVLink. The tp
    # step's note is that line (its command, then why).
    if tp.fix:
        steps.append(run(tp.fix, tp.note.removeprefix(f"`{tp.fix}` (").removesuffix(")")))
    return tuple(steps) + (
        NextStep(None, f"restart the server with {flags}" if flags else "restart the server", start),
        NextStep(None, "check-log on its log says whether it fused",
                 "check-log on its log says whether it fused (`sm120patch check-log --help`)"))


def evaluate(server: Assessment, kernels: Assessment | None, other: InstalledDistribution | None, *,
             jit: JitStatus | None, aot: Sequence[AotShadow], assessed: Sequence[Assessment],
             commands: Commands, device: DriverFacts | None = None, profile: Profile | None = None) -> Chain:
    """The chain of the server ``server``. ``kernels``: the assessment of the distribution it
    fuses with, when this run assessed it (None: not installed, or left out by a selector);
    ``other``: that distribution as installed; ``jit``: its JIT entries; ``aot``: prebuilt
    modules that shadow its sources; ``assessed``: every assessment of this run (the workspace
    step reads the patches applied to each); ``device``: the driver's answers (doctor), None
    where they were not read (status); ``profile``: the tuned-limits profile as it holds here."""
    distribution = server.distribution
    version = server.tree.version
    applied = {a.name: a.applied_ids for a in assessed}
    fusion = judge(distribution, server.raw_version, version, other, applied)
    workspace_ids = {pair for row in distribution.fusion_paths for pair in row.needs}
    name = f"{distribution.name} {server.raw_version}"
    steps = [
        _device(device, commands),
        _kernel_gates(server, other, kernels, workspace_ids, commands),
        _server_gates(server, workspace_ids, commands),
        _requested(server),
        workspace_step(fusion, device, commands),
        _jit(kernels, jit, aot, commands),
        _tp(distribution, server, commands, profile),
    ]
    upstream = ""
    if device is not None and device.capabilities:
        majors = {major for major, _ in device.capabilities}
        if majors <= set(UPSTREAM_MAJORS):
            upstream = "SM" + "/SM".join(f"{m}0" for m in sorted(majors))
            # Upstream fuses here: neither library's SM120 gates stand in the way.
            steps = [s._replace(result=StepResult.OK, fix="", note="", text=f"not needed on {upstream}: upstream supports it")
                     if s.id in ("kernel-gates", "server-gates") else s for s in steps]
    return Chain(name, tuple(steps), fusion, upstream)


# -- the steps ---------------------------------------------------------------------------------

def _device(device: DriverFacts | None, commands: Commands) -> Step:
    if device is None:
        return Step("device", StepResult.UNKNOWN, "not read by status: on SM90/SM100 upstream fuses without any patch, "
                    "and the workspace path below is the one for a GPU without multicast (PCIe, what SM120 boxes are)",
                    fix=commands.doctor)
    capabilities = device.capabilities
    if not capabilities:
        return Step("device", StepResult.UNKNOWN, f"the driver was not read ({device.error})")
    sms = sorted({f"{major}.{minor}" for major, minor in capabilities})
    text = f"{len(capabilities)} GPU{'s' if len(capabilities) != 1 else ''}, compute capability {', '.join(sms)}"
    if device.devices:
        text += "; multicast" if device.multicast else "; no multicast"
    else:
        text += f" (nvidia-smi; the driver answered nothing: {device.error}, so multicast and peer access are not known)"
    majors = {major for major, _ in capabilities}
    if not majors <= {SM120_MAJOR, *UPSTREAM_MAJORS}:
        return Step("device", StepResult.BLOCKS, text + ": FlashInfer's fused allreduce runs on SM90, SM100 and (patched) SM120 only")
    if not device.devices:
        return Step("device", StepResult.UNKNOWN, text)
    if device.peers_ok is False:
        missing = sorted(f"GPU{i}->GPU{j}" for (i, j), ok in device.peer_access.items() if not ok)
        return Step("device", StepResult.BLOCKS, text + f"; no peer access {', '.join(missing)}: every fusion workspace "
                    "maps the other GPUs' memory", fix="nvidia-smi topo -p2p r")
    return Step("device", StepResult.OK, text + ("; peer access between every pair" if device.peers_ok else ""))


def _gate_text(a: Assessment, missing: list[str]) -> str:
    return f"{a.name} {a.raw_version}'s SM120 gates are closed ({a.verdict.value}: {', '.join(missing)} not applied)"


def _kernel_gates(server: Assessment, other: InstalledDistribution | None, kernels: Assessment | None,
                  workspace_ids: set[tuple[str, str]], commands: Commands) -> Step:
    name = server.distribution.fusion_with or ""
    if other is None:
        return Step("kernel-gates", StepResult.BLOCKS, f"{name} is not installed in this environment (the server "
                    "imports it for fusion; install the release the server pins)")
    if kernels is None:
        return Step("kernel-gates", StepResult.UNKNOWN, f"{name} {other.raw_version} was not assessed in this run "
                    "(a selector left it out)", fix=commands.status)
    path = next((row for row in server.distribution.kernel_paths
                 if row.matches(server.tree.version, kernels.tree.version)), None)
    if path is None or kernels.nothing_needed or kernels.patch_set is None:
        return _gates("kernel-gates", kernels, workspace_ids, commands)
    return _kernel_path(server, kernels, path, workspace_ids, commands)


def _kernel_path(server: Assessment, kernels: Assessment, path: KernelPath, workspace_ids: set[tuple[str, str]],
                 commands: Commands) -> Step:
    """The kernel library's required patches sorted by what the server's fused call needs them
    for (``[[fusion_chain.kernel_path]]``): to build and to run it blocks without them; without
    a launch patch, or one that completes upstream's fix of kernels the server does not call,
    it fuses, and the step says what is missing and what that means (a hand fix of the JIT
    gate alone, the field report's, is that case)."""
    a = kernels
    owned = {patch_id for owner, patch_id in workspace_ids if owner == a.name}
    gates = [p for p in a.patch_set.patches if p.required and p.id not in owned]
    states = {p.id: a.patch_state(p).value for p in gates}
    needed = [i for i in states if i in path.build or i in path.run]
    odd = [f"{i} {states[i]}" for i in needed if states[i] in ("drifted", "missing")]
    if odd:
        return Step("kernel-gates", StepResult.UNKNOWN, f"{a.name} {a.raw_version}'s files are not the release's bytes "
                    f"nor the patch's ({', '.join(odd)}): sm120patch cannot say what they do", fix=commands.diff)
    who = f"{server.name} {server.raw_version}"
    build = [i for i in needed if i in path.build and states[i] != "applied"]
    run = [i for i in needed if i in path.run and states[i] != "applied"]
    if build or run:
        why = []
        if build:
            why.append(f"without {', '.join(build)} its JIT module does not build for SM120")
        if run:
            why.append(f"without {', '.join(run)} {path.calls} does not run there")
        return Step("kernel-gates", StepResult.BLOCKS, f"{_gate_text(a, build + run)}: {who} calls {path.calls}, and "
                    + "; ".join(why), fix=commands.apply)
    launch = [i for i in states if i in path.launch and states[i] != "applied"]
    rest = [i for i in states if i not in needed and i not in path.launch and states[i] != "applied"]
    text = (f"{a.name} {a.raw_version}'s SM120 gates are open for {who}'s fused call ({path.calls}): "
            + (", ".join(needed) + " applied" if needed else "nothing to open"))
    if not launch and not rest:
        return Step("kernel-gates", StepResult.OK, f"{a.name} {a.raw_version}'s SM120 gates are open ({', '.join(states)} applied)")
    missing = []
    if launch:
        missing.append(f"{', '.join(launch)} not applied: {path.launch_without}")
    if rest:
        missing.append(f"{', '.join(rest)} not applied: {'they complete' if len(rest) > 1 else 'it completes'} upstream's "
                       f"fix of kernels {server.name} does not call (the plain custom allreduce, the MoE fusion)")
    return Step("kernel-gates", StepResult.OK, text, fix=commands.apply,
                note=f"{a.name} {a.raw_version} is {a.verdict.value}: " + "; ".join(missing) + " — `apply` completes it")


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
        what = (f"{module} in {jit.building[0]} is being built now (FlashInfer's lock is held, no {module}.so yet)"
                if jit.building else
                f"{module} in {jit.incomplete[0]} is incomplete (no {module}.so: a build that did not finish)"
                if jit.incomplete else f"no {module} built for {kernels.raw_version} in {jit.base.cache_dir}")
        return Step("jit", StepResult.OK, what,
                    note=f"its first start compiles {module} (minutes per rank's first call): `{commands.build}` builds it now",
                    fix=commands.build)  # optional on an ok step: what saves the first start its minutes
    archs = ", ".join(e.parent.parent.name for e in built)
    # FlashInfer names each arch directory after the architectures it built for ("120a", "90a_120a").
    return Step("jit", StepResult.OK, f"{module} built in {jit.base.cache_dir} for {archs}")


def _tp(distribution: Distribution, server: Assessment, commands: Commands, profile: Profile | None) -> Step:
    """Which limits the server fuses by: tuned on this box (the profile, read by the opt-in patch
    tuned-limits) or the release's own, tuned for NVLink; advice, never a block. ``note`` holds
    what to run next, as it can be copied. "Tuned" says only what can be known without running
    the server (the profile holds for this box, these releases, as sm120patch reads them); the
    server's own decisions are `verify --tuned`'s, which the text names."""
    applied = TUNED in (server.applied_ids or frozenset())
    offered = server.patch_set is not None and any(p.id == TUNED for p in server.patch_set.patches)
    untuned = distribution.tp_untuned or distribution.tp_advice
    usable = profile is not None and profile.usable
    proof = f"; `{commands.verify_tuned}` runs the server's decisions under it" if commands.verify_tuned else ""
    if applied and TUNED in server.former_ids:
        # Today's form is checked in the target interpreter by apply before it commits; an earlier
        # sm120patch's form never was (SGLang 0.5.21+'s first one raised at every call): by the
        # release data (the hashes name the form), without running the server.
        return Step("tp", StepResult.WARN, f"tuned-limits is applied in an earlier sm120patch's form, whose decision code "
                    f"was never run on {server.name} {server.raw_version} (one such form raised at every call)"
                    + (f"; `{commands.verify_tuned}` runs it" if commands.verify_tuned else ""),
                    fix=commands.apply_tuned, summary="tuned-limits in an earlier, unchecked form")
    if applied and usable:
        where = f"tuned on this box ({profile.path}, {profile.entries[0].created}): " + "; ".join(e.words() for e in profile.entries)
        never = [e for e in profile.entries if e.fused_max_bytes == 0 and e.verdict]
        text = where + "".join(f"; TP{e.tp}: {e.verdict}" for e in never) + "; other TP sizes: the release's own limits"
        unchecked = sorted({n for e in profile.entries for n in e.unchecked})
        if unchecked:
            text += f" (the server also checks {', '.join(unchecked)} and its NCCL settings against the profile)"
        else:  # the releases are the target's own: only the server's environment is out of sight
            settings = sorted({" ".join(f"{k}={v}" for k, v in sorted(e.nccl_env.items())) or "none"
                               for e in profile.entries})
            text += (" (the server also checks its own NCCL settings, which status cannot see, against the "
                     f"profile's: {'; '.join(settings)})")
        tps = "/".join(f"TP{e.tp}" for e in profile.entries)
        return Step("tp", StepResult.OK, text + proof,
                    summary=f"tuned limits at {tps} (the profile holds for this box as sm120patch reads it)")
    why = (profile.problem or "; ".join(profile.others) or "no TP size") if profile is not None else "not read"
    if applied:
        note = ""
        if commands.tune:
            note = (f"`{commands.tune}` (measures where fusion wins on these GPUs for the model you serve: where it "
                    "says YOUR_MODEL_DIR, that model's directory or its config.json; the server reads the profile at "
                    "its next start)")
        return Step("tp", StepResult.WARN, f"tuned-limits applied, but no profile holds here ({why}): the release's own "
                    f"limits apply, tuned on NVLink B200s ({untuned})", fix=commands.tune, note=note,
                    summary="tuned-limits applied but no profile holds: the release's B200 limits apply")
    if usable and offered:
        return Step("tp", StepResult.OK, f"untuned: a profile holds for this box ({'; '.join(e.words() for e in profile.entries)}), "
                    f"but {server.name} {server.raw_version} reads it only with tuned-limits applied ({untuned})",
                    fix=commands.apply_tuned,
                    note=f"`{commands.apply_tuned}` (the server then keeps to the profile)" if commands.apply_tuned else "")
    text = f"untuned: {untuned}" if offered else (distribution.tp_advice or "no TP limit known")
    note = ""
    if offered and commands.tune:
        note = (f"`{commands.tune}` (measures where fusion wins on these GPUs; `apply --with tuned-limits` then keeps "
                "the server to it)")
    return Step("tp", StepResult.OK, text.replace("{bench}", commands.bench), fix=commands.tune if note else "", note=note)
