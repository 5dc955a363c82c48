"""Kill sm120patch (SIGKILL) at every write-related system call of apply and of revert, send it
SIGINT, SIGTERM or SIGHUP there, and fail every write and rename (ENOSPC, EIO), one run per
point, from outside the process with strace. After each kill every file is exactly pristine or
exactly patched, no original is lost, no JIT entry is in place beside sources other than those
it was built from, status calls the state what it is, and the next command (the same one, or
the opposite) brings the environment wholly to one state. After each injected error the whole
environment, its state and its JIT cache are byte for byte as before.

The environment holds the two synthetic distributions of tests/toy.py: a kernel library with a
JIT module and a server, one transaction over both, the JIT entries moved aside and back. What
is swept is sm120patch's own writes (the journal, the stash, the originals, the ledgers, the
renames), the same for every distribution; the toy's few-line files make each of the several
hundred runs a fraction of a second. The real wheels' files are written by the same code (the
matrix, test_e2e and test_situations run it on them)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import pytest

from helpers import ServingEnv, changed, jit_entry_at, need, snapshot
from sm120patch.hashing import sha256
from sm120patch.manifests import load_manifest
from sm120patch.state import TEMPORARY
from toy import FILES as TOY_FILES
from toy import make_data, make_install, make_wheel

STRACE = shutil.which("strace")

# Every system call that creates, writes, renames, removes or re-modes a file or directory.
WRITE_SYSCALLS = (
    "write,pwrite64,openat,rename,renameat,renameat2,unlink,unlinkat,rmdir,mkdir,mkdirat,link,linkat,"
    "symlink,symlinkat,fsync,fdatasync,ftruncate,fchmod,fchmodat,chmod,fchown,fchownat"
)
TRACE_LINE = re.compile(r"^(?P<syscall>\w+)\((?P<args>.*)\) += .*$")
PATH_ARG = re.compile(r'"((?:[^"\\]|\\.)*)"|<([^<>]*)>')  # a string argument, or the path strace -y gives an fd
RUN = "fa17fa17fa17"  # the run id of every traced run (transaction.new_run)
FILES = {relpath: name for name, (relpath, _) in TOY_FILES.items()}  # relpath -> distribution
KERNELS, MODULE, VERSION = "toyfuse", "toy_comm", "1.0"  # the distribution with a JIT module, and it
WORKERS = max(1, min(4, os.cpu_count() or 1))
OPPOSITE = {"apply": "revert", "revert": "apply"}
STATE_OF = {"apply": "patched", "revert": "pristine"}


class Point(NamedTuple):
    """The n-th call of ``syscall`` that names ``path`` (in any argument, as strace's -P
    matches): what a fault is aimed at. ``path`` is a :func:`template`."""

    syscall: str
    path: str
    n: int
    args: str  # the call as the traced run made it (for covers and messages)

    def __str__(self) -> str:
        return f"{self.syscall} #{self.n} on {self.path.format(base='...', pid='<pid>')}"


def paths_in(args: str) -> list[str]:
    return [m[1] if m[1] is not None else m[2] for m in PATH_ARG.finditer(args)]


def template(path: str, base: str, pid: int) -> str:
    """``path`` with the sandbox's directory as ``{base}`` (each worker has its own) and the pid
    in a temporary file's name (state.temporary) as ``{pid}``."""
    path = path.replace("{", "{{").replace("}", "}}").replace(f".sm120patch-{pid}-", ".sm120patch-{pid}-")
    assert path.startswith(base + "/"), path
    return "{base}" + path[len(base):]


