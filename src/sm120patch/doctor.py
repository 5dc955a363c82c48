"""`sm120patch doctor`: the machine and the environment, as they bear on fused allreduce on
SM120: GPUs and compute capability, driver and toolkit versions, PCIe-only topology, AOT
shadowing, the SGLang <-> FlashInfer pin, releases that fix it upstream, and whether the
installed SGLang turns fusion on by itself. Every part reports what it could not find and the
rest goes on."""

from __future__ import annotations

import csv
import io
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Callable

from packaging.version import Version

from sm120patch import driver
from sm120patch.chain import StepResult
from sm120patch.errors import ExitCode
from sm120patch.jitbuild import libcuda_for_link
from sm120patch.reports import StatusReport
from sm120patch.words import counted

ANSI = re.compile(r"\x1b\[[0-9;]*m")
# SM120 needs CUDA 12.8 (sm_120a); FlashInfer >= 0.6.7 targets 120f, which needs 12.9.
MIN_CUDA_SM120 = Version("12.8")
MIN_CUDA_120F = Version("12.9")
FLASHINFER_USES_120F = Version("0.6.7")
PCIE_WARNING = (
    "GPUs talk over PCIe only (no NVLink): upstream measured a TP4 regression with fusion over PCIe "
    "(sglang PR #32330, closed), and one 8-GPU PCIe box ran far slower with fusion on; benchmark "
    "with and without --enable-flashinfer-allreduce-fusion before production"
)


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    compute_cap: str
    driver: str
    memory: str
    bus_id: str

    @property
    def major(self) -> int | None:
        return self.capability[0] if self.capability else None

    @property
    def capability(self) -> tuple[int, int] | None:
        """``(9, 0)`` from "9.0"; None for what nvidia-smi prints when it cannot say ("[N/A]")."""
        major, _, minor = self.compute_cap.partition(".")
        try:
            return int(major), int(minor or 0)
        except ValueError:
            return None


def parse_gpu_query(text: str) -> list[Gpu]:
    """``nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total,pci.bus_id --format=csv``."""
    rows = [r for r in csv.reader(io.StringIO(text.strip()), skipinitialspace=True) if r]
    if not rows or not rows[0] or not rows[0][0].startswith("name"):
        raise ValueError("not nvidia-smi --query-gpu CSV output (no 'name' header)")
    return [Gpu(i, *[c.strip() for c in row[:5]]) for i, row in enumerate(rows[1:]) if len(row) >= 5]


def parse_cuda_version(nvidia_smi_text: str) -> str | None:
    """The driver's CUDA version from plain ``nvidia-smi`` ("CUDA Version: 13.0")."""
    match = re.search(r"CUDA Version:\s*([0-9.]+)", nvidia_smi_text)
    return match.group(1) if match else None


@dataclass(frozen=True)
class Topology:
    gpus: list[str]
    links: dict[tuple[str, str], str] = field(default_factory=dict)  # (GPUi, GPUj) -> PIX/NV4/...

    @property
    def nvlink_pairs(self) -> list[tuple[str, str]]:
        return [pair for pair, link in self.links.items() if link.startswith("NV")]

    @property
    def pcie_only(self) -> bool:
        return len(self.gpus) > 1 and not self.nvlink_pairs


def parse_topology(text: str) -> Topology:
    """``nvidia-smi topo -m``: the GPU-to-GPU part of the matrix (ANSI codes stripped)."""
    lines = [ANSI.sub("", line).rstrip() for line in text.splitlines()]
    header = next((line for line in lines if line.strip().startswith("GPU0")), None)
    if header is None:
        raise ValueError("not nvidia-smi topo -m output (no GPU0 header)")
    columns = [c.strip() for c in header.strip().split("\t")]
    gpus = [c for c in columns if re.fullmatch(r"GPU\d+", c)]
    links = {}
    for line in lines:
        cells = [c.strip() for c in line.split("\t")]
        if cells and re.fullmatch(r"GPU\d+", cells[0]):
            for column, cell in zip(gpus, cells[1:]):
                if column != cells[0]:
                    links[(cells[0], column)] = cell
    return Topology(gpus, links)


