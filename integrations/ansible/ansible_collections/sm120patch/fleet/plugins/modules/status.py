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
    module.exit_json(changed=False, status=document, patched=rc == 0, exit_code=rc)


if __name__ == "__main__":
    main()
