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
from paxpage.runner import ModelRunner

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
    import jax

    cfg, params = tiny_params
    mib = 1 << 20  # small made-up figures: the pool is really allocated (on CPU)
    monkeypatch.setenv(kv_sizing.CLIENT_FRACTION_ENV, "1.0")  # jax may use the whole (made-up) device
    # Sized without compiling a step (kv_sizing.step_bytes_bound)
    monkeypatch.setattr(ModelRunner, "lower_step", lambda *a, **k: pytest.fail("sizing compiled a step"))
    monkeypatch.setattr(kv_sizing, "device_memory_stats", lambda device=None: {
        "bytes_limit": 128 * mib, "bytes_in_use": 16 * mib, "peak_bytes_in_use": 16 * mib})
    resolved = EngineConfig(page_size=8, dtype="float32", attention_impl="xla", max_num_seqs=8,
                            max_num_batched_tokens=64).resolve(cfg, backend="gpu")
    runner = ModelRunner(cfg, params, resolved)
    step = runner.memory_budget.step_bytes
    # the step's outputs alone hold f32 logits for up to 64 rows x the vocabulary
    assert step >= 64 * cfg.vocab_size * 4
    assert runner.cfg.num_pages == (int(128 * mib * 0.9) - 16 * mib - step) // resolved.page_bytes > 1000
    page_axis = 2 if runner.scanned else 1  # [2, L, P, ...] stacked (scanned layers) or [2, P, ...]
    assert jax.tree.leaves(runner.kv_cache)[0].shape[page_axis] == runner.cfg.num_pages
    # An int8 cache: the step is measured against a quantised pool, and pages are smaller.
    quant = dataclasses.replace(resolved, engine=dataclasses.replace(resolved.engine, kv_cache_dtype="int8"),
                                page_bytes=2 * cfg.num_layers * 8 * cfg.num_kv_heads * (cfg.head_dim + 4))
    runner_q = ModelRunner(cfg, params, quant)
    step_q = runner_q.memory_budget.step_bytes
    assert runner_q.cfg.num_pages == (int(128 * mib * 0.9) - 16 * mib - step_q) // quant.page_bytes
    assert jax.tree.leaves(runner_q.kv_cache)[1].shape[page_axis] == runner_q.cfg.num_pages  # the scales
    monkeypatch.setattr(kv_sizing, "device_memory_stats", lambda device=None: None)
    monkeypatch.setattr(kv_sizing, "DEFAULT_KV_CACHE_BYTES", 4 * mib)
    runner = ModelRunner(cfg, params, resolved)  # no statistics: the fixed default
    assert runner.cfg.num_pages == 4 * mib // resolved.page_bytes


def test_gpu_memory_utilization_is_a_share_of_the_whole_device():
    # jax's GPU client may use 0.75 of an 80 GiB device unless told otherwise: 60 GiB
    assert kv_sizing.device_bytes(60 * GIB, "gpu", {}) == 80 * GIB
    assert kv_sizing.device_bytes(72 * GIB, "gpu", {kv_sizing.CLIENT_FRACTION_ENV: "0.9"}) == 80 * GIB
    assert kv_sizing.device_bytes(60 * GIB, "gpu", {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}) == 60 * GIB
    assert kv_sizing.device_bytes(16 * GIB, "tpu", {}) == 16 * GIB  # a TPU's limit is its HBM
    # 0.9 of 80 GiB is 72, but jax's allocator stops at 60: 60 - 2 - 1 GiB of pages
    capped = MemoryBudget(bytes_limit=60 * GIB, bytes_in_use=2 * GIB, step_bytes=GIB, utilization=0.9,
                          device_bytes=80 * GIB)
    assert num_pages_from_memory(capped, 1 << 20) == 57 * 1024
    # with the client's fraction claimed (paxpage generate / serve): 72 - 2 - 1
    claimed = dataclasses.replace(capped, bytes_limit=72 * GIB)
    assert num_pages_from_memory(claimed, 1 << 20) == 69 * 1024
    env = {}
    assert kv_sizing.claim_client_memory(0.9, env) and env == {kv_sizing.CLIENT_FRACTION_ENV: "0.9"}
    user = {kv_sizing.CLIENT_FRACTION_ENV: "0.5"}
    assert not kv_sizing.claim_client_memory(0.9, user) and user[kv_sizing.CLIENT_FRACTION_ENV] == "0.5"


