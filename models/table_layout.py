"""The device layout of the token embedding table, the one weight the step reads both by rows
(the token gather) and as a whole (the tied LM head's product).

A TPU lays a 2-D array out in (8 | 16, 128) tiles, and its default layout for an array is the one
that pads least. For a table [V, H] whose H is not a multiple of 128 (SmolLM2's 576) and whose V
is (49,152), that is column-major: the LM head's product takes it as it is, but the token gather
wants rows, so XLA copies the whole table row-major in every step (54 MiB for SmolLM2; what
scripts/tpu_compile_check.py counts as a weight copy). A runner on TPU therefore holds the table
row-major: the gather reads its rows, the product contracts over the lane axis, and nothing is
copied, for the lane padding (576 -> 640: 6 MiB for SmolLM2). Where the default layout is
row-major already (H a multiple of 128, or the CPU and GPU, whose default is row-major) placing
it so changes nothing.

Quantised tables (embedding_q and its per-row scale and offset, models/quant.py) are gathered by
rows too and take the same layout.
"""

from __future__ import annotations

import jax

TABLE = "embed_tokens"  # the embedding module's name in every family (models/layers.Embedding)


def holds_row_major(backend: str | None) -> bool:
    """Whether a runner on `backend` places its table row-major itself (the TPU only: elsewhere
    the default layout is row-major)."""
    return backend == "tpu"


def row_major_tables(params: dict) -> dict:
    """`params` with the embedding table's 2-D leaves placed row-major: arrays moved (one copy at
    placement, in place of one in every step), jax.ShapeDtypeStructs given the layout for
    ahead-of-time compilation (without a sharding of their own: on jax's default device)."""
    from jax.experimental.layout import Format, Layout

    def place(leaf):
        if len(leaf.shape) != 2:
            return leaf
        sharding = getattr(leaf, "sharding", None)
        if sharding is None:
            sharding = jax.sharding.SingleDeviceSharding(_default_device())
        row_major = Format(Layout(major_to_minor=(0, 1)), sharding)
        if _is_row_major(leaf, sharding):  # placed so already (at load): shared, not copied
            return leaf
        if isinstance(leaf, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=row_major)
        return jax.device_put(leaf, row_major)

    if TABLE not in params:
        return params
    return {**params, TABLE: jax.tree.map(place, params[TABLE])}


def _is_row_major(leaf, sharding) -> bool:
    """Whether an array is placed row-major on `sharding` already: committed (jit keeps a committed
    argument's layout), its layout's major-to-minor order (0, 1) (a placed layout also names its
    tiles, so the order is what is compared)."""
    fmt = getattr(leaf, "format", None)
    layout = getattr(fmt, "layout", None)
    return (not isinstance(leaf, jax.ShapeDtypeStruct) and getattr(leaf, "committed", False) and layout is not None
            and tuple(getattr(layout, "major_to_minor", ())) == (0, 1) and fmt.sharding == sharding)


def _default_device():
    device = jax.config.jax_default_device  # a jax.default_device context's, a Device or a platform name
    if device is None or isinstance(device, str):
        return jax.devices(device)[0]
    return device
