"""Source checkouts: real git trees in the upstream layout, built from the real wheels' files
(FlashInfer keeps include/ and csrc/ at the repository root, SGLang lives under python/)."""

from __future__ import annotations

import json
import subprocess
import zipfile
from pathlib import Path

import git
import pytest

from helpers import need, run_cli
from sm120patch.errors import ExitCode
from sm120patch.wheels import fetch_wheel

FLASHINFER_FILES = ["csrc/trtllm_allreduce.cu", "flashinfer/comm/mnnvl.py", "flashinfer/jit/comm.py",
                    "include/flashinfer/comm/trtllm_allreduce.cuh", "include/flashinfer/comm/trtllm_allreduce_fusion.cuh",
                    "include/flashinfer/comm/trtllm_moe_allreduce_fusion.cuh"]


def new_repo(root: Path) -> git.Repo:
    repo = git.Repo.init(root, initial_branch="main")
    with repo.config_writer() as config:
        config.set_value("user", "name", "Upstream Dev")
        config.set_value("user", "email", "dev@example.org")
    return repo


def flashinfer_tree(wheel: Path, root: Path, version: str, *, submodules: bool = False) -> git.Repo:
    """FlashInfer's repository layout from its wheel: data/include -> include, data/csrc -> csrc
    (and, with ``submodules``, data/spdlog and data/cutlass -> 3rdparty/, as upstream has them)."""
    moves = [("flashinfer/data/include/", "include/"), ("flashinfer/data/csrc/", "csrc/")]
    if submodules:
        moves += [("flashinfer/data/spdlog/", "3rdparty/spdlog/"), ("flashinfer/data/cutlass/", "3rdparty/cutlass/")]
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            for prefix, target in moves:
                if name.startswith(prefix):
                    break
            else:
                prefix, target = ("flashinfer/", "flashinfer/") if name.startswith("flashinfer/") and not name.startswith("flashinfer/data/") else ("", None)
            if target is None or name.endswith("/"):
                continue
            path = root / (target + name[len(prefix):])
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(archive.read(name))
    (root / "version.txt").write_text(version + "\n")
    repo = new_repo(root)
    repo.git.add(A=True)
    repo.index.commit(f"FlashInfer v{version}")
    return repo


def sglang_tree(wheel: Path, root: Path, version: str) -> git.Repo:
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if name.startswith("sglang/") and not name.endswith("/"):
                path = root / "python" / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(archive.read(name))
    repo = new_repo(root)
    repo.git.add(A=True)
    repo.index.commit(f"SGLang v{version}")
    repo.create_tag(f"v{version}")
    return repo


@pytest.fixture
def flashinfer_repo(tmp_path, flashinfer_wheel):
    return flashinfer_tree(flashinfer_wheel, tmp_path / "flashinfer", "0.6.4")


@pytest.fixture
def sglang_repo(tmp_path, sglang_wheel):
    return sglang_tree(sglang_wheel, tmp_path / "sglang", "0.5.9")


def changed_files(repo: git.Repo, rev: str = "HEAD") -> list[str]:
    return sorted(repo.git.show("--name-only", "--format=", rev).split())


def test_flashinfer_tree_apply_makes_one_commit_on_the_named_branch(flashinfer_repo):
    root = flashinfer_repo.working_tree_dir
    base = flashinfer_repo.head.commit.hexsha
    before = run_cli("status", "--source", root)
    assert before.exit_code == ExitCode.NOT_OK and before.output.count("not in HEAD") == 7

    result = run_cli("apply", "--source", root)
    assert result.exit_code == 0, result.output
    assert "on sm120patch/flashinfer-python-0.6.4 (6 files)" in result.output
    assert flashinfer_repo.active_branch.name == "sm120patch/flashinfer-python-0.6.4"
    head = flashinfer_repo.head.commit
    assert [p.hexsha for p in head.parents] == [base]
    assert changed_files(flashinfer_repo) == FLASHINFER_FILES  # exactly the patched files
    message = head.message
    assert "sm120patch: enable SM120 fused allreduce in flashinfer-python 0.6.4" in message
    assert message.count("Forwarded: https://github.com/flashinfer-ai/flashinfer/pull/3903") == 6
    assert "Applied-Upstream: 0.6.17" in message and "Sm120patch-Pinned: yes" in message
    assert "supported_major_versions=[9, 10, 12]" in (Path(root) / "flashinfer/jit/comm.py").read_text()
    assert not flashinfer_repo.is_dirty(untracked_files=True)

    after = run_cli("status", "--source", root)
    assert after.exit_code == 0 and after.output.count("in HEAD") == 7 and "not in HEAD" not in after.output


def test_exported_patch_applies_with_git_am_on_a_fresh_copy(flashinfer_repo, tmp_path):
    root = flashinfer_repo.working_tree_dir
    base = flashinfer_repo.head.commit.hexsha
    assert run_cli("apply", "--source", root).exit_code == 0
    exported = run_cli("export", "--source", root, "--out", str(tmp_path / "patches"))
    assert exported.exit_code == 0, exported.output
    (patch,) = sorted((tmp_path / "patches").glob("*.patch"))
    fresh = git.Repo.clone_from(root, tmp_path / "fresh")
    with fresh.config_writer() as config:
        config.set_value("user", "name", "Reviewer")
        config.set_value("user", "email", "reviewer@example.org")
    fresh.git.checkout("-b", "review", base)
    fresh.git.am(str(patch))
    assert fresh.head.commit.tree.hexsha == flashinfer_repo.head.commit.tree.hexsha


