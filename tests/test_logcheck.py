"""`sm120patch check-log` on the lines the real releases write: every fragment of
patches/<server>/logs.toml found in the release's own wheel, and logs built from the releases'
own code and format strings (read from the wheels here: the logging format of
configure_logger / vllm.logger, the worker prefix of vLLM's _add_prefix, each message's own
format string, exceptions raised by the release's own functions), then read by the command."""

from __future__ import annotations

import ast
import json
import functools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import types
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version

from helpers import run_cli
from sm120patch.distributions import load_registry
from sm120patch.logcheck import load_logs
from sm120patch.wheels import fetch_wheel

SITE = "/srv/venv/lib/python3.11/site-packages/"
pytestmark = pytest.mark.wheels


@functools.lru_cache(maxsize=64)
def wheel_text(distribution: str, version: str, relpath: str | None) -> str:
    with zipfile.ZipFile(fetch_wheel(distribution, version)) as archive:
        if relpath is not None:
            return archive.read(relpath).decode("utf-8")
        top = {"sglang": "sglang/", "vllm": "vllm/", "flashinfer-python": "flashinfer/"}.get(distribution, "")
        return "\n".join(archive.read(n).decode("utf-8", "replace") for n in archive.namelist()
                         if n.startswith(top) and n.endswith(".py"))


def known(distribution: str, versions) -> list[str]:
    found = [v for v in load_registry(full=False).get(distribution).known_versions()
             if versions.contains(v, prereleases=True)]
    return [str(found[0]), str(found[-1])] if found else []


@pytest.mark.parametrize("server", ["sglang", "vllm"])
def test_every_message_fragment_is_in_the_lowest_and_highest_release_of_its_range(server):
    logs = load_logs(server)
    checked = 0
    native = [row for row in logs.lines if row.printed_by is not None]  # common-logs.toml: in no wheel
    assert native and all(row.kind == "died" or row.printed_by.startswith("sm120patch's") for row in native)
    for row in logs.lines:
        if row.printed_by is not None:
            continue
        if row.source is None:
            releases = known(server, row.versions & logs.versions)
            distribution = server
        else:
            releases, distribution = known(row.source, row.source_versions), row.source
        assert releases, f"{server} {row.message}: no known release in its range"
        for version in releases:
            text = wheel_text(distribution, version, row.file)
            for fragment in row.message:
                assert fragment in text, f"{distribution} {version} {row.file}: {fragment!r} is not in its source"
                checked += 1
    assert checked >= 2 * (len(logs.lines) - len(native))
    # The starts of the records that echo a request (never read) are the releases' own too.
    releases = known(server, logs.versions)
    for start in logs.echo:
        for version in releases:
            assert start in wheel_text(server, version, None), f"{server} {version}: no {start!r} in its source"


# -- the releases' own formats, read from their wheels -----------------------------------------------

def _function(source: str, name: str):
    return next(n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                and n.name == name)


def sglang_format(version: str) -> tuple[str, str]:
    """configure_logger's format (prefix still open) and datefmt, from the wheel."""
    source = wheel_text("sglang", version, "sglang/srt/utils/common.py")
    function = _function(source, "configure_logger")
    fmt = next(n.value for n in ast.walk(function) if isinstance(n, ast.Assign)
               and getattr(n.targets[0], "id", None) == "format")
    datefmt = next(k.value.value for k in ast.walk(function) if isinstance(k, ast.keyword) and k.arg == "datefmt")
    return ast.unparse(fmt), datefmt


def sglang_line(version: str, prefix: str, message: str) -> str:
    fmt, datefmt = sglang_format(version)
    formatter = logging.Formatter(eval(fmt, {"maybe_ms": "", "prefix": prefix}), datefmt)  # noqa: S307 - the wheel's f-string
    return formatter.format(logging.makeLogRecord({"msg": message, "levelname": "INFO"})) + "\n"


VLLM_LOGGING_PREFIX = ""  # the environment variable the server ran with (a test may set it)


def vllm_line(version: str, process: str | None, file: str, message: str, level: str = "INFO",
              pid: int | None = None) -> str:
    """vLLM's record format (every line of a multi-line message gets the header, as its
    NewLineFormatter does) behind the worker's "(name pid=N) " prefix, from the wheel."""
    logger_src = wheel_text("vllm", version, "vllm/logger.py")
    fmt = next(n.value for n in ast.walk(ast.parse(logger_src)) if isinstance(n, ast.Assign)
               and getattr(n.targets[0], "id", None) == "_FORMAT")
    datefmt = next(n.value.value for n in ast.walk(ast.parse(logger_src)) if isinstance(n, ast.Assign)
                   and getattr(n.targets[0], "id", None) == "_DATE_FORMAT")
    text = eval(ast.unparse(fmt), {"envs": types.SimpleNamespace(VLLM_LOGGING_PREFIX=VLLM_LOGGING_PREFIX),  # noqa: S307
                                   "VLLM_LOGGING_PREFIX": VLLM_LOGGING_PREFIX})  # 0.11: imported from vllm.envs by name
    pid = pid or 4000 + sum(map(ord, process or "MainProcess"))
    record = logging.makeLogRecord({"msg": "\x00", "levelname": level, "lineno": 42, "process": pid})
    record.fileinfo = file
    # From 0.31 the record format names the process itself (set_vllm_process_name; the main
    # process keeps multiprocessing's name) and the workers' _add_prefix is gone.
    record.vllm_process_name = process or "MainProcess"
    header = logging.Formatter(text, datefmt).format(record).split("\x00")[0]
    prefix = ""
    if process is not None and "vllm_process_name" not in text:
        utils = wheel_text("vllm", version, "vllm/utils/system_utils.py")
        shape = next(n.value for n in ast.walk(_function(utils, "_add_prefix")) if isinstance(n, ast.Assign)
                     and getattr(n.targets[0], "id", None) == "prefix")
        # 0.11 colours the prefix whatever the stream is: the module's own CYAN and RESET.
        colours = {n.targets[0].id: n.value.value for n in ast.parse(utils).body if isinstance(n, ast.Assign)
                   and getattr(n.targets[0], "id", None) in ("CYAN", "RESET")}
        prefix = eval(ast.unparse(shape), {"worker_name": process, "pid": pid, **colours})  # noqa: S307
    return "".join(f"{prefix}{header}{line}\n" for line in message.split("\n"))


def logged(distribution: str, version: str, relpath: str, fragment: str, **names) -> str:
    """The message the release's logging call holding ``fragment`` writes, its own format string
    and arguments evaluated with ``names``."""
    tree = ast.parse(wheel_text(distribution, version, relpath))
    for call in ast.walk(tree):
        if not (isinstance(call, ast.Call) and call.args):
            continue
        first = call.args[0]
        if fragment not in ast.unparse(first).replace("' '", "").replace('" "', ""):
            continue
        namespace = {"self": types.SimpleNamespace(**names), **names}
        message = eval(compile(ast.Expression(first), relpath, "eval"), namespace)  # noqa: S307
        if isinstance(first, ast.Constant) and len(call.args) > 1:
            message %= tuple(eval(compile(ast.Expression(a), relpath, "eval"), namespace) for a in call.args[1:])  # noqa: S307
        return message
    raise AssertionError(f"{distribution} {version} {relpath}: no logging call with {fragment!r}")


def raised_by(distribution: str, version: str, relpath: str, name: str, call, **names) -> str:
    """The traceback the release's own function ``name`` gives when ``call`` runs it, as Python
    prints it (the frame names the file where it is installed)."""
    source = wheel_text(distribution, version, relpath)
    node = _function(source, name)
    module = ast.Module([node], [])
    namespace = dict(names)
    exec(compile(module, SITE + relpath, "exec"), namespace)  # noqa: S102 - the release's own function
    try:
        call(namespace[name])
    except Exception:  # noqa: BLE001 - its exception is what the test is about
        return traceback.format_exc().rstrip("\n")
    raise AssertionError(f"{name} did not raise")


def check(tmp_path, text: str, *args: str):
    log = tmp_path / "server.log"
    log.write_text(text)
    result = run_cli("check-log", str(log), "--json", *args)
    return result.exit_code, json.loads(result.output)


SGLANG_START = {"0.5.9": "sglang/srt/model_executor/model_runner.py"}


def sglang_settings(version: str, tp: int, on: bool) -> str:
    flag = ("flashinfer_allreduce_fusion_backend='trtllm'" if Version(version) >= Version("0.5.14")
            else "enable_flashinfer_allreduce_fusion=True") if on else "enable_flashinfer_allreduce_fusion=False"
    return sglang_line(version, "", f"server_args=ServerArgs(model_path='m', tp_size={tp}, {flag})")


FUSED = {"0.5.9": ("FlashInfer workspace initialized for rank ", {}),
         "0.5.10": ("FlashInfer workspace initialized for rank ", {"backend": "trtllm"}),
         "0.5.14": ("FlashInfer AllReduce Fusion enabled and workspace initialized: ",
                    {"backend_name": "trtllm", "max_token_num": 2048, "hidden_dim": 4096}),
         "0.5.23": ("FlashInfer AllReduce Fusion enabled and workspace initialized: ",
                    {"backend": "trtllm", "max_token_num": 2048, "hidden_dim": 4096})}


