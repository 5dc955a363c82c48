"""The fusion chain's workspace step (chain.py): how the installed server creates FlashInfer's
fusion workspace, and which patches it needs on a GPU without multicast (a PCIe box, no
NVSwitch), from the distribution's ``[[fusion_path]]`` data, the installed release of the
distribution it fuses with and the patches applied to each."""

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

    def render(self) -> str:
        """What the workspace step says when there is no row to judge (chain.py words the rest)."""
        if not self.installed:
            return f"{self.server}: the fusion workspace path depends on the {self.with_} release, and none is installed"
        if self.path is None:
            return f"{self.server} with {self.with_}: sm120patch has no map of its fusion workspace path"
        return f"{self.server} with {self.with_}: {self.path.path}"


def judge(distribution: Distribution, raw_version: str, version: Version | None,
          other: InstalledDistribution | None, applied: Mapping[str, frozenset[str] | None]) -> FusionVerdict:
    """``other``: ``distribution.fusion_with`` as installed (None: it is not); ``applied``: patch
    ids applied per distribution name, for those assessed in this run (None inside: no pinned
    set, so which are applied is not known)."""
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
    return FusionVerdict(server, with_text, True, row, tuple(missing), tuple(unknown))
