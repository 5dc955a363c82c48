"""`sm120patch verify`: prove the patched state, three ways.

- static (always): each patched file's sha256 against the vendor manifest, and a semantic
  check per patch that depends on neither hashes nor rewriters (see semantics.py);
- runtime: FlashInfer's own ``gen_trtllm_comm_module()`` in the target interpreter with
  ``FLASHINFER_CUDA_ARCH_LIST=12.0a``: pristine raises the ``[9, 10]`` error, patched targets
  ``sm_120a``;
- compile: the lamport kernel from the installed headers compiled to PTX (see ptx.py):
  ``sm_120a`` must contain ``griddepcontrol``; ``sm_90a`` and ``sm_100a`` must be identical to
  the PTX from the release's header (kept by sm120patch as the original);
- tuned: where the opt-in patch tuned-limits is applied, the server's own decision code, imported
  in the target interpreter as the server imports it, asked at the profile's boundary sizes (and
  1..TP) what it does: fused or not, one-shot or two-shot (see _decision_probe.py). Its own flag,
  not part of --runtime: it imports the whole server (seconds, and the server's dependencies),
  and `apply --with tuned-limits` runs it after writing, rolling back where the code raises.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from sm120patch import ptx, runas, signals
from sm120patch.assess import State
from sm120patch.errors import ExitCode, Sm120PatchError
from sm120patch.decisions import tuned_checks
from sm120patch.jitbuild import end_group, missing_for_build, start_build
from sm120patch.reports import CheckResult, StatusReport, TreeStatus
from sm120patch.semantics import evaluate
from sm120patch.words import counted

PTX_ARCHS = ("120a", "90a", "100a")


def verify_exit_code(results) -> ExitCode:
    """0 only when every check ran and passed: a check the user asked for that could not run
    does not pass."""
    counted = [r for r in results if r.required or r.ok is False]
    return ExitCode.OK if counted and all(r.ok for r in counted) else ExitCode.NOT_OK


def static_checks(item: TreeStatus) -> list[CheckResult]:
    a = item.assessment
    if a.patch_set is None:
        return [CheckResult("static", a.name, a.nothing_needed, a.reason)]
    results = []
    for patch in a.patch_set.patches:
        state = a.patch_state(patch)
        if not patch.required and state is State.PRISTINE:
            continue  # an opt-in patch nobody asked for
        fa = a.files[patch.file]
        results.append(CheckResult(
            "static", f"{a.name} {patch.id}", state is State.APPLIED,
            f"{patch.file}: {state.value}" + (f" (sha256 {fa.sha256[:12]} = manifest)" if state is State.APPLIED else ""),
        ))
        if fa.state is not State.MISSING and fa.read.data is not None:
            # An older form (an earlier sm120patch's) is checked as that form; status says to update it.
            checks = [f.check for f in patch.formers] if patch.id in fa.former else [patch.check]
            found = [evaluate(c, fa.read.data) for c in checks]
            ok, detail = next((r for r in found if r[0]), found[0])
            if patch.id in fa.former:
                detail = f"older form: {detail}"
            if ok is None:
                ok, detail = False, f"cannot parse {patch.file} ({detail})"
            results.append(CheckResult("semantic", f"{a.name} {patch.id}", ok, detail))
    return results


def runtime_checks(python: Path, items: list[TreeStatus]) -> list[CheckResult]:
    """Each distribution's own JIT spec (asked for SM120) and an import of each of its patched
    Python modules, in the target interpreter, in a temporary JIT workspace: a check leaves no
    trace in the cache it checks (importing FlashInfer writes a log there)."""
    script = Path(__file__).with_name("_runtime_probe.py").read_text(encoding="utf-8")
    results = []
    for item in items:
        spec = item.distribution.verify
        a = item.assessment
        files = a.patch_set.files if a.patch_set else ()
        modules = [f[:-3].replace("/", ".").removesuffix(".__init__") for f in files if f.endswith(".py")
                   and not (spec.jit_spec and f[:-3].replace("/", ".") == spec.jit_spec.split(":")[0])]
        request = {"jit_spec": spec.jit_spec, "modules": modules}
        with tempfile.TemporaryDirectory(prefix="sm120patch-runtime-") as workspace:
            user = runas.environment_owner(python)  # as root on another user's environment: as that user
            user.give(Path(workspace))
            env = user.environ(dict(os.environ, FLASHINFER_WORKSPACE_BASE=workspace))
            if spec.arch_list:
                env["FLASHINFER_CUDA_ARCH_LIST"] = spec.arch_list
            proc = subprocess.run([str(python), "-c", script, json.dumps(request)],
                                  capture_output=True, text=True, env=env, cwd="/", timeout=600, **user.popen_args())
        try:
            out = json.loads(proc.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            results.append(CheckResult("runtime", a.name, False, f"the runtime probe failed: {tail}"))
            continue
        if spec.jit_spec:
            found = out["jit_spec"]
            subject = f"{spec.jit_spec}() with FLASHINFER_CUDA_ARCH_LIST={spec.arch_list}"
            if "skipped" in found:
                results.append(CheckResult("runtime", subject, None, found["skipped"] + "; install torch (and "
                                           f"{a.name}'s dependencies) in that environment to run this check"))
            elif "error" in found:
                results.append(CheckResult("runtime", subject, False, f"raises {found['error']}"))
            else:
                targets = [f for f in found["flags"] if f.startswith("-gencode=")]
                results.append(CheckResult("runtime", subject, any(spec.expect_target in f for f in targets),
                                           "nvcc targets: " + " ".join(targets)))
        for module, found in out["modules"].items():
            subject = f"import {module}"
            if "skipped" in found:
                # Informative: a server's full dependency tree is rarely in the environment checked.
                results.append(CheckResult("runtime", subject, None, found["skipped"], required=False))
            else:
                results.append(CheckResult("runtime", subject, "error" not in found,
                                           "imports" if "error" not in found else found["error"], required=False))
    return results


def _pristine_include_tree(include: Path, header: Path, original_header: bytes, into: Path) -> Path:
    """A mirror of the ``include`` directory (symlinks) whose ``header`` (a file under it) holds
    the release's bytes. Relative includes resolve against the directory a file was named
    through, so the mirror behaves exactly like the tree's own."""
    for directory, _, files in os.walk(include):
        target_dir = into / Path(directory).relative_to(include)
        target_dir.mkdir(parents=True, exist_ok=True)
        for name in files:
            (target_dir / name).symlink_to(Path(directory) / name)
    mirrored = into / header.relative_to(include)
    mirrored.unlink()
    mirrored.write_bytes(original_header)
    return into