@pytest.mark.parametrize("version", ["0.5.9", "0.5.10", "0.5.14", "0.5.23"])
def test_sglang_fused_starting_and_not_requested(tmp_path, version):
    fragment, names = FUSED[version]
    text = sglang_settings(version, 2, True)
    for rank in (0, 1):
        text += sglang_line(version, f" TP{rank}", logged("sglang", version, "sglang/srt/model_executor/model_runner.py",
                                                         "Load weight begin",
                                                         get_available_gpu_memory=lambda *a: 90.0, device="cuda",
                                                         gpu_id=rank))
    code, doc = check(tmp_path, text, "--server", "sglang", "--version", version)
    assert code == 5 and doc["verdict"] == "starting" and "loading weights" in doc["summary"], doc
    fused = text + "".join(
        sglang_line(version, f" TP{rank}", logged("sglang", version, "sglang/srt/layers/flashinfer_comm_fusion.py",
                                                 fragment, rank=rank, world_size=2, **names))
        for rank in (0, 1))
    fused += sglang_line(version, "", "The server is fired up and ready to roll!")
    code, doc = check(tmp_path, fused, "--server", "sglang", "--version", version)
    assert code == 0 and doc["verdict"] == "fused" and doc["final"] and doc["backend"] == "trtllm", doc
    assert [r["rank"] for r in doc["ranks"]] == ["TP0", "TP1"] and {r["verdict"] for r in doc["ranks"]} == {"fused"}
    # One rank only, then ready: not every rank fused.
    one = text + sglang_line(version, " TP0", logged("sglang", version, "sglang/srt/layers/flashinfer_comm_fusion.py",
                                                    fragment, rank=0, world_size=2, **names))
    one += sglang_line(version, "", "The server is fired up and ready to roll!")
    code, doc = check(tmp_path, one, "--server", "sglang", "--version", version)
    assert code == 1 and doc["verdict"] == "fell-back" and "1 of 2" in doc["summary"], doc
    # Not asked for: ready, no fusion line; the release's own flag is named.
    off = sglang_settings(version, 2, False) + sglang_line(version, "", "The server is fired up and ready to roll!")
    code, doc = check(tmp_path, off, "--server", "sglang", "--version", version)
    flag = load_registry(full=False).get("sglang").fusion_flag(Version(version))
    assert code == 1 and doc["verdict"] == "not-requested" and flag in doc["fix"], doc


@pytest.mark.parametrize("version, fragment, step", [
    ("0.5.10", "Disabling flashinfer allreduce fusion permanently", "workspace"),
    ("0.5.14", "Skipping allreduce fusion.", "workspace"),
    ("0.5.23", "Skipping allreduce fusion.", "workspace"),
])
def test_sglang_fell_back(tmp_path, version, fragment, step):
    message = logged("sglang", version, "sglang/srt/layers/flashinfer_comm_fusion.py", fragment,
                     e="cuMulticastGetGranularity failed for FlashInfer workspace preflight: CUDA_ERROR_NOT_SUPPORTED",
                     backend="trtllm")
    text = sglang_settings(version, 2, True) + sglang_line(version, " TP0", message)
    code, doc = check(tmp_path, text, "--server", "sglang", "--version", version)
    assert code == 1 and doc["verdict"] == "fell-back" and doc["step"] == step and doc["final"], doc
    assert fragment in doc["message"] and "sm120patch apply" in doc["fix"]


def test_sglang_0514_crash_from_its_own_resolve_backend_on_sm120(tmp_path):
    """_resolve_backend of the 0.5.14 wheel, asked on a GPU that is neither SM90 nor SM10X."""
    tb = raised_by("sglang", "0.5.14", "sglang/srt/layers/flashinfer_comm_fusion.py", "_resolve_backend",
                   lambda f: f("trtllm"), is_sm90_supported=lambda: False, is_sm100_supported=lambda: False)
    marker = logged("sglang", "0.5.14", "sglang/srt/managers/scheduler.py", "Scheduler hit an exception",
                    traceback=tb)
    text = sglang_settings("0.5.14", 2, True) + sglang_line("0.5.14", " TP1", marker)
    code, doc = check(tmp_path, text, "--server", "sglang")  # no --version: every release's lines
    assert code == 1 and doc["verdict"] == "crashed", doc
    assert doc["crash"]["exception"] == "ValueError: FlashInfer allreduce fusion requires SM90 or SM10X NVIDIA GPUs."
    assert doc["crash"]["frame_file"] == SITE + "sglang/srt/layers/flashinfer_comm_fusion.py"
    assert "backend-resolve" in doc["crash"]["patched_by"] and doc["step"] == "server-gates"
    assert "release not known" in " ".join(doc["notes"])


def flashinfer_unpatched_traceback() -> str:
    """FlashInfer 0.6.4's own CompilationContext on an SM120 GPU, asked as jit/comm.py asks it."""
    def call(cls):
        ctx = cls.__new__(cls)
        ctx.TARGET_CUDA_ARCHS = {(12, "0a")}
        ctx.COMMON_NVCC_FLAGS = []
        return ctx.get_nvcc_flags_list(supported_major_versions=[9, 10])
    return raised_by("flashinfer-python", "0.6.4", "flashinfer/compilation_context.py", "CompilationContext", call,
                     os=os, logger=logging.getLogger("x"), torch=None)


def test_sglang_09_crash_in_flashinfers_jit_gate_points_at_apply(tmp_path):
    marker = logged("sglang", "0.5.9", "sglang/srt/managers/scheduler.py", "Scheduler hit an exception",
                    traceback=flashinfer_unpatched_traceback())
    text = sglang_settings("0.5.9", 2, True) + sglang_line("0.5.9", " TP0", marker)
    code, doc = check(tmp_path, text, "--server", "sglang", "--version", "0.5.9")
    assert code == 1 and doc["verdict"] == "crashed" and doc["step"] == "kernel-gates", doc
    assert doc["crash"]["exception"].startswith("RuntimeError: No supported CUDA architectures found for major "
                                                "versions [9, 10]")
    assert "sm120patch apply --flashinfer" in doc["fix"]
    assert doc["crash"]["patched_by"] is None  # compilation_context.py is not a file sm120patch patches


def test_with_python_the_chain_of_that_environment_names_the_exact_fix_or_says_it_is_open(tmp_path, serving_env):
    """The same crash, read with --python: the pristine environment's chain blocks at the same
    step and gives its exact command; once patched, the chain judges that step open, and the log
    check says the server cannot have run from that environment."""
    marker = logged("sglang", "0.5.9", "sglang/srt/managers/scheduler.py", "Scheduler hit an exception",
                    traceback=flashinfer_unpatched_traceback())
    text = sglang_settings("0.5.9", 2, True) + sglang_line("0.5.9", " TP0", marker)
    python = str(serving_env.python)
    code, doc = check(tmp_path, text, "--python", python)
    assert code == 1 and doc["step"] == "kernel-gates" and doc["version_from"] == "--python", doc
    assert doc["predicted"]["verdict"] == "will not fuse"
    assert doc["fix"].endswith(f" — here: `sm120patch apply --python {python}`")
    assert run_cli("apply", "--python", python).exit_code == 0
    code, doc = check(tmp_path, text, "--python", python)
    assert code == 1 and doc["predicted"]["verdict"] == "will fuse"
    assert "— here:" not in doc["fix"]
    assert any(n.startswith(f"status judges the kernel-gates step open in {python}") for n in doc["notes"])


VLLM_FI = "vllm/distributed/device_communicators/flashinfer_all_reduce.py"
VLLM_PASS = "vllm/compilation/passes/fusion/allreduce_rms_fusion.py"


def vllm_settings(version: str, tp: int, on: bool) -> str:
    flag = "enable_fi_allreduce_fusion" if Version(version) < Version("0.12.0") else "fuse_allreduce_rms"
    message = logged("vllm", version, "vllm/v1/engine/core.py", "Initializing a V1 LLM engine (v",
                     VLLM_VERSION=version,
                     vllm_config=f"model='m', tensor_parallel_size={tp}, compilation_config="
                                 + (f"{{'pass_config': {{'{flag}': True}}}}" if on else "{}"))
    return vllm_line(version, "EngineCore_DP0", "core.py", message)


def vllm_ready(version: str) -> str:
    """The API server's ready line, from wherever the release keeps it."""
    for relpath, fragment in (("vllm/entrypoints/launchers/api_server/entry.py", "Starting vLLM server on "),
                              ("vllm/entrypoints/openai/api_server.py", "Starting vLLM server on "),
                              ("vllm/entrypoints/openai/api_server.py", "Starting vLLM API server ")):
        try:
            message = logged("vllm", version, relpath, fragment, listen_address="http://0.0.0.0:8000",
                             engine_client=types.SimpleNamespace(vllm_config=types.SimpleNamespace(
                                 parallel_config=types.SimpleNamespace(_api_process_rank=0))))
        except (KeyError, AssertionError, NameError):
            continue
        return vllm_line(version, "APIServer", "api_server.py", message)
    raise AssertionError(f"vllm {version}: no ready line")


@pytest.mark.parametrize("version", ["0.19.0", "0.29.0", "0.30.0", "0.31.0", "0.34.0"])
def test_vllm_fused_starting_fell_back_and_crashed(tmp_path, version):
    text = vllm_settings(version, 2, True)
    for rank in (0, 1):
        text += vllm_line(version, f"Worker_TP{rank}", "backends.py",
                          logged("vllm", version, "vllm/compilation/backends.py", "Compiling a graph for compile range ",
                                 compile_range="(1, 8192)", elapsed=3.2, _log_prefix=lambda: ""))
    code, doc = check(tmp_path, text)  # server and release from the lines
    assert code == 5 and doc["verdict"] == "starting" and doc["version"] == version and doc["server"] == "vllm", doc
    assert doc["version_from"] == "the log"
    fused = text
    for rank in (0, 1):
        fused += vllm_line(version, f"Worker_TP{rank}", "flashinfer_all_reduce.py",
                           logged("vllm", version, VLLM_FI, "Initialized FlashInfer Allreduce norm fusion workspace ",
                                  backend="trtllm"))
    ready = vllm_ready(version)
    code, doc = check(tmp_path, fused + ready)
    assert code == 0 and doc["verdict"] == "fused" and doc["backend"] == "trtllm", doc
    assert sorted(r["rank"] for r in doc["ranks"]) == ["Worker_TP0", "Worker_TP1"]
    assert any("only at DEBUG" in n for n in doc["notes"])

    # As released on SM120: no 120 row, the pass says so and stays off.
    gated = text + vllm_line(version, "Worker_TP0", "allreduce_rms_fusion.py",
                             logged("vllm", version, VLLM_PASS, "is not supported for world size", tp_size=2),
                             "WARNING")
    code, doc = check(tmp_path, gated)
    assert code == 1 and doc["verdict"] == "fell-back" and doc["step"] == "server-gates", doc

    # A worker dies of FlashInfer's gate: its traceback carries the worker prefix on every line.
    died = text + vllm_line(version, "Worker_TP1", "multiproc_executor.py",
                            logged("vllm", version, "vllm/v1/executor/multiproc_executor.py",
                                   "WorkerProc failed to start.") + "\n" + flashinfer_unpatched_traceback(), "ERROR")
    code, doc = check(tmp_path, died)
    assert code == 1 and doc["verdict"] == "crashed" and doc["step"] == "kernel-gates", doc
    assert doc["crash"]["frame_file"] == SITE + "flashinfer/compilation_context.py"


