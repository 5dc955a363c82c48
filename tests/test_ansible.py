"""The Ansible collection (integrations/ansible) with the real ansible-core from PyPI, against
localhost (connection local), on throwaway environments with the real wheels: changed only
when something changed, check mode changes nothing, diff mode shows the diff, state absent
restores the RECORD bytes, a refusal fails with sm120patch's own line and exit code."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import COMM, HEADER, ROOT, changed, snapshot
from test_hardening import small_sglang_checkout

COLLECTIONS = ROOT / "integrations" / "ansible"
COLLECTION = COLLECTIONS / "ansible_collections" / "sm120patch" / "fleet"
SM120PATCH = Path(sys.executable).parent / "sm120patch"
pytestmark = pytest.mark.wheels  # ansible-core is downloaded


@pytest.fixture(scope="session")
def ansible(tmp_path_factory) -> Path:
    """A virtual environment with ansible-core from PyPI; its bin directory."""
    venv = tmp_path_factory.mktemp("ansible") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    "ansible-core"], check=True)
    return venv / "bin"


def ansible_env(ansible: Path, tmp_path: Path) -> dict[str, str]:
    """Ansible's environment: this collection, and a HOME of the test's own (ansible writes
    ~/.ansible/tmp otherwise: tests never touch the real $HOME)."""
    return {"ANSIBLE_COLLECTIONS_PATH": str(COLLECTIONS), "ANSIBLE_LOCALHOST_WARNING": "false",
            "ANSIBLE_INVENTORY_UNPARSED_WARNING": "false", "ANSIBLE_HOME": str(tmp_path / "ansible-home"),
            "ANSIBLE_REMOTE_TMP": str(tmp_path / "ansible-remote-tmp"), "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-tmp"),
            "PATH": f"{ansible}:/usr/bin:/bin", "HOME": str(tmp_path), "ANSIBLE_NOCOLOR": "1"}


def play(ansible: Path, tmp_path: Path, tasks: list[dict], *flags: str, handlers: list[dict] | None = None) -> dict:
    """Run ``tasks`` on localhost; each task's registered result (failures included) and the
    play recap's counts."""
    out = tmp_path / "results.json"
    registered = [{**task, "register": f"r{i}", "ignore_errors": True} for i, task in enumerate(tasks)]
    collect = {"ansible.builtin.copy": {
        "dest": str(out), "content": "{{ " + "[" + ", ".join(f"r{i}" for i in range(len(tasks))) + "] | to_json }}"},
        "check_mode": False, "diff": False}
    playbook = tmp_path / "play.yml"
    playbook.write_text(json.dumps([{"hosts": "localhost", "gather_facts": False, "tasks": [*registered, collect],
                                     "handlers": handlers or []}]))
    env = ansible_env(ansible, tmp_path)
    out.unlink(missing_ok=True)
    proc = subprocess.run([str(ansible / "ansible-playbook"), "-i", "localhost,", "-c", "local",
                           "-e", f"ansible_python_interpreter={ansible / 'python'}", *flags, str(playbook)],
                          capture_output=True, text=True, env=env)
    assert out.exists(), proc.stdout + proc.stderr
    recap = re.search(r"localhost\s*:\s*ok=(\d+)\s+changed=(\d+)", proc.stdout)
    return {"results": json.loads(out.read_text()), "changed": int(recap.group(2)) if recap else None,
            "output": proc.stdout}


def results(document: dict) -> list[dict]:
    return document["results"]


def patch_task(env, **extra) -> dict:
    return {"sm120patch.fleet.patch": {"python": str(env.python), "jit_cache_base": str(env.home),
                                       "executable": str(SM120PATCH), **extra}}


def test_present_then_unchanged_then_absent(ansible, serving_env, tmp_path):
    serving_env.seed_jit()
    first = results(play(ansible, tmp_path, [patch_task(serving_env, flashinfer="0.6.4", sglang="any")]))
    assert first[0]["changed"] is True and not first[0].get("failed"), first
    assert "[9, 10, 12]" in serving_env.file(COMM).read_text()
    second = results(play(ansible, tmp_path, [patch_task(serving_env, flashinfer="0.6.4")]))
    assert second[0]["changed"] is False, second
    absent = results(play(ansible, tmp_path, [patch_task(serving_env, state="absent")]))
    assert absent[0]["changed"] is True
    assert serving_env.record_mismatches() == []
    again = results(play(ansible, tmp_path, [patch_task(serving_env, state="absent")]))
    assert again[0]["changed"] is False