@dataclass
class Sandbox:
    """One environment and the bytes it is reset to between runs."""

    env: ServingEnv
    pristine: dict[str, bytes]
    data: Path  # SM120PATCH_DATA_DIR: the shipped data and the toy distributions
    patched: dict[str, bytes] | None = None  # the files after this sandbox's own first apply

    @property
    def base(self) -> Path:
        """The sandbox's directory: its environment (venv/), JIT cache base (home/) and traces."""
        return self.env.root.parent

    @property
    def saved_state(self):
        return self.base / "patched-state"

    @property
    def journal(self):
        return self.env.state_root / "journal.json"

    def argv(self, command: str) -> list[str]:
        return [sys.executable, "-m", "sm120patch", command, "--python", str(self.env.python),
                "--jit-cache-base", str(self.env.home)]

    def seed_jit(self) -> None:
        """JIT entries as a server leaves them, for the kernels' module and another."""
        self.env.seed_jit(modules=(MODULE, "norm"), version=VERSION)

    def reset(self, *, patched: bool) -> None:
        """Pristine, or patched as this sandbox's own apply left it: applied once, then its files
        and its .sm120patch/ restored from that run's copy (the ledger names this sandbox's
        paths, so each keeps its own)."""
        shutil.rmtree(self.env.state_root, ignore_errors=True)
        shutil.rmtree(self.env.home / ".cache", ignore_errors=True)
        files = self.patched if patched and self.patched is not None else self.pristine
        for relpath, data in files.items():
            self.env.file(relpath).write_bytes(data)
        if patched and self.patched is None:
            self.run("apply")
            self.patched = {relpath: self.env.file(relpath).read_bytes() for relpath in FILES}
            shutil.copytree(self.env.state_root, self.saved_state, symlinks=True)
        elif patched:
            shutil.copytree(self.saved_state, self.env.state_root, symlinks=True)
        self.seed_jit()  # entries as a server built them, from the sources as they are now

    def points(self, command: str) -> list[Point]:
        """Every write-related call of one run that touches the environment or its cache, each
        named by what it hits: its syscall, the first of its paths there, and how many calls of
        that syscall had named that path before (the interpreter's own calls, which vary with
        bytecode caches and the like, never name these paths)."""
        trace = self.base / f"trace-{command}.txt"
        proc, pid = self.traced(command, lambda pid: ["-y", "-o", str(trace), "-e", f"trace={WRITE_SYSCALLS}"])
        assert proc.returncode == 0, f"the traced {command} failed: {proc.stderr}"
        roots = (str(self.env.root), str(self.env.home))
        seen: dict[tuple[str, str], int] = {}
        points = []
        for line in trace.read_text().splitlines():
            match = TRACE_LINE.match(line)
            if not match:
                continue
            syscall, args = match["syscall"], match["args"]
            paths = [p for p in paths_in(args) if p.startswith(roots)]
            for path in dict.fromkeys(paths):  # strace's -P matches a call naming the path in any argument
                seen[syscall, path] = seen.get((syscall, path), 0) + 1
            if not paths or syscall == "openat" and not re.search(r"O_WRONLY|O_RDWR|O_CREAT", args):
                continue
            points.append(Point(syscall, template(paths[0], str(self.base), pid), seen[syscall, paths[0]], args))
        return points

    def environ(self, *, run: str | None = None) -> dict[str, str]:
        # No .pyc writes: a traced run is the same run each time. The run's id (transaction.new_run)
        # fixes the paths of its stash and of the JIT entries it moves aside.
        extra = {"SM120PATCH_RUN_ID": run} if run else {}
        return dict(os.environ, PYTHONDONTWRITEBYTECODE="1", SM120PATCH_DATA_DIR=str(self.data), **extra)

    def traced(self, command: str, strace_args) -> tuple[subprocess.CompletedProcess, int]:
        """The command under strace, its run id :data:`RUN`, strace attached before it starts:
        it waits for a line on stdin, then execs (keeping its pid, which names its temporary
        files), so ``strace_args(pid)`` can name the paths of that run."""
        proc = subprocess.Popen(["sh", "-c", 'read _ && exec "$@"', "sh", *self.argv(command)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.environ(run=RUN))
        tracer = subprocess.Popen([STRACE, *strace_args(proc.pid), "-p", str(proc.pid)], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            attached = tracer.stderr.readline()  # strace says so once the process is traced
            assert attached.endswith(f"Process {proc.pid} attached\n"), f"strace did not attach: {attached}"
            stdout, stderr = proc.communicate("\n", timeout=120)
            tracer.communicate(timeout=60)
        finally:
            for process in (proc, tracer):
                if process.poll() is None:
                    process.kill()
                    process.wait()
        return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), proc.pid

    def run(self, command: str) -> subprocess.CompletedProcess:
        """The command as a user runs it (a process of its own: the workers run in threads)."""
        proc = subprocess.run(self.argv(command), capture_output=True, text=True, env=self.environ())
        if command != "status":
            assert proc.returncode == 0, f"{command} failed: {proc.stderr}"
        return proc

    def run_injected(self, command: str, point: Point, action: str) -> subprocess.CompletedProcess:
        """The command with ``action`` at ``point``: strace sees only that syscall on that path
        (``-P``), so its ``when`` counts the calls that name the path, as :meth:`points` did.
        A point the run does not reach fails here (no call of this run made it differently)."""
        trace = self.base / "trace-injected.txt"
        proc, pid = self.traced(command, lambda pid: [
            "-o", str(trace), "-P", point.path.format(base=self.base, pid=pid), "-e", f"trace={point.syscall}",
            "-e", f"inject={point.syscall}:{action}:when={point.n}"])
        calls = [line for line in trace.read_text().splitlines() if line.startswith(f"{point.syscall}(")]
        assert len(calls) >= point.n, \
            f"not reached: the run made {len(calls)} such calls (exit {proc.returncode}: {proc.stderr})"
        return proc

    def temporaries(self) -> list[str]:
        """The temporary files of sm120patch's writes (``.<name>.sm120patch-<pid>.tmp``) anywhere
        in the environment, its state included."""
        return sorted(str(p) for p in self.env.root.rglob(".*.sm120patch-*") if TEMPORARY.match(p.name))

    def file_states(self) -> dict[str, str]:
        states = {}
        for relpath, name in FILES.items():
            manifest = load_manifest(name, VERSION, self.data / "vendor-manifests")
            digest = sha256(self.env.file(relpath).read_bytes())
            expected = manifest.files[relpath]
            states[relpath] = ("pristine" if digest == expected.pristine
                               else "patched" if digest in expected.patched.values() else "MIXED")
        return states

    def check_consistent(self, where: str, built_for: str) -> dict[str, str]:
        """Each file wholly pristine or patched; each patched file's original kept; a JIT entry
        in place only beside the sources it was built from (``built_for``)."""
        states = self.file_states()
        assert "MIXED" not in states.values(), f"{where}: a file is neither pristine nor patched: {states}"
        for relpath, state in states.items():
            if state == "patched":
                original = self.env.state(FILES[relpath]).original(relpath)
                assert original.exists() and original.read_bytes() == self.pristine[relpath], \
                    f"{where}: {relpath} is patched but its original is lost"
        kernels = {states[r] for r, name in FILES.items() if name == KERNELS}
        for arch in ("90a", "90a_120a"):
            entry = jit_entry_at(self.env.home, VERSION, arch, MODULE)
            if entry.exists():
                assert kernels == {built_for}, f"{where}: {entry} is in place beside other sources ({states})"
        return states


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory) -> Path:
    return make_data(tmp_path_factory.mktemp("data"), tmp_path_factory.mktemp("wheels"), ("toyfuse", "toyserve"))


