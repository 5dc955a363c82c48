"""What the tests share (imported by test modules; fixtures live in conftest.py): throwaway
environments with the real wheels, the CLI run as a user runs it, and the one snapshot helper
every scenario test compares before and after."""

from __future__ import annotations

import csv
import fcntl
import functools
import hashlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Collection
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
from click.testing import CliRunner

from sm120patch.cli import cli
from sm120patch.distributions import load_registry
from sm120patch.environment import parse_record_hash
from sm120patch.state import InstallState

ROOT = Path(__file__).resolve().parents[1]
# CI machines have root, strace and nvcc: a test that needs one fails there instead of skipping.
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def need(condition: bool, reason: str) -> None:
    """Skip with ``reason`` (``-ra`` lists it in the summary); fail under CI, where the machine
    is supposed to have it."""
    if not condition:
        if IN_CI:
            pytest.fail(f"CI should have this: {reason}")
        pytest.skip(reason)
FLASHINFER_VERSION = "0.6.4"
SGLANG_VERSION = "0.5.9"
COMM = "flashinfer/jit/comm.py"
HEADER = "flashinfer/data/include/flashinfer/comm/trtllm_allreduce.cuh"
LAMPORT = "flashinfer/data/csrc/trtllm_allreduce.cu"
COMMUNICATOR = "sglang/srt/layers/communicator.py"
SERVER_ARGS = "sglang/srt/server_args.py"
SYMM_MEM = "sglang/srt/distributed/device_communicators/all_reduce_utils.py"
MNNVL = "flashinfer/comm/mnnvl.py"
FUSION_HEADER = "flashinfer/data/include/flashinfer/comm/trtllm_allreduce_fusion.cuh"
MOE_HEADER = "flashinfer/data/include/flashinfer/comm/trtllm_moe_allreduce_fusion.cuh"
FLASHINFER_FILES = (COMM, HEADER, LAMPORT, MNNVL, FUSION_HEADER, MOE_HEADER)  # what 0.6.4's patch set writes


def wheel_file(wheel: Path, relpath: str) -> bytes:
    with zipfile.ZipFile(wheel) as archive:
        return archive.read(relpath)


def jit_entry_at(home: Path, version: str, arch: str, module: str) -> Path:
    """Where FlashInfer's JIT keeps a module's build under ``home`` (its default base)."""
    return home / ".cache" / "flashinfer" / version / arch / "cached_ops" / module


def record_hash(data: bytes) -> str:
    """A RECORD row's hash of ``data`` (sha256=, urlsafe base64 without padding)."""
    import base64

    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


# Where make_venv keeps the installs it copies, one per interpreter and wheel set: a directory of
# this run's, shared by its pytest-xdist workers (conftest.py's _venv_templates says which).
TEMPLATES: Path | None = None


def make_venv(path: Path, wheels: list[Path], *, python: str = sys.executable, linked: bool = True) -> Path:
    """A virtual environment at ``path`` with ``wheels`` installed by pip, without dependencies.

    pip runs once per run for each interpreter and wheel set, and each call gets a copy of that
    install (:func:`_linked_copy`): pip takes about 10 s of CPU for a ~400 MB vLLM wheel, and the
    suite, CPU-bound on 2 cores, installed the same releases in file after file. ``linked=False``
    gives every file a copy of its own, for a test that changes the owner of the whole tree."""
    template = _installed(python, wheels)
    if linked and template not in LINKS:
        LINKS[template] = _links(template)
    _HANDED_OUT.add(template)
    _linked_copy(template, path, LINKS[template] if linked else ())
    return path / "bin" / "python"


def _installed(python: str, wheels: list[Path]) -> Path:
    """The run's one install of ``wheels`` with ``python``, made by whichever worker asks first
    (under a lock, in a directory renamed into place when whole): the key is the interpreter,
    pip's version and each wheel's name and size, in order."""
    base = TEMPLATES
    assert base is not None, "make_venv runs in a test (conftest.py's _venv_templates says where installs go)"
    key = repr((_interpreter(python), metadata.version("pip"), [(w.name, w.stat().st_size) for w in wheels]))
    name = hashlib.sha256(key.encode()).hexdigest()[:16]
    template = base / name
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not template.exists():
            # venv makes the directory itself (mkdtemp's is 0700, which the copies would keep).
            partial = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=base)) / "venv"
            subprocess.run([python, "-m", "venv", "--without-pip", str(partial)], check=True)
            subprocess.run([sys.executable, "-m", "pip", "--python", str(partial / "bin" / "python"), "install",
                            "--quiet", "--no-deps", "--no-compile", "--disable-pip-version-check",
                            *map(str, wheels)], check=True)
            partial.rename(template)
            partial.parent.rmdir()
    return template


