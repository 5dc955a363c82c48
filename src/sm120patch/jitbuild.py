"""Warm FlashInfer's JIT cache: build a distribution's JIT module (``trtllm_comm``) with
FlashInfer's own JIT, in the target interpreter, into the cache base the server reads, so the
first server start after ``apply`` compiles nothing.

The build is FlashInfer's: its JIT spec, its ``build.ninja``, its build lock, its cache path
(``<base>/.cache/flashinfer/<version>/<archs>/cached_ops/<module>``), its architecture choice
(``FLASHINFER_CUDA_ARCH_LIST`` when given, else the GPUs it sees). sm120patch adds the
parallelism (``MAX_JOBS``), the progress, the proof (a fresh process regenerates the same
``build.ninja``, ninja finds nothing to do, the library loads), the cleanup of an entry a
failed or interrupted build leaves half-written, and the end of the whole build (its process
group, ninja and nvcc included) when a signal interrupts it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

from sm120patch import dirfd, runas, signals
from sm120patch.errors import CheckFailedError, TargetError, UsageError
from sm120patch.state import Owner
from sm120patch.words import counted

_STEP = re.compile(r"^\[(\d+)/(\d+)\]")
_ARCH = re.compile(r"^\d+\.\d+[af]?$")

# First in every build process (the group leader, in the target interpreter): sm120patch's end,
# even by SIGKILL (the OOM killer, `kill -9`, a container runtime's timeout), which no handler of
# sm120patch's sees, ends the build. Linux sends the leader SIGTERM when sm120patch dies
# (prctl PR_SET_PDEATHSIG), and the leader passes it to its whole process group: FlashInfer's
# ninja, which passes it on to its compilers' groups. SM120PATCH_PARENT_PID closes the window
# in which sm120patch died before the guard was set. Elsewhere than Linux there is no such
# signal: end_group, on sm120patch's own signals, is all there is.
_GUARD = r"""
def _sm120patch_guard():
    import ctypes, os, signal
    def end(signum=None, frame=None):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.killpg(0, signal.SIGTERM)  # this process too, by the default action
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM)) != 0:  # PR_SET_PDEATHSIG
            return
    except (OSError, AttributeError):
        return
    signal.signal(signal.SIGTERM, end)
    if str(os.getppid()) != os.environ.get("SM120PATCH_PARENT_PID", str(os.getppid())):
        end()
_sm120patch_guard()
"""


def start_build(python: Path, script: str, args: list[str], env: dict, run_as: dict | None = None,
                **pipes) -> subprocess.Popen:
    """``script`` in ``python`` as the leader of a process group (a session) of its own, guarded
    by _GUARD: ended whole by end_group on sm120patch's signals, by the kernel's parent-death
    signal when sm120patch is killed outright."""
    return subprocess.Popen([str(python), "-c", _GUARD + script, *args],
                            env=dict(env, SM120PATCH_PARENT_PID=str(os.getpid())), cwd="/", start_new_session=True,
                            **(run_as or {}), **pipes)


# Runs in the target interpreter. argv[1]: JSON {"spec": "module:function", "phase": "build" | "prove" | "sm120"}.
_SCRIPT = r"""
import importlib, json, os, subprocess, sys
request = json.loads(sys.argv[1])
def say(**event):
    print("@@sm120patch " + json.dumps(event), flush=True)
def sm120():
    # The architectures this FlashInfer builds for an SM120 GPU it detects itself (no
    # FLASHINFER_CUDA_ARCH_LIST): asked of its own CompilationContext, torch's answer for the
    # device replaced (a build machine may have no GPU). 0.6.7+ says 12.0f where nvcc >= 12.9.
    try:
        import torch
        from flashinfer.compilation_context import CompilationContext
    except Exception:
        return None
    saved = os.environ.pop("FLASHINFER_CUDA_ARCH_LIST", None), torch.cuda.device_count, torch.cuda.get_device_capability
    torch.cuda.device_count, torch.cuda.get_device_capability = (lambda: 1), (lambda device=None: (12, 0))
    try:
        return ["%d.%s" % arch for arch in sorted(CompilationContext().TARGET_CUDA_ARCHS)] or None
    except Exception:
        return None
    finally:
        torch.cuda.device_count, torch.cuda.get_device_capability = saved[1], saved[2]
        if saved[0] is not None:
            os.environ["FLASHINFER_CUDA_ARCH_LIST"] = saved[0]