VLLM_OLD_PASS = "vllm/compilation/collective_fusion.py"  # the fusion pass up to 0.15.x


@pytest.mark.parametrize("version", ["0.11.1", "0.12.0", "0.15.1", "0.16.0", "0.17.0", "0.18.1"])
def test_vllm_before_0_19_fuses_silently_at_info_and_says_so(tmp_path, version):
    """vLLM 0.11.1-0.18.x, which status covers: the pass logs its workspace only at DEBUG (0.17-0.18)
    or not at all (0.11.1-0.16.0), and says why in a warning when it stays off."""
    fusion_file = VLLM_OLD_PASS if Version(version) < Version("0.16.0") else VLLM_PASS
    text = vllm_settings(version, 2, True)
    compiling = ("Compiling a graph for compile range " if Version(version) >= Version("0.13.0")
                 else "Compiling a graph for dynamic shape takes ")
    for rank in (0, 1):
        text += vllm_line(version, f"Worker_TP{rank}", "backends.py",
                          logged("vllm", version, "vllm/compilation/backends.py", compiling,
                                 compile_range="(1, 8192)", elapsed=3.2, runtime_shape=None, _log_prefix=lambda: ""))
    code, doc = check(tmp_path, text)
    assert code == 5 and doc["verdict"] == "starting" and doc["version"] == version, doc
    assert "torch.compile" in doc["summary"]

    code, doc = check(tmp_path, text + vllm_ready(version))
    assert code == 0 and doc["verdict"] == "fused" and doc["final"], doc
    assert "only at DEBUG" in doc["summary"] and "none of the warnings" in doc["summary"], doc

    code, doc = check(tmp_path, vllm_settings(version, 2, False) + vllm_ready(version))
    assert code == 1 and doc["verdict"] == "not-requested", doc

    gated = text + vllm_line(version, "Worker_TP0", fusion_file.rsplit("/", 1)[1],
                             logged("vllm", version, fusion_file, "is not supported for world size", tp_size=2),
                             "WARNING") + vllm_ready(version)
    code, doc = check(tmp_path, gated)
    assert code == 1 and doc["verdict"] == "fell-back" and doc["step"] == "server-gates", doc
    assert "fusion-table" in doc["fix"]

    died = text + vllm_line(version, "Worker_TP1", "multiproc_executor.py",
                            logged("vllm", version, "vllm/v1/executor/multiproc_executor.py",
                                   "WorkerProc failed to start.") + "\n" + flashinfer_unpatched_traceback(), "ERROR")
    code, doc = check(tmp_path, died)
    assert code == 1 and doc["verdict"] == "crashed" and doc["step"] == "kernel-gates", doc

    if Version(version) < Version("0.17.0"):
        return
    # 0.17-0.18 at DEBUG: the workspace on every rank; without multicast, the pass's own warning.
    fused = text
    for rank in (0, 1):
        fused += vllm_line(version, f"Worker_TP{rank}", "flashinfer_all_reduce.py",
                           logged("vllm", version, VLLM_FI, "Initialized FlashInfer All Reduce workspace: backend=",
                                  backend="trtllm", world_size=2, rank=rank, max_token_num=2048, hidden_dim=4096,
                                  dtype="torch.bfloat16"), "DEBUG")
    code, doc = check(tmp_path, fused + vllm_ready(version))
    assert code == 0 and doc["verdict"] == "fused" and doc["backend"] == "trtllm", doc
    assert "on every rank (2 of 2)" in doc["summary"]
    refused = text + vllm_line(version, "Worker_TP0", "allreduce_rms_fusion.py",
                               logged("vllm", version, VLLM_PASS, "AllReduce fusion pass is disabled: flashinfer workspace ",
                                      e="[SymmDeviceMemory] Device does not support multicasting."), "WARNING")
    code, doc = check(tmp_path, refused)
    assert code == 1 and doc["verdict"] == "fell-back" and doc["step"] == "workspace", doc
    assert "unicast-workspace" in doc["fix"]


def test_vllm_034_hisparse_backend_lines(tmp_path):
    """0.34.0's own HiSparse lines: on one node trtllm at once (a note, fusion goes on), across
    nodes no FlashInfer allreduce (a fall-back)."""
    version = "0.34.0"
    text = vllm_settings(version, 2, True)
    one_node = text + vllm_line(version, "Worker_TP0", "flashinfer_all_reduce.py",
                                logged("vllm", version, VLLM_FI, "Using flashinfer allreduce backend trtllm: the mnnvl"))
    for rank in (0, 1):
        one_node += vllm_line(version, f"Worker_TP{rank}", "flashinfer_all_reduce.py",
                              logged("vllm", version, VLLM_FI, "Initialized FlashInfer Allreduce norm fusion workspace ",
                                     backend="trtllm"))
    code, doc = check(tmp_path, one_node + vllm_ready(version))
    assert code == 0 and doc["verdict"] == "fused" and any("HiSparse" in n for n in doc["notes"]), doc
    nodes = text + vllm_line(version, "Worker_TP0", "flashinfer_all_reduce.py",
                             logged("vllm", version, VLLM_FI, "FlashInfer allreduce is disabled: the mnnvl"), "WARNING")
    code, doc = check(tmp_path, nodes + vllm_ready(version))
    assert code == 1 and doc["verdict"] == "fell-back" and doc["step"] == "workspace" and "vllm#64327" in doc["fix"], doc


def test_vllm_019_without_multicast_falls_back_and_029_notes_it(tmp_path):
    e = "[SymmDeviceMemory] Device does not support multicasting."
    for version, verdict in (("0.19.0", "fell-back"), ("0.29.0", "starting")):
        message = logged("vllm", version, VLLM_FI, "This is expected on GPUs without NVSwitch", e=e)
        text = vllm_settings(version, 2, True) + vllm_line(version, "Worker_TP0", "flashinfer_all_reduce.py", message,
                                                           "WARNING")
        code, doc = check(tmp_path, text)
        assert doc["verdict"] == verdict, (version, doc)
        if verdict == "fell-back":
            assert code == 1 and doc["step"] == "workspace" and "unicast-workspace" in doc["fix"]
        else:  # 0.25+: mnnvl first, then trtllm: not a fall-back by itself
            assert code == 5 and any("NVSwitch" in n for n in doc["notes"])


def test_an_unknown_release_shows_what_was_seen(tmp_path):
    text = vllm_line("0.29.0", "EngineCore_DP0", "core.py",
                     logged("vllm", "0.29.0", "vllm/v1/engine/core.py", "Initializing a V1 LLM engine (v",
                            VLLM_VERSION="0.99.0", vllm_config="tensor_parallel_size=2"))
    text += vllm_line("0.29.0", "Worker_TP0", "flashinfer_all_reduce.py",
                      logged("vllm", "0.29.0", VLLM_FI, "Initialized FlashInfer Allreduce norm fusion workspace ",
                             backend="trtllm"))
    code, doc = check(tmp_path, text)
    assert code == 3 and doc["verdict"] == "unknown-release" and doc["version"] == "0.99.0", doc
    assert any("Initialized FlashInfer Allreduce norm fusion workspace" in s for s in doc["seen"])


# -- reading: growing, rotated, truncated, coloured, not UTF-8, big ------------------------------------

class _Idle:
    """logcheck's clock, with a flag raised each time the follower has read all there is and
    waits: the writer below writes its next part only then, so what the test writes is read
    in the order it means (before the file exists, then growing, then rotated), however slow
    the machine is."""

    def __init__(self):
        self.waiting = threading.Event()

    def __getattr__(self, name):
        return getattr(time, name)

    def sleep(self, seconds):
        self.waiting.set()
        time.sleep(seconds)

    def next_part(self):
        self.waiting.clear()
        assert self.waiting.wait(120), "check-log stopped reading"
        self.waiting.clear()
        self.waiting.wait(120)  # a whole wait after the clear: the read before it saw the last part


def test_follow_a_growing_rotated_file_until_the_verdict(tmp_path, monkeypatch):
    import sm120patch.logsource

    idle = _Idle()
    monkeypatch.setattr(sm120patch.logsource, "time", idle)
    log = tmp_path / "sglang.log"
    version = "0.5.9"
    lines = [sglang_settings(version, 2, True)]
    lines += [sglang_line(version, f" TP{r}", logged("sglang", version, "sglang/srt/layers/flashinfer_comm_fusion.py",
                                                   "FlashInfer workspace initialized for rank ", rank=r, world_size=2))
              for r in (0, 1)]
    ready = sglang_line(version, "", "The server is fired up and ready to roll!")

    def write():
        idle.next_part()  # the file does not exist when check-log starts
        log.write_bytes(b"\x1b[32m" + lines[0].encode() + b"\x1b[0m" + b"noise \xff\xfe not utf-8\n")
        idle.next_part()
        with log.open("a") as f:
            f.write(lines[1])
        idle.next_part()
        log.rename(tmp_path / "sglang.log.1")  # logrotate: a new file at the path
        log.write_text(lines[2])
        idle.next_part()
        with log.open("a") as f:
            f.write(ready)

    writer = threading.Thread(target=write)
    writer.start()
    result = run_cli("check-log", str(log), "--follow", "--timeout", "60", "--json", "--version", version,
                     "--server", "sglang")
    writer.join()
    doc = json.loads(result.output)
    assert result.exit_code == 0 and doc["verdict"] == "fused" and doc["final"] and not doc["timed_out"], doc


def test_follow_times_out_while_starting_with_exit_5(tmp_path):
    log = tmp_path / "sglang.log"
    log.write_text(sglang_settings("0.5.9", 2, True))
    result = run_cli("check-log", str(log), "--follow", "--timeout", "1", "--server", "sglang")
    assert result.exit_code == 5 and "still starting" in result.output and "timeout passed" in result.output


