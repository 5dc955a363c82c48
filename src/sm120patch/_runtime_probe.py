# Runs inside the target interpreter for `sm120patch verify --runtime`: asks FlashInfer's own
# JIT for the trtllm_comm spec with FLASHINFER_CUDA_ARCH_LIST set by the caller, and tries to
# import SGLang's patched module. Prints one JSON document.
import json
import sys

out = {"flashinfer": None, "sglang": None}

try:
    import torch  # noqa: F401  (flashinfer needs it; say so plainly when it is missing)
except Exception as exc:  # noqa: BLE001
    out["flashinfer"] = {"skipped": "torch is not importable here (%s: %s)" % (type(exc).__name__, exc)}
else:
    try:
        import flashinfer.jit.comm as comm
    except Exception as exc:  # noqa: BLE001
        out["flashinfer"] = {"skipped": "flashinfer.jit.comm does not import (%s: %s)" % (type(exc).__name__, exc)}
    else:
        try:
            spec = comm.gen_trtllm_comm_module()
            out["flashinfer"] = {"flags": list(spec.extra_cuda_cflags or [])}
        except Exception as exc:  # noqa: BLE001
            out["flashinfer"] = {"error": "%s: %s" % (type(exc).__name__, exc)}

if "sglang" in sys.argv[1:]:
    try:
        import sglang.srt.layers.communicator as communicator

        out["sglang"] = {"has_sm120_flag": hasattr(communicator, "_is_sm120_supported")}
    except Exception as exc:  # noqa: BLE001
        out["sglang"] = {"skipped": "sglang's dependencies are not installed here (%s: %s)" % (type(exc).__name__, exc)}

print(json.dumps(out))