@pytest.fixture
def sandboxes(toy_data, tmp_path):
    need(STRACE is not None, "strace is not installed (.ci/run installs it)")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    pristine = {relpath: source.encode() for relpath, source in TOY_FILES.values()}
    boxes = []
    for i in range(WORKERS):
        root = tmp_path / f"box{i}" / "venv"
        make_install(root, [make_wheel(wheels, VERSION, name=name) for name in TOY_FILES])
        (root.parent / "home").mkdir()
        boxes.append(Sandbox(ServingEnv(root, root.parent / "home"), pristine, toy_data))
    return boxes


def spread(boxes: list[Sandbox], points: list, work) -> list[str]:
    """Run ``work(box, index, point)`` for every point, one sandbox per worker; collect failures."""
    chunks = [list(enumerate(points))[i::len(boxes)] for i in range(len(boxes))]

    def run_chunk(box_and_chunk):
        box, chunk = box_and_chunk
        failures = []
        for index, point in chunk:
            try:
                work(box, index, point)
            except AssertionError as exc:
                failures.append(f"{point}: {exc}")
        return failures

    with ThreadPoolExecutor(len(boxes)) as pool:
        return [f for failures in pool.map(run_chunk, zip(boxes, chunks)) for f in failures]


def covers(points: list, command: str) -> None:
    """The traced run wrote every kind of thing a run writes: losing a class of kill points
    fails here, not silently."""
    # A call by a name in a directory descriptor (sm120patch.dirfd) names "<dir>, name": joined.
    touched = " ".join(re.sub(r'<([^<>]*)>, "((?:[^"\\]|\\.)*)"', r"\1/\2", point.args) for point in points)
    wanted = ["journal.json", "/stash/", MODULE, "sm120patch-aside", *FILES]
    wanted += ["/originals/", "ledger.json"] if command == "apply" else []
    missing = [w for w in wanted if w not in touched]
    assert missing == [], f"the {command} trace never touches {missing}"


