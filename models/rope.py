"""Rotary position embeddings (HF rotate-half layout) with the Llama-family scaling variants."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:  # f32[D // 2]
    """Per-pair rotation frequencies, computed on the host once per config."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = cfg.rope_scaling
    if scaling.kind == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept,
        # the band between interpolated smoothly.
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    elif scaling.kind == "yarn":
        inv_freq = _yarn_inverse_frequencies(inv_freq, dim, cfg.rope_theta, scaling)
    return inv_freq.astype(np.float32)


def attention_factor(cfg: ModelConfig) -> float:
    """The magnitude YaRN gives cos / sin (so q.k scales by its square); 1 for the other kinds."""
    scaling = cfg.rope_scaling
    if scaling.kind != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.factor, scaling.mscale) / mscale(scaling.factor, scaling.mscale_all_dim)
    return mscale(scaling.factor)


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """Latent attention's softmax scale (HF DeepseekV3Attention.scaling): (qk_nope + qk_rope) ** -0.5,
    times mscale(factor, mscale_all_dim) ** 2 when a scaled rope states mscale_all_dim."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    scaling = cfg.rope_scaling
    if scaling.kind != "default" and scaling.mscale_all_dim and scaling.factor > 1:
        mscale = 0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0
        scale *= mscale * mscale
    return scale


def deinterleave(x: jax.Array) -> jax.Array:  # [..., D]
    """Pairs (x0, x1), (x2, x3), ... regrouped as [x0, x2, ...; x1, x3, ...]: `apply_rope` of the
    result is HF's apply_rotary_pos_emb_interleave (DeepSeek's rope_interleave), output order included."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def _yarn_inverse_frequencies(inv_freq: np.ndarray, dim: int, base: float, scaling) -> np.ndarray:
    """YaRN: pairs rotating fewer than beta_slow times over the original context are interpolated
    (divided by factor), those rotating more than beta_fast times are kept, with a linear ramp
    over the dimensions between."""
    original = scaling.original_max_position_embeddings

    def dim_of(rotations):  # the pair index that turns `rotations` times over the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-point ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # 1: extrapolate (the pretrained frequency), 0: interpolate
    return inv_freq / scaling.factor * (1.0 - keep) + inv_freq * keep


def apply_rope(
    x: jax.Array,  # [T, N, D]
    positions: jax.Array,  # i32[T]
    inv_freq: np.ndarray,  # f32[D // 2]
    scale: float = 1.0,  # attention_factor(cfg): YaRN's cos / sin magnitude
) -> jax.Array:  # [T, N, D]
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, D/2]
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    x = x.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