def parse_nvcc_version(text: str) -> str | None:
    match = re.search(r"release (\d+\.\d+)", text)
    return match.group(1) if match else None


@dataclass
class Finding:
    level: str  # ok / info / warn
    text: str


@dataclass
class DoctorReport:
    gpus: list[Gpu] = field(default_factory=list)
    topology: Topology | None = None
    findings: list[Finding] = field(default_factory=list)
    driver: driver.DriverFacts | None = None
    libcuda: object | None = None  # jitbuild.Libcuda: what FlashInfer's JIT link would take here
    target: str | None = None  # the interpreter whose environment was examined (the first line)
    python_version: str = ""
    chosen_by: str = ""  # without --python: how that interpreter was chosen

    errors = ()  # the report says what it could not find
    exit_code = ExitCode.OK  # the report was made

    def add(self, level: str, text: str) -> None:
        self.findings.append(Finding(level, text))


def _run(argv: list[str]) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def examine_machine(report: DoctorReport) -> None:
    query = _run(["nvidia-smi", "--query-gpu=name,compute_cap,driver_version,memory.total,pci.bus_id", "--format=csv"])
    if query is None:
        report.add("info", "nvidia-smi not found or it failed: no GPU or driver information on this machine")
    else:
        try:
            report.gpus = parse_gpu_query(query)
        except ValueError as exc:
            report.add("warn", f"could not read nvidia-smi's GPU list: {exc}")
        for gpu in report.gpus:
            note = "SM120: the patched trtllm_comm targets it" if gpu.major == 12 else (
                "SM90/SM100: upstream FlashInfer supports it without patches" if gpu.major in (9, 10) else "")
            report.add("ok" if gpu.major == 12 else "info",
                       f"GPU{gpu.index}: {gpu.name}, compute capability {gpu.compute_cap}, {gpu.memory}, bus {gpu.bus_id}"
                       + (f" ({note})" if note else ""))
        if report.gpus:
            report.add("info", f"driver {report.gpus[0].driver}"
                       + (f", CUDA {cuda} (driver API)" if (cuda := parse_cuda_version(_run(["nvidia-smi"]) or "")) else ""))
        topo_text = _run(["nvidia-smi", "topo", "-m"])
        if topo_text:
            try:
                report.topology = parse_topology(topo_text)
            except ValueError as exc:
                report.add("warn", f"could not read nvidia-smi topo -m: {exc}")
        if report.topology is not None:
            topo = report.topology
            if len(topo.gpus) < 2:
                report.add("info", "one GPU: fused allreduce needs 2, 4, 8 or 16 ranks")
            elif topo.pcie_only:
                report.add("warn", PCIE_WARNING)
            else:
                report.add("ok", f"NVLink between {counted(len(topo.nvlink_pairs) // 2, 'GPU pair')}")
    facts = driver.query()
    if not facts.devices:
        # A driver library sm120patch cannot use (none, too old, in a container without it):
        # what nvidia-smi reported still says which GPUs these are.
        facts = facts._replace(smi_capabilities=tuple(g.capability for g in report.gpus if g.capability))
    examine_driver(report, facts)
    nvcc = _run(["nvcc", "--version"])
    version = parse_nvcc_version(nvcc) if nvcc else None
    if version is None:
        report.add("info", "nvcc not found on PATH: FlashInfer's JIT needs the CUDA toolkit (>= 12.8 for SM120)")
    else:
        v = Version(version)
        if v < MIN_CUDA_SM120:
            report.add("warn", f"CUDA toolkit {version}: SM120 needs >= {MIN_CUDA_SM120}")
        elif v < MIN_CUDA_120F:
            report.add("warn", f"CUDA toolkit {version}: enough for sm_120a; FlashInfer >= {FLASHINFER_USES_120F} targets 120f, which needs >= {MIN_CUDA_120F}")
        else:
            report.add("ok", f"CUDA toolkit {version} (nvcc): enough for sm_120a and 120f")
        libcuda = libcuda_for_link()
        report.libcuda = libcuda
        report.add("ok" if libcuda.kind != "none" else "info", f"libcuda for FlashInfer's JIT link: {libcuda.describe()}")


