"""The compile check of DESIGN.md §5 on the real installed headers: patched sm_120a PTX gains
the PDL instructions and the kernel body; sm_90a and sm_100a PTX do not change at all."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from sm120patch.ptx import compile_ptx, find_nvcc, griddepcontrol_count

pytestmark = [
    pytest.mark.nvcc,
    pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found (CUDA_HOME, PATH, /usr/local/cuda)"),
]

ARCHS = ("120a", "90a", "100a")


def compile_all(data_dir):
    with ThreadPoolExecutor(max_workers=len(ARCHS)) as pool:
        includes = [data_dir / "include", data_dir / "spdlog" / "include", data_dir / "cutlass" / "include"]
        return dict(zip(ARCHS, pool.map(lambda arch: compile_ptx(includes, arch), ARCHS)))


def test_patched_header_compiles_the_lamport_kernel_for_sm120_and_nothing_else_changes(sm120patch, serving_env):
    data_dir = serving_env.file("flashinfer/data")
    pristine = compile_all(data_dir)
    assert griddepcontrol_count(pristine["120a"]) == 0  # empty kernel body on SM120
    assert griddepcontrol_count(pristine["90a"]) > 0

    assert sm120patch("apply", "--flashinfer", "0.6.4").exit_code == 0
    patched = compile_all(data_dir)
    assert griddepcontrol_count(patched["120a"]) == griddepcontrol_count(pristine["90a"])
    assert len(patched["120a"]) > 10 * len(pristine["120a"])
    assert patched["90a"] == pristine["90a"]
    assert patched["100a"] == pristine["100a"]
