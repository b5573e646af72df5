"""Which functional model module runs a config: one module per family, same call contract."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from models.config import ModelConfig
from models.deepseek import DeepseekModel
from models.gemma import GemmaModel
from models.llama import AttentionFn, LlamaModel, WriteKvFn
from models.moe import ExpertsFn, routed_experts


def build_model(cfg: ModelConfig, attention: AttentionFn, write_kv: WriteKvFn, dtype: Any = jnp.float32,
                scan_period: int = 0, batch_invariant: bool = False, lora_impl: str = "xla",
                experts_fn: ExpertsFn = routed_experts, matmul_impl: str = "xla"):
    """The flax module for `cfg`: `.apply({"params": params}, batch, kv_cache) -> (logits, kv_cache)`.
    scan_period > 0: the layers run under a scan (models/layer_stack.py: stacked params and pool).
    lora_impl: how the LoRA delta runs (models/lora_ops.LORA_IMPLS; "native" once
    `lora_ops.resolve_lora_impl` returned it).
    experts_fn: how MoE layers run their routed experts (models/moe.py ExpertsFn; on a mesh,
    paxpage/sharded_experts.py's split of them).
    matmul_impl: how the dense layers' float matmuls run (models/layers.MATMUL_IMPLS; "native" once
    `layers.resolve_matmul_impl` returned it). Latent-attention models keep XLA's dot.
    Latent-attention models (cfg.is_mla) take `attention` / `write_kv` of the latent pool
    (pallas_kernels/latent_attention.py; paxpage/attention_impl.functions picks them)."""
    if cfg.is_mla:
        return DeepseekModel(cfg, attention, write_kv, dtype, scan_period=scan_period, experts_fn=experts_fn,
                             batch_invariant=batch_invariant)
    if cfg.is_gemma:
        return GemmaModel(cfg, attention, write_kv, dtype, scan_period=scan_period, lora_impl=lora_impl,
                          matmul_impl=matmul_impl, batch_invariant=batch_invariant)
    return LlamaModel(cfg, attention, write_kv, dtype, scan_period=scan_period, batch_invariant=batch_invariant,
                      lora_impl=lora_impl, experts_fn=experts_fn, matmul_impl=matmul_impl)