@pytest.mark.parametrize("collector", ["plain", "journal-short", "kubectl"])
def test_new_run_gives_the_restarted_servers_verdict_not_the_run_before(tmp_path, collector):
    """A log kept across restarts ends with the run before the restart (fused here) until the
    restarted server's first line comes: --follow answers with that old run at once; --new-run
    waits for the run that begins after it started and gives that run's verdict (fell back),
    whatever collector wrote the lines."""
    version = "0.5.9"
    log = tmp_path / "sglang.log"
    log.write_text(collected(collector, sglang_run(version, "fused")))
    args = ("--json", "--server", "sglang", "--version", version)
    old = run_cli("check-log", str(log), "--follow", "--timeout", "30", *args)
    assert old.exit_code == 0 and json.loads(old.output)["verdict"] == "fused"

    def restart():
        time.sleep(1.5)  # the restarted server's first line comes after check-log has read the file
        with log.open("a") as f:
            f.write(collected(collector, sglang_run(version, "fell-back")))

    writer = threading.Thread(target=restart)
    writer.start()
    result = run_cli("check-log", str(log), "--new-run", "--timeout", "60", *args)
    writer.join()
    doc = json.loads(result.output)
    assert result.exit_code == 1 and doc["verdict"] != "fused" and (doc["run"], doc["runs"]) == (2, 2), doc
    assert doc["final"] and not doc["timed_out"], doc


def test_new_run_counts_what_was_there_by_its_size_at_the_start_not_by_when_it_was_read(tmp_path):
    """The restarted server may write before check-log has read the old runs (a large log): what
    the file held at the start ends at its size then, so the new run's first lines still count as
    new. The reader's first idle tick comes exactly there, whatever was appended meanwhile."""
    from sm120patch.logsource import open_lines

    log = tmp_path / "sglang.log"
    before, after = sglang_run("0.5.9", "fused"), sglang_run("0.5.9", "fell-back")
    log.write_text(before[:-10])  # the old run's last line not finished yet at the start
    lines = open_lines(str(log), follow=True, deadline=None, mark_start=True)
    with log.open("a") as f:  # the end of that line, and the restarted server's run, before any read
        f.write(before[-10:] + after)
    read = []
    for text in lines:
        if text is None:
            break
        read.append(text)
    assert read == before.splitlines()[:-1]  # the old run's whole lines, and not one line more
    rest = []
    for text in lines:
        if text is None:
            break
        rest.append(text)
    assert rest == (before[before.rstrip("\n").rfind("\n") + 1:] + after).splitlines()


def test_new_run_without_one_is_no_verdict_yet(tmp_path):
    log = tmp_path / "sglang.log"
    log.write_text(sglang_run("0.5.9", "fused"))
    result = run_cli("check-log", str(log), "--new-run", "--timeout", "1", "--server", "sglang", "--version", "0.5.9")
    assert result.exit_code == 5, result.output
    assert "no run of the server began after check-log started (the newest in the log: run 1, from line 1, was " \
           "already there): no verdict yet" in result.output


def test_truncation_and_a_100_mb_log_are_streamed(tmp_path):
    version = "0.5.9"
    filler = sglang_line(version, " TP0", "Decode batch. #running-req: 1, #token: 100, token usage: 0.00, "
                                          "gen throughput (token/s): 90.00, #queue-req: 0") * 1000
    log = tmp_path / "big.log"
    with log.open("w") as f:
        f.write(sglang_settings(version, 2, True))
        while f.tell() < 100 * 1024 * 1024:
            f.write(filler)
        for r in (0, 1):
            f.write(sglang_line(version, f" TP{r}", logged(
                "sglang", version, "sglang/srt/layers/flashinfer_comm_fusion.py",
                "FlashInfer workspace initialized for rank ", rank=r, world_size=2)))
        f.write(sglang_line(version, "", "The server is fired up and ready to roll!"))
    result = run_cli("check-log", str(log), "--json", "--server", "sglang", "--version", version)
    doc = json.loads(result.output)
    assert result.exit_code == 0 and doc["verdict"] == "fused" and doc["lines"] > 500_000, doc


def test_a_missing_file_is_one_line_exit_2(tmp_path):
    result = run_cli("check-log", str(tmp_path / "nope.log"))
    assert result.exit_code == 2 and "no such file" in result.output and "Traceback" not in result.output


# -- the logs operators have (issue #54): collectors' prefixes x releases x outcomes, restarts ------

NCCL_ABORT = ("[rank1]:[E1128 10:03:41.123456 4242 ProcessGroupNCCL.cpp:1896] [PG ID 0 PG GUID 0(default_pg) Rank 1] "
              "Process group watchdog thread terminated with exception: CUDA error: an illegal memory access was "
              "encountered")
DIED_OUTSIDE = [NCCL_ABORT + "\n",
                "terminate called after throwing an instance of 'c10::DistBackendError'\n",
                "Fatal Python error: Aborted\n"]


def collected(collector: str, text: str) -> str:
    """``text`` as a collector writes it: journald's short format, docker/kubectl's RFC 3339 time,
    RFC 5424 syslog, or as it is (a plain file, ``journalctl -o cat``)."""
    prefix = {"plain": "", "journal-cat": "",
              "journal-short": "Nov 28 10:03:41 gpu-host sglang[4242]: ",
              "docker": "2026-11-28T10:03:41.123456789Z ",
              "kubectl": "2026-11-28T10:03:41.123456789+00:00 ",
              "syslog": "<14>1 2026-11-28T10:03:41.123Z gpu-host server 4242 - - "}[collector]
    return "".join(prefix + line + "\n" for line in text.splitlines())


def sglang_run(version: str, outcome: str) -> str:
    fragment, names = FUSED[version]
    text = sglang_settings(version, 2, True)
    fused = "".join(sglang_line(version, f" TP{r}", logged("sglang", version, "sglang/srt/layers/flashinfer_comm_fusion.py",
                                                         fragment, rank=r, world_size=2, **names)) for r in (0, 1))
    ready = sglang_line(version, "", "The server is fired up and ready to roll!")
    if outcome == "fused":
        return text + fused + ready
    if outcome == "died":
        return text + fused + ready + sglang_line(version, " TP1", "Prefill batch. #new-seq: 1") + "".join(DIED_OUTSIDE)
    if outcome == "fell-back":  # as released on SM120: ready, and no rank made the workspace
        return text + ready
    if outcome == "starting":
        return text + sglang_line(version, " TP1", logged("sglang", version, "sglang/srt/model_executor/model_runner.py",
                                                         "Load weight begin", get_available_gpu_memory=lambda *a: 90.0,
                                                         device="cuda", gpu_id=1))
    if outcome == "not-requested":
        return sglang_settings(version, 2, False) + ready
    if outcome == "crashed":
        return text + sglang_line(version, " TP0", logged("sglang", version, "sglang/srt/managers/scheduler.py",
                                                         "Scheduler hit an exception",
                                                         traceback=flashinfer_unpatched_traceback()))
    raise AssertionError(outcome)


def vllm_run(version: str, outcome: str) -> str:
    text = vllm_settings(version, 2, True)
    fused = "".join(vllm_line(version, f"Worker_TP{r}", "flashinfer_all_reduce.py",
                              logged("vllm", version, VLLM_FI, "Initialized FlashInfer Allreduce norm fusion workspace ",
                                     backend="trtllm")) for r in (0, 1))
    ready = vllm_line(version, "APIServer", "api_server.py",
                      logged("vllm", version, "vllm/entrypoints/openai/api_server.py" if version == "0.19.0"
                             else "vllm/entrypoints/launchers/api_server/entry.py", "Starting vLLM server on ",
                             listen_address="http://0.0.0.0:8000"))
    if outcome == "fused":
        return text + fused + ready
    if outcome == "died":
        return text + fused + ready + "".join(f"(Worker_TP1 pid=4242) {line}" for line in DIED_OUTSIDE)
    if outcome == "fell-back":
        return text + vllm_line(version, "Worker_TP0", "allreduce_rms_fusion.py",
                                logged("vllm", version, VLLM_PASS, "is not supported for world size", tp_size=2),
                                "WARNING") + ready
    if outcome == "starting":
        return text + vllm_line(version, "Worker_TP0", "backends.py",
                                logged("vllm", version, "vllm/compilation/backends.py",
                                       "Compiling a graph for compile range ", compile_range="(1, 8192)", elapsed=3.2))
    if outcome == "not-requested":
        return vllm_settings(version, 2, False) + ready
    if outcome == "crashed":
        return text + vllm_line(version, "Worker_TP1", "multiproc_executor.py",
                                logged("vllm", version, "vllm/v1/executor/multiproc_executor.py",
                                       "WorkerProc failed to start.") + "\n" + flashinfer_unpatched_traceback(), "ERROR")
    raise AssertionError(outcome)


RUNS = {"sglang": ("0.5.9", sglang_run), "vllm": ("0.29.0", vllm_run)}
EXPECT = {"fused": (0, "fused"), "died": (1, "crashed"), "crashed": (1, "crashed"), "fell-back": (1, "fell-back"),
          "starting": (5, "starting"), "not-requested": (1, "not-requested")}


@pytest.mark.parametrize("collector", ["plain", "journal-cat", "journal-short", "docker", "kubectl", "syslog"])
@pytest.mark.parametrize("server", ["sglang", "vllm"])
@pytest.mark.parametrize("outcome", ["fused", "died", "crashed", "fell-back", "starting", "not-requested",
                                     "after-a-crash"])
def test_collectors_releases_and_outcomes(tmp_path, collector, server, outcome):
    """Each collector's prefix, each server, and: fused; fused then dead outside Python (the NCCL
    watchdog's abort); crashed in Python; fell back; starting; not requested; a crashed run, then a
    restart (``>>``, systemd's append:) that fused. (Ready before the first request:
    test_a_lazy_workspace_is_not_known_until_the_first_request.)"""
    version, run = RUNS[server]
    if outcome == "after-a-crash":
        first = run(version, "crashed")
        text, expect = first + run(version, "fused"), (0, "fused")
    else:
        text, expect = run(version, outcome), EXPECT[outcome]
    args = ("--server", "sglang", "--version", version) if server == "sglang" else ()
    code, doc = check(tmp_path, collected(collector, text), *args)
    assert (code, doc["verdict"]) == expect, doc
    assert doc["server"] == server and doc["version"] == version
    if outcome == "fused":
        assert doc["final"] and sorted(r["verdict"] for r in doc["ranks"]) == ["fused", "fused"], doc
    if outcome == "died":
        assert doc["summary"].startswith("died outside Python") and "watchdog" in doc["summary"], doc
        assert "fusion had started" in doc["summary"] and "sm120patch verify" in doc["fix"], doc
    if outcome == "after-a-crash":
        assert (doc["run"], doc["runs"]) == (2, 2) and doc["run_line"] == len(first.splitlines()) + 1, doc
        assert any("2 runs" in n for n in doc["notes"])


