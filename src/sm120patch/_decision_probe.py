# Runs inside the target interpreter for `sm120patch verify --tuned` (and after `apply --with
# tuned-limits`). argv[1]: JSON
#   {"kind": "sites" or "tables",
#    "sites": [{"module", "function", "cap"}]  ("sites", SGLang: each decision the tuned-limits patch
#                                              rewrites; "cap": the release's cap there, an expression),
#    "module": the fusion module ("tables", vLLM: its tables the tuned-limits patch narrows at import),
#    "oneshot": {"module", "expression"} or null  (the one-shot argument of the fused call),
#    "server_args": {field: value}, "device_flags": {name: value},
#    "cases": [{"tp", "hidden", "dtype", "sizes", "profile" (optional: SM120PATCH_TUNED_LIMITS)}]}
# Imports the server's patched modules as the server does (importlib, the installed files), then
# asks the server's own decision code, at each TP size and batch size, what it does: whether it
# fuses (SGLang: each decision site, called as the server calls it; vLLM: the fusion pass's limit
# from its SM120 row) and the one-shot argument its fused call hands FlashInfer (the expression
# the patch data puts there, evaluated in the fused call's module). Prints one JSON document.
#
# This one process stands for a TP-N server's rank 0: the tensor-parallel group is a stand-in
# everywhere (its world size through the release's own parallel state; its all-reduce, NCCL's,
# returns its input), and so are the norm layer's two kernels an SGLang gather step is handed
# (fused with the all-reduce, or not: they record which). Where no SM120 GPU is visible, a
# stand-in answers for the device too, and the output says so: torch's device capability (12.0,
# what the inserted code asks at the first forward), the module-level device flags the server
# computed from torch at import ("device_flags", as an SM120 GPU sets them), SGLang's CUDA kernel
# library (sgl_kernel) where an import needs it and it does not load, and each compiled CUDA
# operator vLLM looks up at import where its operator library does not load (each kernel raises if
# called: no decision calls one). The server's state is set by the release's own setters, as a
# TP-N server started with "server_args" (fusion requested, no DP attention) has it by its first
# forward: its ServerArgs, published; the served model's hidden size. The check is about the
# limits; status's `requested` step is about the options. Nothing sm120patch inserted, nor
# anything it calls, is replaced.
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import logging
import os
import re
import sys
import traceback
import types

request = json.loads(sys.argv[1])
out = {"device": None, "cases": []}
ITEMSIZE = {"bf16": 2, "fp16": 2}


def fail(where, exc):
    """The error as one line, with the innermost frame of the server's or sm120patch's code."""
    frames = traceback.extract_tb(exc.__traceback__)
    place = ""
    if frames:
        last = frames[-1]
        place = " (%s:%d in %s)" % (last.filename.rsplit("site-packages/", 1)[-1], last.lineno, last.name)
    return "%s raises %s: %s%s" % (where, type(exc).__name__, str(exc).strip().splitlines()[0] if str(exc).strip() else "",
                                   place)


class Said(logging.Handler):
    """The lines sm120patch's inserted code logs (the profile in force, or why not)."""

    def __init__(self):
        logging.Handler.__init__(self, logging.INFO)
        self.lines = []

    def emit(self, record):
        message = record.getMessage()
        if "sm120patch" in message:
            self.lines.append(message)


def server_args(given):
    """The server's own ServerArgs, as parsed from a command line that gives ``given`` (only the
    fields this release has), every other field at the release's default. A dataclass release
    (up to 0.5.20) is built without its __post_init__, which asks for the GPU and reads the model."""
    import dataclasses

    from sglang.srt.server_args import ServerArgs

    if dataclasses.is_dataclass(ServerArgs):
        fields = {f.name: f for f in dataclasses.fields(ServerArgs)}
        args = ServerArgs.__new__(ServerArgs)
        for name, field in fields.items():
            value = (field.default if field.default is not dataclasses.MISSING else
                     field.default_factory() if field.default_factory is not dataclasses.MISSING else None)
            object.__setattr__(args, name, value)
        for name, value in given.items():
            if name in fields:
                object.__setattr__(args, name, value)
        return args
    names = set(getattr(ServerArgs, "__struct_fields__", ()))  # msgspec (0.5.21+): building it checks nothing
    return ServerArgs(**{name: value for name, value in given.items() if name in names})


