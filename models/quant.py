"""Weight-only quantisation: one in-memory form for int8 per-channel weights and GGUF's block formats.

A quantised weight is int8 values with one f32 scale (and, for the affine formats, one f32
offset) per group of G consecutive weights along the contraction axis:

    Linear kernel [I, O] (paxpage layout, x @ kernel):
        kernel_q      i8[I, O]
        kernel_scale  f32[I / G, O]
        kernel_offset f32[I / G, O]   (only Q4_1 / Q4_K)
        w[i, o] = kernel_q[i, o] * kernel_scale[i // G, o] (+ kernel_offset[i // G, o])
    Embedding table [V, H] (rows gathered; the tied LM head contracts over H):
        embedding_q i8[V, H], embedding_scale f32[V, H / G], embedding_offset f32[V, H / G]
    MoE experts [E, I, O] (gate_up_proj, down_proj; each expert a kernel):
        gate_up_proj_q i8[E, I, O], gate_up_proj_scale f32[E, I / G, O] (and so on)

int8 per output channel (`quantization="int8"`) is the case G = I (one group: scale [1, O]; the
tied embedding gets one scale per vocabulary row, i.e. per LM-head output channel); a GGUF
file's Q8_0 / Q4_0 / Q4_1 / Q4_K tensors are G = 32 and Q6_K G = 16 (models/gguf_quants.py),
held exactly; gpt-oss's MXFP4 experts are G = 32 with power-of-two scales (models/moe_layout.py),
held exactly too, and by default in their own 4 bits: `q` is then u8[..., I / 2, O], two e2m1 codes
a byte (inputs 2j and 2j + 1 in the low and high nibble), each standing for twice its e2m1 value
(`unpack_e2m1`: an integer in [-12, 12]), so every formula below reads it as the int8 values it
packs. GGUF's 4-bit values sit one per int8 byte (not packed two per byte): 1.25 bytes a weight
for Q4_x, against 4 for f32.

Scales and offsets stay f32 whatever the model dtype (a bf16 scale would round GGUF's exact
products); the matmul dequantises on the fly: per-channel as (x @ q) * scale, grouped by
expanding the weight to the compute dtype first (on GPU/TPU XLA fuses the expansion into the
dot's operand; on CPU it is a separate pass, see docs/quantisation.md).

Why not Qwix: qwix 0.1.8 works with this jax and quantises flax Dense layers, but it wraps the
model (`quantize_model`), stores each weight as a `WithAux(QArray)` pytree node, and expresses
affine formats through a zero point ((q - zp) * scale), which cannot hold GGUF's Q4_1 / Q4_K
minimums exactly; our sharding table, the on-disk cache and the checkpoint code all work on flat
named arrays. This module keeps all of those unchanged.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

QUANTIZATIONS = (None, "none", "gguf", "int8")
# Quantised leaves: "<name>_q", "<name>_scale", "<name>_offset" replace the float leaf <name>.
Q, SCALE, OFFSET = "_q", "_scale", "_offset"
# The float leaves that may be quantised: Linear kernels, the embedding table and MoE experts.
QUANTIZABLE = ("kernel", "embedding", "gate_up_proj", "down_proj")
# Of those, the ones that are kernels ([..., I, O], contracted over I): all but the embedding.
EXPERT_LEAVES = ("gate_up_proj", "down_proj")


class QuantizedWeight(NamedTuple):
    """A quantised kernel as a step holds it (a pytree: q i8[..., I, O], or two e2m1 codes a byte
    u8[..., I / 2, O]; scale / offset f32[..., I / G, O], offset None for the symmetric formats and
    the 4-bit codes): MoE experts pass through the grouped matmuls in this form (models/moe.py)."""
    q: Any
    scale: Any
    offset: Any = None

    @property
    def packed(self) -> bool:
        """q holds two e2m1 codes a byte (u8[..., I / 2, O]; `unpack_e2m1`)."""
        return np.dtype(self.q.dtype) == np.uint8

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's logical shape [..., I, O]."""
        *lead, rows, cols = self.q.shape
        return (*lead, 2 * rows if self.packed else rows, cols)

    @property
    def per_channel(self) -> bool:
        """int8 values with one scale per output channel and no offset: the product is scaled."""
        return self.scale.shape[-2] == 1 and self.offset is None and not self.packed


# Twice the value of each e2m1 4-bit code (sign, 2 exponent bits, 1 mantissa bit): exact integers.
E2M1_X2 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