def test_the_readme_example_runs_as_printed_and_the_wrong_server_says_so(tmp_path):
    code, doc = check(tmp_path, sglang_run("0.5.9", "fused"), "--version", "0.5.9")  # README: no --server
    assert code == 0 and doc["verdict"] == "fused" and doc["server"] == "sglang", doc
    log = tmp_path / "vllm.log"
    log.write_text(vllm_run("0.29.0", "fused"))
    for follow in ((), ("--follow", "--timeout", "60")):
        started = time.monotonic()
        result = run_cli("check-log", str(log), "--server", "sglang", *follow)
        assert result.exit_code == 2 and "vLLM's log format" in result.output and "--server vllm" in result.output
        assert "Traceback" not in result.output and time.monotonic() - started < 30


def test_seven_of_eight_names_the_failing_rank_and_out_of_memory_is_not_a_patch(tmp_path):
    version = "0.5.14"
    text = sglang_settings(version, 8, True)
    echo = logged("sglang", version, "sglang/srt/layers/flashinfer_comm_fusion.py", "disabled globally because ")
    cause = logged("sglang", version, "sglang/srt/layers/flashinfer_comm_fusion.py",
                   "Disabling flashinfer allreduce fusion permanently.", backend="trtllm",
                   e="CUDA out of memory. Tried to allocate 1.50 GiB. GPU 5 has a total capacity of 94.97 GiB")
    text += "".join(sglang_line(version, f" TP{r}", echo) for r in (0, 1, 2, 3, 4, 6, 7))
    text += sglang_line(version, " TP5", cause)
    code, doc = check(tmp_path, text, "--server", "sglang", "--version", version)
    assert code == 1 and doc["verdict"] == "fell-back" and "on TP5" in doc["summary"], doc
    assert "unicast" not in doc["fix"] and "mem-fraction-static" in doc["fix"], doc


def test_a_fragment_says_what_its_lines_support(tmp_path):
    """vLLM 0.29 on its way to fusing, the version line rotated away: the mnnvl warning means a
    fall-back only before 0.25, so it is not counted."""
    version = "0.29.0"
    warn = vllm_line(version, "Worker_TP0", "flashinfer_all_reduce.py",
                     logged("vllm", version, VLLM_FI, "This is expected on GPUs without NVSwitch",
                            e="[SymmDeviceMemory] Device does not support multicasting."), "WARNING")
    fused = "".join(vllm_line(version, f"Worker_TP{r}", "flashinfer_all_reduce.py",
                              logged("vllm", version, VLLM_FI, "Initialized FlashInfer Allreduce norm fusion workspace ",
                                     backend="trtllm")) for r in (0, 1))
    code, doc = check(tmp_path, warn + fused)
    # Not fused: from 0.29 the workspace line is fusion's only where the settings line (not in this
    # fragment) asks for the pass, and the server has not said it is ready.
    assert doc["verdict"] == "starting" and code == 5 and not doc["final"], doc
    assert any(n.startswith("not counted:") and "--version tells" in n for n in doc["notes"]), doc


def test_workspace_lines_that_are_not_fusion(tmp_path):
    # vLLM 0.29: the same workspace for plain allreduces, the pass not asked for.
    version = "0.29.0"
    plain = vllm_run(version, "fused").replace("'fuse_allreduce_rms': True", "'custom_ops': ['none']")
    code, doc = check(tmp_path, plain)
    assert code == 1 and doc["verdict"] == "not-requested", doc
    assert any("plain allreduces" in n for n in doc["notes"]), doc
    # SGLang with DP attention: the workspace, and a predicate that never fuses.
    dp = sglang_run("0.5.9", "fused").replace("enable_flashinfer_allreduce_fusion=True",
                                              "enable_flashinfer_allreduce_fusion=True, enable_dp_attention=True")
    code, doc = check(tmp_path, dp, "--server", "sglang", "--version", "0.5.9")
    assert code == 1 and doc["verdict"] == "not-requested" and "DP attention" in doc["fix"], doc


def test_a_lazy_workspace_is_not_known_until_the_first_request(tmp_path):
    version = "0.5.9"
    text = sglang_settings(version, 2, True).replace("enable_flashinfer_allreduce_fusion=True",
                                                     "enable_flashinfer_allreduce_fusion=True, disable_cuda_graph=True")
    text += sglang_line(version, "", "The server is fired up and ready to roll!")
    code, doc = check(tmp_path, text, "--server", "sglang", "--version", version)
    assert code == 5 and doc["verdict"] == "starting" and "first request" in doc["summary"], doc
    served = text + sglang_line(version, " TP0", "Prefill batch. #new-seq: 1, #new-token: 12")
    code, doc = check(tmp_path, served, "--server", "sglang", "--version", version)
    assert code == 1 and doc["verdict"] == "fell-back" and doc["step"] == "server-gates", doc


# -- sources that are not plain files (issue #53 item 1) ----------------------------------------------

def sm120patch(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sm120patch", *args], capture_output=True, text=True,
                          timeout=120, **kwargs)


def test_follow_on_a_fifo_whose_writer_stays_answers_before_the_timeout(tmp_path):
    fifo = tmp_path / "log.fifo"
    os.mkfifo(fifo)
    done = threading.Event()

    def write():
        with open(fifo, "w") as f:
            f.write(sglang_run("0.5.9", "fused"))
            f.flush()
            done.wait(60)  # the writer keeps the FIFO open, as `<(cat log; sleep 25)` does

    writer = threading.Thread(target=write)
    writer.start()
    try:
        started = time.monotonic()
        result = sm120patch("check-log", str(fifo), "--follow", "--timeout", "30", "--server", "sglang",
                            "--version", "0.5.9")
        assert result.returncode == 0 and "fused" in result.stdout, result
        assert time.monotonic() - started < 25
    finally:
        done.set()
        writer.join()


def test_a_fifo_without_a_writer_ends_at_the_timeout_and_a_closed_one_is_read(tmp_path):
    fifo = tmp_path / "log.fifo"
    os.mkfifo(fifo)
    started = time.monotonic()
    result = sm120patch("check-log", str(fifo), "--timeout", "2", "--server", "sglang")
    assert result.returncode == 5 and "timeout passed" in result.stdout and time.monotonic() - started < 30, result
    writer = threading.Thread(target=lambda: fifo.write_text(sglang_run("0.5.9", "fused")))
    writer.start()
    result = sm120patch("check-log", str(fifo), "--follow", "--timeout", "30", "--version", "0.5.9")
    writer.join()
    assert result.returncode == 0 and "Illegal seek" not in result.stderr, result


@pytest.mark.parametrize("how", ["path", "stdin", "pipe", "no-newline"])
def test_an_endless_source_is_refused_in_bounded_time(how):
    if how == "path":
        result = sm120patch("check-log", "/dev/zero")
    elif how == "stdin":
        with open("/dev/zero", "rb") as zero:
            result = sm120patch("check-log", "-", stdin=zero)
    elif how == "no-newline":  # one endless "line": the part skipped past is judged too
        result = subprocess.run(f"cat /dev/zero | {sys.executable} -m sm120patch check-log - --timeout 60", shell=True,
                                capture_output=True, text=True, timeout=120)
    else:
        result = subprocess.run(f"cat /dev/urandom | {sys.executable} -m sm120patch check-log -", shell=True,
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.startswith("sm120patch: error: "), result
    assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) <= 2


