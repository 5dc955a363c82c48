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

from helpers import ROOT, need

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


# The image's build and its starts, in one private mount namespace. Each block prints one line
# of JSON the test reads; the Dockerfile's RUN steps come from the parsed Dockerfile.
SCRIPT = r"""
set -u
site="$1"; work="$2"; shift 2
mount --bind "$work/dist-packages" "$site" || exit 90
export PATH=/usr/bin:/bin
export HOME="$work/root"
result() { printf '%s\n' "$1" >> "$work/results.jsonl"; }
"$SYSTEM_PYTHON" -m pip install --quiet --no-deps --break-system-packages --no-compile "$@" || exit 91
# The Dockerfile's steps, in order, with its build arguments.
COPY_SRC="$SM120PATCH_SRC"; mkdir -p "$COPY_SRC"; (cd "$REPO" && git ls-files -z | xargs -0 cp --parents -t "$COPY_SRC")
i=0
for step in "$work"/run-*.sh; do
    i=$((i+1))
    sh -e "$step" > "$work/step-$i.out" 2>&1; result "{\"step\": $i, \"rc\": $?}"
done
export PATH="$SM120PATCH_HOME/bin:$PATH"
sm120patch status --python "$SYSTEM_PYTHON" --jit-cache-base "$JIT_CACHE_BASE" --json > "$work/status.json"
result "{\"status_rc\": $?}"
snap() { find "$site" "$SM120PATCH_HOME" -type f -newer "$work/mark" | sort; }
touch "$work/mark"; sleep 1
# Already patched: the wrapper execs the server (same pid) with its exit code, and writes nothing.
pids=$(sh -c 'echo $$; exec sm120patch-entrypoint sh -c "echo \$\$; exit 7"'); rc=$?
result "{\"patched_rc\": $rc, \"pids\": \"$(echo $pids)\", \"written\": \"$(snap | tr '\n' ' ')\"}"
# A layer above reinstalled FlashInfer (pristine again): the wrapper applies, then starts.
sm120patch revert --python "$SYSTEM_PYTHON" --jit-cache-base "$JIT_CACHE_BASE" > /dev/null 2>&1
out=$(sm120patch-entrypoint sh -c 'echo started' 2>/dev/null); rc=$?
sm120patch status --python "$SYSTEM_PYTHON" --jit-cache-base "$JIT_CACHE_BASE" > /dev/null 2>&1
result "{\"pristine_rc\": $rc, \"pristine_out\": \"$out\", \"status_after\": $?}"
# A file edited by hand: the patch cannot be applied; the server does not start, unless asked.
sm120patch revert --python "$SYSTEM_PYTHON" --jit-cache-base "$JIT_CACHE_BASE" > /dev/null 2>&1
echo '# edited' >> "$site/flashinfer/jit/comm.py"
out=$(sm120patch-entrypoint sh -c 'echo started' 2>"$work/refused.err"); rc=$?
result "{\"drift_rc\": $rc, \"drift_out\": \"$out\"}"
out=$(SM120PATCH_ON_FAILURE=warn sm120patch-entrypoint sh -c 'echo started' 2>"$work/warned.err"); rc=$?
result "{\"warn_rc\": $rc, \"warn_out\": \"$out\"}"
"""


def test_the_dockerfile_steps_and_the_wrapper_in_a_system_install(tmp_path, flashinfer_wheel, sglang_wheel):
    """The official images' layout: root, the system interpreter, its dist-packages. The
    Dockerfile's steps install sm120patch apart from the server's packages and apply; status
    then says patched (exit 0). The wrapper: patched, it execs the server (one pid, its exit
    code) and writes nothing; after a reinstall it applies first; with a hand-edited file it
    refuses to start the server (exit 3), or starts it with SM120PATCH_ON_FAILURE=warn."""
    need(os.geteuid() == 0 and shutil.which("unshare") is not None, "needs root and unshare (a private mount namespace)")
    need(Path(SYSTEM_PYTHON).exists() and subprocess.run([SYSTEM_PYTHON, "-m", "pip", "--version"],
                                                          capture_output=True).returncode == 0,
         f"needs {SYSTEM_PYTHON} with pip (the system interpreter the images use)")
    site = subprocess.run([SYSTEM_PYTHON, "-c", "import site; print(site.getsitepackages()[0])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    need(Path(site).is_dir(), f"{site} (the system interpreter's first site directory) does not exist")
    work = tmp_path
    (work / "dist-packages").mkdir()
    for pth in Path(site).glob("*.pth"):  # what the machine itself needs there (certificates)
        shutil.copy2(pth, work / "dist-packages")
    args = {"SERVER_PYTHON": "python3", "SM120_ARCHS": "", "JIT_CACHE_BASE": str(work / "root"),
            "SM120PATCH_HOME": str(work / "opt-sm120patch"), "SM120PATCH_APPLY_ARGS": "",
            "SM120PATCH_SRC": str(work / "src")}
    (work / "root").mkdir()
    parsed = dockerfile()
    runs = [item["value"] for item in parsed.structure if item["instruction"] == "RUN"]
    env_path = f"{args['SM120PATCH_HOME']}/bin:/usr/bin:/bin"  # the ENV line, as docker expands it
    for n, run in enumerate(runs, 1):
        exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in args.items())
        (work / f"run-{n}.sh").write_text(exports + f"export PATH={shlex.quote(env_path) if n > 1 else '/usr/bin:/bin'}\n"
                                          + run + "\n")
    env = dict(os.environ, SYSTEM_PYTHON=SYSTEM_PYTHON, REPO=str(ROOT), **args)
    env.pop("VIRTUAL_ENV", None)
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "bash", "-c", SCRIPT, "sm120patch-image",
                           site, str(work), str(flashinfer_wheel), str(sglang_wheel)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    results = {}
    for line in (work / "results.jsonl").read_text().splitlines():
        results.update(json.loads(line))
    steps = {n: json.loads(line)["rc"] for n, line in enumerate((work / "results.jsonl").read_text().splitlines(), 1)
             if '"step"' in line}
    for n, rc in steps.items():
        assert rc == 0, (n, (work / f"step-{n}.out").read_text()[-3000:])

    assert results["status_rc"] == 0
    status = json.loads((work / "status.json").read_text())
    states = {d["name"]: d["state"] for d in status["distributions"]}
    assert states == {"flashinfer-python": "patched", "sglang": "patched"}
    assert all(Path(d["location"]) == Path(site) for d in status["distributions"])
    # sm120patch itself is not among the server's packages.
    assert not any(Path(site).glob("sm120patch*")) and not any(Path(site).glob("click*"))

    wrapper_pid, server_pid = results["pids"].split()
    assert results["patched_rc"] == 7 and wrapper_pid == server_pid  # exec: one process, its exit code
    assert results["written"] == ""  # the fast path writes nothing
    assert results["pristine_rc"] == 0 and results["pristine_out"] == "started" and results["status_after"] == 0
    assert results["drift_rc"] == 3 and results["drift_out"] == ""
    assert "not starting the server" in (work / "refused.err").read_text()
    assert results["warn_rc"] == 0 and results["warn_out"] == "started"
    assert "starting the server anyway" in (work / "warned.err").read_text()