def test_step_defaults_per_backend():
    from paxpage.config import BACKEND_DEFAULTS

    cpu, gpu, tpu = (EngineConfig().resolve(TINY, backend=b) for b in ("cpu", "gpu", "tpu"))
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens, cpu.prefill_row_len, cpu.precompile) == (64, 512, 32, False)
    assert (gpu.max_num_seqs, gpu.max_num_batched_tokens, gpu.prefill_row_len, gpu.precompile) == (256, 2048, 64, False)
    assert (tpu.max_num_seqs, tpu.max_num_batched_tokens, tpu.prefill_row_len, tpu.precompile) == (256, 2048, 64, True)
    assert cpu.prefill_rows == 512 // 32 and gpu.prefill_rows == 2048 // 64
    # scan_layers="auto": the Pallas kernels scan on GPU only (TINY's layers repeat: period 1)
    assert (cpu.scan_period, gpu.scan_period, tpu.scan_period) == (1, 1, 0)
    assert EngineConfig(attention_impl="pallas").resolve(TINY, backend="cpu").scan_period == 0
    given = EngineConfig(max_num_seqs=8, max_num_batched_tokens=96, prefill_row_len=16, precompile=False)
    for backend in BACKEND_DEFAULTS:
        r = given.resolve(TINY, backend=backend)
        assert (r.max_num_seqs, r.max_num_batched_tokens, r.prefill_row_len, r.precompile) == (8, 96, 16, False)
    with pytest.raises(ValueError, match="max_num_seqs must be a positive int or None, got 0"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(TypeError, match="precompile must be a bool or None, got 1"):
        EngineConfig(precompile=1)


def test_docs_table_of_backend_defaults():
    """docs/engine-options.md's table lists BACKEND_DEFAULTS as they are."""
    import os
    import re

    from paxpage.config import BACKEND_DEFAULTS

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    text = open(os.path.join(root, "docs", "engine-options.md")).read()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] in {f.name for f in dataclasses.fields(BACKEND_DEFAULTS["cpu"])}:
            rows[cells[0]] = cells[1:]
    assert set(rows) == {f.name for f in dataclasses.fields(BACKEND_DEFAULTS["cpu"])}, rows
    for i, backend in enumerate(("cpu", "gpu", "tpu")):
        for name, cells in rows.items():
            assert cells[i] == str(getattr(BACKEND_DEFAULTS[backend], name)), (backend, name, cells[i])
    assert re.search(r"BACKEND_DEFAULTS", text)


def test_attention_impl_defaults_and_native_is_cpu_only():
    assert EngineConfig().resolve(TINY, backend="cpu").attention_impl == "native"
    assert EngineConfig().resolve(TINY, backend="gpu").attention_impl == "pallas"
    assert EngineConfig(attention_impl="native").resolve(TINY, backend="cpu").scan_period == 1  # scanned, as "xla"
    with pytest.raises(ValueError, match="attention_impl='native' is a CPU kernel, but the backend is 'gpu'"):
        EngineConfig(attention_impl="native").resolve(TINY, backend="gpu")


def test_kv_cache_dtype_validated():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of \\('auto', 'int8', 'fp8'\\), got 'int4'"):
        EngineConfig(kv_cache_dtype="int4")


