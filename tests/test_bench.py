"""`sm120patch bench` without GPUs: argument handling, every refusal (one line, its exit code),
the hang watchdog on real processes, the recommendation rules, and the worker's own arithmetic
in a real torch (CPU) environment. The GPU run itself is recorded in docs/two-gpu.md."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from helpers import Session, run_cli
from sm120patch import bench
from sm120patch.cli import cli
from sm120patch.errors import CheckFailedError, ExitCode, RefusedError, TargetError, UsageError
from sm120patch.render import bench_json, render_bench

H200 = ("NVIDIA H200", 9, 0)
RTX_PRO_6000 = ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", 12, 0)


def target(devices=(H200, H200), **overrides) -> bench.TargetInfo:
    fields = dict(torch="2.11.0+cu130", flashinfer="0.6.4", cuda=True, nccl=True, devices=tuple(devices))
    fields.update(overrides)
    return bench.TargetInfo(**fields)


def request(**overrides) -> bench.BenchRequest:
    fields = dict(python=Path("/srv/env/bin/python"), tokens=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048),
                  hidden=(4096, 7168))
    return bench.BenchRequest(**dict(fields, **overrides))


def one_line(result, text: str) -> None:
    errors = [line for line in result.output.splitlines() if line.startswith("sm120patch: error:")]
    assert len(errors) == 1 and text in errors[0], result.output
    assert "Traceback" not in result.output


# -- arguments ---------------------------------------------------------------------------

def test_lists_parse_sorted_and_deduplicated():
    assert bench.parse_int_list("64, 1,16,1", option="--tokens", minimum=1, maximum=16384) == (1, 16, 64)


@pytest.mark.parametrize("text, message", [
    ("1,x", "'x' is not a whole number"),
    ("0", "0 must be between 1 and 16384"),
    (",", "give at least one value"),
])
def test_bad_token_lists_are_one_line(text, message):
    result = CliRunner().invoke(cli, ["bench", "--tokens", text])
    assert result.exit_code == ExitCode.USAGE
    one_line(result, message)


def test_hidden_sizes_must_suit_the_kernel():
    result = CliRunner().invoke(cli, ["bench", "--hidden", "4100"])
    assert result.exit_code == ExitCode.USAGE
    one_line(result, "4100 must be between 128 and 16384 and a multiple of 8")


def test_help_has_examples_and_exit_codes():
    result = CliRunner().invoke(cli, ["bench", "--help"])
    assert result.exit_code == 0
    for text in ("Examples:", "sm120patch bench --python", "Exit codes:", "3   refused", "--strategy"):
        assert text in result.output


# -- refusals, decided from what the target reports -----------------------------------------

@pytest.mark.parametrize("info, error, message", [
    (target(torch=None, torch_error="ModuleNotFoundError: No module named 'torch'"), TargetError, "torch is not importable"),
    (target(flashinfer=None), TargetError, "flashinfer-python is not installed"),
    (target(cuda=False, devices=()), TargetError, "no CUDA device is visible to torch"),
    (target(nccl=False), TargetError, "has no NCCL backend"),
    (target(devices=()), UsageError, "bench needs at least 2 GPUs; /srv/env/bin/python sees none"),
    (target(devices=(H200,)), UsageError, "sees 1 (NVIDIA H200)"),
])
def test_what_the_target_lacks(info, error, message):
    with pytest.raises(error) as raised:
        bench.preflight(request(), info, flashinfer_verdict="patched")
    assert message in raised.value.message


def test_every_missing_piece_is_named_in_one_message():
    with pytest.raises(TargetError) as raised:
        bench.preflight(request(), target(torch=None, torch_error="ModuleNotFoundError: No module named 'torch'",
                                          flashinfer=None, numpy=False), flashinfer_verdict=None)
    message = raised.value.message
    assert message.count(";") == 2 and "torch is not importable" in message
    assert "flashinfer-python is not installed" in message and "numpy is not importable" in message


def test_an_impossible_tp_is_refused_as_it_is_parsed():
    """Before the target is asked anything (no interpreter is probed for a --python that does not exist)."""
    result = run_cli("bench", "--tp", "3", "--python", "/nonexistent/python")
    assert result.exit_code == 2
    assert "Invalid value for '--tp': 3: FlashInfer's fused allreduce runs at 2, 4, 8 or 16 ranks" in result.output


def test_a_world_size_the_kernel_refuses_names_the_sizes_and_a_working_one():
    with pytest.raises(UsageError) as raised:
        bench.preflight(request(), target(devices=(H200,) * 3), flashinfer_verdict="patched")
    assert raised.value.message == "--tp 3: FlashInfer's fused allreduce runs at 2, 4, 8 or 16 ranks (3 GPUs are visible)"
    assert raised.value.hint == "pass --tp 2"
    with pytest.raises(UsageError, match="sees only 2 GPUs"):
        bench.preflight(request(tp=4), target(), flashinfer_verdict="patched")
    assert bench.preflight(request(tp=2), target(devices=(H200,) * 3), flashinfer_verdict="patched") == 2


def test_ranks_on_one_gpu_only_for_the_tuner_and_only_when_a_test_asks(monkeypatch):
    """SM120PATCH_TUNE_ONE_GPU=1 (test-only: the lent single-GPU machine) lets --tune put --tp ranks on
    the one visible GPU; without it, or for a plain bench, one GPU is refused as before. The
    workers are told (config "one_gpu"); a run with it can still write no profile (the tuner's
    refusal of shared GPUs, tests/test_tuning.py)."""
    one = target(devices=(H200,))
    with pytest.raises(UsageError, match="bench needs at least 2 GPUs"):
        bench.preflight(request(tp=2, tune=True), one, flashinfer_verdict="patched")
    monkeypatch.setenv("SM120PATCH_TUNE_ONE_GPU", "1")
    assert bench.preflight(request(tp=4, tune=True), one, flashinfer_verdict="patched") == 4
    with pytest.raises(UsageError, match="bench needs at least 2 GPUs"):
        bench.preflight(request(tp=2), one, flashinfer_verdict="patched")
    with pytest.raises(UsageError, match="bench needs at least 2 GPUs; /srv/env/bin/python sees none"):
        bench.preflight(request(tp=2, tune=True), target(devices=()), flashinfer_verdict="patched")
    assert bench.runner.ranks_on_one_gpu(request(tune=True)) and not bench.runner.ranks_on_one_gpu(request())


def test_unpatched_flashinfer_on_sm120_is_refused_with_the_apply_command():
    with pytest.raises(RefusedError) as raised:
        bench.preflight(request(), target(devices=(RTX_PRO_6000,) * 2), flashinfer_verdict="not patched")
    assert "flashinfer-python 0.6.4 is not patched" in raised.value.message
    assert raised.value.hint == "run `sm120patch apply --python /srv/env/bin/python` first"
    assert raised.value.exit_code == ExitCode.REFUSED
    with pytest.raises(RefusedError, match="shadows the patched sources"):
        bench.preflight(request(), target(devices=(RTX_PRO_6000,) * 2), flashinfer_verdict="patched",
                        aot_shadows=["/srv/env/flashinfer_jit_cache/jit_cache/trtllm_comm/trtllm_comm.so"])
    # Patched, or SM90 (upstream supports it as released): it runs.
    assert bench.preflight(request(), target(devices=(RTX_PRO_6000,) * 2), flashinfer_verdict="patched") == 2
    assert bench.preflight(request(), target(), flashinfer_verdict="not patched") == 2


def test_a_target_without_torch(read_only_cli):
    result = read_only_cli("bench")
    assert result.exit_code == ExitCode.USAGE
    one_line(result, "python: torch is not importable (ModuleNotFoundError")
    assert "; numpy is not importable" in result.output  # the environment lacks both: one message names both


def test_a_cpu_only_torch(runtime_env):
    result = Session(runtime_env)("bench", "--tp", "2")
    assert result.exit_code == ExitCode.USAGE
    one_line(result, "no CUDA device is visible to torch 2.13.0+cpu")
    assert "(a CPU-only build)" in result.output


# -- the worker's failures and hangs --------------------------------------------------------

@pytest.mark.parametrize("error, kind, exit_code", [
    ({"phase": "build", "message": "RuntimeError: No supported CUDA architectures found for major versions [9, 10]."},
     RefusedError, ExitCode.REFUSED),
    ({"phase": "fused", "message": "RuntimeError: unsupported ranks number! Supported ranks: 2, 4, 8, 16",
      "case": {"tokens": 1, "hidden": 4096, "strategy": "auto"}}, UsageError, ExitCode.USAGE),
    ({"phase": "fused", "message": "AcceleratorError: CUDA error: an illegal memory access was encountered",
      "case": {"tokens": 8, "hidden": 4096, "strategy": "oneshot"}}, CheckFailedError, 1),
])
def test_worker_errors_become_one_documented_error(error, kind, exit_code):
    raised = bench._classify(error, Path("/srv/env/bin/python"), 2)
    assert isinstance(raised, kind) and raised.exit_code == exit_code
    if "case" in error:
        assert "(tokens" in raised.message or "world size 2" in raised.message


def _emitter(script: str):
    """A real process writing progress events to a pipe the way rank 0 does."""
    import os

    read_fd, write_fd = os.pipe()
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), str(write_fd)], pass_fds=(write_fd,))
    os.close(write_fd)
    return proc, read_fd


def test_a_shape_that_makes_no_progress_is_a_hang_and_every_worker_is_killed():
    proc, read_fd = _emitter("""
        import json, os, sys, time
        out = os.fdopen(int(sys.argv[1]), "w", buffering=1)
        out.write(json.dumps({"event": "case", "index": 0, "tokens": 8, "hidden": 4096, "strategy": "oneshot"}) + "\\n")
        time.sleep(60)
    """)
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    seen = []
    with pytest.raises(CheckFailedError) as raised:
        bench.follow([proc, peer], read_fd, seen.append, build_timeout=30, case_timeout=1)
    assert "no progress for 1 s at tokens 8, hidden 4096, oneshot" in raised.value.message
    assert proc.wait(timeout=5) is not None and peer.wait(timeout=5) is not None
    assert seen and seen[0]["tokens"] == 8


def test_a_pair_of_ranks_that_hangs_is_named_with_what_to_change():
    """bench --tune's first stage: a pair whose small fused call never completes (P2P that hangs)
    is stopped after the pair's time limit, named by its ranks and GPUs, with the settings to
    look at; the workers are killed, never a hung tuner."""
    proc, read_fd = _emitter("""
        import json, os, sys, time
        out = os.fdopen(int(sys.argv[1]), "w", buffering=1)
        for pair in ([0, 1], [0, 2]):
            out.write(json.dumps({"event": "pair", "pair": pair, "gpus": ["0000:01:00.0", "0000:%02x:00.0" % (pair[1] * 64)]}) + "\\n")
        time.sleep(60)
    """)
    with pytest.raises(CheckFailedError) as raised:
        bench.follow([proc], read_fd, None, build_timeout=30, case_timeout=30, pair_timeout=1)
    assert raised.value.message == ("ranks 0 and 2 (GPUs 0000:01:00.0 and 0000:80:00.0) did not complete one small "
                                    "fused call in 1 s: it hangs (every worker was stopped)")
    for advice in ("nvidia-smi topo -p2p r", "PCIe ACS", "iommu=pt", "virtual machine", "NCCL_P2P_DISABLE=1"):
        assert advice in raised.value.hint
    assert proc.wait(timeout=5) is not None


def test_a_pair_of_ranks_that_fails_is_named():
    error = bench._classify({"phase": "pair", "message": "RuntimeError: CUDA error: peer access is not supported",
                             "case": {"pair": [1, 3], "gpus": ["0000:02:00.0", "0000:42:00.0"]}},
                            Path("/srv/env/bin/python"), 4)
    assert isinstance(error, CheckFailedError) and error.message == (
        "ranks 1 and 3 (GPUs 0000:02:00.0 and 0000:42:00.0) could not complete a fused call together: "
        "RuntimeError: CUDA error: peer access is not supported")
    assert "iommu=pt" in error.hint


def test_progress_is_relayed_until_the_workers_exit():
    proc, read_fd = _emitter("""
        import json, os, sys
        out = os.fdopen(int(sys.argv[1]), "w", buffering=1)
        for event in ({"event": "cases", "total": 2}, {"event": "case", "index": 0, "tokens": 1, "hidden": 128,
                      "strategy": "auto"}, {"event": "case", "index": 2}):
            out.write(json.dumps(event) + "\\n")
    """)
    seen = []
    bench.follow([proc], read_fd, seen.append, build_timeout=30, case_timeout=30)
    assert [e["event"] for e in seen] == ["cases", "case", "case"] and proc.returncode == 0


# -- recommendation rules ------------------------------------------------------------------

def _report(timings: dict[int, tuple[float, float]], hidden: int = 4096) -> bench.BenchReport:
    cases = [bench.Case(tokens=t, hidden=hidden, strategy="auto", effective_strategy="oneshot", bytes=t * hidden * 2,
                        ok=True, max_err_norm=0.01, max_err_residual=0.01, worst_ratio=0.2, ranks_agree=True,
                        digests={}, fused_us=f, unfused_us=u, graphs=True) for t, (f, u) in timings.items()]
    return bench.BenchReport(request(tokens=tuple(timings)), 2, {}, cases, 2 ** -5, 2 ** -5)


def test_fused_faster_everywhere_turns_it_on_with_the_largest_size_for_vllm():
    rec = _report({1: (5, 10), 512: (20, 40), 2048: (90, 92)}).recommendation()
    assert rec.sglang is True
    assert rec.vllm_max_size_mb == 16  # 2048 tokens x 4096 x 2 bytes
    assert "fi_allreduce_fusion_max_size_mb=16" in rec.vllm_text


def test_a_crossover_limits_both_recommendations():
    report = _report({1: (5, 10), 64: (8, 12), 512: (50, 40), 2048: (200, 100)})
    rec = report.recommendation()
    assert rec.sglang is None and rec.sglang_text.startswith("fused wins up to 64 tokens")
    # What makes SGLang keep to it, as it can be copied (no SGLang setting does).
    assert "bench --tune --hidden 4096 --python /srv/env/bin/python`" in rec.sglang_text
    assert "`sm120patch apply --with tuned-limits --python /srv/env/bin/python`" in rec.sglang_text
    assert rec.vllm_max_size_mb == 0.5
    assert "slower from 512 tokens (4 MiB)" in render_bench(report)


def test_slower_from_the_start_says_leave_it_off():
    rec = _report({1: (12, 10), 64: (8, 12)}).recommendation()
    assert rec.sglang is False and rec.vllm_max_size_mb is None
    assert "leave --enable-flashinfer-allreduce-fusion off" in rec.sglang_text


def test_the_recommendation_names_the_installed_servers_flag_and_bench_prints_its_advice():
    report = _report({1: (12, 10), 64: (8, 12)})
    report.sglang_flag = "--flashinfer-allreduce-fusion-backend trtllm"  # what bench() sets for SGLang 0.5.14+
    assert report.recommendation().sglang_text.startswith("leave --flashinfer-allreduce-fusion-backend trtllm off")
    report.advice = [("sglang", "info", "pass --attention-backend flashinfer")]
    lines = render_bench(report).splitlines()
    assert lines[-2:] == ["When you run the server:", "  note: pass --attention-backend flashinfer"]
    assert bench_json(report)["advice"] == [{"distribution": "sglang", "level": "info",
                                                "text": "pass --attention-backend flashinfer"}]


def test_a_failed_check_gives_no_recommendation_and_exit_1():
    report = _report({1: (5, 10)})
    report.cases[0].ok, report.cases[0].worst_ratio = False, 3.5
    assert report.recommendation() is None
    error = bench.failure(report)
    assert error.exit_code == 1 and "tokens 1, hidden 4096" in error.message and "3.5×" in error.message
    assert "FAIL" in render_bench(report)


# -- the worker's arithmetic, in a real torch -----------------------------------------------

def test_worker_reference_tolerance_and_inputs_on_cpu_torch(runtime_env):
    worker = Path(bench.__file__).with_name("_bench_worker.py")
    script = f"""
        import importlib.util, json, torch
        spec = importlib.util.spec_from_file_location("worker", {str(worker)!r})
        w = importlib.util.module_from_spec(spec); spec.loader.exec_module(w)
        cpu = torch.device("cpu")
        a = w.make_inputs(7, 256, torch.bfloat16, cpu, 0, 0)
        b = w.make_inputs(7, 256, torch.bfloat16, cpu, 0, 0)
        other_rank = w.make_inputs(7, 256, torch.bfloat16, cpu, 0, 1)
        ref = torch.linspace(-4, 4, 64)
        exact = w.tolerance_ok(ref.to(torch.bfloat16), ref, 2 ** -5, 2 ** -5)
        off = w.tolerance_ok((ref + 0.5).to(torch.bfloat16), ref, 2 ** -5, 2 ** -5)
        nan = w.tolerance_ok(torch.full((4,), float("nan")), torch.zeros(4), 2 ** -5, 2 ** -5)
        print(json.dumps({{
            "deterministic": all(torch.equal(x, y) for x, y in zip(a, b)),
            "x_differs_per_rank": not torch.equal(a[0], other_rank[0]),
            "residual_and_gamma_shared": torch.equal(a[1], other_rank[1]) and torch.equal(a[2], other_rank[2]),
            "exact": exact, "off": off, "nan": nan[1],
            "digest_same": w.digest(a[0]) == w.digest(b[0]), "digest_differs": w.digest(a[0]) != w.digest(other_rank[0]),
        }}))
    """
    proc = subprocess.run([str(runtime_env.python), "-c", textwrap.dedent(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["deterministic"] and out["x_differs_per_rank"] and out["residual_and_gamma_shared"]
    assert out["exact"][1] <= 1.0  # rounding a float32 value to bf16 is within the tolerance
    assert out["off"][1] > 1.0 and out["off"][0] == pytest.approx(0.5, abs=0.02)
    assert out["nan"] == float("inf")
    assert out["digest_same"] and out["digest_differs"]


def test_a_pcie_ipc_path_that_cannot_be_made_here_is_said_and_left_untimed(runtime_env, tmp_path):
    """The worker's make_pcie_ipc in the target interpreter (CPU torch, FlashInfer 0.6.4, SGLang
    0.5.9; one gloo rank), with the rows the parent passes for SGLang 0.5.21 and vLLM 0.31: neither
    server's module imports there, so each falls back to FlashInfer's PcieIpcAllReduceWorkspace,
    which this FlashInfer cannot give: each says how it was tried and why it is not timed, leaves
    nothing to call or destroy, and the ranks' gather of the outcome ran."""
    from test_tuning import SGLANG_PATH, installed

    paths = bench.pcie_ipc_paths(installed(("sglang", "0.5.21"), ("vllm", "0.31.0"), flashinfer="0.7.0"))
    assert paths[0] == SGLANG_PATH
    worker = Path(bench.__file__).with_name("_bench_worker.py")
    script = f"""
        import importlib.util, json, tempfile, torch, torch.distributed as dist
        spec = importlib.util.spec_from_file_location("worker", {str(worker)!r})
        w = importlib.util.module_from_spec(spec); spec.loader.exec_module(w)
        dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
        out = []
        for path in json.loads({json.dumps(json.dumps(paths))}):
            made = w.make_pcie_ipc(path, 1, dist.group.WORLD, dist.group.WORLD, torch.device("cpu"), 256,
                                   torch.bfloat16, [1, 2, 4], {str(tmp_path)!r})
            out.append([made["info"], made["allreduce"] is None and made["destroy"] is None])
        try:
            from flashinfer.comm import PcieIpcAllReduceWorkspace
            why = None
        except Exception as exc:
            why = w.last_line(exc)
        print(json.dumps([out, why]))
        dist.destroy_process_group()  # not left to interpreter teardown, where gloo's threads can abort it
    """
    proc = subprocess.run([str(runtime_env.python), "-c", textwrap.dedent(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    [(sglang, sglang_none), (vllm, vllm_none)], why = json.loads(proc.stdout)
    assert sglang_none and vllm_none
    for info, path in ((sglang, paths[0]), (vllm, paths[1])):
        assert {k: info[k] for k in ("name", "column", "server", "switch", "rows")} == {
            k: path[k] for k in ("name", "column", "server", "switch", "rows")}
        module = path["code"].split(":")[0]
        assert info["how"].startswith("FlashInfer's PcieIpcAllReduceWorkspace with the arguments the server passes "
                                      f"({module} does not import here: ")
        assert why and info["error"] == why  # FlashInfer 0.6.4 (on CPU) gives no PcieIpcAllReduceWorkspace
    assert list(tmp_path.iterdir()) == []  # no tune cache was written


def test_tuner_statistics_and_profile_facts_in_the_target(runtime_env):
    """In the target interpreter (CPU torch, the real FlashInfer and SGLang wheels): the worker's
    median and quartiles, the slowest rank per repetition, and the box, NCCL settings and releases
    computed by _tuned_runtime.py's text: the same box and settings sm120patch computes here."""
    import os

    from sm120patch import _tuned_runtime as runtime

    worker = Path(bench.__file__).with_name("_bench_worker.py")
    script = f"""
        import importlib.util, json, sys
        spec = importlib.util.spec_from_file_location("worker", {str(worker)!r})
        w = importlib.util.module_from_spec(spec); spec.loader.exec_module(w)
        text = open({str(Path(runtime.__file__))!r}).read()
        print(json.dumps({{
            "summary": w.summary([9.0, 1.0, 5.0, 3.0, 7.0]),
            "slowest": w.slowest_per_repetition([[1.0, 5.0, 2.0], [3.0, 4.0, 2.5]]),
            "facts": w.profile_facts(text, ["flashinfer-python", "sglang", "vllm", "torch"]),
        }}))
    """
    env = dict(os.environ, NCCL_P2P_LEVEL="PHB", NCCL_CUMEM_ENABLE="0")
    proc = subprocess.run([str(runtime_env.python), "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["summary"] == [5.0, 3.0, 7.0] and out["slowest"] == [3.0, 5.0, 2.5]
    facts = out["facts"]
    assert facts["box"] == runtime._sm120patch_box()
    assert facts["nccl_env"] == {"NCCL_P2P_LEVEL": "PHB"}  # the servers set NCCL_CUMEM_ENABLE themselves
    assert facts["software"] == {"flashinfer-python": "0.6.4", "sglang": "0.5.9", "torch": "2.13.0+cpu"}  # no vllm


def test_the_workers_measure_the_sizes_the_tuner_asks_for_in_the_same_run(runtime_env, tmp_path):
    """Issue #60 item 7, the refinement as a step of the run: two real worker processes in the
    target interpreter (CPU torch, gloo) run the worker's own tune_rows, each size's measurement
    given by a table-driven tune_row (a box whose crossovers lie between the sizes asked for);
    rank 0 sends its rows to the parent, bench.follow answers with the tuner's next size
    (limits.next_probe), every rank measures it, until the answer is none. Both ranks measured
    the same sizes, the probes are marked, and the limits land within 10 % of the crossovers."""
    import os
    import socket

    from sm120patch.bench.limits import Row, derive, next_probe

    worker = Path(bench.__file__).with_name("_bench_worker.py")
    script = f"""
        import importlib.util, json, os, torch.distributed as dist
        spec = importlib.util.spec_from_file_location("worker", {str(worker)!r})
        w = importlib.util.module_from_spec(spec); spec.loader.exec_module(w)
        rank = int(os.environ["RANK"])
        dist.init_process_group("gloo")
        if rank == 0:
            w._progress = os.fdopen(int(os.environ["SM120PATCH_BENCH_FD"]), "w", buffering=1)

        def tune_row(config, index, tokens, *rest):  # one-shot and two-shot cross at 13, two-shot and NCCL at 45
            w.emit(event="case", index=index, tokens=tokens, hidden=4096, strategy="every path")
            row = {{"tokens": tokens, "bytes": tokens * 8192, "repeats": 7}}
            for column, median in (("oneshot", 5.0 + 0.75 * tokens), ("twoshot", 8.25 + 0.5 * tokens),
                                   ("unfused", 17.25 + 0.3 * tokens)):
                if column != "twoshot" or tokens > 2:
                    row[column + "_us"], row[column + "_iqr_us"] = median, [median * 0.995, median * 1.005]
            return row

        w.tune_row = tune_row
        config = {{"tokens": [1, 2, 4, 8, 16, 32, 64, 128], "hidden": [4096], "tune": {{"refine": True}}}}
        rows = w.tune_rows(config, rank, 2, None, None, None, dist.group.WORLD)
        with open(os.path.join({str(tmp_path)!r}, "rows-%d.json" % rank), "w") as handle:
            json.dump(rows, handle)
        # as the worker ends: left to interpreter teardown, gloo's threads could outlive rank 0's
        # store and abort rank 1 at exit (SIGABRT, "terminate called without an active exception")
        dist.barrier()
        dist.destroy_process_group()
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    read_fd, write_fd = os.pipe()
    ask_read, ask_write = os.pipe()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if rank == 0:
            env.update(SM120PATCH_BENCH_FD=str(write_fd), SM120PATCH_BENCH_ASK_FD=str(ask_read))
        procs.append(subprocess.Popen([str(runtime_env.python), "-c", textwrap.dedent(script)], env=env,
                                      pass_fds=(write_fd, ask_read) if rank == 0 else ()))
    os.close(write_fd)
    os.close(ask_read)
    asked, seen = [], []

    def ask(rows):
        asked.append(next_probe(derive([Row.from_table(r) for r in rows], world=2, hidden=4096)))
        return asked[-1]

    try:
        bench.follow(procs, read_fd, seen.append, build_timeout=120, case_timeout=120, ask=ask, answer_fd=ask_write)
    finally:
        os.close(read_fd)
        os.close(ask_write)
    assert [p.returncode for p in procs] == [0, 0]
    ranks = [json.loads((tmp_path / f"rows-{rank}.json").read_text()) for rank in range(2)]
    assert ranks[0] == ranks[1]
    probes = [r["tokens"] for r in ranks[0] if r.get("probe")]
    assert asked[-1] is None and probes == asked[:-1] and 0 < len(probes) <= 8
    assert not any(e.get("event") == "refine" for e in seen)  # the rows are answered, not shown as progress
    limits = derive([Row.from_table(r) for r in ranks[0]], world=2, hidden=4096)
    a, b = limits.oneshot_max_bytes // 8192, limits.fused_max_bytes // 8192
    assert 13 / 1.1 <= a <= 13 and 45 / 1.1 <= b <= 45


def test_status_holds_a_profile_to_the_targets_torch_as_the_server_does(runtime_env, tmp_path, monkeypatch):
    """Issue #60 item 8: the target's torch (2.13.0+cpu here, read by the probe from its metadata,
    as the server's importlib.metadata reads it) against the profile's. Tuned with another torch:
    the server would not take it, and status does not say a profile holds. Tuned with this torch:
    it holds, and no torch is left unchecked."""
    from sm120patch import _tuned_runtime as runtime

    path = tmp_path / "tuned-limits.json"
    monkeypatch.setenv("SM120PATCH_TUNED_LIMITS", str(path))

    def tp_step(torch: str) -> str:
        entry = {"created": "2026-12-05T01:30:00Z", "nccl_env": runtime._sm120patch_nccl_env(), "dtype": "bf16",
                 "hidden": 4096, "fused_max_bytes": 64 * 8192, "oneshot_max_bytes": 16 * 8192,
                 "software": {"flashinfer-python": "0.6.4", "sglang": "0.5.9", "torch": torch}}
        path.write_text(json.dumps({"kind": "sm120patch tuned limits", "format": 1, "box": runtime._sm120patch_box(),
                                    "entries": {"4": entry}}))
        result = Session(runtime_env)("status", "--json")
        return next(s["text"] for t in json.loads(result.stdout)["distributions"] if t.get("fusion")
                    for s in t["fusion"]["steps"] if s["id"] == "tp")

    other = tp_step("2.11.0+cu130")
    assert other.startswith("untuned: SGLang fuses every batch") and "a profile holds" not in other
    same = tp_step("2.13.0+cpu")
    assert same.startswith("untuned: a profile holds for this box (TP4: fused up to 512 KiB per rank")


def test_the_worker_is_python_3_8():
    """It runs in the server's interpreter, whose floor is 3.8."""
    import ast

    ast.parse(bench.WORKER.read_text(), feature_version=(3, 8))


def test_a_server_that_would_fall_back_without_multicast_is_refused_with_the_reason_and_the_command():
    """SGLang 0.5.11 with FlashInfer 0.6.8.post1 as released: on GPUs without multicast (or not
    read) bench refuses before any GPU work, naming the server's own fall-back and the command
    that applies the missing patches; on GPUs that report multicast it goes on (the workers then
    create the workspace as the server does)."""
    from types import SimpleNamespace

    from packaging.version import Version

    from sm120patch import chain, driver
    from sm120patch.distributions import load_registry
    from sm120patch.fusionpath import judge

    flashinfer = SimpleNamespace(raw_version="0.6.8.post1", version=Version("0.6.8.post1"))
    server = judge(load_registry().get("sglang"), "0.5.11", Version("0.5.11"), flashinfer,
                   {"sglang": frozenset({"fusion-gate"}), "flashinfer-python": frozenset({"jit-gate", "pdl-gates",
                                                                                           "lamport-stride"})})
    assert server.missing == ("sglang:preflight-unicast", "flashinfer-python:unicast-workspace")
    commands = chain.Commands(*(f"sm120patch {w} --python /srv/env/bin/python"
                                for w in ("apply", "build", "doctor", "bench", "status", "diff")))

    def judged(verdict, multicast):
        """The chain as bench gets it: its workspace step judged for GPUs that report ``multicast``."""
        device = None if multicast is None else driver.DriverFacts(devices=tuple(
            driver.Device(i, "NVIDIA RTX PRO 6000 Blackwell", (12, 0), multicast, True, False) for i in range(2)))
        return chain.Chain("sglang 0.5.11", (chain.workspace_step(verdict, device, commands),), verdict)

    for multicast in (False, None):
        with pytest.raises(RefusedError) as raised:
            bench.preflight(request(), target(devices=(RTX_PRO_6000,) * 2), flashinfer_verdict="patched",
                            servers=[judged(server, multicast)])
        assert raised.value.message.startswith("sglang 0.5.11 would not fuse on these GPUs: on a GPU without multicast")
        assert "preflight probe failed" in raised.value.message
        assert raised.value.hint == "run `sm120patch apply --python /srv/env/bin/python` first"
    assert bench.preflight(request(), target(devices=(RTX_PRO_6000,) * 2), flashinfer_verdict="patched",
                           servers=[judged(server, True)]) == 2
    fused = server._replace(missing=())
    assert bench.preflight(request(), target(devices=(RTX_PRO_6000,) * 2), flashinfer_verdict="patched",
                           servers=[judged(fused, False)]) == 2


def test_the_report_names_the_server_path_the_workers_followed():
    report = _report({1: (5, 10)})
    report.meta["server_paths"] = [
        {"server": "sglang 0.5.14 with flashinfer-python 0.6.12", "workspace": "unified", "preflight": "passed"},
        {"server": "sglang 0.5.9 with flashinfer-python 0.6.4", "workspace": "legacy", "preflight": None},
    ]
    lines = render_bench(report).splitlines()
    assert ("server path: sglang 0.5.14 with flashinfer-python 0.6.12: FlashInfer's unified workspace created as the "
            "server creates it; its own preflight: passed") in lines
    assert ("server path: sglang 0.5.9 with flashinfer-python 0.6.4: the legacy call "
            "(trtllm_create_ipc_workspace_for_all_reduce_fusion), the one bench itself makes") in lines
    assert bench_json(report)["server_paths"] == report.meta["server_paths"]
