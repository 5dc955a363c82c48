"""FlashInfer JIT cache: exactly the trtllm_comm entries of one version, in every arch dir;
where the cache is; FlashInfer's own build lock; entries built from another environment."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from helpers import jit_entry_at
from sm120patch import jitcache
from sm120patch.errors import TransactionError


def make_entry(base, version, arch, module):
    entry = jit_entry_at(base, version, arch, module)
    entry.mkdir(parents=True)
    (entry / "build.ninja").write_text("rule x\n")
    return entry


def test_entries_are_only_that_module_of_that_version(tmp_path):
    wanted = [make_entry(tmp_path, "0.6.4", arch, "trtllm_comm") for arch in ("120a", "90a", "90a_120a")]
    make_entry(tmp_path, "0.6.4", "120a", "norm")
    make_entry(tmp_path, "0.6.3", "120a", "trtllm_comm")
    assert jitcache.entries("0.6.4", tmp_path, "trtllm_comm") == sorted(wanted)
    assert jitcache.entries("0.6.4", tmp_path / "missing", "trtllm_comm") == []


def test_flashinfers_own_lock_is_taken_and_a_held_one_is_waited_for_then_named(tmp_path):
    """FlashInfer holds cached_ops/tmp/<module>.lock (an flock) while it builds or loads."""
    entry = make_entry(tmp_path, "0.6.4", "120a", "trtllm_comm")
    lock = tmp_path / ".cache/flashinfer/0.6.4/120a/cached_ops/tmp/trtllm_comm.lock"
    with jitcache.module_locks([entry], "trtllm_comm", owner=None, on_wait=None):
        assert lock.exists()
    waits = []
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(TransactionError, match="a FlashInfer process is building or loading trtllm_comm") as err:
            jitcache.module_locks([entry], "trtllm_comm", owner=None, on_wait=waits.append, timeout=0.3)
    assert waits and str(lock) in err.value.message
    assert "run again once the server has started" in err.value.hint


def test_an_entry_built_from_another_environment_is_told_apart(tmp_path):
    entry = make_entry(tmp_path, "0.6.4", "120a", "trtllm_comm")
    mine, other = tmp_path / "env-a" / "site-packages", tmp_path / "env-b" / "site-packages"
    (entry / "build.ninja").write_text(
        f"build trtllm_allreduce.cuda.o: cuda_compile {other}/flashinfer/data/csrc/trtllm_allreduce.cu\n")
    assert jitcache.foreign_entry(entry, mine) == other / "flashinfer/data/csrc/trtllm_allreduce.cu"
    assert jitcache.foreign_entry(entry, other) is None


def test_an_entry_older_than_the_sources_is_stale(tmp_path):
    entry = make_entry(tmp_path, "0.6.4", "120a", "trtllm_comm")
    source = tmp_path / "comm.py"
    source.write_text("x")
    os.utime(entry / "build.ninja", (1_000_000, 1_000_000))
    assert jitcache.is_stale(entry, [source])
    os.utime(entry / "build.ninja", None)
    os.utime(source, (1_000_000, 1_000_000))
    assert not jitcache.is_stale(entry, [source])


def test_cache_base_follows_flashinfer(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path))
    assert jitcache.cache_base() == jitcache.CacheBase(tmp_path, "$FLASHINFER_WORKSPACE_BASE")
    assert jitcache.cache_base("/srv/other").path == Path("/srv/other")
    monkeypatch.delenv("FLASHINFER_WORKSPACE_BASE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert jitcache.cache_base() == jitcache.CacheBase(tmp_path / "home", "$HOME")
