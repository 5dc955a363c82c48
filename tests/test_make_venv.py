"""make_venv, the tests' real-wheel environments: pip runs once per run for a wheel set, every
later environment of that set is a copy whose package files are hard links to that one install,
and what anything writes (the files patch sets name, the metadata, the venv itself) is its own."""

from __future__ import annotations

import os

from helpers import COMM, ServingEnv, make_venv


def _own_and_linked(env: ServingEnv) -> tuple[list[str], list[str]]:
    site = env.site_packages
    files = [p for p in env.root.rglob("*") if p.is_file() and not p.is_symlink()]
    linked = [str(p.relative_to(site)) for p in files if p.stat().st_nlink > 1]
    return [str(p.relative_to(env.root)) for p in files if p.stat().st_nlink == 1], linked


def test_a_second_environment_of_one_wheel_set_links_the_first_install(serving_env, flashinfer_wheel, sglang_wheel,
                                                                       tmp_path):
    make_venv(tmp_path / "second", [flashinfer_wheel, sglang_wheel])
    second = ServingEnv(tmp_path / "second", serving_env.home)
    package = "flashinfer/__init__.py"
    assert os.stat(serving_env.file(package)).st_ino == os.stat(second.file(package)).st_ino
    own, linked = _own_and_linked(second)
    assert len(linked) > 1000 and not [p for p in linked if ".dist-info" in p.split("/")[0]]
    assert COMM not in linked and "pyvenv.cfg" in own and f"{second.site_packages.relative_to(second.root)}/{COMM}" in own
    assert os.stat(serving_env.file(COMM)).st_ino != os.stat(second.file(COMM)).st_ino
    assert second.record_mismatches() == [] and second.python.is_file()


def test_linked_false_gives_every_file_its_own_bytes(flashinfer_wheel, sglang_wheel, tmp_path):
    make_venv(tmp_path / "venv", [flashinfer_wheel, sglang_wheel], linked=False)
    env = ServingEnv(tmp_path / "venv", tmp_path)
    own, linked = _own_and_linked(env)
    assert linked == [] and len(own) > 1000 and env.record_mismatches() == []
