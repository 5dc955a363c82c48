"""Root against a service user who races it (issue 61): the user owns an environment (the toy
distributions of tests/toy.py, a JIT cache base, a directory for a tuned-limits profile) and runs
a *swapper* while root runs sm120patch there. The swapper replaces every temporary file it sees
by a symbolic link to a root-owned victim, and swaps whole directories (a package, the state
root, the JIT cache's directories, the profile's directory) for links to a root-owned directory
holding files of the same names, then back, as fast as it can.

A try is won by the user when anything outside the environment changed owner, mode, bytes or
listing (the victims), or when one of the user's ``.pth`` files ran as root (it appends its uid
to a log). Used by tests/test_root.py (a few tries each) and benchmarks/root_race.py (hundreds).

Needs root (to be root, and to create the service user); the user is ``sm120race`` (made with
useradd when absent). The interpreter of the user's venv must be one that user can run: the
first of /usr/bin/python3, /usr/local/bin/python3 that it can (not a pyenv under /root, 0700).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from toy import make_data, make_wheel  # noqa: E402
from toy import install as install_wheel  # noqa: E402

USER = "sm120race"
VERSION = "1.0"
NAMES = ("toyfuse", "toyserve")

# The swapper: argv[1] a JSON {"watch": [dirs], "swap": [dirs], "victim_dir", "victim", "stop"}.
SWAPPER = r"""
import json, os, random, sys, time
cfg = json.loads(sys.argv[1])
victim, victim_dir, stop = cfg["victim"], cfg["victim_dir"], cfg["stop"]
wins = {"temporaries": 0, "directories": 0}
def plant(d, n):
    tmp = os.path.join(d, ".swap-%d" % random.randrange(1 << 30))
    try:
        os.symlink(victim, tmp)
        os.rename(tmp, os.path.join(d, n))
        wins["temporaries"] += 1
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
def swap(d):
    real = d + ".real"
    try:
        os.rename(d, real)
    except OSError:
        return
    try:
        os.symlink(victim_dir, d)
        wins["directories"] += 1
        time.sleep(random.choice((0, 0.0002, 0.001)))
        os.unlink(d)
    except OSError:
        pass
    try:
        os.rename(real, d)
    except OSError:
        pass  # root made a new one meanwhile: the try is judged as it ends
stash = cfg["stash"]
while not os.path.exists(stop):
    try:  # the run's stash directory, named by its random run id
        runs = [os.path.join(stash, n) for n in os.listdir(stash)]
    except OSError:
        runs = []
    for d in cfg["watch"] + runs:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for n in names:
            if ".sm120patch-" in n and not n.startswith(".swap-") and not os.path.islink(os.path.join(d, n)):
                plant(d, n)
    if cfg["swap"] and random.random() < cfg["rate"]:
        swap(random.choice(cfg["swap"]))