@pytest.mark.parametrize("command, before", [("apply", False), ("revert", True)])
def test_sigkill_at_every_write_related_syscall(sandboxes, command, before, record_property):
    sandboxes[0].reset(patched=before)
    points = sandboxes[0].points(command)
    covers(points, command)
    # A kill at an fsync leaves the files as a kill at the next point does (without a power
    # loss an fsync changes nothing one can read): one run covers both.
    points = [p for p in points if p.syscall not in ("fsync", "fdatasync")]
    built_for = "patched" if before else "pristine"

    def kill_at(box: Sandbox, index: int, point) -> None:
        box.reset(patched=before)
        proc = box.run_injected(command, point, "signal=KILL")
        assert proc.returncode == -9, f"not killed (exit {proc.returncode}): {proc.stderr}"
        where = f"killed at {point}"
        box.check_consistent(where, built_for)
        status = box.run("status")
        if box.journal.exists():  # interrupted: status says so, exit 3
            assert status.returncode == 3 and "an interrupted" in status.stdout, f"{where}: status: {status.stdout}"
        else:
            assert status.returncode in (0, 1), f"{where}: status exit {status.returncode}: {status.stderr}"
        # The next command: the same one half the time, the opposite one the other half.
        nxt = command if index % 2 == 0 else OPPOSITE[command]
        box.run(nxt)
        states = box.check_consistent(f"{where}, then {nxt}", built_for)
        assert set(states.values()) == {STATE_OF[nxt]}, f"{where}, then {nxt}: {states}"
        assert not box.journal.exists() and not (box.env.state_root / "stash").exists()
        assert box.temporaries() == [], f"{where}, then {nxt}: temporaries left"

    failures = spread(sandboxes, points, kill_at)
    record_property(f"sigkill_points_{command}", len(points))
    print(f"\n{command}: SIGKILL injected at {len(points)} points")
    assert failures == []


