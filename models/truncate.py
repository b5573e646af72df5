"""A model cut to its first layers: a cheap draft for speculative decoding that needs no download.

`truncate_layers(cfg, params, n)` keeps layers 0..n-1 and everything outside the layer stack
(embeddings, final norm, LM head), so the truncated model shares the target's vocabulary and
tokenizer and, being the target's own early layers, often agrees with it. HF transformers loads
the same truncated model from the target's checkpoint with `num_hidden_layers=n` (it drops the
weights of the missing layers), which is what tests compare against.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from models.config import ModelConfig


def truncate_config(cfg: ModelConfig, num_layers: int) -> ModelConfig:
    """`cfg` with its first `num_layers` layers; per-layer fields (layer types, dense MoE layers) cut to match."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int):
        raise TypeError(f"num_layers must be an int, got {type(num_layers).__name__}")
    if not 1 <= num_layers <= cfg.num_layers:
        raise ValueError(f"num_layers must be in 1..{cfg.num_layers} (the model's layers), got {num_layers}")
    return dataclasses.replace(
        cfg, num_layers=num_layers,
        layer_types=cfg.layer_types[:num_layers],
        dense_mlp_layers=tuple(i for i in cfg.dense_mlp_layers if i < num_layers))


def truncate_layers(cfg: ModelConfig, params: dict[str, Any], num_layers: int) -> tuple[ModelConfig, dict[str, Any]]:
    """(config, params) of the model made of `cfg`'s first `num_layers` layers. The arrays are shared,
    not copied, from per-layer params; stacked params (models/layer_stack.py) give the kept layers per
    layer, sliced out."""
    from models import layer_stack

    new_cfg = truncate_config(cfg, num_layers)
    if layer_stack.period_of(params):  # stacked: the kept layers sliced out (copies), per layer
        layers = {f"layers_{i}": layer_stack.layer(params, i) for i in range(num_layers)}
        return new_cfg, {**{k: v for k, v in params.items() if k != layer_stack.STACKED_KEY}, **layers}
    kept = {}
    for name, value in params.items():
        if name.startswith("layers_"):
            if int(name[len("layers_"):]) >= num_layers:
                continue
        kept[name] = value
    assert sum(name.startswith("layers_") for name in kept) == num_layers, sorted(kept)
    return new_cfg, kept
