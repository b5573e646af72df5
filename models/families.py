"""Which functional model module runs a config: one module per family, same call contract."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from models.config import ModelConfig
from models.gemma import GemmaModel
from models.llama import AttentionFn, LlamaModel, WriteKvFn


def build_model(cfg: ModelConfig, attention: AttentionFn, write_kv: WriteKvFn, dtype: Any = jnp.float32,
                scan_period: int = 0):
    """The flax module for `cfg`: `.apply({"params": params}, batch, kv_cache) -> (logits, kv_cache)`.
    scan_period > 0: the layers run under a scan (models/layer_stack.py: stacked params and pool)."""
    if cfg.is_gemma:
        return GemmaModel(cfg, attention, write_kv, dtype, scan_period=scan_period)
    return LlamaModel(cfg, attention, write_kv, dtype, scan_period=scan_period)
