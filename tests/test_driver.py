"""sm120patch's own device queries (driver.py, doctor): against a stand-in libcuda built here
with the system C compiler (tests/data/standin_libcuda.c), which answers as a PCIe SM120 box
does and aborts the process if anything calls a cuMulticast* function."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import need
from sm120patch import driver

SOURCE = Path(__file__).parent / "data" / "standin_libcuda.c"


def build(tmp_path: Path, *, devices=4, multicast=0, peer=1) -> Path:
    need(shutil.which("cc") is not None, "needs a C compiler to build the stand-in libcuda")
    out = tmp_path / f"lib-{devices}-{multicast}-{peer}"
    out.mkdir()
    library = out / "libcuda.so.1"
    subprocess.run(["cc", "-shared", "-fPIC", f"-DNDEV={devices}", "-DCC_MAJOR=12", "-DCC_MINOR=0",
                    f"-DMULTICAST={multicast}", f"-DPEER={peer}", "-Wl,-soname,libcuda.so.1", "-o", str(library),
                    str(SOURCE)], check=True)
    return library


def doctor(library: Path) -> subprocess.CompletedProcess:
    """In a fresh process (a libcuda.so.1 once loaded stays loaded), the driver found as the server finds it."""
    env = dict(os.environ, LD_LIBRARY_PATH=str(library.parent))
    return subprocess.run([sys.executable, "-m", "sm120patch", "doctor", "--python", sys.executable],
                          capture_output=True, text=True, env=env)


def test_no_driver_is_a_fact_not_an_error(tmp_path):
    facts = driver.query(str(tmp_path / "libcuda.so.1"))
    assert facts.devices == () and "not found" in facts.error and facts.multicast is None


def test_a_pcie_sm120_box_reads_as_four_gpus_without_multicast_with_peer_access(tmp_path):
    library = build(tmp_path)
    result = doctor(library)
    assert result.returncode == 0, result.stderr  # the stand-in aborts on any cuMulticast* call
    assert "GPUs without multicast (CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED = 0)" in result.stdout
    assert "peer-to-peer access between every pair of the 4 GPUs" in result.stdout


def test_missing_peer_access_is_a_warning_naming_the_pairs(tmp_path):
    result = doctor(build(tmp_path, devices=2, peer=0))
    assert result.returncode == 0, result.stderr
    assert "WARN  no peer-to-peer access GPU0->GPU1, GPU1->GPU0" in result.stdout


def test_an_nvswitch_box_reports_multicast(tmp_path):
    result = doctor(build(tmp_path, devices=8, multicast=1))
    assert "every GPU reports multicast" in result.stdout and "without multicast (CU_" not in result.stdout
