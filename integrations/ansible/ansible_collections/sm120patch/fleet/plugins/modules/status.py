#!/usr/bin/python
# Copyright: sm120patch contributors
# Apache License 2.0 (see the repository's LICENSE terms in pyproject.toml)
"""Ansible module: sm120patch status of one serving environment, as facts."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: status
short_description: Report sm120patch's status of a server's Python environment (information only)
version_added: "0.1.0"
description:
  - Runs C(sm120patch status --json) and returns its document; changes nothing.
  - C(patched) is true when every installed distribution is patched or fixed upstream (status exit code 0).
  - C(fusion) has, for each installed server (SGLang, vLLM), the verdict of its whole fusion chain as status
    judges it (C(will fuse), C(will not fuse), C(not known)), the one-sentence headline, and the options it
    must be started with; C(status.distributions[].fusion.steps) has every step.
options:
  python:
    description: The interpreter the server runs.
    type: path
    required: true
extends_documentation_fragment:
  - sm120patch.fleet.target
"""

EXAMPLES = r"""
- name: What is patched on each server
  sm120patch.fleet.status:
    python: /opt/sglang/venv/bin/python
  register: sm120

- ansible.builtin.debug:
    msg: "{{ inventory_hostname }}: {{ sm120.patched }}"

- name: Stop before a restart that would not fuse
  ansible.builtin.assert:
    that: sm120.fusion | selectattr('verdict', 'ne', 'will fuse') | list | length == 0
    fail_msg: "{{ sm120.fusion | map(attribute='headline') | join('; ') }}"
"""

RETURN = r"""
status:
  description: The C(sm120patch status --json) document.
  returned: always
  type: dict
patched:
  description: Whether every installed distribution is patched (or fixed upstream).
  returned: always
  type: bool
fusion:
  description: One entry per installed server with a fusion chain.
  returned: always
  type: list
  elements: dict
  contains:
    server: {description: "The server and its release, e.g. C(sglang 0.5.9).", type: str}
    verdict: {description: "C(will fuse), C(will not fuse) or C(not known).", type: str}
    headline: {description: The sentence status prints at its top, with the fix where a step blocks., type: str}
    conditions: {description: "The options the server must be started with (empty: on by default).", type: list}
exit_code:
  description: sm120patch status's exit code (0 patched, 1 not patched, 3 drift or an interrupted run).
  returned: always
  type: int
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sm120patch.fleet.plugins.module_utils.sm120patch_json import executable, run_json


def main():
    module = AnsibleModule(
        argument_spec={
            "python": dict(type="path", required=True),
            "jit_cache_base": dict(type="path"),
            "executable": dict(type="path", default="sm120patch"),
        },
        supports_check_mode=True,
    )
    params = module.params
    exe = executable(module)
    argv = [exe, "status", "--python", params["python"], "--json"]
    if params["jit_cache_base"]:
        argv += ["--jit-cache-base", params["jit_cache_base"]]
    rc, document = run_json(module, argv)
    fusion = [{"server": f"{d['name']} {d['version']}", "verdict": d["fusion"]["verdict"],
               "headline": d["fusion"]["headline"], "conditions": d["fusion"]["conditions"]}
              for d in document.get("distributions", []) if d.get("fusion")]
    module.exit_json(changed=False, status=document, patched=rc == 0, fusion=fusion, exit_code=rc)


if __name__ == "__main__":
    main()