if request["phase"] == "sm120":
    say(sm120=sm120())
    sys.exit(0)
try:
    if not os.environ.get("FLASHINFER_CUDA_ARCH_LIST"):
        import torch
        if not torch.cuda.is_available():
            say(error="no GPU is visible and FLASHINFER_CUDA_ARCH_LIST is not set", kind="arch")
            sys.exit(0)
    module, _, function = request["spec"].partition(":")
    spec = getattr(importlib.import_module(module), function)()
except Exception as exc:
    say(error="%s: %s" % (type(exc).__name__, str(exc).strip().splitlines()[-1] if str(exc).strip() else ""), kind="import")
    sys.exit(0)
say(build_dir=str(spec.build_dir), library=str(spec.jit_library_path), existed=spec.build_dir.exists(),
    had_library=spec.jit_library_path.exists(), aot=bool(getattr(spec, "is_aot", False)))
if request["phase"] == "build":
    def stamp():
        library = spec.jit_library_path
        return library.stat().st_mtime_ns if library.exists() else None
    before = stamp()
    try:
        spec.build(verbose=True)  # FlashInfer's own lock, ninja file and ninja run
    except Exception as exc:
        say(error="%s: %s" % (type(exc).__name__, str(exc).strip().splitlines()[-1] if str(exc).strip() else ""), kind="build")
        sys.exit(0)
    say(built=True, compiled=before is None or stamp() != before)
else:
    from flashinfer.jit.cpp_ext import generate_ninja_build_for_op
    expected = generate_ninja_build_for_op(
        name=spec.name, sources=spec.sources, extra_cflags=spec.extra_cflags,
        extra_cuda_cflags=spec.extra_cuda_cflags, extra_ldflags=spec.extra_ldflags,
        extra_include_dirs=spec.extra_include_dirs,
        **({"needs_device_linking": spec.needs_device_linking} if hasattr(spec, "needs_device_linking") else {}))
    same = spec.ninja_path.exists() and spec.ninja_path.read_text() == expected
    dry = subprocess.run(["ninja", "-n", "-C", str(spec.build_dir), "-f", str(spec.ninja_path)],
                         capture_output=True, text=True)
    try:
        spec.load(spec.jit_library_path)
        loaded, error = True, None
    except Exception as exc:
        loaded, error = False, "%s: %s" % (type(exc).__name__, str(exc).strip().splitlines()[-1] if str(exc).strip() else "")
    say(same_ninja=same, up_to_date="no work to do" in dry.stdout, loaded=loaded, load_error=error, sm120=sm120())
"""


_NEEDS = """
import importlib.util, json
print(json.dumps({"torch": importlib.util.find_spec("torch") is not None}))
"""


def missing_for_build(python: Path | str) -> list[str]:
    """What FlashInfer's JIT build needs and does not find, in words (empty: nothing): torch in
    the target interpreter, ninja on PATH (FlashInfer runs `ninja` as found there), nvcc in the
    toolkit FlashInfer takes (:func:`cuda_home`). Asked before anything is written or announced."""
    missing = []
    try:
        user = runas.environment_owner(python)  # as root on another user's environment: as that user
        proc = subprocess.run([str(python), "-c", _NEEDS], capture_output=True, text=True, timeout=60, cwd="/",
                              env=user.environ(), **user.popen_args())
        found = json.loads(proc.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        found = {"torch": False}
    if not found["torch"]:
        missing.append(f"torch is not importable in {python}")
    if shutil.which("ninja") is None:
        missing.append("ninja is not on PATH (FlashInfer's JIT runs it from there)")
    nvcc = cuda_home() / "bin" / "nvcc"
    if not nvcc.is_file():
        missing.append(f"no nvcc at {nvcc} (FlashInfer's CUDA home: $CUDA_HOME, else two levels above the nvcc on "
                       "PATH, else /usr/local/cuda)")
    return missing


def check_build(python: Path | str, module: str, arch: str | None, gpus: int) -> None:
    """Refuse, in one line and before the first write, a build that cannot run: what is missing
    (:func:`missing_for_build`), or no arch to build for (no --arch, no FLASHINFER_CUDA_ARCH_LIST,
    and ``gpus``, what the driver sees, is 0)."""
    missing = missing_for_build(python)
    if missing:
        raise UsageError(f"cannot build {module}: {'; '.join(missing)}; nothing was changed",
                         hint="the server's environment needs torch and FlashInfer's dependencies, and the machine "
                              "the CUDA toolkit (nvcc >= 12.8) and ninja")
    if not arch and not os.environ.get("FLASHINFER_CUDA_ARCH_LIST") and not gpus:
        raise UsageError(f"cannot tell which GPUs to build {module} for: no GPU is visible and "
                         "FLASHINFER_CUDA_ARCH_LIST is not set; nothing was changed", fix=[("--arch", "12.0a")],
                         hint="builds for SM120 (RTX PRO 6000 Blackwell, RTX 5090); give your servers' compute "
                              "capability if it is another")


def parse_arch(text: str) -> str:
    """``12.0a``, ``9.0a,12.0a`` or ``"9.0a 12.0a"`` -> FLASHINFER_CUDA_ARCH_LIST's form."""
    archs = [a for a in re.split(r"[,\s]+", text.strip()) if a]
    bad = [a for a in archs if not _ARCH.match(a)]
    if not archs or bad:
        raise UsageError(f"--arch {text}: not a list of compute capabilities",
                         fix=[("--arch", "12.0a")],
                         hint="builds for RTX PRO 6000 Blackwell and RTX 5090 (several: --arch '9.0a 12.0a')")
    return " ".join(archs)


