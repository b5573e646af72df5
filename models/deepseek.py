"""Functional Flax model for DeepSeek-V3 and DeepSeek-V2 (HF `DeepseekV3ForCausalLM`,
`DeepseekV2ForCausalLM`): multi-head latent attention (MLA) over a latent KV pool, and a mixture of
experts with shared experts and group-limited routing.

`DeepseekModel(cfg, attention, write_latent).apply({"params": params}, batch, kv_cache)` has the
contract of `LlamaModel`, with `attention` / `write_latent` those of
pallas_kernels/latent_attention.py and each layer's pool the latent pool [1, P, page_size, 1, C].

Attention (HF DeepseekV3Attention, checked against it on the same weights):
- q = q_b_proj(q_a_layernorm(q_a_proj(h))) (or q_proj(h) when q_lora_rank is None), per head
  [q_nope (qk_nope_head_dim) ; q_rope (qk_rope_head_dim)].
- kv_a_proj_with_mqa(h) = [c (kv_lora_rank) ; k_rope (qk_rope_head_dim)]; c is normed
  (kv_a_layernorm); k_rope is one RoPE key shared by every head. HF's two small norms keep
  their default eps 1e-6 whatever rms_norm_eps is.
- RoPE (rope_interleave: on interleaved pairs) with YaRN's cos / sin magnitude. DeepSeek-V2 rotates
  the pairs in place (HF's complex product) where V3 deinterleaves them first: the two differ by
  one fixed permutation of q_rope's and k_rope's dims, which leaves every q.k unchanged. The softmax
  scale is (qk_nope + qk_rope) ** -0.5 times mscale(factor, mscale_all_dim) ** 2 (rope.py).
- The cache holds [c ; k_rope]: C = kv_lora_rank + qk_rope_head_dim values per token and layer.
  kv_b_proj's per-head halves W_UK [C_r, N, qk_nope] and W_UV [C_r, N, v] are absorbed for decode
  rows: the query becomes [q_nope W_UK ; q_rope] in latent space, scores are taken against the
  cached latents, and the latent-space output goes through W_UV, then o_proj. Prefill rows wide
  enough (latent_attention.prefill_uses_expanded, decided from the step's shapes when it is
  traced) run HF's expanded form instead: the row's cached latents become per-head keys and
  values through kv_b_proj, a chunk of pages at a time, and attention has head dims
  qk_nope + qk_rope and v rather than kv_lora_rank + qk_rope (both equal HF up to rounding).
MLP: the first `first_k_dense_replace` layers are dense (cfg.dense_mlp_layers); the others route
each token to its top k experts (models/moe.py route_grouped: V3's sigmoid scores with a correction
bias, V2's softmax, greedy or group-limited) and add the shared experts' MLP.
The multi-token-prediction layers of the checkpoints are not loaded (one token per step).

Axis legend: T flat tokens, H hidden, N query heads, Dn qk_nope_head_dim, Dr qk_rope_head_dim,
Dv v_head_dim, Cr kv_lora_rank, C = Cr + Dr latent width, V vocabulary, R logits rows.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from models import quant
from models.config import ModelConfig
from models.invariant_ops import stable_tokens
from models.layer_stack import run_layers
from models.layers import Embedding, RMSNorm, dense, paged_attention_rows, sow_pooled
from models.llama import AttentionFn, WriteKvFn
from models.moe import ExpertsFn, expert_params, route_grouped, routed_experts
from pallas_kernels import latent_attention
from models.rope import apply_rope, attention_factor, deinterleave, inverse_frequencies, mla_softmax_scale

# How prefill rows attend: "auto" expands when latent_attention.prefill_uses_expanded says the
# step's row width pays for it, "expanded" / "absorbed" force one form (decode rows are absorbed).
PREFILL_FORMS = ("auto", "expanded", "absorbed")

# HF's DeepseekV3RMSNorm default: q_a_layernorm and kv_a_layernorm are built without rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def prefill_uses_expanded(cfg: ModelConfig, row_len: int) -> bool:
    """Whether "auto" runs prefill rows of `row_len` tokens in the expanded form."""
    return latent_attention.prefill_uses_expanded(
        row_len, latent_width=cfg.kv_lora_rank + cfg.qk_rope_head_dim, value_dim=cfg.kv_lora_rank,
        qk_head_dim=cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        nope_head_dim=cfg.qk_nope_head_dim)


class KernelParam(nn.Module):
    """A Linear's kernel [I, O] read as an array (float, or dequantised from models/quant.py's
    int8 form), for weights that are folded into others rather than applied (kv_b_proj)."""
    shape: tuple[int, int]
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self):
        if self.has_variable("params", "kernel" + quant.Q):
            offset = (self.get_variable("params", "kernel" + quant.OFFSET)
                      if self.has_variable("params", "kernel" + quant.OFFSET) else None)
            return quant.dequantize_kernel(self.get_variable("params", "kernel" + quant.Q),
                                           self.get_variable("params", "kernel" + quant.SCALE), offset, self.dtype)
        return self.param("kernel", nn.initializers.lecun_normal(), self.shape, self.dtype).astype(self.dtype)


class GatedMlp(nn.Module):
    """down_proj(silu(gate_proj(h)) * up_proj(h)) of width `width`: the dense layers' MLP and the
    shared experts."""
    width: int
    dtype: Any = jnp.float32
    batch_invariant: bool = False

    @nn.compact
    def __call__(self, h):  # [T, H] -> [T, H]
        inv = self.batch_invariant
        gate = dense(self.width, "gate_proj", self.dtype, batch_invariant=inv)(h)
        up = dense(self.width, "up_proj", self.dtype, batch_invariant=inv)(h)
        return dense(h.shape[-1], "down_proj", self.dtype, batch_invariant=inv)(nn.silu(gate) * up)


class DeepseekMoe(nn.Module):
    """Routed experts (router [H, E], e_score_correction_bias f32[E] with topk_method "noaux_tc",
    gate_up_proj [E, H, 2F], down_proj [E, F, H]); the shared experts' MLP is a sibling
    `shared_experts` module."""
    cfg: ModelConfig
    impl: str = "auto"
    dtype: Any = jnp.float32
    experts_fn: ExpertsFn = routed_experts  # models/moe.py ExpertsFn
    batch_invariant: bool = False  # routing and experts in models/moe.py's "stable" forms

    @nn.compact
    def __call__(self, x):  # [T, H]
        cfg = self.cfg
        E, F, H = cfg.num_experts, cfg.moe_intermediate_size, x.shape[-1]
        init = nn.initializers.lecun_normal()
        router = self.param("router", init, (H, E), self.dtype)
        bias = None
        if cfg.topk_method == "noaux_tc":
            bias = self.param("e_score_correction_bias", nn.initializers.zeros, (E,), self.dtype)
        gate_up, down = expert_params(self, E, H, F, self.dtype)
        weights, experts = route_grouped(x, router, bias, cfg.num_experts_per_tok,
                                         num_groups=cfg.num_expert_groups, topk_groups=cfg.topk_groups,
                                         renormalize=cfg.norm_topk_prob, scaling=cfg.routed_scaling_factor,
                                         scoring=cfg.router_scoring, method=cfg.topk_method,
                                         batch_invariant=self.batch_invariant)
        impl = "stable" if self.batch_invariant else self.impl
        return self.experts_fn(x, weights, experts, gate_up, down, impl=impl)


class MlaLayer(nn.Module):
    cfg: ModelConfig
    attention: AttentionFn  # latent_attention_ref's signature
    write_latent: WriteKvFn  # latent_attention.write_latent's signature
    dtype: Any = jnp.float32
    use_moe: bool = False
    moe_impl: str = "auto"
    prefill_form: str = "auto"  # PREFILL_FORMS
    experts_fn: ExpertsFn = routed_experts
    batch_invariant: bool = False  # row-stable matmuls, fixed-order sums; prefill rows absorbed

    def _per_token(self, fn, x):
        """fn (a map over axis 0 of x [T, ...]) run on at least invariant_ops.MIN_ROWS tokens in the
        batch-invariant mode, so a token's products do not depend on the step's token count."""
        return stable_tokens(fn, x) if self.batch_invariant else fn(x)

    def _absorbed(self, q_nope, q_rope, latent_pages, batch, w_uk, w_uv, sm_scale):
        """The absorbed form over every row of `batch`: [T, N, Dv], through W_UV."""
        dtype = self.dtype
        q_latent = self._per_token(lambda t: jnp.einsum("TND,CND->TNC", t, w_uk), q_nope).astype(dtype)  # [T, N, Cr]
        q_abs = jnp.concatenate([q_latent, q_rope], axis=-1)  # [T, N, C]
        attention = functools.partial(self.attention, value_dim=w_uk.shape[0])
        out = paged_attention_rows(attention, q_abs, latent_pages, batch, sm_scale)  # [T, N, Cr]
        return self._per_token(lambda t: jnp.einsum("TNC,CNV->TNV", t, w_uv), out.astype(dtype)).astype(dtype)

    @nn.compact
    def __call__(self, x, batch, latent_pages):  # x: [T, H]; latent_pages: [1, P, page_size, 1, C]
        cfg, dtype, inv = self.cfg, self.dtype, self.batch_invariant
        num_tokens = x.shape[0]
        N, Dn, Dr, Dv, Cr = (cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                             cfg.kv_lora_rank)
        h = RMSNorm(cfg.rms_norm_eps, dtype, batch_invariant=inv, name="input_layernorm")(x)
        if cfg.q_lora_rank is None:
            q = dense(N * (Dn + Dr), "q_proj", dtype, batch_invariant=inv)(h)
        else:
            q = dense(cfg.q_lora_rank, "q_a_proj", dtype, batch_invariant=inv)(h)
            q = RMSNorm(LATENT_NORM_EPS, dtype, batch_invariant=inv, name="q_a_layernorm")(q)
            q = dense(N * (Dn + Dr), "q_b_proj", dtype, batch_invariant=inv)(q)
        q = q.reshape(num_tokens, N, Dn + Dr)
        q_nope, q_rope = q[..., :Dn], q[..., Dn:]  # [T, N, Dn], [T, N, Dr]
        kv = dense(Cr + Dr, "kv_a_proj_with_mqa", dtype, batch_invariant=inv)(h)  # [T, C]
        c = RMSNorm(LATENT_NORM_EPS, dtype, batch_invariant=inv, name="kv_a_layernorm")(kv[:, :Cr])  # [T, Cr]
        k_rope = kv[:, None, Cr:]  # [T, 1, Dr]
        if cfg.rope_interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        inv_freq, scale = inverse_frequencies(cfg), attention_factor(cfg)
        q_rope = apply_rope(q_rope, batch.positions, inv_freq, scale).astype(dtype)
        k_rope = apply_rope(k_rope, batch.positions, inv_freq, scale).astype(dtype)
        latent = jnp.concatenate([c[:, None, :], k_rope], axis=-1)  # [T, 1, C]
        latent_pages = self.write_latent(latent_pages, latent, batch.slot_mapping)
        kv_b = KernelParam((Cr, N * (Dn + Dv)), dtype, name="kv_b_proj")().reshape(Cr, N, Dn + Dv)
        w_uk, w_uv = kv_b[..., :Dn], kv_b[..., Dn:]  # [Cr, N, Dn], [Cr, N, Dv]
        sm_scale = mla_softmax_scale(cfg)
        num_decode, num_prefill = batch.num_decode_rows, batch.num_prefill_rows
        row_len = (num_tokens - num_decode) // max(1, num_prefill)  # Tq, static
        # The batch-invariant mode absorbs every row: the expanded form's products follow the row width.
        expanded = num_prefill > 0 and not inv and (self.prefill_form == "expanded" or (
            self.prefill_form == "auto" and prefill_uses_expanded(cfg, row_len)))
        if expanded:  # decode rows absorbed, prefill rows expanded
            outs = []
            if num_decode:
                dec_rows = dataclasses.replace(batch, pre_page_indices=batch.pre_page_indices[:0],
                                               pre_kv_lens=batch.pre_kv_lens[:0], pre_q_lens=batch.pre_q_lens[:0])
                outs.append(self._absorbed(q_nope[:num_decode], q_rope[:num_decode], latent_pages, dec_rows,
                                           w_uk, w_uv, sm_scale))
            q_pre = jnp.concatenate([q_nope[num_decode:], q_rope[num_decode:]], axis=-1)
            q_pre = q_pre.reshape(num_prefill, row_len, N, Dn + Dr)  # [Bp, Tq, N, Dn + Dr], RoPE applied
            out = latent_attention.latent_attention_expanded(
                q_pre, latent_pages, batch.pre_page_indices, batch.pre_kv_lens, batch.pre_q_lens, w_uk, w_uv,
                sm_scale=sm_scale)  # [Bp, Tq, N, Dv]
            outs.append(out.reshape(-1, N, Dv).astype(dtype))
            out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
        else:
            out = self._absorbed(q_nope, q_rope, latent_pages, batch, w_uk, w_uv, sm_scale)
        out = out.reshape(num_tokens, N * Dv)
        x = x + dense(cfg.hidden_size, "o_proj", dtype, batch_invariant=inv)(out)
        h = RMSNorm(cfg.rms_norm_eps, dtype, batch_invariant=inv, name="post_attention_layernorm")(x)
        if self.use_moe:
            mlp = DeepseekMoe(cfg, self.moe_impl, dtype, self.experts_fn, inv, name="moe")(h)
            if cfg.num_shared_experts:
                mlp = mlp + GatedMlp(cfg.num_shared_experts * cfg.moe_intermediate_size, dtype, inv,
                                     name="shared_experts")(h)
            return x + mlp, latent_pages
        return x + GatedMlp(cfg.intermediate_size, dtype, inv, name="mlp")(h), latent_pages


class DeepseekModel(nn.Module):
    cfg: ModelConfig
    attention: AttentionFn
    write_latent: WriteKvFn
    dtype: Any = jnp.float32
    moe_impl: str = "auto"  # models/moe.py
    scan_period: int = 0  # > 0: layers under a scan (models/layer_stack.py)
    prefill_form: str = "auto"  # PREFILL_FORMS
    experts_fn: ExpertsFn = routed_experts  # the routed experts (models/moe.py ExpertsFn)
    batch_invariant: bool = False  # EngineConfig.batch_invariant (models/invariant_ops.py)

    def __post_init__(self):
        if self.prefill_form not in PREFILL_FORMS:
            raise ValueError(f"prefill_form must be one of {PREFILL_FORMS}, got {self.prefill_form!r}")
        super().__post_init__()

    @nn.compact
    def __call__(self, batch, kv_cache):
        """Returns (logits f32[R + Rp, V], updated kv_cache), as LlamaModel."""
        cfg, inv = self.cfg, self.batch_invariant
        embed = Embedding(cfg.vocab_size, cfg.hidden_size, self.dtype, batch_invariant=inv, name="embed_tokens")
        x = embed(batch.token_ids)  # [T, H]

        def make_layer(i: int, name: str) -> MlaLayer:
            return MlaLayer(cfg, self.attention, self.write_latent, self.dtype, cfg.is_moe_layer(i),
                            self.moe_impl, self.prefill_form, self.experts_fn, inv, name=name)

        x, new_cache = run_layers(make_layer, cfg.num_layers, self.scan_period, x, batch, kv_cache)
        rows = jnp.concatenate([batch.logits_indices, batch.prompt_logits_indices])
        norm = RMSNorm(cfg.rms_norm_eps, self.dtype, batch_invariant=inv, name="norm")
        sow_pooled(self, norm, x, batch)
        x = norm(x[rows])  # [R + Rp, H]
        if cfg.tie_word_embeddings:
            logits = embed.attend(x)
        else:
            logits = dense(cfg.vocab_size, "lm_head", self.dtype, batch_invariant=inv)(x)
        return logits.astype(jnp.float32), new_cache
