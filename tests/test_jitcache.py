"""FlashInfer JIT cache: exactly the trtllm_comm entries of one version, in every arch dir."""

from __future__ import annotations

import os

from sm120patch import jitcache


def make_entry(base, version, arch, module):
    entry = base / ".cache" / "flashinfer" / version / arch / "cached_ops" / module
    entry.mkdir(parents=True)
    (entry / "build.ninja").write_text("rule x\n")
    return entry


def test_entries_and_invalidate_touch_only_trtllm_comm_of_that_version(tmp_path):
    wanted = [make_entry(tmp_path, "0.6.4", arch, "trtllm_comm") for arch in ("120a", "90a", "90a_120a")]
    others = [
        make_entry(tmp_path, "0.6.4", "120a", "norm"),
        make_entry(tmp_path, "0.6.3", "120a", "trtllm_comm"),
    ]
    assert jitcache.entries("0.6.4", tmp_path) == sorted(wanted)
    assert jitcache.invalidate("0.6.4", tmp_path) == sorted(wanted)
    assert not any(e.exists() for e in wanted)
    assert all(e.exists() for e in others)
    assert jitcache.entries("0.6.4", tmp_path / "missing") == []


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
    assert jitcache.cache_base() == tmp_path
    assert jitcache.cache_base("/srv/other") == __import__("pathlib").Path("/srv/other")
    monkeypatch.delenv("FLASHINFER_WORKSPACE_BASE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert jitcache.cache_base() == tmp_path / "home"
