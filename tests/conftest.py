"""Shared fixtures: the real upstream wheels (downloaded once, cached across runs) installed
without dependencies into throwaway virtual environments; and the CLI, run in-process."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

from sm120patch.cli import cli
from sm120patch.environment import parse_record_hash
from sm120patch.wheels import default_cache, fetch_wheel

FLASHINFER_VERSION = "0.6.4"
SGLANG_VERSION = "0.5.9"


@pytest.fixture(scope="session")
def wheel_cache() -> Path:
    return default_cache()


@pytest.fixture(scope="session")
def flashinfer_wheel(wheel_cache) -> Path:
    return fetch_wheel("flashinfer-python", FLASHINFER_VERSION, wheel_cache)


@pytest.fixture(scope="session")
def sglang_wheel(wheel_cache) -> Path:
    return fetch_wheel("sglang", SGLANG_VERSION, wheel_cache)


def wheel_file(wheel: Path, relpath: str) -> bytes:
    with zipfile.ZipFile(wheel) as archive:
        return archive.read(relpath)


def make_venv(path: Path, wheels: list[Path]) -> Path:
    """A virtual environment at ``path`` with ``wheels`` installed by pip, without dependencies."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
         "--no-compile", "--disable-pip-version-check", *map(str, wheels)],
        check=True,
    )
    return python


@pytest.fixture(scope="session")
def pristine_template(tmp_path_factory, flashinfer_wheel, sglang_wheel) -> Path:
    root = tmp_path_factory.mktemp("template") / "venv"
    make_venv(root, [flashinfer_wheel, sglang_wheel])
    return root


@dataclass
class ServingEnv:
    """A user's serving environment (real wheels, pip-installed) and their JIT cache base."""

    root: Path
    home: Path

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def site_packages(self) -> Path:
        return next((self.root / "lib").glob("python3*/site-packages"))

    def file(self, relpath: str) -> Path:
        return self.site_packages / relpath

    def record_mismatches(self) -> list[str]:
        """Every file whose bytes differ from its distribution's RECORD hash."""
        import csv

        bad = []
        for record in self.site_packages.glob("*.dist-info/RECORD"):
            for row in csv.reader(record.read_text().splitlines()):
                if not row or not row[1]:
                    continue
                data = (self.site_packages / row[0]).read_bytes()
                import hashlib

                if hashlib.sha256(data).hexdigest() != parse_record_hash(row[1]):
                    bad.append(row[0])
        return bad

    def jit_entry(self, arch: str, module: str, version: str = FLASHINFER_VERSION) -> Path:
        return self.home / ".cache" / "flashinfer" / version / arch / "cached_ops" / module


@pytest.fixture
def serving_env(pristine_template, tmp_path) -> ServingEnv:
    root = tmp_path / "venv"
    shutil.copytree(pristine_template, root, symlinks=True)
    # The venv's own paths (pyvenv.cfg, scripts) still name the template; sm120patch asks the
    # interpreter, which reports the copy's prefix, so this is a faithful separate environment.
    home = tmp_path / "home"
    home.mkdir()
    return ServingEnv(root, home)


@dataclass
class Session:
    """Runs sm120patch as the user would, against one serving environment."""

    env: ServingEnv

    def __call__(self, *args: str, target: bool = True):
        extra = ["--python", str(self.env.python), "--jit-cache-base", str(self.env.home)] if target else []
        argv = [*args[:1], *extra, *args[1:]] if args and target else list(args)
        return CliRunner().invoke(cli, argv, catch_exceptions=False)


@pytest.fixture
def sm120patch(serving_env) -> Session:
    return Session(serving_env)


@pytest.fixture(autouse=True)
def _isolated_state(monkeypatch):
    monkeypatch.delenv("SM120PATCH_STATE_DIR", raising=False)
    monkeypatch.delenv("FLASHINFER_WORKSPACE_BASE", raising=False)


# Enough of FlashInfer 0.6.4's dependencies for `flashinfer.jit.comm` (DESIGN.md §5); torch
# 2.13.0 is the CPU build this machine kind keeps on disk.
RUNTIME_REQUIREMENTS = ["torch==2.13.0", "apache-tvm-ffi!=0.1.8,!=0.1.8.post0,<0.2,>=0.1.6", "ninja", "packaging",
                        "numpy", "tqdm", "requests", "einops", "tabulate", "click", "nvidia-ml-py", "filelock"]


@pytest.fixture(scope="session")
def runtime_env(tmp_path_factory, flashinfer_wheel, sglang_wheel) -> ServingEnv:
    """A serving environment that can import flashinfer.jit.comm (torch CPU and the few
    dependencies it needs, then the real wheels without dependencies). Tests that patch it
    revert before they end."""
    root = tmp_path_factory.mktemp("runtime") / "venv"
    python = make_venv(root, [flashinfer_wheel, sglang_wheel])
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
         "--disable-pip-version-check", *RUNTIME_REQUIREMENTS],
        check=True,
    )
    home = root.parent / "home"
    home.mkdir()
    return ServingEnv(root, home)
