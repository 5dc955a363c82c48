"""On a real GPU, as a PCIe SM120 box answers: FlashInfer's SymmDeviceMemory (the unified trtllm
workspace's buffers) with multicast reported absent. tests/standin_driver.py (real=True) makes
CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED read 0 and refuses every cuMulticast* call before it
reaches the driver; everything else is the real driver and torch. Pristine FlashInfer 0.6.4
refuses; with unicast-workspace it allocates real device memory, which is written and read back.
Prints one JSON line. Run by `bash benchmarks/h200_session.sh unicast` (docs/fusion-paths.md)."""

import ctypes
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import standin_driver as sd  # noqa: E402

sd.install(real=True)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from cuda.bindings import driver  # noqa: E402

torch.cuda.set_device(0)
torch.empty(1, device="cuda")  # the primary context, as a server has it
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
import flashinfer.comm as comm  # noqa: E402
from flashinfer.comm.mnnvl import SymmDeviceMemory, TorchDistBackend  # noqa: E402

out = {"device": torch.cuda.get_device_name(0)}
try:
    # As trtllm_create_ipc_workspace_for_all_reduce_fusion(use_symm_dev_mem=True) makes each buffer.
    memory = SymmDeviceMemory(4 << 20, 1, 0, 0, TorchDistBackend(dist.group.WORLD), enable_multicast=False,
                              allocate_signal_pads=False)
    size = 1 << 16
    driver.cuMemsetD8(memory.uc_ptrs[0], 0x5A, size)
    host = (ctypes.c_ubyte * size)()
    driver.cuMemcpyDtoH(ctypes.addressof(host), memory.uc_ptrs[0], size)
    torch.cuda.synchronize()
    out["symm_dev_mem"] = {"allocated": True, "allocation_size": memory.allocation_size,
                           "written_and_read_back": all(b == 0x5A for b in host)}
except Exception as exc:  # noqa: BLE001
    out["symm_dev_mem"] = {"allocated": False, "error": "%s: %s" % (type(exc).__name__, exc)}
try:
    workspace = comm.create_allreduce_fusion_workspace(backend="trtllm", world_size=1, rank=0, max_token_num=128,
                                                       hidden_dim=4096, dtype=torch.bfloat16)
    out["unified_world_1"] = "created"
    workspace.destroy()
except Exception as exc:  # noqa: BLE001
    out["unified_world_1"] = "%s: %s" % (type(exc).__name__, str(exc).strip().splitlines()[-1] if str(exc).strip() else "")
out["multicast_calls"] = [c for c in sd.CALLS if c.startswith("cuMulticast")]
out["stand_in_calls"] = sorted(set(sd.CALLS))
print(json.dumps(out))
dist.destroy_process_group()  # not left to interpreter teardown, where gloo's threads can abort the process