def test_standard_input_closed_is_one_line_exit_2():
    result = subprocess.run(f"{sys.executable} -m sm120patch check-log - <&-", shell=True, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and "standard input is closed" in result.stderr, result
    assert "Traceback" not in result.stderr


def test_memory_stays_bounded_whatever_the_number_of_tracebacks(tmp_path):
    """A run of 50 000 tracebacks (each a scheduler's crash line, as 0.5.9 writes it) is read in
    about the memory of a short log: only what the verdict needs is kept."""
    one = sglang_run("0.5.9", "crashed").split("\n", 1)[1]
    log = tmp_path / "many.log"
    with log.open("w") as f:
        f.write(sglang_settings("0.5.9", 2, True))
        for _ in range(50_000):
            f.write(one)
    small = tmp_path / "small.log"
    small.write_text(sglang_settings("0.5.9", 2, True) + one)
    probe = ("import resource, sys; from click.testing import CliRunner; from sm120patch.cli import cli; "
             "r = CliRunner().invoke(cli, ['check-log', sys.argv[1], '--server', 'sglang', '--version', '0.5.9']); "
             "print(r.exit_code, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    used = {}
    for name, path in (("small", small), ("many", log)):
        out = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, timeout=300)
        code, kib = out.stdout.split()
        assert code == "1", out
        used[name] = int(kib)
    assert used["many"] - used["small"] < 10 << 10, (used, log.stat().st_size)  # KiB (before: +27 MiB)


def test_an_interrupted_check_log_does_not_claim_a_rollback(tmp_path):
    fifo = tmp_path / "log.fifo"
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, "-m", "sm120patch", "check-log", str(fifo), "--timeout", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "rolled back" not in err and "changes nothing" in err, err


def flashinfer_sm100_only_traceback() -> str:
    """FlashInfer 0.6.4's own CompilationContext on an SM120 GPU, asked as jit/fused_moe.py asks it
    for its SM100-only MoE kernels."""
    def call(cls):
        ctx = cls.__new__(cls)
        ctx.TARGET_CUDA_ARCHS = {(12, "0a")}
        ctx.COMMON_NVCC_FLAGS = []
        return ctx.get_nvcc_flags_list(supported_major_versions=[10])
    return raised_by("flashinfer-python", "0.6.4", "flashinfer/compilation_context.py", "CompilationContext", call,
                     os=os, logger=logging.getLogger("x"), torch=None)


@pytest.mark.parametrize("server", ["sglang", "vllm"])
def test_another_flashinfer_modules_arch_error_is_not_blamed_on_trtllm_comm(tmp_path, server):
    version, _ = RUNS[server]
    tb = flashinfer_sm100_only_traceback()
    if server == "sglang":
        text = sglang_settings(version, 2, True) + sglang_line(version, " TP0", logged(
            "sglang", version, "sglang/srt/managers/scheduler.py", "Scheduler hit an exception", traceback=tb))
        args = ("--server", "sglang", "--version", version)
    else:
        text = vllm_settings(version, 2, True) + vllm_line(version, "Worker_TP1", "multiproc_executor.py", logged(
            "vllm", version, "vllm/v1/executor/multiproc_executor.py", "WorkerProc failed to start.") + "\n" + tb,
            "ERROR")
        args = ()
    code, doc = check(tmp_path, text, *args)
    assert code == 1 and doc["verdict"] == "crashed" and "major versions [10]" in doc["crash"]["exception"], doc
    assert doc["step"] == "device" and "apply --flashinfer" not in doc["fix"], doc
    assert ("--moe-runner-backend" if server == "sglang" else "--moe-backend") in doc["fix"]


def test_runs_are_told_by_who_prints_the_start_line(tmp_path):
    """vLLM's engine cores under data parallelism each print the start line: one run. SGLang's
    main process printing its settings again without a word from a rank is a restart."""
    version = "0.29.0"
    first, rest = vllm_run(version, "fused").split("\n", 1)
    dp = f"{first}\n{first.replace('EngineCore_DP0', 'EngineCore_DP1')}\n{rest}"
    code, doc = check(tmp_path, dp)
    assert code == 0 and doc["verdict"] == "fused" and doc["runs"] == 1, doc
    version = "0.5.9"
    off = sglang_settings(version, 2, False) + sglang_line(version, "", "The server is fired up and ready to roll!")
    code, doc = check(tmp_path, off + sglang_run(version, "fused"), "--version", version)
    assert code == 0 and doc["verdict"] == "fused" and (doc["run"], doc["runs"], doc["run_line"]) == (2, 2, 3), doc
    text = run_cli("check-log", str(tmp_path / "server.log"), "--version", version).output
    assert "run 2 of 2 (from line 3): the newest run decides" in text


@pytest.mark.parametrize("line, printed_by", [
    (NCCL_ABORT, "libtorch"),
    ("terminate called after throwing an instance of 'c10::DistBackendError'", "libstdc++"),
    ("Fatal Python error: Segmentation fault", "CPython"),
    ("/usr/local/bin/serve.sh: line 12:  4242 Killed                  python3 -m sglang.launch_server", "the shell"),
    ("Segmentation fault (core dumped)", "the shell"),
    ("*** SIGSEGV received at time=1732788221 on cpu 3 ***", "a native failure-signal handler"),
    ("sglang.service: Main process exited, code=killed, status=9/KILL", "systemd"),
    ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ", "torch.distributed.elastic"),
    ("launcher", None),
])
@pytest.mark.parametrize("server", ["sglang", "vllm"])
def test_each_death_outside_python_after_a_fused_start(tmp_path, server, line, printed_by):
    version, run = RUNS[server]
    if line == "launcher":  # the server's own report of a child gone, from its wheel
        line = (sglang_line(version, "", logged("sglang", version, "sglang/srt/entrypoints/engine.py",
                                                "Scheduler or DataParallelController ",
                                                proc=types.SimpleNamespace(pid=4242, exitcode=-9)))
                if server == "sglang" else
                vllm_line(version, None, "multiproc_executor.py", logged(
                    "vllm", version, "vllm/v1/executor/multiproc_executor.py", "Worker proc ",
                    proc=types.SimpleNamespace(name="VllmWorker-1", exitcode=-9)), "ERROR")).rstrip("\n")
    args = ("--server", "sglang", "--version", version) if server == "sglang" else ()
    code, doc = check(tmp_path, run(version, "fused") + line + "\n", *args)
    assert code == 1 and doc["verdict"] == "crashed" and doc["summary"].startswith("died outside Python"), doc
    assert "fusion had started" in doc["summary"] and doc["fix"], doc
    assert (doc["crash"]["printed_by"] or "").startswith(printed_by) if printed_by else doc["crash"]["printed_by"] is None


@pytest.mark.parametrize("server", ["sglang", "vllm"])
def test_the_tuned_limits_a_server_took_are_reported(tmp_path, server):
    """The line sm120patch's tuned-limits patch makes every rank print (the inserted code's own
    words, `_sm120patch_said`) is reported once, with the ranks that printed it; a fused run stays
    fused."""
    from sm120patch import _tuned_runtime as rt

    version, run = RUNS[server]
    entry = {"fused_max_bytes": 131072, "oneshot_max_bytes": 65536, "created": "2026-12-05T01:30:00Z"}
    took = rt._sm120patch_said(entry, "", 2)
    kept = rt._sm120patch_said(None, "no profile at /etc/sm120patch/tuned-limits.json", 2)
    for said in (took, kept):
        if server == "sglang":
            lines = "".join(sglang_line(version, f" TP{r}", said) for r in (0, 1))
        else:
            lines = "".join(vllm_line(version, f"Worker_TP{r}", "allreduce_rms_fusion.py", said) for r in (0, 1))
        text = run(version, "fused")
        at = text.index("\n", text.index("fusion workspace" if server == "vllm" else "workspace")) + 1
        args = ("--server", "sglang", "--version", version) if server == "sglang" else ()
        code, doc = check(tmp_path, text[:at] + lines + text[at:], *args)
        assert code == 0 and doc["verdict"] == "fused", doc
        mine = [n for n in doc["notes"] if said in n]
        assert len(mine) == 1 and mine[0].startswith("TP0, TP1: " if server == "sglang" else "Worker_TP0, Worker_TP1: "), doc["notes"]


# -- issue #62: fleets, node log files, lines a user writes, wrong fixes, ready or not ----------------

def pod(name: str, text: str) -> str:
    """``text`` as `kubectl logs -l app=... --prefix` prints it for the pod ``name``."""
    return "".join(f"[pod/{name}/server] {line}\n" for line in text.splitlines())


def interleaved(*streams: str) -> str:
    """The lines of several streams taken in turn, as one stream of a fleet mixes them."""
    split = [s.splitlines() for s in streams]
    out = []
    for index in range(max(map(len, split))):
        out += [lines[index] for lines in split if index < len(lines)]
    return "".join(line + "\n" for line in out)


@pytest.mark.parametrize("server", ["sglang", "vllm"])
def test_replicas_in_one_kubectl_prefix_stream_are_told_apart(tmp_path, server):
    """Two replicas of a Deployment read with kubectl's --prefix: each gets its own verdict, named,
    and the exit is the worst; two fused replicas are not 'run 2 of 2'; one pod with --prefix
    reads as a plain log does."""
    version, run = RUNS[server]
    args = ("--server", "sglang", "--version", version) if server == "sglang" else ()
    code, doc = check(tmp_path, pod("srv-a", run(version, "fused")), *args)
    assert code == 0 and doc["verdict"] == "fused" and doc["replica"] == "pod/srv-a/server", doc
    both = interleaved(pod("srv-a", run(version, "fused")), pod("srv-b", run(version, "fused")))
    code, doc = check(tmp_path, both, *args)
    assert code == 0 and doc["verdict"] == "fused", doc
    assert [(r["replica"], r["verdict"], r["runs"]) for r in doc["replicas"]] == [
        ("pod/srv-a/server", "fused", 1), ("pod/srv-b/server", "fused", 1)], doc
    # kubectl's own lines in the stream (no replica, no server line) are not a replica.
    noise = "Defaulted container \"server\" out of: server, init (init)\n"
    code, doc = check(tmp_path, noise + both, *args)
    assert code == 0 and len(doc["replicas"]) == 2, doc
    mixed = interleaved(pod("srv-a", run(version, "fused")), pod("srv-b", run(version, "fell-back")))
    code, doc = check(tmp_path, mixed, *args)
    assert code == 1 and doc["verdict"] == "fell-back" and doc["replica"] == "pod/srv-b/server", doc
    assert "2 replicas (1 fell-back, 1 fused)" in doc["summary"], doc
    text = run_cli("check-log", str(tmp_path / "server.log"), *args).output
    assert "server.log (pod/srv-a/server)" in text and "server.log (pod/srv-b/server)" in text, text
    # --follow answers once every replica has a final verdict.
    result = run_cli("check-log", str(tmp_path / "server.log"), "--follow", "--timeout", "60", "--json", *args)
    assert result.exit_code == 1 and not json.loads(result.output)["timed_out"], result.output


def cri(text: str, cut: int = 0) -> str:
    """``text`` as the CRI format of /var/log/pods writes it (containerd, CRI-O): time, stream,
    P or F; with ``cut``, each line longer than that is split into P records and a last F."""
    out = []
    for line in text.splitlines():
        parts = [line[i:i + cut] for i in range(0, len(line), cut)] if cut else [line]
        out += [f"2026-11-28T10:03:41.123456789Z stderr {'F' if i == len(parts) - 1 else 'P'} {part}"
                for i, part in enumerate(parts)]
    return "\n".join(out) + "\n"


def docker_json(text: str, cut: int = 0) -> str:
    """``text`` as docker's json-file driver writes it (a line it cut has no newline at the end)."""
    out = []
    for line in text.splitlines():
        parts = [line[i:i + cut] for i in range(0, len(line), cut)] if cut else [line]
        out += [json.dumps({"log": part + ("\n" if i == len(parts) - 1 else ""), "stream": "stderr",
                            "time": "2026-11-28T10:03:41.123456789Z"}, separators=(",", ":"))
                for i, part in enumerate(parts)]
    return "\n".join(out) + "\n"


@pytest.mark.parametrize("wrap", ["cri", "cri-partial", "docker-json", "docker-json-partial"])
@pytest.mark.parametrize("server", ["sglang", "vllm"])
def test_node_log_files_are_read_by_their_format(tmp_path, server, wrap):
    version, run = RUNS[server]
    args = ("--server", "sglang", "--version", version) if server == "sglang" else ()
    for outcome, expect in (("fused", (0, "fused")), ("fell-back", (1, "fell-back"))):
        text = run(version, outcome)
        wrapped = (cri if wrap.startswith("cri") else docker_json)(text, 40 if wrap.endswith("partial") else 0)
        code, doc = check(tmp_path, wrapped, *args)
        assert (code, doc["verdict"]) == expect, (outcome, doc)
        if outcome == "fused":
            assert sorted(r["verdict"] for r in doc["ranks"]) == ["fused", "fused"], doc


def test_compressed_rotations_are_read_by_content_with_and_without_follow(tmp_path):
    import gzip as gz

    version = "0.5.9"
    rotated = tmp_path / "server.log.1"  # no .gz: the content says what it is
    rotated.write_bytes(gz.compress(sglang_run(version, "fused").encode()))
    args = ("--server", "sglang", "--version", version, "--json")
    result = run_cli("check-log", str(rotated), *args)
    assert result.exit_code == 0 and json.loads(result.output)["verdict"] == "fused", result.output
    started = time.monotonic()
    result = run_cli("check-log", str(rotated), "--follow", "--timeout", "60", *args)
    assert result.exit_code == 0 and time.monotonic() - started < 30, result.output  # it never grows
    piped = subprocess.run(f"cat {rotated} {rotated} | {sys.executable} -m sm120patch check-log - "
                           "--server sglang --version 0.5.9 --json", shell=True, capture_output=True, text=True,
                           timeout=120)
    doc = json.loads(piped.stdout)
    assert piped.returncode == 0 and (doc["run"], doc["runs"]) == (2, 2), piped
    result = run_cli("check-log", str(rotated), "--new-run", "--timeout", "5", "--server", "sglang")
    assert result.exit_code == 2 and "no run of the server can begin in it" in result.output, result.output


def test_a_long_line_is_matched_by_its_start_and_the_log_is_still_read(tmp_path):
    """A 1.6 MB request logged after the server is up: the rest of that line is skipped, the log
    is not refused, the verdict stands."""
    version = "0.5.9"
    text = sglang_run(version, "fused")
    big = sglang_line(version, " TP0", "Prefill batch. #new-seq: 1, " + "x" * 1_600_000)
    code, doc = check(tmp_path, text + big, "--server", "sglang", "--version", version)
    assert code == 0 and doc["verdict"] == "fused", doc


def test_a_zstd_log_is_read_or_refused_in_one_line(tmp_path):
    log = tmp_path / "server.log.2"
    log.write_bytes(b"\x28\xb5\x2f\xfd" + os.urandom(64))  # zstd's magic number, then a frame
    result = sm120patch("check-log", str(log))
    try:
        import zstandard  # noqa: F401
    except ImportError:
        if sys.version_info < (3, 14):
            assert result.returncode == 2 and "zstd" in result.stderr and "zstd -dc" in result.stderr, result
            return
    assert result.returncode in (2, 5) and "Traceback" not in result.stderr, result


def test_binary_data_is_refused_with_exit_2():
    result = sm120patch("check-log", "/bin/ls")
    assert result.returncode == 2 and "not a text log" in result.stderr, result
    assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) <= 2


