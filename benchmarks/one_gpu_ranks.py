"""FlashInfer's fused allreduce + residual + RMSNorm through each workspace path, and through the
servers' own code, with N ranks on one GPU (tests/one_gpu.py: a process per rank on GPU 0, gloo,
CUDA IPC; the device-index shim in every rank: multicast reported absent, every cuMulticast*
refused before the driver, device indices mapped to 0). Correctness only: the ranks are
time-sliced, no timing is recorded.

    run --world N --label L --suites legacy,unified,sglang-0.5.9,vllm-0.19.0 \\
        [--server sglang-0.5.9=PATH ...] --out L-tpN.json
        with this interpreter's FlashInfer (FLASHINFER_WORKSPACE_BASE as set), N ranks run each
        suite in turn; every rank records, per case, the error of its norm and residual outputs
        against a float32 reference (every rank's bf16 input summed in float32, the residual
        added, RMSNorm in float32) and their sha256; per suite, how its workspace came about
        (created, the server's fall-back and the lines it logged, or the exception).
    table A.json [B.json ...]
        a markdown table: per suite and TP, each document's outcome, its cases within tolerance,
        and how many are bit-identical to the first document's.

Suites:
  legacy         trtllm_create_ipc_workspace_for_all_reduce_fusion + trtllm_allreduce_fusion
                 (what SGLang <= 0.5.9 and vLLM <= 0.16 call)
  unified        create_allreduce_fusion_workspace(backend="trtllm") + allreduce_fusion
                 (what SGLang 0.5.10+ and vLLM 0.17+ call)
  sglang-VER     SGLang's flashinfer_comm_fusion.py of that release (PATH: the wheel's file or
                 sm120patch's patched bytes), loaded with tests/standin_driver.py's
                 load_plain_functions(whole=True): its own workspace manager (0.5.11+: with its
                 preflight) and its own flashinfer_allreduce_residual_rmsnorm. Stood in for:
                 SGLang's parallel-state getters (this gloo group, this rank, one node), the
                 server's arguments (--flashinfer-allreduce-fusion-backend at its default, auto,
                 one node) and is_sm90/sm100_supported (read from torch's capability)
  sglang-tuned-VER
                 SGLang's layer of that release patched with the opt-in tuned-limits (PATH: a
                 directory from `servers`: its fusion predicate's file, its fused-call file, and
                 suite.json naming the predicate), issue #52: for each batch size, the release's
                 own predicate decides whether to fuse, and its own flashinfer_allreduce_residual_
                 rmsnorm, called as layernorm.py calls it, hands the kernel the one-shot choice;
                 under three profiles in turn (tuned: one written on this box by the inserted
                 code's own fingerprint, fused up to 64 tokens and one-shot up to 16 at TP2 and
                 TP4; none; a corrupt one). A batch not fused takes the unfused path (the allreduce,
                 then FlashInfer's fused_add_rmsnorm, as the server's RMSNorm does). Every path's
                 outputs are checked against the float32 reference. Stood in for: the device's
                 SM120 answers (the predicate's is_sm120_supported, and torch's capability while the
                 predicate decides: the kernels run on this GPU as they are), and what the inserted
                 code reads of the server (the parallel state of this group, the server's arguments
                 with fusion on, the hidden size), in the modules each release keeps them in; the
                 inserted code runs as patched (0.5.9, and 0.5.21+ whose layer is add_norm.py)
  vllm-VER       vLLM's flashinfer_all_reduce.py of that release: its own get_fi_ar_workspace
                 (backend auto, one node), then FlashInfer's allreduce_fusion with that workspace
                 as vLLM's fusion pass's op calls it (kARResidualRMSNorm, PDL, fp32_acc)

Every fused call is made with fp32_acc=True (the kernels' float32 accumulation, an argument of
FlashInfer's calls and of SGLang's function): with bf16 accumulation the kernels' error at 8 ranks
exceeds the bf16 tolerance against a float32 reference for pristine and patched alike
(docs/h200.md, cluster clamp); fp32 accumulation makes the reference test meaningful at TP8.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))
import one_gpu  # noqa: E402
from cluster_clamp_gpu import EPS, TOLERANCE, digest, first_line, make_inputs, reference  # noqa: E402

HIDDEN = 4096  # one hidden size: SGLang sizes its workspace lazily from the first call, as a server has one
CASES = [(1, "oneshot"), (8, "oneshot"), (16, "oneshot"), (16, "twoshot"), (64, "oneshot"), (64, "twoshot"),
         (128, "oneshot"), (128, "twoshot")]
MAX_TOKENS = 128


class Rank:
    def __init__(self, rank: int, world: int, out_dir: Path, sd):
        import torch

        self.rank, self.world, self.out_dir, self.sd = rank, world, out_dir, sd
        self.device = torch.device("cuda", 0)
        self.dtype = torch.bfloat16

    def write(self, record: dict) -> None:
        with open(self.out_dir / f"rank{self.rank}.jsonl", "a") as handle:  # survives a crash or a kill
            handle.write(json.dumps(dict(record, rank=self.rank)) + "\n")

    def check(self, suite: str, tokens: int, strategy: str, norm_out, residual_out, **extra) -> None:
        import torch

        atol, rtol = TOLERANCE
        ref_norm, ref_residual = reference(tokens, HIDDEN, self.world, self.dtype)
        row = {"suite": suite, "hidden": HIDDEN, "tokens": tokens, "strategy": strategy, **extra}
        worst = 0.0
        for name, out, ref in (("norm", norm_out, ref_norm), ("residual", residual_out, ref_residual)):
            out = out.float().cpu()
            diff = (out - ref).abs()
            ratio = float((diff / (atol + rtol * ref.abs())).max()) if torch.isfinite(out).all() else float("inf")
            row[f"max_err_{name}"] = float(diff.max())
            worst = max(worst, ratio)
        row.update(worst_ratio=worst, ok=worst <= 1.0, digests={"norm": digest(norm_out), "residual": digest(residual_out)})
        self.write(row)

    def cases(self, suite: str, fused) -> None:
        """``fused(x, residual, gamma, tokens, strategy)`` -> (norm_out, residual_out), or None
        where the caller's code fell back (then the suite stops: a server turns fusion off)."""
        import torch
        import torch.distributed as dist

        for tokens, strategy in CASES:
            if strategy == "twoshot" and tokens <= self.world:
                continue  # two-shot splits the tokens over the ranks
            x, residual, gamma = make_inputs(tokens, HIDDEN, self.rank, self.device, self.dtype)
            dist.barrier()
            try:
                outs = fused(x, residual, gamma, tokens, strategy)
                torch.cuda.synchronize()
                torch.empty(1, device=self.device).fill_(0)  # a launch the driver refused surfaces here
            except Exception as exc:  # noqa: BLE001 - a refusal is a result
                self.write({"suite": suite, "hidden": HIDDEN, "tokens": tokens, "strategy": strategy,
                            "error": first_line(exc)})
                continue
            if outs is None or outs[0] is None:
                self.write({"suite": suite, "event": "fell back", "tokens": tokens, "strategy": strategy})
                return
            self.check(suite, tokens, strategy, *outs)

    def event(self, suite: str, outcome: str, **extra) -> None:
        self.write({"suite": suite, "event": outcome, **extra})


