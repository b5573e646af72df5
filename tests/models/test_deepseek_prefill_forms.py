"""DeepSeek-V3's two prefill forms in a compiled step: a long prefill row runs the expanded form
(per-head keys and values from kv_b_proj), which XLA's cost analysis counts at well below the
absorbed form's FLOPs at DeepSeek-V3's width ratios; both forms' steps give the same logits."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models.families
from models.config import ModelConfig
from models.deepseek import DeepseekModel, prefill_uses_expanded
from models.param_layout import param_shapes
from paxpage.config import EngineConfig
from paxpage.runner import ModelRunner

# DeepSeek-V3's attention at half its widths (kv_lora_rank 256, RoPE 32, nope 64, v 64), small elsewhere
HALF_V3 = ModelConfig.from_hf_dict(dict(
    model_type="deepseek_v3", vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=256, q_lora_rank=64,
    qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, first_k_dense_replace=1, n_routed_experts=4,
    n_group=2, topk_group=1, num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.5,
    norm_topk_prob=True, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
    tie_word_embeddings=False))
ROW = 256  # one prefill row of 256 tokens


def _runner(monkeypatch, form, params=None):
    monkeypatch.setattr(models.families, "DeepseekModel", functools.partial(DeepseekModel, prefill_form=form))
    resolved = EngineConfig(num_pages=64, page_size=16, dtype="float32", attention_impl="xla", max_num_seqs=4,
                            max_num_batched_tokens=ROW, prefill_row_len=ROW, precompile=False,
                            max_model_len=512).resolve(HALF_V3, backend="cpu")
    if params is None:
        params = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32), param_shapes(HALF_V3),
                              is_leaf=lambda x: isinstance(x, tuple))
        return ModelRunner(HALF_V3, params, resolved, None, abstract=True)
    return ModelRunner(HALF_V3, params, resolved)


def _flops(compiled) -> float:
    cost = compiled.cost_analysis()
    return (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]


def test_long_prefill_runs_the_expanded_form(monkeypatch):
    assert prefill_uses_expanded(HALF_V3, ROW) and not prefill_uses_expanded(HALF_V3, 32)
    flops = {form: _flops(_runner(monkeypatch, form).lower_step(1, 1).compile())
             for form in ("auto", "expanded", "absorbed")}
    print(f"step of one decode row and one {ROW}-token prefill row, GFLOP: "
          + ", ".join(f"{form} {f / 1e9:.3f}" for form, f in flops.items()))
    assert flops["auto"] == flops["expanded"]
    assert flops["expanded"] < 0.6 * flops["absorbed"], flops


def _batch(dec, pre, row_len, pages_per_seq=4, page_size=8):
    """A StepBatch from (page table, kv_len) decode rows and (page table, kv_len, q_len) prefill rows,
    every token's logits returned."""
    tokens, positions, slots = [], [], []
    for table, kv_len in dec:
        tokens.append(kv_len % 97)
        positions.append(kv_len - 1)
        slots.append(table[(kv_len - 1) // page_size] * page_size + (kv_len - 1) % page_size)
    for table, kv_len, q_len in pre:
        for i in range(row_len):
            pos = kv_len - q_len + i
            real = i < q_len
            tokens.append((pos * 31 + 7) % 512 if real else 0)
            positions.append(pos if real else 0)
            slots.append(table[pos // page_size] * page_size + pos % page_size if real else -1)

    def tables(rows):
        return np.array([list(r[0]) + [0] * (pages_per_seq - len(r[0])) for r in rows], np.int32).reshape(
            len(rows), pages_per_seq)

    from paxpage.batch import StepBatch

    n = len(tokens)
    return StepBatch(np.array(tokens, np.int32), np.array(positions, np.int32), np.array(slots, np.int32),
                     tables(dec), np.array([r[1] for r in dec], np.int32), tables(pre),
                     np.array([r[1] for r in pre], np.int32), np.array([r[2] for r in pre], np.int32),
                     np.arange(n, dtype=np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32))


@pytest.mark.extended  # the kernel test compares the two forms; the HF test runs the expanded one
def test_expanded_and_absorbed_steps_agree():
    """The same two steps in both forms: two prompts prefilled, then a chunk of the first prompt
    (its earlier keys in the pool) beside the second's decode row. Logits and pools agree to f32
    rounding."""
    from models.random_init import random_params
    from pallas_kernels.latent_attention import latent_attention_xla, write_latent

    params = random_params(HALF_V3, "float32", seed=0)
    width = HALF_V3.kv_lora_rank + HALF_V3.qk_rope_head_dim
    pool = [jnp.zeros((1, 16, 8, 1, width), jnp.float32) for _ in range(HALF_V3.num_layers)]
    first = _batch([], [((0, 1), 16, 16), ((4,), 7, 7)], row_len=16)
    second = _batch([((4,), 8)], [((0, 1, 2), 24, 8), ((5,), 0, 0)], row_len=8)
    results = {}
    for form in ("expanded", "absorbed"):
        model = DeepseekModel(HALF_V3, latent_attention_xla, write_latent, prefill_form=form)
        step = jax.jit(lambda p, b, c: model.apply({"params": p}, b, c))
        logits_a, cache = step(params, first, pool)
        logits_b, cache = step(params, second, cache)
        results[form] = [np.asarray(x) for x in (logits_a, logits_b, *cache)]
    for got, want in zip(results["expanded"], results["absorbed"]):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert np.isfinite(results["expanded"][1]).all()
