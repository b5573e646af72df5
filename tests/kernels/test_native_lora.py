"""The native CPU LoRA delta (pallas_kernels/native_lora.py) against the float64 reference
(models/lora_ops.lora_delta_reference) and its jnp twin, in the step's row layouts, and the
same token's row alone and in a larger batch."""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import lora_ops
from models.lora_ops import LoraRows, lora_delta, lora_delta_reference, token_slots
from pallas_kernels import native_lora
from pallas_kernels.native_lora import lora_delta_native, lora_delta_ref

pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the native kernel"),
    pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU kernel; the default backend is not CPU"),
]

NATIVE = jax.jit(lora_delta_native)
REF = jax.jit(lora_delta_ref)
TOL = dict(rtol=1e-5, atol=1e-5)  # f32 sums of up to a few thousand terms against float64


@pytest.fixture(scope="module", autouse=True)
def native():
    from models.cache import NATIVE_DIR, cache_dir

    assert native_lora.load(os.path.join(cache_dir(), NATIVE_DIR)), native_lora.LIBRARY.error


def _slab(rng, num_slots, width_in, rank, width_out):
    a = (rng.standard_normal((num_slots, width_in, rank)) / np.sqrt(width_in)).astype(np.float32)
    b = (rng.standard_normal((num_slots, rank, width_out)) / np.sqrt(rank)).astype(np.float32)
    return a, b


@pytest.mark.parametrize("num_dec,num_pre,row_len", [(5, 0, 1), (0, 3, 7), (4, 2, 5), (1, 0, 1), (0, 1, 1)])
@pytest.mark.parametrize("width_in,rank,width_out", [(64, 16, 64), (33, 1, 17), (48, 8, 100), (40, 24, 31)])
def test_native_matches_float64_reference(num_dec, num_pre, row_len, width_in, rank, width_out):
    rng = np.random.default_rng(num_dec * 100 + num_pre * 10 + rank)
    num_slots = 3
    a, b = _slab(rng, num_slots, width_in, rank, width_out)
    a[1] = np.nan  # a slot no row names: any stray read fails
    b[1] = np.nan
    dec = rng.choice([-1, 0, 2], num_dec).astype(np.int32)
    pre = rng.choice([-1, 0, 2], num_pre).astype(np.int32)
    x = rng.standard_normal((num_dec + num_pre * row_len, width_in)).astype(np.float32)
    slots = (dec, pre)
    want = lora_delta_reference(x, a, b, slots)
    tok = token_slots(jnp.asarray(dec), jnp.asarray(pre), x.shape[0])
    got = np.asarray(NATIVE(x, a, b, tok))
    np.testing.assert_allclose(got, want, **TOL)
    base = np.asarray(tok) < 0
    assert (got[base] == 0).all() and not np.signbit(got[base]).any()  # exactly +0 for base tokens
    np.testing.assert_allclose(np.asarray(REF(x, a, b, tok)), want, **TOL)
    # through models/lora_ops, as the Linear layers call it, on both paths
    native_rows = np.asarray(jax.jit(lambda x, d, p: lora_delta(x, a, b, LoraRows(d, p, "native")))(x, dec, pre))
    np.testing.assert_array_equal(native_rows, got)
    a[1] = b[1] = 0.0  # the XLA path reads every slot's values in its gather: no NaN there
    xla_rows = np.asarray(jax.jit(lambda x, d, p: lora_delta(x, a, b, LoraRows(d, p, "xla")))(x, dec, pre))
    np.testing.assert_allclose(xla_rows, want, **TOL)


def test_every_slot_and_out_of_range_slots():
    """Many tokens per slot (several work items each), slots in any order, and slot values
    outside [0, S) run the base model."""
    rng = np.random.default_rng(7)
    a, b = _slab(rng, 8, 576, 16, 1536)
    tok = rng.integers(-1, 8, 200).astype(np.int32)
    tok[:3] = [8, 100, -5]
    x = rng.standard_normal((200, 576)).astype(np.float32)
    got = np.asarray(NATIVE(x, a, b, tok))
    want = lora_delta_reference(x, a, b, (np.where((tok >= 0) & (tok < 8), tok, -1), np.zeros(0, np.int32)))
    np.testing.assert_allclose(got, want, **TOL)
    assert not got[:3].any()


def test_all_base_gives_zeros():
    rng = np.random.default_rng(1)
    a, b = _slab(rng, 2, 32, 4, 20)
    got = np.asarray(NATIVE(rng.standard_normal((6, 32)).astype(np.float32), a, b, np.full(6, -1, np.int32)))
    assert got.shape == (6, 20) and not got.any()


@pytest.mark.parametrize("rank", [16, 5])
def test_token_row_is_batch_invariant(rank):
    """A token's row is bitwise the same alone, first or last among other tokens of its slot, and
    in a batch of other slots' tokens (each work item size and position runs the same sums)."""
    rng = np.random.default_rng(rank)
    a, b = _slab(rng, 4, 200, rank, 70)
    x = rng.standard_normal((37, 200)).astype(np.float32)
    tok = rng.integers(-1, 4, 37).astype(np.int32)
    tok[0] = 2
    full = np.asarray(NATIVE(x, a, b, tok))
    alone = np.asarray(NATIVE(x[:1], a, b, tok[:1]))
    np.testing.assert_array_equal(alone[0], full[0])
    for count in (2, 3, 4, 5, 9):  # token 0 in items of each size, at the front
        same = np.full(count, 2, np.int32)
        rows = np.concatenate([x[:1], x[1:count]])
        np.testing.assert_array_equal(np.asarray(NATIVE(rows, a, b, same))[0], full[0])
    reversed_rows = np.asarray(NATIVE(x[::-1], a, b, tok[::-1]))[::-1]  # token 0 last
    np.testing.assert_array_equal(reversed_rows, full)


def test_bad_shapes_raise():
    a, b = np.zeros((2, 8, 4), np.float32), np.zeros((2, 4, 6), np.float32)
    with pytest.raises(ValueError, match="disagree"):
        lora_delta_native(np.zeros((3, 9), np.float32), a, b, np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="rank is 300"):
        lora_delta_native(np.zeros((3, 8), np.float32), np.zeros((1, 8, 300), np.float32),
                          np.zeros((1, 300, 6), np.float32), np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="lora impl"):
        lora_delta(np.zeros((1, 8), np.float32), a, b, LoraRows(np.zeros(1, np.int32), np.zeros(0, np.int32), "fast"))


def test_resolve_lora_impl():
    assert lora_ops.resolve_lora_impl(True, 16) == "native"
    assert lora_ops.resolve_lora_impl(False, 16) == "xla"
    assert lora_ops.resolve_lora_impl(True, native_lora.MAX_RANK + 1) == "xla"
