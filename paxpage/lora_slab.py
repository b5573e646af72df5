"""The device slab of LoRA adapters: per layer and target, max_loras stacked A and B.

Layout: the slab is a params-shaped tree, `{layer: {target: {"lora_a": [S, I, R], "lora_b":
[S, R, O]}}}` with the layer keys of the runner's params (`layers_{i}`, or the scanned
`layers/{j}` subtree whose leaves carry a leading group axis, models/layer_stack.py). The
runner merges it into the params it passes to the jitted step, so each targeted Linear finds
its slab beside its kernel (models/layers.py). Every model layer has every target (zeros
where an adapter does not touch it): the step's shape never depends on the adapters, and a
slot changes by one in-place write.

Ranks below R are zero-padded (the extra rank columns contribute nothing); B holds the
adapter's scale. Unused slots are zeros; rows on the base model use slot -1 and skip the slab.

Axis legend: S slots (max_loras), I a target's input width, R max_lora_rank, O output width,
G scanned layer groups.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models import layer_stack
from models.config import ModelConfig
from models.lora import LoraAdapter, target_shapes


def _per_layer(cfg: ModelConfig, rank: int, fill) -> dict:
    """{layers_i: {target: {"lora_a": fill((I, R), layer, target), "lora_b": fill((R, O), ...)}}}."""
    tree = {}
    for layer in range(cfg.num_layers):
        tree[f"layers_{layer}"] = {
            target: {"lora_a": fill((num_in, rank), layer, target, 0),
                     "lora_b": fill((rank, num_out), layer, target, 1)}
            for target, (num_in, num_out) in target_shapes(cfg, layer).items()}
    return tree


def slab_bytes(cfg: ModelConfig, max_loras: int, rank: int, itemsize: int) -> int:
    total = sum((num_in + num_out) * rank for layer in range(cfg.num_layers)
                for num_in, num_out in target_shapes(cfg, layer).values())
    return total * max_loras * itemsize


def _form(tree: dict, cfg: ModelConfig, period: int, stack) -> dict:
    return layer_stack.stack_layers(tree, cfg.num_layers, period, stack=stack) if period else tree


def zeros(cfg: ModelConfig, max_loras: int, rank: int, dtype, period: int) -> dict:
    """The empty slab, in the runner's params form (period > 0: scanned layers)."""
    tree = _per_layer(cfg, rank, lambda shape, *_: jnp.zeros((max_loras, *shape), dtype))
    return _form(tree, cfg, period, jnp.stack)


def slot_tree(adapter: LoraAdapter, cfg: ModelConfig, rank: int, dtype, period: int) -> dict:
    """One slot's matrices (host arrays, the slab's tree without the S axis), rank-padded."""
    if adapter.rank > rank:
        raise ValueError(f"LoRA adapter {adapter.name!r} has rank {adapter.rank}; max_lora_rank is {rank}")

    def fill(shape, layer, target, half):
        out = np.zeros(shape, dtype)
        pair = adapter.weights.get((layer, target))
        if pair is not None:
            m = pair[half]
            if half == 0:
                out[:, :m.shape[1]] = m
            else:
                out[:m.shape[0], :] = m
        return out

    return _form(_per_layer(cfg, rank, fill), cfg, period, lambda xs: np.stack(list(xs)))


def write_slot(slab: dict, slot, tree: dict) -> dict:
    """The slab with slot `slot` (i32[]) replaced by `tree` (jit it with the slab donated)."""
    return jax.tree.map(lambda s, x: s.at[..., slot, :, :].set(x.astype(s.dtype)), slab, tree)


def merge(params: dict, slab: dict) -> dict:
    """params with the slab's leaves added beside the targeted kernels (new dicts; the arrays
    are shared)."""
    out = dict(params)
    for key, sub in slab.items():
        out[key] = merge(params[key], sub) if isinstance(sub, dict) and not _is_target(sub) else \
            {**params[key], **sub}
    return out


def _is_target(node: dict) -> bool:
    return "lora_a" in node
