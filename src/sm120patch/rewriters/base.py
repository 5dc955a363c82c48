"""Rewriter protocol, typed results and the by-name registry.

A rewriter is a small class, registered under a dotted name (``python.extend-list-argument``),
with a one-line ``description`` and the parameters it takes. Patch sets (TOML data) name a
rewriter and give its parameters and the exact number of sites it must find; the rewriter
never guesses: a different count is a :class:`NoMatch`, and the planner refuses the file.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Mapping, NamedTuple, Union

from sm120patch.errors import PatchDataError


class Changed(NamedTuple):
    """The rewriter found exactly ``sites`` sites and rewrote them."""

    data: bytes
    sites: int


class AlreadyApplied(NamedTuple):
    """Every site is already in its patched form; nothing to do."""

    sites: int


class NoMatch(NamedTuple):
    """The source is neither the expected pristine nor the patched form."""

    reason: str


# NamedTuples, not frozen dataclasses: this module is on status's import path (a frozen dataclass
# costs about 0.5 ms to define). Each has a field, so none is ever an empty (false) tuple.
RewriteResult = Union[Changed, AlreadyApplied, NoMatch]


class Rewriter(abc.ABC):
    """Base class: subclasses set ``name``, ``description`` and ``params`` and implement
    :meth:`rewrite`. ``params`` maps each parameter name to its type (``list`` means a list
    of strings); every listed parameter is required."""

    name: ClassVar[str]
    description: ClassVar[str]
    params: ClassVar[Mapping[str, type]] = {}

    def __init__(self, **params: Any) -> None:
        missing = sorted(set(self.params) - set(params))
        unknown = sorted(set(params) - set(self.params))
        if missing or unknown:
            raise PatchDataError(
                f"rewriter {self.name}: "
                + "; ".join(
                    part
                    for part in (
                        f"missing parameter(s) {', '.join(missing)}" if missing else "",
                        f"unknown parameter(s) {', '.join(unknown)}" if unknown else "",
                    )
                    if part
                )
            )
        for key, kind in self.params.items():
            value = params[key]
            ok = isinstance(value, kind) and (
                kind is not list or all(isinstance(item, str) for item in value)
            )
            if not ok:
                raise PatchDataError(
                    f"rewriter {self.name}: parameter {key} must be "
                    + ("a list of strings" if kind is list else f"a {kind.__name__}")
                )
        self.args = dict(params)
        self.validate()

    def validate(self) -> None:
        """Check parameter values (e.g. that a pattern compiles); raise PatchDataError."""

    @abc.abstractmethod
    def rewrite(self, data: bytes, *, sites: int) -> RewriteResult:
        """Rewrite ``data`` (a file's bytes), which must hold exactly ``sites`` sites."""


REGISTRY: dict[str, type[Rewriter]] = {}


def register(cls: type[Rewriter]) -> type[Rewriter]:
    if cls.name in REGISTRY:
        raise RuntimeError(f"rewriter {cls.name} registered twice")
    REGISTRY[cls.name] = cls
    return cls


def decode(data: bytes, rewriter: str) -> str | NoMatch:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return NoMatch(f"{rewriter}: file is not UTF-8 text ({exc.reason} at byte {exc.start})")
