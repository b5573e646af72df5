"""Functional Flax model for the Llama family (Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3) and
its mixture-of-experts variants (Qwen3-MoE, Mixtral, gpt-oss), whose MoE layers swap the dense
MLP for models/moe.py's SparseMoe. gpt-oss adds attention sinks (a learned logit per query head
in every softmax), an o_proj bias, and biased experts with the clamped SwiGLU.

Mistral and Qwen2/3 configs with a sliding window pass each layer's window to the attention
(`ModelConfig.layer_window`); shared pieces (RMSNorm, paged attention over rows) are models/layers.py.

`LlamaModel(cfg, attention).apply({"params": params}, batch, kv_cache)` is a pure function:
it writes this step's K/V into their pages, attends over the paged cache, and returns the
logits of the rows named by `batch.logits_indices` together with the updated cache.

Axis legend: T flat tokens in the step, H hidden, N query heads, K kv heads, D head dim,
F MLP width, V vocabulary, R logits rows. The step's tokens are laid out as Bd decode rows
of one token followed by Bp prefill rows of Tq tokens (see paxpage.batch.StepBatch).
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.layers import Embedding, MatmulStep, RMSNorm, gated_mlp, paged_attention_rows, qkv_heads, sow_pooled
from models.layers import dense as _dense
from models.layer_stack import run_layers
from models.lora_ops import row_slots
from models.moe import ExpertsFn, SparseMoe, routed_experts
from models.rope import apply_rope, attention_factor, inverse_frequencies

# attention(q [B, Tq, N, D], kv_pages, page_indices, kv_lens, q_lens, *, sm_scale
#           [, sliding_window, soft_cap, sinks]) -> [B, Tq, N, D]
AttentionFn = Callable[..., jax.Array]
# write_kv(kv_pages, k [T, K, D], v [T, K, D], slot_mapping i32[T]) -> kv_pages
WriteKvFn = Callable[..., jax.Array]


class DecoderLayer(nn.Module):
    cfg: ModelConfig
    attention: AttentionFn
    write_kv: WriteKvFn
    dtype: Any = jnp.float32
    sliding_window: int | None = None  # this layer's window (Mistral; Qwen2/3 sliding layers)
    use_moe: bool = False  # this layer's MLP is a sparse mixture of experts
    moe_impl: str = "auto"  # models/moe.py's grouped-matmul implementation
    batch_invariant: bool = False  # row results independent of the step's other rows
    lora_impl: str = "xla"  # models/lora_ops.LORA_IMPLS: how the LoRA delta runs
    experts_fn: ExpertsFn = routed_experts  # the routed experts (models/moe.py ExpertsFn)
    matmul_impl: str = "xla"  # models/layers.MATMUL_IMPLS: how the dense layers' matmuls run

    @nn.compact
    def __call__(self, x, batch, kv_pages):  # x: [T, H]; kv_pages: [2, P, page_size, K, D]
        cfg, dtype, inv = self.cfg, self.dtype, self.batch_invariant
        num_tokens = x.shape[0]
        lora = row_slots(batch, self.lora_impl)  # each row's adapter slot, or None without LoRA
        h = RMSNorm(cfg.rms_norm_eps, dtype, batch_invariant=inv, name="input_layernorm")(x)
        mm = self.matmul_impl
        step = MatmulStep.of(batch)  # the native matmuls skip padding, read a scanned group's panels
        q, k, v = qkv_heads(cfg, h, dtype, inv, lora, mm, step)  # [T, N, D], [T, K, D], [T, K, D]
        if cfg.qk_norm:
            q = RMSNorm(cfg.rms_norm_eps, dtype, batch_invariant=inv, name="q_norm")(q)
            k = RMSNorm(cfg.rms_norm_eps, dtype, batch_invariant=inv, name="k_norm")(k)
        inv_freq, scale = inverse_frequencies(cfg), attention_factor(cfg)
        q = apply_rope(q, batch.positions, inv_freq, scale).astype(dtype)
        k = apply_rope(k, batch.positions, inv_freq, scale).astype(dtype)
        kv_pages = self.write_kv(kv_pages, k, v, batch.slot_mapping)
        sinks = None
        if cfg.attention_sinks:  # gpt-oss: one learned logit per query head in each softmax
            sinks = self.param("attention_sinks", nn.initializers.zeros, (cfg.num_heads,), dtype)
            sinks = sinks.astype(jnp.float32)
        out = paged_attention_rows(self.attention, q, kv_pages, batch, cfg.head_dim**-0.5,
                                   sliding_window=self.sliding_window, sinks=sinks)
        out = out.reshape(num_tokens, cfg.num_heads * cfg.head_dim).astype(dtype)
        x = x + _dense(cfg.hidden_size, "o_proj", dtype, cfg.o_proj_bias, inv, mm)(out, lora, step)
        h = RMSNorm(cfg.rms_norm_eps, dtype, batch_invariant=inv, name="post_attention_layernorm")(x)
        if self.use_moe:
            moe = SparseMoe(cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                            cfg.norm_topk_prob, self.moe_impl, dtype, cfg.moe_bias, cfg.swiglu_limit,
                            cfg.swiglu_alpha, self.experts_fn, inv, name="moe")
            return x + moe(h), kv_pages
        x = x + gated_mlp(cfg, h, nn.silu, dtype, inv, lora, mm, step)
        return x, kv_pages


class LlamaModel(nn.Module):
    cfg: ModelConfig
    attention: AttentionFn
    write_kv: WriteKvFn
    dtype: Any = jnp.float32
    moe_impl: str = "auto"  # "auto", "ragged_dot", "tiled" or "dense" (models/moe.py)
    # > 0: the layers run as a scan over groups of this many (models/layer_stack.py); the params
    # hold a stacked `layers` subtree and kv_cache is the stacked pool [2, L, P, ...].
    scan_period: int = 0
    batch_invariant: bool = False  # EngineConfig.batch_invariant (models/invariant_ops.py, moe.py's "stable")
    lora_impl: str = "xla"  # models/lora_ops.LORA_IMPLS: how the LoRA delta runs
    experts_fn: ExpertsFn = routed_experts  # the routed experts (models/moe.py ExpertsFn)
    matmul_impl: str = "xla"  # models/layers.MATMUL_IMPLS: how the dense layers' matmuls run

    @nn.compact
    def __call__(self, batch, kv_cache):
        """Returns (logits f32[R + Rp, V], updated kv_cache): the sampling rows, then the
        prompt-logprob rows. kv_cache: one pool per layer, or the stacked pool when scanning."""
        cfg = self.cfg
        inv = self.batch_invariant
        embed = Embedding(cfg.vocab_size, cfg.hidden_size, self.dtype, batch_invariant=inv,
                          matmul_impl=self.matmul_impl, name="embed_tokens")
        x = embed(batch.token_ids)  # [T, H]

        def make_layer(i: int, name: str) -> DecoderLayer:
            return DecoderLayer(cfg, self.attention, self.write_kv, self.dtype, cfg.layer_window(i),
                                cfg.is_moe_layer(i), self.moe_impl, inv, self.lora_impl, self.experts_fn,
                                self.matmul_impl, name=name)

        x, new_cache = run_layers(make_layer, cfg.num_layers, self.scan_period, x, batch, kv_cache)
        # Only the rows that will be sampled pay for the final norm and the LM head.
        rows = jnp.concatenate([batch.logits_indices, batch.prompt_logits_indices])
        norm = RMSNorm(cfg.rms_norm_eps, self.dtype, batch_invariant=inv, name="norm")
        sow_pooled(self, norm, x, batch)
        x = norm(x[rows])  # [R + Rp, H]
        if cfg.tie_word_embeddings:
            logits = embed.attend(x)
        else:
            logits = _dense(cfg.vocab_size, "lm_head", self.dtype, batch_invariant=inv, matmul_impl=self.matmul_impl)(x)
        return logits.astype(jnp.float32), new_cache