def test_check_mode_changes_nothing_and_diff_mode_shows_the_diff(ansible, serving_env, tmp_path):
    serving_env.seed_jit()
    before = snapshot(serving_env)
    checked = results(play(ansible, tmp_path, [patch_task(serving_env)], "--check", "--diff"))
    assert checked[0]["changed"] is True  # what would change
    assert "+        supported_major_versions=[9, 10, 12]" in checked[0]["diff"]["prepared"]
    assert changed(before, snapshot(serving_env)) == []
    # Absent in check mode on a pristine environment: nothing would change, nothing changes.
    absent = results(play(ansible, tmp_path, [patch_task(serving_env, state="absent")], "--check"))
    assert absent[0]["changed"] is False
    assert changed(before, snapshot(serving_env)) == []


def test_check_mode_absent_predicts_removing_left_behind_state(ansible, serving_env, tmp_path):
    """Every patched distribution uninstalled: the real `state: absent` removes the state left
    behind (changed), so check mode must say changed too, and change nothing."""
    results(play(ansible, tmp_path, [patch_task(serving_env)]))
    subprocess.run([sys.executable, "-m", "pip", "--python", str(serving_env.python), "uninstall", "--yes", "--quiet",
                    "flashinfer-python", "sglang"], check=True)
    before = snapshot(serving_env)
    checked = results(play(ansible, tmp_path, [patch_task(serving_env, state="absent")], "--check"))
    assert checked[0]["changed"] is True and not checked[0].get("failed"), checked
    assert changed(before, snapshot(serving_env)) == []
    real = results(play(ansible, tmp_path, [patch_task(serving_env, state="absent")]))
    assert real[0]["changed"] is True and not serving_env.state_root.exists(), real
    again = results(play(ansible, tmp_path, [patch_task(serving_env, state="absent")], "--check"))
    assert again[0]["changed"] is False, again


def test_a_drifted_file_fails_with_the_refusal(ansible, serving_env, tmp_path):
    header = serving_env.file(HEADER)
    header.write_text(header.read_text() + "// tuned by hand\n")
    before = snapshot(serving_env)
    failed = results(play(ansible, tmp_path, [patch_task(serving_env)]))
    assert failed[0]["failed"] is True
    assert failed[0]["msg"].startswith("sm120patch: error: refusing to patch flashinfer-python")
    assert "(exit code 3)" in failed[0]["msg"] and failed[0]["exit_code"] == 3
    assert changed(before, snapshot(serving_env)) == []


def test_status_module_reports_facts(ansible, serving_env, tmp_path):
    task = {"sm120patch.fleet.status": {"python": str(serving_env.python), "executable": str(SM120PATCH)}}
    (before,) = results(play(ansible, tmp_path, [task]))
    assert before["patched"] is False and before["changed"] is False and before["exit_code"] == 1
    assert [d["name"] for d in before["status"]["distributions"]] == ["flashinfer-python", "sglang"]
    assert [(f["server"], f["verdict"]) for f in before["fusion"]] == [("sglang 0.5.9", "will not fuse")]
    results(play(ansible, tmp_path, [patch_task(serving_env)]))
    (after,) = results(play(ansible, tmp_path, [task]))
    assert after["patched"] is True and after["exit_code"] == 0
    (fusion,) = after["fusion"]
    assert fusion["verdict"] == "will fuse" and fusion["conditions"] == ["--enable-flashinfer-allreduce-fusion"]
    assert fusion["headline"].startswith("sglang 0.5.9 will fuse on an SM120 GPU when started with")


def test_the_rollout_role_installs_applies_verifies_and_notifies(ansible, serving_env, tmp_path):
    marker = tmp_path / "restarted"
    role = {"ansible.builtin.include_role": {"name": "sm120patch.fleet.rollout"},
            "vars": {"sm120patch_source": str(ROOT), "sm120patch_venv": str(tmp_path / "sm120patch-venv"),
                     "sm120patch_venv_python": sys.executable, "sm120patch_python": str(serving_env.python),
                     "sm120patch_jit_cache_base": str(serving_env.home), "sm120patch_notify": ["restart server"]}}
    handler = {"name": "restart server", "ansible.builtin.file": {"path": str(marker), "state": "touch"}}
    first = play(ansible, tmp_path, [role], handlers=[handler])
    assert not any(r.get("failed") for r in results(first)), first["output"]
    assert marker.exists() and "[9, 10, 12]" in serving_env.file(COMM).read_text()
    marker.unlink()
    second = play(ansible, tmp_path, [role], handlers=[handler])
    assert second["changed"] == 1, second["output"]  # only the final results file: nothing else changed
    assert not marker.exists()  # nothing changed: no restart


