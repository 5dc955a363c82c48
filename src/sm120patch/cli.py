"""Command line: parse, call one function from actions/manifests, render. Nothing else."""

from __future__ import annotations

import functools
import json
import sys

import click

from sm120patch import __version__
from sm120patch.bench import DEFAULT_HIDDEN as DEFAULT_BENCH_HIDDEN, DEFAULT_TOKENS as DEFAULT_BENCH_TOKENS
from sm120patch.errors import ExitCode, Sm120PatchError

EXIT_CODES = """\b
Exit codes:
  0  success (status: everything installed is patched or fixed upstream)
  1  status: something is not (fully) patched
  2  bad input (options, --python, version selector, patch data)
  3  refused: a file is not the release's bytes, or no pinned patch set
  4  failed (I/O error, read-only, permission, lock held); rolled back"""

python_option = click.option(
    "--python", "python", metavar="PATH", default=None,
    help="Interpreter of the environment to act on (e.g. ~/ml-env/bin/python3). Default: this one.",
)
jit_option = click.option(
    "--jit-cache-base", metavar="DIR", default=None,
    help="Base of FlashInfer's JIT cache (the server user's $FLASHINFER_WORKSPACE_BASE or $HOME). "
    "Default: $FLASHINFER_WORKSPACE_BASE, else $HOME.",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print a JSON document instead of text.")
source_option = click.option(
    "--source", metavar="PATH", default=None,
    help="A git checkout of FlashInfer or SGLang to act on instead of an installed environment.",
)


def _apply_source(path, catalog, ids, force):
    from sm120patch import source as source_tree

    result = source_tree.apply_source(source_tree.open_tree(path), catalog, with_ids=ids, force=force)
    click.echo(result.message)


def handle_errors(command):
    """Turn expected failures into one clear message and the documented exit code."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except Sm120PatchError as exc:
            click.echo(f"sm120patch: error: {exc.message}", err=True)
            if exc.hint:
                click.echo(f"hint: {exc.hint}", err=True)
            sys.exit(int(exc.exit_code))
        except OSError as exc:  # outside a transaction (lock, state directory, JIT cache)
            where = f" ({exc.filename})" if exc.filename else ""
            click.echo(f"sm120patch: error: {exc.strerror or exc}{where}", err=True)
            sys.exit(int(ExitCode.FAILED))
        except KeyboardInterrupt:
            click.echo("sm120patch: interrupted; any change in progress was rolled back", err=True)
            sys.exit(130)

    return wrapper


def _wait_message(text: str) -> None:
    click.echo(f"sm120patch: {text}", err=True)


@click.group(epilog=EXIT_CODES, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="sm120patch")
def cli() -> None:
    """Enable FlashInfer/SGLang TRT-LLM allreduce fusion on SM120 GPUs (RTX PRO 6000
    Blackwell, RTX 5090) with exact, version-pinned, reversible patches."""


@cli.command(epilog=EXIT_CODES)
@python_option
@jit_option
@source_option
@json_option
@handle_errors
def status(python, jit_cache_base, source, as_json):
    """Show what is installed, which patches are applied, stale JIT entries and AOT shadowing.
    With --source: which patches a git checkout's HEAD has already."""
    if source:
        from sm120patch import patchsets, report, source as source_tree

        result = source_tree.source_status(source_tree.open_tree(source), patchsets.load_catalog(check_rewriters=False))
        click.echo(json.dumps(report.source_status_json(result), indent=2) if as_json else report.render_source_status(result))
        sys.exit(int(report.source_status_exit_code(result)))
    from sm120patch import environment

    probe = environment.start_probe(python)  # runs while the rest is imported
    from sm120patch import actions, jitcache, patchsets, report

    env = probe.result()
    catalog = patchsets.load_catalog(check_rewriters=False)
    result = actions.collect_status(env, catalog, jit_base=jitcache.cache_base(jit_cache_base))
    click.echo(json.dumps(report.status_json(result), indent=2) if as_json else report.render_status(result))
    sys.exit(int(report.status_exit_code(result)))


@cli.command(epilog=EXIT_CODES)
@click.option("--flashinfer", metavar="VER", default=None,
              help="Patch flashinfer-python, which must be installed at version VER.")
@click.option("--sglang", metavar="VER", default=None,
              help="Patch sglang, which must be installed at version VER.")
@click.option("--with", "with_ids", metavar="ID,...", default="",
              help="Also apply these opt-in patches (see `sm120patch status`).")
@python_option
@click.option("--dry-run", is_flag=True, help="Print the unified diff; change nothing.")
@click.option("--force", is_flag=True,
              help="Patch files that are not the release's bytes (drift), by meaning rather than by hash.")
@jit_option
@source_option
@json_option
@handle_errors
def apply(flashinfer, sglang, with_ids, python, dry_run, force, jit_cache_base, source, as_json):
    """Apply the patch set pinned to each installed release.

    With no --flashinfer/--sglang, every installed distribution that has a patch set is patched.
    Required patches always; opt-in ones only with --with. Re-applying changes nothing.
    With --source, or for an editable install, the patch becomes a commit on the branch
    sm120patch/<dist>-<version> of that git checkout instead."""
    from sm120patch import actions, environment, jitcache, patchsets, report

    catalog = patchsets.load_catalog()
    ids = [i.strip() for i in with_ids.split(",") if i.strip()]
    if source:
        return _apply_source(source, catalog, ids, force)
    env = environment.locate(python)
    selectors = {"flashinfer-python": flashinfer, "sglang": sglang}
    routed = actions.editable_sources(env, selectors)
    for name, path in routed:
        click.echo(f"{name} is an editable install of {path}: patching that source tree as a commit instead", err=True)
        _apply_source(str(path), catalog, ids, force)
    skip = {name for name, _ in routed}
    if skip and not actions.installed_targets(env, selectors, skip=skip):
        return
    result = actions.run_apply(
        env, catalog,
        selectors=selectors, skip=skip,
        with_ids=ids,
        force=force, dry_run=dry_run,
        jit_base=jitcache.cache_base(jit_cache_base), on_wait=_wait_message,
    )
    click.echo(json.dumps(report.change_json(result), indent=2) if as_json else report.render_change(result))


@cli.command(epilog=EXIT_CODES)
@click.option("--flashinfer", is_flag=True, help="Revert flashinfer-python only.")
@click.option("--sglang", is_flag=True, help="Revert sglang only.")
@python_option
@click.option("--force", is_flag=True, help="Restore the release's bytes even over files edited after patching.")
@jit_option
@source_option
@json_option
@handle_errors
def revert(flashinfer, sglang, python, force, jit_cache_base, source, as_json):
    """Restore the release's original bytes of every patched file (checked against RECORD).
    With --source: back to the original branch, deleting sm120patch's branch if it is unchanged."""
    from sm120patch import actions, environment, jitcache, patchsets, report

    if source:
        from sm120patch import source as source_tree

        click.echo(source_tree.revert_source(source_tree.open_tree(source)))
        return

    env = environment.locate(python)
    catalog = patchsets.load_catalog()
    result = actions.run_revert(
        env, catalog,
        selectors={"flashinfer-python": flashinfer, "sglang": sglang},
        force=force, jit_base=jitcache.cache_base(jit_cache_base), on_wait=_wait_message,
    )
    click.echo(json.dumps(report.change_json(result), indent=2) if as_json else report.render_change(result))


@cli.command(epilog=EXIT_CODES)
@python_option
@click.option("--runtime", is_flag=True,
              help="Ask FlashInfer's own JIT (in the target interpreter, needs torch) for trtllm_comm with "
              "FLASHINFER_CUDA_ARCH_LIST=12.0a; import SGLang's patched module where it can be imported.")
@click.option("--compile", "compile_", is_flag=True,
              help="Compile the lamport kernel from the installed headers with nvcc to PTX: sm_120a must "
              "contain griddepcontrol, sm_90a/sm_100a must equal the release's PTX (no GPU needed).")
@click.option("--build", is_flag=True,
              help="Run FlashInfer's own JIT build of trtllm_comm for sm_120a in a temporary workspace "
              "(minutes; without a CUDA driver it compiles but cannot link).")
@jit_option
@json_option
@handle_errors
def verify(python, runtime, compile_, build, jit_cache_base, as_json):
    """Prove the patched state: manifest hashes and semantic checks (always), and optionally a
    runtime, a compile and a build check. Exit 0 when every check that ran passed, else 1."""
    from sm120patch import environment

    probe = environment.start_probe(python)
    from sm120patch import actions, jitcache, patchsets, report, verify as checks

    env = probe.result()
    status_report = actions.collect_status(env, patchsets.load_catalog(check_rewriters=False), jit_base=jitcache.cache_base(jit_cache_base))
    results = [r for s in status_report.distributions for r in checks.static_checks(s)]
    progress = None if as_json else (lambda text: click.echo(text, err=True))
    if runtime:
        results += checks.runtime_checks(env.executable, with_sglang=env.get("sglang") is not None)
    flashinfer = [s for s in status_report.distributions if s.assessment.dist.name == "flashinfer-python"]
    if compile_:
        results += [r for s in flashinfer for r in checks.compile_checks(s, progress=progress)]
    if build:
        results += checks.build_check(env.executable, progress=progress)
    click.echo(json.dumps(report.verify_json(env, results), indent=2) if as_json else report.render_verify(env, results))
    sys.exit(int(report.verify_exit_code(results)))


class _BenchProgress:
    """bench's progress on a terminal: what is being loaded, then a bar over the shapes."""

    def __init__(self) -> None:
        self.bar = None
        self.done = 0

    def __call__(self, event: dict) -> None:
        if event.get("event") == "stage":
            click.echo(f"sm120patch: {event['text']} ...", err=True)
        elif event.get("event") == "cases":
            self.bar = click.progressbar(length=event["total"], label="checking and timing", file=sys.stderr,
                                         show_pos=True, item_show_func=lambda item: item)
            self.bar.__enter__()
        elif event.get("event") == "case" and self.bar is not None:
            shape = f"tokens {event['tokens']}, hidden {event['hidden']}" if "tokens" in event else None
            self.bar.update(event["index"] - self.done, current_item=shape)
            self.done = event["index"]

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


@cli.command(epilog="""\b
Examples:
  sm120patch bench --python ~/sglang-env/bin/python3
  sm120patch bench --python ~/sglang-env/bin/python3 --tp 4 --tokens 1,8,64,512 --hidden 7168

\b
Exit codes:
  0  every shape matched the reference (and was timed)
  1  a fused result differs from the reference, or the kernel crashed or hung
  2  the target cannot run it: no torch, no CUDA, fewer than 2 GPUs, a --tp the kernel refuses
  3  refused: FlashInfer is not patched for the SM120 GPUs in use (run `sm120patch apply`)
  130 interrupted""")
@python_option
@click.option("--tp", type=int, default=None, metavar="N",
              help="Ranks (GPUs) to run: 2, 4, 8 or 16. Default: every visible GPU.")
@click.option("--tokens", metavar="LIST", default=",".join(map(str, DEFAULT_BENCH_TOKENS)), show_default=True,
              help="Token counts (batch sizes) to check and time.")
@click.option("--hidden", metavar="LIST", default=",".join(map(str, DEFAULT_BENCH_HIDDEN)), show_default=True,
              help="Hidden sizes: your model's (e.g. 4096 for Llama-3-8B, 7168 for DeepSeek-V3).")
@click.option("--dtype", type=click.Choice(["bf16", "fp16"]), default="bf16", show_default=True)
@click.option("--strategy", type=click.Choice(["auto", "oneshot", "twoshot", "both"]), default="auto", show_default=True,
              help="auto: FlashInfer's own choice, as SGLang runs it; both: one-shot and two-shot.")
@click.option("--check-only", is_flag=True, help="Check every shape against the reference; skip the timing.")
@jit_option
@json_option
@handle_errors
def bench(python, tp, tokens, hidden, dtype, strategy, check_only, jit_cache_base, as_json):
    """Check FlashInfer's fused allreduce + residual + RMSNorm against NCCL + RMSNorm on this
    machine's GPUs, then time fused against unfused and recommend a setting.

    Runs in the server's interpreter (its torch and FlashInfer), one process per GPU. FlashInfer
    builds trtllm_comm in its JIT cache on first use, as the server would (minutes)."""
    from pathlib import Path

    from sm120patch import bench as bench_mod

    request = bench_mod.BenchRequest(
        python=Path(python) if python else None, tp=tp,
        tokens=bench_mod.parse_int_list(tokens, option="--tokens", minimum=1, maximum=16384),
        hidden=bench_mod.parse_int_list(hidden, option="--hidden", minimum=128, maximum=16384, multiple_of=8),
        dtype=dtype, strategy=strategy, check_only=check_only,
        jit_base=Path(jit_cache_base).expanduser() if jit_cache_base else None,
    )
    progress = _BenchProgress() if sys.stderr.isatty() and not as_json else None
    try:
        result = bench_mod.bench(request, on_event=progress)
    finally:
        if progress:
            progress.close()
    click.echo(json.dumps(bench_mod.to_json(result), indent=2) if as_json else bench_mod.render(result))
    failed = bench_mod.failure(result)
    if failed:
        raise failed


@cli.command()
@python_option
@jit_option
@json_option
@handle_errors
def doctor(python, jit_cache_base, as_json):
    """Check the machine and environment: GPUs and compute capability, driver and CUDA toolkit,
    PCIe-only topology, AOT shadowing, version pins, upstream fixes, SGLang's fusion default.
    Works without a GPU or nvidia-smi (it says so). Exit 0 unless an error stops it."""
    from sm120patch import environment

    probe = environment.start_probe(python)
    from sm120patch import actions, doctor as checks, jitcache, patchsets

    result = checks.DoctorReport()
    checks.examine_machine(result)
    env = probe.result()
    status_report = actions.collect_status(env, patchsets.load_catalog(check_rewriters=False),
                                           jit_base=jitcache.cache_base(jit_cache_base))
    checks.examine_environment(result, status_report)
    click.echo(json.dumps(checks.to_json(result), indent=2) if as_json else checks.render(result))


@cli.command()
@click.option("--flashinfer", metavar="VER", default=None, help="Only flashinfer-python (installed at VER).")
@click.option("--sglang", metavar="VER", default=None, help="Only sglang (installed at VER).")
@click.option("--with", "with_ids", metavar="ID,...", default="", help="Include these opt-in patches.")
@python_option
@handle_errors
def diff(flashinfer, sglang, with_ids, python):
    """Print the unified diff apply would make, with paths from the package root
    (site-packages): `git apply` and `patch -p1` accept it there. Changes nothing."""
    from sm120patch import actions, environment, jitcache, patchsets

    result = actions.run_apply(
        environment.locate(python), patchsets.load_catalog(),
        selectors={"flashinfer-python": flashinfer, "sglang": sglang},
        with_ids=[i.strip() for i in with_ids.split(",") if i.strip()],
        dry_run=True, jit_base=jitcache.cache_base(),
    )
    for r in result.results:
        for planned in (r.plan.files if r.plan else ()):
            click.echo(planned.diff(r.plan.assessment.dist.location), nl=False)


@cli.command()
@click.option("--source", metavar="PATH", required=True, help="The git checkout sm120patch committed to.")
@click.option("--out", metavar="DIR", required=True, type=click.Path(file_okay=False), help="Where to write the patch files.")
@handle_errors
def export(source, out):
    """Write sm120patch's commit as `git format-patch` files (for `git am`, or upstream)."""
    from pathlib import Path

    from sm120patch import source as source_tree

    for path in source_tree.export_source(source_tree.open_tree(source), Path(out)):
        click.echo(f"wrote {path}")


@cli.command("list")
@json_option
@handle_errors
def list_(as_json):
    """The support matrix: every release sm120patch knows, its patches, and the upstream fix."""
    from sm120patch import patchsets, report

    catalog = patchsets.load_catalog(check_rewriters=False)
    click.echo(json.dumps(report.list_json(catalog), indent=2) if as_json else report.render_list(catalog))


@cli.group()
def manifest() -> None:
    """Build the vendor manifests from the real upstream wheels (maintainers)."""


@manifest.command("build")
@click.option("--wheel-cache", metavar="DIR", default=None,
              help="Where downloaded wheels are kept (default: ~/.cache/sm120patch/wheels).")
@click.option("--out", metavar="DIR", default=None, help="Write here instead of vendor-manifests/.")
@click.option("--check", is_flag=True, help="Rebuild and compare with the committed manifests; write nothing.")
@handle_errors
def manifest_build(wheel_cache, out, check):
    """Download every pinned release's wheel and write its manifest."""
    from pathlib import Path

    from sm120patch import manifests, patchsets, wheels

    catalog = patchsets.load_catalog()
    cache = Path(wheel_cache) if wheel_cache else wheels.default_cache()
    stale = []
    for patch_set in catalog.patch_sets:
        for version in patch_set.versions:
            wheel = wheels.fetch_wheel(patch_set.distribution, str(version), cache)
            document = manifests.build_manifest(wheel, patch_set)
            if check:
                path = manifests.manifest_path(patch_set.distribution, str(version))
                same = path.exists() and path.read_text(encoding="utf-8") == manifests.render(document)
                click.echo(f"{'ok     ' if same else 'DIFFERS'} {path}")
                stale += [] if same else [path]
            else:
                click.echo(f"wrote {manifests.write_manifest(document, Path(out) if out else None)}")
    if stale:
        sys.exit(int(ExitCode.NOT_PATCHED))


def main() -> None:
    cli(prog_name="sm120patch")