class StandinGroup:
    """The tensor-parallel group of a TP-N server, as its rank 0 sees it (one process stands for N).
    Its all-reduce is NCCL's: it returns its input."""

    def __init__(self, world_size):
        self.world_size = world_size
        self.rank_in_group = 0
        self.rank = 0
        self.local_rank = 0
        self.ranks = list(range(world_size))

    def all_reduce(self, tensor, *args, **kwargs):
        return tensor


class StandinNorm:
    """The norm layer's kernels: which one the layer was handed (fused with the all-reduce, or
    the all-reduce then the norm)."""

    def __init__(self):
        self.took = []

    def forward_with_allreduce_fusion(self, hidden_states, residual, *args, **kwargs):
        self.took.append(True)
        return hidden_states, residual

    def __call__(self, hidden_states, residual=None, *args, **kwargs):
        self.took.append(False)
        return hidden_states, residual


class StandinKernel:
    """A name sgl_kernel exports (a kernel, or a table of its types): it raises if called."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attribute):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return StandinKernel("%s.%s" % (self._name, attribute))

    def __call__(self, *args, **kwargs):
        raise RuntimeError("%s is a CUDA kernel; the stand-in device has none" % self._name)


class StandinKernels(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """sgl_kernel, SGLang's CUDA kernel library, where it does not load without a GPU: every
    module of it imports, and every kernel raises if called (no decision calls one)."""

    def find_spec(self, name, path=None, target=None):
        if name == "sgl_kernel" or name.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []

        def kernel_of(attribute):
            if attribute.startswith("__"):
                raise AttributeError(attribute)
            return StandinKernel("%s.%s" % (spec.name, attribute))

        module.__getattr__ = kernel_of
        return module

    def exec_module(self, module):
        pass


def server_state(tp, hidden, dtype, given):
    """What a TP-``tp`` SGLang server's rank 0 has set by its first forward, set by the release's own
    setters: its arguments (published), its tensor-parallel group (the stand-in, through the
    release's parallel state), its attention groups (TP-wide, no DP attention) and the served
    model's hidden size (the DP-gather metadata)."""
    args = server_args(dict(given, tp_size=tp))
    try:
        context = importlib.import_module("sglang.srt.runtime_context").get_context()
    except (ImportError, AttributeError):  # up to 0.5.13: no runtime context
        context = None
    published = importlib.import_module("sglang.srt.server_args")
    if hasattr(context, "set_server_args"):
        # The arguments as published (0.5.21+'s global setter also resolves them, which asks for the GPU).
        context.set_server_args(args)  # publishes get_exec(), get_parallel().tp_size ...
    elif hasattr(published, "set_global_server_args_for_scheduler"):
        published.set_global_server_args_for_scheduler(args)
    else:  # up to 0.5.4: the model runner copies its keys of the arguments into global_server_args_dict
        batch = importlib.import_module("sglang.srt.managers.schedule_batch")
        batch.global_server_args_dict.update({k: getattr(args, k) for k in batch.GLOBAL_SERVER_ARGS_KEYS
                                              if hasattr(args, k)})
    flags = getattr(getattr(context, "flags", None), "dp", None)
    if flags is not None and hasattr(flags, "buffer_hidden_size"):  # 0.5.18+
        flags.buffer_hidden_size = hidden
    else:
        dp = importlib.import_module("sglang.srt.layers.dp_attention")
        dp._DpGatheredBufferWrapper.set_metadata(hidden, dtype, torch.device("cuda", 0))
        for name, value in (("_ATTN_TP_RANK", 0), ("_ATTN_TP_SIZE", tp), ("_ATTN_DP_RANK", 0), ("_ATTN_DP_SIZE", 1)):
            if name in dp.__dict__ and dp.__dict__[name] is None:  # what initialize_dp_attention sets without DP attention
                dp.__dict__[name] = value
    parallel_state = importlib.import_module("sglang.srt.distributed.parallel_state")
    if parallel_state.__dict__.get("_TP", 0) is None:  # what initialize_model_parallel sets
        parallel_state._TP = StandinGroup(tp)


def site_of(module, function):
    """The decision site and how the server calls it: a function of the batch size (SGLang 0.5.8+),
    the communicator's per-layer method, or its gather step handed the norm layer (up to 0.5.7)."""
    found = module.__dict__.get(function)
    owner = None
    if found is None:
        owner = next((c for c in module.__dict__.values() if isinstance(c, type) and c.__module__ == module.__name__
                      and function in c.__dict__), None)
        found = owner.__dict__[function] if owner is not None else None
    found = getattr(found, "__func__", found)  # a staticmethod's function
    code = getattr(found, "__code__", None)
    if code is None:
        return None
    params = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    if owner is None and code.co_argcount == 1:
        return lambda size, tp: found(size)
    if owner is not None and params[:2] == ("self", "forward_batch"):
        def per_layer(size, tp):
            # A communicator of a layer that is not the last, as its constructor leaves it for a
            # TP-N server without speculative decoding: its context made by the release's own init_new.
            layer = owner.__new__(owner)
            layer.is_last_layer = False
            layer._speculative_algo = None
            layer._context = module.CommunicateContext.init_new()
            batch = types.SimpleNamespace(input_ids=torch.empty(size, dtype=torch.int64, device="meta"))
            return found(layer, batch)
        return per_layer
    if params[:5] == ("hidden_states", "residual", "forward_batch", "layernorm", "context"):
        def gather(size, tp):
            norm = StandinNorm()
            hidden = torch.empty(size, 8, device="meta")
            found(hidden, hidden, None, norm, module.CommunicateContext.init_new(),
                  residual_input_mode=module.ScatterMode.TP_ATTN_FULL)
            if len(norm.took) != 1:
                raise RuntimeError("the layer was handed %d norm kernels" % len(norm.took))
            return norm.took[0]
        return gather
    return None


try:
    import torch
except Exception as exc:  # noqa: BLE001
    print(json.dumps({"skipped": "torch is not importable here (%s: %s)" % (type(exc).__name__, exc)}))
    sys.exit(0)

real = []
try:
    if torch.cuda.is_available():
        real = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
except Exception:  # noqa: BLE001 - a driver that does not answer: no GPU as far as this check goes
    real = []
standin = not any(major == 12 for major, _ in real)
if standin:
    torch.cuda.get_device_capability = lambda device=None: (12, 0)
    out["device"] = "stand-in SM120 GPU (no SM120 GPU visible to torch here%s)" % (
        ": it sees compute capability " + ", ".join("%d.%d" % c for c in real) if real else "")
    if request["kind"] == "sites":
        # A CPU-feature query some releases make at import and a later torch no longer has: this CPU's AMX.
        if not hasattr(torch._C._cpu, "_is_amx_tile_supported"):
            torch._C._cpu._is_amx_tile_supported = lambda: False
else:
    out["device"] = "%d GPU(s), compute capability %s" % (len(real), ", ".join("%d.%d" % c for c in real))

said = Said()
logging.getLogger().addHandler(said)
logging.getLogger().setLevel(logging.INFO)


MISSING_OP = re.compile(r"'_OpNamespace' '(\w+)' object has no attribute '(\w+)'")
operators = {"libraries": {}, "defined": []}  # the compiled operators stood in, by namespace


def stand_in_operator(exc):
    """Whether ``exc`` is the server asking torch for one of its compiled CUDA operators that is not
    registered (vLLM's vllm._C does not load without its CUDA libraries; it looks its operators up
    at import, for the patterns its passes match): on the stand-in device, the operator is then
    declared with no kernel (calling it raises; no decision calls one) and the import runs again."""
    found = MISSING_OP.match(str(exc)) if standin and isinstance(exc, AttributeError) else None
    if found is None or len(operators["defined"]) >= 1000:
        return False
    namespace, name = found.groups()
    if namespace not in operators["libraries"]:
        operators["libraries"][namespace] = torch.library.Library(namespace, "FRAGMENT")
    operators["libraries"][namespace].define(name + "(Tensor[] args) -> ()")
    operators["defined"].append("%s::%s" % (namespace, name))
    return True


def import_one(name):
    """One module, imported as the server imports it. On the stand-in device, where the import
    needs sgl_kernel and it does not load (not installed, or its CUDA libraries missing), once
    more with its kernels stood in (only then: a release that imports without it keeps its own
    way of doing without); likewise for each compiled operator it looks up that is not registered."""
    while True:
        try:
            return importlib.import_module(name)
        except AttributeError as exc:
            if not stand_in_operator(exc):
                raise
        except ImportError as exc:
            if not stand_in_kernels(exc):
                raise


def stand_in_kernels(exc):
    """Whether ``exc`` is an import failing for want of sgl_kernel on the stand-in device: its
    kernels are then stood in (once), and the output says why."""
    # Only where sgl_kernel itself does not import (a real one that loaded and lacks a module is
    # the environment's to fix), once, and for SGLang.
    if not standin or request["kind"] != "sites" or "sgl_kernel" in sys.modules or any(
            isinstance(finder, StandinKernels) for finder in sys.meta_path):
        return False
    missing = (getattr(exc, "name", None) or "").split(".")[0] == "sgl_kernel"
    if not missing and not any("/sgl_kernel/" in frame.filename for frame in traceback.extract_tb(exc.__traceback__)):
        return False
    sys.meta_path.insert(0, StandinKernels())
    for loaded in [m for m in sys.modules if m.split(".")[0] == "sgl_kernel"]:
        del sys.modules[loaded]
    out["device"] += "; sgl_kernel's CUDA kernels stood in (%s)" % (
        "it is not installed here" if isinstance(exc, ModuleNotFoundError) and exc.name == "sgl_kernel" else
        "it does not load here: " + (str(exc).strip().splitlines() or [type(exc).__name__])[0])
    return True


def import_all(names):
    """The server's modules by name, imported as the server imports them; where one does not
    import, the answer instead: {"skipped": why} (the check cannot run here) or {"error": why}
    (the patched module's own code raised)."""
    modules = {}
    for name in dict.fromkeys(names):
        try:
            modules[name] = import_one(name)
        except Exception as exc:  # noqa: BLE001
            own = name.replace(".", "/")
            frames = [frame.filename for frame in traceback.extract_tb(exc.__traceback__)]
            # An error raised by the patched module's own code says something about the patch; one
            # raised further in (a dependency missing or at another release here) means the check
            # cannot run, and says nothing about the patch.
            if isinstance(exc, ModuleNotFoundError) and exc.name and not name.startswith(exc.name):
                return {"skipped": "%s does not import here: its dependency %s is not installed" % (name, exc.name)}
            if not frames or not frames[-1].endswith((own + ".py", own + "/__init__.py")):
                return {"skipped": fail("importing " + name, exc) + " while its imports run"}
            return {"error": fail("import " + name, exc)}
    return modules


def set_profile(case):
    if "profile" in case:
        if case["profile"] is None:
            os.environ.pop("SM120PATCH_TUNED_LIMITS", None)
        else:
            os.environ["SM120PATCH_TUNED_LIMITS"] = case["profile"]


def sglang_answers():
    sites = request["sites"]
    oneshot = request.get("oneshot")
    modules = import_all([s["module"] for s in sites] + ([oneshot["module"]] if oneshot else []))
    if "skipped" in modules or "error" in modules:
        return modules
    drivers, caps = {}, {}
    for s in sites:
        module = modules[s["module"]]
        drivers[s["function"]] = site_of(module, s["function"])
        if drivers[s["function"]] is None:
            return {"skipped": "%s.%s is not a decision site this check knows how to call" % (s["module"], s["function"])}
        if standin:
            for name, value in request.get("device_flags", {}).items():
                if name in module.__dict__:
                    module.__dict__[name] = value
        try:
            caps[s["function"]] = eval(s["cap"], module.__dict__) if s.get("cap") else None  # noqa: S307 - patch data
        except Exception:  # noqa: BLE001 - a release without this constant: no cap to ask about
            caps[s["function"]] = None
    out["caps"] = caps
    for cap in caps.values():  # each release cap, at its boundary too
        if isinstance(cap, int):
            for case in request["cases"]:
                case["sizes"] = sorted(set(case["sizes"]) | {cap - 1, cap, cap + 1})

    def ask(case):
        """One server process's decisions: the inserted code decides once per process, so each TP
        size is asked in a process of its own (forked here, after the imports)."""
        tp, sizes = case["tp"], case["sizes"]
        row = {"tp": tp, "sites": {name: {} for name in drivers}, "oneshot": {}}
        set_profile(case)
        dtype = torch.bfloat16 if case["dtype"] == "bf16" else torch.float16
        try:
            server_state(tp, case["hidden"], dtype, request.get("server_args", {}))
        except Exception as exc:  # noqa: BLE001
            row["skipped"] = fail("setting up a TP%d server's state" % tp, exc)
            return row
        for size in sizes:
            for name, drive in drivers.items():
                try:
                    row["sites"][name][str(size)] = bool(drive(size, tp))
                except Exception as exc:  # noqa: BLE001
                    row["error"] = fail("%s(%d tokens) at TP%d" % (name, size, tp), exc)
                    return row
            if not oneshot:
                continue
            # The fused call's arguments as SGLang's layer hands them: a [tokens, hidden] tensor (on the
            # meta device: its size is all the expression reads), use_oneshot=None, the TP size.
            names = {"input_tensor": torch.empty(size, case["hidden"], dtype=dtype, device="meta"),
                     "use_oneshot": None, "world_size": tp}
            try:
                value = eval(oneshot["expression"], modules[oneshot["module"]].__dict__, names)  # noqa: S307 - patch data
            except Exception as exc:  # noqa: BLE001
                row["error"] = fail("the fused call's use_oneshot argument (%d tokens, TP%d)" % (size, tp), exc)
                return row
            row["oneshot"][str(size)] = value
        return row

    return {"ask": ask}


def vllm_answers():
    """vLLM decides at import: its fusion module narrows its SM120 rows then, so each case imports it
    in a process of its own. The pass fuses up to its row's bytes over hidden x itemsize tokens
    (PassConfig.flashinfer_max_size, then AllReduceFusionPass); the fused call's one-shot argument is
    the patch data's expression, evaluated in the module (before 0.29 the call compares the message
    with its one-shot row first, as written here)."""
    oneshot = request.get("oneshot")
    # vLLM configures its loggers not to propagate: its one line about the profile reaches this
    # check's handler only where vLLM leaves logging as it finds it.
    os.environ["VLLM_CONFIGURE_LOGGING"] = "0"
    # What the fusion module imports, imported once here before the processes fork: each of them
    # then imports only the fusion module itself, whose code reads the profile. One that fails
    # here fails again there, where it is reported.
    try:
        import ast

        spec = importlib.util.find_spec(request["module"])
        with open(spec.origin, encoding="utf-8") as source:
            tree = ast.parse(source.read())
        for node in tree.body:
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for name in names:
                try:
                    import_one(name)
                except Exception:  # noqa: BLE001
                    pass
    except Exception:  # noqa: BLE001 - the server's module is not found: the processes say so
        pass

    def ask(case):
        tp = case["tp"]
        set_profile(case)
        modules = import_all([request["module"]])
        if "skipped" in modules or "error" in modules:
            return dict(modules, tp=tp)
        module = modules[request["module"]]
        row = {"tp": tp, "sites": {"fusion pass": {}}, "oneshot": {}}
        mib = 1024 * 1024
        fused_mb = (module.__dict__.get("FI_ALLREDUCE_FUSION_MAX_SIZE_MB") or {}).get(120, {}).get(tp)
        oneshot_mb = (module.__dict__.get("_FI_ALLREDUCE_ONE_SHOT_MAX_SIZES_MB") or {}).get(120, {}).get(tp)
        per_token = case["hidden"] * ITEMSIZE[case["dtype"]]
        most = int(fused_mb * mib) // per_token if fused_mb is not None else 0
        for size in case["sizes"]:
            row["sites"]["fusion pass"][str(size)] = 1 <= size <= most
            if not oneshot or size > most:
                continue
            nbytes = size * per_token
            names = {"workspace": types.SimpleNamespace(backend="trtllm"), "device_capability": 120, "world_size": tp,
                     "current_tensor_size": nbytes, "num_tokens": size,
                     "use_oneshot": oneshot_mb is None or nbytes <= oneshot_mb * mib}
            try:
                row["oneshot"][str(size)] = eval(oneshot["expression"], module.__dict__, names)  # noqa: S307 - patch data
            except Exception as exc:  # noqa: BLE001
                row["error"] = fail("the fused call's use_oneshot argument (%d tokens, TP%d)" % (size, tp), exc)
                return row
        return row

    return {"ask": ask}


answers = sglang_answers() if request["kind"] == "sites" else vllm_answers()
if "ask" not in answers:
    print(json.dumps(dict(answers, device=out["device"])))
    sys.exit(0)

for case in request["cases"]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the server process of this TP size
        os.close(read)
        try:
            found = answers["ask"](case)
        except BaseException as exc:  # noqa: BLE001
            found = {"tp": case["tp"], "error": fail("the probe", exc)}
        found["log"] = list(said.lines)
        found["operators"] = operators["defined"]
        with os.fdopen(write, "w") as pipe:
            pipe.write(json.dumps(found))
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        text = pipe.read()
    os.waitpid(pid, 0)
    try:
        out["cases"].append(json.loads(text))
    except ValueError:
        out["cases"].append({"tp": case["tp"], "error": "the probe's process for TP%d ended without an answer" % case["tp"]})

stood_in = sorted({op for row in out["cases"] for op in row.pop("operators", [])})
if stood_in:
    out["device"] += "; %d compiled CUDA operators the server looks up at import stood in (%s, ...: its operator " \
                     "library does not load here)" % (len(stood_in), ", ".join(stood_in[:2]))
print(json.dumps(out))
