"""The one pipeline every command runs, for every kind of tree:

    locate -> select -> (lock) -> recover -> assess -> plan -> (dry run stops here)
           -> write (one transaction | one commit) -> cache -> read back -> report

Here: the :class:`Request`, locate (the trees to act on) and ``status``; ``apply``, ``revert``,
``build`` and ``diff`` (changes.py) run the rest of it after locate. Each is a plain function of
a :class:`Request`; the CLI only parses, calls one of them and renders what it returns. Judging
happens under the lock: two runs at once behave as if one ran after the other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Callable, Mapping, NamedTuple

from packaging.version import InvalidVersion, Version

from sm120patch import chain, terminal, tunedlimits
from sm120patch.dirfd import exposure
from sm120patch.assess import assess, present_by_meaning
from sm120patch.checkout import CheckoutTree, open_checkout
from sm120patch.distributions import ANY, Registry, load_registry
from sm120patch.environment import Environment, Probe, start_probe
from sm120patch.errors import NewerFormatError, RefusedError, Sm120PatchError, UsageError
from sm120patch.installed import InstalledTree
from sm120patch.invocation import command
from sm120patch.journal import journal_at, read_journal
from sm120patch.locks import read_locks
from sm120patch.reports import StatusReport, TreeStatus
from sm120patch.state import orphans, state_root, temporaries

if TYPE_CHECKING:  # the commands' view of a tree; the write step itself is changes.py's
    from sm120patch.write import Worktree

__all__ = ["Request", "locate", "normalize_selector", "status"]


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
    text = value[1:] if value[:1] in ("v", "V") else value
    try:
        if text != text.strip():  # packaging would read ' 0.6.4' as 0.6.4: a quoted value is taken as typed
            raise InvalidVersion(text)
        Version(text)
    except InvalidVersion:
        shown = value if value and value == value.strip() else repr(value)  # '' and ' 0.6.4' visible as given
        raise UsageError(f"--{option} {shown}: not a version", hint=f"e.g. --{option} 0.6.4, or --{option} alone "
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
        return terminal.join(word for option in self.options for word in option)

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


# -- status ----------------------------------------------------------------------------------------

def status(request: Request, registry: Registry | None = None, *, device=None,
           located: Located | None = None) -> StatusReport:
    """``device``: the driver's answers (``driver.DriverFacts``, doctor reads them first), for the
    fusion chain's device step; None: status leaves the driver alone. ``located``: the trees a
    run already found (apply, judging the chain once its change stands: no second probe)."""
    registry = registry or load_registry(full=False)
    located = located or locate(request, registry)
    # Read under the shared lock of every install location: a run changing one (apply, revert)
    # is seen before or after, never half done.
    with read_locks(located.state_dirs, on_wait=request.on_wait, busy=_running):
        return _status(request, registry, located, device)


def _running(site_dir: Path) -> str:
    """The run that holds ``site_dir``, as its journal names it (which command, which process)."""
    try:
        journal = read_journal(journal_at(site_dir))
    except Sm120PatchError:
        journal = None
    where = f"another sm120patch is changing {site_dir}"
    return f"{where}: {journal.describe(running=True)}" if journal is not None else where


def _status(request: Request, registry: Registry, located: Located, device) -> StatusReport:
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
                        verbose_command=located.command("status --verbose"),
                        orphans=[o for d in site_dirs for o in orphans(d)],
                        temporaries=[p for d in site_dirs if not journal_at(d).exists() for p in temporaries(d)],
                        exposed=_exposed([*site_dirs, *(t.jit.base.path for t in trees if t.jit is not None)]))


def _exposed(paths) -> list[tuple[Path, str]]:
    """As root: where another user can change a directory on the way to what a run writes
    (status and doctor say so; the writes go by descriptor there: sm120patch.dirfd)."""
    found = {}
    for path in paths:
        hit = exposure(path)
        if hit is not None:
            found.setdefault(hit[0], hit[1])
    return list(found.items())


def _chains(trees: list[TreeStatus], located: Located, aot: list, device) -> list[TreeStatus]:
    """Each server's fusion chain, judged once from every assessment of this run (the patches
    applied to it and to the distribution it fuses with, that one's JIT entries)."""
    if located.env is None:
        return trees
    assessed = [t.assessment for t in trees]
    by_name = {t.distribution.name: t for t in trees}
    profile = None
    if any(t.distribution.fusion_paths for t in trees):
        versions = {t.assessment.name: t.assessment.raw_version for t in trees}
        # The server checks the torch release the profile names too: the target's, where the probe
        # found it (without torch no server runs there, and status says torch is not checked).
        torch = located.env.get("torch")
        if torch is not None:
            versions["torch"] = torch.raw_version
        profile = tunedlimits.read(versions)
    commands = chain.Commands(apply=located.command("apply"), build=located.command("build"),
                              doctor=located.command("doctor"), bench=located.command("bench"),
                              status=located.command("status"), diff=command("diff", located.options[0]),
                              tune=tunedlimits.tune_command(located.options, profile),
                              apply_tuned=located.command("apply --with tuned-limits"),
                              verify_tuned=located.command("verify --tuned"))
    judged = []
    for item in trees:
        d = item.distribution
        item = item._replace(compilation_config=_compilation_config(item, profile))
        if d.fusion_paths:
            kernels = by_name.get(d.fusion_with)
            item = item._replace(chain=chain.evaluate(
                item.assessment, kernels.assessment if kernels else None, located.env.get(d.fusion_with),
                jit=kernels.jit if kernels else None, aot=aot, assessed=assessed, commands=commands, device=device,
                profile=profile))
        judged.append(item)
    return judged


def _compilation_config(item: TreeStatus, profile) -> str:
    """vLLM's one --compilation-config for this box, with where its size comes from: the fused
    limit `bench --tune` measured here (the smallest over the TP sizes the profile holds for:
    vLLM takes one value for every TP size), else the data's untuned size."""
    row = item.distribution.fusion_flag_row(item.tree.version)
    if row is None or not row.sizing:
        return ""
    if profile is not None and profile.usable:
        entry = min(profile.entries, key=lambda e: e.fused_max_bytes)
        size = math.floor(entry.fused_max_bytes / 2 ** 20 * 100) / 100
        return (f"`{row.compilation_config(size)}` ({size:g} MB: the fused limit `bench --tune` measured on this box "
                f"at TP{entry.tp}, {profile.path})")
    return (f"`{row.compilation_config(row.untuned_mb)}` ({row.untuned_mb:g} MB: not measured on this box, "
            "fusion-table's smallest SM120 limit; bench --tune measures this box's)")


def _fusion_with(located: Located, tree: Worktree):
    """The installed distribution ``tree``'s fusion depends on (None: none, or not a known one)."""
    other = tree.distribution.fusion_with
    return located.env.get(other) if other and located.env is not None else None


# -- apply, revert, diff ---------------------------------------------------------------------------
