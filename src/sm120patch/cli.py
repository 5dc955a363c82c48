"""Command line: parse, call one function, render. Nothing else.

Every expected failure is one line (``sm120patch: error: ...``), sometimes a ``hint:`` line
that works when copied as printed, and the exit code each command's help lists.

Each command imports the modules it runs inside its own function: this is the one place in
sm120patch that imports its own modules lazily, so that `status` (the command run most, by
people and by Ansible) never pays for `bench`, `releases`, `verify` or `logcheck`; every module
below imports at its top (tests/test_layers.py)."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
from pathlib import Path
from typing import Callable

import click

from sm120patch import __version__, signals, terminal
from sm120patch.errors import ExitCode, Sm120PatchError



def _selectors() -> list[tuple[str, str]]:
    from sm120patch.distributions import selectors

    try:
        return selectors()
    except Sm120PatchError:  # malformed data: the command that loads it says so in one line
        return []


SELECTORS = _selectors()  # (option, distribution) from patches/*/distribution.toml


HELP_WIDTH = 78  # the epilog's lines, which click indents by two: --help fits 80 columns


def _example_lines(example: str) -> list[str]:
    """An example as it fits: its comment on a line above it; a long command continued with a
    backslash at a space (one with quotes comes split by hand, where a continuation is safe)."""
    command, _, comment = example.partition("   # ")
    lines = [f"  # {comment}"] if comment else []
    if len(command) + 2 <= HELP_WIDTH or "\n" in command or "'" in command or '"' in command:
        return lines + [f"  {part}" for part in command.split("\n")]
    parts = textwrap.wrap(command, width=HELP_WIDTH - 4, initial_indent="  ", subsequent_indent="      ",
                          break_long_words=False, break_on_hyphens=False)
    return lines + [part + " \\" for part in parts[:-1]] + parts[-1:]


class Epilog(str):
    """A command's --help epilog that keeps the exit codes it lists: :class:`Command` reads its
    130 line, so what an interrupt says is what the help promised."""

    codes: tuple[tuple[int, str], ...] = ()


def epilog(examples: list[str], codes: list[tuple[int, str]]) -> Epilog:
    """A command's examples and its own exit codes, in the layout `--help` keeps (\\b), each line
    within :data:`HELP_WIDTH`."""
    lines = ["\b", "Examples:"] + [line for e in examples for line in _example_lines(e)] + ["", "\b", "Exit codes:"]
    lines += [line for code, text in codes
              for line in textwrap.wrap(text, width=HELP_WIDTH, initial_indent=f"  {code:<3} ", subsequent_indent=" " * 6,
                                        break_long_words=False, break_on_hyphens=False)]
    text = Epilog("\n".join(lines))
    text.codes = tuple(codes)
    return text


USAGE = (2, "bad input: an option, --python, a version selector, patch data")
USAGE_NO_TARGET = (2, "bad input: an option or its value")  # the commands that take no --python
INTERRUPTED = (130, "interrupted: Ctrl-C (143: SIGTERM, 129: SIGHUP); the change in progress was rolled back")
# The commands that change nothing in the environment say so instead.
INTERRUPTED_READING = (130, "interrupted: Ctrl-C (143: SIGTERM, 129: SIGHUP); nothing of the environment was changed")


one_line = terminal.one_line  # a message as one line, every control (a newline too) shown escaped


def handle(exc: BaseException) -> int:
    """The one place an exception becomes a message and an exit code."""
    if isinstance(exc, Sm120PatchError):
        click.echo(f"sm120patch: error: {one_line(exc.message)}", err=True)
        if exc.hint_line:
            click.echo(f"hint: {terminal.visible(exc.hint_line)}", err=True)  # a diff keeps its lines
        return int(exc.exit_code)
    if isinstance(exc, click.exceptions.NoArgsIsHelpError):  # `sm120patch` alone: what it is and does
        click.echo(exc.ctx.get_help())
        return 0
    if isinstance(exc, click.UsageError):
        message = one_line(exc.format_message())
        click.echo(f"sm120patch: error: {message}", err=True)
        command = exc.ctx.command_path if exc.ctx else "sm120patch"
        # A group's --help (`sm120patch bogus`, `sm120patch manifest bogus`) lists its commands.
        what = "commands" if exc.ctx is None or isinstance(exc.ctx.command, click.Group) else "options"
        click.echo(f"hint: `{command} --help` lists the {what}, with examples", err=True)
        return int(ExitCode.USAGE)
    if isinstance(exc, BrokenPipeError):  # `--help | head`: a closed pipe is not an error (emit() keeps the code)
        _stdout_closed()
        return 0
    if isinstance(exc, (KeyboardInterrupt, click.Abort, signals.Interrupted)):
        message, code = interrupted(exc)
        click.echo(f"sm120patch: {message}", err=True)
        return code
    if isinstance(exc, OSError):  # outside a transaction: reading state, the JIT cache, a lock
        click.echo(one_line(f"sm120patch: error: {_os_error(exc)}"), err=True)
        if isinstance(exc, PermissionError) and exc.filename:  # which user to run as, or which mode to change
            from sm120patch.state import permission_hint

            click.echo(f"hint: {one_line(permission_hint(Path(str(exc.filename))))}", err=True)
        return int(ExitCode.FAILED)
    raise exc


def _os_error(exc: OSError) -> str:
    """An OSError outside a transaction, as its error line says it (after ``error: ``)."""
    where = f" ({exc.filename})" if exc.filename else ""
    return f"{exc.strerror or exc}{where}; nothing was changed"


def interrupted(exc: BaseException) -> tuple[str, int]:
    """What an interrupt says and the code the run exits with: 128 + the signal only where
    nothing the run changed stands (the README: 130 means rolled back)."""
    signum = getattr(exc, "signum", int(signal.SIGINT))
    committed = signals.STATE.committed
    if committed:  # a signal after the write (during a build): the change it made stands
        return (f"interrupted ({signals.name(signum)}) after the {committed} was committed: that change stands "
                "(`sm120patch status` shows it); what came after it did not finish", int(ExitCode.NOT_OK))
    if signals.STATE.reading:
        return f"interrupted ({signals.name(signum)}); this command changes nothing", signals.exit_code(signum)
    return f"interrupted ({signals.name(signum)}); any change in progress was rolled back", signals.exit_code(signum)


def _command_name(ctx: click.Context) -> str:
    return ctx.command_path.partition(" ")[2]


def _quiet(ctx: click.Context, param: click.Parameter, value: bool) -> None:  # noqa: ARG001 - click's callback
    if value:
        from sm120patch import progress

        progress.QUIET = True


class Command(click.Command):
    """Every command also takes -q after its name (`sm120patch status -q`), as the group does before it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.params.append(click.Option(["-q", "--quiet"], is_flag=True, expose_value=False, callback=_quiet,
                                        help="Print errors only (as `sm120patch -q`): the exit code says the outcome."))

    def invoke(self, ctx: click.Context):
        # A command whose --help says an interrupt changes nothing (it only reads) says so when interrupted.
        signals.STATE.reading = INTERRUPTED_READING in getattr(self.epilog, "codes", ())
        try:
            return super().invoke(ctx)
        except Sm120PatchError as exc:  # its hint may repeat this command, corrected
            exc.invocation = invocation(ctx)
            if ctx.params.get("as_json") and not _emitted:  # --json: stdout gets a document, always
                _error_document(ctx, exc.message, exc.hint_line, exc.exit_code)
            raise
        except (KeyboardInterrupt, click.Abort, signals.Interrupted) as exc:
            if ctx.params.get("as_json") and not _emitted:  # --json: a document, interrupted too
                message, code = interrupted(exc)
                with signals.held():  # the document whole, even under a second Ctrl-C
                    _error_document(ctx, message, None, code)
            raise
        except OSError as exc:  # handle() makes it exit 4 with its one line; --json gets its document too
            if ctx.params.get("as_json") and not _emitted and not isinstance(exc, BrokenPipeError):
                _error_document(ctx, _os_error(exc), None, ExitCode.FAILED)
            raise


