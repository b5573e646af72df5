"""The converted-GGUF cache (models/cache.py): one entry per source file, stale and damaged entries
rebuilt, writes atomic, `paxpage cache info|clear`. Every test runs on a private PAXPAGE_CACHE_DIR,
so the user's own cache is never read, written or cleared."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from models import cache, loading
from models.loading import load_model
from tests.models.test_loading import assert_tree_equal, expected_tree, hf_model, state, write_gguf


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("PAXPAGE_CACHE_DIR", str(root))
    return root


@pytest.fixture
def conversions(monkeypatch):
    """The GGUF files converted from scratch (not served from the cache), in order."""
    calls = []
    real = loading.read_gguf
    monkeypatch.setattr(loading, "read_gguf", lambda p, **kw: calls.append(p) or real(p, **kw))
    return calls


@pytest.fixture
def tiny_gguf(tmp_path):
    model = hf_model("llama")
    path = tmp_path / "src" / "m.gguf"
    path.parent.mkdir()
    write_gguf(path, model)
    return path, expected_tree(state(model), L=2, bias=False, qk_norm=False, tied=False)


def entries(root) -> list[str]:
    """The names under the cache root, but for the compiled kernels' and executables' folders
    (made by whichever load first builds them in a process, so present or not by test order)."""
    built = (cache.XLA_DIR, cache.EXECUTABLES_DIR, cache.NATIVE_DIR)
    return sorted(p.name for p in root.iterdir() if p.name not in built) if root.exists() else []


def test_one_entry_per_file_reused(cache_root, conversions, tiny_gguf):
    path, want = tiny_gguf
    load_model(path)
    (name,) = entries(cache_root)
    assert name.startswith("gguf-") and name.endswith("-m")
    _, params, _ = load_model(path)
    _, params16, _ = load_model(path, dtype="bfloat16")  # one f32 entry serves every dtype
    link = path.parent / "link.gguf"
    link.symlink_to(path)
    load_model(link)  # a symlink shares its target's entry
    assert conversions == [str(path)]
    assert entries(cache_root) == [name]
    assert_tree_equal(params, want)
    assert params16["layers_0"]["q_proj"]["kernel"].dtype == np.dtype("bfloat16")


def test_changed_source_replaces_its_entry(cache_root, conversions, tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    load_model(path)
    (name,) = entries(cache_root)
    other = hf_model("llama", hidden_size=32, intermediate_size=64)
    write_gguf(path, other)  # same path, new contents (a reinstall)
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    _, params, _ = load_model(path)
    assert len(conversions) == 2
    assert entries(cache_root) == [name]
    assert_tree_equal(params, expected_tree(state(other), L=2, bias=False, qk_norm=False, tied=False))


@pytest.mark.parametrize("damage", ["truncate params", "truncate meta", "delete params", "garble meta"])
def test_damaged_entry_is_detected_and_rebuilt(cache_root, conversions, tiny_gguf, damage):
    path, want = tiny_gguf
    load_model(path)
    (name,) = entries(cache_root)
    entry = cache_root / name
    target = entry / ("params.safetensors" if "params" in damage else "config.json")
    if damage.startswith("truncate"):
        target.write_bytes(target.read_bytes()[:-3])  # a few bytes: a parse could still pass
    elif damage.startswith("delete"):
        target.unlink()
    else:
        target.write_text("{")
    _, params, _ = load_model(path)
    assert len(conversions) == 2
    assert_tree_equal(params, want)
    assert entries(cache_root) == [name]
    _, params, _ = load_model(path)  # the rebuilt entry is good
    assert len(conversions) == 2
    assert_tree_equal(params, want)


def test_crashed_write_is_never_read(cache_root, conversions, tiny_gguf, monkeypatch):
    path, want = tiny_gguf

    def crash(tmp, entry):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(cache, "_move_into_place", crash)
        load_model(path)  # the write fails; the load still succeeds
    assert entries(cache_root) == []  # and leaves nothing behind
    # A killed process leaves its .building-* directory: complete files, never read as an entry.
    load_model(path)
    (name,) = entries(cache_root)
    os.rename(cache_root / name, cache_root / ".building-killed")
    calls = []
    real = loading.read_gguf
    monkeypatch.setattr(loading, "read_gguf", lambda p, **kw: calls.append(p) or real(p, **kw))
    _, params, _ = load_model(path)
    assert calls == [str(path)]
    assert_tree_equal(params, want)


def test_old_entries_of_the_same_file_are_pruned(cache_root, conversions, tiny_gguf):
    path, _ = tiny_gguf
    cache_root.mkdir()
    old = cache_root / "gguf-0123456789abcdef0123456789abcdef"  # paxpage 0.1's layout: one per mtime
    old.mkdir()
    (old / "config.json").write_text(json.dumps({"paxpage_gguf_cache": 1, "source": str(path)}))
    (old / "params.safetensors").write_bytes(b"x" * 1000)
    unrelated = cache_root / "gguf-fedcba9876543210-other"
    unrelated.mkdir()
    (unrelated / "config.json").write_text(json.dumps({"paxpage_gguf_cache": 2, "source": "/elsewhere.gguf"}))
    abandoned, live = cache_root / ".building-abandoned", cache_root / ".building-live"
    abandoned.mkdir()
    live.mkdir()
    hours_ago = time.time() - 3 * 3600
    os.utime(abandoned, (hours_ago, hours_ago))
    load_model(path)
    names = entries(cache_root)
    assert old.name not in names and abandoned.name not in names
    assert unrelated.name in names and live.name in names  # another file's entry; a write under way
    assert len([n for n in names if n.startswith("gguf-")]) == 2


def test_cache_info_and_clear(cache_root, tiny_gguf, capsys):
    from paxpage.cli import main

    path, _ = tiny_gguf
    assert main(["cache", "info"]) == 0
    assert "converted models: 0" in capsys.readouterr().out
    load_model(path)
    (cache_root / "xla").mkdir()
    (cache_root / "xla" / "exe").write_bytes(b"x" * 5000)
    (cache_root / ".building-x").mkdir()
    (cache_root / "notes.txt").write_text("the user's own file")  # not paxpage's: never removed
    items = cache.list_cache()
    assert sorted(i.kind for i in items) == ["model", "partial", "xla"]
    (model_item,) = [i for i in items if i.kind == "model"]
    assert (model_item.source, model_item.state) == (os.path.realpath(path), "ok")
    assert model_item.num_bytes > sum(np.asarray(v).nbytes for v in state(hf_model("llama")).values())
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert str(cache_root) in out and "converted models: 1" in out and os.path.realpath(path) in out
    assert "unfinished writes: 1" in out and "XLA compilation cache: 0.0 MB" in out
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert [i.state for i in cache.list_cache() if i.kind == "model"] == ["stale (source changed)"]
    assert main(["cache", "clear"]) == 0
    assert "removed 3 items" in capsys.readouterr().out
    assert entries(cache_root) == ["notes.txt"]


def test_cache_dir_default_and_override(monkeypatch, tmp_path):
    monkeypatch.delenv("PAXPAGE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == str(tmp_path / "xdg" / "paxpage")
    monkeypatch.setenv("PAXPAGE_CACHE_DIR", str(tmp_path / "mine"))
    assert cache.cache_dir() == str(tmp_path / "mine")


@pytest.mark.slow
def test_default_model_twice_one_entry_and_truncation_rebuilt(default_model_cache, conversions, monkeypatch):
    """The default model in the test run's private cache (shared with the README test): a second load
    adds no entry, and a truncated tokenizer file is caught and rebuilt."""
    monkeypatch.setenv("PAXPAGE_CACHE_DIR", str(default_model_cache))
    root = default_model_cache
    _, params, tok = load_model(quantization="gguf")  # the entry's own form
    _, params2, tok2 = load_model(quantization="gguf")
    entry_names = [n for n in entries(root) if n.startswith("gguf-")]
    assert len(entry_names) == 1 and len(conversions) <= 1
    assert not [n for n in entries(root) if n.startswith((".building-", ".stale-"))]
    f = root / entry_names[0] / "tokenizer.json"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    n_before = len(conversions)
    _, params3, tok3 = load_model(quantization="gguf")
    assert len(conversions) == n_before + 1  # detected and converted again
    assert [n for n in entries(root) if n.startswith("gguf-")] == entry_names
    text = "What is the capital of France? <|im_start|>ünïcödé"
    assert tok3.encode(text) == tok.encode(text) == tok2.encode(text)
    for a, b in ((params, params2), (params, params3)):
        for leaf in ("kernel_q", "kernel_scale", "kernel_offset"):  # the GGUF-native Q4_1 form
            np.testing.assert_array_equal(np.asarray(a["layers_3"]["v_proj"][leaf]),
                                          np.asarray(b["layers_3"]["v_proj"][leaf]))
