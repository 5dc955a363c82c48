"""doctor: parsers on nvidia-smi output captured on the H200 and on SM120 samples written from
the documented format (tests/data/nvidia-smi/README.md says which is which), and the whole
command with and without nvidia-smi."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from sm120patch.doctor import parse_cuda_version, parse_gpu_query, parse_nvcc_version, parse_topology

DATA = Path(__file__).parent / "data" / "nvidia-smi"


def read(name: str) -> str:
    return (DATA / name).read_text()


def test_h200_gpu_query():
    (gpu,) = parse_gpu_query(read("h200-query.csv"))
    assert (gpu.name, gpu.compute_cap, gpu.major, gpu.driver) == ("NVIDIA H200", "9.0", 9, "580.159.04")
    assert gpu.memory == "143771 MiB" and gpu.bus_id == "00000000:00:06.0"


def test_sm120_gpu_query():
    gpus = parse_gpu_query(read("sm120x4-query.csv"))
    assert [g.major for g in gpus] == [12, 12, 12, 12]
    assert gpus[3].bus_id == "00000000:61:00.0"


def test_h200_topology_with_ansi_header_is_one_gpu():
    topo = parse_topology(read("h200-topo.txt"))
    assert topo.gpus == ["GPU0"] and topo.links == {} and not topo.pcie_only


def test_sm120_pcie_topology():
    topo = parse_topology(read("sm120x4-topo.txt"))
    assert topo.gpus == ["GPU0", "GPU1", "GPU2", "GPU3"]
    assert topo.links[("GPU0", "GPU1")] == "NODE" and topo.links[("GPU1", "GPU3")] == "SYS"
    assert topo.pcie_only


def test_nvlink_topology():
    topo = parse_topology(read("nvlink-x2-topo.txt"))
    assert not topo.pcie_only and topo.nvlink_pairs == [("GPU0", "GPU1"), ("GPU1", "GPU0")]


def test_driver_cuda_version_and_nvcc_release():
    assert parse_cuda_version(read("h200-nvidia-smi.txt")) == "13.0"
    assert parse_nvcc_version("Cuda compilation tools, release 12.8, V12.8.93") == "12.8"


def test_garbage_is_a_value_error():
    with pytest.raises(ValueError):
        parse_gpu_query("hello\n")
    with pytest.raises(ValueError):
        parse_topology("no matrix here\n")


def fake_tool(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def fake_nvidia_smi(tmp_path, monkeypatch):
    """An nvidia-smi on PATH that prints the given captured outputs (the tool is outside what
    we patch; its output format is what doctor must read)."""

    def install(query: str, topo: str, plain: str = "h200-nvidia-smi.txt") -> None:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir(exist_ok=True)
        fake_tool(bin_dir, "nvidia-smi", f"""
case "$1" in
  --query-gpu=*) cat '{DATA / query}' ;;
  topo) cat '{DATA / topo}' ;;
  *) cat '{DATA / plain}' ;;
esac
""")
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    return install


def test_doctor_on_the_h200_outputs(read_only_cli, fake_nvidia_smi):
    fake_nvidia_smi("h200-query.csv", "h200-topo.txt")
    result = read_only_cli("doctor")
    assert result.exit_code == 0, result.output
    assert "GPU0: NVIDIA H200, compute capability 9.0" in result.output
    assert "SM90/SM100: upstream FlashInfer supports it without patches" in result.output
    assert "driver 580.159.04, CUDA 13.0" in result.output
    assert "one GPU: fused allreduce needs 2, 4, 8 or 16 ranks" in result.output
    assert "flashinfer-python 0.6.4: not patched" in result.output


def test_doctor_on_a_pcie_sm120_box_warns_to_benchmark(read_only_cli, fake_nvidia_smi):
    fake_nvidia_smi("sm120x4-query.csv", "sm120x4-topo.txt")
    result = read_only_cli("doctor")
    assert result.exit_code == 0, result.output
    assert result.output.count(", compute capability 12.0,") == 4  # one line per GPU
    assert "WARN  GPUs talk over PCIe only (no NVLink)" in result.output
    assert "benchmark" in result.output


def test_doctor_without_nvidia_smi_still_reports_the_rest(sm120patch, monkeypatch, tmp_path):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    result = sm120patch("doctor")
    assert result.exit_code == 0, result.output
    assert "nvidia-smi not found" in result.output
    assert "nvcc not found on PATH" in result.output
    assert "sglang 0.5.9 uses fusion on SM120 only with --enable-flashinfer-allreduce-fusion" in result.output
    assert "sglang 0.5.9 pins flashinfer-python==0.6.3; 0.6.4 is installed" in result.output


def test_doctor_json_is_one_document(read_only_cli, fake_nvidia_smi):
    import json

    fake_nvidia_smi("sm120x4-query.csv", "sm120x4-topo.txt")
    result = read_only_cli("doctor", "--json")
    assert result.exit_code == 0
    document = json.loads(result.output)
    text = json.dumps(document)
    assert "12.0" in text and "PCIe" in text and "flashinfer-python" in text


def test_doctor_judges_the_chain_by_nvidia_smi_when_the_driver_answers_nothing(read_only_cli, fake_nvidia_smi):
    """An H200 (compute capability 9.0, the captured output) on a machine whose CUDA driver
    library sm120patch cannot use (none here): upstream fuses there without a patch, so each
    chain speaks of those GPUs, not of SM120, and asks for no `apply`."""
    fake_nvidia_smi("h200-query.csv", "h200-topo.txt")
    result = read_only_cli("doctor")
    assert result.exit_code == 0, result.output
    assert "fuse on SM120" not in result.output and "sm120patch apply" not in result.output, result.output
    assert "sglang 0.5.9 will" in result.output and "on these GPUs (SM90)" in result.output
    assert "kernel-gates blocks" not in result.output and "server-gates blocks" not in result.output
    assert ("device unknown: 1 GPU, compute capability 9.0 (nvidia-smi; the driver answered nothing"
            in result.output), result.output
    findings = json.loads(read_only_cli("doctor", "--json").output)["findings"]
    assert any("on these GPUs (SM90)" in f["text"] for f in findings)