def compile_checks(item: TreeStatus, *, progress: Callable[[str], None] | None = None) -> list[CheckResult]:
    a = item.assessment
    nvcc = ptx.find_nvcc()
    if nvcc is None:
        return [CheckResult("compile", "nvcc PTX", None, "nvcc not found ($CUDA_HOME/bin when set, else PATH, else /usr/local/cuda/bin): install the CUDA toolkit (>= 12.8) or set CUDA_HOME")]
    relpath = item.distribution.verify.compile_header
    header = a.files.get(relpath) if relpath else None
    if header is None:
        return [CheckResult("compile", "nvcc PTX", None, f"this release's patch set does not touch {relpath}")]
    if not item.distribution.verify.compile_includes:
        # Data from before the include path was data (SM120PATCH_DATA_DIR can point at it).
        return [CheckResult("compile", "nvcc PTX", None, "the patch data names no include path ([verify] compile_includes)")]
    # The include directories as the wheel names them, wherever this tree keeps them (an install:
    # under flashinfer/data; a checkout: include/ and 3rdparty/): the tree's read() says where.
    includes = [a.tree.read(relpath).path for relpath in item.distribution.verify.compile_includes]
    expected = a.manifest.files[relpath].pristine if a.manifest else None
    reference = a.tree.saved_original(relpath, expected) if header.state is State.APPLIED and expected else None

    def build(arch: str, tree: Sequence[Path], label: str) -> str:
        if progress:
            progress(f"compiling sm_{arch} PTX from the {label} header with {nvcc} ...")
        start = time.monotonic()
        text = ptx.compile_ptx(tree, arch, nvcc=nvcc)
        if progress:
            progress(f"  sm_{arch} ({label}): {time.monotonic() - start:.1f} s, {ptx.griddepcontrol_count(text)} griddepcontrol")
        return text

    results = []
    try:
        # The other architectures' PTX is compiled only where there is a release header to compare
        # it with: without one it could show nothing (an unpatched header is the release's).
        others = PTX_ARCHS[1:] if reference is not None else ()
        installed = {arch: build(arch, includes, "installed") for arch in (PTX_ARCHS[0], *others)}
        count = ptx.griddepcontrol_count(installed["120a"])
        detail = counted(count, "griddepcontrol instruction") + ("" if count else ": the kernel body is compiled out")
        if others and count:  # what the same kernel holds where it was never gated, to compare with
            detail += f" (sm_{others[0]}: {ptx.griddepcontrol_count(installed[others[0]])})"
        results.append(CheckResult("compile", "sm_120a lamport kernel PTX", count > 0, detail))
        if reference is None:
            detail = "installed header is the release's" if header.state is State.PRISTINE else "no saved original to compare with"
            for arch in PTX_ARCHS[1:]:
                results.append(CheckResult("compile", f"sm_{arch} PTX unchanged", None if header.state is not State.PRISTINE else True, detail))
            return results
        with tempfile.TemporaryDirectory(prefix="sm120patch-pristine-") as tmp:
            tree = [_pristine_include_tree(includes[0], header.path, reference, Path(tmp)), *includes[1:]]
            for arch in PTX_ARCHS[1:]:
                same = build(arch, tree, "release") == installed[arch]
                results.append(CheckResult("compile", f"sm_{arch} PTX unchanged", same,
                                           "byte-identical to the release header's PTX" if same else "PTX differs from the release header's"))
    except Sm120PatchError as exc:
        results.append(CheckResult("compile", "nvcc PTX", False, exc.message))
    return results