def unpack_e2m1(packed):
    """u8[..., I / 2, O] (two e2m1 codes a byte, input 2j low) -> i8[..., I, O], twice each code's
    value. Arithmetic rather than a table lookup, so that XLA fuses it into the matmul that reads it:
    magnitude codes 0-3 are 0-3; 4-7 are (2 | bit 0) << (bits 1-2 - 1), i.e. 4, 6, 8, 12."""
    if isinstance(packed, np.ndarray):
        codes = np.stack([packed & 0x0F, packed >> 4], axis=-2)
        return E2M1_X2[codes].reshape(*packed.shape[:-2], 2 * packed.shape[-2], packed.shape[-1])
    values = jnp.stack([_e2m1_x2(packed & 0x0F), _e2m1_x2(packed >> 4)], axis=-2)  # [..., I / 2, 2, O]
    return values.reshape(*packed.shape[:-2], 2 * packed.shape[-2], packed.shape[-1])


def _e2m1_x2(codes):
    """u8 e2m1 codes (0-15) -> i8, twice each value, elementwise in 8 bits (see unpack_e2m1)."""
    k = codes & 7
    magnitude = jnp.where(k < 4, k, (2 | (k & 1)) << ((k >> 1) - 1)).astype(jnp.int8)
    return jnp.where(codes >= 8, -magnitude, magnitude)


