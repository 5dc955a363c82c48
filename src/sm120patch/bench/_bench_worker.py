# Runs inside the *target* interpreter, one process per GPU, for `sm120patch bench`: the
# server's own torch and FlashInfer, nothing from sm120patch. First it creates the workspace the
# way each installed server does (its own preflight where it has one and it imports, then the
# same FlashInfer call with the same arguments), so that a box where the server would fall back
# to unfused allreduce fails here with the reason. Then, for every shape, it checks
# FlashInfer's fused allreduce + residual add + RMSNorm (the call SGLang makes) against an
# NCCL allreduce followed by a reference RMSNorm in float32, then times the fused call against
# the unfused pair (NCCL allreduce + FlashInfer's fused_add_rmsnorm), in CUDA graphs where they
# can be captured. With "tune" it measures the paths the tuner derives limits from, each
# server's PCIe-IPC allreduce among them (make_pcie_ipc: made with the server's own class).
#
# Protocol with the parent (sm120patch.bench): the configuration arrives as JSON in
# SM120PATCH_BENCH_CONFIG; rank 0 writes progress as JSON lines to the file descriptor in
# SM120PATCH_BENCH_FD and the result document to <SM120PATCH_BENCH_DIR>/result.json; a rank
# that fails writes <dir>/error-<rank>.json ({"phase", "message", "case"}) and exits 1.
# torch.distributed is initialised from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (env://).
# Python 3.8+, so no newer syntax.
import contextlib
import hashlib
import importlib
import json
import logging
import os
import pathlib
import sys
import traceback

_progress = None
_answers = None  # rank 0: the parent's answers to "refine" (SM120PATCH_BENCH_ASK_FD)
# Every rank a process on GPU 0 (config "one_gpu": sm120patch's test-only switch for a machine with
# one GPU): the collectives go over gloo, through host memory (NCCL refuses two ranks on one device),
# and nothing is captured in CUDA graphs (a gloo collective cannot be). Correctness is exact; the
# ranks take turns on the GPU, so their timings measure nothing a server would see.
_ONE_GPU = False


def emit(**event):
    if _progress is not None:
        _progress.write(json.dumps(event) + "\n")


class Failure(Exception):
    def __init__(self, phase, message, case=None):
        Exception.__init__(self, message)
        self.phase, self.message, self.case = phase, message, case


def last_line(exc):
    text = str(exc).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return "%s: %s" % (type(exc).__name__, lines[-1] if lines else "")


def check_server_paths(paths, rank, world, max_tokens, hidden, dtype):
    """Create the fusion workspace as each server in ``paths`` does (config "server_paths": the
    server, its FlashInfer call, its own preflight as "module:function"); a Failure names the
    server and what refused. Returns one result per path, for the report."""
    import torch.distributed as dist

    results, cpu_group = [], None
    for path in paths:
        entry = {"server": path["server"], "workspace": path["workspace"], "preflight": None}
        if path.get("preflight"):
            module_name, function_name = path["preflight"].split(":")
            try:
                function = getattr(importlib.import_module(module_name), function_name)
            except Exception as exc:  # noqa: BLE001 - a server that does not import here
                entry["preflight"] = "not importable in this interpreter (%s): not run" % last_line(exc)
            else:
                if cpu_group is None:  # the server votes on a CPU group too
                    cpu_group = dist.new_group(backend="gloo")
                if not function(world, max_tokens, hidden, dtype, cpu_group=cpu_group):
                    raise Failure("server-path", "%s: its own workspace preflight (%s) skips fusion on these GPUs "
                                  "(the server would serve unfused; its log line is above)"
                                  % (path["server"], path["preflight"]))
                entry["preflight"] = "passed"
        if path["workspace"] == "unified":
            import flashinfer.comm as comm

            try:
                workspace = comm.create_allreduce_fusion_workspace(
                    backend="trtllm", world_size=world, rank=rank, max_token_num=max_tokens, hidden_dim=hidden,
                    dtype=dtype)
            except Exception as exc:  # noqa: BLE001
                raise Failure("server-path", "%s: FlashInfer's create_allreduce_fusion_workspace(backend=\"trtllm\"), "
                              "called as the server calls it, failed (the server would serve unfused): %s"
                              % (path["server"], last_line(exc)))
            getattr(workspace, "destroy", lambda: None)()
        results.append(entry)
    return results