def _error_document(ctx: click.Context, message: str, hint: str | None, code: int) -> None:
    from sm120patch.render import json_document

    error = {"error": {"message": message, "hint": hint, "exit_code": int(code)}}
    emit(json.dumps(json_document(_command_name(ctx), code, error), indent=2))


class Group(click.Group):
    command_class = Command
    group_class = type  # subgroups (manifest) are this class too, so their commands are Commands

    def main(self, args=None, prog_name=None, **extra):  # noqa: D102 - click's entry point, one-line errors
        global _emitted
        _emitted = False  # per command: CliRunner runs many in one process
        from sm120patch import progress

        progress.QUIET = False
        with signals.handled():
            try:
                code = super().main(args=args, prog_name=prog_name or "sm120patch", standalone_mode=False, **extra)
            except click.exceptions.Exit as exc:
                code = exc.exit_code
            except SystemExit as exc:  # a command's own exit code
                code = exc.code
            except BaseException as exc:  # noqa: BLE001 - handle() re-raises what it does not know
                code = handle(exc)
            else:
                if signals.pending() is not None:  # a signal a finalizer dropped: the run was interrupted
                    code = handle(signals.Interrupted(signals.pending()))
            late = signals.late()
            if late is not None:  # it arrived after the commit point: the run finished, as it says
                click.echo(f"sm120patch: {signals.name(late)} arrived after the {signals.STATE.committed} was "
                           "committed: the change stands and its cleanup finished", err=True)
            signals.STATE.finished = True
        sys.exit(code or 0)


_emitted = False  # whether the command printed its document (an error then adds none)