def legacy(r: Rank) -> None:
    import torch.distributed as dist

    from flashinfer.comm import trtllm_ar

    made = trtllm_ar.trtllm_create_ipc_workspace_for_all_reduce_fusion(r.rank, r.world, MAX_TOKENS, HIDDEN,
                                                                       use_fp32_lamport=False, group=dist.group.WORLD)
    ipc_handles, workspace = made[0], made[1]
    r.event("legacy", "workspace created")

    def fused(x, residual, gamma, tokens, strategy):
        norm_out, residual_out = x.new_empty(x.shape), x.new_empty(x.shape)
        trtllm_ar.trtllm_allreduce_fusion(
            allreduce_in=x, world_size=r.world, world_rank=r.rank, token_num=tokens, hidden_dim=HIDDEN,
            workspace_ptrs=workspace, launch_with_pdl=True, use_oneshot=strategy == "oneshot",
            trigger_completion_at_end=False, fp32_acc=True,
            pattern_code=trtllm_ar.AllReduceFusionPattern.kARResidualRMSNorm, allreduce_out=None,
            residual_in=residual, residual_out=residual_out, norm_out=norm_out, quant_out=None, scale_out=None,
            rms_gamma=gamma, rms_eps=EPS, scale_factor=None, layout_code=None)
        return norm_out, residual_out

    r.cases("legacy", fused)
    dist.barrier()
    try:
        trtllm_ar.trtllm_destroy_ipc_workspace_for_all_reduce_fusion(ipc_handles, group=dist.group.WORLD)
    except Exception as exc:  # noqa: BLE001 - the cases are done; a release's other destroy signature is not one
        r.event("legacy", "destroy raised", error=first_line(exc))