def examine_driver(report: DoctorReport, facts: driver.DriverFacts) -> None:
    """What the fusion workspaces depend on, as the driver answers its queries (multicast
    support, peer access); never a multicast call."""
    report.driver = facts
    if not facts.devices:
        report.add("info", f"{facts.error}: multicast support and peer access not read (the fusion paths below "
                           "are for a GPU without multicast, as on PCIe SM120 boxes)")
        return
    multicast = [d.index for d in facts.devices if d.multicast]
    if facts.multicast:
        report.add("info", "every GPU reports multicast (CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED = 1: an NVSwitch box)")
    else:
        report.add("info", "GPUs without multicast (CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED = 0"
                           + (f"; GPU {', '.join(map(str, multicast))} report 1" if multicast else "")
                           + "): the fusion workspace must be unicast (see the fusion lines below)")
    if facts.peers_ok is False:
        missing = sorted(f"GPU{i}->GPU{j}" for (i, j), ok in facts.peer_access.items() if not ok)
        report.add("warn", f"no peer-to-peer access {', '.join(missing)}: every fusion workspace maps the other GPUs' "
                           "memory (IPC or symmetric memory), so fusion cannot run across those pairs; check "
                           "`nvidia-smi topo -p2p r` and the BIOS's ACS/IOMMU settings")
    elif facts.peers_ok:
        report.add("ok", f"peer-to-peer access between every pair of the {len(facts.devices)} GPUs")


def doctor(status: Callable[[driver.DriverFacts | None], StatusReport]) -> DoctorReport:
    """``sm120patch doctor``: the machine first, then the environment (``status``, given the
    driver's answers so that each server's fusion chain is judged for these GPUs)."""
    report = DoctorReport()
    examine_machine(report)
    examine_environment(report, status(report.driver))
    return report


def examine_environment(report: DoctorReport, status: StatusReport) -> None:
    report.target, report.python_version, report.chosen_by = status.target, status.python_version, status.chosen_by
    for item in status.trees:
        a, distribution = item.assessment, item.distribution
        verdict = a.verdict
        report.add("ok" if verdict.done else "info",
                   f"{a.name} {a.raw_version}: {verdict.value}" + (f" ({a.reason})" if a.reason else ""))
        if a.patch_set is not None and distribution.fixed_in:
            report.add("info", f"{a.name} {distribution.fixed_in} and later support SM120 here natively ({distribution.upstream})")
        for level, text in item.advice_lines():
            report.add(level, text)
        if item.pin:
            report.add("info", item.pin)
        if item.chain is not None:
            chain = item.chain
            # "ok" only where the driver answered for these GPUs: unread, the sentence is about an SM120 GPU.
            known = chain.step("device").result is not StepResult.UNKNOWN
            report.add({"will fuse": "ok" if known else "info", "will not fuse": "warn"}.get(chain.verdict, "info"),
                       chain.headline)
            for step in chain.steps:
                if step.result is not StepResult.OK:
                    report.add("info", f"  {step.id} {step.result.value}: {step.text}"
                               + (f" (fix: `{step.fix}`)" if step.fix else ""))
        if item.jit is not None:
            for entry in item.jit.stale:
                report.add("warn", f"stale JIT cache entry {entry}: remove it (sm120patch apply does)")
            for entry, source in item.jit.foreign.items():
                report.add("info", f"JIT cache entry {entry} was built from another environment's sources ({source})")
    for directory, who in status.exposed:
        report.add("info", f"{directory} and below: {who} can change them; as root, sm120patch writes there by directory "
                           "descriptors only and runs that environment's programs as its owner")
    if not status.trees:
        report.add("info", f"none of {', '.join(status.registry_names)} is installed in this environment")
    for shadow in status.aot:
        report.add("warn", f"prebuilt {shadow.path} ({shadow.source}) shadows the patched sources: uninstall flashinfer-jit-cache or remove it")
