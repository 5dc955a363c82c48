"""The newcomer's pass (issue #64): what a new user meets first. A Ctrl-C after `apply` has
printed its report, `--json` when interrupted, the default `status` that fits a screen, the
commands the tool prints run as printed, vLLM's --compilation-config as one pasteable value."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, need
from sm120patch import tunedlimits
from test_synthetic import data_dir, toy  # noqa: F401 - the synthetic distribution's fixtures

STRACE = shutil.which("strace")
COMMITTED = "sm120patch: SIGINT arrived after the apply was committed: the change stands and its cleanup finished\n"


def toy_argv(toy, *words: str) -> list[str]:
    return [sys.executable, "-m", "sm120patch", words[0], "--python", str(toy.venv / "bin" / "python"),
            "--jit-cache-base", str(toy.home), *words[1:]]


def after_the_report(trace: str) -> list[tuple[str, int]]:
    """Every syscall of a traced run after its last write to stdout (the report's end), as
    (syscall, n): the n-th call of that syscall in the run, which strace can inject a signal at."""
    counts: dict[str, int] = {}
    moments = []
    for line in trace.splitlines():
        syscall = line.partition("(")[0]
        if not syscall.isidentifier():
            continue
        counts[syscall] = counts.get(syscall, 0) + 1
        if syscall == "write" and line.startswith("write(1,"):
            moments = []
            continue
        moments.append((syscall, counts[syscall]))
    return moments


def test_a_ctrl_c_after_apply_printed_its_report_never_reads_as_rolled_back(toy, tmp_path):
    """SIGINT at every syscall `apply` makes after the last line of its report (strace injects
    it there): the patch stands, so the exit code is apply's own (0), never 130 nor a death by
    the signal (which the shell shows as 130, "rolled back"), and stderr is empty or the one line
    that says the signal came after the commit. Before, Python's finalization put the default
    handler back and a Ctrl-C there ended the process silently by the signal."""
    need(STRACE is not None, "strace is not installed (.ci/run installs it)")
    revert = toy_argv(toy, "revert")
    status = toy_argv(toy, "status", "--brief")
    first = tmp_path / "trace.txt"
    subprocess.run([STRACE, "-o", str(first), *toy_argv(toy, "apply")], capture_output=True, check=True, timeout=120)
    moments = after_the_report(first.read_text())
    assert moments, first.read_text()[-2000:]
    subprocess.run(revert, capture_output=True, check=True, timeout=120)
    outcomes = {}
    for syscall, n in moments:
        trace = tmp_path / f"trace-{syscall}-{n}.txt"
        proc = subprocess.run([STRACE, "-o", str(trace), "-e", f"trace={syscall}", "-e",
                               f"inject={syscall}:signal=INT:when={n}", *toy_argv(toy, "apply")],
                              capture_output=True, text=True, timeout=120)
        reached = sum(line.startswith(f"{syscall}(") for line in trace.read_text().splitlines()) >= n
        outcomes[(syscall, n)] = (reached, proc.returncode, proc.stderr)
        assert subprocess.run(status, capture_output=True, timeout=120).returncode == 0, (syscall, n, proc.stderr)
        subprocess.run(revert, capture_output=True, check=True, timeout=120)
    for moment, (reached, returncode, stderr) in outcomes.items():
        assert returncode == 0, (moment, returncode, stderr)
        assert stderr in ("", COMMITTED), (moment, stderr)
    answered = [m for m, (reached, _, stderr) in outcomes.items() if reached and stderr == COMMITTED]
    print(f"\nSIGINT at {len(moments)} moments after apply's report: {len(answered)} answered with the committed line")
    assert answered  # the signal was delivered and said, not only sent to a process already gone


@pytest.mark.parametrize("command, syscall, code", [
    ("status", "wait4", 130),  # while it waits for the target interpreter's answer
    ("apply", "rename,renameat,renameat2", 130),  # inside the transaction (renames by directory descriptor): rolled back
    ("revert", "wait4", 130),
    ("verify", "wait4", 130),
])
def test_an_interrupted_json_command_still_prints_its_document(toy, command, syscall, code):
    """`--json` always prints a document on stdout: an interrupt's too, with the same keys as
    every other (command, exit_code, target, next) and the one line the text gives, under
    error. Before, an interrupted --json run printed nothing on stdout."""
    import json

    need(STRACE is not None, "strace is not installed (.ci/run installs it)")
    if command == "revert":
        subprocess.run(toy_argv(toy, "apply"), capture_output=True, check=True, timeout=120)
    proc = subprocess.run([STRACE, "-o", "/dev/null", "-e", f"trace={syscall}", "-e",
                           f"inject={syscall}:signal=INT:when=1", *toy_argv(toy, command, "--json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    document = json.loads(proc.stdout)
    assert list(document)[:4] == ["command", "exit_code", "target", "next"] and document["command"] == command
    assert document["exit_code"] == code and "interrupted (SIGINT)" in document["error"]["message"], document
    assert proc.stderr.startswith("sm120patch: interrupted (SIGINT)"), proc.stderr


def pass_config_fields(site: Path) -> dict[str, str]:
    """PassConfig's fields and their annotations, read from the installed vLLM's own source."""
    import ast

    source = next(p for p in (site / "vllm" / "config" / "compilation.py", site / "vllm" / "config" / "pass_config.py")
                  if p.is_file() and "class PassConfig" in p.read_text())
    tree = ast.parse(source.read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "PassConfig")
    return {n.target.id: ast.unparse(n.annotation) for n in cls.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


@pytest.mark.wheels  # fetches a real vLLM wheel itself (no wheel fixture marks it)
@pytest.mark.parametrize("version", ["0.11.1"])
def test_vllm_gets_one_compilation_config_with_the_size_for_this_box(tmp_path, monkeypatch, version):
    """vLLM's advice names one --compilation-config a user can paste: the key that turns the
    pass on and the size key with its value, both fields of the release's own PassConfig (read
    from its wheel), parsed as vLLM parses the option (JSON). Before, it named
    pass_config.fi_allreduce_fusion_max_size_mb and the switch as two things, with no value."""
    import json
    import re
    import shlex

    from helpers import Session
    from test_vllm import vllm_env

    env = vllm_env(tmp_path, version)
    output = Session(env)("status", "--verbose").output
    configs = re.findall(r"`(--compilation-config '[^`]*')`", output)
    assert configs, output
    fields = pass_config_fields(env.site_packages)
    for config in configs:
        option, value = shlex.split(config)
        passes = json.loads(value)["pass_config"]
        assert set(passes) <= set(fields), (passes, fields)
        switch, sizing = list(passes)
        assert fields[switch] == "bool" and passes[switch] is True
        assert "float" in fields[sizing] and passes[sizing] == 0.5

    # With a profile of this box: its fused limit, the smallest over its TP sizes (vLLM takes one
    # value for every TP size), in MB.
    from test_tuned_limits import write_profile

    profile = tmp_path / "tuned-limits.json"
    write_profile(profile, {"vllm": version}, tp2=(1024, 64), tp4=(256, 32))  # 8 MiB and 2 MiB at hidden 4096
    monkeypatch.setenv("SM120PATCH_TUNED_LIMITS", str(profile))
    output = Session(env)("status", "--verbose").output
    tuned = re.findall(r"`(--compilation-config '[^`]*')` \(([^)]*)\)", output)
    assert tuned and all(json.loads(shlex.split(c)[1])["pass_config"]["fi_allreduce_fusion_max_size_mb"] == 2
                         and "measured on this box at TP4" in why for c, why in tuned), output


# -- every command the tool prints, run as printed ---------------------------------------------

AS_ROOT = 'sudo "$(command -v sm120patch)" '
PRINTED = re.compile(r"`((?:sudo \"\$\(command -v sm120patch\)\" |sm120patch )[^`]*)`")
NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]


def install_sm120patch(kind: str, home: Path, copy: Path) -> dict[str, str]:
    """sm120patch installed the two ways the README gives, for the user whose home is ``home``:
    in a venv of its own with its console script (pipx: the script linked into ~/.local/bin, on
    PATH; a venv: its bin/ on PATH). The venv imports the readable copy of sm120patch and its
    libraries (no PyPI here). Returns that user's environment."""
    venv = home / (".local/share/pipx/venvs/sm120patch" if kind == "pipx" else "venvs/sm120patch")
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "sm120patch-copy.pth").write_text(f"{copy / 'src'}\n{copy / 'deps'}\n")
    script = venv / "bin" / "sm120patch"
    script.write_text(f"#!{venv}/bin/python\nimport sys\nfrom sm120patch.__main__ import main\n"
                      "if __name__ == '__main__':\n    sys.exit(main())\n")
    script.chmod(0o755)
    if kind == "pipx":
        (home / ".local" / "bin").mkdir(parents=True)
        (home / ".local" / "bin" / "sm120patch").symlink_to(script)
        bin_dir = home / ".local" / "bin"
    else:
        bin_dir = venv / "bin"
    return {"HOME": str(home), "PATH": f"{bin_dir}:/usr/bin:/bin", "LANG": "C.UTF-8", "NO_COLOR": "1"}


