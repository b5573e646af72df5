"""Sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral): top-k routing and grouped expert matmuls.

Each token's router picks `top_k` of E experts; only those experts' SwiGLU MLPs run on it. The
T * top_k (token, expert) pairs are sorted by expert so that every expert sees one contiguous
group of rows, and each expert's weights multiply only its own group (a grouped matmul), so
the work grows with the number of routed tokens, not with E. Shapes stay static: the routed
rows are always M = T * top_k; only the group sizes are data.

Grouped-matmul implementations (`impl`):
    "ragged_dot"  jax.lax.ragged_dot: XLA's native grouped matmul on GPU and TPU. On CPU jax
                  lowers it to a masked product over every expert for every row (E times the
                  work), so it is not the CPU default.
    "tiled"       pure jnp: each expert's group is padded to whole tiles of `tile` rows, every
                  tile belongs to one expert, and one batched matmul runs each tile against its
                  expert's weights. Work is at most (M + min(E, M) * (tile - 1)) rows.
    "dense"       every expert on every token, combined with the routing weights (zero for the
                  experts a token did not pick): the baseline the benchmark compares against.
    "auto"        "ragged_dot" on GPU / TPU, "tiled" on CPU.

Axis legend: T tokens, H hidden, E experts, k experts per token, M = T * k routed rows,
F expert MLP width, G tiles, R rows in one tile.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

IMPLS = ("auto", "ragged_dot", "tiled", "dense")


def resolve_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"moe_impl {impl!r} is not one of {IMPLS}")
    if impl == "auto":
        return "ragged_dot" if jax.default_backend() in ("gpu", "tpu") else "tiled"
    return impl


def route(x, router, top_k: int, renormalize: bool):
    """Router softmax over all experts (in f32), then the top k.

    x [T, H], router [H, E] -> (weights f32[T, k], experts i32[T, k]). `renormalize` rescales the
    k chosen probabilities to sum to 1 (Mixtral always; Qwen3-MoE when `norm_topk_prob`).
    """
    logits = jnp.einsum("TH,HE->TE", x, router).astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def tile_rows(num_rows: int, num_experts: int) -> int:
    """Tile height for the "tiled" grouped matmul: about half the mean group, clamped to 8..64.

    Small tiles waste little padding but make many small matmuls (and weight copies); on CPU
    these bounds measured best for 8-32 experts and 64-512 tokens."""
    target = max(1, num_rows // (2 * num_experts))
    return min(64, max(8, 1 << (target.bit_length() - 1)))


def _swiglu(h):  # [..., 2F] (gate then up) -> [..., F]
    gate, up = jnp.split(h, 2, axis=-1)
    return nn.silu(gate) * up


def _experts_ragged(x_sorted, group_sizes, gate_up, down):
    """x_sorted [M, H] grouped by expert -> [M, H]."""
    h = jax.lax.ragged_dot(x_sorted, gate_up, group_sizes)  # [M, 2F]
    return jax.lax.ragged_dot(_swiglu(h), down, group_sizes)  # [M, H]


def _experts_tiled(x_sorted, sorted_experts, group_sizes, gate_up, down):
    """The same as `_experts_ragged` with static-shape tiles (see the module docstring)."""
    num_rows, hidden = x_sorted.shape
    num_experts = gate_up.shape[0]
    tile = tile_rows(num_rows, num_experts)
    # Each non-empty group pads up to < tile rows; at most min(E, M) groups are non-empty.
    num_tiles = (num_rows + min(num_experts, num_rows) * (tile - 1)) // tile
    padded = (group_sizes + tile - 1) // tile * tile  # [E]
    padded_start = jnp.cumsum(padded) - padded
    start = jnp.cumsum(group_sizes) - group_sizes
    # Row r of the sorted rows goes to slot padded_start[e] + (r - start[e]) of the tiled buffer.
    dest = padded_start[sorted_experts] + jnp.arange(num_rows) - start[sorted_experts]  # [M]
    x_tiles = jnp.zeros((num_tiles * tile, hidden), x_sorted.dtype).at[dest].set(x_sorted)
    x_tiles = x_tiles.reshape(num_tiles, tile, hidden)  # [G, R, H]
    # Tile g starts at row g * tile: its expert is the one whose padded range holds that row.
    # Tiles past the last group hold only zeros; clamping gives them a valid (unused) expert.
    tile_expert = jnp.searchsorted(jnp.cumsum(padded), jnp.arange(num_tiles) * tile, side="right")
    tile_expert = jnp.minimum(tile_expert, num_experts - 1)  # [G]
    h = jnp.einsum("GRH,GHF->GRF", x_tiles, gate_up[tile_expert])
    y = jnp.einsum("GRF,GFH->GRH", _swiglu(h), down[tile_expert])
    return y.reshape(num_tiles * tile, hidden)[dest]  # [M, H]


def _experts_dense(x, weights, experts, gate_up, down):
    """Every expert on every token. x [T, H] -> [T, H]."""
    num_experts = gate_up.shape[0]
    h = jnp.einsum("TH,EHF->ETF", x, gate_up)
    y = jnp.einsum("ETF,EFH->ETH", _swiglu(h), down)
    # [T, E] routing weights, zero for the experts a token did not pick.
    combine = jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=jnp.float32) * weights[..., None], axis=1)
    return jnp.einsum("TE,ETH->TH", combine, y.astype(jnp.float32))


def moe_mlp(x, router, gate_up, down, *, top_k: int, renormalize: bool, impl: str = "auto"):
    """The sparse MoE MLP.

    x [T, H]; router [H, E]; gate_up [E, H, 2F] (gate columns, then up); down [E, F, H].
    Returns [T, H] in x's dtype: sum over the token's k experts of weight * down(silu(gate) * up).
    """
    impl = resolve_impl(impl)
    num_tokens, hidden = x.shape
    weights, experts = route(x, router, top_k, renormalize)  # [T, k]
    if impl == "dense":
        return _experts_dense(x, weights, experts, gate_up, down).astype(x.dtype)
    flat_experts = experts.reshape(-1)  # [M]; entry j is token j // k
    order = jnp.argsort(flat_experts, stable=True)  # sorted position -> entry
    sorted_experts = flat_experts[order]
    group_sizes = jnp.bincount(flat_experts, length=gate_up.shape[0]).astype(jnp.int32)  # [E]
    x_sorted = x[order // top_k]  # [M, H]
    if impl == "ragged_dot":
        y_sorted = _experts_ragged(x_sorted, group_sizes, gate_up, down)
    else:
        y_sorted = _experts_tiled(x_sorted, sorted_experts, group_sizes, gate_up, down)
    y = jnp.zeros_like(y_sorted).at[order].set(y_sorted)  # back to entry order
    y = y.reshape(num_tokens, top_k, hidden).astype(jnp.float32)
    return jnp.einsum("Tk,TkH->TH", weights, y).astype(x.dtype)


class SparseMoe(nn.Module):
    """Parameters: router [H, E], gate_up_proj [E, H, 2F], down_proj [E, F, H] (models/param_layout.py)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # F, one expert's width
    renormalize: bool
    impl: str = "auto"
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):  # [T, H]
        E, F, H = self.num_experts, self.intermediate_size, x.shape[-1]
        init = nn.initializers.lecun_normal()
        router = self.param("router", init, (H, E), self.dtype)
        gate_up = self.param("gate_up_proj", init, (E, H, 2 * F), self.dtype)
        down = self.param("down_proj", init, (E, F, H), self.dtype)
        return moe_mlp(x, router, gate_up, down, top_k=self.top_k, renormalize=self.renormalize,
                       impl=self.impl)