@functools.cache
def _interpreter(python: str) -> tuple[str, str]:
    version = subprocess.run([python, "-c", "import sys; print(sys.version)"], capture_output=True, text=True,
                             check=True).stdout
    return os.path.realpath(python), version.strip()


# The files of an install that its copies link to, with each one's size, mtime, mode and owner as
# linked: a copy's own bytes are the files any patch set names and each distribution's metadata
# (what sm120patch and the tests write, chmod or replace in place), and everything outside
# site-packages; every other file (thousands: most of each package) is a hard link, which makes a
# copy about four times faster than copying. sm120patch replaces a file by a rename, never in
# place, and pip unlinks a file before it writes one there, so neither writes through a link; a
# test that does fails at its teardown (conftest.py's _links_unwritten).
LINKS: dict[Path, dict[str, tuple]] = {}
_HANDED_OUT: set[Path] = set()  # the installs copied since the last written_links()


def _links(template: Path) -> dict[str, tuple]:
    """The files of ``template`` its copies link to, each also entered in SHARED_HASHES (one
    lstat of each file for both)."""
    site = next((template / "lib").glob("python3*/site-packages"))
    patched = {relpath for patch_set in load_registry().patch_sets for relpath in patch_set.files}
    links = {}
    for path in site.rglob("*"):
        relative, info = path.relative_to(site), path.lstat()
        if (stat.S_ISREG(info.st_mode) and not relative.parts[0].endswith(".dist-info")
                and relative.as_posix() not in patched):
            links[str(path)] = _fields(info)
            SHARED_HASHES[info.st_dev, info.st_ino] = None
    return links


def _fields(info: os.stat_result) -> tuple:
    """What a write in place through a link changes: size, mtime, mode, owner."""
    return info.st_size, info.st_mtime_ns, info.st_mode, info.st_uid, info.st_gid


def _inode(path: str) -> tuple:
    return _fields(os.lstat(path))


def written_links() -> list[str]:
    """The linked files of each install copied since the last call whose size, mtime, mode or
    owner changed since they were first linked: written in place through some test's copy."""
    checked = [LINKS.get(template, {}) for template in _HANDED_OUT]
    _HANDED_OUT.clear()
    return sorted(path for links in checked for path, was in links.items() if _inode(path) != was)


def _linked_copy(template: Path, path: Path, links: Collection[str]) -> None:
    """``path`` made a copy of the environment ``template``, each file in ``links`` a hard link to
    the template's. The venv's own paths (pyvenv.cfg, scripts) still name the template; sm120patch
    asks the interpreter, which reports the copy's prefix, so the copy is a separate environment."""

    def link_or_copy(source: str, target: str) -> None:
        if source in links:
            os.link(source, target)
        else:
            shutil.copy2(source, target)

    shutil.copytree(template, path, symlinks=True, copy_function=link_or_copy)


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

    def dist_info(self, prefix: str) -> Path:
        return next(self.site_packages.glob(f"{prefix}-*.dist-info"))

    def state(self, prefix: str = "flashinfer_python") -> InstallState:
        return InstallState(self.site_packages / ".sm120patch" / self.dist_info(prefix).name)

    @property
    def state_root(self) -> Path:
        return self.site_packages / ".sm120patch"

    def record_mismatches(self) -> list[str]:
        """Every file whose bytes differ from its distribution's RECORD hash."""
        bad = []
        for record in self.site_packages.glob("*.dist-info/RECORD"):
            for row in csv.reader(record.read_text().splitlines()):
                if not row or not row[1]:
                    continue
                path = self.site_packages / row[0]
                digest = file_sha256(path, path.stat()) if path.exists() else hashlib.sha256(b"").hexdigest()
                if digest != parse_record_hash(row[1]):
                    bad.append(row[0])
        return bad

    def jit_entry(self, arch: str, module: str, version: str = FLASHINFER_VERSION) -> Path:
        return jit_entry_at(self.home, version, arch, module)

    def seed_jit(self, archs=("90a", "90a_120a"), modules=("trtllm_comm", "norm"),
                 version: str = FLASHINFER_VERSION) -> None:
        """JIT entries as a server leaves them (stand-in files, newer than the sources), with
        the lock file FlashInfer creates beside them (cached_ops/tmp/<module>.lock)."""
        for arch in archs:
            for module in modules:
                entry = self.jit_entry(arch, module, version)
                entry.mkdir(parents=True, exist_ok=True)
                (entry / f"{module}.so").write_bytes(b"\x7fELF")
                (entry.parent / "tmp").mkdir(exist_ok=True)
                (entry.parent / "tmp" / f"{module}.lock").touch()