def _stdout_closed() -> None:
    """The reader of stdout went away (`status | head -3`): what is still to be printed, and the
    interpreter's flush at exit, go to /dev/null, so the command ends quietly with its own exit
    code (a pipeline's `pipefail` and Ansible read it), never a BrokenPipeError."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no stdout file descriptor at all (an embedding): nothing to protect
        pass


def emit(text: str, *, nl: bool = True, colour: Callable[[str], str] = str, data: bool = False) -> None:
    """``text`` on stdout, every control character in it but newline and tab made visible
    (terminal.visible): a drifted file's escape sequences in a diff, a path's, never reach the
    terminal as such; then ``colour``, sm120patch's own (render.paint). ``data``: a patch
    (`diff > sm120.patch`), written exact where stdout is no terminal, so that `patch` applies it."""
    global _emitted
    if text:
        try:
            exact = data and not sys.stdout.isatty()
            if exact:  # (color=True: click would take CSI sequences out of it, off a terminal)
                click.echo(text, nl=nl, color=True)
            else:
                click.echo(colour(terminal.visible(text)), nl=nl)
        except BrokenPipeError:
            _stdout_closed()
        _emitted = True


def python_option(function):
    return click.option("--python", "python", metavar="PATH", default=None,
                        help="The interpreter your server runs (a path, a name on PATH, or its environment's directory). "
                             "Default: the activated environment ($VIRTUAL_ENV, then $CONDA_PREFIX); else "
                             "sm120patch's own interpreter if it has FlashInfer, SGLang or vLLM; else python3 on "
                             "PATH. The first line of the report says which.")(function)


def source_option(function):
    return click.option("--source", metavar="DIR", default=None,
                        help="A git checkout of FlashInfer, SGLang or vLLM to act on instead of an installed environment.")(function)


def jit_option(function):
    return click.option("--jit-cache-base", metavar="DIR", default=None,
                        help="Base of FlashInfer's JIT cache: the server user's $FLASHINFER_WORKSPACE_BASE or $HOME. "
                        "Default: $FLASHINFER_WORKSPACE_BASE, else $HOME (as root on another user's environment: "
                        "that user's home).")(function)


def json_option(function):
    return click.option("--json", "as_json", is_flag=True, help="Print a JSON document instead of text.")(function)


def arch_option(function):
    # Checked in request_from, inside the command: a bad list then gets the user's own command,
    # corrected, as its hint (in a callback the rest of the command line is not parsed yet).
    return click.option("--arch", metavar="LIST", default=None,
                        help="Compute capabilities to build for (FLASHINFER_CUDA_ARCH_LIST), e.g. 12.0a; needed "
                        "where no GPU is visible (an image build). Default: the GPUs FlashInfer sees.")(function)


def wheel_dir_option(function):
    return click.option("--wheel-dir", metavar="DIR", default=None,
                        type=click.Path(exists=True, file_okay=False, path_type=Path),
                        help="Where the release's wheels are, for an offline server (else sm120patch's wheel cache, "
                        "downloading what is missing).")(function)


def selector_options(function):
    """--flashinfer [VER], --sglang [VER], --vllm [VER] (one per distribution, from the data): the same grammar on every command. Alone, the
    option selects that distribution; with a version, it also asserts the installed one."""
    from sm120patch.distributions import ANY

    for option, name in reversed(SELECTORS):
        function = click.option(f"--{option}", option, metavar="[VER]", default=None, is_flag=False, flag_value=ANY,
                                help=f"Only {name}; with VER, it must be installed at that release.")(function)
    return function


def invocation(ctx: click.Context):
    """The running command as the user gave it (the options typed, in their order), for hints
    that repeat it with one part corrected."""
    from click.core import ParameterSource

    from sm120patch.distributions import ANY
    from sm120patch.invocation import Invocation

    params = {p.name: p for p in ctx.command.params if isinstance(p, click.Option)}
    options = []
    for name, value in ctx.params.items():  # click fills these in command-line order
        if name not in params or ctx.get_parameter_source(name) is not ParameterSource.COMMANDLINE:
            continue
        if value is False or value is None:
            continue
        option = max(params[name].opts, key=len)
        selector_alone = name in dict(SELECTORS) and value == ANY
        text = ",".join(value) if isinstance(value, tuple) else str(value)  # a repeatable option, as one value
        options.append((option, None if value is True or selector_alone else text))
    return Invocation(ctx.command_path.partition(" ")[2], tuple(options))


def request_from(*, python=None, source=None, jit_cache_base=None, wheel_dir=None, with_ids=None, force=False,
                 dry_run=False, build=False, arch=None, on_build_step=None, early_probe=False, **selectors):
    """``early_probe``: start asking the target interpreter now, so that it answers while the
    rest of sm120patch is imported and the patch data read (status stays fast)."""
    if python and source:
        raise click.UsageError("--python and --source name two different targets; give one")
    if arch is not None:
        from sm120patch.jitbuild import parse_arch

        arch = parse_arch(arch)
    probe = None
    if early_probe and not source:
        from sm120patch import environment

        probe = environment.start_probe(python, [name for _, name in SELECTORS])
    from sm120patch import pipeline

    names = dict(SELECTORS)
    chosen = {names[option]: pipeline.normalize_selector(option, value)
              for option, value in selectors.items() if option in names and value is not None}
    # --with a,b and --with a --with b alike (each given value must name a patch).
    given = (with_ids,) if isinstance(with_ids, str) else tuple(with_ids or ())
    ids = tuple(dict.fromkeys(i.strip() for value in given for i in value.split(",") if i.strip()))
    empty = [value for value in given if not value.strip(" ,")]
    if empty:
        raise click.BadParameter(f"{empty[0]!r} names no patch; give opt-in patch ids, e.g. --with symm-mem "
                                 "(`sm120patch list` shows them)", param_hint="--with")
    return pipeline.Request(python=python, source=source, selectors=chosen, with_ids=ids, force=force,
                            dry_run=dry_run, jit_base=jit_cache_base, wheel_dir=wheel_dir, build=build, arch=arch,
                            on_build_step=on_build_step, probe=probe,
                            on_wait=lambda text: click.echo(one_line(f"sm120patch: {text}"), err=True))


def show(report, as_json: bool, text, document=None, *, note=None, nl: bool = True, data: bool = False) -> int:
    """Every command's end: the report as text or as its --json document (``note``: given the
    report and its text, a line for stderr, or None), then each error it carries through
    :func:`handle` (the change it reports stands); the command returns the report's exit code,
    which :class:`Group` exits with."""
    from sm120patch import progress, render

    ctx = click.get_current_context()
    # The text is for this stdout: its width, and its colours, painted after terminal.visible
    # (which would show sm120patch's own escape sequences as text too).
    render.COLUMNS, render.COLOUR = render.terminal_width(), render.colour() and not as_json
    rendered = (json.dumps(render.json_document(_command_name(ctx), report.exit_code, document(report)), indent=2)
                if as_json else text(report))
    if as_json or not progress.QUIET:
        emit(rendered, nl=nl or as_json, colour=render.paint, data=data and not as_json)
        said = note(report, rendered) if note is not None else None
        if said:
            click.echo(terminal.visible(said), err=True)
    for error in report.errors:
        error.invocation = invocation(ctx)
        handle(error)
    return int(report.exit_code)


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
             epilog=epilog(["sm120patch status --python ~/ml-env/bin/python3",
                            "sm120patch apply --python ~/ml-env/bin/python3",
                            "sm120patch bench --python ~/ml-env/bin/python3"],
                           [(0, "success"), (1, "status: not patched; verify/bench: a check failed; build (and apply "
                                                "--build): the build failed; check-log: fell back, not requested or "
                                                "crashed"), USAGE,
                            (3, "refused: a file is not the release's bytes, no pinned patch set; check-log: a release "
                                "whose log lines are not mapped"),
                            (4, "failed (I/O, permissions, a lock held); everything was rolled back"),
                            (5, "check-log: no verdict yet (the server is still starting)"), INTERRUPTED]))
@click.version_option(__version__, prog_name="sm120patch")
@click.option("-q", "--quiet", is_flag=True,
              help="Print errors only, no report and no progress (scripts, Ansible): the exit code says the outcome. "
                   "--json still prints its document.")
def cli(quiet) -> None:
    """Enable the TRT-LLM fused allreduce (allreduce + residual + RMSNorm) of FlashInfer, SGLang
    and vLLM on SM120 GPUs (RTX PRO 6000 Blackwell, RTX 5090) with exact, version-pinned,
    reversible patches. Each command's --help has examples."""
    from sm120patch import progress

    progress.QUIET = quiet


