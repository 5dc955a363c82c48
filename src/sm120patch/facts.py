"""Facts about upstream releases that are not patches (DESIGN.md §2-3), kept in one place."""

from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import Version

# SGLang 0.5.4.post2-0.5.7 auto-enable fusion through is_blackwell_supported() (majors 10 and 12):
# there, a patched SGLang uses fusion on SM120 without --enable-flashinfer-allreduce-fusion.
SGLANG_AUTO_ENABLES_ON_SM120 = SpecifierSet(">=0.5.4.post2,<=0.5.7")


def sglang_auto_enables_fusion(version: Version | None) -> bool:
    return version is not None and version in SGLANG_AUTO_ENABLES_ON_SM120

# FlashInfer 0.4.0 and 0.4.1 were published as sdists only: an install built from them has no
# wheel RECORD sm120patch can check its bytes against, and its files depend on the build.
SDIST_ONLY = {"flashinfer-python": ("0.4.0", "0.4.1")}
