"""The cluster clamp (cluster-clamp, cluster-clamp-moe, cluster-clamp-custom) on a real GPU, with
every rank a process of its own on one GPU (CUDA IPC between processes of one device, a gloo
process group for the host side; no NCCL, so several ranks can share a GPU).

Three subcommands:

    probe --site SITE --out probe.json
        compile a small program against SITE's installed (patched) headers and print what each
        launcher's GetMaxClusterSize answers for its lamport kernel on this device (the launchers
        keep the answer in a function-local static, so the module itself cannot be asked).
    run --world N --label L --out L.json
        with this interpreter's FlashInfer (and FLASHINFER_WORKSPACE_BASE as set), N processes on
        GPU 0 call trtllm_allreduce_fusion (legacy IPC workspace
        trtllm_create_ipc_workspace_for_all_reduce_fusion, kARResidualRMSNorm, bf16) for each
        shape and strategy; every rank records the sha256 of its norm and residual outputs and the
        error against a float32 reference (the bf16 inputs of every rank, summed in float32,
        then the residual add and RMSNorm in float32).
    compare A.json [B.json ...]
        a markdown table: per case, each run's max error, whether it is within tolerance, and
        whether B (and later documents) are bit-identical to A (every rank's outputs).

Ranks on one GPU are time-sliced: the kernels spin on flags their peers write, so a call takes
as long as the scheduler needs to run every rank once. This checks correctness only; its
timings mean nothing and are not recorded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import one_gpu  # noqa: E402  (the rank launcher, shared with one_gpu_ranks.py and lamport_stride_demo.py)

TOLERANCE = (2.0 ** -5, 2.0 ** -5)  # bf16, as `sm120patch bench` checks: |err| <= atol + rtol * |ref|
EPS = 1e-6
HIDDEN = (1024, 4096, 8192, 16384)
TOKENS = (1, 8, 16, 64, 128)
SAFE_ENV = one_gpu.SAFE_ENV

# The probe: each patched header's GetMaxClusterSize for the kernel its launcher asks about, with
# the launcher's block size (128 for the fused and MoE launchers, kWarpSize for the custom one).
PROBE = r"""
#include <cstdio>
#include "flashinfer/comm/trtllm_allreduce.cuh"
#include "flashinfer/comm/trtllm_allreduce_fusion.cuh"
#include "flashinfer/comm/trtllm_moe_allreduce_fusion.cuh"

namespace ar = flashinfer::trtllm_allreduce::reduce_fusion;
namespace fu = flashinfer::trtllm_allreduce_fusion;
namespace moe = flashinfer::trtllm_moe_allreduce_fusion;
using bf16 = __nv_bfloat16;

template <int N>
void row(bool first) {
  int fused = fu::GetMaxClusterSize(reinterpret_cast<void const*>(
      fu::allreduce_fusion_kernel_oneshot_lamport<fu::AllReduceFusionPattern::kARResidualRMSNorm, bf16, N, false>), 128);
  int reduce = moe::GetMaxClusterSize(reinterpret_cast<void const*>(
      moe::moereduce_allreduce_fusion_kernel_oneshot_lamport<bf16, N, true, true, true, false>), 128);
  int finalize = moe::GetMaxClusterSize(reinterpret_cast<void const*>(
      moe::moefinalize_allreduce_fusion_kernel_oneshot_lamport<bf16, N, true, true, false>), 128);
  int custom = ar::GetMaxClusterSize(reinterpret_cast<void const*>(
      ar::lamport_style_one_shot_all_reduce_norm_kernel<1, bf16, N, false, true>), flashinfer::trtllm_allreduce::details::kWarpSize);
  std::printf("%s{\"ranks\": %d, \"allreduce_fusion_kernel_oneshot_lamport\": %d, "
              "\"moereduce_allreduce_fusion_kernel_oneshot_lamport\": %d, "
              "\"moefinalize_allreduce_fusion_kernel_oneshot_lamport\": %d, "
              "\"lamport_style_one_shot_all_reduce_norm_kernel\": %d}",
              first ? "" : ", ", N, fused, reduce, finalize, custom);
}

