"""GGUF block formats decoded into the affine int8 form of models/quant.py, without going through f32.

Every format below is exactly `w = q * scale + offset` with q a small integer, one (scale, offset)
per group of G consecutive weights along a row (the row is a HF [out, in] weight's input axis):

    format  block bytes  weights  G   q range    scale            offset
    Q8_0    34           32       32  -128..127  d (f16)          none
    Q4_0    18           32       32  -8..7      d (f16)          none        (stored nibble - 8)
    Q4_1    20           32       32  0..15      d (f16)          m (f16)
    Q4_K    144          256      32  0..15      d * sc (6 bit)   -dmin * m (6 bit)
    Q6_K    210          256      16  -32..31    d * sc (int8)    none        (stored 6 bits - 32)

so "int8 first" is lossless: q fits int8 and scale/offset are f32 products of an f16 and a small
integer, which f32 holds exactly. The products are formed in the same order as `gguf.quants`
(the package's numpy reference, which transformers also uses) so q * scale + offset rounds to
the very values it returns; tests/models/test_gguf_quants.py checks each format against it.

`decode(raw, type_name)`: raw u8[rows, bytes_per_row] (a GGUFReader tensor's `.data`) ->
(q i8[rows, cols], scale f32[rows, cols / G], offset f32[rows, cols / G] | None).
"""

from __future__ import annotations

import numpy as np

# format -> (bytes per block, weights per block, group size G)
BLOCKS = {
    "Q8_0": (34, 32, 32),
    "Q4_0": (18, 32, 32),
    "Q4_1": (20, 32, 32),
    "Q4_K": (144, 256, 32),
    "Q6_K": (210, 256, 16),
}
FORMATS = tuple(BLOCKS)


def _f16(raw: np.ndarray) -> np.ndarray:
    """u8[..., 2] little-endian halves -> f32[...]."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """u8[..., 16] -> u8[..., 32]: the low nibbles are weights 0..15, the high ones 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q8_0(b):
    d = _f16(b[:, 0:2])[:, None]
    return b[:, 2:].view(np.int8), d, None


def _q4_0(b):
    d = _f16(b[:, 0:2])[:, None]
    return _nibbles(b[:, 2:]).astype(np.int8) - np.int8(8), d, None


def _q4_1(b):
    d, m = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
    return _nibbles(b[:, 4:]).astype(np.int8), d, m


def _k4_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 (scale, min) 6-bit pairs of a Q4_K block from its 12 packed bytes: u8[n, 12] ->
    (u8[n, 8], u8[n, 8]). Pairs 0..3 are the low 6 bits of bytes 0..3 and 4..7; pairs 4..7 take
    their low 4 bits from bytes 8..11 and their top 2 bits from the spare bits of bytes 0..7."""
    lo, mid, hi = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc, mn


def _q4_k(b):
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
    sc, mn = _k4_scales(b[:, 4:16])
    qs = b[:, 16:].reshape(n, 4, 32)  # four runs of 64 weights: low nibbles, then high nibbles
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, 256).astype(np.int8)
    return q, d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _q6_k(b):
    n = b.shape[0]
    ql, qh = b[:, 0:128].reshape(n, 2, 64), b[:, 128:192].reshape(n, 2, 32)
    sc = b[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])[:, None]
    # Each half of 128 weights: four runs of 32, low 4 bits from ql, top 2 bits from qh.
    low = np.concatenate([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=-1)
    high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=-1)
    q = (low | (high << 4)).reshape(n, 256).astype(np.int8) - np.int8(32)
    return q, d * sc, None


_DECODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q6_K": _q6_k}


def decode(raw: np.ndarray, type_name: str):
    """(q, scale, offset) of the blocks in `raw` (see the module docstring); leading axes of
    `raw` beyond the rows are kept (a 3-D expert tensor decodes to 3-D arrays)."""
    if type_name not in BLOCKS:
        raise ValueError(f"GGUF type {type_name!r} has no int8 form; supported: {FORMATS}")
    block_bytes, block_size, group = BLOCKS[type_name]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if raw.shape[-1] % block_bytes:
        raise ValueError(f"{type_name} row of {raw.shape[-1]} bytes is not whole {block_bytes}-byte blocks")
    lead = raw.shape[:-1]
    num_blocks = raw.shape[-1] // block_bytes
    q, scale, offset = _DECODERS[type_name](raw.reshape(-1, block_bytes))
    cols = num_blocks * block_size
    groups = cols // group
    q = q.reshape(*lead, cols)
    scale = np.broadcast_to(scale, (q.size // cols * num_blocks, block_size // group)).reshape(*lead, groups)
    if offset is not None:
        offset = np.broadcast_to(offset, (q.size // cols * num_blocks, block_size // group)).reshape(*lead, groups)
        offset = np.ascontiguousarray(offset, dtype=np.float32)
    return q, np.ascontiguousarray(scale, dtype=np.float32), offset


def dequantize(q: np.ndarray, scale: np.ndarray, offset: np.ndarray | None) -> np.ndarray:
    """f32 weights of a decoded row-major form: groups run along the last axis."""
    group = q.shape[-1] // scale.shape[-1]
    w = q.reshape(*scale.shape, group).astype(np.float32) * scale[..., None]
    if offset is not None:
        w = w + offset[..., None]
    return w.reshape(q.shape)