def test_the_module_documentation_matches_its_arguments(ansible, tmp_path):
    """ansible-doc parses DOCUMENTATION; its options are exactly the module's arguments."""
    import ast

    for name in ("patch", "status", "check_log"):
        proc = subprocess.run([str(ansible / "ansible-doc"), "-t", "module", "--json", f"sm120patch.fleet.{name}"],
                              capture_output=True, text=True, env=ansible_env(ansible, tmp_path))
        assert proc.returncode == 0, proc.stderr
        documented = set(json.loads(proc.stdout)[f"sm120patch.fleet.{name}"]["doc"]["options"])
        source = (COLLECTION / "plugins" / "modules" / f"{name}.py").read_text()
        spec = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.keyword) and n.arg == "argument_spec")
        assert documented == {ast.literal_eval(k) for k in spec.value.keys}, name


def test_check_log_module_waits_for_the_verdict(ansible, tmp_path):
    """The module on a real SGLang 0.5.9 log shape: fused passes with the verdict; a log that
    only starts fails with exit code 5 once its timeout passed."""
    log = tmp_path / "sglang.log"
    log.write_text("[2026-01-01 00:00:00] server_args=ServerArgs(tp_size=2, enable_flashinfer_allreduce_fusion=True)\n"
                   "[2026-01-01 00:00:01 TP0] FlashInfer workspace initialized for rank 0, world_size 2\n"
                   "[2026-01-01 00:00:01 TP1] FlashInfer workspace initialized for rank 1, world_size 2\n"
                   "[2026-01-01 00:00:02] The server is fired up and ready to roll!\n")
    starting = tmp_path / "starting.log"
    starting.write_text("[2026-01-01 00:00:00 TP0] Load weight begin. avail mem=90.00 GB\n")
    task = {"sm120patch.fleet.check_log": {"log": str(log), "version": "0.5.9", "server": "sglang",
                                           "executable": str(SM120PATCH), "timeout": 30}}
    waiting = {"sm120patch.fleet.check_log": {"log": str(starting), "server": "sglang",
                                              "executable": str(SM120PATCH), "timeout": 1}}
    fused, still = results(play(ansible, tmp_path, [task, waiting]))
    assert fused["verdict"] == "fused" and fused["exit_code"] == 0 and not fused.get("failed"), fused
    assert still["failed"] is True and still["exit_code"] == 5 and still["verdict"] == "starting", still


def test_ansible_on_an_editable_install_changes_only_when_bytes_change_and_check_mode_is_exact(
        ansible, serving_env, sglang_wheel, tmp_path):
    """SGLang installed editable (pip's direct_url.json) from a checkout: `state: present` reports
    changed once, then never again (a notify handler restarts the server once); `state: absent`
    in check mode predicts exactly, and never fails the host for having nothing to do."""
    checkout = small_sglang_checkout(tmp_path / "sglang", sglang_wheel)
    dist_info = next(serving_env.site_packages.glob("sglang-*.dist-info"))
    (dist_info / "direct_url.json").write_text(json.dumps({"url": checkout.as_uri(), "dir_info": {"editable": True}}))
    nothing = results(play(ansible, tmp_path, [patch_task(serving_env, state="absent")], "--check"))
    assert nothing[0]["changed"] is False and not nothing[0].get("failed"), nothing
    first, second = results(play(ansible, tmp_path, [patch_task(serving_env), patch_task(serving_env)]))
    assert first["changed"] is True and not first.get("failed"), first
    head = git_head(checkout)
    assert second["changed"] is False and not second.get("failed"), second
    assert git_head(checkout) == head
    would = results(play(ansible, tmp_path, [patch_task(serving_env, state="absent")], "--check"))
    assert would[0]["changed"] is True and not would[0].get("failed"), would
    assert git_head(checkout) == head  # check mode changed nothing
    absent, again = results(play(ansible, tmp_path, [patch_task(serving_env, state="absent")] * 2))
    assert absent["changed"] is True and again["changed"] is False and not again.get("failed"), again


def git_head(checkout: Path) -> str:
    return subprocess.run(["git", "-C", str(checkout), "rev-parse", "--abbrev-ref", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