@cli.command(short_help="Will each server fuse, what stands in the way, what to run next (--verbose: all of it).",
             epilog=epilog(["sm120patch status --python ~/ml-env/bin/python3",
                            "sm120patch status --verbose --python ~/ml-env/bin/python3   # every patch, the chain",
                            "sm120patch status --python ~/ml-env/bin/python3 --json | jq .exit_code",
                            "sm120patch status --source ~/src/flashinfer"],
                           [(0, "everything installed is patched (or fixed upstream)"),
                            (1, "something is not patched, partly patched, or has no patch set; or none of the "
                                "distributions sm120patch patches is installed there"), USAGE,
                            (3, "a file is not the release's bytes (drift), or an interrupted run"),
                            (4, "failed to read the environment's state, or a run in progress (apply, revert) "
                                "held it longer than SM120PATCH_LOCK_WAIT (10 s)"), INTERRUPTED_READING]))
@python_option
@source_option
@selector_options
@jit_option
@click.option("--brief", is_flag=True, help="Only the answer: one line per server, whether it will fuse and what "
              "stands in the way (on a terminal, wrapped to its width, a command never broken).")
@click.option("--verbose", "-v", is_flag=True, help="The whole table: every patch and who made it, each server's "
              "fusion chain step by step, the JIT cache entries, notes and pins (--json always has it all).")
@json_option
def status(python, source, jit_cache_base, brief, verbose, as_json, **selectors):
    """Will each installed server fuse on SM120, and what stands in the way: the answer per
    server, one line per distribution (its version, patched or not, what is missing or drifted,
    warnings), and what to run next. --verbose: each distribution's pinned patch set and the
    state of every patch (who made it: sm120patch, a hand edit), the fusion chain, stale or
    foreign trtllm_comm JIT entries, AOT shadowing, pins, and an interrupted run. With --source:
    which patches a git checkout's HEAD has."""
    if brief and verbose:
        raise click.UsageError("--brief and --verbose ask for opposite things; give one")
    request = request_from(python=python, source=source, jit_cache_base=jit_cache_base, early_probe=True, **selectors)
    from sm120patch import pipeline, render

    if brief:
        return show(pipeline.status(request), as_json, render.render_brief, render.status_json, note=render.brief_note)
    text = render.render_status_verbose if verbose else render.render_status
    return show(pipeline.status(request), as_json, text, render.status_json)


@cli.command(short_help="Apply the patch set pinned to each installed release.",
             epilog=epilog(["sm120patch apply --python ~/ml-env/bin/python3",
                            "sm120patch apply --python ~/ml-env/bin/python3 --flashinfer 0.6.4 --sglang 0.5.9",
                            "sm120patch apply --python ~/ml-env/bin/python3 --sglang --with symm-mem --dry-run",
                            "sm120patch apply --source ~/src/sglang"],
                           [(0, "patched, or nothing to change"),
                            (1, "--build: the patch was applied; the build failed, could not start or was interrupted"),
                            (2, "bad input: an option, --python, a version selector, patch data; --build: what the "
                                "build needs (torch, ninja, nvcc, an arch) is missing: nothing was changed"),
                            (3, "refused: drift, no pinned patch set, a symlinked file, an interrupted run (dry run); "
                                "nothing was changed; --with tuned-limits: the server's patched decision code raised "
                                "in the target interpreter (verify --tuned's check), every change rolled back"),
                            (4, "failed (I/O, read-only, permissions, a lock held); everything was rolled back"),
                            INTERRUPTED]))
@selector_options
@click.option("--with", "with_ids", metavar="ID,...", multiple=True,
              help="Also apply these opt-in patches (see `list`); repeatable.")
@python_option
@source_option
@click.option("--dry-run", is_flag=True, help="Print the unified diff; change nothing (a checkout: no branch, no commit).")
@click.option("--force", is_flag=True, help="Patch files that are not the release's bytes (drift, a symlink, an "
              "unknown release) by meaning; recorded as unpinned.")
@click.option("--build", "build_", is_flag=True, help="Then build trtllm_comm with FlashInfer's JIT into the server's "
              "JIT cache, so the next start compiles nothing (minutes; see `sm120patch build --help`).")
@arch_option
@jit_option
@wheel_dir_option
@json_option
def apply(with_ids, python, source, dry_run, force, build_, arch, jit_cache_base, wheel_dir, as_json, **selectors):
    """Apply the patch set pinned to each installed release (or to a checkout, as one commit on
    the branch sm120patch/<dist>-<version>). Required patches always, opt-in ones with --with.
    One run is one transaction: everything or nothing. Re-applying changes nothing."""
    from sm120patch import changes, render
    from sm120patch.progress import BuildProgress

    with BuildProgress(quiet=as_json) as progress:
        report = changes.apply(request_from(python=python, source=source, jit_cache_base=jit_cache_base,
                                             wheel_dir=wheel_dir, with_ids=with_ids, force=force, dry_run=dry_run,
                                             build=build_, arch=arch, on_build_step=progress, **selectors))
    return show(report, as_json, render.render_change, render.change_json)


