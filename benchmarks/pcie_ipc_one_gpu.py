"""The servers' PCIe-IPC allreduce + fused_add_rmsnorm exactly as `sm120patch bench --tune` makes
and checks it (its worker's make_pcie_ipc and pcie_ipc_row, run from src/), with N ranks on one
GPU (tests/one_gpu.py: a process per rank on GPU 0, gloo, CUDA IPC; the device-index shim in
every rank: multicast reported absent, every cuMulticast* refused before the driver).
Correctness only: the ranks are time-sliced, nothing is timed.

    python benchmarks/pcie_ipc_one_gpu.py run --world 2 --paths sglang-pcie-ipc,vllm-pcie-ipc \\
        --hidden 4096 --tokens 1,8,64,512,1024 --out pcie-ipc-tp2.json

Run it with the target interpreter (torch with CUDA, FlashInfer 0.7.0+ and its cuda-python and
nvidia-ml-py; SGLang 0.5.21+ or vLLM 0.30+ where their own classes should be used, else the
worker says they do not import and makes FlashInfer's workspace with their arguments). The
rows come from patches/<server>/distribution.toml ([[pcie_ipc]]), as sm120patch passes them.
Per rank and path: how it was made (or why not), then per token count whether the server
sends that size there, and where it does: the eager call and one CUDA-graph replay, each
against every rank's bf16 input summed in float32, residual added, RMSNorm in float32
(`bench`'s tolerance), with the sha256 of the outputs. FLASHINFER_AUTOTUNE_DIR is pointed into
the output directory so that FlashInfer's tune cache of the real machine is left alone; the
autotune still runs (as in the servers) and under time slicing it is slow: give --timeout room.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tomllib
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
import one_gpu  # noqa: E402

WORKER = ROOT / "src" / "sm120patch" / "bench" / "_bench_worker.py"
TOLERANCE = (2.0 ** -5, 2.0 ** -5)  # bench's for bf16 (runner.TOLERANCE)
EPS = 1e-6


def load_worker():
    spec = importlib.util.spec_from_file_location("bench_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def path_rows(names: list[str]) -> list[dict]:
    """The parent's rows for these paths (bench.pcie_ipc_paths without an installed server to
    name: "server" says the data row), read from the distributions' data."""
    rows = []
    for server in ("sglang", "vllm"):
        doc = tomllib.loads((ROOT / "patches" / server / "distribution.toml").read_text())
        for row in doc.get("pcie_ipc", []):
            if row["name"] in names:
                # "column": sm120patch.bench.limits.UNFUSED_PATHS's (not imported: it pulls in the CLI's needs)
                rows.append({"name": row["name"], "column": row["name"].replace("-", "_"), "code": row["code"],
                             "rows": row["rows"], "switch": row["switch"],
                             "server": f"{server} {row['versions']} with flashinfer-python {row['with']}"})
    return rows