def _packed_matmul(x, q, scale):
    """x [..., I] @ a packed kernel (q u8[I / 2, O], scale f32[I / G, O]) -> [..., O] in x's dtype,
    as two products, the even inputs against the low nibbles and the odd ones against the high:
    each operand is an elementwise function of q and the scale, which XLA fuses into its matmul,
    where interleaving the two halves back into [I, O] would be a copy of the whole expert."""
    rows, out = q.shape
    per_group = rows // scale.shape[0]  # G / 2 rows of each nibble per scale

    def half(codes):
        w = _e2m1_x2(codes).astype(jnp.float32).reshape(scale.shape[0], per_group, out) * scale[:, None, :]
        return w.reshape(rows, out).astype(x.dtype)

    y = jnp.dot(x[..., 0::2], half(q & 0x0F), preferred_element_type=jnp.float32)
    y = y + jnp.dot(x[..., 1::2], half(q >> 4), preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def is_scale_path(path: str) -> bool:
    return path.endswith(SCALE) or path.endswith(OFFSET)


def base_name(path: str) -> str:
    """"layers_0/q_proj/kernel_scale" -> "layers_0/q_proj/kernel"; other paths unchanged."""
    for suffix in (Q, SCALE, OFFSET):
        leaf = path.rsplit("/", 1)[-1]
        if leaf in tuple(n + suffix for n in QUANTIZABLE):
            return path[: -len(suffix)]
    return path


# ------------------------------------------------------------------ in the jitted step

def dequantize_kernel(q, scale, offset, dtype):
    """q i8[..., I, O] (or packed e2m1 codes u8[..., I / 2, O]), scale/offset f32[..., I / G, O]
    -> dtype[..., I, O] (leading axes: a stack's layers, or a kernel's column panels,
    models/panel_layout.py)."""
    if jnp.dtype(q.dtype) == jnp.uint8:
        q = unpack_e2m1(q)
    *lead, num_groups, out = scale.shape
    w = q.reshape(*lead, num_groups, -1, out).astype(jnp.float32) * scale[..., :, None, :]
    if offset is not None:
        w = w + offset[..., :, None, :]
    return w.reshape(q.shape).astype(dtype)


def quantized_matmul(x, q, scale, offset=None):
    """x [..., I] @ the quantised kernel -> [..., O] in x's dtype."""
    if jnp.dtype(q.dtype) == jnp.uint8:  # two e2m1 codes a byte (symmetric: no offset)
        assert offset is None, "packed e2m1 codes take no offset"
        return _packed_matmul(x, q, scale)
    if scale.shape[0] == 1 and offset is None:  # per output channel: scale the product
        y = jnp.dot(x, q.astype(x.dtype), preferred_element_type=jnp.float32) * scale[0]
        return y.astype(x.dtype)
    return jnp.dot(x, dequantize_kernel(q, scale, offset, x.dtype))


def dequantize_rows(q, scale, offset, dtype):
    """Rows of a quantised table: q i8[..., H], scale/offset f32[..., H / G] -> dtype[..., H]."""
    group = q.shape[-1] // scale.shape[-1]
    w = q.reshape(*scale.shape, group).astype(jnp.float32) * scale[..., None]
    if offset is not None:
        w = w + offset[..., None]
    return w.reshape(q.shape).astype(dtype)


def expand(w, dtype):
    """A kernel as floats: a float array cast to `dtype`, a QuantizedWeight dequantised."""
    if isinstance(w, QuantizedWeight):
        return dequantize_kernel(w.q, w.scale, w.offset, dtype)
    return w.astype(dtype)


def matmul(x, w):
    """x [..., I] @ a kernel [I, O], float or a QuantizedWeight -> [..., O] in x's dtype."""
    if isinstance(w, QuantizedWeight):
        return quantized_matmul(x, w.q, w.scale, w.offset)
    return x @ w


def module_weight(module, name: str):
    """(q, scale, offset | None) when a flax module's params hold `name` quantised, else None:
    the params tree decides, so one model definition runs float, int8 and GGUF weights."""
    if not module.has_variable("params", name + Q):
        return None
    offset = module.get_variable("params", name + OFFSET) if module.has_variable("params", name + OFFSET) else None
    return QuantizedWeight(module.get_variable("params", name + Q), module.get_variable("params", name + SCALE),
                           offset)


def quantized_attend(x, q, scale, offset=None):
    """x [R, H] against every row of the quantised table [V, H] -> [R, V] (the tied LM head)."""
    if scale.shape[-1] == 1 and offset is None:  # one scale per row = per output channel
        y = jnp.dot(x, q.astype(x.dtype).T, preferred_element_type=jnp.float32) * scale[:, 0]
        return y.astype(x.dtype)
    return jnp.dot(x, dequantize_rows(q, scale, offset, x.dtype).T)


# ------------------------------------------------------------------ on the host, flat trees

def quantize_int8(w: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 with one scale per slice along every axis but `axis` (the contraction
    axis, which the scale's shape keeps as length 1): w ~ q * scale, |q| <= 127."""
    w = np.asarray(w, dtype=np.float32)
    amax = np.max(np.abs(w), axis=axis, keepdims=True)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return q, scale


def _contraction_axis(name: str) -> int:
    return -1 if name.endswith("embedding") else -2  # kernels [I, O] and experts [E, I, O]; the table [V, H]


def _is_expert(path: str) -> bool:
    return base_name(path).rsplit("/", 1)[-1] in EXPERT_LEAVES


def quantize_flat_int8(flat: dict[str, Any]) -> dict[str, Any]:
    """Every float kernel, the embedding and the MoE experts -> int8 per output channel (per
    expert for experts). Quantised leaves are expanded first and re-quantised, except experts
    that come quantised (gpt-oss's MXFP4, already int8 and exact): they stay as they are. The
    router and biases stay float."""
    kept = {path: x for path, x in flat.items() if _is_expert(path) and base_name(path) + Q in flat}
    flat = dequantize_flat({path: x for path, x in flat.items() if path not in kept})
    out = dict(kept)
    for path, x in flat.items():
        leaf = path.rsplit("/", 1)[-1]
        if leaf in QUANTIZABLE and np.ndim(x) == (3 if leaf in EXPERT_LEAVES else 2):
            q, scale = quantize_int8(np.asarray(x, dtype=np.float32), _contraction_axis(path))
            out[path + Q], out[path + SCALE] = q, scale
        else:
            out[path] = x
    return out


def dequantize_flat(flat: dict[str, Any]) -> dict[str, Any]:
    """The f32 expansion of every quantised leaf (the `quantization="none"` form)."""
    out = {}
    for path, x in flat.items():
        if path.endswith(SCALE) or path.endswith(OFFSET):
            continue
        base = base_name(path)
        if base != path:  # a "_q" leaf (scales and offsets were skipped above)
            q, scale, offset = (np.asarray(flat[base + s]) if base + s in flat else None for s in (Q, SCALE, OFFSET))
            if q.dtype == np.uint8:
                q = unpack_e2m1(q)
            if _contraction_axis(base) == -2:  # kernels: groups along axis -2 -> work on the transpose
                t = lambda a: None if a is None else np.swapaxes(a, -1, -2)  # noqa: E731
                w = t(_expand(t(q), t(scale), t(offset)))
            else:
                w = _expand(q, scale, offset)
            out[base] = np.ascontiguousarray(w)
        else:
            out[path] = x
    return out


def _expand(q, scale, offset):  # row-major groups along the last axis, numpy f32
    group = q.shape[-1] // scale.shape[-1]
    w = q.reshape(*scale.shape, group).astype(np.float32) * scale[..., None]
    if offset is not None:
        w = w + offset[..., None]
    return w.reshape(q.shape)


def cast_params(params, dtype, to_array=jnp.asarray):
    """Float leaves to `dtype`, except quantisation scales / offsets (f32) and int8 values."""
    dt = jnp.dtype(dtype)

    def cast(path, x):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        if np.dtype(x.dtype) in (np.int8, np.uint8):  # quantised values (uint8: packed e2m1 codes)
            return to_array(x)
        return to_array(x, jnp.float32 if is_scale_path(name) else dt)
    return jax.tree_util.tree_map_with_path(cast, params)


def bytes_by_dtype(params, per_device: bool = False) -> dict[str, int]:
    """{dtype name: bytes} over the leaves of a params tree; `per_device`: what the first device
    holds of each (sharded) jax array, rather than the whole."""
    out: dict[str, int] = {}
    for leaf in jax.tree.leaves(params):
        name = np.dtype(leaf.dtype).name
        shape = leaf.shape
        if per_device and isinstance(leaf, jax.Array) and leaf.addressable_shards:
            shape = leaf.addressable_shards[0].data.shape
        out[name] = out.get(name, 0) + int(np.prod(shape)) * np.dtype(leaf.dtype).itemsize
    return out