@cli.command(short_help="Build trtllm_comm into the server's JIT cache, so its next start compiles nothing.",
             epilog=epilog(["sm120patch build --python ~/ml-env/bin/python3",
                            "sm120patch build --python /opt/venv/bin/python --arch 12.0a   # an image build, no GPU",
                            "sudo \"$(command -v sm120patch)\" build --python ~svc/env/bin/python   # builds as "
                            "svc, in svc's cache"],
                           [(0, "built, and proven to be the entry FlashInfer loads at start"),
                            (1, "the build failed (its last lines are shown; no half-written entry is left)"),
                            (2, "bad input: an option, --python; what the build needs (torch, ninja, nvcc, an arch) "
                                "is missing"),
                            (3, "refused: FlashInfer is not patched (run `sm120patch apply --build`)"), INTERRUPTED]))
@python_option
@arch_option
@jit_option
@json_option
def build(python, arch, jit_cache_base, as_json):
    """Build FlashInfer's trtllm_comm with FlashInfer's own JIT, in the target interpreter, into
    the JIT cache the server reads (--jit-cache-base, else as `status` says), for the GPUs
    FlashInfer sees (or FLASHINFER_CUDA_ARCH_LIST, or --arch), using every core. A fresh process
    then proves that FlashInfer will load it without compiling."""
    from sm120patch import changes, render
    from sm120patch.progress import BuildProgress

    with BuildProgress(quiet=as_json) as progress:
        report = changes.build(request_from(python=python, jit_cache_base=jit_cache_base, arch=arch,
                                             on_build_step=progress))
    return show(report, as_json, render.render_change, render.change_json)


@cli.command(short_help="Restore the release's bytes of every patched file.",
             epilog=epilog(["sm120patch revert --python ~/ml-env/bin/python3",
                            "sm120patch revert --python ~/ml-env/bin/python3 --sglang",
                            "sm120patch revert --python ~/ml-env/bin/python3 --force --wheel-dir /srv/wheels",
                            "sm120patch revert --source ~/src/flashinfer"],
                           [(0, "restored (or nothing to restore)"), USAGE,
                            (3, "refused for some distribution (edited after patching, no release bytes to be had); "
                                "the others were restored"),
                            (4, "failed; everything was rolled back"), INTERRUPTED]))
@selector_options
@python_option
@source_option
@click.option("--force", is_flag=True, help="Restore the release's bytes even over files edited by hand, and clear a "
              "journal that cannot be rolled back.")
@jit_option
@wheel_dir_option
@json_option
@click.option("--dry-run", is_flag=True, help="Say what would be restored and removed; change nothing (no download).")
def revert(python, source, force, dry_run, jit_cache_base, wheel_dir, as_json, **selectors):
    """Restore what sm120patch replaced (the release's bytes), each checked against the installed
    RECORD: from the saved original, else from the release wheel. A hand-made patch is reverted
    too. With --source: back to the original branch."""
    from sm120patch import changes, render

    report = changes.revert(request_from(python=python, source=source, jit_cache_base=jit_cache_base,
                                          wheel_dir=wheel_dir, force=force, dry_run=dry_run, **selectors))
    return show(report, as_json, render.render_change, render.change_json)


@cli.command(short_help="Print the unified diff apply would make.",
             epilog=epilog(["sm120patch diff --python ~/ml-env/bin/python3 > sm120.patch",
                            "patch -p1 < sm120.patch -d \"$(~/ml-env/bin/python3 \\\n"
                            "    -c 'import sysconfig; print(sysconfig.get_path(\"purelib\"))')\"   # the same change by hand"],
                           [(0, "the diff (or, on stderr, that there is nothing to apply)"), USAGE,
                            (3, "refused: drift, no pinned patch set"), INTERRUPTED_READING]))
@selector_options
@click.option("--with", "with_ids", metavar="ID,...", multiple=True, help="Include these opt-in patches; repeatable.")
@python_option
@source_option
@click.option("--force", is_flag=True, help="As apply --force: by meaning, for drifted files or unknown releases.")
def diff(with_ids, python, source, force, **selectors):
    """Print the unified diff apply would make, with paths from the package root (site-packages)
    or the checkout's root: `patch -p1` and `git apply` accept it there. Changes nothing."""
    from sm120patch import changes, render

    report = changes.diff(request_from(python=python, source=source, with_ids=with_ids, force=force, **selectors))
    return show(report, False, render.render_diff, note=render.diff_note, nl=False, data=True)


@cli.command(short_help="Prove the patched state: hashes, semantics, runtime, compile, build.",
             epilog=epilog(["sm120patch verify --python ~/ml-env/bin/python3",
                            "sm120patch verify --python ~/ml-env/bin/python3 --runtime --compile",
                            "sm120patch verify --python ~/ml-env/bin/python3 --tuned"],
                           [(0, "every check ran and passed"),
                            (1, "a check failed, or a check you asked for could not run (it says what it needs)"),
                            USAGE, INTERRUPTED_READING]))
@python_option
@click.option("--runtime", is_flag=True, help="FlashInfer's own JIT spec of trtllm_comm for 12.0a, and an import of each "
              "patched module, in the target interpreter (needs torch; a temporary JIT workspace).")
@click.option("--compile", "compile_", is_flag=True, help="The lamport kernel from the installed headers to PTX with nvcc: "
              "sm_120a must contain griddepcontrol, sm_90a/sm_100a must equal the release's PTX (no GPU needed).")
@click.option("--build", is_flag=True, help="FlashInfer's JIT build of trtllm_comm for sm_120a in a temporary workspace "
              "(minutes; without a CUDA driver it compiles but does not link).")
@click.option("--tuned", is_flag=True, help="Where tuned-limits is applied: the server's own fusion decisions, imported "
              "in the target interpreter as the server imports them, at the profile's limits (-1, 0, +1 token) and "
              "1..TP tokens: fused or not, one-shot or two-shot (a stand-in SM120 device where none is visible).")
