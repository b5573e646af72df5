"""Exact draws from temperature / top-k / top-p / min-p filtered distributions, without sorting
or scanning the vocabulary once per threshold bit.

Axis legend: R rows, V vocabulary, C candidates (a row's C best tokens, descending), N blocks of
the vocabulary, B tokens per block.

A non-greedy row with scaled logits x = logits / temperature draws token i with probability
proportional to exp(x_i) over the kept set {logits >= max(v_k, v_p, v_m)} (`filter_logits`'
semantics, ties at a threshold kept):
  v_k  the top_k-th largest logit (top_k off: -inf)
  v_p  the largest v whose {logits >= v} holds top_p of the top-k set's mass (top_p 1: -inf)
  v_m  max(logits) + temperature * log(min_p), i.e. p_i >= min_p * p_max (min_p off: -inf)
Thresholds compare logits, not x, which has their order (up to ties made by rounding): x is
recomputed in each pass, possibly rounded differently, and a drawn token must compare equal
to itself from one pass to the next.

Each row takes one of three paths, chosen from the row alone, so a seeded row draws the same
token whatever batch it is in:
  candidates  top_k <= C and no tie across the C-th candidate: the top-k set lies in
              lax.top_k's C best, every threshold is found there, and the draw is an inverse
              CDF over at most C tokens.
  proposal    top_k off: one inverse-CDF draw from the whole distribution (block sums, then
              one block), accepted when the token is kept (min-p: a comparison; top-p: the mass
              of strictly better tokens is below the target, one masked sum). Accepted draws
              are distributed exactly as the kept set; a row accepts with probability at least
              top_p * (mass kept by min-p), so few rows go on.
  exact       the rest (top_k > C, a tie at the C-th candidate, rejected proposals), one row at
              a time: the top-k threshold by bisection, then rejection rounds restricted to
              {logits > the last rejected logit}, each a few passes over one row; the best token is
              always accepted, so it ends.

On CPU at R = 256, V = 49152 an elementwise pass over [R, V] costs ~30-60 ms; the first two paths
cost one or two such passes (plus lax.top_k over C when some row sets top_k), instead of the
64 passes of a threshold bisection. Randomness: one uniform per row and round, from
fold_in(row key, round); round 0 is the candidate or proposal draw.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NUM_CANDIDATES = 128  # top_k up to this takes the candidate path
_BLOCK = 256  # tokens per block of the inverse-CDF draw over the whole vocabulary
_MAX_ROUNDS = 200  # rejection rounds of one row on the exact path (a guard: see exact_row)


def argmax_rows(x: jax.Array) -> jax.Array:
    """First index of each row's maximum, i32[R], for x f32[R, V]: jnp.argmax's result (and
    lax.top_k(x, 1)'s), found blockwise: the maxima of blocks of _BLOCK tokens, the first block
    holding the largest, then the first maximum inside that block. On XLA CPU at [256, 49152]
    this takes ~2-4 ms against ~13 ms for lax.top_k(x, 1) and ~50 ms for jnp.argmax (both
    timed in one process, jax 0.10.2), because the block maxima are a plain max reduction."""
    num_rows = x.shape[0]
    xb = _blocks(x)  # [R, N, B], -inf padding after the last token: never an earlier maximum
    block = jax.lax.top_k(jnp.max(xb, axis=-1), 1)[1]  # [R, 1]: the lower index among ties
    inner = jax.lax.top_k(jnp.take_along_axis(xb, block[:, :, None], axis=1)[:, 0], 1)[1]
    return (block[:, 0] * _BLOCK + inner[:, 0]).astype(jnp.int32).reshape(num_rows)


def sortable_keys(x: jax.Array) -> jax.Array:
    """f32 -> i32 with the same order (IEEE bits; negative floats have their magnitude bits
    flipped), so thresholds can be found by an exact bisection over 32-bit integers."""
    x = jnp.where(x == 0, 0.0, x)  # -0.0 == 0.0 must map to one key
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def largest_threshold(keys: jax.Array, ok_fn) -> jax.Array:
    """Largest i32 threshold tau per row with ok_fn(keys >= tau) true, given ok_fn is monotone
    (true for small tau). keys i32[R, V] -> i32[R, 1]. 32 halvings of the i32 range: exact."""
    num_rows = keys.shape[0]
    lo = jnp.full((num_rows, 1), jnp.iinfo(jnp.int32).min, jnp.int32)  # ok_fn(lo) holds
    hi = jnp.full((num_rows, 1), jnp.iinfo(jnp.int32).max, jnp.int32)

    def halve(_, bounds):
        lo, hi = bounds
        # upper midpoint without overflow; lo < mid <= hi while lo < hi
        mid = (lo >> 1) + (hi >> 1) + ((lo & 1) | (hi & 1))
        ok = ok_fn(keys >= mid) & (lo < hi)
        return jnp.where(ok, mid, lo), jnp.where(ok | (lo >= hi), hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 32, halve, (lo, hi))
    return lo


def _uniform(key: jax.Array, round_: int | jax.Array) -> jax.Array:
    """One f32 in [0, 1) for round `round_` of the row with typed key `key`."""
    return jax.random.uniform(jax.random.fold_in(key, round_), (), jnp.float32)


def _pick(cum: jax.Array, target: jax.Array) -> jax.Array:
    """Index of the draw `target` (in [0, total)) in non-decreasing cumulative sums cum[..., M]:
    the first entry above target, never an entry of zero weight (rounding past the end lands
    on the last entry of positive weight). -> i32[...]."""
    total = cum[..., -1:]
    below = jnp.sum(cum <= target[..., None], axis=-1)
    last_positive = jnp.sum(cum < total, axis=-1)
    return jnp.minimum(below, last_positive).astype(jnp.int32)


def _expand(a: jax.Array, ndim: int) -> jax.Array:
    a = jnp.asarray(a, jnp.float32)
    return a.reshape(a.shape + (1,) * (ndim - a.ndim))


def _weights(logits: jax.Array, temperature, best, floor, low) -> jax.Array:
    """exp(logits / temperature - best) where floor <= logits and low < logits, else 0.
    temperature, best, floor, low: the batch shape of logits without its token axes.

    The scaled logits are recomputed inside each pass rather than stored (a materialised
    [R, V] array costs as much as a pass on CPU), and XLA may round them differently in
    different passes; so every threshold (a drawn token's own value above all) compares the
    logits themselves, whose order the scaled logits share."""
    temperature, best, floor, low = (_expand(a, logits.ndim) for a in (temperature, best, floor, low))
    kept = (logits >= floor) & (logits > low)
    return jnp.where(kept, jnp.exp(logits / temperature - best), 0.0)


def _blocks(x: jax.Array) -> jax.Array:
    """[..., V] -> [..., N, B], padded with -inf (zero weight)."""
    vocab = x.shape[-1]
    num_blocks = -(-vocab // _BLOCK)
    pad = num_blocks * _BLOCK - vocab
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=-jnp.inf)
    return x.reshape(x.shape[:-1] + (num_blocks, _BLOCK))


def _inverse_cdf(logits: jax.Array, weight_args, u: jax.Array):
    """Draw from _weights(logits, *weight_args) with uniforms u, over the whole vocabulary:
    block sums, pick a block, then pick inside it. logits f32[..., V], u f32[...].
    -> (token i32[...], its logit f32[...], total weight f32[...])."""
    xb = _blocks(logits)  # [..., N, B]
    block_sums = jnp.sum(_weights(xb, *weight_args), axis=-1)  # [..., N]
    cum = jnp.cumsum(block_sums, axis=-1)
    total = cum[..., -1]
    target = u * total
    block = _pick(cum, target)
    # weight of the blocks before the chosen one
    previous = jnp.take_along_axis(cum, jnp.maximum(block - 1, 0)[..., None], -1)[..., 0]
    before = jnp.where(block > 0, previous, 0.0)
    xin = jnp.take_along_axis(xb, block[..., None, None], axis=-2)[..., 0, :]  # [..., B]
    inner = _pick(jnp.cumsum(_weights(xin, *weight_args), axis=-1), target - before)
    value = jnp.take_along_axis(xin, inner[..., None], axis=-1)[..., 0]
    return block * _BLOCK + inner, value, total


def _mass_above(logits: jax.Array, temperature, best, floor, value) -> jax.Array:
    """Weight of {logits >= floor, logits > value}: f32[...]."""
    return jnp.sum(_weights(logits, temperature, best, floor, value), axis=-1)


def draw(logits: jax.Array, best_logit: jax.Array, temperature: jax.Array, top_k: jax.Array,
         top_p: jax.Array, min_p: jax.Array, keys: jax.Array, greedy: jax.Array,
         proposal=None) -> jax.Array:
    """Tokens i32[R] for logits f32[R, V] (penalised), best_logit f32[R] = their row max,
    temperature f32[R] (rows with `greedy` take the argmax), top_k i32[R] (0 off),
    top_p f32[R], min_p f32[R], keys u32[R, 2] raw threefry key data.
    proposal: None (the proposal path in XLA ops), or a function with the signature of
    pallas_kernels.native_sampling.proposal_draw_ref that runs it instead (the native CPU kernel)."""
    num_rows, vocab = logits.shape
    num_cands = min(NUM_CANDIDATES, vocab)
    temperature = jnp.where(greedy, 1.0, temperature)
    best = best_logit / temperature  # == max(x) exactly: x / t is monotone in x
    keys = jax.random.wrap_key_data(keys, impl="threefry2x32")
    u0 = jax.vmap(_uniform, in_axes=(0, None))(keys, 0)  # [R]
    # min-p keeps x >= max(x) + log(min_p), i.e. logits >= max(logits) + T log(min_p): the
    # best token always passes, whatever the rounding
    l_min = jnp.where(min_p > 0, best_logit + temperature * jnp.log(jnp.where(min_p > 0, min_p, 1.0)),
                      -jnp.inf)
    sampled = ~greedy
    wants_top_k = sampled & (top_k > 0)

    # ---- candidates: the C best logits; their column 0 is the argmax (lax.top_k keeps the
    # lower index first among ties), so greedy rows read it too.
    def top_candidates(logits):
        values, ids = jax.lax.top_k(logits, num_cands)
        return values, ids

    def argmax_only(logits):
        ids = argmax_rows(logits)[:, None]
        return (jnp.full((num_rows, num_cands), -jnp.inf, logits.dtype),
                jnp.broadcast_to(ids, (num_rows, num_cands)))

    def no_candidates(logits):
        return (jnp.full((num_rows, num_cands), -jnp.inf, logits.dtype),
                jnp.zeros((num_rows, num_cands), jnp.int32))

    which = jnp.where(jnp.any(wants_top_k), 2, jnp.where(jnp.any(greedy), 1, 0))
    cand_logits, cand_ids = jax.lax.switch(which, (no_candidates, argmax_only, top_candidates), logits)
    cand_ids = cand_ids.astype(jnp.int32)
    argmax = cand_ids[:, 0]
    # Thresholds compare logits (descending here), weights use the scaled x.
    cand_w = jnp.exp(cand_logits / temperature[:, None] - best[:, None])  # [R, C]
    kth = jnp.take_along_axis(cand_logits, jnp.clip(top_k - 1, 0, num_cands - 1)[:, None], -1)[:, 0]
    fits = wants_top_k & (top_k <= num_cands) & (kth > cand_logits[:, -1])
    l_top_k = jnp.where(top_k > 0, kth, -jnp.inf)
    cum_k = jnp.cumsum(jnp.where(cand_logits >= l_top_k[:, None], cand_w, 0.0), axis=-1)
    # v_p: the first candidate whose cumulative mass reaches top_p of the top-k set's mass
    j = _pick(cum_k, top_p * cum_k[:, -1])
    l_top_p = jnp.where(top_p < 1.0, jnp.take_along_axis(cand_logits, j[:, None], -1)[:, 0], -jnp.inf)
    floor = jnp.maximum(jnp.maximum(l_top_k, l_top_p), l_min)
    w = jnp.where(cand_logits >= floor[:, None], cand_w, 0.0)
    cum_w = jnp.cumsum(w, axis=-1)
    cand_token = jnp.take_along_axis(cand_ids, _pick(cum_w, u0 * cum_w[:, -1])[:, None], -1)[:, 0]

    # ---- proposal: rows without top_k draw from the whole distribution, then check the draw.
    proposing = sampled & (top_k <= 0)
    no_floor = jnp.full((num_rows,), -jnp.inf, jnp.float32)

    def propose(logits):
        if proposal is not None:
            return proposal(logits, temperature, best, l_min, top_p, u0, proposing)
        token, value, total = _inverse_cdf(
            logits, (temperature, best, no_floor, no_floor), u0)
        kept = value >= l_min

        def top_p_test(_):
            return _mass_above(logits, temperature, best, no_floor, value) < top_p * total

        checks_top_p = proposing & (top_p < 1.0)
        kept &= jax.lax.cond(jnp.any(checks_top_p), top_p_test,
                             lambda _: jnp.ones((num_rows,), bool), None) | ~checks_top_p
        return token, kept

    prop_token, accepted = jax.lax.cond(
        jnp.any(proposing), propose,
        lambda _: (jnp.zeros((num_rows,), jnp.int32), jnp.zeros((num_rows,), bool)), logits)

    tokens = jnp.where(greedy, argmax, jnp.where(fits, cand_token, prop_token))
    pending = sampled & ~fits & ~(proposing & accepted)

    # ---- exact: the remaining rows one at a time.
    def exact_row(r):
        lr = jax.lax.dynamic_index_in_dim(logits, r, keepdims=False)  # [V]
        t_r, best_r, k, p, lmin = temperature[r], best[r], top_k[r], top_p[r], l_min[r]

        def kth_largest(lr):  # the k-th largest logit, exactly
            keys_r = sortable_keys(lr)[None]
            tau = largest_threshold(keys_r, lambda kept: jnp.sum(kept, -1, keepdims=True) >= k)
            return jnp.min(jnp.where(keys_r >= tau, lr[None], jnp.inf))

        l_k = jax.lax.cond(k > 0, kth_largest, lambda _: jnp.float32(-jnp.inf), lr)
        target = p * _mass_above(lr, t_r, best_r, l_k, -jnp.inf)  # top_p of the top-k set

        def not_done(state):
            # A guard, not a limit met in practice: each round discards at least the drawn
            # token and all worse ones (typically half the remaining mass). A row with no finite
            # logit would loop forever; past the cap the row takes its best token.
            return ~state[3] & (state[0] <= _MAX_ROUNDS)

        def round_(state):
            round_, low, _, _ = state
            floor = jnp.maximum(l_k, lmin)
            token, value, _ = _inverse_cdf(lr, (t_r, best_r, floor, low),
                                           _uniform(keys[r], round_))
            # value strictly increases from round to round, and the best token is accepted
            ok = (p >= 1.0) | (_mass_above(lr, t_r, best_r, l_k, value) < target)
            return round_ + 1, value, token, ok

        state = (jnp.int32(1), jnp.float32(-jnp.inf), jnp.int32(0), jnp.bool_(False))
        _, _, token, ok = jax.lax.while_loop(not_done, round_, state)
        # (`argmax` is not computed when no row is greedy: the row's own)
        return jnp.where(ok, token, argmax_rows(lr[None])[0])

    def next_row(state):
        tokens, pending = state
        r = jnp.argmax(pending)
        return tokens.at[r].set(exact_row(r)), pending.at[r].set(False)

    tokens, _ = jax.lax.while_loop(lambda s: jnp.any(s[1]), next_row, (tokens, pending))
    return tokens
