"""Reading a compiled TPU program's text (`compiled.as_text()`) for what its memory analysis does
not show: whole copies of a pool leaf or of a weight (relayouts), the pool staged through VMEM,
and f32 arrays of weight shapes (upcasts). scripts/tpu_compile_check.py reports them.

An instruction reads `%name = dtype[dims]{layout} op(%operand, ...)`; HLO names dtypes its own way
(HLO_DTYPES).
"""

from __future__ import annotations

import re

from tpu_targets import device_shape  # noqa: I001 (first: it sets libtpu's environment before jax)

import jax
import jax.numpy as jnp
import numpy as np

# numpy dtype name -> HLO's
HLO_DTYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "int8": "s8", "uint8": "u8",
              "int32": "s32", "float8_e4m3fn": "f8e4m3fn", "float8_e5m2": "f8e5m2"}
ITEMSIZE = {hlo: jnp.dtype(name).itemsize for name, hlo in HLO_DTYPES.items()}
COPY = re.compile(r"= (\w+)\[([0-9,]+)\]\{[^}]*\} copy\(%([^),\s]+)\)")
STEP_PARAM = re.compile(r"%(\S+) = [^\n]*? parameter\(\d+\)[^\n]*op_name=\"params\[")


def leaf_copies(hlo: str, cache) -> list[int]:
    """Per leaf of one layer's cache (a plain pool's one array; a quantised pool's values, then
    its scales): the compiled program's instructions that copy the whole leaf (a relayout)."""
    counts = []
    for leaf in jax.tree.leaves(cache):
        name = HLO_DTYPES[jnp.dtype(leaf.dtype).name]
        pattern = re.compile(re.escape(f"{name}[{','.join(map(str, device_shape(leaf)))}]") + r"\{[^}]*\} copy\(")
        counts.append(len(pattern.findall(hlo)))
    return counts


def pool_copies(hlo: str, cache) -> int:
    """Instructions of the compiled program that copy a whole leaf of a layer's pool (a relayout)."""
    return sum(leaf_copies(hlo, cache))


def pool_staging(hlo: str, cache) -> int:
    """Asynchronous copies of a whole leaf of a layer's pool (its values, or a quantised pool's
    scales), in whatever shape of the leaf's elements XLA gives it: XLA's memory-space assignment
    staging the leaf through VMEM and back (a scheduling choice, not a relayout). A leaf written in
    VMEM and copied back lands in a fresh HBM buffer, not the donated one: a temporary of the
    leaf's bytes for the rest of the step."""
    count = 0
    for leaf in jax.tree.leaves(cache):
        name = HLO_DTYPES[jnp.dtype(leaf.dtype).name]
        size = int(np.prod(device_shape(leaf)))
        for dims in re.findall(r"= \(" + name + r"\[([0-9,]+)\]\{[^}]*\}[^=]*copy-start\(", hlo):
            count += int(np.prod([int(x) for x in dims.split(",")])) == size
    return count


def weight_copies(hlo: str) -> list[tuple[str, int]]:
    """The compiled step's copies of a whole weight, (shape, bytes) each: a relayout of one of its
    params in every step (e.g. an embedding table held in a layout the token gather cannot read;
    models/table_layout.py). Counted wherever the copy lands, VMEM included, where it adds no
    temporary bytes to the memory analysis."""
    params = set(STEP_PARAM.findall(hlo))
    found = []
    for dtype, dims, operand in COPY.findall(hlo):
        if operand in params:
            shape = [int(x) for x in dims.split(",")]
            found.append((f"{dtype}{shape}", int(np.prod(shape)) * ITEMSIZE.get(dtype, 4)))
    return found


def f32_weight_arrays(hlo: str, shapes: set[tuple[int, ...]]) -> list[str]:
    """f32 arrays of one of `shapes` (the weights' per-device shapes) or their transposes: an upcast."""
    found = set()
    for dims in re.findall(r"f32\[([0-9,]+)\]", hlo):
        shape = tuple(int(x) for x in dims.split(","))
        if shape in shapes or shape[::-1] in shapes:
            found.add(f"f32{list(shape)}")
    return sorted(found)
