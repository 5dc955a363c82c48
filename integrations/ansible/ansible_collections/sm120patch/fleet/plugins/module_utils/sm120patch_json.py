# Copyright: sm120patch contributors
# Apache License 2.0 (see the repository's LICENSE terms in pyproject.toml)
"""What the read-only modules share: run one sm120patch command with --json and take its document."""

from __future__ import annotations

import json


def executable(module):
    """The sm120patch to run: a path as given, else looked up on the host's PATH."""
    exe = module.params["executable"]
    return exe if "/" in exe else module.get_bin_path(exe, required=True)


def run_json(module, argv):
    """(exit code, document) of ``argv``; a run that printed no document, or an error document,
    fails the task with sm120patch's own first line on stderr."""
    rc, out, err = module.run_command(argv)
    try:
        document = json.loads(out)
        if "error" in document:  # an error, as --json prints it: the stderr line says it as well
            raise ValueError(document["error"]["message"])
    except ValueError:
        lines = [line for line in err.splitlines() if line.strip()]
        module.fail_json(msg=f"{lines[0] if lines else f'sm120patch {argv[1]} printed no JSON'} (exit code {rc})",
                         exit_code=rc, cmd=" ".join(argv), stderr=err)
    return rc, document
