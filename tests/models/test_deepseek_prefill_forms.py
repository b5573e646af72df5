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