@jit_option
@json_option
def verify(python, runtime, compile_, build, tuned, jit_cache_base, as_json):
    """Prove the patched state: manifest hashes and semantic checks always; with options, a
    runtime, a compile and a build check."""
    from sm120patch import pipeline, render, verify as checks
    from sm120patch.progress import line_progress

    report = checks.verify(pipeline.status(request_from(python=python, jit_cache_base=jit_cache_base)),
                           runtime=runtime, compile_=compile_, build=build, tuned=tuned,
                           progress=line_progress(quiet=as_json))
    return show(report, as_json, render.render_verify, render.verify_json)


@cli.command(short_help="Check the machine: GPUs, driver, toolkit, topology, the environment.",
             epilog=epilog(["sm120patch doctor --python ~/ml-env/bin/python3", "sm120patch doctor --json"],
                           [(0, "the report was made (it works without a GPU and says so)"), USAGE, INTERRUPTED_READING]))
@python_option
@jit_option
@json_option
def doctor(python, jit_cache_base, as_json):
    """GPUs and compute capability, driver and CUDA toolkit, PCIe-only topology, AOT shadowing,
    version pins, upstream fixes, whether SGLang turns fusion on by itself."""
    from sm120patch import doctor as checks, pipeline, render

    report = checks.doctor(lambda device: pipeline.status(request_from(python=python, jit_cache_base=jit_cache_base),
                                                          device=device))
    return show(report, as_json, render.render_doctor, render.doctor_json)


def _world_size(value):
    """--tp is refused as it is parsed, before the target is asked anything: FlashInfer's fused
    allreduce runs at these sizes only."""
    from sm120patch.bench.preflight import SUPPORTED_WORLD_SIZES

    if value is not None and value not in SUPPORTED_WORLD_SIZES:
        raise click.BadParameter(f"{value}: FlashInfer's fused allreduce runs at "
                                 f"{', '.join(map(str, SUPPORTED_WORLD_SIZES[:-1]))} or {SUPPORTED_WORLD_SIZES[-1]} ranks")
    return value


@cli.command(short_help="Check the fused allreduce against NCCL on this machine's GPUs, time it, recommend.",
             epilog=epilog(["sm120patch bench --python ~/sglang-env/bin/python3",
                            "sm120patch bench --python ~/sglang-env/bin/python3 --tp 4 --tokens 1,8,64,512 --hidden 7168",
                            "sudo \"$(command -v sm120patch)\" bench --tune --tp 4 \\\n"
                            "    --model ~/models/llama/config.json --python ~/sglang-env/bin/python3   # as root: it "
                            "writes /etc/sm120patch/tuned-limits.json"],
                           [(0, "every shape matched the reference (and was timed); --tune: and the profile was written"),
                            (1, "a fused result differs from the reference, the kernel crashed or hung, or the "
                                "workspace created as the installed server creates it was refused; --tune: or a pair "
                                "of ranks could not complete a fused call together"),
                            (2, "the target cannot run it: no torch, no CUDA, fewer than 2 GPUs, a --tp the kernel refuses"),
                            (3, "refused: FlashInfer is not patched for the SM120 GPUs in use, or an installed server "
                                "would not fuse on GPUs without multicast (run `sm120patch apply`); --tune: ranks that "
                                "share a GPU, or a file at the profile's path that is not a profile"),
                            (4, "--tune: the profile could not be written (nothing was)"),
                            INTERRUPTED_READING]))
@python_option
@click.option("--tp", type=int, default=None, metavar="N", callback=lambda ctx, param, value: _world_size(value),
              help="Ranks (GPUs) to run: 2, 4, 8 or 16. Default: every visible GPU.")
@click.option("--tokens", metavar="LIST", default="1,2,4,8,16,32,64,128,256,512,1024,2048", show_default=True,
              help="Token counts (batch sizes) to check and time.")
@click.option("--hidden", metavar="LIST", default="4096,7168", show_default=True,
              help="Hidden sizes: your model's (e.g. 4096 for Llama-3-8B, 7168 for DeepSeek-V3).")
@click.option("--dtype", type=click.Choice(["bf16", "fp16"]), default="bf16", show_default=True)
@click.option("--strategy", type=click.Choice(["auto", "oneshot", "twoshot", "both"]), default="auto", show_default=True,
              help="auto: FlashInfer's own choice, as SGLang runs it; both: one-shot and two-shot.")
@click.option("--check-only", is_flag=True, help="Check every shape against the reference; skip the timing.")
@click.option("--tune", is_flag=True,
              help="Measure where fusion wins at this TP size (one-shot, two-shot, NCCL + norm, each checked, then "
                   "timed in repetitions; then sizes between two of --tokens until each limit is within 10 % of its "
                   "crossover) and write the limits into the profile the patched servers read.")
@click.option("--model", metavar="PATH", default=None,
              help="--tune: the model's config.json, or its directory (its hidden_size and torch_dtype), instead "
                   "of --hidden.")
@click.option("--profile", "profile_path", metavar="PATH", default=None,
              help="--tune: where to write the profile. Default: $SM120PATCH_TUNED_LIMITS, else "
                   "/etc/sm120patch/tuned-limits.json (where the servers look).")
@click.option("--repeats", type=click.IntRange(3, 101), default=7, show_default=True,
              help="--tune: independent repetitions per path and size (median and interquartile range).")