def test_a_bare_traceback_holding_the_readmes_error_is_a_crash(tmp_path):
    """_resolve_backend of the 0.5.14 wheel raising on SM120, printed by Python itself (no
    'Scheduler hit an exception:' line before it): crashed, with the fix of that error."""
    tb = raised_by("sglang", "0.5.14", "sglang/srt/layers/flashinfer_comm_fusion.py", "_resolve_backend",
                   lambda f: f("trtllm"), is_sm90_supported=lambda: False, is_sm100_supported=lambda: False)
    text = sglang_settings("0.5.14", 2, True) + tb + "\n"
    code, doc = check(tmp_path, text, "--server", "sglang", "--version", "0.5.14")
    assert code == 1 and doc["verdict"] == "crashed" and doc["step"] == "server-gates", doc
    assert doc["crash"]["exception"].endswith("requires SM90 or SM10X NVIDIA GPUs."), doc
    # The same traceback in a run that got ready is not what ended it.
    ready = text + sglang_line("0.5.14", "", "The server is fired up and ready to roll!")
    code, doc = check(tmp_path, ready, "--server", "sglang", "--version", "0.5.14")
    assert doc["verdict"] != "crashed", doc


def sglang_echo(version: str, prompt: str) -> str:
    """The record SGLang's --log-requests writes for a request with this prompt, its own f-string."""
    return sglang_line(version, "", logged("sglang", version, "sglang/srt/utils/request_logger.py", "Receive: obj=",
                                           _dataclass_to_string_truncated=lambda o, m, skip_names=None:
                                           f"GenerateReqInput(text={o!r})", obj=prompt, max_length=2048,
                                           skip_names=None, headers_str=""))


def test_a_prompt_echoed_by_log_requests_never_changes_the_verdict(tmp_path):
    version = "0.5.14"
    fragment, names = FUSED[version]
    settings = sglang_settings(version, 2, True)
    fused = settings + "".join(sglang_line(version, f" TP{r}", logged(
        "sglang", version, "sglang/srt/layers/flashinfer_comm_fusion.py", fragment, rank=r, world_size=2, **names))
        for r in (0, 1)) + sglang_line(version, "", "The server is fired up and ready to roll!")
    crash = logged("sglang", version, "sglang/srt/managers/scheduler.py", "Scheduler hit an exception",
                   traceback="ValueError: FlashInfer allreduce fusion requires SM90 or SM10X NVIDIA GPUs.")
    code, doc = check(tmp_path, fused + sglang_echo(version, f"why does my log say {crash}"), "--server", "sglang",
                      "--version", version)
    assert code == 0 and doc["verdict"] == "fused", doc
    off = sglang_settings(version, 8, False) + sglang_line(version, "", "The server is fired up and ready to roll!")
    quote = logged("sglang", version, "sglang/srt/layers/flashinfer_comm_fusion.py", fragment, rank=0, world_size=8,
                   **names)
    code, doc = check(tmp_path, off + sglang_echo(version, quote), "--server", "sglang", "--version", version)
    assert code == 1 and doc["verdict"] == "not-requested" and not doc["ranks"], doc
    # vLLM's echo of a response that quotes the workspace line.
    v = "0.33.0"
    answer = logged("vllm", v, "vllm/entrypoints/serve/utils/request_logger.py", "Generated response %s%s: output: %r",
                    request_id="cmpl-1", stream_info="", outputs=["Initialized FlashInfer Allreduce norm fusion "
                                                                  "workspace with backend=trtllm"], finish_reason="stop")
    text = vllm_settings(v, 2, False) + vllm_line(v, "APIServer", "request_logger.py", answer) + vllm_ready(v)
    code, doc = check(tmp_path, text)
    assert code == 1 and doc["verdict"] == "not-requested", doc


def test_a_fell_back_line_that_caught_flashinfers_jit_gate_names_the_jit_gate(tmp_path):
    """SGLang 0.5.14 with its pinned FlashInfer 0.6.12, only SGLang patched: its workspace code
    catches the JIT gate's error and falls back; the fix is FlashInfer's jit-gate."""
    version = "0.5.14"
    error = flashinfer_unpatched_traceback().splitlines()[-1].split(": ", 1)[1]
    line = logged("sglang", version, "sglang/srt/layers/flashinfer_comm_fusion.py",
                  "Disabling flashinfer allreduce fusion permanently.", backend="trtllm", e=error)
    text = sglang_settings(version, 2, True) + sglang_line(version, " TP0", line)
    for args in (("--version", version), ()):
        code, doc = check(tmp_path, text, "--server", "sglang", *args)
        assert code == 1 and doc["verdict"] == "fell-back" and doc["step"] == "kernel-gates", doc
        assert "apply --flashinfer" in doc["fix"] and "unicast" not in doc["fix"], doc


@pytest.mark.parametrize("cause, step, words", [
    ("CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of 94.97 GiB", "workspace",
     "--gpu-memory-utilization"),
    ("Ninja build failed. Ninja output:", "jit", "sm120patch build"),
    ("cuda-too-old", "jit", "CUDA 12.9 or newer"),
])
def test_vllm_names_the_cause_a_backend_gave_before_no_backend_made_the_workspace(tmp_path, cause, step, words):
    if cause == "cuda-too-old":  # FlashInfer 0.6.12's own error for a CUDA toolkit too old for SM 12.x (120f)
        cause = logged("flashinfer-python", "0.6.12", "flashinfer/compilation_context.py", "SM 12.x requires CUDA")
    version = "0.33.0"
    text = vllm_settings(version, 2, True)
    for r in (0, 1):
        text += vllm_line(version, f"Worker_TP{r}", "flashinfer_all_reduce.py",
                          logged("vllm", version, VLLM_FI, "Failed to initialize FlashInfer All Reduce workspace: %s.",
                                 e=cause), "WARNING")
        text += vllm_line(version, f"Worker_TP{r}", "flashinfer_all_reduce.py",
                          logged("vllm", version, VLLM_FI, "Failed to initialize FlashInfer Allreduce norm fusion "
                                 "workspace ", backend="trtllm"), "ERROR")
    code, doc = check(tmp_path, text + vllm_ready(version))
    assert code == 1 and doc["verdict"] == "fell-back" and doc["step"] == step, doc
    assert words in doc["fix"] and "unicast" not in doc["fix"], doc


@pytest.mark.parametrize("setting, words", [("enforce_eager=True, ", "--enforce-eager"),
                                            ("'mode': <CompilationMode.NONE: 0>, ", "-O0")])
def test_vllm_without_compilation_runs_no_pass(tmp_path, setting, words):
    version = "0.29.0"
    settings = vllm_settings(version, 2, True)
    if setting.startswith("enforce"):
        settings = settings.replace("tensor_parallel_size=2, ", "tensor_parallel_size=2, " + setting)
    else:
        settings = settings.replace("{'pass_config'", "{" + setting + "'pass_config'")
    code, doc = check(tmp_path, settings + vllm_ready(version))
    assert code == 1 and doc["verdict"] == "not-requested" and words in doc["fix"], doc
    assert "fusion-table" not in doc["fix"], doc


def test_a_cuda_graph_capture_oom_is_the_graphs_not_the_workspaces(tmp_path):
    version = "0.5.9"
    relpath = "sglang/srt/model_executor/cuda_graph_runner.py"
    message = logged("sglang", version, relpath, "Capture cuda graph failed: ",
                     e="CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of 94.97 GiB",
                     CUDA_GRAPH_CAPTURE_FAILED_MSG="Possible solutions:")
    namespace = {}
    exec(compile(f"def capture():\n    raise Exception({message!r})\n", SITE + relpath, "exec"), namespace)  # noqa: S102
    try:
        namespace["capture"]()
    except Exception:  # noqa: BLE001
        tb = traceback.format_exc().rstrip("\n")
    marker = logged("sglang", version, "sglang/srt/managers/scheduler.py", "Scheduler hit an exception", traceback=tb)
    text = sglang_run(version, "fused").rsplit("\n", 2)[0] + "\n" + sglang_line(version, " TP1", marker)
    code, doc = check(tmp_path, text, "--server", "sglang", "--version", version)
    assert code == 1 and doc["verdict"] == "crashed" and "--cuda-graph-max-bs" in doc["fix"], doc
    assert "no memory left for FlashInfer's workspace" not in doc["fix"], doc


