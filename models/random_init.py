"""Random-weight models at the shapes of released ones, built on the device: no checkpoint.

For benchmarks and the device check (scripts/device_check.py), where what matters is the work a
step does at a real model's dims, not what it says. `preset(name)` gives the ModelConfig of a
released model (its config.json's dims; tokenizer-free, so token ids in, token ids out) and
`preset(name, tiny=True)` the same architecture shrunk to under 250k parameters for CPU
rehearsals. `random_params(cfg)` draws the parameter tree of models/param_layout.py with
jax.random, one jitted call per leaf, straight into device memory, placed as the loaders place
theirs (jax's default device, uncommitted, as `jnp.asarray` leaves them); nothing is built on
the host.

Weights: normal / sqrt(fan-in) for every matrix (the fan-in is the contraction axis, shape[-2]:
kernels are [in, out], experts [E, in, out]), the embedding normal / sqrt(H) so that a tied LM head
gives unit-scale logits, norm scales 1, biases 0. Activations then stay O(1) through the layers
and the logits hold no NaN or inf in bf16.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from models.config import ModelConfig, RopeScaling
from models.param_layout import check_dtype, param_specs, unflatten

PRESETS: dict[str, ModelConfig] = {
    # meta-llama/Llama-3.2-1B: tied embeddings, llama3 rope scaling
    "llama-3.2-1b": ModelConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
        num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(kind="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192),
        max_position_embeddings=131072, tie_word_embeddings=True, bos_token_id=128000,
        eos_token_ids=(128001,)),
    # meta-llama/Meta-Llama-3-8B
    "llama-3-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
        bos_token_id=128000, eos_token_ids=(128001,)),
    # Qwen/Qwen3-30B-A3B: 128 experts, 8 per token, every layer sparse
    "qwen3-30b-a3b": ModelConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32,
        num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        qk_norm=True, bos_token_id=None, eos_token_ids=(151645,), model_type="qwen3_moe",
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
    # openai/gpt-oss-20b: attention sinks, windowed (128) and full layers in turn, 32 biased experts
    "gpt-oss-20b": ModelConfig(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_layers=24, num_heads=64,
        num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=150000.0,
        rope_scaling=RopeScaling(kind="yarn", factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0,
                                 beta_slow=1.0, truncate=False),
        max_position_embeddings=131072, qkv_bias=True, bos_token_id=199998, eos_token_ids=(200002,),
        model_type="gpt_oss", sliding_window=128,
        layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)),
        num_experts=32, num_experts_per_tok=4, moe_intermediate_size=2880, norm_topk_prob=True,
        attention_sinks=True, o_proj_bias=True, moe_bias=True, swiglu_limit=7.0, swiglu_alpha=1.702),
    # deepseek-ai/DeepSeek-V2-Lite: latent attention (576 values per token and layer, a plain q_proj),
    # a dense first layer, then 64 experts (6 per token, greedy) beside 2 shared ones
    "deepseek-v2-lite": ModelConfig(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_layers=27, num_heads=16,
        num_kv_heads=1, head_dim=64, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=RopeScaling(kind="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                                 beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707),
        max_position_embeddings=163840, bos_token_id=100000, eos_token_ids=(100001,), model_type="deepseek_v2",
        num_experts=64, num_experts_per_tok=6, moe_intermediate_size=1408, dense_mlp_layers=(0,),
        num_shared_experts=2, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, rope_interleave=True),
}


def preset(name: str, *, tiny: bool = False, num_layers: int | None = None) -> ModelConfig:
    """The config of `name` (a PRESETS key). tiny: the same architecture (model type, tied or
    untied head, query heads per kv head, qk-norm, experts per token) at hidden 64, 2 layers, a
    512-token vocabulary and 8 experts; latent attention keeps its heads, with a latent of
    32 + 8 values. num_layers: keep the dims, cut the depth."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}")
    cfg = PRESETS[name]
    if tiny and cfg.is_mla:
        cfg = dataclasses.replace(
            cfg, vocab_size=512, hidden_size=64, intermediate_size=128, **_depth(cfg, 2), head_dim=8,
            max_position_embeddings=4096, bos_token_id=None, eos_token_ids=(), num_experts=8,
            num_experts_per_tok=min(cfg.num_experts_per_tok, 2), moe_intermediate_size=32,
            num_expert_groups=min(cfg.num_expert_groups, 2), topk_groups=1, kv_lora_rank=32,
            q_lora_rank=cfg.q_lora_rank and 32, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
    elif tiny:
        group = cfg.num_heads // cfg.num_kv_heads
        num_heads = max(group, 4)
        moe = {}
        if cfg.num_experts:
            moe = dict(num_experts=8, num_experts_per_tok=min(cfg.num_experts_per_tok, 2), moe_intermediate_size=32)
        cfg = dataclasses.replace(
            cfg, vocab_size=512, hidden_size=64, intermediate_size=128, **_depth(cfg, 2), num_heads=num_heads,
            num_kv_heads=num_heads // group, head_dim=16, max_position_embeddings=4096,
            bos_token_id=None, eos_token_ids=(), **moe)
    if num_layers is not None:
        cfg = dataclasses.replace(cfg, **_depth(cfg, num_layers))
    return cfg


def _depth(cfg: ModelConfig, num_layers: int) -> dict[str, Any]:
    """The fields that cut `cfg` to `num_layers` layers (a layer-type pattern keeps its start)."""
    return dict(num_layers=num_layers, layer_types=cfg.layer_types[:num_layers])


def num_params(cfg: ModelConfig) -> int:
    """Parameters of `cfg`'s tree (every leaf of models/param_layout.py, float form)."""
    return sum(math.prod(shape) for shape, _, _ in param_specs(cfg).values())


def random_params(cfg: ModelConfig, dtype: Any = "bfloat16", seed: int = 0,
                  sharding: jax.sharding.Sharding | None = None) -> dict[str, Any]:
    """The parameter tree of `cfg` (models/param_layout.py) drawn on the device in `dtype`.
    sharding: where every leaf goes, committed there (default: jax's default device, uncommitted,
    as loaded params: a committed tree beside the runner's uncommitted fresh KV pool makes the
    first step's executable lower again once the pool is a step's output).
    Leaf i is drawn from fold_in(key(seed), i), so a tree is the same wherever it is built."""
    dt = check_dtype(dtype)
    key = jax.random.key(seed)
    flat = {}
    for i, (path, (shape, _, _)) in enumerate(param_specs(cfg).items()):
        kind, scale = _init(path, shape, cfg)
        flat[path] = _draw(shape, dt.name, kind, scale, sharding)(jax.random.fold_in(key, i))
    return unflatten(flat)


def _init(path: str, shape: tuple[int, ...], cfg: ModelConfig) -> tuple[str, float]:
    """(kind, scale) of one leaf: "normal" times scale, or "ones" / "zeros"."""
    if len(shape) == 1:
        return ("zeros", 0.0) if path.endswith("bias") else ("ones", 1.0)
    if path == "embed_tokens/embedding":
        return "normal", cfg.hidden_size ** -0.5
    return "normal", shape[-2] ** -0.5


@functools.lru_cache(maxsize=None)
def _draw(shape: tuple[int, ...], dtype: str, kind: str, scale: float, sharding):
    """One jitted draw per distinct leaf (a model has a handful: its layers repeat)."""

    def draw(key):
        if kind == "ones":
            return jnp.ones(shape, dtype)
        if kind == "zeros":
            return jnp.zeros(shape, dtype)
        return jax.random.normal(key, shape, dtype) * jnp.asarray(scale, dtype)

    return jax.jit(draw) if sharding is None else jax.jit(draw, out_shardings=sharding)