print(json.dumps(wins))
"""

PLANTED: dict[str, Counter] = {c: Counter() for c in ("apply", "revert", "profile")}  # the swapper's links, per command
PTH = "import os; open({log!r}, 'a').write('%d\\n' % os.getuid())\n"


def need_root(pytest=None) -> None:
    """Skip (fail under CI=true) when not root: the race needs two users."""
    if os.geteuid() == 0:
        return
    message = "the race against another user needs root (CI runs the suite as root)"
    if os.environ.get("CI") == "true":
        raise AssertionError(message)
    if pytest is not None:
        pytest.skip(message)
    raise SystemExit(message)


def service_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent",
                        "--shell", "/usr/sbin/nologin", USER], check=True, capture_output=True)
        return pwd.getpwnam(USER)


def user_python(user: pwd.struct_passwd) -> str:
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3") or ""):
        if candidate and os.path.exists(candidate) and subprocess.run(
                [candidate, "-c", "import venv"], user=user.pw_uid, group=user.pw_gid, extra_groups=[],
                cwd="/", capture_output=True).returncode == 0:
            return candidate
    raise RuntimeError(f"no Python that {USER} can run (a pyenv under /root is not reachable)")


def tree(root: Path) -> dict[str, tuple]:
    """Every entry under ``root`` (itself included): type, owner, mode, bytes or link target."""
    found = {}
    for path in [root, *sorted(root.rglob("*"))]:
        info = path.lstat()
        kind = stat.S_IFMT(info.st_mode)
        content = os.readlink(path) if path.is_symlink() else path.read_bytes() if path.is_file() else None
        found[str(path.relative_to(root))] = (kind, info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode), content)
    return found


class Arena(NamedTuple):
    base: Path  # 0755, root's: everything of one race
    user: pwd.struct_passwd
    template: Path  # the user's environment as made (copied back before every try)
    env: Path  # the user's environment: venv/, home/ (JIT cache base), profiles/
    outside: Path  # root's victims
    data: Path  # SM120PATCH_DATA_DIR
    uid_log: Path

    @property
    def python(self) -> Path:
        return self.env / "venv" / "bin" / "python"

    @property
    def site(self) -> Path:
        return next((self.env / "venv" / "lib").glob("python3*/site-packages"))

    def argv(self, command: str) -> list[str]:
        return [sys.executable, "-m", "sm120patch", *command.split(), "--python", str(self.python),
                "--jit-cache-base", str(self.env / "home")]

    def environ(self) -> dict:
        return dict(os.environ, SM120PATCH_DATA_DIR=str(self.data), PYTHONDONTWRITEBYTECODE="1",
                    SM120PATCH_LOCK_WAIT="2")

    def reset(self) -> None:
        subprocess.run(["rm", "-rf", str(self.env)], check=True)
        subprocess.run(["cp", "-a", str(self.template), str(self.env)], check=True)
        (self.base / "stop").unlink(missing_ok=True)
        self.uid_log.write_text("")

    def owned(self) -> list[Path]:
        """Directories of the user's environment the swapper watches and swaps."""
        site = self.site
        cached = self.env / "home" / ".cache" / "flashinfer" / VERSION / "90a" / "cached_ops"
        return [site / "toyfuse", site / "toyserve", site / ".sm120patch",
                site / ".sm120patch" / f"toyfuse-{VERSION}.dist-info",
                site / ".sm120patch" / f"toyfuse-{VERSION}.dist-info" / "originals" / "toyfuse",
                cached, cached / "tmp", self.env / "profiles"]

    def swapper(self, *, swap: bool = True) -> subprocess.Popen:
        stash = self.site / ".sm120patch" / "stash"
        watch = [*self.owned(), stash]
        config = {"watch": [str(p) for p in watch], "stash": str(stash), "swap": [str(p) for p in self.owned()] if swap else [], "rate": 0.05,
                  "victim": str(self.outside / "victim"), "victim_dir": str(self.outside), "stop": str(self.base / "stop")}
        return subprocess.Popen([self.python, "-I", "-c", SWAPPER, json.dumps(config)], user=self.user.pw_uid,
                                group=self.user.pw_gid, extra_groups=[], cwd="/", stdout=subprocess.PIPE, text=True)

    def stop(self, swapper: subprocess.Popen) -> dict:
        (self.base / "stop").touch()
        out, _ = swapper.communicate(timeout=30)
        return json.loads(out or "{}")

    def pth_ran_as(self) -> set[int]:
        try:
            return {int(line) for line in self.uid_log.read_text().split()}
        except FileNotFoundError:
            return set()


