"""Weights held once, in the dtype and the form they run in: the device's live arrays after loading
a model and building its default engine (layers scanned on CPU: paxpage.load holds them stacked)
are its parameters x the dtype's size, plus the KV pool and a small constant. A stacked copy beside
per-layer arrays, or a cast copy, would add the layers' bytes again."""

from __future__ import annotations

import gc
import math

import jax
import pytest

import paxpage
from models.param_layout import param_shapes

SMALL_CONSTANT = 4096  # the engine's few fixed device arrays (decode constants, no-token rows)


def _live() -> dict[int, jax.Array]:
    """{buffer address: array} of the live device buffers (per-shard views share their array's)."""
    gc.collect()
    return {x.unsafe_buffer_pointer(): x for x in jax.live_arrays() if not x.is_deleted()}


@pytest.mark.parametrize("dtype,quantization", [("float32", None), ("bfloat16", None), ("float32", "int8")],
                         ids=["f32", "bf16", "int8"])
def test_device_holds_each_weight_once(tiny_llama_dir, dtype, quantization):
    before = _live()  # held, so no address is reused meanwhile: only the new buffers count
    model = paxpage.load(tiny_llama_dir, dtype=dtype, quantization=quantization)
    engine = model.engine(paxpage.EngineConfig(num_pages=8, max_num_seqs=4, dtype=dtype))
    assert engine.runner.scanned == (jax.default_backend() == "cpu")
    pool = {x.unsafe_buffer_pointer() for x in jax.tree.leaves(engine.runner.kv_cache)}
    held = sum(x.nbytes for address, x in _live().items() if address not in before and address not in pool)
    shapes = jax.tree.leaves(param_shapes(model.config), is_leaf=lambda x: isinstance(x, tuple))
    num_params = sum(math.prod(s) for s in shapes)
    if quantization is None:
        expected = num_params * jax.numpy.dtype(dtype).itemsize
    else:  # int8 values for every matrix, f32 for the norms and the per-channel scales
        matrices = sum(math.prod(s) for s in shapes if len(s) == 2)
        expected = sum(model.memory().values())
        assert model.memory()["int8"] == matrices
        assert model.memory()["float32"] < 0.1 * matrices
    try:
        assert expected <= held <= expected + SMALL_CONSTANT, (held, expected)
    finally:
        model.close()
        del engine, model, before


def test_load_defaults_to_the_backends_engine_dtype(tiny_llama_dir):
    model = paxpage.load(tiny_llama_dir)
    assert set(model.memory()) == {"float32" if jax.default_backend() == "cpu" else "bfloat16"}
