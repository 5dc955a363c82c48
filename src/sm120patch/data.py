"""Where the shipped data lives: ``patches/`` and ``vendor-manifests/``.

In a wheel they are package data (``sm120patch/_data/...``, see pyproject.toml); in a source
checkout (editable install, tests) they are the top-level folders of the repository.
"""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGE_DATA = Path(__file__).parent / "_data"
_CHECKOUT = Path(__file__).resolve().parents[2]


def data_dir(name: str) -> Path:
    """``patches`` or ``vendor-manifests``; ``SM120PATCH_DATA_DIR`` overrides both (tests)."""
    override = os.environ.get("SM120PATCH_DATA_DIR")
    if override:
        return Path(override) / name
    packaged = _PACKAGE_DATA / name
    return packaged if packaged.is_dir() else _CHECKOUT / name


def data_is_packaged() -> bool:
    """Whether the data in use is an installed wheel's package data (maintainer commands that
    write data refuse to change an installed sm120patch)."""
    return not os.environ.get("SM120PATCH_DATA_DIR") and (_PACKAGE_DATA / "patches").is_dir()


try:  # tomllib is standard from Python 3.11
    import tomllib as toml
except ImportError:  # pragma: no cover
    import tomli as toml  # type: ignore[no-redef]

__all__ = ["data_dir", "toml"]
