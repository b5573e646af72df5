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

A quantised pool (kv_quant.QuantizedKV) has its values in the same layout as a plain one and
its per-(token, kv head, K | V) scales beside them:
- canonical: SCALE_DTYPES["canonical"] (bf16) [2, P, page_size, K], the values' leading axes;
  f32 in the XLA-op path's pools (XLA_CANONICAL), holding the same bf16 values.
- tpu: i32 [K, R, 1, W], head-major rows of W = 128 lanes (`ScaleRows`): row r of head h holds
  the scales of pages r * pages_per_row .. (r + 1) * pages_per_row - 1, slot s of page p at lane
  (p % pages_per_row) * lanes_per_page + s, one 32-bit word holding that slot's key and value
  scales as a bf16 pair (`pack_scale_pairs`: the key's bits high, the value's low). A bf16
  [2, P, page_size, K] array puts K (1 to 8) on a tile's 128 lanes and XLA keeps it in a
  transposed layout, so a Mosaic kernel made it copy the scales on every call; these rows are one
  dense (1, 128) tile each, a page's block is one DMA of one row per head, and the kernels take
  the page's lanes with one lane rotation and split each word with a shift and a mask
  (`unpack_scale_pairs`). A 32-bit word, not two bf16 lanes: a (1, 128) row tile exists for
  32-bit types only. The pair holds the bf16 scales exactly, 2 bytes each as in the canonical
  layout.

Which layout a pool gets is decided where the pool is made (`for_backend`), and every reader
(kernels, page copies, sharding, sizing) asks the layout for shapes and axes instead of
hard-coding them. scripts/tpu_compile_check.py measures each layout's compiled bytes and copies
(docs/gpu-tpu.md has the figures).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

LAYOUTS = ("canonical", "tpu")
# A quantised pool's scale dtype in each layout (the canonical one is kv_quant.SCALE_DTYPE).
# (tpu: 32-bit words, each a packed bf16 pair; the scales themselves are bf16 in both)
SCALE_DTYPES = {"canonical": jnp.bfloat16, "tpu": jnp.int32}
# A word no packed pair is (its key half is bf16 -inf, and a scale is never negative): the TPU
# scale write marks the lanes a row keeps with it.
NO_PAIR = -(1 << 23)  # 0xFF800000
LANES = 128  # a TPU tile's lane count


def pack_scale_pairs(k_scales: jax.Array, v_scales: jax.Array) -> jax.Array:
    """Key and value scales (any float dtype, rounded to bf16, the scales' own dtype) -> i32
    words of the same shape, each the key's bf16 bits in its high half and the value's low.
    Integers, so that nothing treats a word as a float (a denormal or NaN one) on the way."""
    bits = lambda x: lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16).astype(jnp.int32)  # noqa: E731
    return (bits(k_scales) << 16) | bits(v_scales)


def unpack_scale_pairs(words: jax.Array) -> tuple[jax.Array, jax.Array]:
    """i32 words of `pack_scale_pairs` -> (key scales, value scales) f32, the bf16 values exactly
    (a bf16 is the high half of the f32 it widens to). A mask, a shift and bitcasts: elementwise
    integer ops that Mosaic TPU lowers."""
    high = lax.bitcast_convert_type(words & jnp.int32(-(1 << 16)), jnp.float32)
    low = lax.bitcast_convert_type(words << 16, jnp.float32)
    return high, low


