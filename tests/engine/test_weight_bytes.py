"""Weights held once, in the dtype they run in: the device's live arrays after loading a model and
building an engine are its parameters x the dtype's size, plus the KV pool and a small constant."""

from __future__ import annotations

import gc
import math

import jax
import pytest

import paxpage
from models.param_layout import param_shapes

SMALL_CONSTANT = 4096  # the engine's few fixed device arrays (decode constants, no-token rows)


def _live_bytes() -> int:
    """Bytes of the live device buffers, each once (per-shard views share their array's buffer)."""
    gc.collect()
    return sum({x.unsafe_buffer_pointer(): x.nbytes for x in jax.live_arrays() if not x.is_deleted()}.values())


@pytest.mark.parametrize("dtype,quantization", [("float32", None), ("bfloat16", None), ("float32", "int8")],
                         ids=["f32", "bf16", "int8"])
def test_device_holds_each_weight_once(tiny_llama_dir, dtype, quantization):
    before = _live_bytes()
    model = paxpage.load(tiny_llama_dir, dtype=dtype, quantization=quantization)
    engine = model.engine(paxpage.EngineConfig(num_pages=8, max_num_seqs=4, dtype=dtype, scan_layers=False,
                                               attention_impl="xla"))
    pool = sum(x.nbytes for x in jax.tree.leaves(engine.runner.kv_cache))
    held = _live_bytes() - before - pool
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
        del engine, model


def test_load_defaults_to_the_backends_engine_dtype(tiny_llama_dir):
    model = paxpage.load(tiny_llama_dir)
    assert set(model.memory()) == {"float32" if jax.default_backend() == "cpu" else "bfloat16"}
