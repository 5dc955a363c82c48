"""`sm120patch build` and `apply --build`: FlashInfer's own JIT build of trtllm_comm into the
server's JIT cache. Here (no GPU, no CUDA driver) the paths up to the build and its failures;
the build itself, and the first use after it, are measured on the H200 (docs/h200.md)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import (ROOT, ServingEnv, Session, changed, one_clear_error, readelf_dynamic, snapshot, tree_snapshot,
                     undefined)
from sm120patch.errors import ExitCode
from sm120patch.jitbuild import arch_note, parse_arch
from sm120patch.errors import UsageError


@pytest.mark.parametrize("text, wanted", [("12.0a", "12.0a"), ("9.0a,12.0a", "9.0a 12.0a"), (" 9.0a  12.0a ", "9.0a 12.0a"),
                                          ("10.0f", "10.0f")])
def test_arch_lists_are_flashinfers_form(text, wanted):
    assert parse_arch(text) == wanted


def test_a_missing_nm_or_compiler_for_the_stub_is_one_check_failure_not_an_os_error(tmp_path, monkeypatch):
    """These run after apply's commit: an OSError there would be reported as "nothing was
    changed", which is false then. Each is a failed check with what to install."""
    from sm120patch.errors import CheckFailedError
    from sm120patch.jitbuild import build_stub, driver_symbols

    objects = tmp_path / "a.o"
    objects.write_bytes(b"")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(CheckFailedError, match="nm: No such file or directory") as nm:
        driver_symbols([objects])
    assert "install binutils" in nm.value.hint
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(CheckFailedError, match="no-such-cc: No such file or directory") as cc:
        build_stub(["cuInit"], tmp_path)
    assert "install a C compiler" in cc.value.hint


@pytest.mark.parametrize("text", ["", "12", "sm_120a", "12.0a;9.0a"])
def test_a_bad_arch_list_is_a_usage_error(text):
    with pytest.raises(UsageError, match="not a list of compute capabilities"):
        parse_arch(text)


def test_build_refuses_unpatched_sources_and_changes_nothing(read_only_cli, read_only_env):
    before = snapshot(read_only_env)
    result = read_only_cli("build")
    assert result.exit_code == ExitCode.REFUSED
    one_clear_error(result.output, "flashinfer-python 0.6.4 is not patched")
    # The hint names this target and the cache base given, so it works when copied as printed.
    assert (f"hint: run `sm120patch apply --build --python {read_only_env.python} --jit-cache-base {read_only_env.home}`"
            in result.output)
    assert changed(before, snapshot(read_only_env)) == []


def test_dry_run_never_builds(sm120patch, serving_env):
    before = snapshot(serving_env)
    result = sm120patch("apply", "--build", "--dry-run")
    assert result.exit_code == 0 and "built trtllm_comm" not in result.output
    assert changed(before, snapshot(serving_env)) == []


def test_what_the_build_needs_is_checked_before_the_first_write_and_before_it_is_announced(sm120patch, serving_env):
    """#55 item 6: no torch in the target: apply --build refuses before it patches (exit 2, the
    environment byte for byte as it was), build refuses before it says it is building, and
    verify --build says NOT RUN with the reason, on an unpatched environment without starting a build."""
    before = snapshot(serving_env)
    result = sm120patch("apply", "--build", "--arch", "12.0a")
    assert result.exit_code == ExitCode.USAGE
    one_clear_error(result.output, f"cannot build trtllm_comm: torch is not importable in {serving_env.python}")
    assert "nothing was changed" in result.output and "patched" not in result.output
    assert changed(before, snapshot(serving_env)) == []
    unpatched = sm120patch("verify", "--build")
    assert unpatched.exit_code == ExitCode.NOT_OK and "building" not in unpatched.output
    assert "NOT RUN  build    trtllm_comm JIT build (12.0a): not run: flashinfer-python 0.6.4 is not patched" in unpatched.output
    assert changed(before, snapshot(serving_env)) == []
    assert sm120patch("apply").exit_code == ExitCode.OK
    patched = snapshot(serving_env)
    built = sm120patch("build", "--arch", "12.0a")
    assert built.exit_code == ExitCode.USAGE and "building trtllm_comm" not in built.output
    one_clear_error(built.output, "cannot build trtllm_comm: torch is not importable")
    verified = sm120patch("verify", "--build")
    assert verified.exit_code == ExitCode.NOT_OK
    assert "trtllm_comm JIT build (12.0a): not run: torch is not importable in" in verified.output
    assert "ModuleNotFoundError" not in verified.output
    assert changed(patched, snapshot(serving_env)) == []