@pytest.mark.parametrize("command, before", [("apply", False), ("revert", True)])
def test_enospc_and_eio_on_every_write_and_rename_change_nothing(sandboxes, command, before, record_property):
    sandboxes[0].reset(patched=before)
    points = [p for p in sandboxes[0].points(command)
              if p.syscall in ("write", "pwrite64", "rename", "renameat", "renameat2", "link", "linkat")]
    found = {p.syscall for p in points}
    assert "write" in found and found & {"rename", "renameat", "renameat2"}, points  # (renames by directory descriptor)

    def fail_at(box: Sandbox, index: int, point: Point) -> None:
        action = "error=ENOSPC" if point.syscall in ("write", "pwrite64") else "error=EIO"
        box.reset(patched=before)
        before_snapshot = snapshot(box.env)
        proc = box.run_injected(command, point, action)
        where = f"{action} at {point}"
        assert proc.returncode == 4, f"{where}: exit {proc.returncode}: {proc.stderr}"
        assert "Traceback" not in proc.stderr, f"{where}: {proc.stderr}"
        assert proc.stderr.startswith("sm120patch: error: "), f"{where}: {proc.stderr}"
        message = "No space left on device" if "ENOSPC" in action else "Input/output error"
        assert message in proc.stderr and "()" not in proc.stderr, f"{where}: {proc.stderr}"
        assert re.search(rf"{message} \({re.escape(str(box.base))}/", proc.stderr), f"{where}: names no path: {proc.stderr}"
        diff = changed(before_snapshot, snapshot(box.env))
        assert diff == [], f"{where}: changed {diff}"

    failures = spread(sandboxes, points, fail_at)
    record_property(f"error_points_{command}", len(points))
    print(f"\n{command}: ENOSPC/EIO injected at {len(points)} points")
    assert failures == []


SIGNALS = (("INT", 130), ("TERM", 143), ("HUP", 129))  # Ctrl-C, systemd/Ansible, a closed terminal


@pytest.mark.parametrize("command, before", [("apply", False), ("revert", True)])
def test_a_signal_at_every_write_related_syscall_ends_in_one_state_and_says_which(sandboxes, command, before,
                                                                                   record_property):
    """SIGINT, SIGTERM and SIGHUP in turn, one per point: before the commit point the run rolls
    back and says so (exit 128 + the signal); after it the change stands, the run finishes and
    says that the signal came after the commit (exit 0). Either way nothing is pending, no
    temporary is left, and a full revert afterwards leaves no .sm120patch/ at all."""
    sandboxes[0].reset(patched=before)
    points = sandboxes[0].points(command)
    covers(points, command)
    built_for = "patched" if before else "pristine"
    start = "patched" if before else "pristine"

    def signal_at(box: Sandbox, index: int, point) -> None:
        name, code = SIGNALS[index % len(SIGNALS)]
        box.reset(patched=before)
        proc = box.run_injected(command, point, f"signal={name}")
        where = f"SIG{name} at {point}"
        states = set(box.check_consistent(where, built_for).values())
        assert "Traceback" not in proc.stderr, f"{where}: {proc.stderr}"
        if states == {STATE_OF[command]} and states != {start}:  # the change was made: it says so
            assert proc.returncode == 0, f"{where}: the change stands, exit {proc.returncode}: {proc.stderr}"
            assert "rolled back" not in proc.stderr, f"{where}: {proc.stderr}"
            assert f"SIG{name} arrived after the {command} was committed" in proc.stderr, f"{where}: {proc.stderr}"
        else:
            assert states == {start}, f"{where}: {states}"
            assert proc.returncode == code, f"{where}: rolled back, exit {proc.returncode}: {proc.stderr}"
            assert proc.stderr == f"sm120patch: interrupted (SIG{name}); any change in progress was rolled back\n", \
                f"{where}: {proc.stderr}"
        root = box.env.state_root
        assert not box.journal.exists() and not (root / "stash").exists(), f"{where}: a run is left pending"
        assert box.temporaries() == [], f"{where}: temporaries left"
        status = box.run("status")
        assert status.returncode in (0, 1) and "interrupted" not in status.stdout, f"{where}: {status.stdout}"
        assert "by hand" not in status.stdout, f"{where}: sm120patch's own writes called a hand edit"
        box.run("revert")
        assert not root.exists(), f"{where}, then a full revert: {sorted(map(str, root.rglob('*')))}"
        assert set(box.file_states().values()) == {"pristine"}, where

    failures = spread(sandboxes, points, signal_at)
    record_property(f"signal_points_{command}", len(points))
    print(f"\n{command}: SIGINT/SIGTERM/SIGHUP injected at {len(points)} points")
    assert failures == []
