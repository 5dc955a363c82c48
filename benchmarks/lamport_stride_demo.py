"""What FlashInfer's plain custom allreduce does on its lamport path at world size 2: the
`lamport-stride` bug (every gated release) made visible, before and after `sm120patch apply`.

`trtllm_custom_all_reduce` with RESIDUAL_RMS_NORM and ONESHOT takes the lamport one-shot
kernel when there are at most 16 tokens and the hidden size is at least 256. The host wrapper
of the gated releases writes the three lamport buffer sets at slots i + tp_size and
i + 2 * tp_size, while the kernel reads them at i + 16 and i + 32 (MAX_RANKS_PER_NODE): at
world size 2 the kernel reads slots nobody wrote. FlashInfer's own test never reaches this
path (its token counts are 64 and 128).

Run with the serving environment's interpreter on a machine with 2 GPUs (each rank one
process; the whole run is bounded by --timeout, a hang included):

    FLASHINFER_WORKSPACE_BASE=/tmp/ws python benchmarks/lamport_stride_demo.py --json out.json

or with every rank on one GPU (`--one-gpu`, tests/one_gpu.py: gloo instead of NCCL, CUDA IPC
between the processes of one device; the reference then sums every rank's input in float32 on
the CPU), at world size 2, 4 or 8: the host and kernel strides differ at every world size
below 16. `--rounds 1` runs the first round only (its calls use consecutive flags, so the
three lamport sets in turn until the first error).

The lamport buffer set a call uses is its barrier flag % 3. A CUDA error poisons a process's
context, so each set gets a fresh pair of processes (one round per starting flag 1, 2, 3);
in each round every rank makes --calls calls (consecutive flags) and compares the output with
NCCL allreduce + a float32 RMSNorm, stopping at the first exception.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import one_gpu  # noqa: E402  (the rank launcher, shared with cluster_clamp_gpu.py and one_gpu_ranks.py)

TOKENS = 8  # <= 16: the lamport kernel
HIDDEN = 4096
EPS = 1e-6


def first_line(exc: BaseException) -> str:
    """torch puts the CUDA error first and advice about debugging after it."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def worker(rank: int, world: int, first_flag: int, calls: int, dtype_name: str, one: bool) -> None:
    import torch
    import torch.distributed as dist

    import flashinfer.comm as comm

    index = 0 if one else rank
    torch.cuda.set_device(index)
    device = torch.device("cuda", index)
    dist.init_process_group("gloo" if one else "nccl")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    workspace = comm.trtllm_create_ipc_workspace_for_all_reduce(rank, world, 16, HIDDEN, group=dist.group.WORLD)
    ptrs = [torch.tensor(w, dtype=torch.int64) for w in workspace]
    generator = torch.Generator().manual_seed(1234)
    residual = torch.randn(TOKENS * HIDDEN, generator=generator).to(device, dtype)
    weight = torch.randn(HIDDEN, generator=generator).to(device, dtype)
    for flag in range(first_flag, first_flag + calls):
        x = torch.randn(TOKENS * HIDDEN, generator=torch.Generator().manual_seed(flag * 10 + rank)).to(device, dtype)
        out = torch.empty_like(x)
        inter = torch.zeros_like(x)
        record = {"rank": rank, "round": first_flag, "call": flag - first_flag + 1, "flag": flag, "lamport_set": flag % 3}
        dist.barrier()
        try:
            comm.trtllm_custom_all_reduce(
                inp=x, out=out, tp_size=world, tp_rank=rank, token_num=TOKENS,
                fusion_op_code=comm.AllReduceFusionOp.RESIDUAL_RMS_NORM,
                strategy_code=comm.AllReduceStrategyType.ONESHOT, config_code=0, launch_with_pdl=False,
                flag_value=flag, peer_comm_buffer_ptrs=ptrs[0], peer_barrier_ptrs_in=ptrs[2],
                peer_barrier_ptrs_out=ptrs[3], bias=None, residual=residual, weight=weight,
                weight_pre_residual_norm=None, eps=EPS, intermediate_buffer=inter,
                lamport_peer_comm_buffer_ptrs_0=ptrs[4], lamport_peer_comm_buffer_ptrs_1=ptrs[5],
                lamport_peer_comm_buffer_ptrs_2=ptrs[6])
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - what the pristine build does is the point
            record["error"] = first_line(exc)
            print("RESULT " + json.dumps(record), flush=True)
            return
        if one:  # gloo: every rank's input, summed in float32 on the CPU
            summed = x.float().cpu()
            dist.all_reduce(summed)
            summed = summed.to(device)
        else:
            summed = x.clone()
            dist.all_reduce(summed)
        added = (summed.float() + residual.float()).view(TOKENS, HIDDEN)
        ref = added * torch.rsqrt(added.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()
        err = (out.float().view(TOKENS, HIDDEN) - ref).abs()
        record.update(max_abs_err=float(err.max()), finite=bool(torch.isfinite(out.float()).all()),
                      ok=bool(torch.isclose(out.float().view(TOKENS, HIDDEN), ref, atol=2 ** -5, rtol=2 ** -5).all()),
                      out_abs_mean=float(out.float().abs().mean()), ref_abs_mean=float(ref.abs().mean()))
        print("RESULT " + json.dumps(record), flush=True)
    dist.barrier()
    comm.trtllm_destroy_ipc_workspace_for_all_reduce(workspace, group=dist.group.WORLD)
    dist.destroy_process_group()


def run_round(args, first_flag: int) -> dict:
    """One set of processes starting at ``first_flag``, bounded by --timeout."""
    log_dir = Path(tempfile.mkdtemp(prefix=f"lamport-demo-{first_flag}-"))
    launched = one_gpu.launch([sys.executable, __file__, *sys.argv[1:]], args.world, args.timeout, log_dir,
                              env={"LAMPORT_DEMO_FLAG": str(first_flag)}, visible="0" if args.one_gpu else None)
    records = []
    for rank in range(args.world):
        text = (log_dir / f"rank{rank}.log").read_text(errors="replace")
        records += [json.loads(line[7:]) for line in text.splitlines() if line.startswith("RESULT ")]
    tails = {rank: [line for line in lines if not line.startswith("RESULT ")][-3:]
             for rank, lines in launched["tails"].items()}
    return {"first_flag": first_flag, "hung": bool(launched["hung"]), "hung_ranks": launched["hung"],
            "elapsed_s": launched["elapsed_s"], "exit_codes": launched["exit_codes"], "records": records,
            "tails": tails}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per round")
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--one-gpu", action="store_true", help="every rank a process on GPU 0 (gloo, CUDA IPC)")
    parser.add_argument("--rounds", type=int, choices=(1, 2, 3), default=3, help="starting flags 1, 2, 3 (the first N)")
    args = parser.parse_args()
    if one_gpu.rank_and_world():
        worker(one_gpu.rank_and_world()[0], args.world, int(os.environ["LAMPORT_DEMO_FLAG"]), args.calls,
               args.dtype, args.one_gpu)
        return 0
    import flashinfer

    print(f"flashinfer {flashinfer.__version__}, world size {args.world}, {TOKENS} tokens x {HIDDEN}, {args.dtype}, "
          "RESIDUAL_RMS_NORM + ONESHOT (the lamport kernel); one set of processes per starting lamport set"
          + (", every rank on GPU 0" if args.one_gpu else ""))
    rounds = [run_round(args, first_flag) for first_flag in (1, 2, 3)[:args.rounds]]
    correct = total = 0
    for rnd in rounds:
        print(f"round starting at flag {rnd['first_flag']} (lamport set {rnd['first_flag'] % 3}):")
        for r in sorted(rnd["records"], key=lambda r: (r["call"], r["rank"])):
            total += 1
            where = f"    rank {r['rank']} flag {r['flag']} (set {r['lamport_set']}): "
            if "error" in r:
                print(where + f"raised {r['error']}")
                continue
            correct += r["ok"]
            print(where + f"{'correct' if r['ok'] else 'WRONG'}, max |out - ref| = {r['max_abs_err']:.4g}, "
                  f"mean |out| = {r['out_abs_mean']:.4g} (reference {r['ref_abs_mean']:.4g})"
                  + ("" if r["finite"] else ", non-finite values"))
        for rank, code in enumerate(rnd["exit_codes"]):
            state = f"killed after {args.timeout:.0f} s (hung)" if rank in rnd["hung_ranks"] else f"exit code {code}"
            print(f"    rank {rank}: {state}" + (f"; last output: {' | '.join(rnd['tails'][rank])}" if code != 0 else ""))
    print(f"{correct} of {args.world * args.calls * len(rounds)} rank-calls correct ({total} completed or raised)")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"flashinfer": flashinfer.__version__, "world": args.world, "dtype": args.dtype,
                       "one_gpu": args.one_gpu, "calls": args.calls, "correct": correct,
                       "tokens": TOKENS, "hidden": HIDDEN, "rounds": rounds}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