def test_revert_returns_to_the_original_branch(flashinfer_repo):
    root = flashinfer_repo.working_tree_dir
    assert run_cli("apply", "--source", root).exit_code == 0
    result = run_cli("revert", "--source", root)
    assert result.exit_code == 0, result.output
    assert flashinfer_repo.active_branch.name == "main"
    assert "sm120patch/flashinfer-python-0.6.4" not in flashinfer_repo.heads
    assert run_cli("status", "--source", root).output.count("not in HEAD") == 7


def test_revert_keeps_a_branch_someone_committed_to(flashinfer_repo):
    root = flashinfer_repo.working_tree_dir
    assert run_cli("apply", "--source", root).exit_code == 0
    (Path(root) / "NOTES.md").write_text("benchmarks\n")
    flashinfer_repo.index.add(["NOTES.md"])
    flashinfer_repo.index.commit("my notes")
    result = run_cli("revert", "--source", root)
    assert result.exit_code == ExitCode.REFUSED and "commits sm120patch did not make" in result.output
    assert flashinfer_repo.active_branch.name == "sm120patch/flashinfer-python-0.6.4"


def repo_state(repo: git.Repo) -> tuple:
    """Everything a run could change in a checkout: refs, HEAD, index, working files."""
    root = Path(repo.working_tree_dir)
    files = {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file() and ".git" not in p.parts}
    return (sorted((h.name, h.commit.hexsha) for h in repo.heads), repo.head.commit.hexsha,
            (root / ".git" / "index").read_bytes(), files,
            sorted(p.name for p in (root / ".git").iterdir()))


def test_a_dirty_tree_is_refused(flashinfer_repo):
    root = Path(flashinfer_repo.working_tree_dir)
    (root / "NOTES.md").write_text("wip\n")
    before = repo_state(flashinfer_repo)
    result = run_cli("apply", "--source", str(root))
    assert result.exit_code == ExitCode.REFUSED and "uncommitted changes" in result.output
    assert repo_state(flashinfer_repo) == before


def test_a_drifted_file_in_a_checkout_is_refused_as_in_an_environment(flashinfer_repo):
    root = Path(flashinfer_repo.working_tree_dir)
    comm = root / "flashinfer/jit/comm.py"
    comm.write_text(comm.read_text() + "# wip\n")
    before = repo_state(flashinfer_repo)
    result = run_cli("apply", "--source", str(root))
    assert result.exit_code == ExitCode.REFUSED
    assert "flashinfer/jit/comm.py" in result.output and "not the release's bytes" in result.output
    assert repo_state(flashinfer_repo) == before


def test_dry_run_on_a_checkout_changes_nothing_and_prints_the_diff(flashinfer_repo):
    """A dry run never creates the branch or commits (it once did)."""
    root = flashinfer_repo.working_tree_dir
    before = repo_state(flashinfer_repo)
    result = run_cli("apply", "--source", root, "--dry-run")
    assert result.exit_code == 0, result.output
    assert "+        supported_major_versions=[9, 10, 12]" in result.output
    assert "--- a/flashinfer/jit/comm.py" in result.output or "--- flashinfer/jit/comm.py" in result.output
    assert repo_state(flashinfer_repo) == before
    diff = run_cli("diff", "--source", root)
    assert diff.exit_code == 0 and "include/flashinfer/comm/trtllm_allreduce.cuh" in diff.output
    assert repo_state(flashinfer_repo) == before


def test_json_on_a_checkout_is_one_document(flashinfer_repo):
    root = flashinfer_repo.working_tree_dir
    result = run_cli("apply", "--source", root, "--json")
    assert result.exit_code == 0
    doc = json.loads(result.output)  # nothing printed ahead of it
    (entry,) = doc["results"]
    assert entry["kind"] == "checkout" and entry["commit"]["branch"] == "sm120patch/flashinfer-python-0.6.4"
    assert entry["commit"]["sha"] == flashinfer_repo.head.commit.hexsha
    status = json.loads(run_cli("status", "--source", root, "--json").output)
    assert status["exit_code"] == 0
    assert {p["in_head"] for p in status["distributions"][0]["patches"]} == {True}


def test_force_on_a_drifted_checkout_commits_by_meaning_as_unpinned(flashinfer_repo):
    root = Path(flashinfer_repo.working_tree_dir)
    comm = root / "flashinfer/jit/comm.py"
    comm.write_text("# local change\n" + comm.read_text())
    flashinfer_repo.index.add(["flashinfer/jit/comm.py"])
    flashinfer_repo.index.commit("local change")
    result = run_cli("apply", "--source", str(root), "--force")
    assert result.exit_code == 0, result.output
    assert "Sm120patch-Pinned: no" in flashinfer_repo.head.commit.message
    assert comm.read_text().startswith("# local change\n") and "[9, 10, 12]" in comm.read_text()
    assert run_cli("revert", "--source", str(root)).exit_code == 0
    assert flashinfer_repo.active_branch.name == "main"