def test_no_gpu_and_no_arch_says_to_pass_arch(runtime_env):
    session = Session(runtime_env)
    assert session("apply", "--flashinfer").exit_code == 0
    try:
        result = session("build")
        assert result.exit_code == ExitCode.USAGE
        one_clear_error(result.output, "cannot tell which GPUs to build trtllm_comm for: no GPU is visible")
        assert "--arch 12.0a" in result.output
    finally:
        assert session("revert").exit_code == 0


def failing_cuda_home(tmp_path) -> Path:
    """A CUDA home whose nvcc is there (what the build checks before it starts) and fails every
    compile: the build starts and fails in FlashInfer's ninja run."""
    home = tmp_path / "failing-cuda"
    (home / "bin").mkdir(parents=True)
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'nvcc: a stand-in that compiles nothing' >&2\nexit 1\n")
    nvcc.chmod(0o755)
    return home


def test_a_failed_build_leaves_no_half_written_entry(runtime_env, monkeypatch, tmp_path):
    """The compiler is missing: FlashInfer's ninja run fails; exit 1, its last lines shown, and
    the cache entry the build had started is gone."""
    session = Session(runtime_env)
    assert session("apply", "--flashinfer").exit_code == 0
    monkeypatch.setenv("CUDA_HOME", str(failing_cuda_home(tmp_path)))
    monkeypatch.setenv("PATH", f"{runtime_env.root / 'bin'}:/usr/bin:/bin")
    try:
        result = session("build", "--arch", "12.0a")
        assert result.exit_code == ExitCode.NOT_OK, result.output
        one_clear_error(result.output, "FlashInfer's JIT build of trtllm_comm failed")
        assert "the half-built entry was removed" in result.output
        assert not runtime_env.jit_entry("120a", "trtllm_comm").exists()
    finally:
        monkeypatch.undo()
        assert session("revert").exit_code == 0


def test_verify_build_reports_a_failed_build(runtime_env, monkeypatch, tmp_path):
    """`verify --build` through the CLI: FlashInfer's build in a temporary workspace; without a
    compiler it fails, and verify says so (exit 1) and leaves the server's cache alone."""
    session = Session(runtime_env)
    assert session("apply", "--flashinfer").exit_code == 0
    before = snapshot(runtime_env)
    monkeypatch.setenv("CUDA_HOME", str(failing_cuda_home(tmp_path)))
    monkeypatch.setenv("PATH", f"{runtime_env.root / 'bin'}:/usr/bin:/bin")
    try:
        result = session("verify", "--build")
        assert result.exit_code == ExitCode.NOT_OK
        assert "FAIL  build" in result.output and "trtllm_comm JIT build (12.0a)" in result.output
        assert changed(before, snapshot(runtime_env)) == []
    finally:
        monkeypatch.undo()
        assert session("revert").exit_code == 0


def test_a_stub_links_like_the_driver_and_defines_nothing_of_cudart(tmp_path):
    """The stub, on a small object that calls the driver and the runtime: the library linked
    against it records NEEDED libcuda.so.1 (the soname), leaves cuInit undefined for the real
    driver to provide at load, and the stub defines no cuda* (runtime) function."""
    import subprocess

    from sm120patch.jitbuild import build_stub, driver_symbols

    source = tmp_path / "user.c"
    source.write_text("int cuInit(unsigned); int cuMemAlloc_v2(void *, unsigned long); int cudaMalloc(void **, unsigned long);\n"
                      "int use(void) { void *p; return cuInit(0) + cuMemAlloc_v2(&p, 1) + cudaMalloc(&p, 1); }\n")
    obj = tmp_path / "user.o"
    subprocess.run(["cc", "-c", "-fPIC", "-o", str(obj), str(source)], check=True)
    symbols = driver_symbols([obj])
    assert symbols == ["cuInit", "cuMemAlloc_v2"]
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    stub = build_stub(symbols, stubs)
    assert readelf_dynamic(stub)[1] == ["libcuda.so.1"]
    library = tmp_path / "libuser.so"
    subprocess.run(["cc", "-shared", "-o", str(library), str(obj), f"-L{stubs}", "-lcuda", "-Wl,--allow-shlib-undefined"],
                   check=True)
    assert "libcuda.so.1" in readelf_dynamic(library)[0]
    assert {"cuInit", "cuMemAlloc_v2", "cudaMalloc"} <= undefined(library)
    assert "cudaMalloc" not in subprocess.run(["nm", "-D", "--defined-only", str(stub)], capture_output=True,
                                              text=True, check=True).stdout


