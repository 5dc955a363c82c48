# Runs inside the target interpreter for `sm120patch verify --runtime` (with a temporary
# FLASHINFER_WORKSPACE_BASE and the arch list set by the caller). argv[1]: JSON
# {"jit_spec": "module:function" or null, "modules": [dotted names of patched Python modules]}.
# Asks the distribution's own JIT for its spec, and imports every patched module (a missing
# import in a patch is a NameError no hash can show). Prints one JSON document.
import importlib
import json
import os
import sys
import traceback

request = json.loads(sys.argv[1])
out = {"jit_spec": None, "modules": {}}

try:
    import torch  # noqa: F401  (FlashInfer and SGLang need it; say so plainly when it is missing)
    torch_error = None
except Exception as exc:  # noqa: BLE001
    torch_error = "torch is not importable here (%s: %s)" % (type(exc).__name__, exc)

if request.get("jit_spec"):
    if torch_error:
        out["jit_spec"] = {"skipped": torch_error}
    else:
        module_name, _, function = request["jit_spec"].partition(":")
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # noqa: BLE001
            out["jit_spec"] = {"skipped": "%s does not import (%s: %s)" % (module_name, type(exc).__name__, exc)}
        else:
            try:
                spec = getattr(module, function)()
                out["jit_spec"] = {"flags": list(spec.extra_cuda_cflags or [])}
            except Exception as exc:  # noqa: BLE001
                out["jit_spec"] = {"error": "%s: %s" % (type(exc).__name__, exc)}

for name in request.get("modules", []):
    if torch_error:
        out["modules"][name] = {"skipped": torch_error}
        continue
    try:
        importlib.import_module(name)
        out["modules"][name] = {"ok": True}
    except ModuleNotFoundError as exc:
        # A dependency that is not installed here: the check cannot run, which says nothing
        # about the patch. A patched module's own missing name is a NameError/ImportError.
        if exc.name and not name.startswith(exc.name):
            out["modules"][name] = {"skipped": "its dependency %s is not installed here" % exc.name}
        else:
            out["modules"][name] = {"error": "ModuleNotFoundError: %s" % exc}
    except Exception as exc:  # noqa: BLE001
        # Only an error raised inside the patched module itself says something about the patch;
        # one raised while its parent packages import (FlashInfer's comm package asserts that
        # libcudart is loaded, which a machine without the CUDA runtime never has) means the
        # check cannot run here.
        own = (os.sep.join(name.split(".")) + ".py", os.sep.join(name.split(".") + ["__init__.py"]))
        frames = [frame.filename for frame in traceback.extract_tb(exc.__traceback__)]
        if any(filename.endswith(own) for filename in frames):
            out["modules"][name] = {"error": "%s: %s" % (type(exc).__name__, exc)}
        else:
            out["modules"][name] = {"skipped": "it cannot be imported here: %s: %s (raised while its packages "
                                               "import, before its own code runs)" % (type(exc).__name__, exc)}

print(json.dumps(out))