def test_sglang_tree_with_an_opt_in_patch(sglang_repo):
    root = sglang_repo.working_tree_dir
    result = run_cli("apply", "--source", root, "--with", "symm-mem")
    assert result.exit_code == 0, result.output
    assert changed_files(sglang_repo) == [
        "python/sglang/srt/distributed/device_communicators/all_reduce_utils.py",
        "python/sglang/srt/layers/communicator.py",
    ]
    assert sglang_repo.active_branch.name == "sm120patch/sglang-0.5.9"


def test_a_checkout_at_the_upstream_fix_has_every_patch_in_head(tmp_path, wheel_cache):
    repo = flashinfer_tree(fetch_wheel("flashinfer-python", "0.6.17", wheel_cache), tmp_path / "fi", "0.6.17")
    status = run_cli("status", "--source", repo.working_tree_dir)
    assert status.exit_code == 0 and status.output.count("in HEAD") == 6 and "not in HEAD" not in status.output


def test_not_a_checkout(tmp_path):
    result = run_cli("apply", "--source", str(tmp_path))
    assert result.exit_code == ExitCode.USAGE and "not a git checkout" in result.output
    missing = run_cli("apply", "--source", str(tmp_path / "nope"))
    assert missing.exit_code == ExitCode.USAGE and "no such directory" in missing.output


def test_an_editable_install_is_patched_in_its_source_tree(sm120patch, serving_env, sglang_repo):
    """pip records an editable install in direct_url.json; apply routes it to source mode."""
    dist_info = next(serving_env.site_packages.glob("sglang-*.dist-info"))
    (dist_info / "direct_url.json").write_text(json.dumps(
        {"url": Path(sglang_repo.working_tree_dir).as_uri(), "dir_info": {"editable": True}}))
    assert f"editable install of {sglang_repo.working_tree_dir}" in sm120patch("status").output
    result = sm120patch("apply", "--sglang", "0.5.9")
    assert result.exit_code == 0, result.output
    assert "sglang is an editable install of" in result.output
    assert sglang_repo.active_branch.name == "sm120patch/sglang-0.5.9"
    # site-packages untouched (but for the direct_url.json this test wrote)
    assert serving_env.record_mismatches() == [f"{dist_info.name}/direct_url.json"]


def test_diff_is_accepted_by_patch_p1_from_site_packages(serving_env, tmp_path):
    diff = run_cli("diff", "--python", str(serving_env.python), "--flashinfer", "0.6.4")
    assert diff.exit_code == 0
    patch_file = tmp_path / "sm120.patch"
    patch_file.write_text(diff.output)
    subprocess.run(["patch", "-p1", "--dry-run", "-i", str(patch_file)], cwd=serving_env.site_packages, check=True,
                   capture_output=True)
    subprocess.run(["git", "apply", "--check", str(patch_file)], cwd=serving_env.site_packages, check=True)


def test_verify_compile_builds_a_checkouts_header_from_its_own_layout(tmp_path, flashinfer_wheel):
    """verify --compile of an editable FlashInfer (its tree is the checkout) compiles the header
    where the checkout keeps it: include/ and the 3rdparty/ submodules, not flashinfer/data/.
    Pristine, the SM120 lamport kernel is compiled out; after apply (a commit), it is there."""
    from sm120patch import verify
    from sm120patch.assess import assess
    from sm120patch.checkout import open_checkout
    from sm120patch.distributions import load_registry
    from sm120patch.ptx import find_nvcc
    from sm120patch.reports import TreeStatus

    need(find_nvcc() is not None, "nvcc not found (CUDA_HOME, PATH, /usr/local/cuda)")
    repo = flashinfer_tree(flashinfer_wheel, tmp_path / "flashinfer", "0.6.4", submodules=True)

    def lamport_check():
        tree = open_checkout(repo.working_tree_dir, load_registry())
        compiled.clear()
        results = verify.compile_checks(TreeStatus(assess(tree, tree.distribution)), progress=compiled.append)
        return {r.subject: r for r in results}

    compiled: list[str] = []
    before = lamport_check()["sm_120a lamport kernel PTX"]
    assert before.ok is False and "compiled out" in before.detail
    # The release's header: nothing to compare the other architectures' PTX with, so none is compiled.
    assert [line.split(" PTX")[0] for line in compiled if line.startswith("compiling")] == ["compiling sm_120a"]
    assert run_cli("apply", "--source", repo.working_tree_dir).exit_code == ExitCode.OK
    after = lamport_check()
    assert after["sm_120a lamport kernel PTX"].ok is True
    # A checkout keeps no original (the release is the commit before sm120patch's): nothing to compare with.
    assert after["sm_90a PTX unchanged"].ok is None and after["sm_90a PTX unchanged"].detail == "no saved original to compare with"
    assert [line.split(" PTX")[0] for line in compiled if line.startswith("compiling")] == ["compiling sm_120a"]