def unified_fused(r: Rank, workspace):
    import flashinfer.comm as comm

    def fused(x, residual, gamma, tokens, strategy):
        norm_out, residual_out = x.new_empty(x.shape), x.new_empty(x.shape)
        comm.allreduce_fusion(input=x, workspace=workspace, pattern=comm.AllReduceFusionPattern.kARResidualRMSNorm,
                              launch_with_pdl=True, residual_out=residual_out, norm_out=norm_out, residual_in=residual,
                              rms_gamma=gamma, rms_eps=EPS, use_oneshot=strategy == "oneshot", fp32_acc=True)
        return norm_out, residual_out

    return fused


def unified(r: Rank) -> None:
    import flashinfer.comm as comm

    workspace = comm.create_allreduce_fusion_workspace(backend="trtllm", world_size=r.world, rank=r.rank,
                                                       max_token_num=MAX_TOKENS, hidden_dim=HIDDEN, dtype=r.dtype)
    r.event("unified", "workspace created", backend=getattr(workspace, "backend", None))
    r.cases("unified", unified_fused(r, workspace))
    workspace.destroy()


def sglang_names(r: Rank) -> dict:
    """SGLang's parallel-state getters, answered for this gloo group (every TP group is WORLD,
    one node, no expert parallelism), and the two non-parallel-state names its fused path reads."""
    import torch
    import torch.distributed as dist

    world_group = dist.group.WORLD
    coordinator = types.SimpleNamespace(world_size=r.world, rank_in_group=r.rank, device_group=world_group,
                                        cpu_group=world_group)
    parallel = types.SimpleNamespace(tp_size=r.world, tp_rank=r.rank, attn_tp_size=r.world, attn_tp_rank=r.rank,
                                     moe_ep_size=1, moe_ep_rank=0, moe_tp_size=r.world, moe_tp_rank=r.rank)
    major = torch.cuda.get_device_capability(0)[0]
    return {
        "is_flashinfer_available": lambda: True,
        "get_tensor_model_parallel_world_size": lambda: r.world,
        "get_attn_tensor_model_parallel_world_size": lambda: r.world,
        "get_attn_tensor_model_parallel_rank": lambda: r.rank,
        "get_moe_expert_parallel_world_size": lambda: 1,
        "get_moe_expert_parallel_rank": lambda: 0,
        "get_moe_tensor_parallel_world_size": lambda: r.world,
        "get_moe_tensor_parallel_rank": lambda: r.rank,
        "get_parallel": lambda: parallel,
        "get_tp_group": lambda: coordinator,
        "get_attn_tp_group": lambda: coordinator,
        "get_moe_tp_group": lambda: coordinator,
        "get_moe_ep_group": lambda: coordinator,
        "in_the_same_node_as": lambda group, source_rank=0: [True] * r.world,
        # Not parallel state: the server's flags as `--enable-flashinfer-allreduce-fusion` leaves
        # the backend (auto) on one node, and SGLang's capability helpers as this GPU answers.
        "get_global_server_args": lambda: types.SimpleNamespace(flashinfer_allreduce_fusion_backend="auto", nnodes=1),
        "is_sm90_supported": lambda device=None: major == 9,
        "is_sm100_supported": lambda device=None: major == 10,
    }


