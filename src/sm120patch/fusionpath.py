"""Past the gate: whether the installed server really enters fusion on a GPU without multicast
(a PCIe box, no NVSwitch), from the distribution's ``[[fusion_path]]`` data, the installed
release of the distribution it fuses with, the patches applied to each and, where sm120patch
has read them, the machine's GPUs (``driver.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, NamedTuple

from sm120patch.distributions import Distribution, FusionPath

if TYPE_CHECKING:
    from packaging.version import Version

    from sm120patch.environment import InstalledDistribution


class FusionVerdict(NamedTuple):
    server: str  # "sglang 0.5.14"
    with_: str  # "flashinfer-python 0.6.12", or the name alone when it is not installed
    installed: bool  # whether the distribution it fuses with is installed
    path: FusionPath | None  # None: not installed, or sm120patch has not mapped this combination
    missing: tuple[str, ...] = ()  # "distribution:id" not applied
    unknown: tuple[str, ...] = ()  # needed, on a distribution this run did not assess
    target: str = ""  # the option naming the target in commands: "--python /srv/env/bin/python"

    @property
    def apply_command(self) -> str:
        """What applies the missing patches (every required one), as it can be copied."""
        return f"sm120patch apply {self.target}"

    @property
    def doctor_command(self) -> str:
        """What reads this machine's GPUs, for the same target."""
        return f"sm120patch doctor {self.target}"

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
        if not self.installed:
            return f"{self.server}: the fusion workspace path depends on the {self.with_} release, and none is installed"
        if self.path is None:
            return f"{self.server} with {self.with_}: sm120patch has no map of its fusion workspace path"
        if multicast is True:
            return (f"this machine's GPUs report multicast: {self.server} with {self.with_} takes the {self.path.path}")
        if self.missing:
            return (f"{where}: {self.server} with {self.with_} falls back to unfused allreduce (the server starts; "
                    f"only its log says so): {self.path.without}. Apply {', '.join(self.missing)} to make it fuse: "
                    f"`{self.apply_command}`")
        if self.unknown:
            return (f"{where}: {self.server} with {self.with_} enters fusion once {', '.join(self.unknown)} "
                    f"is applied (not checked: this run selected only some distributions; without a selector "
                    f"status checks them all)")
        return f"{where}: {self.server} with {self.with_} enters fusion: {self.path.path}"


def judge(distribution: Distribution, raw_version: str, version: Version | None,
          other: InstalledDistribution | None, applied: Mapping[str, frozenset[str] | None], *,
          target: str) -> FusionVerdict:
    """``other``: ``distribution.fusion_with`` as installed (None: it is not); ``applied``: patch
    ids applied per distribution name, for those assessed in this run (None inside: no pinned
    set, so which are applied is not known); ``target``: the option naming the target in the
    commands the verdict prints."""
    server = f"{distribution.name} {raw_version}"
    if other is None:
        return FusionVerdict(server, distribution.fusion_with, False, None)
    with_text = f"{distribution.fusion_with} {other.raw_version}"
    row = distribution.fusion_path(version, other.version)
    if row is None:
        return FusionVerdict(server, with_text, True, None)
    missing, unknown = [], []
    for owner, patch_id in row.needs:
        ids = applied.get(owner)
        name = f"{owner}:{patch_id}"
        if owner not in applied or ids is None:
            unknown.append(name)
        elif patch_id not in ids:
            missing.append(name)
    return FusionVerdict(server, with_text, True, row, tuple(missing), tuple(unknown), target)