@dataclass(frozen=True)
class BuildResult:
    module: str
    entry: Path  # <base>/.cache/flashinfer/<version>/<archs>/cached_ops/<module>
    archs: str  # what FlashInfer built for (the entry's arch directory)
    seconds: float
    proof: str  # how the entry was shown to be the one FlashInfer loads at start
    compiled: bool = True  # False: the entry was up to date, ninja had nothing to do (nothing changed)
    note: str | None = None  # when the server, left to itself, would look for another entry
    libcuda: str | None = None  # linked against sm120patch's own stub: what and why (None: the link's own)


def arch_note(arch: str | None, sm120: list[str] | None = None) -> str | None:
    """When a server left to itself would look up another entry than ``--arch`` built.

    FlashInfer names the entry after its arch list; detecting a GPU of SM90 or later it adds a
    suffix (12.0 -> 12.0a, directory 120a). ``--arch 12.0`` therefore builds an entry that a
    server without FLASHINFER_CUDA_ARCH_LIST=12.0 in its environment never looks up. ``sm120``
    is what the installed FlashInfer builds for an SM120 GPU it detects (its own answer: 0.6.7+
    says 12.0f where nvcc is 12.9 or later): an ``--arch`` for SM120 other than that (12.0a
    there, or a list of several) is found only by a server that sets the same list."""
    if not arch:
        return None
    plain = [a for a in arch.split() if a[-1].isdigit() and int(a.split(".")[0]) >= 9]
    if plain:
        suffixed = " ".join(a + "a" if a in plain else a for a in arch.split())
        return (f"a server that detects its GPUs builds for {suffixed!r} (FlashInfer adds the 'a' from SM90 on) and "
                f"finds this entry only with FLASHINFER_CUDA_ARCH_LIST={arch!r} in its environment; else use "
                f"--arch '{suffixed}'")
    detected = " ".join(sm120 or ())
    if not detected or not any(a.startswith("12.") for a in arch.split()) or sorted(arch.split()) == sorted(detected.split()):
        return None
    sglang = " (SGLang 0.5.4.post3 and later set it themselves on SM120)" if arch == "12.0a" else ""
    return (f"an SM120 server whose FlashInfer detects its GPUs builds for {detected!r} with this FlashInfer and nvcc, "
            f"and finds this entry ({arch!r}) only with FLASHINFER_CUDA_ARCH_LIST={arch!r} in its environment{sglang}; "
            f"else use --arch '{detected}'")