def printed_commands(*texts: str) -> list[str]:
    return list(dict.fromkeys(c for text in texts for c in PRINTED.findall(text)))


# What each printed command may answer on this CPU-only box, whose serving environment has no
# torch: anything but a command that does not parse, is not found, or crashes.
EXPECTED = {"status": {0, 1}, "apply": {0}, "revert": {0}, "doctor": {0}, "check-log": {0}, "diff": {0},
            "build": {2, 3}, "bench": {2}}


@pytest.mark.wheels
@pytest.mark.parametrize("user", ["root", "nobody"])
def test_every_printed_command_runs_as_printed(shared_dir, flashinfer_wheel, sglang_wheel, user):
    """The newcomer's session, with sm120patch installed as pipx and as a venv install puts it,
    as root and as a user who is not: `status`, then every command it prints (backticked:
    `next:`, `fix:`, `check:`, notes, hints) run by bash exactly as printed, then the same for
    what `status` and `apply` print once patched. `bench --tune`'s one placeholder (the model's
    directory, which sm120patch cannot know) is the only word replaced. A command printed with
    sudo is run as sudo runs it: the `$(command -v sm120patch)` in the user's shell (sudo's own
    PATH has no pipx or venv install), the rest as root. None may fail to parse, be not found
    or crash; each exits with a code its --help lists for this box (no torch: bench and build
    say the target cannot run them)."""
    from helpers import make_venv, readable_copy
    from sm120patch.tunedlimits import MODEL_PLACEHOLDER

    need(shutil.which("bash") is not None, "needs bash")
    copy = readable_copy(shared_dir)
    model = shared_dir / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text('{"hidden_size": 4096, "torch_dtype": "bfloat16"}')
    etc = Path("/etc/sm120patch").exists()
    for kind in ("pipx", "venv"):
        home = shared_dir / f"{user}-{kind}"
        home.mkdir()
        environ = install_sm120patch(kind, home, copy)
        env_root = home / "ml-env"
        make_venv(env_root, [flashinfer_wheel, sglang_wheel], python="/usr/bin/python3", linked=user == "root")
        python = str(env_root / "bin" / "python")
        if user != "root":
            subprocess.run(["chown", "-R", "nobody:nogroup", str(home)], check=True)
        prefix = NOBODY if user != "root" else []

        def run(line: str, as_root: bool = False) -> subprocess.CompletedProcess:
            return subprocess.run([*([] if as_root else prefix), "bash", "-c", line], env=environ, cwd=str(home),
                                  capture_output=True, text=True, timeout=600)

        ran: dict[str, tuple[int, str]] = {}

        def run_printed(output: str) -> list[str]:
            commands = [c for c in printed_commands(output) if c not in ran]
            for line in commands:
                pasted = line.replace(MODEL_PLACEHOLDER, str(model))
                if pasted.startswith(AS_ROOT):  # what sudo runs: the path the user's shell found, as root
                    assert user != "root", line  # root writes the profile itself
                    found = run("command -v sm120patch").stdout.strip()
                    assert found and Path(found).name == "sm120patch", (kind, found)
                    proc = subprocess.run(["bash", "-c", f"{shlex.quote(found)} {pasted[len(AS_ROOT):]}"],
                                          env={**environ, "HOME": "/root", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                                          cwd="/", capture_output=True, text=True, timeout=600)
                else:
                    proc = run(pasted)
                words = shlex.split(pasted.replace(AS_ROOT, "sm120patch "))
                ran[line] = (proc.returncode, proc.stderr)
                assert "command not found" not in proc.stderr and proc.returncode != 127, (kind, line, proc.stderr)
                assert "--help` lists the" not in proc.stderr and "Traceback" not in proc.stderr, (kind, line, proc.stderr)
                assert proc.returncode in EXPECTED[words[1]], (kind, line, proc.returncode, proc.stdout, proc.stderr)
            return commands

        first = run(f"sm120patch status --python {shlex.quote(python)}")
        assert first.returncode == 1 and "next: `sm120patch apply" in first.stdout, (kind, first.stdout, first.stderr)
        before = run_printed(first.stdout + first.stderr)
        assert any(" apply " in c for c in before) and any("status --verbose" in c for c in before), before
        assert run(f"sm120patch status --python {shlex.quote(python)}").returncode == 0  # the printed apply applied
        patched = run(f"sm120patch status --python {shlex.quote(python)}")
        verbose = run(f"sm120patch status --verbose --python {shlex.quote(python)}")
        applied = run(f"sm120patch apply --python {shlex.quote(python)}")
        after = run_printed(patched.stdout + verbose.stdout + applied.stdout)
        tune = [c for c in after if "bench --tune" in c]
        assert tune and all(c.startswith(AS_ROOT) == (user != "root") for c in tune), tune
        assert any(" build " in c for c in after) and any("doctor" in c for c in after), after
        # The README's Quick start, line by line as a user pastes it (its ~/ml-env is this one;
        # check-log needs the server's log, which a box without a server has not got).
        quick = (ROOT / "README.md").read_text().split("## Quick start")[1].split("```\n")[1]
        (home / "models" / "my-model").mkdir(parents=True)
        (home / "models" / "my-model" / "config.json").write_text((model / "config.json").read_text())
        if user != "root":
            subprocess.run(["chown", "-R", "nobody:nogroup", str(home / "models")], check=True)
        readme = [line for line in quick.splitlines()
                  if line.startswith(("sm120patch ", AS_ROOT)) and " check-log " not in line]
        assert len(readme) >= 5, quick
        for line in readme:
            if line.startswith(AS_ROOT):  # as sudo runs it (above)
                found = run("command -v sm120patch").stdout.strip()
                home_words = line[len(AS_ROOT):].replace("~/", f"{home}/")
                proc = subprocess.run(["bash", "-c", f"{shlex.quote(found)} {home_words}"],
                                      env={**environ, "HOME": "/root", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                                      cwd="/", capture_output=True, text=True, timeout=600)
            else:
                proc = run(line)
            words = line.replace(AS_ROOT, "sm120patch ").split()
            assert proc.returncode in EXPECTED[words[1]] and "--help` lists the" not in proc.stderr, (
                kind, line, proc.returncode, proc.stderr)
        print(f"\n{user}, {kind}: {len(ran)} printed commands and {len(readme)} of the README's run as printed")
    assert Path("/etc/sm120patch").exists() == etc  # bench refused before writing anything


# -- status: a screen by default ----------------------------------------------------------------

def status_at_80(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sm120patch", "status", *argv], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "80"}, timeout=120)


@pytest.mark.wheels
def test_status_by_default_fits_a_40_line_terminal_one_line_per_distribution(serving_env):
    """`status` answers per server, says in one line per distribution its version, whether it is
    patched and what stands in the way, and what to run next: within 40 lines of 80 columns
    for one environment, before and after apply. The whole table is --verbose's (and always
    --json's); a label (fix:, check:, note:) stays on its command's line there. Before, status
    printed the whole table (about 110 lines) every time."""
    target = ["--python", str(serving_env.python), "--jit-cache-base", str(serving_env.home)]
    for stage in ("pristine", "patched"):
        short = status_at_80(*target)
        lines = short.stdout.splitlines()
        assert short.returncode == (1 if stage == "pristine" else 0), short.stderr
        assert len(lines) <= 40, (len(lines), short.stdout)
        state = "not patched" if stage == "pristine" else "patched"
        for name in ("flashinfer-python 0.6.4", "sglang 0.5.9"):
            assert [line for line in lines if line.startswith(f"  {name}: {state}")], (name, short.stdout)
        assert "\n  fusion chain:" not in short.stdout and "\n  JIT cache: " not in short.stdout
        assert "\nnext: " in short.stdout and "status --verbose" in " ".join(lines[-2:])
        assert [line for line in lines if line.startswith("every patch, the fusion chain and the JIT cache:")]
        if stage == "pristine":
            assert "sglang 0.5.9: not patched; fusion-gate to apply; fusion blocked at: kernel-gates, server-gates" in (
                " ".join(short.stdout.split()))
        verbose = status_at_80(*target, "--verbose")
        assert verbose.returncode == short.returncode and "\n  fusion chain:" in verbose.stdout
        assert len(verbose.stdout.splitlines()) > 40
        for line in verbose.stdout.splitlines():
            if re.match(r" *(fix|check):", line):
                assert "`sm120patch " in line, (line, verbose.stdout)  # the command beside its label
        brief = status_at_80(*target, "--brief")
        assert brief.returncode == short.returncode and "flashinfer-python" not in brief.stdout.split("will")[0]
        if stage == "pristine":
            assert subprocess.run([sys.executable, "-m", "sm120patch", "apply", *target], capture_output=True,
                                  timeout=120).returncode == 0
    assert status_at_80(*target, "--brief", "--verbose").returncode == 2


def test_the_readme_quick_start_clones_and_keeps_the_venv_apart_from_the_clone():
    """The Quick start begins with the clone; the venv install's directory is not where
    `git clone` from the home directory puts the clone (~/sm120patch), nor inside it."""
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start")[1].split("### Uninstalling")[0]
    block = quick.split("```\n")[1]
    assert block.splitlines()[0].startswith("git clone ") and " sm120patch && cd sm120patch" in block.splitlines()[0]
    venv = re.search(r"python3 -m venv (\S+)", quick).group(1)
    assert venv.rstrip("/") != "~/sm120patch" and not venv.startswith("~/sm120patch/"), venv
    assert "~/sm120patch" not in readme.split("### Uninstalling")[1].split("###")[0]


def test_the_printed_tune_command_takes_the_hidden_size_a_profile_of_this_box_holds(monkeypatch, tmp_path):
    """Where a profile of this box already has the model's hidden size, `bench --tune` is printed
    with it (nothing to fill in); else with the one placeholder. Where this user cannot write the
    profile, through sudo, and with --profile when SM120PATCH_TUNED_LIMITS names it (sudo does not
    pass the variable on)."""
    from sm120patch import tunedlimits

    target = (("--python", "/srv/env/bin/python"),)
    entry = tunedlimits.Entry(4, 1 << 17, 1 << 20, 7168, "bf16", "2026-12-01T00:00:00Z", "", (), {})
    held = tunedlimits.Profile("/etc/sm120patch/tuned-limits.json", False, "", (entry,), ())
    absent = tunedlimits.Profile("/etc/sm120patch/tuned-limits.json", False, "absent", (), ())
    monkeypatch.delenv(tunedlimits.ENV, raising=False)
    root = os.geteuid() == 0
    prefix = "sm120patch" if root else tunedlimits.AS_ROOT
    assert tunedlimits.tune_command(target, held) == f"{prefix} bench --tune --hidden 7168 --python /srv/env/bin/python"
    assert tunedlimits.tune_command(target, absent) == (
        f"{prefix} bench --tune --model {tunedlimits.MODEL_PLACEHOLDER} --python /srv/env/bin/python")
    mine = tmp_path / "limits" / "tuned-limits.json"  # a directory the tuner makes, in one this user may write
    assert tunedlimits.tune_command(target, absent, {tunedlimits.ENV: str(mine)}).startswith("sm120patch bench --tune ")
    if root:  # the rest is what a user who is not root sees
        return
    closed = "/proc/tuned-limits.json"
    assert tunedlimits.tune_command(target, absent, {tunedlimits.ENV: closed}).endswith(f"--profile {closed}")


@pytest.mark.wheels
def test_status_of_a_checkout_by_default_says_what_head_has_in_one_line(tmp_path, flashinfer_wheel):
    """A git checkout's line is judged by meaning, as --verbose's table is: every patch to apply
    before, none after apply's commit."""
    from helpers import run_cli
    from test_source import flashinfer_tree

    root = flashinfer_tree(flashinfer_wheel, tmp_path / "flashinfer", "0.6.4").working_tree_dir
    before = run_cli("status", "--source", root, short=True)
    assert before.exit_code == 1 and "not patched; 7 patches to apply" in before.output, before.output
    assert run_cli("apply", "--source", root).exit_code == 0
    after = run_cli("status", "--source", root, short=True)
    assert after.exit_code == 0 and "to apply" not in after.output and ": patched" in after.output, after.output
    assert len(after.output.splitlines()) <= 10


def test_the_model_placeholder_pasted_unfilled_says_what_to_put_there(tmp_path):
    """The one word status's `bench --tune` line leaves to fill in, pasted as it is: bench says it is
    that word and what goes there (exit 2), not that a file YOUR_MODEL_DIR cannot be read."""
    proc = subprocess.run([sys.executable, "-m", "sm120patch", "bench", "--tune", "--model", tunedlimits.MODEL_PLACEHOLDER,
                           "--python", sys.executable], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"sm120patch: error: --model {tunedlimits.MODEL_PLACEHOLDER} is the one word of the "
                                  "printed line to fill in"), proc.stderr