BUILD_ARCHS = "12.0a"  # what verify --build compiles for: SM120, as a server on an RTX PRO 6000 or RTX 5090 would


def build_check(python: Path, *, arch_list: str = BUILD_ARCHS, progress: Callable[[str], None] | None = None) -> list[CheckResult]:
    """FlashInfer's own JIT build of trtllm_comm into a temporary workspace; linking and
    loading need libcuda (a driver), so without one the objects are compiled and that is said."""
    script = """
import ctypes.util, json, os
import flashinfer.jit.comm as comm
spec = comm.gen_trtllm_comm_module()
out = {"build_dir": str(spec.build_dir), "sources": len(spec.sources), "libcuda": ctypes.util.find_library("cuda")}
try:
    spec.build_and_load()
    out["loaded"] = True
except Exception as exc:
    out["loaded"] = False
    out["error"] = "%s: %s" % (type(exc).__name__, str(exc).strip().splitlines()[-1] if str(exc).strip() else "")
out["objects"] = sorted(p for p in os.listdir(spec.build_dir) if p.endswith(".o"))
out["library"] = os.path.exists(spec.jit_library_path)
print(json.dumps(out))
"""
    with tempfile.TemporaryDirectory(prefix="sm120patch-build-") as workspace:
        user = runas.environment_owner(python)  # as root on another user's environment: as that user
        user.give(Path(workspace))
        env = user.environ(dict(os.environ, FLASHINFER_CUDA_ARCH_LIST=arch_list, FLASHINFER_WORKSPACE_BASE=workspace))
        if progress:
            progress(f"building trtllm_comm for {arch_list} with FlashInfer's JIT (minutes) ...")
        start = time.monotonic()
        # A process group of its own, ended whole on a signal (jitbuild.end_group) or when
        # sm120patch is killed outright: a killed interpreter alone would leave FlashInfer's
        # ninja and nvcc running.
        proc = start_build(python, script, [], env, user.popen_args(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
        try:
            stdout, stderr = proc.communicate()
        except BaseException:
            with signals.held():
                end_group(proc)
            raise
        proc = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        elapsed = time.monotonic() - start
        try:
            out = json.loads(proc.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            return [CheckResult("build", f"trtllm_comm JIT build ({arch_list})", False, tail)]
    subject = f"trtllm_comm JIT build ({arch_list})"
    objects, sources = len(out["objects"]), out["sources"]
    if out["loaded"]:
        return [CheckResult("build", subject, True, f"built and loaded in {elapsed:.0f} s ({objects} objects)")]
    if objects == sources and not out["libcuda"]:
        # Every source compiled; the link step needs libcuda, which only a machine with a driver has.
        return [CheckResult("build", subject, True,
                            f"compiled all {sources} sources in {elapsed:.0f} s; not linked or loaded: "
                            "no CUDA driver (libcuda) on this machine")]
    return [CheckResult("build", subject, False, f"{out.get('error')} after {elapsed:.0f} s ({objects} of {sources} objects)")]


@dataclass(frozen=True)
class VerifyReport:
    status: StatusReport
    results: list[CheckResult]
    errors = ()  # every failed check is a row of the report

    @property
    def exit_code(self) -> ExitCode:
        return verify_exit_code(self.results)


def verify(status: StatusReport, *, runtime: bool, compile_: bool, build: bool, tuned: bool = False,
           progress: Callable[[str], None] | None = None) -> VerifyReport:
    """``sm120patch verify``: the checks asked for, in the status report's interpreter."""
    return VerifyReport(status, run_verify(status, Path(status.target), runtime=runtime, compile_=compile_, build=build,
                                           tuned=tuned, progress=progress))


def run_verify(report: StatusReport, python: Path, *, runtime: bool, compile_: bool, build: bool, tuned: bool = False,
               progress: Callable[[str], None] | None = None) -> list[CheckResult]:
    """The checks asked for, over every distribution of the status report."""
    results = [r for item in report.trees for r in static_checks(item)]
    if runtime:
        results += runtime_checks(python, [item for item in report.trees if item.assessment.patch_set])
    if compile_:
        results += [r for item in report.trees if item.distribution.verify.compile_header and item.assessment.patch_set
                    for r in compile_checks(item, progress=progress)]
    if tuned:
        if progress:
            progress("running the servers' tuned decision code in the target interpreter ...")
        results += tuned_checks(python, report)
    if build:
        results += _build_or_why_not(report, python, progress)
    return results


def _build_or_why_not(report: StatusReport, python: Path, progress: Callable[[str], None] | None) -> list[CheckResult]:
    """The build check, or NOT RUN with the reason, as --runtime says it (where `build` refuses:
    sources that are not patched; or where the build cannot start: no torch, ninja or nvcc)."""
    subject = f"trtllm_comm JIT build ({BUILD_ARCHS})"
    kernels = [item for item in report.trees if item.distribution.jit_module and item.distribution.verify.jit_spec]
    if not kernels:
        return [CheckResult("build", subject, None, "not run: no distribution with a JIT module sm120patch patches "
                                                    "is installed here")]
    unpatched = [item.assessment for item in kernels if not item.assessment.verdict.done]
    if unpatched:
        a = unpatched[0]
        return [CheckResult("build", subject, None, f"not run: {a.name} {a.raw_version} is {a.verdict.value} (the "
                                                    "build would be of the release's sources; `sm120patch apply` first)")]
    missing = missing_for_build(python)
    if missing:
        return [CheckResult("build", subject, None, f"not run: {'; '.join(missing)}")]
    return build_check(python, arch_list=BUILD_ARCHS, progress=progress)


# -- tuned: the server's own decisions under the profile -------------------------------------------