def fused_call(x, residual, gamma, eps, norm_out, residual_out, world, rank, workspace, use_oneshot):
    """FlashInfer's fused allreduce + residual add + RMSNorm, called as SGLang calls it (PDL on,
    fp32 accumulation off); ``use_oneshot`` None: FlashInfer's own choice."""
    import flashinfer.comm as comm

    comm.trtllm_allreduce_fusion(
        allreduce_in=x, world_size=world, world_rank=rank, token_num=x.shape[0], hidden_dim=x.shape[1],
        workspace_ptrs=workspace, launch_with_pdl=True, use_oneshot=use_oneshot,
        trigger_completion_at_end=False, fp32_acc=False,
        pattern_code=comm.AllReduceFusionPattern.kARResidualRMSNorm,
        allreduce_out=None, residual_in=residual, residual_out=residual_out, norm_out=norm_out,
        quant_out=None, scale_out=None, rms_gamma=gamma, rms_eps=eps, scale_factor=None,
        layout_code=None)


def tolerance_ok(out, ref, atol, rtol):
    """(max |out - ref|, worst ratio to the allowed error): the check passes when the ratio is
    at most 1, i.e. |out - ref| <= atol + rtol * |ref| everywhere (torch.isclose's rule)."""
    import torch

    diff = (out.float() - ref).abs()
    allowed = atol + rtol * ref.abs()
    bad = ~torch.isfinite(out.float())
    worst = float((diff / allowed).max()) if diff.numel() else 0.0
    if bool(bad.any()):
        worst = float("inf")
    return float(diff.max()) if diff.numel() else 0.0, worst


def all_reduce(tensor, group):
    """The unfused allreduce, in place: NCCL in the tensor's own dtype; with every rank on GPU 0,
    gloo over a float32 copy in host memory, rounded back to the tensor's dtype."""
    import torch.distributed as dist

    if not _ONE_GPU:
        dist.all_reduce(tensor, group=group)
        return
    host = tensor.float().cpu()
    dist.all_reduce(host, group=group)
    tensor.copy_(host)


def reference(x, residual, gamma, eps, group):
    """The allreduce (all_reduce), then residual add and RMSNorm in float32."""
    import torch

    summed = x.clone()
    all_reduce(summed, group)
    residual_out = summed.float() + residual.float()
    variance = residual_out.pow(2).mean(dim=-1, keepdim=True)
    norm_out = residual_out * torch.rsqrt(variance + eps) * gamma.float()
    return norm_out, residual_out


def digest(tensor):
    import numpy

    import torch

    data = tensor.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy()
    return hashlib.sha256(numpy.ascontiguousarray(data).tobytes()).hexdigest()


def make_inputs(tokens, hidden, dtype, device, seed, rank):
    """Deterministic inputs for one shape: the allreduce input differs per rank; the residual
    and the RMSNorm weight are the same on every rank (they are replicated in a TP model)."""
    import torch

    def randn(shape, salt):
        generator = torch.Generator().manual_seed(seed * 1000003 + salt)
        return torch.randn(shape, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)

    base = tokens * 131 + hidden
    x = randn((tokens, hidden), base * 17 + rank + 1)
    residual = randn((tokens, hidden), base * 17)
    gamma = randn((hidden,), hidden)
    return x, residual, gamma


def capture(body, inner):
    """``body`` run ``inner`` times as one callable: a CUDA graph replay where it can be captured,
    else eager launches. Returns (run, used_graph); the graph lives as long as ``run``."""
    import torch

    if _ONE_GPU:
        def run():
            for _ in range(inner):
                body()
        return run, False
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            body()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                body()
        return graph.replay, True
    except Exception:  # noqa: BLE001 - not capturable here: time eager launches instead
        torch.cuda.synchronize()

        def run():
            for _ in range(inner):
                body()
        return run, False


