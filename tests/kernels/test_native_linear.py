"""The native CPU matmul over column panels (pallas_kernels/native_linear.py) against a float64
numpy product of the plain [I, O] weight and against its jnp twin, a row alone against the same
row in larger batches, and the panel layout (models/panel_layout.py) against numpy indexing."""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import panel_layout
from pallas_kernels import native_linear
from pallas_kernels.native_linear import linear_native, linear_ref

pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the native kernel"),
    pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU kernel; the default backend is not CPU"),
]

NATIVE = jax.jit(linear_native)
REF = jax.jit(linear_ref)
TOL = dict(rtol=1e-5, atol=2e-5)  # f32 sums of up to 1,536 terms of order 1 / sqrt(I) against float64


@pytest.fixture(scope="module", autouse=True)
def native():
    from models.cache import NATIVE_DIR, cache_dir

    assert native_linear.load(os.path.join(cache_dir(), NATIVE_DIR)), native_linear.LIBRARY.error


def _weight(rng, width_in, width_out):
    return (rng.standard_normal((width_in, width_out)) / np.sqrt(max(width_in, 1))).astype(np.float32)


def test_panels_are_column_blocks_of_the_plain_weight():
    w = np.arange(3 * 128, dtype=np.float32).reshape(3, 128)
    panels = panel_layout.to_panels(w)
    assert panels.shape == (2, 3, 64)
    for p in range(2):  # panel p, row i is w[i, 64p:64p+64]
        np.testing.assert_array_equal(panels[p], w[:, 64 * p:64 * p + 64])
    np.testing.assert_array_equal(panel_layout.from_panels(panels), w)
    stacked = np.stack([w, w + 1])  # a leading layer axis stays in front
    np.testing.assert_array_equal(np.asarray(panel_layout.to_panels(jnp.asarray(stacked)))[1, 1], w[:, 64:] + 1)


@pytest.mark.parametrize("rows, width_in, width_out", [
    (1, 576, 576),  # a lone decode row
    (4, 576, 192),  # SmolLM2's k/v projection
    (7, 64, 128),  # rows not a multiple of the 6-row tile
    (16, 1536, 576),  # down_proj
    (64, 576, 1536),  # gate_proj at the CPU decode batch
    (100, 96, 64),  # two row groups (48 rows an item)
    (516, 576, 576),  # a mixed step's tokens
])
def test_matches_float64_and_the_jnp_twin(rows, width_in, width_out):
    rng = np.random.default_rng(rows * 7 + width_in)
    x = rng.standard_normal((rows, width_in)).astype(np.float32)
    w = _weight(rng, width_in, width_out)
    panels = panel_layout.to_panels(w)
    want = x.astype(np.float64) @ w.astype(np.float64)
    got = np.asarray(NATIVE(x, panels))
    assert got.shape == (rows, width_out)
    np.testing.assert_allclose(got, want, **TOL)
    np.testing.assert_allclose(np.asarray(REF(x, panels)), want, **TOL)


def test_empty_shapes():
    rng = np.random.default_rng(0)
    panels = panel_layout.to_panels(_weight(rng, 32, 64))
    assert NATIVE(np.zeros((0, 32), np.float32), panels).shape == (0, 64)
    empty_in = np.asarray(NATIVE(np.zeros((3, 0), np.float32), np.zeros((1, 0, 64), np.float32)))
    np.testing.assert_array_equal(empty_in, np.zeros((3, 64), np.float32))


def test_a_row_is_the_same_alone_and_in_any_batch():
    rng = np.random.default_rng(1)
    panels = panel_layout.to_panels(_weight(rng, 576, 192))
    x = rng.standard_normal((97, 576)).astype(np.float32)
    alone = np.asarray(NATIVE(x[40:41], panels))[0]
    for lo, hi in ((0, 97), (38, 45), (40, 46), (36, 41)):  # the row at every tile position
        np.testing.assert_array_equal(np.asarray(NATIVE(x[lo:hi], panels))[40 - lo], alone)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"expected \[T, I\] and \[\(G,\) P, I, 64\]"):
        linear_native(jnp.zeros((2, 8)), jnp.zeros((1, 8, 32)))
    with pytest.raises(ValueError, match=r"expected \[T, I\] and \[\(G,\) P, I, 64\]"):
        linear_ref(jnp.zeros((2, 8)), jnp.zeros((1, 9, 64)))
    with pytest.raises(ValueError, match=r"live \(3,\) for x \(2, 8\); expected \[2\]"):
        linear_native(jnp.zeros((2, 8)), jnp.zeros((1, 8, 64)), jnp.ones(3, bool))