def sglang(r: Rank, suite: str, path: str) -> None:
    sd = r.sd
    logged: list[str] = []
    module = sd.load_plain_functions(path, f"sglang_fusion_{suite.replace('.', '_')}", logged, sglang_names(r),
                                     whole=True)
    before = len(sd.CALLS)

    def fused(x, residual, gamma, tokens, strategy):
        return module.flashinfer_allreduce_residual_rmsnorm(input_tensor=x, residual=residual, weight=gamma, eps=EPS,
                                                           use_oneshot=strategy == "oneshot", fp32_acc=True)

    try:
        r.cases(suite, fused)
    finally:
        r.event(suite, "log", log=logged, shim_calls=sorted(set(sd.CALLS[before:])))


# sglang-tuned-VER: the profile's limits at hidden 4096, bf16, for TP2 and TP4 (tokens), and the
# batch sizes asked: each side of both limits, and of the ranks' count (two-shot needs more tokens).
TUNED_TOKENS = {"fused": 64, "oneshot": 16}
TUNED_BATCHES = (1, 2, 3, 4, 5, 8, 16, 17, 32, 64, 65, 128)


def tuned_profiles(r: Rank, predicate) -> dict:
    """Rank 0 writes the suite's profiles, the tuned one with the inserted code's own view of this
    box and NCCL settings (what the server judges it by); every rank gets their paths."""
    import torch.distributed as dist

    paths = {"tuned": r.out_dir / "tuned.json", "none": r.out_dir / "absent.json", "corrupt": r.out_dir / "corrupt.json"}
    if r.rank == 0:
        import flashinfer

        entry = {"created": "2026-12-05T00:00:00Z", "software": {"flashinfer-python": flashinfer.__version__},
                 "nccl_env": predicate._sm120patch_nccl_env(), "dtype": "bf16", "hidden": HIDDEN,
                 "fused_max_bytes": TUNED_TOKENS["fused"] * HIDDEN * 2,
                 "oneshot_max_bytes": TUNED_TOKENS["oneshot"] * HIDDEN * 2}
        paths["tuned"].write_text(json.dumps({"kind": "sm120patch tuned limits", "format": 1,
                                              "box": predicate._sm120patch_box(),
                                              "entries": {"2": entry, "4": entry}}))
        paths["corrupt"].write_text('{"kind": "sm120patch tuned limits", "format": 1, "box": ')
    dist.barrier()
    return paths


