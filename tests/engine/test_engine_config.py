"""EngineConfig / ResolvedConfig: copying, pickling, and the KV pool size they resolve to."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

from models.config import ModelConfig
from paxpage import kv_sizing
from paxpage.config import EngineConfig
from paxpage.kv_sizing import MemoryBudget, num_pages_from_memory

TINY = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, max_position_embeddings=256)


def test_resolved_config_copies_and_pickles():
    # __getattr__ forwards to .engine; copy / pickle probe attributes before .engine exists.
    resolved = EngineConfig(page_size=8, num_pages=40).resolve(TINY)
    for clone in (copy.copy(resolved), copy.deepcopy(resolved), pickle.loads(pickle.dumps(resolved))):
        assert clone == resolved
        assert clone.page_size == 8 and clone.num_pages == 40 and clone.max_num_seqs == 64


GIB = 1 << 30


def test_num_pages_from_memory_hand_computed():
    # 0.9 x 80 GiB = 72 GiB; 2 GiB in use, a 1 GiB step: 69 GiB of 1 MiB pages
    budget = MemoryBudget(bytes_limit=80 * GIB, bytes_in_use=2 * GIB, step_bytes=GIB, utilization=0.9)
    assert num_pages_from_memory(budget, 1 << 20) == 69 * 1024
    assert num_pages_from_memory(dataclasses.replace(budget, utilization=1.0), 3 << 20) == 77 * 1024 // 3
    full = MemoryBudget(bytes_limit=10 * GIB, bytes_in_use=8 * GIB, step_bytes=GIB, utilization=0.9)
    with pytest.raises(ValueError, match="gpu_memory_utilization 0.9 of 10.00 GiB.*8.00 GiB are in use"):
        num_pages_from_memory(full, 1 << 20)


@pytest.mark.parametrize("bad", [0, 0.0, 1.5, -0.1, True, "0.9", float("nan")])
def test_gpu_memory_utilization_validated(bad):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be a number in \\(0, 1\\]"):
        EngineConfig(gpu_memory_utilization=bad)


def test_pool_size_sources():
    page_bytes = 2 * TINY.num_layers * 16 * TINY.num_kv_heads * TINY.head_dim * 4  # f32, 16-token pages
    cpu = EngineConfig().resolve(TINY, backend="cpu")
    assert (cpu.num_pages, cpu.kv_source) == ((1 << 30) // page_bytes, "fixed default on CPU")
    gpu = EngineConfig(dtype="float32").resolve(TINY, backend="gpu")
    assert (gpu.num_pages, gpu.kv_source) == (None, "device memory")  # the runner sizes it
    for backend in ("cpu", "gpu"):
        given = EngineConfig(dtype="float32", kv_cache_bytes=100 * page_bytes + 1).resolve(TINY, backend=backend)
        assert (given.num_pages, given.kv_source) == (100, "kv_cache_bytes")
        assert EngineConfig(num_pages=7).resolve(TINY, backend=backend).num_pages == 7


@pytest.fixture(scope="module")
def tiny_params(tiny_llama_dir):
    from models.loading import load_model

    return load_model(tiny_llama_dir)[:2]


def test_runner_sizes_pool_from_device_memory(tiny_params, monkeypatch):
    from paxpage.runner import ModelRunner

    cfg, params = tiny_params
    mib = 1 << 20  # small made-up figures: the pool is really allocated (on CPU)
    monkeypatch.setattr(kv_sizing, "device_memory_stats", lambda device=None: {
        "bytes_limit": 128 * mib, "bytes_in_use": 16 * mib, "peak_bytes_in_use": 16 * mib})
    resolved = EngineConfig(page_size=8, dtype="float32", attention_impl="xla", max_num_seqs=8,
                            max_num_batched_tokens=64).resolve(cfg, backend="gpu")
    runner = ModelRunner(cfg, params, resolved)
    step = runner.memory_budget.step_bytes
    # the step's outputs alone hold f32 logits for up to 64 rows x the vocabulary
    assert step >= 64 * cfg.vocab_size * 4
    assert runner.cfg.num_pages == (int(128 * mib * 0.9) - 16 * mib - step) // resolved.page_bytes > 1000
    assert runner.kv_cache[0].shape[1] == runner.cfg.num_pages
    monkeypatch.setattr(kv_sizing, "device_memory_stats", lambda device=None: None)
    monkeypatch.setattr(kv_sizing, "DEFAULT_KV_CACHE_BYTES", 4 * mib)
    runner = ModelRunner(cfg, params, resolved)  # no statistics: the fixed default
    assert runner.cfg.num_pages == 4 * mib // resolved.page_bytes