def make_arena() -> Arena:
    user = service_user()
    base = Path(tempfile.mkdtemp(prefix="sm120patch-race-", dir="/tmp"))
    base.chmod(0o755)
    data = make_data(base / "data", _mkdir(base / "wheels"), NAMES)
    template = base / "template"
    venv = template / "venv"
    template.mkdir()
    subprocess.run([user_python(user), "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    for name in NAMES:
        install_wheel(site, make_wheel(base / "wheels", VERSION, name=name))
    uid_log = base / "pth-uids.log"
    uid_log.touch()
    os.chown(uid_log, user.pw_uid, user.pw_gid)
    (site / "zz_race.pth").write_text(PTH.format(log=str(uid_log)))
    cached = template / "home" / ".cache" / "flashinfer" / VERSION / "90a" / "cached_ops"
    (cached / "toy_comm").mkdir(parents=True)
    (cached / "toy_comm" / "toy_comm.so").write_bytes(b"\x7fELF")
    (cached / "tmp").mkdir()
    (cached / "tmp" / "toy_comm.lock").touch()
    (template / "profiles").mkdir()
    subprocess.run(["chown", "-R", f"{user.pw_uid}:{user.pw_gid}", str(template)], check=True)
    outside = base / "outside"  # root's: a file of every name the run writes, and the victim
    outside.mkdir()
    for name in ("victim", "comm.py", "gate.py", "ledger.json", "journal.json", "toy_comm.lock", "tuned.json",
                 "toy_comm.so"):
        (outside / name).write_text(f"root's {name}\n")
        (outside / name).chmod(0o600)
    (outside / "toy_comm").mkdir()
    (outside / "toy_comm" / "toy_comm.so").write_text("root's\n")
    arena = Arena(base, user, template, base / "env", outside, data, uid_log)
    arena.reset()
    return arena


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


PROFILE_WRITER = r"""
import json, sys
from pathlib import Path
from sm120patch.bench import profile
from sm120patch import _tuned_runtime as runtime
sys.path.insert(0, sys.argv[2])
from test_tuning import pcie_entry
tp = int(sys.argv[3])
try:
    written = profile.write(Path(sys.argv[1]), box=runtime._sm120patch_box(), tp=tp, new_entry=pcie_entry(tp))
    print("wrote")
except Exception as exc:
    print("refused: %s" % exc)
"""


def one_try(arena: Arena, command: str, *, swap: bool = True, check_pth: bool = True) -> str:
    """One race: ``command`` ("apply", "revert" (after an apply without the swapper), "profile")
    as root beside the swapper. Returns the outcome ("exit 0", "exit 4", "wrote", "refused");
    raises AssertionError when the user won (``check_pth``: also when the .pth ran as root)."""
    arena.reset()
    before_outside = tree(arena.outside)
    env = arena.environ()
    if command == "revert":
        done = subprocess.run(arena.argv("apply"), capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stderr
    swapper = arena.swapper(swap=swap)
    time.sleep(0.05)
    try:
        if command == "profile":
            proc = subprocess.run([sys.executable, "-c", PROFILE_WRITER, str(arena.env / "profiles" / "tuned.json"),
                                   str(HERE), "4"], capture_output=True, text=True, env=env, timeout=120)
            outcome = proc.stdout.strip().split(":")[0] or f"crashed: {proc.stderr.strip()[-300:]}"
        else:
            proc = subprocess.run(arena.argv(command), capture_output=True, text=True, env=env, timeout=120)
            outcome = f"exit {proc.returncode}"
            assert "Traceback" not in proc.stderr, proc.stderr
    finally:
        PLANTED[command].update(arena.stop(swapper))
    after = tree(arena.outside)
    changed = sorted(k for k in set(before_outside) | set(after) if before_outside.get(k) != after.get(k))
    assert changed == [], f"{command}: root's files changed: {changed} ({outcome})"
    ran = arena.pth_ran_as() if check_pth else set()
    assert 0 not in ran, f"{command}: the user's .pth ran as root ({outcome})"
    assert ran <= {arena.user.pw_uid}, ran
    return outcome


def race(arena: Arena, command: str, tries: int) -> Counter:
    """``tries`` races, every other one with temporary files alone swapped (so that more runs
    reach their writes), the others with whole directories too."""
    return Counter(one_try(arena, command, swap=bool(n % 2)) for n in range(tries))


def cleanup(arena: Arena) -> None:
    subprocess.run(["rm", "-rf", str(arena.base)], check=False)