def sglang_tuned(r: Rank, suite: str, path: str) -> None:
    import logging

    import torch
    import torch.distributed as dist
    from flashinfer.comm import trtllm_ar
    from flashinfer.norm import fused_add_rmsnorm

    sd, directory = r.sd, Path(path)
    spec = json.loads((directory / "suite.json").read_text())
    logged: list[str] = []

    class Handler(logging.Handler):
        def emit(self, record):
            logged.append(record.getMessage())

    logging.getLogger().addHandler(Handler())
    logging.getLogger().setLevel(logging.INFO)
    where = spec.get("module", "sglang.srt.layers.communicator")  # the predicate's module in this release
    predicate = sd.load_predicate(str(directory / "predicate.py"), spec["predicate"], sd.sglang_predicate_names(torch),
                                  name=where)
    # What the inserted code asks of the rest of the server (each release's _sm120patch_sglang_served
    # imports it from where that release keeps it): the parallel state of this gloo group, the
    # server's arguments with fusion on, no DP attention, the served model's hidden size. The
    # inserted code itself runs as patched: nothing of it is replaced.
    names = sglang_names(r)
    server_args = types.SimpleNamespace(enable_flashinfer_allreduce_fusion=True,
                                        flashinfer_allreduce_fusion_backend="trtllm", nnodes=1)
    served = {
        "sglang.srt.distributed": {"get_tensor_model_parallel_world_size": names["get_tensor_model_parallel_world_size"]},
        "sglang.srt.layers.dp_attention": {"get_dp_hidden_size": lambda: HIDDEN, "is_dp_attention_enabled": lambda: False},
        "sglang.srt.server_args": {"get_global_server_args": lambda: server_args},
        "sglang.srt.runtime_context": {"get_parallel": names["get_parallel"],
                                       "get_exec": lambda: types.SimpleNamespace(comm=server_args)},
    }
    for dotted, attributes in served.items():
        for depth in range(1, dotted.count(".") + 1):
            sys.modules.setdefault(".".join(dotted.split(".")[:depth]), types.ModuleType(".".join(dotted.split(".")[:depth])))
        sys.modules.setdefault(dotted, types.ModuleType(dotted)).__dict__.update(attributes)
    for depth in range(1, where.count(".") + 1):
        sys.modules.setdefault(".".join(where.split(".")[:depth]), types.ModuleType(".".join(where.split(".")[:depth])))
    sys.modules[where] = predicate  # where the fused call's module asks

    real_capability = torch.cuda.get_device_capability

    def deciding(tokens):
        """The predicate's answer with the device answering as an SM120 GPU (this one is not): the
        inserted code asks torch once per process, at its first decision, and keeps the answer."""
        torch.cuda.get_device_capability = lambda device=None: (12, 0)
        try:
            return bool(getattr(predicate, spec["predicate"])(tokens))
        finally:
            torch.cuda.get_device_capability = real_capability
    module = sd.load_plain_functions(str(directory / "fusion.py"), f"sglang_fusion_{suite.replace('.', '_')}", logged,
                                     sglang_names(r), whole=True)
    handed: list = []

    class Recorder:  # FlashInfer's comm package, recording the one-shot choice the kernel is handed
        def __init__(self, comm):
            self.comm = comm

        def __getattr__(self, name):
            return getattr(self.comm, name)

        def trtllm_allreduce_fusion(self, **kwargs):
            handed.append(kwargs["use_oneshot"])
            return self.comm.trtllm_allreduce_fusion(**kwargs)

    module._flashinfer_comm = Recorder(module._flashinfer_comm)
    for profile, where in tuned_profiles(r, predicate).items():
        os.environ["SM120PATCH_TUNED_LIMITS"] = str(where)
        for cache in ("_SM120PATCH_SEEN", "_SM120PATCH_TOKENS", "_SM120PATCH_DEVICE"):  # a fresh server process,
            predicate.__dict__.get(cache, {}).clear()                                  # as far as the inserted code can tell
        del logged[:]
        for tokens in TUNED_BATCHES:
            x, residual, gamma = make_inputs(tokens, HIDDEN, r.rank, r.device, r.dtype)
            fuses = deciding(tokens)
            dist.barrier()
            try:
                if fuses:
                    handed.clear()
                    norm_out, residual_out = module.flashinfer_allreduce_residual_rmsnorm(
                        input_tensor=x, residual=residual, weight=gamma, eps=EPS)
                    given = handed[-1] if handed else "no kernel call"
                    oneshot = given if given is not None else trtllm_ar._should_use_oneshot(tokens, HIDDEN, r.dtype,
                                                                                           r.world)
                    strategy = "oneshot" if oneshot else "twoshot"
                else:
                    given, strategy = None, "unfused"
                    host = x.float().cpu()
                    dist.all_reduce(host)  # gloo: NCCL refuses two ranks on one GPU
                    norm_out, residual_out = x.new_empty(x.shape).copy_(host), residual.clone()
                    fused_add_rmsnorm(norm_out, residual_out, gamma, EPS)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a refusal is a result
                r.write({"suite": suite, "profile": profile, "tokens": tokens, "error": first_line(exc)})
                continue
            r.check(suite, tokens, strategy, norm_out, residual_out, profile=profile, fuses=fuses, handed=given)
        r.event(suite, "log", profile=profile, log=[line for line in logged if "sm120patch" in line])