def test_quantized_pool_holds_more_tokens_at_one_budget():
    # SmolLM2-135M's KV shape: 30 layers, 3 kv heads of 64. A 16-token page per (K or V, layer,
    # kv head): f32 16 * 64 * 4 = 4096 bytes, bf16 2048, int8 / fp8 16 * (64 + 2-byte bf16 scale) = 1056
    # (the native kernel, the CPU default, reads bf16 scales; the XLA-ops path's pool holds them
    # in f32, kv_layout.XLA_CANONICAL: 1088).
    smollm2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                          num_kv_heads=3, head_dim=64, max_position_embeddings=8192)
    per_page = {"float32": 4096, "bfloat16": 2048, "int8": 1056, "fp8": 1056}
    budget = 1 << 30
    pages = {}
    for name, want in per_page.items():
        dtype, kv = (name, "auto") if name in ("float32", "bfloat16") else ("bfloat16", name)
        resolved = EngineConfig(dtype=dtype, kv_cache_dtype=kv, kv_cache_bytes=budget).resolve(smollm2, backend="cpu")
        assert resolved.page_bytes == 2 * 30 * 3 * want
        pages[name] = resolved.num_pages
    assert pages["int8"] == pages["fp8"] == budget // (180 * 1056) == 5648
    assert pages["bfloat16"] == budget // (180 * 2048) == 2912
    # 2x bf16's tokens and 4x f32's, less the scales' 2 bytes per 64 values (1/33): 1.94x bf16's.
    assert pages["int8"] / pages["bfloat16"] == pytest.approx(2 * 64 / 66, rel=1e-3)
    assert pages["int8"] / pages["float32"] == pytest.approx(4 * 64 / 66, rel=1e-3)
    xla = EngineConfig(dtype="bfloat16", kv_cache_dtype="int8", kv_cache_bytes=budget,
                       attention_impl="xla").resolve(smollm2, backend="cpu")
    assert xla.page_bytes == 2 * 30 * 3 * 1088


def test_tpu_pool_sizing_counts_the_packed_scale_rows_it_allocates(tiny_params):
    """On TPU the pool is in the TPU kernels' layout, whose scales are bf16 pairs packed in 32-bit
    lanes: the bytes a page is charged are the bytes the pool's arrays hold (16 pages: one whole
    scale row at page_size 8), as many as the canonical pool's bf16 scales."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import kv_layout
    from paxpage.kv_pool import KVPoolSpec

    cfg, _ = tiny_params
    for kv in ("auto", "int8"):
        resolved = EngineConfig(page_size=8, num_pages=16, kv_cache_dtype=kv, attention_impl="pallas",
                                scan_layers=False).resolve(cfg, backend="tpu")
        pool = KVPoolSpec(cfg, 8, kv, jnp.bfloat16, kv_layout.TPU, False).abstract(16)
        held = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(pool))
        assert held == 16 * resolved.page_bytes, kv
    canonical = EngineConfig(page_size=8, num_pages=16, kv_cache_dtype="int8", dtype="bfloat16").resolve(cfg, backend="cpu")
    # per (token, kv head, K or V): one bf16 scale, in the native kernel's pool and on TPU
    assert resolved.page_bytes == canonical.page_bytes
    f32_scales = EngineConfig(page_size=8, num_pages=16, kv_cache_dtype="int8", dtype="bfloat16",
                              attention_impl="xla").resolve(cfg, backend="cpu")
    # the XLA-ops path's pool: one f32 scale, 2 bytes more
    assert f32_scales.page_bytes - canonical.page_bytes == 2 * cfg.num_layers * 8 * cfg.num_kv_heads * 2


@pytest.mark.parametrize("scan_layers", [False, True])
def test_runner_builds_and_copies_a_quantized_pool(tiny_params, scan_layers):
    """Per-layer caches or the scanned layers' one stacked cache [2, L, P, ...]: fp8 pages with
    bf16 scales (the native kernel's pool), and a page copy moves a page's scales with its values in every layer."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.kv_quant import QuantizedKV
    from paxpage.runner import ModelRunner

    cfg, params = tiny_params
    resolved = EngineConfig(page_size=8, num_pages=6, dtype="float32", kv_cache_dtype="fp8", scan_layers=scan_layers,
                            max_num_seqs=4, max_num_batched_tokens=32).resolve(cfg, backend="cpu")
    runner = ModelRunner(cfg, params, resolved)
    assert runner.scanned == scan_layers
    caches = [runner.kv_cache] if scan_layers else runner.kv_cache
    lead = (2, cfg.num_layers) if scan_layers else (2,)
    assert len(caches) == (1 if scan_layers else cfg.num_layers)
    for layer in caches:
        assert isinstance(layer, QuantizedKV)
        assert layer.pages.shape == (*lead, 6, 8, cfg.num_kv_heads, cfg.head_dim)
        assert layer.pages.dtype == jnp.float8_e4m3fn
        assert layer.scales.shape == (*lead, 6, 8, cfg.num_kv_heads) and layer.scales.dtype == jnp.bfloat16
    leaves, tree = jax.tree.flatten(runner.kv_cache)
    filled = [jnp.asarray(np.arange(x.size).reshape(x.shape) % 7, x.dtype) for x in leaves]
    runner.kv_cache = jax.tree.unflatten(tree, filled)
    before = [np.array(x, np.float32) for x in filled]
    runner.copy_pages([(1, 4), (2, 0)])  # copy-on-write moves a page's scales with its values
    page_axis = len(lead)
    for want, got in zip(before, jax.tree.leaves(runner.kv_cache)):
        view = np.moveaxis(want, page_axis, 0)  # a view: assignments land in `want`
        for src, dst in ((1, 4), (2, 0)):
            view[dst] = view[src]
        np.testing.assert_array_equal(np.asarray(got, np.float32), want)


SMOL2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=2, num_heads=9,
                    num_kv_heads=3, head_dim=64, tie_word_embeddings=True, max_position_embeddings=8192)