def test_which_libcuda_a_build_would_link_is_the_linkers_answer(tmp_path, monkeypatch):
    """A toolkit with a stub is named as the toolkit stub; without one (and no driver here), none:
    the linker is asked, with FlashInfer's own -L flags."""
    from sm120patch.jitbuild import build_stub, libcuda_for_link

    with_stub = tmp_path / "cuda-with-stub"
    (with_stub / "lib64" / "stubs").mkdir(parents=True)
    build_stub(["cuInit"], with_stub / "lib64" / "stubs")
    found = libcuda_for_link(with_stub)
    assert found.kind == "toolkit stub" and found.path == with_stub / "lib64" / "stubs" / "libcuda.so"
    assert "CUDA toolkit stub" in found.describe()
    bare = tmp_path / "cuda-bare"
    (bare / "lib64").mkdir(parents=True)
    baseline = libcuda_for_link(bare)
    if baseline.kind == "none":  # this machine: no driver on the linker's default path
        assert "a stub sm120patch makes for it" in baseline.describe()
    else:
        assert baseline.kind == "driver"
    monkeypatch.setenv("CUDA_HOME", str(with_stub))
    from sm120patch.jitbuild import cuda_home

    assert cuda_home() == with_stub


def test_a_plain_arch_of_sm90_or_later_is_named_as_the_server_would_miss_it():
    assert parse_arch("12.0") == "12.0"  # a valid list: FLASHINFER_CUDA_ARCH_LIST=12.0 is the user's call
    note = arch_note("9.0a 12.0")
    assert "builds for '9.0a 12.0a'" in note and "--arch '9.0a 12.0a'" in note
    assert arch_note("12.0a") is None and arch_note("8.0 8.6") is None and arch_note(None) is None


@pytest.mark.parametrize("arch, sm120, found", [
    ("12.0a", ["12.0a"], None),  # FlashInfer up to 0.6.6: the server looks up this very entry
    ("12.0a", ["12.0f"], "'12.0f'"),  # 0.6.7+ with nvcc 12.9+: another directory (120f)
    ("12.0f", ["12.0f"], None),
    ("9.0a 12.0a", ["12.0a"], "'12.0a'"),  # a list of several: its own directory (90a_120a)
    ("9.0a", ["12.0f"], None),  # not built for SM120: nothing to say about SM120 servers
    ("12.0a", None, None),  # FlashInfer could not say (an old release, no nvcc): no guess
])
def test_an_sm120_arch_other_than_flashinfers_own_is_named_with_both_ways_out(arch, sm120, found):
    note = arch_note(arch, sm120)
    if found is None:
        assert note is None
        return
    assert f"builds for {found}" in note and f"FLASHINFER_CUDA_ARCH_LIST={arch!r}" in note
    assert note.endswith(f"else use --arch {found}")
    assert ("SGLang 0.5.4.post3 and later set it themselves" in note) is (arch == "12.0a")


# What FlashInfer's own code derives, in the serving environment's interpreter: the JIT cache
# directory and nvcc's arch flags, once from two detected SM120 GPUs (torch's answer is the
# only thing replaced; there is no SM120 GPU here) and once from the list `--arch 12.0a` sets.
_DERIVED = """
import json, sys, torch
if sys.argv[1] == "detected":
    torch.cuda.device_count = lambda: 2
    torch.cuda.get_device_capability = lambda device=None: (12, 0)
import flashinfer.jit.env as env
from flashinfer.compilation_context import CompilationContext
print(json.dumps([str(env.FLASHINFER_JIT_DIR), CompilationContext().get_nvcc_flags_list([9, 10, 12])]))
"""


def test_an_image_build_for_12_0a_lands_where_an_sm120_server_looks(runtime_env, tmp_path):
    import json
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHINFER_")}
    env["FLASHINFER_WORKSPACE_BASE"] = str(tmp_path)
    derived = {}
    for how, extra in (("detected", {}), ("--arch", {"FLASHINFER_CUDA_ARCH_LIST": parse_arch("12.0a")})):
        out = subprocess.run([str(runtime_env.python), "-c", _DERIVED, how], env=dict(env, **extra),
                             capture_output=True, text=True, check=True).stdout
        derived[how] = json.loads(out.splitlines()[-1])
    assert derived["detected"] == derived["--arch"]
    jit_dir, flags = derived["--arch"]
    assert jit_dir.endswith("/120a/cached_ops") and "-gencode=arch=compute_120a,code=sm_120a" in flags