def vllm(r: Rank, suite: str, path: str) -> None:
    import torch.distributed as dist

    sd = r.sd
    logged: list[str] = []
    # VLLM_FLASHINFER_ALLREDUCE_BACKEND at its default; one node (vLLM's get_node_count).
    envs = types.SimpleNamespace(VLLM_FLASHINFER_ALLREDUCE_BACKEND="auto", VLLM_ALLREDUCE_USE_FLASHINFER=False)
    manager = sd.load_plain_functions(path, f"vllm_fi_ar_{suite.replace('.', '_')}", logged,
                                      {"envs": envs, "get_node_count": lambda *a, **k: 1,
                                       "_node_count": lambda *a, **k: 1})
    try:
        workspace = manager.get_fi_ar_workspace(r.world, r.rank, MAX_TOKENS, HIDDEN, r.dtype, dist.group.WORLD)
        if workspace is None:
            r.event(suite, "fell back")
        else:
            r.event(suite, "workspace created", backend=getattr(workspace, "backend", None))
            r.cases(suite, unified_fused(r, workspace))
    finally:
        r.event(suite, "log", log=logged)


def worker(args) -> None:
    rank, world = one_gpu.rank_and_world()
    out_dir = Path(os.environ["ONE_GPU_OUT"])
    sd = one_gpu.start_rank(shim=True)
    import torch.distributed as dist

    import flashinfer
    from flashinfer.comm import trtllm_ar

    r = Rank(rank, world, out_dir, sd)
    r.event("process", "started", flashinfer=flashinfer.__version__, file=flashinfer.__file__)
    if rank == 0:  # loaded (or built) once, before the others look at the cache
        trtllm_ar.get_trtllm_comm_module()
    dist.barrier()
    trtllm_ar.get_trtllm_comm_module()
    servers = dict(item.split("=", 1) for item in args.server)
    for suite in args.suites.split(","):
        dist.barrier()
        try:
            if suite == "legacy":
                legacy(r)
            elif suite == "unified":
                unified(r)
            elif suite.startswith("sglang-tuned-"):
                sglang_tuned(r, suite, servers[suite])
            elif suite.startswith("sglang-"):
                sglang(r, suite, servers[suite])
            elif suite.startswith("vllm-"):
                vllm(r, suite, servers[suite])
            else:
                raise SystemExit(f"unknown suite {suite}")
        except Exception as exc:  # noqa: BLE001 - the next suite still runs
            r.event(suite, "raised", error=first_line(exc), where=traceback.format_exc().splitlines()[-3:])
    r.event("process", "done", multicast_calls=[c for c in sd.CALLS if c.startswith("cuMulticast")],
            mapped_calls=sorted({c.split("(")[0] for c in sd.CALLS if "->0)" in c}))
    dist.barrier()
    dist.destroy_process_group()


def run(args) -> int:
    command = [sys.executable, __file__, "run", "--world", str(args.world), "--label", args.label, "--suites",
               args.suites, *[a for s in args.server for a in ("--server", s)]]
    result, records = one_gpu.launch_and_collect(command, args.world, args.timeout, f"one-gpu-{args.label}-tp{args.world}-")
    started = next((rec for rec in records if rec.get("event") == "started"), {})
    document = {"label": args.label, "world": args.world, "suites": args.suites.split(","),
                "servers": dict(item.split("=", 1) for item in args.server), "flashinfer": started.get("flashinfer"),
                "file": started.get("file"), "tolerance": TOLERANCE, "launch": result, "records": records}
    Path(args.out).write_text(json.dumps(document, indent=1))
    print(f"{args.label} TP{args.world} (flashinfer {document['flashinfer']}): {one_gpu.describe(result)}")
    for line in summary(document):
        print("  " + line)
    for rank in result["hung"] + [r for r, c in enumerate(result["exit_codes"]) if c not in (0, None)]:
        print(f"  rank {rank} last output: " + " | ".join(result["tails"][rank]))
    return 0 if not result["hung"] and all(c == 0 for c in result["exit_codes"]) else 1


def outcome(document: dict, suite: str) -> dict:
    """What one suite did in one document: its workspace, its cases, on every rank."""
    world = document["world"]
    recs = [r for r in document["records"] if r.get("suite") == suite]
    events = [r for r in recs if "event" in r]
    rows = [r for r in recs if "event" not in r]
    cases = {}
    for row in rows:
        cases.setdefault((row["tokens"], row["strategy"]), []).append(row)
    complete = {k: v for k, v in cases.items() if len(v) == world and all("error" not in x for x in v)}
    ok = sum(all(x["ok"] for x in v) for v in complete.values())
    raised = sorted({e["error"] for e in events if e["event"] == "raised"}
                    | {x["error"] for v in cases.values() for x in v if "error" in x})
    fell = any(e["event"] == "fell back" for e in events)
    logs = sorted({line for e in events if e["event"] == "log" for line in e.get("log", [])})
    worst = max((max(x["max_err_norm"], x["max_err_residual"]) for v in complete.values() for x in v), default=None)
    return {"cases": cases, "complete": complete, "ok": ok, "raised": raised, "fell_back": fell, "log": logs,
            "worst": worst, "ran": bool(recs)}


