"""Pieces every model family shares: RMSNorm, dense layers, and paged attention over the step's rows.

Axis legend: T flat tokens in the step, N query heads, K kv heads, D head dim, H hidden.
The step's tokens are Bd decode rows of one token followed by Bp prefill rows of Tq tokens
(see paxpage.batch.StepBatch).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


class RMSNorm(nn.Module):
    eps: float
    dtype: Any = jnp.float32
    # Gemma stores w and scales by (1 + w) (its weights start at 0); Llama stores the scale itself.
    unit_offset: bool = False

    @nn.compact
    def __call__(self, x):  # [..., H]
        init = nn.initializers.zeros if self.unit_offset else nn.initializers.ones
        scale = self.param("scale", init, (x.shape[-1],), self.dtype).astype(jnp.float32)
        if self.unit_offset:
            scale = 1.0 + scale
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * scale).astype(self.dtype)


def dense(features: int, name: str, dtype, use_bias: bool = False) -> nn.Dense:
    return nn.Dense(features, use_bias=use_bias, dtype=dtype, param_dtype=dtype, name=name)


def qkv_heads(cfg, h, dtype):
    """The attention's input projections of h [T, H] (q_proj, k_proj, v_proj; `cfg` a
    ModelConfig): q [T, N, D], k and v [T, K, D]. Call inside a module's compact method."""
    num_tokens = h.shape[0]
    q = dense(cfg.num_heads * cfg.head_dim, "q_proj", dtype, cfg.qkv_bias)(h)
    k = dense(cfg.num_kv_heads * cfg.head_dim, "k_proj", dtype, cfg.qkv_bias)(h)
    v = dense(cfg.num_kv_heads * cfg.head_dim, "v_proj", dtype, cfg.qkv_bias)(h)
    return (q.reshape(num_tokens, cfg.num_heads, cfg.head_dim),
            k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim),
            v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim))


def gated_mlp(cfg, h, activation, dtype):
    """down_proj(activation(gate_proj(h)) * up_proj(h)): h [T, H] -> [T, H] through width
    F = cfg.intermediate_size (Llama: silu; Gemma: gelu-tanh). Call inside a compact method."""
    gate = dense(cfg.intermediate_size, "gate_proj", dtype)(h)
    up = dense(cfg.intermediate_size, "up_proj", dtype)(h)
    return dense(cfg.hidden_size, "down_proj", dtype)(activation(gate) * up)


def paged_attention_rows(attention, q, kv_pages, batch, sm_scale, *, sliding_window=None, soft_cap=None):
    """Splits the flat tokens q [T, N, D] into the decode and prefill row groups and attends each.

    The window and cap reach the attention function only when set, so a plain causal layer traces
    exactly the attention it always did."""
    masking = {}
    if sliding_window is not None:
        masking["sliding_window"] = sliding_window
    if soft_cap is not None:
        masking["soft_cap"] = soft_cap
    num_decode = batch.num_decode_rows
    num_prefill = batch.num_prefill_rows
    outs = []
    if num_decode:
        q_dec = q[:num_decode][:, None]  # [Bd, 1, N, D]
        dec_q_lens = (batch.dec_kv_lens > 0).astype(jnp.int32)
        out = attention(q_dec, kv_pages, batch.dec_page_indices, batch.dec_kv_lens, dec_q_lens,
                        sm_scale=sm_scale, **masking)
        outs.append(out.reshape(num_decode, *q.shape[1:]))
    if num_prefill:
        q_pre = q[num_decode:].reshape(num_prefill, -1, *q.shape[1:])  # [Bp, Tq, N, D]
        out = attention(q_pre, kv_pages, batch.pre_page_indices, batch.pre_kv_lens,
                        batch.pre_q_lens, sm_scale=sm_scale, **masking)
        outs.append(out.reshape(-1, *q.shape[1:]))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