@jit_option
@json_option
@click.pass_context
def bench(ctx, python, tp, tokens, hidden, dtype, strategy, check_only, tune, model, profile_path, repeats,
          jit_cache_base, as_json):
    """Create the fusion workspace the way the installed server does, check FlashInfer's fused
    allreduce + residual + RMSNorm against NCCL + RMSNorm on this machine's GPUs, then time fused
    against unfused and recommend a setting; with --tune, measure the limits and write the profile.

    Runs in the server's interpreter (its torch and FlashInfer), one process per GPU. FlashInfer
    builds trtllm_comm in its JIT cache on first use, as the server would (minutes)."""
    from sm120patch import bench as bench_mod, render
    from sm120patch.bench import profile
    from sm120patch.progress import BenchProgress

    given = {name for name in ("hidden", "dtype", "model", "profile_path", "repeats", "check_only", "strategy")
             if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT}
    if not tune and given & {"model", "profile_path", "repeats"}:
        option = {"model": "--model", "profile_path": "--profile", "repeats": "--repeats"}[sorted(given & {"model", "profile_path", "repeats"})[0]]
        raise click.UsageError(f"{option} is for --tune (measure the limits and write the profile)")
    if tune:
        if given & {"check_only", "strategy"}:
            raise click.UsageError("--tune checks and times every path itself: drop --check-only and --strategy")
        if model and "hidden" in given:
            raise click.UsageError("--tune: give --model or --hidden, not both")
        if model:
            hidden_size, model_dtype = profile.read_model(Path(model).expanduser())
            hidden, dtype = str(hidden_size), dtype if "dtype" in given else (model_dtype or dtype)
        elif "hidden" not in given:
            raise click.UsageError("--tune measures for one model: pass --hidden N (its hidden size) or --model PATH "
                             "(its config.json)")
    request = bench_mod.BenchRequest(
        python=Path(python) if python else None, tp=tp,
        tokens=bench_mod.parse_int_list(tokens, option="--tokens", minimum=1, maximum=16384),
        hidden=bench_mod.parse_int_list(hidden, option="--hidden", minimum=128, maximum=16384, multiple_of=8),
        dtype=dtype, strategy=strategy, check_only=check_only, tune=tune, repeats=repeats,
        jit_base=Path(jit_cache_base).expanduser() if jit_cache_base else None,
    )
    if tune and len(request.hidden) != 1:
        raise click.UsageError(f"--tune: one hidden size (the model's), not {hidden}")
    with BenchProgress(quiet=as_json) as progress:
        on_event = progress if progress.enabled else None
        if tune:
            report = bench_mod.tune(request, profile_path=Path(profile_path).expanduser() if profile_path
                                    else profile.default_path(), model=Path(model).resolve() if model else None,
                                    on_event=on_event)
            return show(report, as_json, render.render_tune, render.tune_json)
        report = bench_mod.bench(request, on_event=on_event)
    return show(report, as_json, render.render_bench, render.bench_json)


@cli.command("check-log", short_help="Read a server's log: did it really fuse, fall back, crash, or is it starting?",
             epilog=epilog(["sm120patch check-log /var/log/sglang.log --version 0.5.9",
                            "sm120patch check-log server.log --python ~/ml-env/bin/python3",
                            "sm120patch check-log /var/log/vllm.log --follow --timeout 900 --json",
                            "sm120patch check-log /var/log/sglang.log --new-run --timeout 900 & systemctl restart sglang; wait $!",
                            "journalctl -u sglang -o cat | sm120patch check-log - --server sglang"],
                           [(0, "fused and serving: FlashInfer's workspace on every rank and the ready line (the newest "
                                "run of the log; several replicas: of every one)"),
                            (1, "fell back to unfused allreduce, not requested, crashed or died outside Python (it "
                                "says which, the chain step and the fix)"),
                            (2, "bad input: an option, a missing file (without --follow), a --python without the server, "
                                "a device or binary data instead of a log, standard input closed, a log of the other "
                                "server than --server"),
                            (3, "unknown release: sm120patch has not mapped that release's log lines (it shows what it saw)"),
                            (4, "the log could not be read"),
                            (5, "no verdict yet: still starting, or fused but not serving yet (with --follow, or on a "
                                "pipe: the timeout passed first)"),
                            INTERRUPTED_READING]))
@click.argument("log", metavar="FILE|-")
@click.option("--server", type=click.Choice(["sglang", "vllm"]), default=None,
              help="Which server wrote it. Default: told by the lines' format.")
@click.option("--version", "server_version", metavar="VER", default=None,
              help="The server's release, to pick its lines (vLLM logs it; SGLang does not).")
@python_option
@click.option("--follow", is_flag=True, help="Keep reading the growing file (like tail -F: rotation and truncation "
              "too) until the first final verdict or --timeout.")
@click.option("--new-run", is_flag=True, help="Follow the log for a run that begins after this command starts, and "
              "give its verdict (the runs already in the log do not count): start it before, or as, you restart "
              "the server.")
@click.option("--timeout", type=click.FloatRange(min=0), default=600, show_default=True, metavar="SECONDS",
              help="With --follow or --new-run, or reading a pipe or FIFO: stop waiting after this long and give the "
                   "verdict of what was read (exit 5 when that is no verdict yet).")
@json_option
def check_log(log, server, server_version, python, follow, new_run, timeout, as_json):
    """Say from a server's own log lines whether SGLang or vLLM really fused (which backend, the
    workspace on every rank), fell back to unfused allreduce (the release's message, the step
    that explains it and the fix), crashed (the exception and its last frame), is still starting,
    or never asked for fusion. Per rank and in one line; the lines are each release's own, from
    patches/<server>/logs.toml."""
    from sm120patch import logcheck, render

    report = logcheck.check_log(logcheck.CheckLogRequest(log, server, server_version, python, follow, timeout,
                                                         new_run))
    return show(report, as_json, render.render_log_check, render.log_check_json)


@cli.command(short_help="Write sm120patch's commit in a checkout as git format-patch files.",
             epilog=epilog(["sm120patch export --source ~/src/flashinfer --out /tmp/sm120-patches"],
                           [(0, "written"), USAGE_NO_TARGET,
                            (3, "sm120patch made no commit there, or --out has a file of a patch's name that is not "
                                "this commit's export (nothing was written)")]))