def build(python: Path, *, spec: str, module: str, base: Path, arch: str | None, owner: Owner | None,
          progress: Callable[[str, int, int], None] | None = None, jobs: int | None = None) -> BuildResult:
    """Build ``spec`` (``module:function``, FlashInfer's JIT spec) in ``python`` into ``base``,
    then prove in a fresh process that FlashInfer will load it without compiling."""
    # The server's environment and nothing that changes FlashInfer's flags: FLASHINFER_JIT_VERBOSE
    # or _DEBUG would make a debug build (other nvcc flags, another build.ninja, an entry the
    # server rebuilds), FLASHINFER_NVCC_THREADS goes into build.ninja too. MAX_JOBS only sets
    # ninja's -j; ninja's [n/m] lines reach us because the build runs with verbose=True.
    server_env = dict(os.environ, FLASHINFER_WORKSPACE_BASE=str(base))
    if arch:
        server_env["FLASHINFER_CUDA_ARCH_LIST"] = arch
    env = dict(server_env, MAX_JOBS=str(jobs or os.cpu_count() or 1), PYTHONUNBUFFERED="1")
    # As the cache base's owner; where that is root's, still never as root for another user's
    # environment (its interpreter runs its owner's code: sm120patch.runas).
    run_as = _run_as(owner) or runas.environment_owner(python).popen_args()
    start = time.monotonic()
    if progress:
        progress(f"building {module} with FlashInfer's JIT in {python} for "
                 f"{arch or 'the GPUs FlashInfer sees'} into {base} ({env['MAX_JOBS']} jobs; minutes)", 0, 0)
    events: dict = {}
    try:
        events, tail = _run(python, {"spec": spec, "phase": "build"}, env, run_as, progress, events)
        libcuda = None
        if "error" in events and events.get("build_dir") and _missing_libraries(tail) == ["cuda"]:
            # Every object compiled; only libcuda is missing. Link again (ninja redoes the link alone)
            # against a stub made from the objects' own driver calls.
            events, tail, libcuda = _link_with_stub(python, spec, env, run_as, progress,
                                                    Path(events["build_dir"]), owner, events)
    except BaseException:  # a signal (the build's processes are gone by now), or a stub that cannot be made
        with signals.held():  # a second Ctrl-C must not leave the removal half done
            _remove_partial(events, base, module)
        raise
    elapsed = time.monotonic() - start
    where = events.get("build_dir")
    if "error" in events:
        home = _ninja_cuda_home(Path(where)) if where else None
        removed = _remove_partial(events, base, module)
        kind = events.get("kind")
        if kind == "import":
            raise TargetError(f"FlashInfer's JIT does not import in {python}: {events['error']}",
                              hint="the server's environment needs torch and FlashInfer's dependencies")
        if kind == "arch":
            raise UsageError(f"cannot tell which GPUs to build {module} for: {events['error']}",
                             fix=[("--arch", "12.0a")],
                             hint="builds for SM120 (RTX PRO 6000 Blackwell, RTX 5090); give your servers' "
                                  "compute capability if it is another")
        detail = "\n".join(tail)
        missing = [name for name in _missing_libraries(tail) if name != "cuda" or libcuda is None]
        if missing:  # every object compiled; the link found no such library where FlashInfer looks
            where_text = f"{home}/lib64" if home else "$CUDA_HOME/lib64"
            raise CheckFailedError(
                f"FlashInfer compiled {module} but could not link it: no {', '.join('lib' + m for m in missing)} in "
                f"{where_text} (FlashInfer's CUDA home: $CUDA_HOME, else two levels above the nvcc on PATH)"
                + ("; the half-built entry was removed" if removed else ""),
                hint="set CUDA_HOME to the CUDA toolkit's root (the directory with bin/nvcc and lib64/), e.g. "
                     "CUDA_HOME=/usr/local/cuda, and run it again")
        raise CheckFailedError(f"FlashInfer's JIT build of {module} failed after {elapsed:.0f} s: {events['error']}"
                               + ("; the patched sources are in place, the half-built entry was removed"
                                  if removed else ""),
                               hint=("the build's last lines:\n" + detail) if detail else None)
    if "built" not in events:
        raise CheckFailedError(f"FlashInfer's JIT build of {module} stopped without a result: " + (tail[-1] if tail else "no output"))
    proof, _ = _run(python, {"spec": spec, "phase": "prove"}, server_env, run_as, None)
    entry = Path(where)
    problems = [text for key, text in (("same_ninja", "its build.ninja is not the one FlashInfer generates at start"),
                                       ("up_to_date", "ninja would rebuild it at start"))
                if not proof.get(key)]
    if problems:
        raise CheckFailedError(f"the built entry {entry} is not what FlashInfer loads at start: {'; '.join(problems)}")
    if proof.get("loaded"):
        how = "a fresh process regenerated the same build.ninja, ninja had no work to do, and the library loaded"
    else:
        how = ("a fresh process regenerated the same build.ninja and ninja had no work to do; the library did not "
               f"load here ({proof.get('load_error')}): a machine without a CUDA driver cannot load it")
    return BuildResult(module, entry, entry.parent.parent.name, elapsed, how, bool(events.get("compiled", True)),
                       arch_note(arch, proof.get("sm120")), libcuda)


