"""The container recipe (integrations/container/): its Dockerfile's steps run in order against the
real wheels installed the way the official SGLang and vLLM images install them (root, the system
interpreter's dist-packages, no venv), then the entrypoint wrapper in front of a stand-in server.
No container engine runs here: a private mount namespace puts an empty directory over the
system interpreter's first site directory, so the real system is never touched. Also: the
Dockerfile and the values snippets, read by well-kept parsers (dockerfile-parse, PyYAML)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from helpers import ROOT, jit_entry_at, need, readelf_dynamic, undefined
from test_synthetic import data_dir, toy  # noqa: F401 - the synthetic distribution's fixtures

CONTAINER = ROOT / "integrations" / "container"
SYSTEM_PYTHON = "/usr/bin/python3"


def dockerfile():
    from dockerfile_parse import DockerfileParser

    return DockerfileParser(str(CONTAINER / "Dockerfile"))


def test_the_dockerfile_declares_what_it_uses():
    """Every ${NAME} a step uses is an ARG declared after FROM (or an ENV); FROM takes the base
    image as a build argument; the steps are the ones the docs describe."""
    import re

    parsed = dockerfile()
    structure = [item for item in parsed.structure if item["instruction"] != "COMMENT"]
    kinds = [item["instruction"] for item in structure]
    assert kinds[0] == "ARG" and structure[0]["value"].startswith("BASE_IMAGE=")
    assert kinds[1] == "FROM" and structure[1]["value"] == "${BASE_IMAGE}"
    declared = {item["value"].split("=", 1)[0] for item in structure[2:] if item["instruction"] == "ARG"}
    declared |= {"PATH", "HOME"}
    for item in structure[2:]:
        used = set(re.findall(r"\$\{(\w+)", item["value"]))
        assert used <= declared, f"{item['instruction']} {item['value'][:60]}: {sorted(used - declared)} not declared"
    runs = [item["value"] for item in structure if item["instruction"] == "RUN"]
    assert "pip install" in runs[0] and "--target" in runs[0]
    assert runs[1].startswith("sm120patch apply") and "sm120patch verify" in runs[1]
    assert [c for c in kinds if c == "COPY"] == ["COPY"]


# Where each chart or runtime takes the container's command (production-stack takes none).
COMMANDS = {
    "production-stack.yaml": None,
    "vllm-chart.yaml": lambda d: d["image"]["command"],
    "kserve-servingruntime.yaml": lambda d: d["spec"]["containers"][0]["command"],
    "llm-d-modelservice.yaml": lambda d: d["decode"]["containers"][0]["command"],
    "ome-clusterservingruntime.yaml": lambda d: d["spec"]["engineConfig"]["runner"]["command"],
}


def test_every_values_snippet_is_named_here_and_in_the_doc():
    shipped = {path.name for path in (CONTAINER / "values").glob("*.yaml")}
    assert shipped == set(COMMANDS)
    doc = (ROOT / "docs" / "containers.md").read_text()
    assert all(f"values/{name}" in doc for name in shipped)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_the_values_snippets_are_yaml_with_the_image_or_the_wrapper(name):
    document = yaml.safe_load((CONTAINER / "values" / name).read_text())
    assert "-sm120" in json.dumps(document)  # the derived image
    if COMMANDS[name] is None:  # a chart without a command override: the image alone
        return
    command = COMMANDS[name](document)
    assert command[0] == "sm120patch-entrypoint"  # the wrapper first, then the server
    if command[1:2] == ["/bin/bash"]:  # a shell in between: it must exec the server, keeping its signals
        script = document["spec"]["engineConfig"]["runner"]["args"][0]
        assert script.lstrip().startswith("exec ")
    if name == "llm-d-modelservice.yaml":
        assert document["decode"]["containers"][0]["modelCommand"] == "custom"  # else the chart ignores command


def test_the_wrapper_and_launcher_are_valid_shell_and_python():
    assert subprocess.run(["sh", "-n", str(CONTAINER / "sm120patch-entrypoint")]).returncode == 0
    compile((CONTAINER / "sm120patch-launcher.in").read_text().replace("@HOME@", "/opt/x"), "launcher", "exec")


@pytest.mark.waits  # 13 s: past sm120patch's own 10 s lock wait, the bound the wrapper raises
def test_the_wrapper_waits_for_a_sibling_replicas_apply_then_starts(toy, tmp_path):
    """Two replicas on one shared site-packages: one is applying (it holds the install lock, here
    for 13 s, past sm120patch's own 10 s), the other's wrapper starts meanwhile. It waits for the
    sibling (the bound its header documents), then applies and starts the server, exit 0, the
    file patched (before: "apply failed (exit 4); not starting the server", exit 3)."""
    import fcntl
    import sys
    import time

    from toy import FILES

    entrypoint = CONTAINER / "sm120patch-entrypoint"
    assert "SM120PATCH_LOCK_WAIT" in entrypoint.read_text().split("set -eu")[0]  # the bound is documented
    comm = toy.site / FILES["toyfuse"][0]
    released = comm.read_bytes()
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:/usr/bin:/bin", HOME=str(toy.home),
               SM120PATCH_PYTHON=str(toy.venv / "bin" / "python"), SM120PATCH_JIT_CACHE_BASE=str(toy.home))
    env.pop("SM120PATCH_LOCK_WAIT", None)
    fd = os.open(toy.site, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the sibling's apply, as sm120patch holds it
    try:
        start = time.monotonic()
        proc = subprocess.Popen(["sh", str(entrypoint), "sh", "-c", "echo started"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(13)
        assert proc.poll() is None, proc.communicate()  # still waiting, not refused
    finally:
        os.close(fd)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and out.strip() == "started", (proc.returncode, out, err)
    assert time.monotonic() - start >= 13
    assert comm.read_bytes() != released  # patched by this replica once the sibling let go


# The image's build and its starts, each in a private mount namespace over the same directories.
# Each block appends one line of JSON the test reads; the Dockerfile's RUN steps come from the
# parsed Dockerfile.
PRELUDE = r"""
set -u
site="$1"; work="$2"; shift 2
# Where the system pip writes as root (/usr/local: the site directory, console scripts in bin/,
# data files such as man pages in share/) is an overlay whose writes land in this test's
# directory; the interpreter's first site directory is an empty directory of this test's.
mount -t overlay overlay -o "lowerdir=/usr/local,upperdir=$work/usr-local/upper,workdir=$work/usr-local/work" \
    /usr/local || exit 90
mount --bind "$work/dist-packages" "$site" || exit 90
export PATH=/usr/bin:/bin
export HOME="$work/root"
result() { printf '%s\n' "$1" >> "$work/results.jsonl"; }
status() { sm120patch status --python "$SYSTEM_PYTHON" --jit-cache-base "$JIT_CACHE_BASE" "$@"; }
"""

# The image: the serving packages installed by the system pip as root (the real wheels, and
# torch CPU with the few libraries FlashInfer's JIT build needs), then the Dockerfile's steps,
# the build among them, then status.
BUILD = PRELUDE + r"""
"$SYSTEM_PYTHON" -m pip install --quiet --no-deps --break-system-packages --no-compile "$@" || exit 91
"$SYSTEM_PYTHON" -m pip install --quiet --break-system-packages --no-compile -r "$work/runtime-requirements.txt" || exit 91
ls -A "$site" > "$work/site-before.txt"
COPY_SRC="$SM120PATCH_SRC"; mkdir -p "$COPY_SRC"; (cd "$REPO" && git ls-files -z | xargs -0 cp --parents -t "$COPY_SRC")
i=0
for step in "$work"/run-*.sh; do
    i=$((i+1))
    t0=$EPOCHREALTIME; sh -e "$step" > "$work/step-$i.out" 2>&1; rc=$?
    result "{\"step\": $i, \"rc\": $rc, \"started\": $t0, \"ended\": $EPOCHREALTIME}"
done
ls -A "$site" > "$work/site-after.txt"
export PATH="$SM120PATCH_HOME/bin:$PATH"
status --json > "$work/status.json"; result "{\"status_rc\": $?}"
"""

# The containers' starts. First the link again where the image's linker finds a libcuda (the
# test made one from the module's own driver calls), then the wrapper.
STARTS = PRELUDE + r"""
export PATH="$SM120PATCH_HOME/bin:$PATH"
rm "$ENTRY/trtllm_comm.so"
LIBRARY_PATH="$work/image-stubs" sm120patch build --python "$SYSTEM_PYTHON" --jit-cache-base "$JIT_CACHE_BASE" \
    --arch 12.0a > "$work/relink.out" 2>&1; result "{\"relink_rc\": $?}"
snap() { find "$site" "$SM120PATCH_HOME" "$JIT_CACHE_BASE" -newer "$work/mark" ! -type d | sort; }
touch "$work/mark"; sleep 1
# Already patched: the wrapper execs the server (same pid) with its exit code, and writes nothing.
t0=$EPOCHREALTIME; pids=$(sh -c 'echo $$; exec sm120patch-entrypoint sh -c "echo \$\$; exit 7"'); rc=$?
result "{\"patched_rc\": $rc, \"pids\": \"$(echo $pids)\", \"written\": \"$(snap | tr '\n' ' ')\", \"check\": [$t0, $EPOCHREALTIME]}"
# A layer above reinstalled FlashInfer (pristine again): the wrapper applies, then starts.
sm120patch revert --python "$SYSTEM_PYTHON" --jit-cache-base "$JIT_CACHE_BASE" > /dev/null 2>&1
result "{\"entry_after_revert\": $([ -e "$ENTRY" ] && echo true || echo false)}"
out=$(sm120patch-entrypoint sh -c 'echo started' 2>/dev/null); rc=$?
status > /dev/null 2>&1
result "{\"pristine_rc\": $rc, \"pristine_out\": \"$out\", \"status_after\": $?}"
# A file edited by hand: the patch cannot be applied; the server does not start, unless asked.
sm120patch revert --python "$SYSTEM_PYTHON" --jit-cache-base "$JIT_CACHE_BASE" > /dev/null 2>&1
echo '# edited' >> "$site/flashinfer/jit/comm.py"
out=$(sm120patch-entrypoint sh -c 'echo started' 2>"$work/refused.err"); rc=$?
result "{\"drift_rc\": $rc, \"drift_out\": \"$out\"}"
out=$(SM120PATCH_ON_FAILURE=warn sm120patch-entrypoint sh -c 'echo started' 2>"$work/warned.err"); rc=$?
result "{\"warn_rc\": $rc, \"warn_out\": \"$out\"}"
"""


def _outside(*paths: str) -> dict[str, tuple[int, int]]:
    """What the real system holds where pip writes (each file and directory: size, mtime)."""
    found = {}
    for top in paths:
        for root, dirs, files in os.walk(top):
            for name in dirs + files:
                path = os.path.join(root, name)
                stat = os.lstat(path)
                found[path] = (stat.st_size, stat.st_mtime_ns)
    return found


@pytest.mark.nvcc
def test_the_dockerfile_builds_a_patched_warm_image_and_the_wrapper_starts_it(tmp_path, flashinfer_wheel, sglang_wheel):
    """The official images' layout: root, the system interpreter, its dist-packages. The
    Dockerfile's steps, with its default build arguments, install sm120patch apart from the
    server's packages, apply and build trtllm_comm for 12.0a with no GPU and no driver (this
    machine's toolkit, assembled from PyPI's nvidia-cuda-* wheels, has no libcuda stub: the link
    is done against one sm120patch makes from the objects' driver calls); status then says
    patched, with the JIT entry built. The module records NEEDED libcuda.so.1 exactly when it
    calls the driver and leaves those calls undefined; where the image's linker finds a libcuda,
    the same link uses it. The wrapper: patched, it execs the server (one pid, its exit code)
    and writes nothing; after a reinstall it applies first (revert removed the entry); with a
    hand-edited file it refuses to start the server (exit 3), or starts it with
    SM120PATCH_ON_FAILURE=warn. Nothing of the real system changes."""
    from conftest import RUNTIME_REQUIREMENTS
    from sm120patch.jitbuild import build_stub, cuda_home, driver_symbols, libcuda_for_link
    from sm120patch.ptx import find_nvcc

    need(os.geteuid() == 0 and shutil.which("unshare") is not None, "needs root and unshare (a private mount namespace)")
    need(Path(SYSTEM_PYTHON).exists() and subprocess.run([SYSTEM_PYTHON, "-m", "pip", "--version"],
                                                          capture_output=True).returncode == 0,
         f"needs {SYSTEM_PYTHON} with pip (the system interpreter the images use)")
    need(find_nvcc() is not None, "nvcc not found (CUDA_HOME, PATH, /usr/local/cuda)")
    # The toolkit's root, as an image sets it (FlashInfer's guess, two levels above the nvcc on
    # PATH, is a wrapper script's directory here).
    roots = [r for r in (cuda_home(), Path("/usr/local/cuda")) if (r / "lib64" / "libcudart.so").exists()]
    need(bool(roots), "no CUDA toolkit root with lib64/libcudart.so")
    site = subprocess.run([SYSTEM_PYTHON, "-c", "import site; print(site.getsitepackages()[0])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    need(Path(site).is_dir(), f"{site} (the system interpreter's first site directory) does not exist")
    outside = ("/usr/local", site)
    before = _outside(*outside)
    work = tmp_path
    (work / "dist-packages").mkdir()
    for pth in Path(site).glob("*.pth"):  # what the machine itself needs there (certificates)
        shutil.copy2(pth, work / "dist-packages")
    (work / "usr-local" / "upper").mkdir(parents=True)
    (work / "usr-local" / "work").mkdir()
    args = {"SERVER_PYTHON": "python3", "JIT_CACHE_BASE": str(work / "root"),
            "SM120PATCH_HOME": str(work / "opt-sm120patch"), "SM120PATCH_APPLY_ARGS": "",
            "SM120PATCH_SRC": str(work / "src")}
    (work / "root").mkdir()
    parsed = dockerfile()
    defaults = {item["value"].split("=", 1)[0]: item["value"].split("=", 1)[1] for item in parsed.structure
                if item["instruction"] == "ARG" and "=" in item["value"]}
    args["SM120_ARCHS"] = defaults["SM120_ARCHS"]  # the image's default build
    assert args["SM120_ARCHS"] == "12.0a"
    runs = [item["value"] for item in parsed.structure if item["instruction"] == "RUN"]
    env_path = f"{args['SM120PATCH_HOME']}/bin:/usr/bin:/bin"  # the ENV line, as docker expands it
    for n, run in enumerate(runs, 1):
        exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in args.items())
        (work / f"run-{n}.sh").write_text(exports + f"export PATH={shlex.quote(env_path) if n > 1 else '/usr/bin:/bin'}\n"
                                          + run + "\n")
    (work / "runtime-requirements.txt").write_text("".join(f"{r}\n" for r in RUNTIME_REQUIREMENTS))
    env = dict(os.environ, SYSTEM_PYTHON=SYSTEM_PYTHON, REPO=str(ROOT), CUDA_HOME=str(roots[0]), **args)
    env.pop("VIRTUAL_ENV", None)

    def in_namespace(script: str, *argv: str, timeout: int) -> None:
        proc = subprocess.run(["unshare", "-m", "--propagation", "private", "bash", "-c", script, "sm120patch-image",
                               site, str(work), *argv], capture_output=True, text=True, env=env, timeout=timeout)
        assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])

    def results() -> dict:
        found = {}
        for line in (work / "results.jsonl").read_text().splitlines():
            found.update(json.loads(line))
        return found

    # The image build: the compile is minutes of every core; the bound is for a busy machine.
    in_namespace(BUILD, str(flashinfer_wheel), str(sglang_wheel), timeout=3600)
    steps = [json.loads(line) for line in (work / "results.jsonl").read_text().splitlines() if '"step"' in line]
    assert len(steps) == len(runs)
    for n, step in enumerate(steps, 1):
        assert step["rc"] == 0, (n, (work / f"step-{n}.out").read_text()[-3000:])
    # For docs/containers.md: what each step took here, and what the build adds to the image.
    print("\n" + "; ".join(f"RUN {s['step']}: {s['ended'] - s['started']:.1f} s" for s in steps))
    built = (work / f"step-{len(runs)}.out").read_text()
    assert "built trtllm_comm for 120a" in built, built[-3000:]
    # FlashInfer 0.6.4 builds 12.0a for an SM120 GPU it detects: the entry is the server's own, no note.
    assert "detects its GPUs" not in built, built[-3000:]
    stub_used = libcuda_for_link().kind == "none"
    assert ("linked against a libcuda stub sm120patch made for this link alone" in built) is stub_used, built[-3000:]

    assert results()["status_rc"] == 0
    status = json.loads((work / "status.json").read_text())
    states = {d["name"]: d["state"] for d in status["distributions"]}
    assert states == {"flashinfer-python": "patched", "sglang": "patched"}
    assert all(Path(d["location"]) == Path(site) for d in status["distributions"])
    flashinfer = next(d for d in status["distributions"] if d["name"] == "flashinfer-python")
    entry = jit_entry_at(Path(flashinfer["jit_cache"]["base"]), flashinfer["version"], "120a", "trtllm_comm")
    assert flashinfer["jit_cache"]["entries"] == [str(entry)], flashinfer["jit_cache"]
    assert not flashinfer["jit_cache"]["stale"] and not flashinfer["jit_cache"]["incomplete"]
    sglang = next(d for d in status["distributions"] if d["name"] == "sglang")
    jit_step = next(s for s in sglang["fusion"]["steps"] if s["id"] == "jit")
    assert jit_step["result"] == "ok" and jit_step["text"].endswith("for 120a") and jit_step["note"] is None, jit_step
    # sm120patch itself is not among the server's packages: the steps added only its state there.
    listed = {name: set((work / f"site-{name}.txt").read_text().split()) for name in ("before", "after")}
    assert listed["after"] - listed["before"] == {".sm120patch"} and listed["before"] <= listed["after"], listed

    print(f"the JIT entry: {sum(p.stat().st_size for p in entry.rglob('*') if p.is_file()) / 2**20:.1f} MiB "
          f"({len(list(entry.rglob('*')))} files and directories)")
    # The module links as the GPU server's driver expects.
    needed, _ = readelf_dynamic(entry / "trtllm_comm.so")
    calls = set(driver_symbols(sorted(entry.rglob("*.o"))))
    print(f"\ntrtllm_comm's objects call {len(calls)} driver function(s) directly: {sorted(calls)}; NEEDED {needed}")
    assert ("libcuda.so.1" in needed) == bool(calls) and "libcudart.so.13" in needed, needed
    assert calls <= undefined(entry / "trtllm_comm.so")
    assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob("sm120patch-libcuda-*"))  # the stub is gone
    (work / "image-stubs").mkdir()
    build_stub(sorted(calls), work / "image-stubs")

    env["ENTRY"] = str(entry)
    in_namespace(STARTS, timeout=1800)
    found = results()
    relink = (work / "relink.out").read_text()
    assert found["relink_rc"] == 0 and (entry / "trtllm_comm.so").exists() is False  # revert removed it since
    assert "stub sm120patch made" not in relink and "built trtllm_comm for 120a" in relink, relink[-2000:]
    print(f"the wrapper's check before the server, patched: {found['check'][1] - found['check'][0]:.2f} s")
    wrapper_pid, server_pid = found["pids"].split()
    assert found["patched_rc"] == 7 and wrapper_pid == server_pid  # exec: one process, its exit code
    assert found["written"] == ""  # the fast path writes nothing
    assert found["entry_after_revert"] is False
    assert found["pristine_rc"] == 0 and found["pristine_out"] == "started" and found["status_after"] == 0
    assert found["drift_rc"] == 3 and found["drift_out"] == ""
    assert "not starting the server" in (work / "refused.err").read_text()
    assert found["warn_rc"] == 0 and found["warn_out"] == "started"
    assert "starting the server anyway" in (work / "warned.err").read_text()
    assert _outside(*outside) == before  # the real system: not a file added, removed or changed