def snapshot(env: ServingEnv, *extra: Path) -> dict[str, tuple]:
    """Every path of the environment (its packages, sm120patch's state, everything else under
    its prefix), its JIT cache base and ``extra``: file hashes, link targets, owners and modes.
    Two snapshots are equal only when nothing anywhere changed."""
    return tree_snapshot(env.root, env.home, *extra)


# The sha256 of each file that test environments share with an install by a hard link
# (make_venv's copies), by (device, inode), hashed once per run: conftest.py fails a test that
# writes one of them in place, so the bytes cannot change under this cache.
SHARED_HASHES: dict[tuple[int, int], str | None] = {}


def file_sha256(path: Path, info: os.stat_result) -> str:
    """The sha256 of the file ``info`` describes (once per run for one in SHARED_HASHES)."""
    key = (info.st_dev, info.st_ino)
    digest = SHARED_HASHES.get(key) or hashlib.sha256(path.read_bytes()).hexdigest()
    if key in SHARED_HASHES:
        SHARED_HASHES[key] = digest
    return digest


def tree_snapshot(*bases: Path) -> dict[str, tuple]:
    """:func:`snapshot` of any directories."""
    found = {}
    for base in bases:
        if not base.exists():
            continue
        for path in sorted([base, *base.rglob("*")]):
            if "__pycache__" in path.parts:
                continue
            info = path.lstat()
            if path.is_symlink():
                what = ("link", os.readlink(path))
            elif path.is_file():
                what = ("file", file_sha256(path, info))
            else:
                what = ("dir",)
            found[str(path)] = (*what, info.st_mode, info.st_uid, info.st_gid)
    return found


def fingerprint(env: ServingEnv) -> dict[str, tuple]:
    """What any write changes (inode, mode, size, modification time) for every path of ``env``
    and its JIT cache base, without reading the files: cheap enough to take around every test."""
    return tree_fingerprint(env.root, env.home)


def tree_fingerprint(*bases: Path) -> dict[str, tuple]:
    """:func:`fingerprint` of any directories (the wheel cache: gigabytes, never read)."""
    found = {}
    for base in bases:
        for path in [base, *base.rglob("*")]:
            if "__pycache__" not in path.parts:
                info = path.lstat()
                found[str(path)] = (info.st_ino, info.st_mode, info.st_size, info.st_mtime_ns)
    return found


def changed(before: dict, after: dict) -> list[str]:
    """The paths that differ between two snapshots (for assertion messages)."""
    return sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))


@dataclass
class Session:
    """Runs sm120patch as the user would, against one serving environment."""

    env: ServingEnv

    def __call__(self, *args: str, target: bool = True):
        extra = ["--python", str(self.env.python)] if target else []
        if target and args and args[0] not in NO_JIT_CACHE:
            extra += ["--jit-cache-base", str(self.env.home)]
        argv = [*args[:1], *extra, *args[1:]] if args and target else list(args)
        return run_cli(*argv)


NO_JIT_CACHE = ("diff",)  # commands that never look at FlashInfer's JIT cache


def run_cli(*args: str, short: bool = False):
    """sm120patch in this process. `status` is read as --verbose prints it (the whole table the
    tests were written against), unless ``short``: the default view is tests/test_newcomer.py's."""
    if args and args[0] == "status" and not short and not {"--brief", "--json", "--verbose", "-v"} & set(args):
        args = (*args, "--verbose")
    return CliRunner().invoke(cli, list(args), catch_exceptions=False, prog_name="sm120patch")


def one_clear_error(output: str, text: str) -> None:
    lines = [line for line in output.splitlines() if line.startswith("sm120patch: error:")]
    assert len(lines) == 1 and text in lines[0], output
    assert "Traceback" not in output