def measure(run, reps, inner, warmup):
    """Median microseconds per call over ``reps`` timed runs of ``run`` (``inner`` calls each),
    after ``warmup`` untimed ones."""
    import torch

    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / inner)
    samples.sort()
    return samples[len(samples) // 2]


def time_graph(body, reps, inner, warmup):
    """Median microseconds per call of ``body``: captured ``inner`` times in one CUDA graph,
    replayed ``warmup`` times, then ``reps`` timed replays. Falls back to eager launches when
    the graph cannot be captured; returns (median_us, used_graph)."""
    run, used_graph = capture(body, inner)
    return measure(run, reps, inner, warmup), used_graph


def main(config, rank, world, out_dir):
    import torch
    import torch.distributed as dist

    global _ONE_GPU
    _ONE_GPU = bool(config.get("one_gpu"))
    local_rank = 0 if _ONE_GPU else int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group(backend="gloo" if _ONE_GPU else "nccl")
    group = dist.group.WORLD
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[config["dtype"]]

    # Build (or load from FlashInfer's JIT cache) the two modules; the ranks start on different
    # ones so that a cold cache compiles both at once. FlashInfer's file locks do the rest.
    emit(event="stage", text="loading FlashInfer's trtllm_comm and norm modules (a first build takes minutes)")
    try:
        import flashinfer.comm.trtllm_ar as trtllm_ar
        from flashinfer.norm import fused_add_rmsnorm
    except Exception as exc:  # noqa: BLE001
        raise Failure("import", last_line(exc))
    try:
        import flashinfer.norm as norm

        builders = [trtllm_ar.get_trtllm_comm_module, getattr(norm, "get_norm_module", lambda: None)]
        for build in builders[rank % 2:] + builders[:rank % 2]:
            build()
    except Exception as exc:  # noqa: BLE001
        raise Failure("build", last_line(exc))
    dist.barrier(group=group)
    tune = config.get("tune")
    gpus = None
    if tune:
        gpus = identify(local_rank, world, group)
        emit(event="stage", text="every pair of ranks: opening each other's memory and one small fused call "
             "(%d pairs)" % (world * (world - 1) // 2))
        check_pairs(rank, world, gpus, config["hidden"][0], dtype, device, config, group)

    tokens_list, hidden_list = config["tokens"], config["hidden"]
    max_tokens, max_hidden = max(tokens_list), max(hidden_list)
    emit(event="stage", text="creating the fusion workspace as the installed server does")
    server_paths = check_server_paths(config.get("server_paths", []), rank, world, max_tokens, max_hidden, dtype)
    dist.barrier(group=group)
    try:
        workspace = trtllm_ar.trtllm_create_ipc_workspace_for_all_reduce_fusion(
            rank, world, max_tokens, max_hidden, use_fp32_lamport=False, group=group)
        ipc_handles, workspace_tensor = workspace[0], workspace[1]
    except Exception as exc:  # noqa: BLE001
        raise Failure("workspace", last_line(exc))
    dist.barrier(group=group)

    should_use_oneshot = getattr(trtllm_ar, "_should_use_oneshot", None)
    cases = []
    for hidden in ([] if tune else hidden_list):
        for tokens in tokens_list:
            for strategy in config["strategies"]:
                if strategy == "twoshot" and tokens <= world:
                    continue  # FlashInfer: two-shot needs more tokens than ranks
                cases.append((hidden, tokens, strategy))
    if not tune:
        emit(event="cases", total=len(cases))
    eps, atol, rtol = config["eps"], config["atol"], config["rtol"]
    results = []
    for index, (hidden, tokens, strategy) in enumerate(cases):
        case = {"tokens": tokens, "hidden": hidden, "strategy": strategy}
        emit(event="case", index=index, **case)
        use_oneshot = {"auto": None, "oneshot": True, "twoshot": False}[strategy]
        effective = strategy
        if strategy == "auto" and should_use_oneshot is not None:
            effective = "oneshot" if should_use_oneshot(tokens, hidden, dtype, world) else "twoshot"
        x, residual, gamma = make_inputs(tokens, hidden, dtype, device, config["seed"], rank)
        norm_out = torch.empty_like(x)
        residual_out = torch.empty_like(x)

        def fused():
            fused_call(x, residual, gamma, eps, norm_out, residual_out, world, rank, workspace_tensor, use_oneshot)

        dist.barrier(group=group)
        try:
            fused()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001
            raise Failure("fused", last_line(exc), case)
        ref_norm, ref_residual = reference(x, residual, gamma, eps, group)
        norm_err, norm_ratio = tolerance_ok(norm_out, ref_norm, atol, rtol)
        res_err, res_ratio = tolerance_ok(residual_out, ref_residual, atol, rtol)
        mine = {"norm": digest(norm_out), "residual": digest(residual_out)}
        everyone = [None] * world
        dist.all_gather_object(everyone, [mine, max(norm_ratio, res_ratio), norm_err, res_err], group=group)
        row = dict(case)
        row.update(
            effective_strategy=effective,
            bytes=tokens * hidden * x.element_size(),
            max_err_norm=max(e[2] for e in everyone),
            max_err_residual=max(e[3] for e in everyone),
            worst_ratio=max(e[1] for e in everyone),
            digests=everyone[0][0],
            ranks_agree=all(e[0] == everyone[0][0] for e in everyone),
        )
        row["ok"] = row["worst_ratio"] <= 1.0 and row["ranks_agree"]
        if not config["check_only"]:
            dist.barrier(group=group)
            fused_us, fused_graph = time_graph(fused, config["reps"], config["inner"], config["warmup"])
            a, r = x.clone(), residual.clone()

            def unfused():
                all_reduce(a, group)
                fused_add_rmsnorm(a, r, gamma, eps)

            dist.barrier(group=group)
            unfused_us, unfused_graph = time_graph(unfused, config["reps"], config["inner"], config["warmup"])
            timings = [None] * world
            dist.all_gather_object(timings, [fused_us, unfused_us, fused_graph and unfused_graph], group=group)
            # The slowest rank sets the pace of a TP step.
            row.update(fused_us=max(t[0] for t in timings), unfused_us=max(t[1] for t in timings),
                       graphs=all(t[2] for t in timings))
        results.append(row)
    if tune:
        made = []
        if tune.get("pcie_ipc"):
            emit(event="stage", text="creating the servers' PCIe-IPC allreduce as each does with its switch on "
                 "(FlashInfer builds and tunes its kernels: minutes the first time)")
            cpu_group = dist.new_group(backend="gloo")  # the servers' CPU group: FlashInfer tunes over it
            made = [make_pcie_ipc(spec, world, group, cpu_group, device, config["hidden"][0], dtype,
                                  config["tokens"], out_dir) for spec in tune["pcie_ipc"]]
        rows = tune_rows(config, rank, world, device, dtype, workspace_tensor, group, made)
        for path in made:
            if path["destroy"] is not None:
                path["destroy"]()
    else:
        emit(event="case", index=len(cases))
    dist.barrier(group=group)
    try:
        trtllm_ar.trtllm_destroy_ipc_workspace_for_all_reduce_fusion(ipc_handles, group=group)
    except Exception:  # noqa: BLE001 - the results stand; the process exits next
        pass
    if rank == 0:
        props = torch.cuda.get_device_properties(device)
        document = {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "nccl": nccl_version(),
            "collectives": "gloo, every rank on GPU 0" if _ONE_GPU else "nccl",
            "flashinfer": getattr(__import__("flashinfer"), "__version__", None),
            "device": props.name,
            "capability": "%d.%d" % (props.major, props.minor),
            "world_size": world,
            "dtype": config["dtype"],
            "server_paths": server_paths,
            "cases": results,
        }
        if tune:
            document["tune"] = dict(profile_facts(tune["runtime"], tune["distributions"]), gpus=gpus, rows=rows,
                                    pcie_ipc=[path["info"] for path in made])
        path = os.path.join(out_dir, "result.json")
        with open(path + ".tmp", "w") as handle:
            json.dump(document, handle)
        os.replace(path + ".tmp", path)
    dist.destroy_process_group()


def identify(local_rank, world, group):
    """Every rank's GPU, in rank order: its PCI bus id as sysfs spells it and its UUID (two ranks
    on one GPU, or on two MIG slices of one, share the bus id)."""
    import torch
    import torch.distributed as dist

    props = torch.cuda.get_device_properties(local_rank)
    bus = None
    if getattr(props, "pci_bus_id", None) is not None:
        bus = "%04x:%02x:%02x.0" % (getattr(props, "pci_domain_id", 0), props.pci_bus_id, props.pci_device_id)
    mine = {"bus_id": bus, "uuid": str(getattr(props, "uuid", "")) or None, "name": props.name}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def check_pairs(rank, world, gpus, hidden, dtype, device, config, group):
    """Before any timing, every pair of ranks opens each other's IPC memory (a two-rank fusion
    workspace) and completes one small fused call, checked against the reference. A pair that
    fails raises a Failure naming it; one that hangs is named by the parent, from the "pair"
    event, when its time is up."""
    import torch
    import torch.distributed as dist
    import flashinfer.comm.trtllm_ar as trtllm_ar

    for first in range(world):
        for second in range(first + 1, world):
            where = {"pair": [first, second], "gpus": [gpus[first]["bus_id"], gpus[second]["bus_id"]]}
            emit(event="pair", **where)
            pair = dist.new_group([first, second])  # every rank takes part in making each group
            if rank in (first, second):
                me = 0 if rank == first else 1
                try:
                    handles, pointers = trtllm_ar.trtllm_create_ipc_workspace_for_all_reduce_fusion(
                        me, 2, 1, hidden, use_fp32_lamport=False, group=pair)[:2]
                    x, residual, gamma = make_inputs(1, hidden, dtype, device, config["seed"], rank)
                    norm_out, residual_out = torch.empty_like(x), torch.empty_like(x)
                    fused_call(x, residual, gamma, config["eps"], norm_out, residual_out, 2, me, pointers, True)
                    torch.cuda.synchronize()
                    ref_norm, _ = reference(x, residual, gamma, config["eps"], pair)
                    ratio = tolerance_ok(norm_out, ref_norm, config["atol"], config["rtol"])[1]
                    trtllm_ar.trtllm_destroy_ipc_workspace_for_all_reduce_fusion(handles, group=pair)
                except Exception as exc:  # noqa: BLE001
                    raise Failure("pair", last_line(exc), where)
                if ratio > 1.0:
                    raise Failure("pair", "the fused call's result differs from NCCL + RMSNorm (%.3g times the "
                                  "tolerance): the GPUs read each other's memory wrongly" % ratio, where)
            dist.barrier(group=group)


def summary(samples):
    """(median, first quartile, third quartile) of the repetitions' figures."""
    import statistics

    q1, median, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return median, q1, q3


def slowest_per_repetition(per_rank):
    """A TP step waits for its slowest rank: each repetition's figure is the largest of the ranks'."""
    return [max(figures) for figures in zip(*per_rank)]


class _Lines(object):
    """A logging handler that keeps what a server's module logs at warning level and above (its
    reasons for staying on NCCL), for the report."""

    def __init__(self, name):
        self.logger, self.lines = logging.getLogger(name), []
        self.handler = logging.Handler(logging.WARNING)
        self.handler.emit = lambda record: self.lines.append(record.getMessage())
        self.logger.addHandler(self.handler)

    def close(self):
        self.logger.removeHandler(self.handler)
        return self.lines


def pcie_ipc_batches(rows):
    """SGLang's tune batches for a workspace of ``rows`` rows: the powers of two up to 512 that
    fit, and ``rows`` itself (pcie_ipc_ar.py's _tune_batches, used only where SGLang does not
    import)."""
    batches = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b <= rows]
    return tuple(batches + ([rows] if rows >= 1 and rows not in batches else []))


def make_pcie_ipc(spec, world, group, cpu_group, device, hidden, dtype, tokens, out_dir):
    """The server's PCIe-IPC allreduce made as that server makes it with its switch on (``spec``:
    the parent's row: "name", "code" the server's class as "module:Class", "rows" the widest batch
    the server sizes its workspace for): its own class where it imports, else FlashInfer's
    PcieIpcAllReduceWorkspace with the arguments it passes. Returns {"allreduce": x -> the reduced
    tensor, "takes": x -> whether the server sends x there, "around": a context for graph capture
    or None, "destroy", "info": for the report}; where it cannot be made, "allreduce" is None and
    "info" says why (every rank agrees: the tuner then times the other paths)."""
    import torch
    import torch.distributed as dist

    name, rows = spec["name"], spec["rows"]
    info = {"name": name, "column": spec["column"], "server": spec["server"], "switch": spec["switch"], "rows": rows,
            "how": None, "error": None, "log": []}
    made = {"allreduce": None, "takes": None, "around": None, "destroy": None, "info": info}
    module_name, class_name = spec["code"].split(":")
    lines = _Lines(module_name)
    try:
        own = getattr(importlib.import_module(module_name), class_name)
        info["how"] = "the server's own %s" % class_name
    except Exception as exc:  # noqa: BLE001 - a server that does not import here
        own = None
        info["how"] = ("FlashInfer's PcieIpcAllReduceWorkspace with the arguments the server passes (%s does not "
                       "import here: %s)" % (module_name, last_line(exc)))
    # The server's vLLM-style capture sizes: every batch measured up to its widest, and that one.
    sizes = sorted(set([t for t in tokens if t <= rows] + [rows]))
    try:
        if name == "sglang-pcie-ipc" and own is not None:
            comm = own(group=group, device=device, cpu_group=cpu_group)
            if not comm.disabled:
                comm.prepare(hidden=hidden, max_rows=rows)  # as SGLang's runner does before graph capture
            if comm.disabled or getattr(comm, "_workspace", None) is None:
                raise Failure("pcie-ipc", "; ".join(lines.lines) or "the server left it off (world size %d)" % world)
            info["rows"] = comm.max_numel // hidden  # SGLANG_PCIE_IPC_MAX_NUMEL, where set, sized it
            made.update(allreduce=comm.pcie_ipc_all_reduce, takes=comm.should_pcie_ipc_ar, destroy=comm.destroy)
        elif name == "vllm-pcie-ipc" and own is not None:
            comm = own(group=group, tune_group=cpu_group, device=device)
            if not comm.disabled:  # as vLLM's kernel warmup does before graph capture
                comm.setup(hidden_dim=hidden, dtype=dtype, capture_sizes=sizes,
                           tune_cache=_vllm_tune_cache(out_dir, world))
            if comm.disabled or comm.workspace is None:
                raise Failure("pcie-ipc", "; ".join(lines.lines) or "the server left it off (world size %d)" % world)
            made.update(allreduce=comm.all_reduce, takes=comm.should_use, around=comm.capture, destroy=comm.destroy)
        else:
            from flashinfer.comm import PcieIpcAllReduceWorkspace
            from flashinfer.comm.pcie_ipc_tuning import default_cache_path

            if name == "sglang-pcie-ipc":  # bf16 only, SGLANG_PCIE_IPC_MAX_NUMEL or rows x hidden
                kind, numel = torch.bfloat16, int(os.environ.get("SGLANG_PCIE_IPC_MAX_NUMEL") or 0) or rows * hidden
                info["rows"] = numel // hidden
                workspace = PcieIpcAllReduceWorkspace(group=group, max_numel=numel, dtype=kind,
                                                      tune_batches=pcie_ipc_batches(numel // hidden),
                                                      tune_cache=str(default_cache_path(world)))
                try:
                    workspace.tune([hidden], dtype=kind, tune_group=cpu_group)
                except Exception:  # noqa: BLE001 - SGLang keeps the seed policy then
                    pass
            else:  # vLLM: the model's dtype, the capture sizes, tuned and prepared
                kind, numel = dtype, sizes[-1] * hidden
                workspace = PcieIpcAllReduceWorkspace(group=group, max_numel=numel, dtype=kind, tune_batches=tuple(sizes),
                                                      tune_cache=_vllm_tune_cache(out_dir, world))
                torch.cuda.synchronize(device)
                workspace.rebind_stream()
                workspace.tune([hidden], dtype=kind, tune_group=cpu_group)
                workspace.prepare([(b, hidden) for b in sizes], dtype=kind)

            def takes(x):
                return (x.dtype == kind and x.is_contiguous() and x.dim() == 2 and x.shape[1] == hidden
                        and x.numel() <= numel and workspace.supports(x))

            bound = [None]

            def allreduce(x):  # both servers move the workspace to the stream that calls it
                stream = torch.cuda.current_stream()
                if bound[0] is None or stream != bound[0]:
                    workspace.rebind_stream()
                    bound[0] = stream
                return workspace.all_reduce(x)

            @contextlib.contextmanager
            def around():
                torch.cuda.synchronize(device)
                workspace.rebind_stream()
                try:
                    yield
                finally:
                    torch.cuda.synchronize(device)
                    workspace.rebind_stream()

            made.update(allreduce=allreduce, takes=takes, around=around, destroy=workspace.destroy)
    except Failure as failure:
        info["error"] = failure.message
    except Exception as exc:  # noqa: BLE001 - said in the report; the other paths are timed
        info["error"] = last_line(exc)
    if info["error"]:
        made.update(allreduce=None, destroy=None)
    info["log"] = lines.close()  # what the server's module warned about (an autotune it skipped, ...)
    everyone = [None] * world
    dist.all_gather_object(everyone, info["error"], group=group)
    failed = [e for e in everyone if e]
    if failed and made["allreduce"] is not None:  # another rank failed: nobody times it (a lone rank would hang)
        info["error"] = "on another rank: %s" % failed[0]
        made.update(allreduce=None, destroy=None)
    return made


def _vllm_tune_cache(out_dir, world):
    """vLLM names its tune cache pcie_ipc_allreduce_tp_<ranks>.json beside its FlashInfer autotune
    file (a per-model directory the tuner cannot know): here, the run's own directory, so it tunes
    as a first start does and leaves no file behind."""
    return pathlib.Path(out_dir) / ("pcie_ipc_allreduce_tp_%s.json" % "-".join(str(r) for r in range(world)))


def pcie_ipc_row(made, x, residual, gamma, eps):
    """The server's PCIe-IPC allreduce + fused_add_rmsnorm at one size, as a tune path
    (name, the call checked, the call timed, its outputs, the capture context)."""
    from flashinfer.norm import fused_add_rmsnorm

    a, r, out = x.clone(), residual.clone(), [None]

    def timed():  # out of place, as the servers' allreduce returns a new tensor; the norm in place
        out[0] = made["allreduce"](a)
        fused_add_rmsnorm(out[0], r, gamma, eps)

    def checked():
        r.copy_(residual)
        timed()

    return made["info"]["column"], checked, timed, lambda: (out[0], r), made["around"]


def tune_rows(config, rank, world, device, dtype, workspace_tensor, group, pcie_ipc=()):
    """For each token count at the one hidden size, tune_row; then, where the parent narrows the
    limits (config "tune" "refine"), each size it asks for, until it asks for none: rank 0 sends
    the rows so far (a "refine" event) and reads the next size from SM120PATCH_BENCH_ASK_FD, and
    every rank measures it (the rows it adds are marked "probe")."""
    import torch.distributed as dist

    hidden = config["hidden"][0]
    emit(event="cases", total=len(config["tokens"]))
    rows = [tune_row(config, index, tokens, rank, world, device, dtype, workspace_tensor, group, pcie_ipc)
            for index, tokens in enumerate(config["tokens"])]
    emit(event="case", index=len(config["tokens"]))
    while config["tune"].get("refine"):
        asked = [ask_parent(rows) if rank == 0 else None]
        dist.broadcast_object_list(asked, src=0, group=group)
        if not asked[0]:
            break
        emit(event="stage", text="narrowing the limits down: %d tokens, hidden %d" % (asked[0], hidden))
        row = tune_row(config, len(config["tokens"]), int(asked[0]), rank, world, device, dtype, workspace_tensor,
                       group, pcie_ipc)
        row["probe"] = True
        rows.append(row)
    return rows


def ask_parent(rows):
    """Rank 0: the rows so far to the parent (bench.limits.next_probe decides there), and the token
    count it answers, or None (no more sizes, or no parent listening)."""
    global _answers
    emit(event="refine", rows=rows)
    if _answers is None:
        fd = os.environ.get("SM120PATCH_BENCH_ASK_FD")
        if not fd:
            return None
        _answers = os.fdopen(int(fd), "r")
    line = _answers.readline()
    try:
        return json.loads(line).get("tokens") if line else None
    except ValueError:
        return None


def tune_row(config, index, tokens, rank, world, device, dtype, workspace_tensor, group, pcie_ipc):
    """One token count at the one hidden size: check every path against the float32 reference,
    then time them, ``repeats`` independent repetitions interleaved path by path (a drift of the
    clocks touches every path alike). One-shot is timed only within FlashInfer's own one-shot
    region (the tuned limit never passes it), two-shot only above ``world`` tokens, a server's
    PCIe-IPC path (``pcie_ipc``: make_pcie_ipc's) only at the sizes that server sends it (the
    others are listed in the row's "not_run")."""
    import torch
    import torch.distributed as dist
    from flashinfer.norm import fused_add_rmsnorm

    tune, hidden, eps = config["tune"], config["hidden"][0], config["eps"]
    emit(event="case", index=index, tokens=tokens, hidden=hidden, strategy="every path")
    x, residual, gamma = make_inputs(tokens, hidden, dtype, device, config["seed"], rank)
    message = tokens * hidden * x.element_size()
    norm_out, residual_out = torch.empty_like(x), torch.empty_like(x)
    ref_norm, ref_residual = reference(x, residual, gamma, eps, group)

    def fused(use_oneshot):
        def body():
            fused_call(x, residual, gamma, eps, norm_out, residual_out, world, rank, workspace_tensor, use_oneshot)
        return body, (norm_out, residual_out)

    a, r = x.clone(), residual.clone()

    def unfused():  # in place, as the server runs it: timed on whatever the last call left
        all_reduce(a, group)
        fused_add_rmsnorm(a, r, gamma, eps)

    def unfused_from_inputs():
        a.copy_(x)
        r.copy_(residual)
        unfused()

    paths = []  # (name, the call checked, the call timed, its outputs, the capture's context)
    if message <= tune["oneshot_max_bytes"] or tokens <= world:
        body, outputs = fused(True)
        paths.append(("oneshot", body, body, lambda outputs=outputs: outputs, None))
    if tokens > world:
        body, outputs = fused(False)
        paths.append(("twoshot", body, body, lambda outputs=outputs: outputs, None))
    paths.append(("unfused", unfused_from_inputs, unfused, lambda: (a, r), None))
    row = {"tokens": tokens, "bytes": message}
    for made in pcie_ipc:
        if made["allreduce"] is None:
            continue
        if made["takes"](x):  # a function of the shape: every rank answers alike
            paths.append(pcie_ipc_row(made, x, residual, gamma, eps))
        else:  # the server sends this size elsewhere (NCCL): absent here, never 0 us
            row.setdefault("not_run", []).append(made["info"]["name"])
    worst = 0.0
    for name, checked, _, outputs, _ in paths:
        dist.barrier(group=group)
        try:
            checked()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001
            raise Failure("fused" if name in ("oneshot", "twoshot") else "unfused", last_line(exc),
                          {"tokens": tokens, "hidden": hidden, "strategy": name})
        out_norm, out_residual = outputs()
        ratio = max(tolerance_ok(out_norm, ref_norm, config["atol"], config["rtol"])[1],
                    tolerance_ok(out_residual, ref_residual, config["atol"], config["rtol"])[1])
        row["%s_check" % name] = ratio
        worst = max(worst, ratio)
    ratios = [None] * world
    dist.all_gather_object(ratios, worst, group=group)
    if max(ratios) > 1.0:
        bad = [path[0] for path in paths if row["%s_check" % path[0]] > 1.0] or ["a path on another rank"]
        raise Failure("check", "%s differs from NCCL + float32 RMSNorm (%.3g times the tolerance): no timing "
                      "of a wrong result" % (", ".join(bad), max(ratios)),
                      {"tokens": tokens, "hidden": hidden, "strategy": bad[0]})
    runs = []
    for name, _, timed, _, around in paths:
        with around() if around is not None else contextlib.nullcontext():
            runs.append((name, capture(timed, config["inner"])))
    mine = dict((name, []) for name, _ in runs)
    for repetition in range(tune["repeats"]):
        # Progress per repetition: the parent's time limit is per step, and --repeats sets the steps.
        emit(event="case", index=index, tokens=tokens, hidden=hidden,
             strategy="repetition %d of %d" % (repetition + 1, tune["repeats"]))
        for name, (run, _) in runs:
            dist.barrier(group=group)
            mine[name].append(measure(run, config["reps"], config["inner"], config["warmup"]))
    everyone = [None] * world
    dist.all_gather_object(everyone, [mine, all(graph for _, (_, graph) in runs)], group=group)
    for name, _ in runs:
        median, q1, q3 = summary(slowest_per_repetition([e[0][name] for e in everyone]))
        row["%s_us" % name], row["%s_iqr_us" % name] = median, [q1, q3]
    row["graphs"] = all(e[1] for e in everyone)
    row["repeats"] = tune["repeats"]
    del runs
    return row


def profile_facts(runtime_text, distributions):
    """The box, the NCCL settings and the releases, computed by the very code the servers run
    (sm120patch's _tuned_runtime.py, passed as text: nothing from sm120patch imports here)."""
    namespace = {"__name__": "sm120patch_tuned_runtime"}
    exec(compile(runtime_text, "_tuned_runtime.py", "exec"), namespace)
    versions = namespace["_sm120patch_versions"](distributions)
    return {"box": namespace["_sm120patch_box"](), "nccl_env": namespace["_sm120patch_nccl_env"](),
            "software": dict((name, version) for name, version in sorted(versions.items()) if version is not None)}


def nccl_version():
    try:
        version = __import__("torch").cuda.nccl.version()
    except Exception:  # noqa: BLE001
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def report_failure(out_dir, rank, phase, message, case=None):
    with open(os.path.join(out_dir, "error-%d.json" % rank), "w") as handle:
        json.dump({"phase": phase, "message": message, "case": case}, handle)


if __name__ == "__main__":
    rank, out_dir = int(os.environ["RANK"]), os.environ["SM120PATCH_BENCH_DIR"]
    if rank == 0 and os.environ.get("SM120PATCH_BENCH_FD"):
        _progress = os.fdopen(int(os.environ["SM120PATCH_BENCH_FD"]), "w", buffering=1)
    try:
        main(json.loads(os.environ["SM120PATCH_BENCH_CONFIG"]), rank, int(os.environ["WORLD_SIZE"]), out_dir)
    except Failure as failure:
        report_failure(out_dir, rank, failure.phase, failure.message, failure.case)
        sys.exit(1)
    except Exception as exc:  # noqa: BLE001 - anything else: the parent shows one line
        traceback.print_exc()
        report_failure(out_dir, rank, "worker", last_line(exc))
        sys.exit(1)