class _Terminal:
    """stderr that is (or is not) a terminal (CliRunner's is not one), collecting what is drawn."""

    def __init__(self, tty: bool):
        self.tty = tty
        self.text = []

    def isatty(self):
        return self.tty

    def write(self, text):
        self.text.append(text.decode() if isinstance(text, bytes) else text)

    def flush(self):
        pass


@pytest.mark.parametrize("tty, quiet, drawn", [(True, False, True), (False, False, False), (True, True, False)])
def test_ninja_steps_become_a_bar_on_a_terminal_and_plain_lines_elsewhere(monkeypatch, tty, quiet, drawn):
    """The start is said at once (ninja's first step can take minutes); then a bar on a
    terminal, one plain line per step elsewhere (systemd, Ansible), nothing with --json."""
    import sys

    from sm120patch.progress import BuildProgress

    terminal = _Terminal(tty)
    monkeypatch.setattr(sys, "stderr", terminal)
    with BuildProgress(quiet=quiet) as progress:
        progress("building trtllm_comm with FlashInfer's JIT ...", 0, 0)
        for step in (1, 2, 3, 4):
            progress(f"[{step}/4] nvcc ...", step, 4)
    shown = "".join(terminal.text)
    if quiet:
        assert shown == ""
        return
    assert shown.startswith("sm120patch: building trtllm_comm with FlashInfer's JIT ...\n")
    assert ("building trtllm_comm" in shown.split("\n", 1)[1] and "4/4" in shown) == drawn  # the bar's own label
    if not drawn:
        assert shown.splitlines()[1:] == [f"sm120patch: build step {n}/4: nvcc ..." for n in (1, 2, 3, 4)]


# The one test that needs a CUDA GPU: CI has none and skips it, saying why. On the H200:
# `bash benchmarks/h200_session.sh gpu-test` (docs/h200.md).
GPU_PYTHON = os.environ.get("SM120PATCH_GPU_PYTHON")


@pytest.mark.gpu
@pytest.mark.skipif(not GPU_PYTHON, reason="needs a CUDA GPU and a serving interpreter with CUDA torch and the real "
                    "flashinfer-python 0.6.4 / sglang 0.5.9 wheels: set SM120PATCH_GPU_PYTHON "
                    "(benchmarks/h200_session.sh gpu-test makes one on the lent H200)")
def test_on_a_gpu_the_first_use_after_apply_build_compiles_nothing(tmp_path):
    import json
    import subprocess

    env = ServingEnv(Path(GPU_PYTHON).parent.parent, tmp_path / "home")
    env.home.mkdir()
    session = Session(env)
    before = tree_snapshot(env.root)  # the cache base keeps what FlashInfer itself writes there (locks, logs)
    result = session("apply", "--build")
    try:
        assert result.exit_code == 0, result.output
        assert "built trtllm_comm for " in result.output and "the library loaded" in result.output
        first = subprocess.run([str(env.python), str(ROOT / "benchmarks" / "first_use.py")], capture_output=True,
                               text=True, check=True, env=dict(os.environ, FLASHINFER_WORKSPACE_BASE=str(env.home)))
        used = json.loads(first.stdout.splitlines()[-1])
        assert used["compiled"] is False, used
        library = Path(used["library"])
        assert library.is_relative_to(env.home / ".cache" / "flashinfer")
    finally:
        assert session("revert").exit_code == 0
    assert changed(before, tree_snapshot(env.root)) == []
    assert not library.parent.exists()  # revert removed the entry built from the patched sources


def test_the_link_errors_name_each_missing_library():
    """Only a link that misses libcuda alone gets the stub; one that misses the runtime too (a
    CUDA home that is not the toolkit's root) is told to set CUDA_HOME."""
    from sm120patch.jitbuild import _missing_libraries

    both = ["/usr/bin/ld: cannot find -lcudart: No such file or directory",
            "/usr/bin/ld: cannot find -lcuda: No such file or directory", "collect2: error: ld returned 1 exit status"]
    assert _missing_libraries(both) == ["cuda", "cudart"]
    assert _missing_libraries(both[1:]) == ["cuda"]
    assert _missing_libraries(["ninja: build stopped: subcommand failed."]) == []