@dataclasses.dataclass(frozen=True)
class ScaleRows:
    """Where the tpu layout keeps page scales: each page's page_size words (a packed key and value
    scale per slot) take `lanes_per_page` lanes (a power of two dividing 128, or a multiple of
    128), `pages_per_row` pages share a row of `row_width` lanes."""

    page_size: int

    @property
    def lanes_per_page(self) -> int:
        need = self.page_size
        if need <= LANES:
            return 1 << (need - 1).bit_length()
        return -(-need // LANES) * LANES

    @property
    def pages_per_row(self) -> int:
        return max(1, LANES // self.lanes_per_page)

    @property
    def row_width(self) -> int:
        return max(LANES, self.lanes_per_page)

    def num_rows(self, num_pages: int) -> int:
        return -(-num_pages // self.pages_per_row)

    def lane(self, page, slot):
        """Lane of (page, slot) in its row (row = page // pages_per_row); ints or arrays."""
        return (page % self.pages_per_row) * self.lanes_per_page + slot


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """One layer's pool layout (a static value: hashable, usable as a jit static argument)."""

    name: str  # one of LAYOUTS
    # Canonical scales held in f32 (the bf16 scales kv_quant.quantize makes, stored exactly): the
    # XLA-op attention path's pools. XLA CPU gathers a bf16 array by converting all of it to f32,
    # in every layer of every step (~0.6 s per SmolLM2 int8 step on a 2-core AMD EPYC, jax
    # 0.10.2); an f32 one it reads in place. The native kernel reads bf16 scales as stored.
    wide_scales: bool = False

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

    @property
    def scale_dtype(self):
        """A quantised pool's scale dtype in this layout."""
        return jnp.dtype(jnp.float32 if self.wide_scales else SCALE_DTYPES[self.name])

    def scale_shape(self, num_pages: int, page_size: int, num_kv_heads: int) -> tuple[int, ...]:
        """A quantised pool's scales array shape."""
        if self.name == "tpu":
            rows = ScaleRows(page_size)
            return (num_kv_heads, rows.num_rows(num_pages), 1, rows.row_width)
        return (2, num_pages, page_size, num_kv_heads)

    def scale_bytes_per_page(self, page_size: int) -> int:
        """Bytes one kv head's scales (K and V) take per page of a quantised pool, lane padding
        included (the tpu layout's last row also pads to whole rows: under one row per pool)."""
        if self.name == "tpu":
            return ScaleRows(page_size).lanes_per_page * self.scale_dtype.itemsize
        return 2 * page_size * self.scale_dtype.itemsize

    @property
    def scale_head_axis(self) -> int:
        """The scales' axis of kv heads (split with the values' by tensor parallelism)."""
        return 0 if self.name == "tpu" else 3

    def from_canonical(self, pool):
        """[2, P, page_size, K, D] (or a kv_quant.QuantizedKV of canonical values and scales) ->
        this layout (the same keys, values and scales)."""
        if self.name == "canonical":
            return pool
        if hasattr(pool, "scales"):  # a QuantizedKV
            return dataclasses.replace(pool, pages=self.from_canonical(pool.pages),
                                       scales=self.scales_from_canonical(pool.scales))
        return jnp.concatenate([pool[0], pool[1]], axis=-1).transpose(0, 2, 1, 3)  # [P, K, ps, 2D]

    def to_canonical(self, pool):
        """This layout -> [2, P, page_size, K, D] (or a QuantizedKV of canonical arrays):
        references and tests read that."""
        if self.name == "canonical":
            return pool
        if hasattr(pool, "scales"):
            num_pages, _, page_size, _ = pool.pages.shape
            return dataclasses.replace(pool, pages=self.to_canonical(pool.pages),
                                       scales=self.scales_to_canonical(pool.scales, num_pages, page_size))
        head_dim = pool.shape[-1] // 2
        kv = pool.transpose(0, 2, 1, 3)  # [P, ps, K, 2D]
        return jnp.stack([kv[..., :head_dim], kv[..., head_dim:]])

    def scales_from_canonical(self, scales: jax.Array) -> jax.Array:
        """Canonical scales [2, P, page_size, K] -> this layout's."""
        if self.name == "canonical":
            return scales
        _, num_pages, page_size, num_kv_heads = scales.shape
        rows = ScaleRows(page_size)
        per_page = pack_scale_pairs(scales[0], scales[1]).transpose(2, 0, 1)  # [K, P, page_size]
        padded_pages = rows.num_rows(num_pages) * rows.pages_per_row
        per_page = jnp.pad(per_page, ((0, 0), (0, padded_pages - num_pages), (0, rows.lanes_per_page - page_size)))
        flat = per_page.reshape(num_kv_heads, rows.num_rows(num_pages), rows.pages_per_row * rows.lanes_per_page)
        flat = jnp.pad(flat, ((0, 0), (0, 0), (0, rows.row_width - flat.shape[-1])))
        return flat[:, :, None, :].astype(self.scale_dtype)

    def scales_to_canonical(self, scales: jax.Array, num_pages: int, page_size: int) -> jax.Array:
        """This layout's scales -> canonical [2, P, page_size, K] (SCALE_DTYPES["canonical"])."""
        if self.name == "canonical":
            return scales
        rows = ScaleRows(page_size)
        num_kv_heads, num_rows = scales.shape[0], scales.shape[1]
        used = scales[:, :, 0, :rows.pages_per_row * rows.lanes_per_page]
        per_page = used.reshape(num_kv_heads, num_rows * rows.pages_per_row, rows.lanes_per_page)
        per_page = per_page[:, :num_pages, :page_size].transpose(1, 2, 0)  # [P, page_size, K]
        return jnp.stack(unpack_scale_pairs(per_page)).astype(SCALE_DTYPES["canonical"])

    def write_scales(self, scales: jax.Array, page_size: int, slot_mapping: jax.Array,
                     kv_scales: jax.Array) -> jax.Array:
        """scales (this layout) with kv_scales [2, T, K] stored at token t's slot (page_id *
        page_size + offset); padding (-1) and slots past the pool are dropped. An in-place XLA
        scatter on the donated scales; on the tpu layout the reference of the TPU write, which
        updates whole rows by DMA (kv_write._write_scale_rows_tpu)."""
        if self.name == "canonical":
            num_pages = scales.shape[1]
            # (page, offset) directly: a flat-slot reshape makes XLA copy the whole buffer
            page = jnp.where(slot_mapping < 0, num_pages, slot_mapping // page_size)
            return scales.at[:, page, slot_mapping % page_size].set(kv_scales.astype(scales.dtype), mode="drop")
        rows = ScaleRows(page_size)
        num_kv_heads = scales.shape[0]
        page = slot_mapping // page_size  # [T]
        row = jnp.where(slot_mapping < 0, scales.shape[1], page // rows.pages_per_row)
        lane = rows.lane(jnp.maximum(page, 0), slot_mapping % page_size)[:, None]  # [T, 1] against [T, K]
        head = jnp.arange(num_kv_heads)[None, :]
        row = jnp.broadcast_to(row[:, None], kv_scales.shape[1:])
        return scales.at[head, row, 0, lane].set(pack_scale_pairs(kv_scales[0], kv_scales[1]), mode="drop")

    def copy_scale_pages(self, scales: jax.Array, page_size: int, src: jax.Array, dst: jax.Array) -> jax.Array:
        """Copies pages src -> dst (i32[C]) of this layout's scales; a dst past the pool is dropped."""
        if self.name == "canonical":
            return scales.at[:, dst].set(scales[:, src], mode="drop")
        rows = ScaleRows(page_size)
        span = jnp.arange(page_size)[None, :]  # a page's lanes: [1, page_size]
        src_lane = rows.lane(src, 0)[:, None] + span
        dst_lane = rows.lane(dst, 0)[:, None] + span
        src_row = jnp.broadcast_to((src // rows.pages_per_row)[:, None], src_lane.shape)
        # a dst past the pool lands in the last row's unused lanes or past the rows (dropped)
        dst_row = jnp.broadcast_to((dst // rows.pages_per_row)[:, None], dst_lane.shape)
        taken = scales[:, src_row, 0, src_lane]  # [K, C, page_size]
        return scales.at[:, dst_row, 0, dst_lane].set(taken, mode="drop")


def two_token_scatter(slot_mapping: jax.Array, *rows: jax.Array) -> tuple[jax.Array, ...]:
    """(slot_mapping, *rows) for a pool scatter of T tokens (rows [T, ...]), with one padding
    token (slot -1, dropped) appended when T is 1. XLA rewrites a one-index scatter as a
    select around a dynamic-update-slice; where the updated pool then has two users (a scanned
    layer's carry and XLA attention's row view of the pool) that fusion is duplicated and the
    whole pool copied per layer: a one-row SmolLM2 decode step took 7-10 s instead of ~30 ms
    (2-core AMD EPYC, jax 0.10.2). A scatter of two indices stays in place."""
    if slot_mapping.shape[0] != 1:
        return (slot_mapping, *rows)
    pad = jnp.full((1,), -1, slot_mapping.dtype)
    return (jnp.concatenate([slot_mapping, pad]), *(jnp.concatenate([r, jnp.zeros_like(r)]) for r in rows))


CANONICAL = KVLayout("canonical")
XLA_CANONICAL = KVLayout("canonical", wide_scales=True)  # the "xla" attention path's pools
TPU = KVLayout("tpu")


def get(layout: "KVLayout | str | None") -> KVLayout:
    """A KVLayout from a layout, its name, or None (canonical)."""
    if layout is None:
        return CANONICAL
    return layout if isinstance(layout, KVLayout) else KVLayout(layout)


def for_backend(backend: str | None, latent: bool = False) -> KVLayout:
    """The layout a pool made for this kernel family gets: "tpu" for the TPU Pallas kernels (plain
    or quantised), canonical otherwise and for a latent-attention pool."""
    return TPU if backend == "tpu" and not latent else CANONICAL