SMOL2_MOE = dataclasses.replace(SMOL2, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=256)
# DeepSeek-V3's attention and routing at a tenth of its widths, two layers (one dense)
LATENT = ModelConfig.from_hf_dict(dict(
    model_type="deepseek_v3", vocab_size=32000, hidden_size=704, intermediate_size=1856, moe_intermediate_size=192,
    num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=64, q_lora_rank=160,
    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, first_k_dense_replace=1, n_routed_experts=16, n_group=4,
    topk_group=2, num_experts_per_tok=4, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False))


@pytest.mark.parametrize("model,engine", [
    (SMOL2, dict()),
    (SMOL2, dict(max_num_seqs=256, max_num_batched_tokens=2048, prefill_row_len=64)),
    (SMOL2, dict(max_num_seqs=8, max_num_batched_tokens=64, prefill_row_len=16, attention_impl="xla")),
    (SMOL2_MOE, dict()),
    (SMOL2_MOE, dict(max_num_seqs=8, max_num_batched_tokens=64, prefill_row_len=16)),
    (LATENT, dict()),
    (LATENT, dict(max_num_seqs=8, max_num_batched_tokens=512, prefill_row_len=128)),  # expanded prefill rows
], ids=["smollm2-2l", "smollm2-2l-wide", "smollm2-2l-small-xla", "moe-2l", "moe-2l-small", "latent-2l",
        "latent-2l-expanded"])
def test_step_bytes_bound_holds_the_compiled_step(model, engine):
    """The bound the pool is sized against on GPU / TPU, against what XLA allocates for the
    largest step (its compiled memory analysis, here on CPU in f32; the TPU compile check
    makes the same comparison for bf16 at real shapes): above it, and not far above it."""
    import jax
    import jax.numpy as jnp

    from models.param_layout import param_shapes

    resolved = EngineConfig(num_pages=256, dtype="float32", **engine).resolve(model, backend="cpu")
    params = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32), param_shapes(model),
                          is_leaf=lambda x: isinstance(x, tuple))
    runner = ModelRunner(model, params, resolved, None, abstract=True)
    bound, compiled = runner.step_bytes_bound(), runner.step_memory_bytes()
    # (at these small widths one layer's weights, counted as if copied, are much of the bound)
    assert compiled < bound < 3.5 * compiled, (bound, compiled)