def sm120patch_argv(env: ServingEnv, *args: str, python: str = sys.executable) -> list[str]:
    """The command line of a separate sm120patch process against ``env``."""
    return [python, "-m", "sm120patch", args[0], "--python", str(env.python), "--jit-cache-base", str(env.home),
            *args[1:]]


def readable_copy(shared: Path) -> Path:
    """A world-readable copy of sm120patch (src/, its data) and of the libraries it imports
    (deps/), made once under ``shared``: what another user's interpreter can import."""
    import click
    import libcst
    import packaging

    copy = shared / "sm120patch-copy"
    if not copy.exists():
        shutil.copytree(ROOT / "src", copy / "src")
        for data in ("patches", "vendor-manifests"):
            shutil.copytree(ROOT / data, copy / data)
        for module in (libcst, click, packaging):
            shutil.copytree(Path(module.__file__).parent, copy / "deps" / module.__name__)
        subprocess.run(["chmod", "-R", "a+rX", str(copy)], check=True)
    return copy


def run_as_nobody(argv: list[str], shared: Path, **env: str) -> subprocess.CompletedProcess:
    """``argv`` (a ``python -m sm120patch ...`` line) run as the user nobody, from a
    world-readable copy of sm120patch, its data and the libraries it imports, made once under
    ``shared`` (nobody may not be able to read this checkout: a 0700 temporary clone)."""
    copy = readable_copy(shared)
    return subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", *argv],
                          capture_output=True, text=True, cwd="/",
                          env=dict(os.environ, PYTHONPATH=f"{copy / 'src'}{os.pathsep}{copy / 'deps'}", **env))


def readelf_dynamic(library: Path) -> tuple[list[str], list[str]]:
    """(NEEDED entries, SONAME) of a shared library, as readelf -d prints them."""
    import re

    text = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", text), re.findall(r"\(SONAME\)\s+Library soname: \[(.+?)\]", text)


def undefined(library: Path) -> set[str]:
    text = subprocess.run(["nm", "-D", "--undefined-only", "--format=just-symbols", str(library)],
                          capture_output=True, text=True, check=True).stdout
    return set(text.split())


# What a test script in the serving interpreter runs first to hold vLLM's fusion file (``path``) as
# patched: its two fusion tables, the one-shot selector, and every name sm120patch inserted (the
# narrowing runs as the module runs it at import), with what they log collected in ``logged``. The
# script imports ast, json, logging, sys and types and sets ``path`` before it.
VLLM_TUNED_MODULE = r"""logged = []
class Handler(logging.Handler):
    def emit(self, record):
        logged.append(record.getMessage())
logging.getLogger().addHandler(Handler())
logging.getLogger().setLevel(logging.INFO)
KEEP = ("FI_ALLREDUCE_FUSION_MAX_SIZE_MB", "_FI_ALLREDUCE_ONE_SHOT_MAX_SIZES_MB", "MiB",
        "_select_flashinfer_allreduce_use_oneshot")
def wanted(node):
    if isinstance(node, ast.FunctionDef):
        return node.name in KEEP or node.name.startswith("_sm120patch")
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):  # the narrowing, as the module runs it
        return isinstance(node.value.func, ast.Name) and node.value.func.id.startswith("_sm120patch")
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return any(isinstance(t, ast.Name) and (t.id in KEEP or t.id.lower().startswith("_sm120patch")) for t in targets)
module = types.ModuleType("vllm_fusion")
tree = ast.parse(open(path).read())
exec(compile(ast.Module([n for n in tree.body if wanted(n)], []), path, "exec"), module.__dict__)
MiB = 1024 * 1024
"""


def write_tuned_profile(path: Path, entries: dict, *, hidden: int, software: dict | None = None,
                        created: str = "2026-12-06T03:00:00Z") -> str:
    """A tuned-limits profile of this machine (its box as the servers read it), mode 0644: one entry
    per TP size in ``entries``, TP -> (fused bytes, one-shot bytes) at ``hidden``, bf16, tuned with
    the releases ``software``. Returns the path as a server is handed it."""
    import json

    from sm120patch import _tuned_runtime as rt

    path.write_text(json.dumps({"kind": "sm120patch tuned limits", "format": 1, "box": rt._sm120patch_box(), "entries": {
        str(tp): {"created": created, "software": software or {}, "nccl_env": {}, "dtype": "bf16", "hidden": hidden,
                  "fused_max_bytes": fused, "oneshot_max_bytes": one} for tp, (fused, one) in entries.items()}}))
    path.chmod(0o644)
    return str(path)
