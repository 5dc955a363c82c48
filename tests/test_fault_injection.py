"""Kill sm120patch (SIGKILL) at every write-related system call of apply and of revert, and
fail every write and rename (ENOSPC, EIO), one run per point, from outside the process with
strace. After each run, every touched file is exactly pristine or exactly patched, no
original is lost, no trtllm_comm JIT entry outlives the sources it was built from, and the
next command brings the environment to a consistent state."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from conftest import ServingEnv, wheel_file
from sm120patch.manifests import load_manifest
from sm120patch.state import DistributionState

STRACE = shutil.which("strace")
pytestmark = pytest.mark.skipif(STRACE is None, reason="strace is not installed (.ci/run installs it)")

# Every system call that creates, writes, renames, removes or re-modes a file or directory.
WRITE_SYSCALLS = (
    "write,pwrite64,openat,rename,renameat,renameat2,unlink,unlinkat,rmdir,mkdir,mkdirat,"
    "fsync,fdatasync,ftruncate,fchmod,fchmodat,chmod,fchown,fchownat"
)
TRACE_LINE = re.compile(r"^(?P<syscall>\w+)\((?P<args>.*)$")
FILES = (
    "flashinfer/jit/comm.py",
    "flashinfer/data/include/flashinfer/comm/trtllm_allreduce.cuh",
    "flashinfer/data/csrc/trtllm_allreduce.cu",
)
WORKERS = max(1, min(4, os.cpu_count() or 1))
SELECT = {"apply": ["--flashinfer", "0.6.4"], "revert": ["--flashinfer"]}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Sandbox:
    """One environment and the bytes it is reset to between runs."""

    env: ServingEnv
    pristine: dict[str, bytes]

    @property
    def state(self) -> DistributionState:
        return DistributionState(self.env.root / "share" / "sm120patch" / "flashinfer-python")

    def argv(self, command: str) -> list[str]:
        return [sys.executable, "-m", "sm120patch", command, "--python", str(self.env.python),
                "--jit-cache-base", str(self.env.home), *SELECT[command]]

    def reset(self, *, patched: bool) -> None:
        shutil.rmtree(self.env.root / "share", ignore_errors=True)
        shutil.rmtree(self.env.home / ".cache", ignore_errors=True)
        for relpath, data in self.pristine.items():
            self.env.file(relpath).write_bytes(data)
        if patched:
            self.run("apply")
        for arch in ("90a", "90a_120a"):  # entries as a server built them, after the last change
            for module in ("trtllm_comm", "norm"):
                entry = self.env.jit_entry(arch, module)
                entry.mkdir(parents=True)
                (entry / f"{module}.so").write_bytes(b"\x7fELF")

    def points(self, command: str) -> list[tuple[str, int]]:
        """(syscall, n): the n-th call of that syscall touched the environment or its cache."""
        trace = self.env.root.parent / f"trace-{command}.txt"
        subprocess.run([STRACE, "-qq", "-y", "-o", str(trace), "-e", f"trace={WRITE_SYSCALLS}", *self.argv(command)],
                       check=True, capture_output=True, env=quiet_env())
        counts: dict[str, int] = {}
        points = []
        roots = (str(self.env.root), str(self.env.home))
        for line in trace.read_text().splitlines():
            match = TRACE_LINE.match(line)
            if not match:
                continue
            syscall = match["syscall"]
            counts[syscall] = counts.get(syscall, 0) + 1
            args = match["args"]
            if not any(root in args for root in roots):
                continue
            if syscall == "openat" and not re.search(r"O_WRONLY|O_RDWR|O_CREAT", args):
                continue
            points.append((syscall, counts[syscall]))
        return points

    def run(self, command: str) -> subprocess.CompletedProcess:
        """The command as a user runs it (a process of its own: the workers run in threads)."""
        proc = subprocess.run(self.argv(command), capture_output=True, text=True, env=quiet_env())
        assert proc.returncode == 0, f"{command} failed: {proc.stderr}"
        return proc

    def run_injected(self, command: str, syscall: str, n: int, action: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [STRACE, "-qq", "-o", "/dev/null", "-e", f"trace={syscall}", "-e", f"inject={syscall}:{action}:when={n}",
             *self.argv(command)],
            capture_output=True, text=True, env=quiet_env(),
        )

    def file_states(self) -> dict[str, str]:
        manifest = load_manifest("flashinfer-python", "0.6.4")
        states = {}
        for relpath in FILES:
            digest = sha(self.env.file(relpath).read_bytes())
            expected = manifest.files[relpath]
            states[relpath] = ("pristine" if digest == expected.pristine
                               else "patched" if digest in expected.patched.values() else "MIXED")
        return states

    def check_consistent(self, where: str) -> dict[str, str]:
        states = self.file_states()
        assert "MIXED" not in states.values(), f"{where}: a file is neither pristine nor patched: {states}"
        for relpath, state in states.items():
            if state == "patched":
                original = self.state.original(relpath)
                assert original.exists() and original.read_bytes() == self.pristine[relpath], \
                    f"{where}: {relpath} is patched but its original is lost"
        if "patched" in states.values():
            newest = max(self.env.file(r).stat().st_mtime for r in FILES)
            for arch in ("90a", "90a_120a"):
                entry = self.env.jit_entry(arch, "trtllm_comm")
                if entry.exists():
                    assert all(p.stat().st_mtime >= newest for p in entry.rglob("*") if p.is_file()) or \
                        self.state.journal_path.exists(), f"{where}: {entry} was built from other sources"
        return states


def quiet_env() -> dict[str, str]:
    # No .pyc writes: the traced runs must make the same calls every time.
    return dict(os.environ, PYTHONDONTWRITEBYTECODE="1")


@pytest.fixture
def sandboxes(pristine_template, tmp_path, flashinfer_wheel):
    pristine = {relpath: wheel_file(flashinfer_wheel, relpath) for relpath in FILES}
    boxes = []
    for i in range(WORKERS):
        root = tmp_path / f"box{i}" / "venv"
        shutil.copytree(pristine_template, root, symlinks=True)
        (root.parent / "home").mkdir()
        boxes.append(Sandbox(ServingEnv(root, root.parent / "home"), pristine))
    return boxes


def spread(boxes: list[Sandbox], points: list, work) -> list[str]:
    """Run ``work(box, point)`` for every point, one sandbox per worker; collect failures."""
    chunks = [points[i::len(boxes)] for i in range(len(boxes))]

    def run_chunk(box_and_chunk):
        box, chunk = box_and_chunk
        failures = []
        for point in chunk:
            try:
                work(box, point)
            except AssertionError as exc:
                failures.append(f"{point}: {exc}")
        return failures

    with ThreadPoolExecutor(len(boxes)) as pool:
        return [f for failures in pool.map(run_chunk, zip(boxes, chunks)) for f in failures]


@pytest.mark.parametrize("command, before, after", [("apply", False, "patched"), ("revert", True, "pristine")])
def test_sigkill_at_every_write_related_syscall(sandboxes, command, before, after, record_property):
    sandboxes[0].reset(patched=before)
    points = sandboxes[0].points(command)
    assert len(points) >= 40, points  # the journal, stash, originals, files, state and cache all count

    def kill_at(box: Sandbox, point) -> None:
        syscall, n = point
        box.reset(patched=before)
        proc = box.run_injected(command, syscall, n, "signal=KILL")
        assert proc.returncode in (-9, 137), f"not killed (exit {proc.returncode}): the point was not reached"
        box.check_consistent(f"killed at {syscall} #{n}")
        box.run(command)  # the next command
        states = box.check_consistent(f"after the next {command}")
        assert set(states.values()) == {after}, f"after the next {command}: {states}"
        assert not box.state.journal_path.exists()

    failures = spread(sandboxes, points, kill_at)
    record_property(f"sigkill_points_{command}", len(points))
    print(f"\n{command}: SIGKILL injected at {len(points)} points")
    assert failures == []


@pytest.mark.parametrize("command, before", [("apply", False), ("revert", True)])
def test_enospc_and_eio_on_every_write_and_rename_roll_back(sandboxes, command, before, record_property):
    sandboxes[0].reset(patched=before)
    points = [(s, n, "error=ENOSPC" if s.startswith("write") or s == "pwrite64" else "error=EIO")
              for s, n in sandboxes[0].points(command) if s in ("write", "pwrite64", "rename", "renameat", "renameat2")]
    assert len(points) >= 10, points

    def fail_at(box: Sandbox, point) -> None:
        syscall, n, action = point
        box.reset(patched=before)
        files_before = {r: box.env.file(r).read_bytes() for r in FILES}
        applied_before = box.state.applied_path.read_bytes() if box.state.applied_path.exists() else None
        proc = box.run_injected(command, syscall, n, action)
        where = f"{action} at {syscall} #{n}"
        assert proc.returncode == 4, f"{where}: exit {proc.returncode}: {proc.stderr}"
        assert "Traceback" not in proc.stderr, f"{where}: {proc.stderr}"
        assert proc.stderr.startswith("sm120patch: error: "), f"{where}: {proc.stderr}"
        message = "No space left on device" if "ENOSPC" in action else "Input/output error"
        assert message in proc.stderr, f"{where}: {proc.stderr}"
        assert {r: box.env.file(r).read_bytes() for r in FILES} == files_before, f"{where}: files changed"
        applied_now = box.state.applied_path.read_bytes() if box.state.applied_path.exists() else None
        assert applied_now == applied_before, f"{where}: the applied record changed"
        assert not box.state.journal_path.exists(), f"{where}: a journal was left behind"

    failures = spread(sandboxes, points, fail_at)
    record_property(f"error_points_{command}", len(points))
    print(f"\n{command}: ENOSPC/EIO injected at {len(points)} points")
    assert failures == []