int main() {
  int device = 0, cluster_launch = 0, major = 0, minor = 0, sms = 0;
  cudaSetDevice(device);
  cudaDeviceGetAttribute(&cluster_launch, cudaDevAttrClusterLaunch, device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  std::printf("{\"capability\": \"%d.%d\", \"sms\": %d, \"cluster_launch\": %d, \"kernels\": [", major, minor,
              sms, cluster_launch);
  row<2>(true);
  row<4>(false);
  row<8>(false);
  row<16>(false);
  std::printf("]}\n");
  return 0;
}
"""


def probe(args) -> int:
    include = Path(args.site) / "flashinfer" / "data" / "include"
    nvcc = os.environ.get("NVCC") or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    with tempfile.TemporaryDirectory() as tmp:
        source, exe = Path(tmp) / "probe.cu", Path(tmp) / "probe"
        source.write_text(PROBE)
        # FlashInfer 0.6.4's JIT flags for trtllm_comm (jit/core.py, jit/cpp_ext.py), so that the
        # kernels asked about use the registers the module's kernels use.
        cmd = [nvcc, "-std=c++17", f"-gencode=arch=compute_{args.arch},code=sm_{args.arch}", "-use_fast_math",
               "-DFLASHINFER_ENABLE_F16", "-DFLASHINFER_ENABLE_BF16", "-DFLASHINFER_ENABLE_FP8_E4M3",
               "-DFLASHINFER_ENABLE_FP8_E5M2", "-DFLASHINFER_ENABLE_FP8_E8M0", "-DFLASHINFER_ENABLE_FP4_E2M1",
               "--expt-relaxed-constexpr", "-static-global-template-stub=false", "-DNDEBUG", "-O3",
               f"-I{include}", f"-I{include.parent / 'spdlog' / 'include'}", str(source), "-o", str(exe)]
        start = time.monotonic()
        built = subprocess.run(cmd, capture_output=True, text=True)
        if built.returncode:
            print(built.stderr[-4000:], file=sys.stderr)
            return 1
        ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    document = json.loads(ran.stdout)
    document.update(headers=str(include), arch=args.arch, compile_s=round(time.monotonic() - start, 1),
                    nvcc=" ".join(cmd[:-4]))
    print(json.dumps(document))
    if args.out:
        Path(args.out).write_text(json.dumps(document, indent=2))
    return 0


def make_inputs(tokens: int, hidden: int, rank: int, device, dtype):
    import torch

    def randn(shape, salt):
        generator = torch.Generator().manual_seed(salt)
        return torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype)

    base = tokens * 131 + hidden
    x = randn((tokens, hidden), base * 17 + rank + 1)
    residual = randn((tokens, hidden), base * 17)
    gamma = randn((hidden,), hidden)
    return x.to(device), residual.to(device), gamma.to(device)


def reference(tokens: int, hidden: int, world: int, dtype):
    """The float32 reference of one case: every rank's input (as make_inputs makes it, in
    ``dtype``) summed in float32, the residual added, RMSNorm in float32. (norm, residual), on
    the CPU."""
    import torch

    total = sum(make_inputs(tokens, hidden, r, "cpu", dtype)[0].float() for r in range(world))
    _, residual, gamma = make_inputs(tokens, hidden, 0, "cpu", dtype)
    ref_residual = total + residual.float()
    return ref_residual * torch.rsqrt(ref_residual.pow(2).mean(-1, keepdim=True) + EPS) * gamma.float(), ref_residual


def digest(tensor) -> str:
    import torch

    return hashlib.sha256(tensor.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def worker(rank: int, world: int, out_dir: Path) -> None:
    import torch
    import torch.distributed as dist

    # CLAMP_DEVICE=cpu runs the script's own logic against a stand-in FlashInfer without a GPU.
    device = torch.device(os.environ.get("CLAMP_DEVICE", "cuda:0"))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    import flashinfer
    import flashinfer.comm as comm
    import flashinfer.comm.trtllm_ar as trtllm_ar

    if rank == 0:  # loaded (or built) once, before the others look at the cache
        trtllm_ar.get_trtllm_comm_module()
    dist.barrier(group=group)
    trtllm_ar.get_trtllm_comm_module()
    dtype = torch.bfloat16
    ipc_handles, workspace = trtllm_ar.trtllm_create_ipc_workspace_for_all_reduce_fusion(
        rank, world, max(TOKENS), max(HIDDEN), use_fp32_lamport=False, group=group)
    atol, rtol = TOLERANCE
    rows = []
    for hidden in HIDDEN:
        for tokens in TOKENS:
            for strategy in ("oneshot", "twoshot"):
                if strategy == "twoshot" and tokens <= world:
                    continue  # FlashInfer's two-shot splits the tokens over the ranks
                x, residual, gamma = make_inputs(tokens, hidden, rank, device, dtype)
                norm_out, residual_out = torch.empty_like(x), torch.empty_like(x)
                row = {"hidden": hidden, "tokens": tokens, "strategy": strategy, "rank": rank}
                dist.barrier(group=group)
                try:
                    comm.trtllm_allreduce_fusion(
                        allreduce_in=x, world_size=world, world_rank=rank, token_num=tokens, hidden_dim=hidden,
                        workspace_ptrs=workspace, launch_with_pdl=True, use_oneshot=strategy == "oneshot",
                        trigger_completion_at_end=False, fp32_acc=False,
                        pattern_code=comm.AllReduceFusionPattern.kARResidualRMSNorm,
                        allreduce_out=None, residual_in=residual, residual_out=residual_out, norm_out=norm_out,
                        quant_out=None, scale_out=None, rms_gamma=gamma, rms_eps=EPS, scale_factor=None,
                        layout_code=None)
                    sync()
                    if device.type == "cuda":
                        # A launch the driver refused (too many resources, say) is left as the
                        # runtime's last error, not raised: the next torch kernel launch reports it.
                        torch.empty(1, device=device).fill_(0)
                except Exception as exc:  # noqa: BLE001 - a refusal is a result here
                    row["error"] = first_line(exc)
                    rows.append(row)
                    with open(out_dir / f"rank{rank}.rows.jsonl", "a") as partial:
                        partial.write(json.dumps(row) + "\n")
                    continue
                ref_norm, ref_residual = reference(tokens, hidden, world, dtype)
                worst = 0.0
                for name, out, ref in (("norm", norm_out, ref_norm), ("residual", residual_out, ref_residual)):
                    out = out.float().cpu()
                    diff = (out - ref).abs()
                    ratio = float((diff / (atol + rtol * ref.abs())).max())
                    if not bool(torch.isfinite(out).all()):
                        ratio = float("inf")
                    row[f"max_err_{name}"] = float(diff.max())
                    worst = max(worst, ratio)
                row.update(worst_ratio=worst, ok=worst <= 1.0,
                           digests={"norm": digest(norm_out), "residual": digest(residual_out)})
                rows.append(row)
                with open(out_dir / f"rank{rank}.rows.jsonl", "a") as partial:  # survives a crash or a kill
                    partial.write(json.dumps(row) + "\n")
    dist.barrier(group=group)
    trtllm_ar.trtllm_destroy_ipc_workspace_for_all_reduce_fusion(ipc_handles, group=group)
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"flashinfer": flashinfer.__version__,
                                                         "file": flashinfer.__file__, "rows": rows}))
    dist.destroy_process_group()


def run(args) -> int:
    out_dir = Path(tempfile.mkdtemp(prefix=f"clamp-{args.label}-"))
    launched = one_gpu.launch([sys.executable, __file__, "run", "--world", str(args.world), "--label", args.label],
                              args.world, args.timeout, out_dir, env={"CLAMP_OUT": str(out_dir)})
    hung = bool(launched["hung"])
    ranks = {}
    for rank in range(args.world):
        path = out_dir / f"rank{rank}.json"
        ranks[rank] = json.loads(path.read_text()) if path.exists() else None
    document = {"label": args.label, "world": args.world, "hung": hung, "hung_ranks": launched["hung"],
                "elapsed_s": launched["elapsed_s"], "exit_codes": launched["exit_codes"], "tolerance": TOLERANCE,
                "flashinfer": next((r["flashinfer"] for r in ranks.values() if r), None),
                "file": next((r["file"] for r in ranks.values() if r), None),
                "rows": [row for r in ranks.values() if r for row in r["rows"]]}
    missing = [rank for rank, r in ranks.items() if r is None]
    for rank in missing:  # what a rank finished before it died or was killed
        partial = out_dir / f"rank{rank}.rows.jsonl"
        rows = [json.loads(line) for line in partial.read_text().splitlines()] if partial.exists() else []
        document["rows"] += [dict(row, partial=True) for row in rows]
    if missing:
        document["partial_ranks"] = missing
        document["tails"] = {rank: (out_dir / f"rank{rank}.log").read_text()[-1500:] for rank in missing}
    Path(args.out).write_text(json.dumps(document, indent=1))
    errors = sum("error" in row for row in document["rows"])
    ok = sum(bool(row.get("ok")) for row in document["rows"])
    print(f"{args.label}: world {args.world}, {len(document['rows'])} rank-cases, {ok} within tolerance, "
          f"{errors} raised; {one_gpu.describe(launched)}")
    for rank, tail in document.get("tails", {}).items():
        print(f"  rank {rank} wrote no result; last output:\n{tail}")
    return 0 if not missing and not hung else 1


def compare(args) -> int:
    docs = [json.loads(Path(p).read_text()) for p in args.documents]
    base = docs[0]
    key = lambda r: (r["hidden"], r["tokens"], r["strategy"])  # noqa: E731
    cases = sorted({key(r) for d in docs for r in d["rows"]})
    atol, rtol = base["tolerance"]
    labels = [f"{d['label']} (TP{d['world']})" for d in docs]
    print(f"tolerance |err| <= {atol:g} + {rtol:g}·|ref| against the float32 reference (norm and residual "
          f"outputs, every rank)")
    header = ["hidden", "tokens", "path"] + [f"{label} max err" for label in labels]
    header += [f"{label} bit-identical to {labels[0]}" for label in labels[1:]]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    identical = [0] * len(docs)
    within = [0] * len(docs)
    for case in cases:
        cells = [str(case[0]), str(case[1]), case[2]]
        per_doc = [sorted((r for r in d["rows"] if key(r) == case), key=lambda r: r["rank"]) for d in docs]
        for index, rows in enumerate(per_doc):
            if not rows:
                cells.append("not run")
            elif any("error" in r for r in rows):
                cells.append("raised: " + next(r["error"] for r in rows if "error" in r)[:90])
            else:
                err = max(max(r["max_err_norm"], r["max_err_residual"]) for r in rows)
                complete = len(rows) == docs[index]["world"]
                good = all(r["ok"] for r in rows) and complete
                within[index] += good
                cells.append(f"{err:.4g}" + ("" if good else " (OVER)" if complete else
                                             f" ({len(rows)} of {docs[index]['world']} ranks)"))
        for index in range(1, len(docs)):
            a, b = per_doc[0], per_doc[index]
            if not a or not b or any("error" in r for r in a + b):
                cells.append("n/a")
                continue
            same = len(a) == len(b) and all(x["digests"] == y["digests"] for x, y in zip(a, b))
            identical[index] += same
            cells.append("yes" if same else "NO")
        print("| " + " | ".join(cells) + " |")
    for index, label in enumerate(labels):
        line = f"{label}: {within[index]} of {len(cases)} cases within tolerance on every rank"
        if index:
            line += f"; {identical[index]} bit-identical to {labels[0]}"
        print(line)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("probe")
    p.add_argument("--site", required=True)
    p.add_argument("--arch", default="90a")
    p.add_argument("--out")
    r = sub.add_parser("run")
    r.add_argument("--world", type=int, default=2)
    r.add_argument("--label", default="run")
    r.add_argument("--out", default="run.json")
    r.add_argument("--timeout", type=float, default=240.0)
    c = sub.add_parser("compare")
    c.add_argument("documents", nargs="+")
    args = parser.parse_args()
    if args.command == "probe":
        return probe(args)
    if args.command == "run":
        if one_gpu.rank_and_world():
            worker(one_gpu.rank_and_world()[0], args.world, Path(os.environ["CLAMP_OUT"]))
            return 0
        return run(args)
    return compare(args)


if __name__ == "__main__":
    sys.exit(main())