def summary(document: dict) -> list[str]:
    lines = []
    for suite in document["suites"]:
        o = outcome(document, suite)
        text = f"{suite}: "
        if not o["ran"]:
            text += "not reached"
        elif o["fell_back"]:
            text += "fell back"
        elif o["complete"]:
            text += f"{o['ok']} of {len(o['complete'])} cases within tolerance (max |err| {o['worst']:.4g})"
        if o["raised"]:
            text += ("; " if o["complete"] or o["fell_back"] else "") + "raised: " + " / ".join(o["raised"])[:300]
        lines.append(text)
        lines += [f"    log: {line[:300]}" for line in o["log"] if "fusion" in line.lower() or "fail" in line.lower()]
    return lines


def table(args) -> int:
    docs = [json.loads(Path(p).read_text()) for p in args.documents]
    print("| suite | TP | " + " | ".join(f"{d['label']} (TP{d['world']})" for d in docs)
          + " | bit-identical to the first run of its TP |")
    print("|" + " --- |" * (3 + len(docs)))
    keys = sorted({(s, d["world"]) for d in docs for s in d["suites"]}, key=lambda k: (k[0], k[1]))
    for suite, world in keys:
        cells, runs = [], []
        for d in docs:
            if d["world"] != world or suite not in d["suites"]:
                cells.append("not run")
                continue
            o = outcome(d, suite)
            runs.append(o)
            if o["fell_back"]:
                cell = "fell back"
            elif o["complete"]:
                cell = f"{o['ok']}/{len(o['complete'])} within tolerance"
            else:
                cell = "no case ran" if not o["raised"] else ""
            if o["raised"]:
                cell += (" " if cell else "") + "raised: " + o["raised"][0][:80]
            if d["launch"]["hung"]:
                cell += f" (rank(s) {d['launch']['hung']} hung)"
            cells.append(cell)
        same = []
        for other in runs[1:]:  # against the first document of this TP
            a, b = runs[0]["complete"], other["complete"]
            both = set(a) & set(b)
            if both:
                equal = sum(all(x["digests"] == y["digests"] for x, y in
                                zip(sorted(a[k], key=lambda z: z["rank"]), sorted(b[k], key=lambda z: z["rank"])))
                            for k in both)
                same.append(f"{equal}/{len(both)}")
        print(f"| {suite} | {world} | " + " | ".join(cells) + f" | {', '.join(same) or 'n/a'} |")
    return 0


# The server files the sglang-*/vllm-* suites run, per release: SGLang's fusion module, vLLM's
# workspace manager.
SERVER_FILES = {"sglang": "sglang/srt/layers/flashinfer_comm_fusion.py",
                "vllm": "vllm/distributed/device_communicators/flashinfer_all_reduce.py"}


