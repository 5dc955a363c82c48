# Runs inside the target interpreter for `sm120patch verify --tuned` (and after `apply --with
# tuned-limits`). argv[1]: JSON
#   {"predicate": {"module", "function", "cap"}, "oneshot": {"module", "expression"} or null,
#    "server_args": {field: value}, "device_flags": {name: value}, "cases": [{"tp", "hidden", "dtype", "sizes"}]}
# Imports the server's patched modules as the server does (importlib, the installed files), then
# asks the server's own decision code, at each TP size and batch size, what it does: the fusion
# predicate the patch data rewrites (fused or not) and the one-shot argument its fused call hands
# FlashInfer (the expression the patch data puts there, evaluated in the fused call's module).
# Prints one JSON document.
#
# Where no SM120 GPU is visible, a stand-in answers for the device only, and the output says so:
# torch's device capability (12.0, what the inserted code asks at the first forward), the
# module-level device flags the server computed from torch at import ("device_flags", as an SM120
# GPU sets them), and the tensor-parallel group of a TP-N server (this one process is its rank 0:
# the group's world size, through the release's own parallel state). The server's state is set by
# the release's own setters, as a TP-N server started with "server_args" (fusion requested, no DP
# attention) has it by its first forward: its ServerArgs, published; the served model's hidden
# size. The check is about the limits; status's `requested` step is about the options. Nothing
# sm120patch inserted, nor anything it calls, is replaced.
import importlib
import json
import logging
import os
import sys
import traceback

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
    """The tensor-parallel group of a TP-N server, as its rank 0 sees it (one process stands for N)."""

    def __init__(self, world_size):
        self.world_size = world_size
        self.rank_in_group = 0
        self.rank = 0
        self.local_rank = 0
        self.ranks = list(range(world_size))


def start_server(tp, hidden, dtype, given):
    """What a TP-``tp`` SGLang server's rank 0 has set by its first forward, set by the release's own
    setters: its arguments (published), its tensor-parallel group (the stand-in, through the
    release's parallel state), and the served model's hidden size (the DP-gather metadata)."""
    import importlib

    import torch

    args = server_args(dict(given, tp_size=tp))
    try:
        context = importlib.import_module("sglang.srt.runtime_context")
    except ImportError:  # up to 0.5.20: no runtime context, the arguments are a module global
        context = None
        importlib.import_module("sglang.srt.server_args").set_global_server_args_for_scheduler(args)
    if context is not None:
        # The arguments as published (0.5.21+'s global setter also resolves them, which asks for the GPU).
        context.get_context().set_server_args(args)  # publishes get_exec(), get_parallel().tp_size ...
        context.get_flags().dp.buffer_hidden_size = hidden
    else:
        dp = importlib.import_module("sglang.srt.layers.dp_attention")
        dp._DpGatheredBufferWrapper.set_metadata(hidden, dtype, torch.device("cuda", 0))
    parallel_state = importlib.import_module("sglang.srt.distributed.parallel_state")
    if context is None:
        parallel_state._TP = StandinGroup(tp)


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
else:
    out["device"] = "%d GPU(s), compute capability %s" % (len(real), ", ".join("%d.%d" % c for c in real))

said = Said()
logging.getLogger().addHandler(said)
logging.getLogger().setLevel(logging.INFO)

spec = request["predicate"]
modules = {}
for name in dict.fromkeys([spec["module"]] + ([request["oneshot"]["module"]] if request.get("oneshot") else [])):
    try:
        modules[name] = importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001
        own = name.replace(".", "/")
        frames = [frame.filename for frame in traceback.extract_tb(exc.__traceback__)]
        # An error in the patched module itself says something about the patch; one raised by a
        # dependency that is missing here means the check cannot run.
        if isinstance(exc, ModuleNotFoundError) and exc.name and not name.startswith(exc.name):
            print(json.dumps({"skipped": "%s does not import here: its dependency %s is not installed" % (name, exc.name),
                              "device": out["device"]}))
            sys.exit(0)
        if not any(f.endswith((own + ".py", own + "/__init__.py")) for f in frames):
            print(json.dumps({"skipped": fail("importing " + name, exc) + " while its packages import",
                              "device": out["device"]}))
            sys.exit(0)
        print(json.dumps({"error": fail("import " + name, exc), "device": out["device"]}))
        sys.exit(0)

predicate_module = modules[spec["module"]]
predicate = getattr(predicate_module, spec["function"], None)
if predicate is None or getattr(predicate, "__code__", None) is None or predicate.__code__.co_argcount != 1:
    print(json.dumps({"skipped": "%s.%s is not a predicate of the batch size (this check drives those, SGLang 0.5.8+)"
                      % (spec["module"], spec["function"]), "device": out["device"]}))
    sys.exit(0)
if standin:
    for name, value in request.get("device_flags", {}).items():
        if name in predicate_module.__dict__:
            predicate_module.__dict__[name] = value
cap = out["cap"] = predicate_module.__dict__.get(spec.get("cap") or "")
if isinstance(cap, int):  # the release's own cap, at its boundary too
    for case in request["cases"]:
        case["sizes"] = sorted(set(case["sizes"]) | {cap - 1, cap, cap + 1})

oneshot = request.get("oneshot")


def ask(case):
    """One server process's decisions: the inserted code decides once per process, so each TP size
    is asked in a process of its own (forked here, after the imports)."""
    tp, sizes = case["tp"], case["sizes"]
    row = {"tp": tp, "fused": {}, "oneshot": {}}
    dtype = torch.bfloat16 if case["dtype"] == "bf16" else torch.float16
    try:
        start_server(tp, case["hidden"], dtype, request.get("server_args", {}))
    except Exception as exc:  # noqa: BLE001
        row["skipped"] = fail("setting up a TP%d server's state" % tp, exc)
        return row
    for size in sizes:
        try:
            row["fused"][str(size)] = bool(predicate(size))
        except Exception as exc:  # noqa: BLE001
            row["error"] = fail("%s(%d) at TP%d" % (spec["function"], size, tp), exc)
            break
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
            break
        row["oneshot"][str(size)] = value
    row["log"] = list(said.lines)
    return row


for case in request["cases"]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the server process of this TP size
        os.close(read)
        try:
            found = ask(case)
        except BaseException as exc:  # noqa: BLE001
            found = {"tp": case["tp"], "error": fail("the probe", exc)}
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

print(json.dumps(out))
