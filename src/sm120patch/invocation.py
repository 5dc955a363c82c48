"""The command the user ran, kept as options, so that a hint can repeat it with only the wrong
part corrected: `revert --flashinfer 0.6.5` on an environment with 0.6.4 suggests `revert
--flashinfer 0.6.4`, not `apply`, and `--dry-run` survives. Printed quoted for a POSIX shell,
so that it works when copied as printed, whatever the paths hold."""

from __future__ import annotations

from typing import NamedTuple

from sm120patch import terminal

PROGRAM = "sm120patch"


class Invocation(NamedTuple):
    command: str  # "revert", "manifest build"
    options: tuple[tuple[str, str | None], ...] = ()  # in the order given; None: a flag, or a selector alone

    def replaced(self, option: str, value: str | None) -> Invocation:
        """The same command with ``option`` set to ``value`` (added at the end if it was not given)."""
        if any(name == option for name, _ in self.options):
            return self._replace(options=tuple((name, value if name == option else old) for name, old in self.options))
        return self._replace(options=(*self.options, (option, value)))

    def without(self, *options: str) -> Invocation:
        return self._replace(options=tuple(o for o in self.options if o[0] not in options))

    @property
    def words(self) -> list[str]:
        words = [PROGRAM, *self.command.split()]
        for name, value in self.options:
            words += [name] if value is None else [name, value]
        return words

    def __str__(self) -> str:
        return terminal.join(self.words)


def command(words: str, *options: tuple[str, str | None]) -> str:
    """An sm120patch command line built here (``words``: the subcommand and its own flags), quoted."""
    return str(Invocation(words, tuple(options)))
