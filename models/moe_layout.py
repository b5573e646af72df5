"""Expert tensors of HF MoE checkpoints, in whichever of their layouts a checkpoint uses.

models/param_layout.py names expert weights as transformers 5 holds them in memory: per layer
`mlp.gate.weight` [E, H] (the router), `mlp.experts.gate_up_proj` [E, 2*Fe, H] (each expert's
gate rows, then its up rows) and `mlp.experts.down_proj` [E, H, Fe]. Checkpoints on disk
(transformers 5's own save_pretrained included) mostly keep one Linear per expert instead:
    Qwen3-MoE  mlp.experts.{j}.{gate,up,down}_proj.weight
    Mixtral    block_sparse_moe.gate.weight, block_sparse_moe.experts.{j}.{w1,w3,w2}.weight
               (w1 gate [Fe, H], w3 up [Fe, H], w2 down [H, Fe])
`with_expert_tensors` answers the fused names from either.

gpt-oss (cfg.moe_bias) holds `mlp.experts.gate_up_proj` [E, H, 2*Fe] with gate and up columns
interleaved (gate at even columns), and its released checkpoints store the expert weights as
MXFP4 (`<name>_blocks` [E, O, I/32, 16] u8 of packed 4-bit values, low nibble first, and
`<name>_scales` [E, O, I/32] u8 exponents biased by 127, one per 32 inputs): held exactly as
models/quant.py's packed form, the 4-bit codes as stored (u8 [E, I/2, O], two a byte) with half the
block's power of two as an f32 scale [E, I/32, O] (each code standing for twice its value, an
integer in [-12, 12]), and the gate / up columns regrouped as gate, then up.
`quantization="none"` expands them to floats.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from models.config import ModelConfig
from models.quant import QuantizedWeight, unpack_e2m1

# (gate, up, down) per-expert names under a layer's MoE prefix.
_PER_EXPERT = {
    ".mlp.": ("gate_proj.weight", "up_proj.weight", "down_proj.weight"),
    ".block_sparse_moe.": ("w1.weight", "w3.weight", "w2.weight"),
}


def with_expert_tensors(cfg: ModelConfig, get_tensor: Callable[[str], Any]) -> Callable[[str], Any]:
    """Wraps `get_tensor(name)` (KeyError when absent) so that fused expert names also resolve from
    per-expert tensors. Other names pass through unchanged."""
    if not cfg.num_experts:
        return get_tensor
    if cfg.moe_bias:
        return _gpt_oss_experts(get_tensor)

    def get(name: str):
        try:
            return get_tensor(name)
        except KeyError:
            if name.endswith(".mlp.gate.weight"):  # Mixtral's router
                return get_tensor(name.replace(".mlp.", ".block_sparse_moe."))
            for suffix, parts in ((".mlp.experts.gate_up_proj", (0, 1)), (".mlp.experts.down_proj", (2,))):
                if name.endswith(suffix):
                    return _stack_experts(cfg.num_experts, name[: -len(suffix)], parts, get_tensor)
            raise

    return get


def _stack_experts(num_experts: int, layer: str, parts: tuple[int, ...], get_tensor) -> np.ndarray:
    """[E, rows, cols] from per-expert tensors; two parts (gate, up) are joined along the rows."""
    for moe_prefix, names in _PER_EXPERT.items():
        first = f"{layer}{moe_prefix}experts.0.{names[parts[0]]}"
        try:
            get_tensor(first)
        except KeyError:
            continue
        experts = []
        for j in range(num_experts):
            pieces = []
            for part in parts:
                name = f"{layer}{moe_prefix}experts.{j}.{names[part]}"
                try:
                    pieces.append(np.asarray(get_tensor(name)))
                except KeyError:
                    raise ValueError(f"missing tensor {name!r} (expert {j} of {num_experts})") from None
            experts.append(np.concatenate(pieces, axis=0))
        return np.stack(experts)
    raise KeyError(f"{layer}.mlp.experts")


def mxfp4_packed(blocks, scales) -> tuple[np.ndarray, np.ndarray]:
    """MXFP4 blocks u8[..., G, 16] (two 4-bit e2m1 codes a byte, low nibble first) and scales
    u8[..., G] (2 ** (s - 127) per block of 32) -> (codes u8[..., G * 16], as stored: inputs 2j and
    2j + 1 in byte j's low and high nibble; scale f32[..., G] = 2 ** (s - 128), exact, subnormal at
    s = 0): models/quant.py's packed form, each code standing for twice its value."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not pair "
                         "(blocks [..., G, 16], scales [..., G])")
    packed = blocks.reshape(*blocks.shape[:-2], -1)
    return packed, np.ldexp(np.float32(1.0), scales.astype(np.int32) - 128).astype(np.float32)


def decode_mxfp4(blocks, scales) -> np.ndarray:
    """MXFP4 blocks and scales (as `mxfp4_packed`) -> f32[..., G * 32], exact."""
    packed, scale = mxfp4_packed(blocks, scales)
    q = unpack_e2m1(packed[..., None])[..., 0]  # [..., G * 32] twice each value
    return (q.reshape(*scale.shape, 32) * scale[..., None]).reshape(q.shape).astype(np.float32)


def _gate_then_up(x):  # [..., 2*Fe], gate / up interleaved -> gate columns, then up
    if isinstance(x, QuantizedWeight):  # scales share the values' columns
        return QuantizedWeight(*(None if a is None else _gate_then_up(a) for a in x))
    x = np.asarray(x)
    return np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def _gpt_oss_experts(get_tensor: Callable[[str], Any]) -> Callable[[str], Any]:
    def dense_or_mxfp4(name: str):
        try:
            return np.asarray(get_tensor(name))
        except KeyError:
            q, scale = mxfp4_packed(get_tensor(name + "_blocks"), get_tensor(name + "_scales"))
            # [E, O, I / 2] and [E, O, I / 32] -> [E, I / 2, O] and [E, I / 32, O]
            return QuantizedWeight(np.ascontiguousarray(q.swapaxes(-1, -2)),
                                   np.ascontiguousarray(scale.swapaxes(-1, -2)))

    def get(name: str):
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            x = dense_or_mxfp4(name)
            return _gate_then_up(x) if name.endswith("gate_up_proj") else x
        if name.endswith(".mlp.experts.gate_up_proj_bias"):
            return _gate_then_up(get_tensor(name))
        return get_tensor(name)

    return get