@pytest.mark.parametrize("pattern", ["all", "none", "tail", "prefill_rows", "scattered"])
def test_only_live_rows_are_computed_and_keep_their_bits(pattern):
    rng = np.random.default_rng(6)
    rows = 100  # 4 decode rows then three prefill rows of 32 tokens, as a step lays them out
    live = {"all": np.ones(rows, bool), "none": np.zeros(rows, bool),
            "tail": np.arange(rows) < 7,  # decode rows past the batch are padding
            "prefill_rows": np.concatenate([[1, 1, 1, 0], np.arange(96) % 32 < np.repeat([5, 32, 17], 32)]).astype(bool),
            "scattered": rng.random(rows) < 0.5}[pattern]
    x = rng.standard_normal((rows, 96)).astype(np.float32)
    panels = panel_layout.to_panels(_weight(rng, 96, 192))
    full = np.asarray(NATIVE(x, panels))
    got = np.asarray(jax.jit(linear_native)(x, panels, live))
    np.testing.assert_array_equal(got[live], full[live])  # a live row's bits do not depend on the others
    np.testing.assert_array_equal(got[~live], 0.0)
    ref = np.asarray(jax.jit(linear_ref)(x, panels, live))
    np.testing.assert_allclose(ref[live], (x.astype(np.float64) @ from_panels64(panels))[live], **TOL)
    np.testing.assert_array_equal(ref[~live], 0.0)


def from_panels64(panels):
    return np.asarray(panel_layout.from_panels(panels), np.float64)


def test_pack_holds_packable_kernels_in_panels_and_unpack_restores_them():
    rng = np.random.default_rng(2)
    tree = {"q_proj": {"kernel": _weight(rng, 8, 128)}, "k_proj": {"kernel": _weight(rng, 8, 32)},
            "norm": {"scale": np.ones(8, np.float32)}, "emb": {"kernel_q": np.zeros((8, 64), np.int8)}}
    plain = {k: dict(v) for k, v in tree.items()}
    packed = panel_layout.pack(tree)
    assert set(packed["q_proj"]) == {"kernel_panels"} and packed["q_proj"]["kernel_panels"].shape == (2, 8, 64)
    assert packed["k_proj"]["kernel"] is plain["k_proj"]["kernel"]  # O = 32: not a multiple of 64
    assert packed["emb"]["kernel_q"] is plain["emb"]["kernel_q"]  # quantised: as it is
    assert "kernel" not in tree["q_proj"]  # the plain kernel was let go
    assert panel_layout.holds_panels(packed) and not panel_layout.holds_panels(plain)
    back = panel_layout.unpack(packed)
    np.testing.assert_array_equal(back["q_proj"]["kernel"], plain["q_proj"]["kernel"])
    assert back["norm"]["scale"] is plain["norm"]["scale"]


