"""How one layer's KV pool is laid out in memory: one layout per kernel family, one interface.

Axis legend: P pages, page_size slots per page, K kv heads, D head dim.

- "canonical" [2, P, page_size, K, D] (0 = K, 1 = V): what the references, the GPU / CPU kernels
  and the XLA / native paths read. Its last two dims (K, D) are small on TPU: at K = 3 / D = 64 or
  K = 1 / D = 128 they fill a fraction of a (8 | 16, 128) tile, so a Mosaic TPU kernel on this
  layout makes XLA relayout (copy) the whole pool on every call.
- "tpu" [P, K, page_size, 2 * D]: K and V side by side on the lane dim (lanes 0..D-1 the key,
  D..2D-1 the value of slot s, head h). The last two dims are (page_size, 2D): at page_size 16
  and D = 64 exactly one bf16 (16, 128) tile, at D = 128 two. The pool is its logical size on
  TPU and a page's block is one contiguous DMA. jax's `ragged_paged_attention` and tpu-inference
  also fuse K and V into one array (interleaved on the head axis, with D padded to 128 lanes);
  this keeps D unpadded instead, which suits SmolLM2's D = 64.

Which layout a pool gets is decided where the pool is made (`for_backend`), and every reader
(kernels, page copies, sharding, sizing) asks the layout for shapes and axes instead of
hard-coding them. The quantised pool (kv_quant.QuantizedKV) keeps the canonical layout on every
backend: its per-(token, head) scales have no tiling-friendly TPU layout yet, so on TPU the
kernels relay out its scales at every shape and its values where K < 8
(scripts/tpu_compile_check.py measures it; docs/gpu-tpu.md has the figures).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

LAYOUTS = ("canonical", "tpu")


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """One layer's pool layout (a static value: hashable, usable as a jit static argument)."""

    name: str  # one of LAYOUTS

    def __post_init__(self):
        if self.name not in LAYOUTS:
            raise ValueError(f"KV layout is {self.name!r}; expected one of {LAYOUTS}")

    def shape(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """The pool's array shape for P pages of page_size slots, K kv heads of head dim D."""
        if self.name == "tpu":
            return (num_pages, num_kv_heads, page_size, 2 * head_dim)
        return (2, num_pages, page_size, num_kv_heads, head_dim)

    @property
    def page_axis(self) -> int:
        """The pool's axis of pages (what a page copy indexes)."""
        return 0 if self.name == "tpu" else 1

    @property
    def head_axis(self) -> int:
        """The pool's axis of kv heads (what tensor parallelism splits)."""
        return 1 if self.name == "tpu" else 3

    def dims(self, shape) -> tuple[int, int, int, int]:
        """(P, page_size, K, D) of a pool of this layout; ValueError if `shape` is not one."""
        shape = tuple(shape)
        if self.name == "tpu":
            if len(shape) != 4 or shape[3] % 2:
                raise ValueError(f"pool has shape {shape}; the tpu layout is [P, K, page_size, 2 * D]")
            num_pages, num_kv_heads, page_size, lanes = shape
            return num_pages, page_size, num_kv_heads, lanes // 2
        if len(shape) != 5 or shape[0] != 2:
            raise ValueError(f"pool has shape {shape}; the canonical layout is [2, P, page_size, K, D]")
        _, num_pages, page_size, num_kv_heads, head_dim = shape
        return num_pages, page_size, num_kv_heads, head_dim

    def from_canonical(self, pool: jax.Array) -> jax.Array:
        """[2, P, page_size, K, D] -> this layout (the same keys and values)."""
        if self.name == "canonical":
            return pool
        return jnp.concatenate([pool[0], pool[1]], axis=-1).transpose(0, 2, 1, 3)  # [P, K, ps, 2D]

    def to_canonical(self, pool: jax.Array) -> jax.Array:
        """This layout -> [2, P, page_size, K, D] (references and tests read that)."""
        if self.name == "canonical":
            return pool
        head_dim = pool.shape[-1] // 2
        kv = pool.transpose(0, 2, 1, 3)  # [P, ps, K, 2D]
        return jnp.stack([kv[..., :head_dim], kv[..., head_dim:]])


CANONICAL = KVLayout("canonical")
TPU = KVLayout("tpu")


def get(layout: "KVLayout | str | None") -> KVLayout:
    """A KVLayout from a layout, its name, or None (canonical)."""
    if layout is None:
        return CANONICAL
    return layout if isinstance(layout, KVLayout) else KVLayout(layout)


def for_backend(backend: str | None, quantized: bool = False, latent: bool = False) -> KVLayout:
    """The layout a pool made for this kernel family gets: "tpu" for the TPU Pallas kernels on a
    plain (unquantised, non-latent) pool, canonical otherwise."""
    return TPU if backend == "tpu" and not quantized and not latent else CANONICAL
