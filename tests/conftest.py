"""Fixtures: the real upstream wheels (downloaded once, cached across runs) installed without
dependencies into throwaway virtual environments. Tests never touch the real $HOME: each test
gets a HOME of its own (the wheel cache is pinned before that, so it stays shared)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import helpers
from helpers import (
    FLASHINFER_VERSION, SGLANG_VERSION, ServingEnv, Session, fingerprint, make_venv, need,
    written_links,
)
from sm120patch.wheels import default_cache, fetch_wheel

# Resolved once, from the real environment, before any test moves HOME.
os.environ.setdefault("SM120PATCH_WHEEL_CACHE", str(default_cache()))
REAL_HOME = Path.home()
# What a test run may add to the real $HOME: the caches of the real wheels and of pip.
HOME_ALLOWED = {".cache", ".cache/sm120patch", ".cache/pip"}


@pytest.fixture(scope="session", autouse=True)
def _venv_templates(tmp_path_factory):
    """Where make_venv keeps the run's installs: in the run's own temporary directory, which each
    pytest-xdist worker's lies in (pytest's recipe for what workers share), so that pytest removes
    them with it when the run passes and keeps them with the rest when it fails (pyproject.toml's
    tmp_path_retention_policy)."""
    base = tmp_path_factory.getbasetemp()
    helpers.TEMPLATES = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "venv-templates"
    helpers.TEMPLATES.mkdir(exist_ok=True)


def _home_entries() -> set[str]:
    found = {p.name for p in REAL_HOME.iterdir()} if REAL_HOME.is_dir() else set()
    cache = REAL_HOME / ".cache"
    return found | ({f".cache/{p.name}" for p in cache.iterdir()} if cache.is_dir() else set())


@pytest.fixture(scope="session", autouse=True)
def _real_home_untouched():
    """Tests never write to the real $HOME (each test gets its own): checked at the end."""
    before = _home_entries()
    yield
    added = _home_entries() - before - HOME_ALLOWED
    assert not added, f"the test run wrote to the real $HOME: {sorted(added)}"


@pytest.fixture(scope="session")
def wheel_cache() -> Path:
    return default_cache()


@pytest.fixture(scope="session")
def flashinfer_wheel(wheel_cache) -> Path:
    return fetch_wheel("flashinfer-python", FLASHINFER_VERSION, wheel_cache)


@pytest.fixture(scope="session")
def sglang_wheel(wheel_cache) -> Path:
    return fetch_wheel("sglang", SGLANG_VERSION, wheel_cache)


@pytest.fixture(scope="session")
def pristine_template(tmp_path_factory, flashinfer_wheel, sglang_wheel) -> Path:
    """One copy per worker of the run's FlashInfer 0.6.4 and SGLang 0.5.9 install, for
    read_only_env (which checks it around every test)."""
    root = tmp_path_factory.mktemp("template") / "venv"
    make_venv(root, [flashinfer_wheel, sglang_wheel])
    return root


@pytest.fixture
def serving_env(flashinfer_wheel, sglang_wheel, tmp_path) -> ServingEnv:
    root = tmp_path / "venv"
    make_venv(root, [flashinfer_wheel, sglang_wheel])
    home = tmp_path / "home"
    home.mkdir()
    return ServingEnv(root, home)


@pytest.fixture(autouse=True)
def _links_unwritten():
    """A test fails if a file its environments share with make_venv's install by a hard link
    was written in place (that changes it for every later test): checked after its teardown."""
    yield
    written = written_links()
    assert not written, (f"a file linked from a shared install changed in place (size, mtime, mode or owner; it "
                         f"changed for every later test): {written[:5]}; add it to the files helpers.py copies, "
                         f"or make that environment with make_venv(..., linked=False)")


@pytest.fixture
def sm120patch(serving_env) -> Session:
    return Session(serving_env)


@pytest.fixture(scope="session")
def _read_only_env(pristine_template, tmp_path_factory) -> ServingEnv:
    return ServingEnv(pristine_template, tmp_path_factory.mktemp("read-only-home"))


@pytest.fixture
def read_only_env(_read_only_env) -> ServingEnv:
    """The real-wheel environment made once per run, for tests that only read it (no copy): a
    test that changes anything in it or in its JIT cache base fails."""
    before = fingerprint(_read_only_env)
    yield _read_only_env
    assert fingerprint(_read_only_env) == before, "a test that only reads the shared environment changed it"


@pytest.fixture
def read_only_cli(read_only_env) -> Session:
    return Session(read_only_env)


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path_factory):
    monkeypatch.delenv("SM120PATCH_STATE_DIR", raising=False)
    monkeypatch.delenv("FLASHINFER_WORKSPACE_BASE", raising=False)
    home = tmp_path_factory.mktemp("home-of-the-tester")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    # sm120patch wraps its text to $COLUMNS, which pytest-xdist's workers set (to 80): a test that
    # wants a width sets it (test_terminal.py), every other one reads the unwrapped lines.
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("NO_COLOR", raising=False)


# Enough of FlashInfer 0.6.4's dependencies for `flashinfer.jit.comm` (DESIGN.md §5); torch
# 2.13.0 is the CPU build this machine kind keeps on disk.
RUNTIME_REQUIREMENTS = ["torch==2.13.0", "apache-tvm-ffi!=0.1.8,!=0.1.8.post0,<0.2,>=0.1.6", "ninja", "packaging",
                        "numpy", "tqdm", "requests", "einops", "tabulate", "click", "nvidia-ml-py", "filelock"]


@pytest.fixture(scope="session")
def runtime_env(tmp_path_factory, flashinfer_wheel, sglang_wheel) -> ServingEnv:
    """A serving environment that can import flashinfer.jit.comm (torch CPU and the few
    dependencies it needs, then the real wheels without dependencies): one per test session,
    removed at its end (it is over a gigabyte). Tests that patch it revert before they end."""
    root = tmp_path_factory.mktemp("runtime") / "venv"
    # Files of its own, none linked: pip installs into it below and tests patch it for the whole
    # session, while the check of links runs after the one test that made it.
    python = make_venv(root, [flashinfer_wheel, sglang_wheel], linked=False)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
                    "--disable-pip-version-check", *RUNTIME_REQUIREMENTS], check=True)
    home = root.parent / "home"
    home.mkdir()
    yield ServingEnv(root, home)
    shutil.rmtree(root.parent, ignore_errors=True)


# Tests that need the real upstream wheels (or torch, or a download), and the fault-injection
# sweeps (minutes of strace): `make check` leaves them out and runs the rest in well under a
# minute; `make test` runs everything.
WHEEL_FIXTURES = {"flashinfer_wheel", "sglang_wheel", "wheel_cache", "pristine_template", "serving_env", "sm120patch",
                  "read_only_env", "read_only_cli", "runtime_env", "sandboxes"}
NEEDS_WHEELS = ("test_matrix.py", "test_manifests.py", "test_fault_injection.py")


# The files whose tests use the runtime environment (over a gigabyte, torch in it): under
# pytest-xdist (`make test` runs -n auto) they all go to one worker, in the order one process
# runs them, so the environment is made once. The fault-injection sweeps are spread one test
# at a time; every other file stays on one worker (its module fixtures are made once).
RUNTIME_FILES = ("test_bench.py", "test_build.py", "test_fusion_paths.py", "test_tuned_limits.py", "test_verify.py")
SPREAD_FILES = ("test_fault_injection.py",)
# The longest work first, so that what is handed out last is short and neither worker is left
# with minutes of it at the end while the other idles: every SGLang and vLLM range's decisions in
# one environment of several gigabytes (test_verify_tuned.py), the container test's image build
# (minutes of nvcc), the matrix's installs, the runtime environment's files, then each file of
# more than about half a minute (seconds of test time in docs/benchmarks.md, longest first); every
# other file after them, in collection order.
FIRST = ("test_verify_tuned.py", "test_containers.py", "test_matrix.py", *RUNTIME_FILES, "test_vllm.py", "test_releases.py",
         "test_logcheck.py", "test_ansible.py", "test_source.py", "test_situations.py", "test_hardening.py", *SPREAD_FILES,
         "test_reliability_four.py", "test_hints.py", "test_manifests.py")


def pytest_collection_modifyitems(config, items):
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if WHEEL_FIXTURES & fixtures or item.path.name in NEEDS_WHEELS:
            item.add_marker(pytest.mark.wheels)
        if "runtime_env" in fixtures and item.path.name not in RUNTIME_FILES:
            raise pytest.UsageError(f"{item.nodeid} uses runtime_env: add {item.path.name} to RUNTIME_FILES")
    # A stable sort: each file's tests keep their order.
    items.sort(key=lambda item: FIRST.index(item.path.name) if item.path.name in FIRST else len(FIRST))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            # Work is handed out in the order above (the longest first), not pytest-xdist's default
            # of the scopes with the most tests first, which left the single-test sweeps for last
            # (the switch is pytest-xdist 3.8's: pyproject.toml requires it).
            config.option.loadscopereorder = False

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            name = path.rsplit("/", 1)[-1]
            return "runtime" if name in RUNTIME_FILES else nodeid if name in SPREAD_FILES else path

    return Scheduling(config, log)


@pytest.fixture
def shared_dir():
    """A directory every user can reach (pytest's own are 0700), for tests that run sm120patch
    as another user: needs root, setpriv and /usr/bin/python3. Removed afterwards."""
    need(os.geteuid() == 0, "running sm120patch as another user needs root")
    need(shutil.which("setpriv") is not None and shutil.which("python3", path="/usr/bin") is not None,
         "needs setpriv and /usr/bin/python3 to run as another user")
    shared = Path(os.environ.get("TMPDIR", "/tmp")) / f"sm120patch-shared-{os.getpid()}"
    shutil.rmtree(shared, ignore_errors=True)
    shared.mkdir(mode=0o755)
    yield shared
    shutil.rmtree(shared, ignore_errors=True)


@pytest.fixture
def shell(tmp_path):
    """Runs a command line as printed, in bash, with an `sm120patch` on PATH that is this
    checkout (as after the README's install), in this test's environment (its HOME, its
    SM120PATCH_DATA_DIR)."""
    bindir = tmp_path / "shell-bin"
    bindir.mkdir()
    shim = bindir / "sm120patch"
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m sm120patch \"$@\"\n")
    shim.chmod(0o755)

    def run(line: str, cwd: Path = tmp_path, timeout: float = 120) -> subprocess.CompletedProcess:
        env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}")
        return subprocess.run(["bash", "-c", line], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)

    return run