def test_a_tied_table_is_held_as_panels_of_its_transpose():
    rng = np.random.default_rng(4)
    table = rng.standard_normal((192, 8)).astype(np.float32)  # V = 192: three panels
    untied = panel_layout.pack({"embed_tokens": {"embedding": table.copy()}})
    assert set(untied["embed_tokens"]) == {"embedding"}  # only a tied LM head is multiplied by it
    odd = panel_layout.pack({"embed_tokens": {"embedding": table[:100].copy()}}, tied_table=True)
    assert set(odd["embed_tokens"]) == {"embedding"}  # V = 100: not a multiple of 64
    panels = panel_layout.pack({"embed_tokens": {"embedding": table.copy()}}, tied_table=True)
    held = panels["embed_tokens"]["embedding_panels"]
    assert held.shape == (3, 8, 64) and held.flags["C_CONTIGUOUS"]
    for v in (0, 63, 64, 130, 191):  # panel v // 64, column v % 64 holds vocabulary row v
        np.testing.assert_array_equal(held[v // 64, :, v % 64], table[v])
    np.testing.assert_array_equal(panel_layout.unpack(panels)["embed_tokens"]["embedding"], table)


@pytest.mark.parametrize("matmul_impl", ["native", "xla"])
def test_embedding_over_table_panels_looks_up_rows_and_attends_as_the_table(matmul_impl):
    from models.layers import Embedding

    rng = np.random.default_rng(5)
    table = rng.standard_normal((128, 16)).astype(np.float32)
    panels = panel_layout.pack({"embed_tokens": {"embedding": table.copy()}}, tied_table=True)["embed_tokens"]
    module = Embedding(128, 16, matmul_impl=matmul_impl)
    ids = jnp.array([0, 5, 127, 64, 5], jnp.int32)
    rows = module.apply({"params": panels}, ids)
    np.testing.assert_array_equal(np.asarray(rows), table[np.asarray(ids)])
    x = rng.standard_normal((3, 16)).astype(np.float32)
    logits = module.apply({"params": panels}, jnp.asarray(x), method=Embedding.attend)
    np.testing.assert_allclose(np.asarray(logits), x.astype(np.float64) @ table.T.astype(np.float64), **TOL)


def test_stacked_panels_are_read_at_the_group():
    rng = np.random.default_rng(7)
    stacked = np.stack([panel_layout.to_panels(_weight(rng, 96, 128)) for _ in range(3)])  # [G, P, I, 64]
    x = rng.standard_normal((13, 96)).astype(np.float32)
    live = np.arange(13) % 4 != 3
    native, ref = jax.jit(linear_native), jax.jit(linear_ref)
    for group in range(3):
        want = np.asarray(NATIVE(x, stacked[group]))
        got = np.asarray(native(x, stacked, None, jnp.int32(group)))
        np.testing.assert_array_equal(got, want)  # the same kernel over the group's panels: the same bits
        np.testing.assert_array_equal(np.asarray(native(x, stacked, live, jnp.int32(group)))[live], want[live])
        np.testing.assert_allclose(np.asarray(ref(x, stacked, None, jnp.int32(group))),
                                   x.astype(np.float64) @ from_panels64(stacked[group]), **TOL)
    with pytest.raises(ValueError, match="a group goes with"):
        linear_native(jnp.asarray(x), jnp.asarray(stacked[0]), None, jnp.int32(0))
    with pytest.raises(ValueError, match="a group goes with"):
        linear_ref(jnp.asarray(x), jnp.asarray(stacked))


@pytest.mark.parametrize("rows, width_in, width_out, stacked", [(1, 576, 576, False), (7, 96, 128, True),
                                                                 (64, 576, 1536, False)])
def test_bf16_panels_are_read_as_stored(rows, width_in, width_out, stacked):
    """A bf16 model's panels: the product of the bf16 values in f32 (against float64 of the same
    bf16 values), never a widened copy of the weight; live rows and a stack's group as for f32."""
    rng = np.random.default_rng(rows + width_out)
    x = jnp.asarray(rng.standard_normal((rows, width_in)), jnp.bfloat16)
    w = jnp.asarray(_weight(rng, width_in, width_out), jnp.bfloat16)
    panels = panel_layout.to_panels(w)
    group = None
    if stacked:
        panels, group = jnp.stack([panels * 2, panels]), jnp.int32(1)
    live = np.arange(rows) % 3 != 1
    fn = jax.jit(linear_native)
    hlo = fn.lower(x, panels, live, group).compile().as_text()
    assert f"f32[{','.join(map(str, panels.shape))}]" not in hlo  # no f32 copy of the panels
    got = np.asarray(fn(x, panels, live, group))
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(got[live], want[live], **TOL)
    np.testing.assert_array_equal(got[~live], 0.0)


def _quantised(rng, width_in, width_out, block, with_offset):
    """A quantised kernel as models/quant.py holds it: q i8[I, O], scale (and offset) f32[I / block, O]."""
    q = rng.integers(-127, 128, (width_in, width_out)).astype(np.int8)
    scale = (rng.random((width_in // block, width_out)) / (64 * np.sqrt(width_in)) + 1e-4).astype(np.float32)
    offset = (rng.standard_normal(scale.shape) / (8 * np.sqrt(width_in))).astype(np.float32) if with_offset else None
    return q, scale, offset


def _expanded(q, scale, offset):
    """numpy's f32 expansion of the plain quantised kernel (the quantization="none" form)."""
    from models import quant

    flat = {"w/kernel_q": q, "w/kernel_scale": scale}
    if offset is not None:
        flat["w/kernel_offset"] = offset
    return quant.dequantize_flat(flat)["w/kernel"]


@pytest.mark.parametrize("rows, width_in, width_out, block, with_offset, stacked", [
    (1, 576, 576, 32, True, False),  # a decode row, GGUF Q4_1's layout: dequantised in the tile
    (5, 64, 128, 16, False, True),  # Q6_K-sized blocks, no offset, a stack's group
    (7, 96, 128, 96, False, False),  # int8 per output channel (one block), two row tiles: the panel expanded once
    (64, 1536, 576, 32, True, False),  # down_proj at the CPU decode batch
    (200, 576, 192, 32, True, True),  # two items of rows (192 an item) in a stack
])
def test_quantised_panels_equal_the_f32_kernel_on_their_expansion(rows, width_in, width_out, block, with_offset,
                                                                  stacked):
    """int8 panels with their scale / offset panels give the bits the f32 kernel gives on numpy's
    f32 expansion of the same weight (each weight rounded as numpy rounds it), and the float64
    product within f32 rounding; the jnp twin too. Padding rows stay 0."""
    rng = np.random.default_rng(rows + width_in + block)
    x = rng.standard_normal((rows, width_in)).astype(np.float32)
    q, scale, offset = _quantised(rng, width_in, width_out, block, with_offset)
    w = _expanded(q, scale, offset)
    panels = [panel_layout.to_panels(a) if a is not None else None for a in (q, scale, offset)]
    group = None
    if stacked:  # the wanted weight is group 1 of 2; group 0 is another one
        other = [None if a is None else -a if a.dtype == np.int8 else a * 2 for a in panels]
        panels = [None if a is None else np.stack([b, a]) for a, b in zip(panels, other)]
        group = jnp.int32(1)
    live = np.arange(rows) % 5 != 2 if rows > 1 else None
    q_panels, scale_panels, offset_panels = panels
    got = np.asarray(jax.jit(linear_native)(x, q_panels, live, group, scale_panels, offset_panels))
    same = np.asarray(NATIVE(x, panel_layout.to_panels(w)))
    mask = np.ones(rows, bool) if live is None else live
    np.testing.assert_array_equal(got[mask], same[mask])
    np.testing.assert_array_equal(got[~mask], 0.0)
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(got[mask], want[mask], **TOL)
    ref = np.asarray(jax.jit(linear_ref)(x, q_panels, live, group, scale_panels, offset_panels))
    np.testing.assert_allclose(ref[mask], want[mask], **TOL)


def test_quantised_panels_need_matching_scales():
    x, q = jnp.zeros((2, 64)), jnp.zeros((1, 64, 64), jnp.int8)
    with pytest.raises(ValueError, match="int8 panels take a scale"):
        linear_native(x, q)
    with pytest.raises(ValueError, match="int8 panels take a scale"):
        linear_ref(x, jnp.zeros((1, 64, 64)), scale=jnp.ones((1, 2, 64)))
    with pytest.raises(ValueError, match=r"expected \[\(G,\) P, I / Q, 64\] with Q dividing I"):
        linear_native(x, q, scale=jnp.ones((1, 3, 64)))  # 3 blocks do not divide 64 inputs
    with pytest.raises(ValueError, match=r"expected \[\(G,\) P, I / Q, 64\]"):
        linear_native(x, q, scale=jnp.ones((1, 2, 64)), offset=jnp.ones((1, 4, 64)))


def test_pack_holds_quantised_kernels_and_a_tied_table_in_panels():
    rng = np.random.default_rng(8)
    q, scale, offset = _quantised(rng, 64, 128, 32, True)
    table_q = rng.integers(-127, 128, (128, 64)).astype(np.int8)  # a tied table [V, H], one scale per row
    table_scale = rng.random((128, 1)).astype(np.float32)
    tree = {"layers_0": {"up_proj": {"kernel_q": q, "kernel_scale": scale, "kernel_offset": offset},
                         "k_proj": {"kernel_q": q[:, :32].copy(), "kernel_scale": scale[:, :32].copy()}},
            "embed_tokens": {"embedding_q": table_q, "embedding_scale": table_scale}}
    packed = panel_layout.pack({k: {n: dict(v) for n, v in sub.items()} if k == "layers_0" else dict(sub)
                                for k, sub in tree.items()}, tied_table=True)
    up = packed["layers_0"]["up_proj"]
    assert {n: a.shape for n, a in up.items()} == {"kernel_panels_q": (2, 64, 64), "kernel_panels_scale": (2, 2, 64),
                                                   "kernel_panels_offset": (2, 2, 64)}
    np.testing.assert_array_equal(up["kernel_panels_scale"][1], scale[:, 64:])  # panel 1: columns 64..127
    assert set(packed["layers_0"]["k_proj"]) == {"kernel_q", "kernel_scale"}  # O = 32: as it is
    table = packed["embed_tokens"]
    assert {n: a.shape for n, a in table.items()} == {"embedding_panels_q": (2, 64, 64),
                                                      "embedding_panels_scale": (2, 1, 64)}
    np.testing.assert_array_equal(table["embedding_panels_q"][1, :, 3], table_q[67])  # vocabulary row 67
    assert panel_layout.holds_panels(packed)
    back = panel_layout.unpack(packed)
    for name in ("layers_0/up_proj", "layers_0/k_proj", "embed_tokens"):
        a, b = name.split("/") if "/" in name else (name, None)
        want, got = (tree[a][b], back[a][b]) if b else (tree[a], back[a])
        assert set(got) == set(want)
        for leaf in want:
            np.testing.assert_array_equal(got[leaf], want[leaf])


@pytest.mark.parametrize("matmul_impl", ["native", "xla"])
def test_embedding_over_quantised_table_panels(matmul_impl):
    """A quantised tied table in panels: a lookup is numpy's expansion of the row, the LM head the
    float64 product with the expanded table."""
    from models import quant
    from models.layers import Embedding

    rng = np.random.default_rng(9)
    q = rng.integers(-127, 128, (128, 64)).astype(np.int8)
    scale = (rng.random((128, 2)) / 500).astype(np.float32)  # blocks of 32 along H
    offset = (rng.standard_normal((128, 2)) / 100).astype(np.float32)
    table = quant.dequantize_flat({"t/embedding_q": q, "t/embedding_scale": scale,
                                   "t/embedding_offset": offset})["t/embedding"]
    held = panel_layout.pack({"embed_tokens": {"embedding_q": q, "embedding_scale": scale,
                                               "embedding_offset": offset}}, tied_table=True)["embed_tokens"]
    assert set(held) == {"embedding_panels_q", "embedding_panels_scale", "embedding_panels_offset"}
    module = Embedding(128, 64, matmul_impl=matmul_impl)
    ids = jnp.array([0, 5, 127, 64, 5], jnp.int32)
    np.testing.assert_array_equal(np.asarray(module.apply({"params": held}, ids)), table[np.asarray(ids)])
    x = rng.standard_normal((3, 64)).astype(np.float32)
    logits = module.apply({"params": held}, jnp.asarray(x), method=Embedding.attend)
    np.testing.assert_allclose(np.asarray(logits), x.astype(np.float64) @ table.T.astype(np.float64), **TOL)