# -- an interrupted build (issue 38, item 2) ---------------------------------------------------

# A stand-in for nvcc in a CUDA home of its own: `--version` answers as CUDA 12.8 does (FlashInfer
# asks it while it writes build.ninja); a compile writes its pid, then keeps touching a marker
# file and never finishes, as a compile of minutes looks from outside. FlashInfer, its
# build.ninja and the real ninja (the environment's own) run it as they run nvcc.
_SLOW_NVCC = """#!/bin/sh
case "$*" in *--version*)
  echo "nvcc: NVIDIA (R) Cuda compiler driver"
  echo "Cuda compilation tools, release 12.8, V12.8.93"; exit 0;;
esac
echo $$ >> {pids}
while :; do touch {marker}; sleep 0.1; done
"""


def _slow_cuda_home(tmp_path: Path) -> tuple[Path, Path, Path]:
    home, pids, marker = tmp_path / "slow-cuda", tmp_path / "nvcc.pids", tmp_path / "nvcc.alive"
    (home / "bin").mkdir(parents=True)
    (home / "lib64").mkdir()
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text(_SLOW_NVCC.format(pids=pids, marker=marker))
    nvcc.chmod(0o755)
    return home, pids, marker


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie has stopped: only its parent's wait is left)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rindex(")") + 2] not in "ZX"


def _slow_build(runtime_env: ServingEnv, tmp_path: Path, command: str):
    """`command` (build, or verify --build) started on the patched runtime environment with the
    stand-in nvcc that never finishes: the session, the process (a group of its own), and the
    stand-in's pid file and marker."""
    import subprocess
    import sys

    from helpers import sm120patch_argv

    session = Session(runtime_env)
    assert session("apply", "--flashinfer").exit_code == 0
    cuda, pids, marker = _slow_cuda_home(tmp_path)
    env = dict(os.environ, CUDA_HOME=str(cuda), PATH=f"{runtime_env.root / 'bin'}:/usr/bin:/bin")
    argv = (sm120patch_argv(runtime_env, "build", "--arch", "12.0a") if command == "build" else
            [sys.executable, "-m", "sm120patch", "verify", "--python", str(runtime_env.python), "--build"])
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    return session, proc, pids, marker


def _wait_for_the_compiler(proc, pids: Path) -> None:
    import time

    deadline = time.monotonic() + 240
    while not (pids.exists() and pids.read_text().strip()) and proc.poll() is None:
        assert time.monotonic() < deadline, "the stand-in compiler never started"
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()


@pytest.mark.parametrize("command, signal_name, whom", [("build", "SIGTERM", "sm120patch"),
                                                       ("build", "SIGINT", "its process group"),
                                                       ("verify --build", "SIGTERM", "sm120patch")])
def test_a_signal_during_build_ends_the_compiler_and_leaves_no_partial_entry(runtime_env, tmp_path, command, signal_name,
                                                                             whom):
    """`build` (and `verify --build`, in its temporary workspace) while nvcc runs: SIGTERM to
    the sm120patch process alone (systemd, Ansible), or SIGINT to its whole process group
    (Ctrl-C at a terminal). No compiler may outlive sm120patch (none of the stand-in's pids runs
    when it has exited, and its marker stops changing), the exit code is the signal's, and the
    entry FlashInfer had started (build.ninja, no trtllm_comm.so) is gone: status finds no
    entry, where it used to call the partial one "current"."""
    import signal
    import time

    session, proc, pids, marker = _slow_build(runtime_env, tmp_path, command)
    entry = runtime_env.jit_entry("120a", "trtllm_comm")
    try:
        _wait_for_the_compiler(proc, pids)
        assert (entry / "build.ninja").exists() or command != "build"  # FlashInfer had started the entry
        signum = getattr(signal, signal_name)
        if whom == "sm120patch":
            proc.send_signal(signum)
        else:
            os.killpg(proc.pid, signum)
        out, err = proc.communicate(timeout=60)
        compilers = [int(p) for p in pids.read_text().split()]
        alive = [p for p in compilers if _running(p)]
        seen = marker.stat().st_mtime_ns
        time.sleep(0.5)
        assert not alive and marker.stat().st_mtime_ns == seen, f"the compiler outlived sm120patch: {alive}"
        assert proc.returncode == 128 + signum, (proc.returncode, err)
        assert "Traceback" not in err and err.count("sm120patch: error:") + err.count("sm120patch: interrupted") == 1, err
        assert not entry.exists(), sorted(p.name for p in entry.iterdir())
        status = session("status")
        assert "current" not in status.output and "no trtllm_comm entries" in status.output, status.output
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in (int(p) for p in (pids.read_text().split() if pids.exists() else [])):
            if _running(pid):  # (before the fix: the stand-ins left running)
                os.kill(pid, signal.SIGKILL)
        assert session("revert").exit_code == 0


