"""Synthetic distributions, added to sm120patch as data alone: toyfuse (a kernel library with
a JIT module, as FlashInfer is) and toyserve (a server, as SGLang is). Each is a wheel made
here, its manifest built by sm120patch's own builder, installed by unpacking it into a
site-packages with its RECORD. The pipeline cannot tell them from the real ones; their files
are a few lines, so a test that runs sm120patch hundreds of times stays fast."""

from __future__ import annotations

import csv
import io
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.version import Version

from helpers import ROOT, record_hash
from sm120patch.distributions import load_registry
from sm120patch.manifests import build_manifest, manifest_text

SOURCE = '''\
def gen_trtllm_comm_module():
    return gen_jit_spec(
        "toy_comm",
        supported_major_versions=[9, 10],
    )
'''
DISTRIBUTION = '''\
name = "toyfuse"
option = "toyfuse"
summary = "a synthetic distribution: everything sm120patch knows about it is this file and 1.0.toml"
fixed_in = "2.0"
jit_module = "toy_comm"

[[advice]]
versions = ">=1.0"
level = "info"
text = "toyfuse {version} is made up for the tests"
'''
PATCH_SET = '''\
versions = ["1.0", "1.1"]
summary = "accept SM120"

[[patch]]
id = "jit-gate"
check = "jit-gate"
file = "toyfuse/comm.py"
required = true
summary = "gen_trtllm_comm_module accepts 12"
upstream = "https://example.org/toyfuse/pull/1"
fixed_in = "2.0"

[[patch.edit]]
rewriter = "python.extend-list-argument"
sites = 1
params = { function = "gen_trtllm_comm_module", keyword = "supported_major_versions", value = "12" }
'''
SERVE_SOURCE = SOURCE.replace('"toy_comm"', '"toy_gate"')  # its own file, the same kind of gate
SERVE_DISTRIBUTION = '''\
name = "toyserve"
option = "toyserve"
summary = "a synthetic server: everything sm120patch knows about it is this file and 1.0.toml"
fixed_in = "2.0"
'''
SERVE_PATCH_SET = PATCH_SET.replace("toyfuse/comm.py", "toyserve/gate.py").replace("toyfuse/pull", "toyserve/pull")
# name -> (the file its patch set patches, that file's bytes as released)
FILES = {"toyfuse": ("toyfuse/comm.py", SOURCE), "toyserve": ("toyserve/gate.py", SERVE_SOURCE)}


def make_wheel(directory: Path, version: str, source: str | None = None, *, name: str = "toyfuse") -> Path:
    relpath, released = FILES[name]
    files = {f"{name}/__init__.py": b"", relpath: (released if source is None else source).encode(),
             f"{name}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{name}-{version}.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for path, data in files.items():
        writer.writerow([path, record_hash(data), len(data)])
    writer.writerow([f"{name}-{version}.dist-info/RECORD", "", ""])
    wheel = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
        archive.writestr(f"{name}-{version}.dist-info/RECORD", record.getvalue())
    return wheel


def make_data(data: Path, wheels: Path, names: tuple[str, ...] = ("toyfuse",)) -> Path:
    """The shipped data plus the toy distributions ``names``, as SM120PATCH_DATA_DIR sees it."""
    shutil.copytree(ROOT / "patches", data / "patches")
    shutil.copytree(ROOT / "vendor-manifests", data / "vendor-manifests")
    texts = {"toyfuse": (DISTRIBUTION, PATCH_SET), "toyserve": (SERVE_DISTRIBUTION, SERVE_PATCH_SET)}
    for name in names:
        (data / "patches" / name).mkdir()
        (data / "patches" / name / "distribution.toml").write_text(texts[name][0])
        (data / "patches" / name / "1.0.toml").write_text(texts[name][1])
    registry = load_registry(data / "patches")
    for name in names:
        for version in ("1.0", "1.1"):
            patch_set = registry.get(name).find(Version(version))
            out = data / "vendor-manifests" / name / f"{version}.json"
            out.parent.mkdir(exist_ok=True)
            out.write_text(manifest_text(build_manifest(make_wheel(wheels, version, name=name), patch_set)))
    return data


def install(site: Path, wheel: Path) -> None:
    """What an installer leaves: the wheel's files and its RECORD, and INSTALLER."""
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
        dist_info = next(n.split("/")[0] for n in archive.namelist() if n.split("/")[0].endswith(".dist-info"))
    (site / dist_info / "INSTALLER").write_text("pip\n")


def make_install(venv: Path, wheels: list[Path]) -> Path:
    """A bare venv at ``venv`` with ``wheels`` installed as an installer would; its site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    for wheel in wheels:
        install(site, wheel)
    return site