def rank_main(args) -> None:
    rank, world = one_gpu.rank_and_world()
    out_dir = Path(os.environ["ONE_GPU_OUT"])
    os.environ.setdefault("FLASHINFER_AUTOTUNE_DIR", str(out_dir / "autotune"))
    sd = one_gpu.start_rank(shim=True)
    import torch
    import torch.distributed as dist

    w = load_worker()
    device, dtype, hidden = torch.device("cuda", 0), torch.bfloat16, args.hidden
    tokens = [int(t) for t in args.tokens.split(",")]
    records = []

    def record(**item):
        records.append(dict(item, rank=rank))
        with open(out_dir / f"rank{rank}.jsonl", "a") as handle:  # survives a kill
            handle.write(json.dumps(records[-1]) + "\n")

    group = dist.group.WORLD  # gloo: the servers pass their device (NCCL) group; NCCL refuses two ranks on one GPU
    cpu_group = dist.new_group(backend="gloo")
    for spec in path_rows(args.paths.split(",")):
        dist.barrier()
        try:
            made = w.make_pcie_ipc(spec, world, group, cpu_group, device, hidden, dtype, tokens, str(out_dir))
        except Exception as exc:  # noqa: BLE001 - the next path still runs
            record(path=spec["name"], event="raised", error=w.last_line(exc), where=traceback.format_exc()[-800:])
            continue
        record(path=spec["name"], event="made", info=made["info"])
        if made["allreduce"] is None:
            continue
        for n in tokens:
            x, residual, gamma = w.make_inputs(n, hidden, dtype, device, 0, rank)
            if not made["takes"](x):
                record(path=spec["name"], event="not-run", tokens=n)
                continue
            # The reference without a collective: every rank's input is a function of its rank.
            summed = sum(w.make_inputs(n, hidden, dtype, device, 0, r)[0].float() for r in range(world))
            ref_residual = summed + residual.float()
            ref_norm = ref_residual * torch.rsqrt(ref_residual.pow(2).mean(-1, keepdim=True) + EPS) * gamma.float()
            name, checked, timed, outputs, around = w.pcie_ipc_row(made, x, residual, gamma, EPS)
            result = {"path": spec["name"], "event": "checked", "tokens": n}
            try:
                checked()
                torch.cuda.synchronize()
                norm, res = outputs()
                result["eager"] = [w.tolerance_ok(norm, ref_norm, *TOLERANCE)[1],
                                   w.tolerance_ok(res, ref_residual, *TOLERANCE)[1], w.digest(norm)]
                with around() if around is not None else w.contextlib.nullcontext():
                    replay, graph = w.capture(timed, 1)
                residual_before = outputs()[1].clone()  # the graph adds into the residual in place
                replay()
                torch.cuda.synchronize()
                norm, res = outputs()
                again = residual_before.float() + summed
                again_norm = again * torch.rsqrt(again.pow(2).mean(-1, keepdim=True) + EPS) * gamma.float()
                result["graph"] = graph
                result["replay"] = max(w.tolerance_ok(norm, again_norm, *TOLERANCE)[1],
                                       w.tolerance_ok(res, again, *TOLERANCE)[1])
            except Exception as exc:  # noqa: BLE001
                result.update(event="raised", error=w.last_line(exc))
            record(**result)
        if made["destroy"] is not None:
            made["destroy"]()
    record(path=None, event="done", multicast_calls=[c for c in sd.CALLS if c.startswith("cuMulticast")])
    dist.barrier()
    dist.destroy_process_group()


def run(args) -> int:
    command = [sys.executable, __file__, "run", "--world", str(args.world), "--paths", args.paths,
               "--hidden", str(args.hidden), "--tokens", args.tokens, "--out", args.out]
    result, records = one_gpu.launch_and_collect(command, args.world, args.timeout, f"pcie-ipc-tp{args.world}-")
    document = {"world": args.world, "paths": args.paths.split(","), "hidden": args.hidden, "tokens": args.tokens,
                "tolerance": TOLERANCE, "launch": result, "records": records}
    Path(args.out).write_text(json.dumps(document, indent=1))
    print(f"PCIe-IPC paths at TP{args.world} on one GPU: {one_gpu.describe(result)}")
    for item in records:
        if item["rank"] == 0 or item["event"] in ("raised",):
            print("  " + json.dumps(item))
    bad = [i for i in records if i["event"] == "raised" or (i["event"] == "checked" and (
        max(i["eager"][:2]) > 1.0 or i["replay"] > 1.0))]
    return 1 if bad or result["hung"] or any(c not in (0, None) for c in result["exit_codes"]) else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--world", type=int, default=2)
    r.add_argument("--paths", default="sglang-pcie-ipc,vllm-pcie-ipc")
    r.add_argument("--hidden", type=int, default=4096)
    r.add_argument("--tokens", default="1,8,64,512,1024")
    r.add_argument("--out", default="pcie-ipc.json")
    r.add_argument("--timeout", type=float, default=540.0)
    args = parser.parse_args()
    if one_gpu.rank_and_world():
        rank_main(args)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
