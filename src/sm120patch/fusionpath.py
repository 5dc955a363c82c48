"""Past the gate: whether the installed server really enters fusion on a GPU without multicast
(a PCIe box, no NVSwitch), from the distribution's ``[[fusion_path]]`` data, the installed
release of the distribution it fuses with, the patches applied to each and, where sm120patch
has read them, the machine's GPUs (``driver.py``)."""

from __future__ import annotations

from typing import Mapping, NamedTuple

from sm120patch.distributions import Distribution, FusionPath


class FusionVerdict(NamedTuple):
    server: str  # "sglang 0.5.14"
    with_: str | None  # "flashinfer-python 0.6.12"; None: not installed
    path: FusionPath | None  # None: sm120patch has not mapped this combination
    missing: tuple[str, ...] = ()  # "distribution:id" not applied
    unknown: tuple[str, ...] = ()  # needed, on a distribution this run did not assess

    @property
    def enters(self) -> bool | None:
        """True: the server enters fusion on a GPU without multicast; False: it falls back;
        None: not known (an unmapped combination, or patches not assessed in this run)."""
        if self.path is None:
            return None
        if self.missing:
            return False
        return None if self.unknown else True

    def render(self, *, multicast: bool | None = None) -> str:
        """In words; ``multicast``: what this machine's GPUs report (None: not read)."""
        where = ("this machine's GPUs report no multicast" if multicast is False
                 else "on a GPU without multicast (PCIe, no NVSwitch)")
        if self.with_ is None:
            return f"{self.server}: the fusion workspace path depends on the FlashInfer release, and none is installed"
        if self.path is None:
            return f"{self.server} with {self.with_}: sm120patch has no map of its fusion workspace path"
        if multicast is True:
            return (f"this machine's GPUs report multicast: {self.server} with {self.with_} takes the {self.path.path}")
        if self.missing:
            return (f"{where}: {self.server} with {self.with_} falls back to unfused allreduce (the server starts; "
                    f"only its log says so): {self.path.without}. Apply {', '.join(self.missing)} to make it fuse")
        if self.unknown:
            return (f"{where}: {self.server} with {self.with_} enters fusion once {', '.join(self.unknown)} "
                    f"is applied (not checked in this run: select that distribution too)")
        return f"{where}: {self.server} with {self.with_} enters fusion: {self.path.path}"


def judge(distribution: Distribution, raw_version: str, version, with_installed: tuple[str, object] | None,
          applied: Mapping[str, frozenset[str] | None]) -> FusionVerdict | None:
    """``with_installed``: (raw version, Version) of ``distribution.fusion_with`` as installed, or
    None; ``applied``: patch ids applied per distribution name, for those assessed in this run
    (None inside: no pinned set, so which are applied is not known)."""
    if not distribution.fusion_paths:
        return None
    server = f"{distribution.name} {raw_version}"
    if with_installed is None:
        return FusionVerdict(server, None, None)
    with_text = f"{distribution.fusion_with} {with_installed[0]}"
    row = distribution.fusion_path(version, with_installed[1])
    if row is None:
        return FusionVerdict(server, with_text, None)
    missing, unknown = [], []
    for owner, patch_id in row.needs:
        ids = applied.get(owner)
        name = f"{owner}:{patch_id}"
        if owner not in applied or ids is None:
            unknown.append(name)
        elif patch_id not in ids:
            missing.append(name)
    return FusionVerdict(server, with_text, row, tuple(missing), tuple(unknown))