@click.option("--source", metavar="DIR", required=True, help="The git checkout sm120patch committed to.")
@click.option("--out", metavar="DIR", required=True, type=click.Path(file_okay=False), help="Where to write the patch files.")
@click.option("--force", is_flag=True, help="Replace a file of the same name in --out that is not this commit's export.")
def export(source, out, force):
    """Write sm120patch's commit as `git format-patch` files (for `git am`, or upstream)."""
    from sm120patch import checkout, distributions, render
    from sm120patch.reports import ExportReport

    tree = checkout.open_checkout(source, distributions.load_registry(full=False))
    return show(ExportReport(checkout.export(tree, Path(out), force=force)), False, render.render_export)


@cli.command("list", short_help="The support matrix: releases, patches, upstream fixes.",
             epilog=epilog(["sm120patch list", "sm120patch list --python ~/ml-env/bin/python3",
                            "sm120patch list --json | jq '.distributions.sglang.releases | keys'"], [(0, "printed"), USAGE, INTERRUPTED_READING]))
@python_option
@json_option
def list_(python, as_json):
    """Every release sm120patch knows, its patches (required and opt-in), and the upstream fix.
    With --python: which release of each is installed there."""
    from sm120patch import distributions, environment, render
    from sm120patch.reports import ListReport

    registry = distributions.load_registry(full=False)
    installed = target = None
    if python:
        env = environment.start_probe(python, registry.names).result(registry.wanted_rows)
        installed = {name: env.get(name) for name in registry.names if env.get(name) is not None}
        target = str(env.executable)
    return show(ListReport(registry, installed, target), as_json, render.render_list_report, render.list_report_json)


@cli.group(short_help="Maintainers: build the vendor manifests, add a new upstream release.",
           epilog=epilog(["sm120patch manifest build --check --distribution sglang",
                          "sm120patch manifest add sglang 0.5.24",
                          "sm120patch manifest add vllm --newer --check"], [(0, "see each command")]))
def manifest() -> None:
    """Build the vendor manifests from the real upstream wheels, and add new releases (maintainers)."""


@manifest.command("build", epilog=epilog(["sm120patch manifest build", "sm120patch manifest build --check",
                                          "sm120patch manifest build --check --distribution vllm"],
                                         [(0, "written, or (--check) identical"), (1, "--check: a manifest differs"),
                                          USAGE_NO_TARGET, (4, "a download failed")]))
@click.option("--wheel-cache", metavar="DIR", default=None, help="Where downloaded wheels are kept (default: ~/.cache/sm120patch/wheels).")
@click.option("--out", metavar="DIR", default=None, help="Write here instead of vendor-manifests/.")
@click.option("--check", is_flag=True, help="Rebuild and compare with the committed manifests; write nothing.")
@click.option("--distribution", "names", metavar="NAME", multiple=True,
              help="Only this distribution's releases (repeatable; default: every one). vLLM's wheels are ~400 MB each.")
def manifest_build(wheel_cache, out, check, names):
    """Download every pinned release's wheel and write (or compare) its manifest."""
    from sm120patch import releases, render
    from sm120patch.progress import line_progress
    from sm120patch.reports import ManifestReport

    result = releases.build_all(Path(wheel_cache) if wheel_cache else None, Path(out) if out else None,
                                check=check, progress=line_progress(), names=names)
    return show(ManifestReport(result, check), False, render.render_manifests)


@manifest.command("add", epilog=epilog(["sm120patch manifest add sglang 0.5.24",
                                        "sm120patch manifest add vllm 0.34.0 --wheel ./vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl",
                                        "sm120patch manifest add flashinfer-python --newer --check"],
                                       [(0, "pinned, or already supported (--check: every release is supported)"),
                                        (1, "--check: a release needs a pin that is not written yet"),
                                        USAGE_NO_TARGET, (3, "no patch set fits: nothing was written"),
                                        (4, "a download failed")]))
@click.argument("distribution", metavar="DIST")
@click.argument("version", required=False, metavar="[VERSION]")
@click.option("--wheel", "wheel", metavar="FILE", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Take this wheel of the release instead of downloading it.")
@click.option("--newer", is_flag=True, help="Every release on the index newer than the newest sm120patch knows.")
@click.option("--check", is_flag=True, help="Report what would be pinned; write nothing (for a scheduled job).")
@click.option("--wheel-cache", metavar="DIR", default=None, help="Where downloaded wheels are kept (default: ~/.cache/sm120patch/wheels).")
def manifest_add(distribution, version, wheel, newer, check, wheel_cache):
    """Support a new upstream release: try the neighbouring releases' patch sets on its real
    wheel, keep the one that fits exactly, and write its pin and manifest (maintainers).

    Prints a review summary: the set kept, each file's sha256 against the previous release's,
    and the diff of each patched file. When no set fits, nothing is written and the evidence is
    printed: each rewriter's site count in this release, and what the nearest release has.
    """
    from sm120patch import releases, render
    from sm120patch.progress import line_progress
    from sm120patch.reports import AdditionReport

    if newer == bool(version):
        raise click.UsageError("give a VERSION or --newer (not both)" if newer else "give a VERSION, or --newer for every "
                         "release newer than the newest known one")
    if wheel and newer:
        raise click.UsageError("--wheel names one release's wheel: give its VERSION instead of --newer")
    cache = Path(wheel_cache) if wheel_cache else None
    if newer:
        results = releases.newer(distribution, check=check, wheel_cache=cache, progress=line_progress())
    else:
        results = [releases.add(distribution, version, wheel=Path(wheel) if wheel else None, check=check,
                                wheel_cache=cache)]
    missing = [r for r in results if not r.supported]
    report = AdditionReport(distribution, results, check, newer, [releases.refusal(missing[0])] if missing else [])
    return show(report, False, render.render_additions)


def main() -> None:
    cli(prog_name="sm120patch")
