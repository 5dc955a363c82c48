#!/usr/bin/python
# Copyright: sm120patch contributors
# Apache License 2.0 (see the repository's LICENSE terms in pyproject.toml)
"""Ansible module: wait for a server's log to say whether it fused (sm120patch check-log --follow)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: check_log
short_description: Wait for an SGLang or vLLM server's log to say whether FlashInfer allreduce fusion really runs
version_added: "0.1.0"
description:
  - Runs C(sm120patch check-log FILE --follow --json) after a restart and returns its verdict; changes nothing.
  - Fails when the server fell back to unfused allreduce, crashed, never asked for fusion (unless I(require_fused=false)),
    or gave no verdict before I(timeout) seconds (exit code 5, the server may still be starting).
options:
  log:
    description: The server's log file (it may not exist yet; rotation and truncation are followed).
    type: path
    required: true
  server:
    description: Which server wrote it (default, from the lines' format).
    type: str
    choices: [sglang, vllm]
  version:
    description: The server's release (SGLang does not log it).
    type: str
  python:
    description: The interpreter the server runs, asked for the release instead of I(version).
    type: path
  timeout:
    description: Seconds to wait for a final verdict.
    type: float
    default: 600
  require_fused:
    description: Fail unless the verdict is C(fused).
    type: bool
    default: true
extends_documentation_fragment:
  - sm120patch.fleet.target.executable
"""

EXAMPLES = r"""
- name: Restart SGLang
  ansible.builtin.systemd: {name: sglang, state: restarted}

- name: Did it fuse?
  sm120patch.fleet.check_log:
    log: /var/log/sglang.log
    version: "0.5.9"
    timeout: 900
  register: fusion
"""

RETURN = r"""
verdict:
  description: fused, fell-back, crashed, starting, not-requested or unknown-release.
  returned: always
  type: str
report:
  description: The C(sm120patch check-log --json) document (ranks, step, fix, crash).
  returned: always
  type: dict
exit_code:
  description: sm120patch check-log's exit code (0 fused and serving, 1 fell back / not requested / crashed, 3 unknown release, 5 no verdict yet).
  returned: always
  type: int
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sm120patch.fleet.plugins.module_utils.sm120patch_json import executable, run_json


def main():
    module = AnsibleModule(
        argument_spec={
            "log": dict(type="path", required=True),
            "server": dict(type="str", choices=["sglang", "vllm"]),
            "version": dict(type="str"),
            "python": dict(type="path"),
            "timeout": dict(type="float", default=600),
            "require_fused": dict(type="bool", default=True),
            "executable": dict(type="path", default="sm120patch"),
        },
        supports_check_mode=True,
    )
    params = module.params
    exe = executable(module)
    argv = [exe, "check-log", params["log"], "--follow", "--timeout", str(params["timeout"]), "--json"]
    for option in ("server", "version", "python"):
        if params[option]:
            argv += [f"--{option}", params[option]]
    rc, document = run_json(module, argv)
    result = dict(changed=False, verdict=document["verdict"], report=document, exit_code=rc)
    if rc != 0 and (params["require_fused"] or rc not in (0, 1)):
        fix = f" Fix: {document['fix']}" if document.get("fix") else ""
        module.fail_json(msg=f"{document['summary']}{fix} (exit code {rc})", **result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