@pytest.mark.parametrize("command", ["build", "verify --build"])
def test_a_build_killed_outright_leaves_no_compiler_running(runtime_env, tmp_path, command):
    """SIGKILL to sm120patch while nvcc runs (the OOM killer, `kill -9`, a container runtime's
    timeout): sm120patch cannot act, yet FlashInfer's interpreter, ninja and the compiler end
    with it (the parent-death signal of the build's group leader), within seconds, and stop
    writing into the JIT cache; then nothing holds FlashInfer's lock, status calls the entry
    left incomplete (not "being built now"), and revert does not wait on the lock (before: all
    three kept running with parent PID 1, and revert gave up after 10 s, exit 4)."""
    import signal
    import time

    session, proc, pids, marker = _slow_build(runtime_env, tmp_path, command)
    entry = runtime_env.jit_entry("120a", "trtllm_comm")
    leaders = []
    try:
        _wait_for_the_compiler(proc, pids)
        leaders = [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
        assert leaders, "no build process under sm120patch"
        proc.kill()
        proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL
        compilers = [int(p) for p in pids.read_text().split()]
        deadline = time.monotonic() + 15
        while any(_running(p) for p in compilers + leaders) and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = [p for p in compilers + leaders if _running(p)]
        assert not alive, f"the build outlived sm120patch killed by SIGKILL: {alive}"
        seen = marker.stat().st_mtime_ns
        time.sleep(0.5)
        assert marker.stat().st_mtime_ns == seen, "the compiler still writes"
        if command == "build":
            status = session("status")
            assert f"{entry}: incomplete" in status.output and "being built" not in status.output, status.output
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in leaders + [int(p) for p in (pids.read_text().split() if pids.exists() else [])]:
            if _running(pid):  # (before the fix: the build left running)
                os.killpg(pid, signal.SIGKILL) if pid in leaders else os.kill(pid, signal.SIGKILL)
        reverted = session("revert")
        assert reverted.exit_code == 0, reverted.output


def test_only_what_an_unfinished_build_made_is_removed(tmp_path):
    """The entry of a build that did not finish goes; one that had its library before the build
    started (the build was only relinking or checking it) is left as it was, and so is one whose
    library the build had already written. The build (the target's code) names its entry: a
    path outside the cache base's form for the module is never removed (issue 61)."""
    from sm120patch.jitbuild import _remove_partial

    base = tmp_path / "home"

    def entry(name: str, library: bool) -> dict:
        where = base / ".cache" / "flashinfer" / "0.6.4" / name / "cached_ops" / "trtllm_comm"
        where.mkdir(parents=True)
        (where / "build.ninja").write_text("rule x\n")
        if library:
            (where / "trtllm_comm.so").write_bytes(b"\x7fELF")
        return {"build_dir": str(where), "library": str(where / "trtllm_comm.so")}

    def remove(events: dict) -> bool:
        return _remove_partial(events, base, "trtllm_comm")

    partial = entry("partial", library=False)
    assert remove(dict(partial, had_library=False)) and not Path(partial["build_dir"]).exists()
    kept = entry("had-its-library", library=True)
    assert not remove(dict(kept, had_library=True)) and Path(kept["library"]).exists()
    finished = entry("linked", library=True)
    assert not remove(dict(finished, had_library=False)) and Path(finished["library"]).exists()
    assert not remove({})  # interrupted before FlashInfer named its entry: nothing of it to remove
    elsewhere = tmp_path / "roots" / "trtllm_comm"  # a build that names another directory
    elsewhere.mkdir(parents=True)
    (elsewhere / "keep").write_text("root's")
    for named in (elsewhere, base / ".cache" / "flashinfer" / "0.6.4" / "x" / "cached_ops" / ".." / ".." / ".." / ".."
                  / ".." / ".." / "roots" / "trtllm_comm"):
        assert not remove({"build_dir": str(named), "had_library": False}) and (elsewhere / "keep").exists()