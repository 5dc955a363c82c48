"""Progress on stderr (a bar on a terminal, plain lines elsewhere): never part of a command's output or its --json."""

from __future__ import annotations

import sys

import click

from sm120patch.terminal import one_line


QUIET = False  # `sm120patch --quiet`: no progress at all, for scripts and Ansible


class _Bar:
    """A click progress bar on stderr, made when the first event needs it, closed on exit; on a
    terminal only (``enabled``)."""

    def __init__(self, *, quiet: bool) -> None:
        quiet = quiet or QUIET
        self.enabled = not quiet and sys.stderr.isatty()
        self.bar = None
        self.done = 0

    def _open(self, **options) -> None:
        self.bar = click.progressbar(file=sys.stderr, show_pos=True, **options)
        self.bar.__enter__()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


class BuildProgress(_Bar):
    """ninja's [n/m] steps as a progress bar with the elapsed time on a terminal; elsewhere
    (systemd, Ansible, a pipe) one plain line per step. The build says it has started at once
    (``step`` 0): ninja's first step can take minutes."""

    def __init__(self, *, quiet: bool) -> None:
        super().__init__(quiet=quiet)
        self.quiet = quiet or QUIET

    def __call__(self, line: str, step: int, total: int) -> None:
        if self.quiet:
            return
        if step == 0:
            click.echo(one_line(f"sm120patch: {line}"), err=True)
            return
        if not self.enabled:
            click.echo(one_line(f"sm120patch: build step {step}/{total}: {line.split('] ', 1)[-1][:160]}"), err=True)
            return
        if self.bar is None:
            self._open(length=total, label="building trtllm_comm", show_eta=True)
        self.bar.update(step - self.done)
        self.done = step


class BenchProgress(_Bar):
    """bench's progress on a terminal: what is being loaded, then a bar over the shapes."""

    def __call__(self, event: dict) -> None:
        if not self.enabled:
            return
        if event.get("event") == "stage":
            click.echo(one_line(f"sm120patch: {event['text']} ..."), err=True)
        elif event.get("event") == "cases":
            self._open(length=event["total"], label="checking and timing", item_show_func=lambda item: item)
        elif event.get("event") == "case" and self.bar is not None:
            shape = f"tokens {event['tokens']}, hidden {event['hidden']}" if "tokens" in event else None
            self.bar.update(event["index"] - self.done, current_item=shape)
            self.done = event["index"]


def line_progress(*, quiet: bool = False):
    """Progress lines on stderr, a terminal or not (None: say nothing, for --json)."""
    return None if quiet or QUIET else (lambda text: click.echo(one_line(text), err=True))


def say(text: str) -> None:
    """One line on stderr about work that takes a while (a download), wherever it is called from."""
    if not QUIET:
        click.echo(one_line(f"sm120patch: {text}"), err=True)
