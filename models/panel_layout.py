"""Dense kernels held in column panels, the form the native CPU matmul streams
(pallas_kernels/native_linear.py).

A Linear's float kernel [I, O] with O a multiple of 64 may be held as `kernel_panels`
[P, I, 64] (P = O / 64): panel p is columns [64p, 64p + 64), one contiguous block. The same
weights, the same bytes; only the order in memory differs. Stacked params carry their leading
layer axis in front: [L, P, I, 64] against [L, I, O].

`paxpage.load` holds an f32 or bf16 model's kernels this way on CPU where the default engine runs
the native matmul (paxpage/held_form.py), so the weights are held once in the form that runs.
Runners that run XLA's dot (tensor parallelism, `attention_impl="xla"`) take a copy in the plain
form (models/param_forms.py), and a checkpoint is always written plain (`Model.per_layer_params`).
Kernels whose O is not a multiple of 64 stay as they are.

A quantised kernel (models/quant.py: kernel_q i8[I, O], kernel_scale / kernel_offset f32[I / Q, O])
goes into panels the same way, each of its arrays: `kernel_panels_q` [P, I, 64] and
`kernel_panels_scale` / `kernel_panels_offset` [P, I / Q, 64], which the native matmul
dequantises as it streams them.

A tied LM head multiplies by the embedding table's transpose, so a tied float table [V, H] with V
a multiple of 64 is held the same way, as `embedding_panels` [V / 64, H, 64] (panel p: vocabulary
rows [64p, 64p + 64), each transposed): the head runs as the native matmul, and a token's
embedding row is gathered across its panel (H values 64 apart). A quantised tied table
(embedding_q [V, H], embedding_scale / _offset [V, H / Q]) likewise: `embedding_panels_q`
[V / 64, H, 64] and `embedding_panels_scale` / `_offset` [V / 64, H / Q, 64].

Axis legend: L layers, I input width, O output width, P panels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models import quant, table_layout
from pallas_kernels.native_linear import PANEL_DTYPES

PANEL = 64
PLAIN = "kernel"
PANELS = "kernel_panels"
TABLE = "embedding"
TABLE_PANELS = "embedding_panels"
# The dtypes held in panels: those the native matmul reads as stored.
DTYPES = PANEL_DTYPES
# A quantised weight's arrays (models/quant.py suffixes) and their names in panels.
QUANT_SUFFIXES = (quant.Q, quant.SCALE, quant.OFFSET)
PANELS_Q, PANELS_SCALE, PANELS_OFFSET = (PANELS + suffix for suffix in QUANT_SUFFIXES)
TABLE_PANELS_Q, TABLE_PANELS_SCALE, TABLE_PANELS_OFFSET = (TABLE_PANELS + suffix for suffix in QUANT_SUFFIXES)
# plain name -> its name in panels, and how each goes back
_PLAIN_OF = {PANELS: (PLAIN, "kernel"), TABLE_PANELS: (TABLE, "table"),
             **{PANELS + x: (PLAIN + x, "kernel") for x in QUANT_SUFFIXES},
             **{TABLE_PANELS + x: (TABLE + x, "table") for x in QUANT_SUFFIXES}}


def to_panels(kernel):
    """[..., I, O] -> [..., P, I, 64] (O a multiple of 64)."""
    *lead, i, o = kernel.shape
    xp = np if isinstance(kernel, np.ndarray) else jnp
    return xp.swapaxes(kernel.reshape(*lead, i, o // PANEL, PANEL), -3, -2)


def from_panels(panels):
    """[..., P, I, 64] -> [..., I, O = 64 P] (a ShapeDtypeStruct gives the plain one's)."""
    *lead, p, i, c = panels.shape
    if isinstance(panels, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((*lead, i, p * c), panels.dtype)
    xp = np if isinstance(panels, np.ndarray) else jnp
    return xp.swapaxes(panels, -3, -2).reshape(*lead, i, p * c)


def table_to_panels(table):
    """[..., V, H] -> [..., V / 64, H, 64]: the panels of the [H, V] transpose (V a multiple of 64)."""
    *lead, v, h = table.shape
    xp = np if isinstance(table, np.ndarray) else jnp
    return xp.swapaxes(table.reshape(*lead, v // PANEL, PANEL, h), -1, -2)


def table_from_panels(panels):
    """[..., V / 64, H, 64] -> [..., V, H] (a ShapeDtypeStruct gives the plain one's)."""
    *lead, p, h, c = panels.shape
    if isinstance(panels, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((*lead, p * c, h), panels.dtype)
    xp = np if isinstance(panels, np.ndarray) else jnp
    return xp.swapaxes(panels, -1, -2).reshape(*lead, p * c, h)


def packable(kernel, axis: int = -1) -> bool:
    """An f32 or bf16 array (what the native matmul reads) whose `axis` (a kernel's output width;
    a table's vocabulary) splits into panels."""
    return kernel.ndim >= 2 and kernel.shape[axis] % PANEL == 0 and jnp.dtype(kernel.dtype) in DTYPES


def packable_quantized(params: dict, name: str, axis: int = -1) -> bool:
    """Whether `params` holds `name` quantised (name_q int8, name_scale) with `axis` of name_q (a
    kernel's output width; a table's vocabulary) splitting into panels."""
    q, scale = params.get(name + quant.Q), params.get(name + quant.SCALE)
    return q is not None and scale is not None and q.ndim >= 2 and q.shape[axis] % PANEL == 0 \
        and jnp.dtype(q.dtype) == jnp.int8


def holds_panels(params) -> bool:
    """Whether any kernel (or the table) of `params` is held in panels."""
    if not isinstance(params, dict):
        return False
    return any(name in _PLAIN_OF for name in params) or any(holds_panels(v) for v in params.values())


def pack(params: dict, tied_table: bool = False) -> dict:
    """Every packable Linear kernel of `params` in panels, and the embedding table when
    `tied_table` (the model's LM head is its transpose) and it is packable. The plain arrays are
    let go as each is packed (the caller's tree is emptied of them), so packing holds one extra
    kernel at a time."""
    out = _pack_kernels(params)
    table = out.get(table_layout.TABLE)
    if tied_table and isinstance(table, dict):
        if TABLE in table and packable(table[TABLE], axis=-2):
            value = table.pop(TABLE)
            table[TABLE_PANELS] = _own(table_to_panels(value))
            del value
        elif packable_quantized(table, TABLE, axis=-2):
            for suffix in QUANT_SUFFIXES:
                if TABLE + suffix in table:
                    value = table.pop(TABLE + suffix)
                    table[TABLE_PANELS + suffix] = _own(table_to_panels(value))
                    del value
    return out


def _pack_kernels(params: dict) -> dict:
    out = {}
    quantised = packable_quantized(params, PLAIN)
    for name in list(params):
        value = params[name]
        if isinstance(value, dict):
            out[name] = _pack_kernels(value)
        elif name == PLAIN and packable(value) or quantised and name in (PLAIN + x for x in QUANT_SUFFIXES):
            del params[name]
            out[PANELS + name[len(PLAIN):]] = _own(to_panels(value))
            del value
        else:
            out[name] = value
    return out


def unpack(params):
    """`params` with every kernel (and the table) in panels back in the plain form (a copy of those)."""
    if not isinstance(params, dict):
        return params
    out = {}
    for name, value in params.items():
        if name in _PLAIN_OF:
            plain, kind = _PLAIN_OF[name]
            out[plain] = (from_panels if kind == "kernel" else table_from_panels)(value)
        else:
            out[name] = unpack(value)
    return out


def _own(x):
    """A contiguous array of its own: numpy's swap is a view of the plain kernel (jnp's is a new array)."""
    return np.ascontiguousarray(x) if isinstance(x, np.ndarray) else x