@pytest.mark.parametrize("args", [(), ("--version", "0.29.0")])
def test_vllm_029_workspace_lines_without_the_settings_line_give_no_verdict(tmp_path, args):
    version = "0.29.0"
    text = "".join(vllm_line(version, f"Worker_TP{r}", "flashinfer_all_reduce.py",
                             logged("vllm", version, VLLM_FI, "Initialized FlashInfer Allreduce norm fusion workspace ",
                                    backend="trtllm")) for r in (0, 1)) + vllm_ready(version)
    code, doc = check(tmp_path, text, *args)
    assert code == 5 and doc["verdict"] == "starting" and "settings line" in doc["summary"], doc


@pytest.mark.parametrize("server", ["sglang", "vllm"])
def test_exit_0_means_fused_and_serving_and_follow_waits_for_ready(tmp_path, server):
    version, run = RUNS[server]
    args = ("--server", "sglang", "--version", version) if server == "sglang" else ()
    whole = run(version, "fused")
    ready_at = whole.rstrip("\n").rfind("\n") + 1
    code, doc = check(tmp_path, whole[:ready_at], *args)
    assert code == 5 and doc["verdict"] == "starting" and "not serving yet" in doc["summary"], doc
    log = tmp_path / "server.log"

    def ready():
        time.sleep(2)
        with log.open("a") as f:
            f.write(whole[ready_at:])

    writer = threading.Thread(target=ready)
    writer.start()
    result = run_cli("check-log", str(log), "--follow", "--timeout", "60", "--json", *args)
    writer.join()
    doc = json.loads(result.output)
    assert result.exit_code == 0 and doc["verdict"] == "fused" and doc["final"], doc


def test_sglang_0521_graph_capture_is_a_stage(tmp_path):
    version = "0.5.21"
    begin = logged("sglang", version, "sglang/srt/model_executor/model_runner_components/cuda_graph_setup.py",
                   "CUDA graph begin. ", capture_name="target decode", prefill_backend="fa3",
                   capture_num_tokens=[1, 2], before_mem=40.0)
    text = sglang_settings(version, 2, True) + sglang_line(version, " TP0", begin)
    code, doc = check(tmp_path, text, "--server", "sglang", "--version", version)
    assert code == 5 and "capturing CUDA graphs" in doc["summary"], doc


def vllm_logo(version: str) -> str:
    """The API server's first lines from 0.33: log_version_and_model's logo, monochrome."""
    source = wheel_text("vllm", version, "vllm/entrypoints/common/startup.py")
    function = _function(source, "log_version_and_model")
    template = next(n for n in ast.walk(function) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "Template")
    from string import Template
    logo = Template(ast.literal_eval(template.args[0])).substitute(dict.fromkeys("wobr", "")) % (version, "m")
    return vllm_line(version, "APIServer", "startup.py", logo)


def test_vllm_033_logo_starts_a_run_and_names_the_release(tmp_path):
    """From 0.33 the API server's first line is a logo: a start that got no further than it (killed
    before its engine started) is a run of its own, and the logo names the release."""
    version = "0.33.0"
    first = vllm_logo(version)
    code, doc = check(tmp_path, first + vllm_logo(version) + vllm_run(version, "fused"))
    assert code == 0 and doc["verdict"] == "fused" and doc["version"] == version, doc
    at = len(first.splitlines()) + next(i for i, line in enumerate(first.splitlines(), 1) if "version" in line)
    assert (doc["run"], doc["runs"], doc["run_line"]) == (2, 2, at), doc  # the logo's version line
    code, doc = check(tmp_path, first)
    assert code == 5 and (doc["version"], doc["version_from"]) == (version, "the log"), doc


def test_dp2_tp2_counts_four_ranks_and_notes_say_things_once(tmp_path):
    version = "0.29.0"
    settings = vllm_settings(version, 2, True).replace("tensor_parallel_size=2, ",
                                                       "tensor_parallel_size=2, data_parallel_size=2, ")
    workers = [f"Worker_DP{d}_TP{t}" for d in (0, 1) for t in (0, 1)]
    fused = "".join(vllm_line(version, w, "flashinfer_all_reduce.py",
                              logged("vllm", version, VLLM_FI, "Initialized FlashInfer Allreduce norm fusion workspace ",
                                     backend="trtllm"), pid=5000 + i) for i, w in enumerate(workers))
    code, doc = check(tmp_path, settings + fused + vllm_ready(version))
    assert code == 0 and doc["expected_ranks"] == 4 and "(4 of 4)" in doc["summary"], doc
    text = run_cli("check-log", str(tmp_path / "server.log")).output
    assert "ranks (4 of 4 seen)" in text, text
    # Plain allreduce workspaces on two processes: "2 processes"; an ambiguous line every rank
    # printed: one note.
    plain = vllm_run(version, "fused").replace("'fuse_allreduce_rms': True", "'custom_ops': ['none']")
    code, doc = check(tmp_path, plain)
    assert any("on 2 processes," in n for n in doc["notes"]), doc
    warn = "".join(vllm_line(version, f"Worker_TP{r}", "flashinfer_all_reduce.py",
                             logged("vllm", version, VLLM_FI, "This is expected on GPUs without NVSwitch",
                                    e="[SymmDeviceMemory] Device does not support multicasting."), "WARNING")
                   for r in (0, 1))
    code, doc = check(tmp_path, warn)
    assert len([n for n in doc["notes"] if n.startswith("not counted:")]) == 1, doc


@pytest.mark.parametrize("version", ["0.29.0", "0.33.0"])
def test_vllm_logging_prefix_keeps_the_workers_apart(tmp_path, monkeypatch, version):
    """VLLM_LOGGING_PREFIX comes first in the record format (the wheel's own): from 0.31 before the
    process name, before that after the worker's prefix."""
    monkeypatch.setattr(sys.modules[__name__], "VLLM_LOGGING_PREFIX", "[replica-a] ")
    text = vllm_run(version, "fused")
    assert "[replica-a] " in text
    code, doc = check(tmp_path, text)
    assert code == 0 and doc["verdict"] == "fused", doc
    assert sorted(r["rank"] for r in doc["ranks"]) == ["Worker_TP0", "Worker_TP1"], doc


def test_vllm_cuda_graph_capture_oom_is_the_graphs_not_the_workspaces(tmp_path):
    """An out-of-memory raised under the model runner's capture_model (the name read from the
    wheel) is the graphs' memory; the same error elsewhere stays the workspace's."""
    version = "0.29.0"
    relpath = "vllm/v1/worker/gpu_model_runner.py"
    assert "def capture_model(" in wheel_text("vllm", version, relpath)
    namespace = {}
    exec(compile("class OutOfMemoryError(RuntimeError):\n    __module__ = 'torch'\n"  # torch's own name
                 "def capture_model():\n    raise OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB. "
                 "GPU 1 has a total capacity of 94.97 GiB')\n", SITE + relpath, "exec"), namespace)  # noqa: S102
    try:
        namespace["capture_model"]()
    except RuntimeError:
        tb = traceback.format_exc().rstrip("\n")
    failed = logged("vllm", version, "vllm/v1/executor/multiproc_executor.py", "WorkerProc failed to start.")
    text = vllm_run(version, "fused").rsplit("\n", 2)[0] + "\n"
    code, doc = check(tmp_path, text + vllm_line(version, "Worker_TP1", "multiproc_executor.py", failed + "\n" + tb,
                                                "ERROR"))
    assert code == 1 and doc["verdict"] == "crashed" and "CUDA graph capture" in doc["fix"], doc
    elsewhere = tb.replace("in capture_model", "in load_model")
    code, doc = check(tmp_path, text + vllm_line(version, "Worker_TP1", "multiproc_executor.py",
                                                failed + "\n" + elsewhere, "ERROR"))
    assert code == 1 and "FlashInfer's workspace" in doc["fix"], doc


def test_new_run_in_a_fleet_waits_for_each_replicas_restart(tmp_path):
    """--new-run on a stream of two replicas: each replica's verdict is that of its run that began
    after check-log started."""
    version = "0.5.9"
    log = tmp_path / "fleet.log"
    log.write_text(interleaved(pod("srv-a", sglang_run(version, "fused")), pod("srv-b", sglang_run(version, "fused"))))

    def restart():
        time.sleep(1.5)
        with log.open("a") as f:
            f.write(interleaved(pod("srv-a", sglang_run(version, "fused")),
                                pod("srv-b", sglang_run(version, "fell-back"))))

    writer = threading.Thread(target=restart)
    writer.start()
    result = run_cli("check-log", str(log), "--new-run", "--timeout", "60", "--json", "--server", "sglang",
                     "--version", version)
    writer.join()
    doc = json.loads(result.output)
    assert result.exit_code == 1 and doc["replica"] == "pod/srv-b/server" and not doc["timed_out"], doc
    assert [(r["verdict"], r["run"], r["runs"]) for r in doc["replicas"]] == [("fused", 2, 2), ("fell-back", 2, 2)]


def test_sglang_dp_ranks_are_counted_and_dp_attention_does_not_double_them(tmp_path):
    version = "0.5.9"
    fragment, names = FUSED[version]
    scopes = [f" DP{d} TP{t}" for d in (0, 1) for t in (0, 1)]
    fused = "".join(sglang_line(version, scope, logged("sglang", version, "sglang/srt/layers/flashinfer_comm_fusion.py",
                                                      fragment, rank=i % 2, world_size=2, **names))
                    for i, scope in enumerate(scopes)) + sglang_line(version, "", "The server is fired up and ready to roll!")
    settings = sglang_settings(version, 2, True).replace("tp_size=2, ", "tp_size=2, dp_size=2, ")
    code, doc = check(tmp_path, settings + fused, "--server", "sglang", "--version", version)
    assert code == 0 and doc["expected_ranks"] == 4 and "(4 of 4)" in doc["summary"], doc
    attention = sglang_settings(version, 4, True).replace(
        "tp_size=4, ", "tp_size=4, dp_size=2, ").replace(")", ", enable_dp_attention=True)")
    code, doc = check(tmp_path, attention + fused, "--server", "sglang", "--version", version)
    assert doc["expected_ranks"] == 4 and doc["verdict"] == "not-requested", doc