def sm120_archs(python: Path) -> list[str] | None:
    """What the FlashInfer in ``python`` builds for an SM120 GPU it detects itself (``["12.0a"]``
    up to 0.6.6, ``["12.0f"]`` from 0.6.7 where nvcc is 12.9 or later); None where it cannot say.
    ``build`` gets the same answer from its proof."""
    env = {k: v for k, v in os.environ.items() if k != "FLASHINFER_CUDA_ARCH_LIST"}
    # As root on another user's environment, its interpreter runs as that user (sm120patch.runas).
    events, _ = _run(python, {"spec": "", "phase": "sm120"}, env, runas.environment_owner(python).popen_args(), None)
    return events.get("sm120")


def _remove_partial(events: dict, base: Path, module: str) -> bool:
    """The entry a build that did not finish leaves (build.ninja, .d and object files, no
    library), which FlashInfer would take for its own at the next start, and status for a
    built one. An entry that had its library before this build is left as it was: the build
    did not make it. The build (the target's code, run as the cache's owner) says where its
    entry is: only a path of the form FlashInfer gives it, ``<base>/.cache/flashinfer/<version>/
    <archs>/cached_ops/<module>``, is removed, by directory descriptor (sm120patch.dirfd)."""
    where = events.get("build_dir")
    if not where or events.get("had_library") or Path(events.get("library") or where).is_file():
        return False
    entry = Path(os.path.normpath(os.path.join(base, where)))
    cache = Path(os.path.normpath(base)) / ".cache" / "flashinfer"
    if not (entry.is_relative_to(cache) and len(entry.relative_to(cache).parts) == 4
            and entry.parent.name == "cached_ops" and entry.name == module):
        return False
    dirfd.rmtree(entry)
    return True


def _missing_libraries(tail: list[str]) -> list[str]:
    """The -l libraries the linker said it cannot find (ld: "cannot find -lcuda")."""
    return sorted(set(re.findall(r"cannot find -l([\w.+-]+)", "\n".join(tail))))


def _ninja_cuda_home(build_dir: Path) -> str | None:
    """The toolkit FlashInfer wrote into the entry's build.ninja (``cuda_home = ...``)."""
    try:
        found = re.search(r"^cuda_home = (.+)$", (build_dir / "build.ninja").read_text(), flags=re.M)
    except OSError:
        return None
    return found.group(1).strip() if found else None


def _link_with_stub(python: Path, spec: str, env: dict, run_as: dict, progress, build_dir: Path,
                    owner: Owner | None, events: dict) -> tuple[dict, list[str], str]:
    symbols = driver_symbols(sorted(build_dir.rglob("*.o")))
    with tempfile.TemporaryDirectory(prefix="sm120patch-libcuda-") as scratch:
        directory = Path(scratch)
        build_stub(symbols, directory)
        if run_as:  # the build runs as the cache base's owner: the stub must be theirs to read
            for path in (directory, *directory.iterdir()):
                os.chown(path, owner.uid, owner.gid)
        search = os.pathsep.join(filter(None, [scratch, env.get("LIBRARY_PATH")]))
        events.pop("error", None)
        events.pop("kind", None)
        events, tail = _run(python, {"spec": spec, "phase": "build"}, dict(env, LIBRARY_PATH=search), run_as, progress,
                            events)
    calls = (f"the {counted(len(symbols), 'driver function')} the objects call, soname libcuda.so.1" if symbols else
             "the objects call no driver function: the linker records no libcuda, as with the real driver")
    why = (f"linked against a libcuda stub sm120patch made for this link alone ({calls}; then removed): the link "
           "found no CUDA driver and no toolkit stub here" + (". The module records NEEDED libcuda.so.1: the GPU "
                                                               "server's driver is what loads" if symbols else ""))
    return events, tail, why


