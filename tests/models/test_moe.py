"""The sparse MoE MLP (models/moe.py) against a per-token numpy loop written from the routing rules."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from models.moe import moe_mlp, tile_rows


def numpy_moe(x, router, gate_up, down, top_k, renormalize):
    """Token by token: softmax over experts, the k largest, optional renormalisation, weighted SwiGLU sum."""
    x, router, gate_up, down = (np.asarray(a, np.float64) for a in (x, router, gate_up, down))
    width = down.shape[1]
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        logits = x[t] @ router
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        chosen = np.argsort(-probs)[:top_k]
        weights = probs[chosen] / (probs[chosen].sum() if renormalize else 1.0)
        for e, w in zip(chosen, weights):
            h = x[t] @ gate_up[e]
            gate, up = h[:width], h[width:]
            out[t] += w * ((gate / (1 + np.exp(-gate)) * up) @ down[e])
    return out


def _weights(rng, num_tokens, hidden, num_experts, width, skew=0.0):
    x = rng.normal(size=(num_tokens, hidden)).astype(np.float32)
    router = rng.normal(size=(hidden, num_experts)).astype(np.float32)
    router[:, 0] += skew  # skew > 0 sends most tokens to expert 0: very uneven groups
    gate_up = (rng.normal(size=(num_experts, hidden, 2 * width)) / np.sqrt(hidden)).astype(np.float32)
    down = (rng.normal(size=(num_experts, width, hidden)) / np.sqrt(width)).astype(np.float32)
    return x, router, gate_up, down


@pytest.mark.parametrize("impl", ["tiled", "ragged_dot", "dense", "stable"])
@pytest.mark.parametrize("num_tokens,num_experts,top_k,renormalize,skew", [
    (1, 4, 2, True, 0.0),      # one token: most experts get no rows
    (13, 8, 2, False, 0.0),    # Qwen3-MoE without norm_topk_prob
    (40, 8, 3, True, 2.0),     # skewed: one large group, several empty ones
    (96, 4, 2, True, 0.0),     # 48 rows per expert: tiles of 32
])
def test_moe_matches_per_token_reference(impl, num_tokens, num_experts, top_k, renormalize, skew):
    rng = np.random.default_rng(num_tokens)
    x, router, gate_up, down = _weights(rng, num_tokens, 32, num_experts, 24, skew)
    fn = jax.jit(functools.partial(moe_mlp, top_k=top_k, renormalize=renormalize, impl=impl))  # one compile
    out = np.asarray(fn(x, router, gate_up, down))
    ref = numpy_moe(x, router, gate_up, down, top_k, renormalize)
    np.testing.assert_allclose(out, ref, rtol=2e-4, atol=2e-4)


def test_tile_rows_bounds():
    assert tile_rows(2, 8) == 8  # clamped below
    assert tile_rows(128, 8) == 16
    assert tile_rows(1000, 8) == 64  # a power of two at most the mean group (125)
    assert tile_rows(10_000, 4) == 128  # clamped above


def test_unknown_impl_is_a_value_error():
    rng = np.random.default_rng(0)
    x, router, gate_up, down = _weights(rng, 4, 8, 4, 8)
    with pytest.raises(ValueError, match="moe_impl 'sparse'"):
        moe_mlp(x, router, gate_up, down, top_k=2, renormalize=True, impl="sparse")


@pytest.mark.parametrize("num_tokens,skew", [(1, 0.0), (40, 2.0)])
@pytest.mark.extended
def test_tiled_over_every_tile_matches_reference(num_tokens, skew):
    """The GPU form of "tiled": a fixed trip count over every tile, the unused ones included."""
    from models.moe import _experts_tiled, route

    rng = np.random.default_rng(num_tokens)
    x, router, gate_up, down = _weights(rng, num_tokens, 32, 8, 24, skew)
    weights, experts = route(x, router, 2, True)
    y = _experts_tiled(*map(jax.numpy.asarray, (x, experts.reshape(-1))), 2, jax.numpy.asarray(gate_up),
                       jax.numpy.asarray(down), fixed_trip_count=True)
    out = np.einsum("Tk,TkH->TH", np.asarray(weights), np.asarray(y).reshape(num_tokens, 2, -1))
    np.testing.assert_allclose(out, numpy_moe(x, router, gate_up, down, 2, True), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("impl", ["stable", "tiled"])
def test_stable_token_alone_equals_batched(impl):
    """impl "stable" (the batch-invariant mode): a token's output is bitwise the one it gets alone,
    whatever shares its step (2, 9 or 70 tokens); "tiled" sizes its tiles by the step and moves it.
    Widths at which XLA CPU's matmul rows change their bits with the row count."""
    rng = np.random.default_rng(4)
    x, router, gate_up, down = _weights(rng, 70, 576, 4, 256)
    fn = jax.jit(functools.partial(moe_mlp, top_k=2, renormalize=True, impl=impl))
    alone = np.asarray(fn(x[5:6], router, gate_up, down))[0]
    batched = [np.asarray(fn(x[lo:hi], router, gate_up, down))[5 - lo] for lo, hi in ((4, 6), (0, 9), (0, 70))]
    if impl == "stable":
        for row in batched:
            np.testing.assert_array_equal(row, alone)
    else:
        assert any(not np.array_equal(row, alone) for row in batched)
    np.testing.assert_allclose(alone, numpy_moe(x[5:6], router, gate_up, down, 2, True)[0], rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("impl,parts,fixed", [
    *((impl, parts, False) for impl in ("tiled", "ragged_dot", "dense", "stable") for parts in (2, 4)),
    ("tiled", 4, True),
])
def test_expert_slices_add_up_to_the_numpy_reference(impl, parts, fixed):
    """Expert parallelism's local computation: each slice of whole experts (expert_offset) sums
    only the rows routed to its own experts; the slices' sums add up to every expert's, the
    float64 per-token reference, with gpt-oss's gate / up bias on the sliced experts. fixed: the
    tiled loop over every tile (the GPU's fixed trip count), whose rows of other slices' experts
    are computed and discarded."""
    import models.moe as moe
    from models.moe import _experts_tiled, expert_sums, route

    rng = np.random.default_rng(parts)
    num_experts, width = 8, 24
    x, router, gate_up, down = _weights(rng, 29, 32, num_experts, width, skew=1.0)
    bias = (0.1 * rng.normal(size=(num_experts, 2 * width))).astype(np.float32)
    weights, experts = route(jax.numpy.asarray(x), jax.numpy.asarray(router), 2, True)
    local = num_experts // parts
    total = 0.0
    for d in range(parts):
        cut = slice(d * local, (d + 1) * local)
        if fixed:
            tiled = functools.partial(_experts_tiled, fixed_trip_count=True)
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(moe, "_experts_tiled", tiled)
                part = expert_sums(x, weights, experts, gate_up[cut], down[cut], impl=impl, gate_up_bias=bias[cut],
                                   expert_offset=d * local)
        else:
            part = jax.jit(functools.partial(expert_sums, impl=impl))(
                x, weights, experts, gate_up[cut], down[cut], gate_up_bias=bias[cut], expert_offset=d * local)
        total = total + np.asarray(part, np.float64)
    x64, w64 = np.asarray(x, np.float64), np.asarray(weights, np.float64)
    want = np.zeros_like(x64)
    for t in range(x.shape[0]):
        for e, w in zip(np.asarray(experts)[t], w64[t]):
            h = x64[t] @ gate_up[e] + bias[e]
            gate, up = h[:width], h[width:]
            want[t] += w * ((gate / (1 + np.exp(-gate)) * up) @ down[e])
    np.testing.assert_allclose(total, want, rtol=2e-4, atol=2e-4)


def _held(rng, w, form):
    """Expert weights w [E, I, O] in a quantised form, and its float64 expansion written here:
    "per-channel" (models/quant.quantize_int8 over each expert's inputs: one scale per output),
    "groups" (random int8 codes, a scale and an offset per 8 inputs, as GGUF's affine formats) or
    "e2m1" (random 4-bit e2m1 codes two a byte, inputs 2j / 2j + 1 low / high, a power-of-two
    scale per 8 inputs: MXFP4's form, each code standing for twice its value)."""
    from models.quant import QuantizedWeight, quantize_int8

    if form == "per-channel":
        q, scale = quantize_int8(w, axis=-2)
        return QuantizedWeight(q, scale), q.astype(np.float64) * scale
    num_experts, inputs, outputs = w.shape
    if form == "e2m1":
        codes = rng.integers(0, 16, size=w.shape).astype(np.uint8)
        packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
        scale = np.ldexp(1.0, rng.integers(-6, -3, size=(num_experts, inputs // 8, outputs))).astype(np.float32)
        values = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])[codes]
        return QuantizedWeight(packed, scale), 2 * values * np.repeat(scale.astype(np.float64), 8, axis=1)
    q = rng.integers(-8, 8, size=w.shape).astype(np.int8)
    scale = rng.uniform(0.5, 1.5, size=(num_experts, inputs // 8, outputs)).astype(np.float32) / (4 * np.sqrt(inputs))
    offset = rng.normal(0.0, 0.02, size=scale.shape).astype(np.float32)
    expanded = q * np.repeat(scale.astype(np.float64), 8, axis=1) + np.repeat(offset.astype(np.float64), 8, axis=1)
    return QuantizedWeight(q, scale, offset), expanded


@pytest.mark.parametrize("impl", ["tiled", "ragged_dot", "dense", "stable"])
@pytest.mark.parametrize("form", ["per-channel", "groups", "e2m1"])
def test_quantized_experts_match_the_reference_on_their_expansion(impl, form):
    """Experts held quantised (gpt-oss's MXFP4 int8 form, quantization="int8") through every
    grouped-matmul form equal the float64 per-token reference on the weights they stand for; so
    do expert parallelism's slices of them (quantised slices of whole experts) added up."""
    from models.moe import expert_sums, route

    rng = np.random.default_rng(11)
    x, router, gate_up, down = _weights(rng, 40, 32, 8, 24, skew=1.0)
    (gate_up_q, gate_up64), (down_q, down64) = _held(rng, gate_up, form), _held(rng, down, form)
    out = jax.jit(functools.partial(moe_mlp, top_k=2, renormalize=True, impl=impl))(x, router, gate_up_q, down_q)
    ref = numpy_moe(x, router, gate_up64, down64, 2, True)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=2e-4, atol=2e-4)
    weights, experts = route(jax.numpy.asarray(x), jax.numpy.asarray(router), 2, True)
    part = jax.jit(functools.partial(expert_sums, impl=impl))
    halves = [part(x, weights, experts, jax.tree.map(lambda a: a[cut], gate_up_q), jax.tree.map(lambda a: a[cut], down_q),
                   expert_offset=cut.start) for cut in (slice(0, 4), slice(4, 8))]
    np.testing.assert_allclose(np.asarray(halves[0] + halves[1]), ref, rtol=2e-4, atol=2e-4)
