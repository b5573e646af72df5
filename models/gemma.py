"""Functional Flax model for the Gemma family (Gemma 2, Gemma 3 text).

`GemmaModel(cfg, attention, write_kv).apply({"params": params}, batch, kv_cache)` has the same
contract as `LlamaModel`: same batch, same page tables and pool, (logits, new cache) back.

What Gemma does differently from Llama (each checked against HF transformers):
- RMSNorm scales by (1 + w); every block is "sandwiched": norms before and after both the
  attention and the MLP (input / post_attention / pre_feedforward / post_feedforward).
- Embeddings are multiplied by sqrt(hidden) (rounded to the model dtype, as HF does).
- MLP gate is GELU with the tanh approximation.
- Softmax scale is query_pre_attn_scalar ** -0.5; Gemma 2 soft-caps attention scores (50) and
  both soft-cap the final logits (30): x -> c * tanh(x / c).
- Layers alternate local (sliding window) and global attention (`cfg.layer_types`); Gemma 3
  rotates local layers with their own RoPE base (`cfg.local_rope_theta`, unscaled) and
  normalises q and k per head (qk-norm) before RoPE.

Axis legend: T flat tokens in the step, H hidden, N query heads, K kv heads, D head dim,
F MLP width, V vocabulary, R logits rows.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.config import ModelConfig, RopeScaling
from models.layers import Embedding, MatmulStep, RMSNorm, dense, gated_mlp, paged_attention_rows, qkv_heads, sow_pooled
from models.layer_stack import run_layers
from models.lora_ops import row_slots
from models.llama import AttentionFn, WriteKvFn
from models.rope import apply_rope, attention_factor, inverse_frequencies


def _norm(cfg: ModelConfig, dtype, name: str, batch_invariant: bool = False) -> RMSNorm:
    return RMSNorm(cfg.rms_norm_eps, dtype, unit_offset=True, batch_invariant=batch_invariant, name=name)


def _layer_rope(cfg: ModelConfig, window: int | None):
    """(inv_freq, cos / sin scale): Gemma 3's local layers use their own unscaled RoPE base; all
    other layers the global one."""
    if window is not None and cfg.local_rope_theta is not None:
        cfg = dataclasses.replace(cfg, rope_theta=cfg.local_rope_theta, rope_scaling=RopeScaling())
    return inverse_frequencies(cfg), attention_factor(cfg)


class GemmaDecoderLayer(nn.Module):
    cfg: ModelConfig
    attention: AttentionFn
    write_kv: WriteKvFn
    dtype: Any = jnp.float32
    sliding_window: int | None = None  # local layers' window; None = global layer
    lora_impl: str = "xla"  # models/lora_ops.LORA_IMPLS: how the LoRA delta runs
    matmul_impl: str = "xla"  # models/layers.MATMUL_IMPLS: how the dense layers' matmuls run
    batch_invariant: bool = False  # row results independent of the step's other rows

    @nn.compact
    def __call__(self, x, batch, kv_pages):  # x: [T, H]; kv_pages: [2, P, page_size, K, D]
        cfg, dtype, inv = self.cfg, self.dtype, self.batch_invariant
        num_tokens = x.shape[0]
        lora = row_slots(batch, self.lora_impl)  # each row's adapter slot, or None without LoRA
        h = _norm(cfg, dtype, "input_layernorm", inv)(x)
        mm = self.matmul_impl
        step = MatmulStep.of(batch)  # the native matmuls skip padding, read a scanned group's panels
        q, k, v = qkv_heads(cfg, h, dtype, inv, lora, mm, step)  # [T, N, D], [T, K, D] x 2
        if cfg.qk_norm:  # Gemma 3
            q = _norm(cfg, dtype, "q_norm", inv)(q)
            k = _norm(cfg, dtype, "k_norm", inv)(k)
        inv_freq, scale = _layer_rope(cfg, self.sliding_window)
        q = apply_rope(q, batch.positions, inv_freq, scale).astype(dtype)
        k = apply_rope(k, batch.positions, inv_freq, scale).astype(dtype)
        kv_pages = self.write_kv(kv_pages, k, v, batch.slot_mapping)
        out = paged_attention_rows(self.attention, q, kv_pages, batch, cfg.sm_scale,
                                   sliding_window=self.sliding_window, soft_cap=cfg.attn_logit_softcap)
        out = out.reshape(num_tokens, cfg.num_heads * cfg.head_dim).astype(dtype)
        out = dense(cfg.hidden_size, "o_proj", dtype, batch_invariant=inv, matmul_impl=mm)(out, lora, step)
        x = x + _norm(cfg, dtype, "post_attention_layernorm", inv)(out)
        h = _norm(cfg, dtype, "pre_feedforward_layernorm", inv)(x)
        mlp = gated_mlp(cfg, h, functools.partial(jax.nn.gelu, approximate=True), dtype, inv, lora, mm, step)
        x = x + _norm(cfg, dtype, "post_feedforward_layernorm", inv)(mlp)
        return x, kv_pages


class GemmaModel(nn.Module):
    cfg: ModelConfig
    attention: AttentionFn
    write_kv: WriteKvFn
    dtype: Any = jnp.float32
    # > 0: the layers run as a scan over groups of this many, one period of the local/global
    # pattern (models/layer_stack.py); params and kv_cache are then stacked.
    scan_period: int = 0
    lora_impl: str = "xla"  # models/lora_ops.LORA_IMPLS: how the LoRA delta runs
    matmul_impl: str = "xla"  # models/layers.MATMUL_IMPLS: how the dense layers' matmuls run
    batch_invariant: bool = False  # EngineConfig.batch_invariant (models/invariant_ops.py)

    @nn.compact
    def __call__(self, batch, kv_cache):
        """Returns (logits f32[R + Rp, V], updated kv_cache): the sampling rows, then the
        prompt-logprob rows. kv_cache: one pool per layer, or the stacked pool when scanning."""
        cfg, inv = self.cfg, self.batch_invariant
        embed = Embedding(cfg.vocab_size, cfg.hidden_size, self.dtype, batch_invariant=inv,
                          matmul_impl=self.matmul_impl, name="embed_tokens")
        x = embed(batch.token_ids) * jnp.asarray(math.sqrt(cfg.hidden_size), self.dtype)  # [T, H]

        def make_layer(i: int, name: str) -> GemmaDecoderLayer:
            return GemmaDecoderLayer(cfg, self.attention, self.write_kv, self.dtype, cfg.layer_window(i),
                                     self.lora_impl, self.matmul_impl, inv, name=name)

        x, new_cache = run_layers(make_layer, cfg.num_layers, self.scan_period, x, batch, kv_cache)
        rows = jnp.concatenate([batch.logits_indices, batch.prompt_logits_indices])
        norm = _norm(cfg, self.dtype, "norm", inv)
        sow_pooled(self, norm, x, batch)
        x = norm(x[rows])  # [R + Rp, H]
        if cfg.tie_word_embeddings:
            logits = embed.attend(x)
        else:
            logits = dense(cfg.vocab_size, "lm_head", self.dtype, batch_invariant=inv, matmul_impl=self.matmul_impl)(x)
        logits = logits.astype(jnp.float32)
        if cfg.final_logit_softcap is not None:
            logits = cfg.final_logit_softcap * jnp.tanh(logits / cfg.final_logit_softcap)
        return logits, new_cache