def servers(args) -> int:
    """Here, with sm120patch installed: each server release's file from its real wheel
    (pristine/SUITE.py) and the bytes sm120patch's rewriters make of it (patched/SUITE.py; the
    release's bytes again where its patch set leaves that file alone), checked against the
    manifests as `apply` checks them. A few kilobytes travel to the GPU machine instead of the
    wheels (vLLM's are hundreds of megabytes)."""
    import hashlib
    import zipfile

    from packaging.version import Version

    from sm120patch.distributions import load_registry
    from sm120patch.edits import apply_edits
    from sm120patch.wheels import fetch_wheel

    registry = load_registry()
    out = Path(args.out)
    made = {}

    def checked(dist: str, version: str, path: str, pristine: bytes, patches) -> bytes:
        """The bytes ``patches`` make of ``path``, each state checked against the manifest."""
        patched = apply_edits(pristine, patches, where=f"{dist} {version}") if patches else pristine
        manifest = json.loads((HERE.parent / "vendor-manifests" / dist / f"{version}.json").read_text())
        entry = manifest["files"].get(path, {})
        ids = "+".join(sorted(getattr(p, "id", str(p)) for p in patches))
        expected = {"pristine": hashlib.sha256(pristine).hexdigest() if not entry else entry["pristine"],
                    "patched": entry["patched"][ids] if patches else entry.get("pristine",
                                                                                 hashlib.sha256(pristine).hexdigest())}
        for label, data in (("pristine", pristine), ("patched", patched)):
            if hashlib.sha256(data).hexdigest() != expected[label]:
                raise SystemExit(f"{dist} {version}: {label} {path} is not the manifest's ({expected[label][:12]})")
        return patched

    for suite in args.suites.split(","):
        dist, version = suite.split("-", 1)
        if version.startswith("tuned-"):  # the layer with tuned-limits: a directory of its two files
            version = version[len("tuned-"):]
            wheel = zipfile.ZipFile(fetch_wheel(dist, version, Path(args.wheel_cache)))
            patch_set = registry.get(dist).find(Version(version))
            chosen = patch_set.select(["tuned-limits"])
            tuned = patch_set.patch("tuned-limits")
            predicate = next(e.params["function"] for e in tuned.edits if "function" in e.params)
            fused = patch_set.patch("tuned-oneshot").file
            target = out / "patched" / suite
            target.mkdir(parents=True, exist_ok=True)
            for name, path in (("predicate.py", tuned.file), ("fusion.py", fused)):
                patches = [p for p in chosen if p.file == path]
                (target / name).write_bytes(checked(dist, version, path, wheel.read(path), patches))
            (target / "suite.json").write_text(json.dumps({"predicate": predicate,
                                                           "module": tuned.file[:-len(".py")].replace("/", ".")}))
            made[suite] = {"files": [tuned.file, fused], "patches": [p.id for p in chosen], "predicate": predicate}
            print(f"{suite}: {tuned.file} and {fused}: {', '.join(made[suite]['patches'])}")
            continue
        path = SERVER_FILES[dist]
        pristine = zipfile.ZipFile(fetch_wheel(dist, version, Path(args.wheel_cache))).read(path)
        patch_set = registry.get(dist).find(Version(version))
        # What `sm120patch apply` writes: the required patches (the opt-in ones have suites of their own).
        patches = [p for p in patch_set.select() if p.file == path] if patch_set else []
        patched = checked(dist, version, path, pristine, patches)
        for label, data in (("pristine", pristine), ("patched", patched)):
            (out / label).mkdir(parents=True, exist_ok=True)
            (out / label / f"{suite}.py").write_bytes(data)
        made[suite] = {"file": path, "patches": [getattr(p, "id", str(p)) for p in patches],
                       "pristine_sha256": hashlib.sha256(pristine).hexdigest(),
                       "patched_sha256": hashlib.sha256(patched).hexdigest()}
        print(f"{suite}: {path}: {', '.join(made[suite]['patches']) or 'no patch touches this file'}")
    (out / "servers.json").write_text(json.dumps(made, indent=1))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--world", type=int, default=2)
    r.add_argument("--label", default="run")
    r.add_argument("--suites", default="legacy,unified")
    r.add_argument("--server", action="append", default=[], help="SUITE=PATH of the server's file")
    r.add_argument("--out", default="run.json")
    r.add_argument("--timeout", type=float, default=120.0)
    t = sub.add_parser("table")
    t.add_argument("documents", nargs="+")
    v = sub.add_parser("servers")
    v.add_argument("--suites", default="sglang-0.5.9,sglang-0.5.10,sglang-0.5.14,vllm-0.19.0,vllm-0.29.0")
    v.add_argument("--wheel-cache", required=True)
    v.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.command == "run":
        if one_gpu.rank_and_world():
            worker(args)
            return 0
        return run(args)
    return table(args) if args.command == "table" else servers(args)


if __name__ == "__main__":
    sys.exit(main())