# -- libcuda for the link ----------------------------------------------------------------------
#
# FlashInfer links every JIT module with `-L$cuda_home/lib64 -L$cuda_home/lib64/stubs -lcuda`.
# A GPU-less build machine whose toolkit has no stub (PyPI's nvidia-cuda-* wheels, a runtime
# image) has no libcuda at all: every object compiles, then the link fails. The linker needs
# only a file named libcuda.so that defines the driver functions the objects call and names
# itself libcuda.so.1 (DESIGN.md section 9): the module then records what it would against the
# real library (`NEEDED libcuda.so.1` when it calls the driver at all; trtllm_comm's objects do
# not), and the GPU server's driver is what loads. sm120patch
# builds such a stub only after the link failed for want of one, from the objects' own
# undefined cu* symbols, in a temporary directory it removes, and hands it to the linker by
# LIBRARY_PATH (the compiler driver's search path): unlike FLASHINFER_EXTRA_LDFLAGS it leaves
# build.ninja as the server will generate it, so the server's first start relinks nothing.

CUDA_ERROR_NO_DEVICE = 100
_DRIVER_SYMBOL = re.compile(r"^cu[A-Z]\w*$")  # the driver API (cuInit, cuMemAlloc_v2); cudart is cuda*


class Libcuda(NamedTuple):
    kind: str  # "driver" | "toolkit stub" | "none"
    path: Path | None
    cuda_home: Path

    def describe(self) -> str:
        if self.kind == "none":
            return (f"none: no CUDA driver and no stub in {self.cuda_home}/lib64/stubs; a build here (apply --build) "
                    "links against a stub sm120patch makes for it")
        return f"the {'CUDA driver' if self.kind == 'driver' else 'CUDA toolkit stub'} {self.path}"


def cuda_home() -> Path:
    """The toolkit FlashInfer's JIT uses (flashinfer.jit.cpp_ext.get_cuda_path's rule): $CUDA_HOME,
    $CUDA_PATH, two levels above the nvcc on PATH, else /usr/local/cuda."""
    given = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if given:
        return Path(given)
    nvcc = shutil.which("nvcc")
    return Path(nvcc).parent.parent if nvcc else Path("/usr/local/cuda")


