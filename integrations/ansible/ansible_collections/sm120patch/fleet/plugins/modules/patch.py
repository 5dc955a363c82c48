#!/usr/bin/python
# Copyright: sm120patch contributors
# Apache License 2.0 (see the repository's LICENSE terms in pyproject.toml)
"""Ansible module: sm120patch's patches present or absent on one serving environment."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: patch
short_description: Apply or revert sm120patch's SM120 allreduce-fusion patches on a server's Python environment
version_added: "0.1.0"
description:
  - Runs C(sm120patch apply) or C(sm120patch revert) against the interpreter a server runs, so that FlashInfer's
    TRT-LLM fused allreduce (and SGLang's use of it) works on NVIDIA SM120 GPUs.
  - Idempotent. C(changed) is what sm120patch reports it changed on disk; a second run reports C(changed=false).
  - Check mode runs C(apply --dry-run) (C(revert --dry-run) for C(state=absent)) and changes nothing; it reports changed exactly when the run would change something.
  - Diff mode returns the unified diff C(apply) makes.
  - Fails with sm120patch's one-line error and exit code when it refuses (a file that is not the release's bytes,
    a release without a pinned patch set) or fails (nothing was changed, or everything was rolled back).
options:
  state:
    description: C(present) applies the pinned patch set of each installed release; C(absent) restores the release's bytes.
    type: str
    choices: [present, absent]
    default: present
  python:
    description: The interpreter the server runs (its virtual environment's C(bin/python)).
    type: path
    required: true
  flashinfer:
    description: Assert that this flashinfer-python version is installed, and act on flashinfer-python (C(any) for whatever release is installed).
    type: str
  sglang:
    description: Assert that this sglang version is installed, and act on sglang (C(any) for whatever release is installed).
    type: str
  vllm:
    description: Assert that this vllm version is installed, and act on vllm (C(any) for whatever release is installed).
    type: str
  with:
    description: Opt-in patch ids to apply as well (see C(sm120patch list)).
    type: list
    elements: str
    default: []
  force:
    description: Patch files that are not the release's bytes by meaning (apply), or restore the release's bytes over hand edits (revert).
    type: bool
    default: false
  build:
    description: After applying, build trtllm_comm into the server's JIT cache (C(sm120patch apply --build)).
    type: bool
    default: false
extends_documentation_fragment:
  - sm120patch.fleet.target
"""

EXAMPLES = r"""
- name: SM120 fused allreduce for the SGLang server
  sm120patch.fleet.patch:
    python: /opt/sglang/venv/bin/python
    flashinfer: "0.6.4"
    sglang: "0.5.9"
    jit_cache_base: /home/sglang
  notify: restart sglang

- name: Back to the release's bytes
  sm120patch.fleet.patch:
    python: /opt/sglang/venv/bin/python
    state: absent
"""

RETURN = r"""
report:
  description: The JSON document sm120patch printed (C(apply --json) or C(revert --json); in check mode the dry run of either).
  returned: always
  type: dict
exit_code:
  description: sm120patch's exit code.
  returned: always
  type: int
"""

import json

from ansible.module_utils.basic import AnsibleModule


def selectors(params):
    args = []
    for option in ("flashinfer", "sglang", "vllm"):
        value = params.get(option)
        if value is None:
            continue
        args.append(f"--{option}" if value == "any" else f"--{option}={value}")
    return args


def target(params):
    args = ["--python", params["python"]]
    if params.get("jit_cache_base"):
        args += ["--jit-cache-base", params["jit_cache_base"]]
    return args


def run(module, argv):
    rc, out, err = module.run_command(argv)
    try:
        document = json.loads(out) if out.strip() else None
    except ValueError:
        document = None
    return rc, document, out, err


def fail(module, argv, rc, err, document=None):
    lines = [line for line in err.splitlines() if line.strip()]
    message = next((line for line in lines if line.startswith("sm120patch: error:")), lines[-1] if lines else "")
    hint = next((line for line in lines if line.startswith("hint:")), None)
    module.fail_json(msg=f"{message} (exit code {rc})" + (f"; {hint}" if hint else ""), exit_code=rc,
                     cmd=" ".join(argv), stderr=err, report=document)


def diff_text(document):
    return "".join(f["diff"] or "" for r in (document or {}).get("results", []) for f in r.get("files", []))


def main():
    module = AnsibleModule(
        argument_spec={
            "state": dict(type="str", choices=["present", "absent"], default="present"),
            "python": dict(type="path", required=True),
            "flashinfer": dict(type="str"),
            "sglang": dict(type="str"),
            "vllm": dict(type="str"),
            "with": dict(type="list", elements="str", default=[]),
            "jit_cache_base": dict(type="path"),
            "force": dict(type="bool", default=False),
            "build": dict(type="bool", default=False),
            "executable": dict(type="path", default="sm120patch"),
        },
        supports_check_mode=True,
    )
    params = module.params
    exe = module.get_bin_path(params["executable"], required=True) if "/" not in params["executable"] else params["executable"]
    common = target(params) + selectors(params)
    force = ["--force"] if params["force"] else []

    if params["state"] == "present":
        with_ids = ["--with", ",".join(params["with"])] if params["with"] else []
        dry = [exe, "apply", *common, *with_ids, *force, "--dry-run", "--json"]
        result = {}
        if module.check_mode or module._diff:
            rc, document, _, err = run(module, dry)
            if rc != 0:
                fail(module, dry, rc, err, document)
            would = bool(document.get("would_change"))
            if module._diff:
                result["diff"] = {"prepared": diff_text(document)}
            if module.check_mode:
                module.exit_json(changed=would, report=document, exit_code=rc, **result)
        argv = [exe, "apply", *common, *with_ids, *force, *(["--build"] if params["build"] else []), "--json"]
        rc, document, _, err = run(module, argv)
        if rc != 0:
            fail(module, argv, rc, err, document)
        module.exit_json(changed=bool(document.get("changed")), report=document, exit_code=rc, **result)

    # absent
    if module.check_mode:
        # revert's own dry run: it counts what the run would change, the state a distribution
        # uninstalled while patched left behind included (status's "applied" did not).
        argv = [exe, "revert", *common, *force, "--dry-run", "--json"]
        rc, document, _, err = run(module, argv)
        if rc != 0:
            fail(module, argv, rc, err, document)
        module.exit_json(changed=bool(document.get("would_change")), report=document, exit_code=rc)
    argv = [exe, "revert", *common, *force, "--json"]
    rc, document, _, err = run(module, argv)
    if rc != 0:
        fail(module, argv, rc, err, document)
    module.exit_json(changed=bool(document.get("changed")), report=document, exit_code=rc)


if __name__ == "__main__":
    main()