def libcuda_for_link(home: Path | None = None) -> Libcuda:
    """Which libcuda FlashInfer's link would take here: asked of the linker itself (a link of an
    empty library with FlashInfer's -L flags and -lcuda, traced)."""
    home = home or cuda_home()
    cxx = os.environ.get("CXX", "c++")
    with tempfile.TemporaryDirectory(prefix="sm120patch-link-") as scratch:
        try:
            proc = subprocess.run([cxx, "-shared", "-x", "c", os.devnull, f"-L{home}/lib64", f"-L{home}/lib64/stubs",
                                   "-lcuda", "-Wl,--trace", "-o", str(Path(scratch) / "probe.so")],
                                  capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return Libcuda("none", None, home)
    found = re.search(r"(/\S*libcuda\.so[.\d]*)", proc.stdout + proc.stderr) if proc.returncode == 0 else None
    if found is None:
        return Libcuda("none", None, home)
    path = Path(found.group(1))
    return Libcuda("toolkit stub" if "stubs" in path.parts else "driver", path, home)


def driver_symbols(objects: list[Path]) -> list[str]:
    """The CUDA driver functions ``objects`` call and do not define."""
    if not objects:
        return []
    try:
        proc = subprocess.run(["nm", "--undefined-only", "--format=just-symbols", *map(str, objects)],
                              capture_output=True, text=True)
    except OSError as exc:  # after apply's commit: the patch stands, and the error must not say otherwise
        raise CheckFailedError(f"cannot read which driver functions the objects call: nm: {exc.strerror}",
                               hint="install binutils (it provides nm), then run the command again") from None
    if proc.returncode:
        raise CheckFailedError(f"nm could not read the objects: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    return sorted({name for name in proc.stdout.split() if _DRIVER_SYMBOL.match(name)})


def build_stub(symbols: list[str], directory: Path) -> Path:
    """``directory``/libcuda.so: each of ``symbols`` a function that answers "no device", and
    the soname libcuda.so.1 (what the real library names itself, so what the module records)."""
    source = directory / "libcuda_stub.c"
    source.write_text("/* sm120patch: a link-time stand-in for the CUDA driver; never loaded. */\n"
                      + "".join(f"int {name}(void) {{ return {CUDA_ERROR_NO_DEVICE}; }}\n" for name in symbols))
    library = directory / "libcuda.so"
    compiler = os.environ.get("CC", "cc")
    try:
        proc = subprocess.run([compiler, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(library), str(source)],
                              capture_output=True, text=True)
    except OSError as exc:
        raise CheckFailedError(f"could not build a libcuda stub for the link with {compiler}: {exc.strerror}",
                               hint="install a C compiler (or set CC to one), then run the command again") from None
    if proc.returncode:
        raise CheckFailedError(f"could not build a libcuda stub for the link with {compiler}: "
                               f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    return library


def _run_as(owner: Owner | None) -> dict:
    """As root for another user's cache base: build as that user, so the entry, its lock and
    its directories are theirs (the server takes FlashInfer's lock in there)."""
    if owner is not None and os.geteuid() == 0 and owner.uid != 0:
        return {"user": owner.uid, "group": owner.gid, "extra_groups": []}
    return {}


def _run(python: Path, request: dict, env: dict, run_as: dict,
         progress: Callable[[str, int, int], None] | None, events: dict | None = None) -> tuple[dict, list[str]]:
    """Run one phase in the target interpreter. ``events`` (filled as they arrive) is the
    caller's, so that what the build had said (its entry) is known even when a signal ends it.

    The build runs in a process group of its own (a new session, start_build): a SIGTERM sent to
    sm120patch alone (systemd, Ansible) would otherwise leave FlashInfer's ninja and its nvcc
    running with parent PID 1, writing into the cache after sm120patch exited (a SIGKILL, which
    sm120patch never sees, ends it by the parent-death signal); and a Ctrl-C reaches
    sm120patch only, which ends the build itself, waits for it and then reports (never a
    traceback from the target's interpreter). On any exception here (a signal, an I/O error)
    the whole group, and whatever it started in groups of its own (ninja puts each compiler
    in one), is ended before the exception goes on."""
    events = {} if events is None else events
    tail: deque[str] = deque(maxlen=20)
    proc = start_build(python, _SCRIPT, [json.dumps(request)], env, run_as, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line.startswith("@@sm120patch "):
                events.update(json.loads(line[len("@@sm120patch "):]))
                continue
            tail.append(line)
            step = _STEP.match(line)
            if step and progress:
                progress(line, int(step.group(1)), int(step.group(2)))
        proc.wait()
    except BaseException:
        with signals.held():  # a second Ctrl-C must not cut the cleanup short
            end_group(proc)
        raise
    finally:
        proc.stdout.close()
    if proc.returncode and "error" not in events:
        events["error"] = f"the build process exited with {proc.returncode}"
    return events, list(tail)


GRACE_S = 5.0  # how long the build has to stop after SIGTERM before it is killed


def end_group(proc: subprocess.Popen, grace: float = GRACE_S) -> None:
    """End ``proc`` (a session leader), its process group and every process below it: SIGTERM
    (ninja passes it on to its compilers' groups), then SIGKILL to whatever is left after
    ``grace`` seconds; return once they are gone."""
    import signal

    doomed: set[int] = set()
    for how, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        if proc.poll() is None:  # (what it started since the last look, while it can still be found)
            doomed |= _descendants(proc.pid) | {proc.pid}
        doomed = {pid for pid in doomed if _alive(pid)}
        groups = {proc.pid} | {g for g in map(_pgid, doomed) if g is not None and g != os.getpgrp()}
        for group in groups:
            try:
                os.killpg(group, how)
            except OSError:  # gone already, or not ours to signal
                pass
        for pid in doomed:
            try:
                os.kill(pid, how)
            except OSError:
                pass
        deadline = time.monotonic() + wait
        while doomed and time.monotonic() < deadline:
            proc.poll()  # reaps our child, so that it stops counting as alive
            doomed = {pid for pid in doomed if _alive(pid)}
            if doomed:
                time.sleep(0.05)
        if not doomed:
            break
    proc.wait()


def _descendants(root: int) -> set[int]:
    """Every process below ``root`` (read from /proc: the build's ninja and compilers)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None:
                children.setdefault(int(stat[3]), []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields from the state on (the name, in parentheses, may hold spaces)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return ["", ""] + text[text.rindex(")") + 2:].split()


def _pgid(pid: int) -> int | None:
    stat = _stat(pid)
    return int(stat[4]) if stat else None


def _alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[2] not in ("Z", "X")  # a zombie has stopped: only its parent's wait is left
