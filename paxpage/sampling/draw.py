"""Exact draws from temperature / top-k / top-p / min-p filtered distributions, without sorting
or scanning the vocabulary once per threshold bit.

Axis legend: R rows, V vocabulary, C candidates (a row's C best tokens, descending), N blocks of
the vocabulary, B tokens per block.

A non-greedy row with scaled logits x = logits / temperature draws token i with probability
proportional to exp(x_i) over the kept set {logits >= max(v_k, v_p, v_m)} (`filter_logits'`
semantics, ties at a threshold kept):
  v_k  the top_k-th largest logit (top_k off: -inf)
  v_p  the largest v whose {logits >= v} holds top_p of the top-k set's mass (top_p 1: -inf)
  v_m  max(logits) + temperature * log(min_p), i.e. p_i >= min_p * p_max (min_p off: -inf)
Thresholds compare logits, not x, which has their order (up to ties made by rounding): x is
recomputed in each pass, possibly rounded differently, and a drawn token must compare equal
to itself from one pass to the next.

Every draw is a Gumbel-max: the argmax of log-weight + Gumbel noise, the noise a pure function
of the row's key and the block or token id (paxpage/sampling/noise.py). So a draw is exact in
distribution and moves only when two noisy scores nearly tie: a logit changed by a rounding
error (another tensor-parallel reduction order, another batch) leaves the token alone unless
its score and another's are that close. No draw walks cumulative sums, where the same error
would shift every tail token's interval. A draw over the whole vocabulary is two-level: a block
by Gumbel-max over the log of the block sums, then a token inside it by Gumbel-max over its
tokens; P(block) * P(token | block) is the token's probability, and the noise of V / B + B
indices per row costs little beside the one exp pass that the block sums need.

Each row takes one of three paths, chosen from the row alone, so a seeded row draws the same
token whatever batch it is in:
  candidates  top_k <= C and no tie across the C-th candidate: the top-k set lies in
              lax.top_k's C best, every threshold is found there, and the draw is a Gumbel-max
              over at most C tokens.
  proposal    top_k off: one two-level draw from the whole distribution, accepted when the token
              is kept (min-p: a comparison; top-p: the mass of strictly better tokens is below
              the target, one masked sum). Accepted draws are distributed exactly as the kept
              set; a row accepts with probability at least top_p * (mass kept by min-p), so few
              rows go on.
  exact       the rest (top_k > C, a tie at the C-th candidate, rejected proposals), one row at
              a time: the top-k threshold by bisection, then rejection rounds restricted to
              {logits > the last rejected logit}, each a few passes over one row; the best token is
              always accepted, so it ends.

On CPU at R = 256, V = 49152 an elementwise pass over [R, V] costs ~30-60 ms; the first two paths
cost one or two such passes (plus lax.top_k over C when some row sets top_k), instead of the
64 passes of a threshold bisection. Randomness: round 0 is the candidate or proposal draw, round
r > 0 the exact path's r-th rejection round, each with its own noise streams.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paxpage.sampling.noise import BLOCK_STREAM, TOKEN_STREAM, gumbel

NUM_CANDIDATES = 128  # top_k up to this takes the candidate path
_BLOCK = 256  # tokens per block of the two-level draw over the whole vocabulary
_MAX_ROUNDS = 200  # rejection rounds of one row on the exact path (a guard: see exact_row)
_GPU_PLATFORMS = ("cuda", "rocm")


def by_platform(select_fn, branch_fn, *operands, branchless: bool | None = None):
    """select_fn(*operands) where this lowers for a GPU, branch_fn(*operands) elsewhere.

    XLA:GPU copies a conditional's predicate and a data-dependent loop's condition to the host
    and waits for them, each time; XLA:CPU and TPU decide on the device. So the GPU lowering
    computes every stage and combines them with selects (select_fn), where the CPU skips the
    stages no row needs (branch_fn). branchless True / False picks one on any platform (tests)."""
    if branchless is not None:
        return (select_fn if branchless else branch_fn)(*operands)
    return jax.lax.platform_dependent(*operands, **{p: select_fn for p in _GPU_PLATFORMS}, default=branch_fn)


def cond_or_select(pred, true_fn, false_fn, *operands, branchless: bool | None = None):
    """lax.cond(pred, true_fn, false_fn, *operands), or on a GPU both and a select (by_platform)."""
    def select(*ops):
        return jax.tree.map(lambda a, b: jnp.where(pred, a, b), true_fn(*ops), false_fn(*ops))

    return by_platform(select, lambda *ops: jax.lax.cond(pred, true_fn, false_fn, *ops), *operands,
                       branchless=branchless)


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


def _pick(cum: jax.Array, target: jax.Array) -> jax.Array:
    """Index of `target` (in [0, total)) in non-decreasing cumulative sums cum[..., M]: the first
    entry above target, never an entry of zero weight (rounding past the end lands on the last
    entry of positive weight). -> i32[...]. Finds thresholds (top-p's), never a draw."""
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


def _log_weights(logits: jax.Array, temperature, best, floor, low) -> jax.Array:
    """log of `_weights`: logits / temperature - best where kept, else -inf."""
    temperature, best, floor, low = (_expand(a, logits.ndim) for a in (temperature, best, floor, low))
    kept = (logits >= floor) & (logits > low)
    return jnp.where(kept, logits / temperature - best, -jnp.inf)


def gumbel_argmax(scores: jax.Array, keys: jax.Array, stream, ids: jax.Array) -> jax.Array:
    """Position of the largest scores + gumbel(keys, stream, ids) per row: a draw from
    softmax(scores). scores f32[R, M] (-inf: never drawn, unless the whole row is), keys
    u32[R, 2], ids i32[R, M] or i32[M] the noise indices. -> i32[R]."""
    noisy = jnp.where(scores > -jnp.inf, scores + gumbel(keys, stream, ids), -jnp.inf)
    return jax.lax.top_k(noisy, 1)[1][:, 0].astype(jnp.int32)


def two_level_draw(logits: jax.Array, weight_args, keys: jax.Array, round_):
    """Draw from _weights(logits, *weight_args) over the whole vocabulary: a block by Gumbel-max
    over the log block sums (noise stream 2 round + BLOCK_STREAM, indexed by block), then a token
    in it by Gumbel-max over its log-weights (2 round + TOKEN_STREAM, indexed by token id).
    logits f32[R, V], weight_args per-row f32[R] each, keys u32[R, 2] -> (token i32[R], its
    logit f32[R], total weight f32[R]). A row of zero weight gives token 0 (never used)."""
    num_rows = logits.shape[0]
    xb = _blocks(logits)  # [R, N, B]
    num_blocks = xb.shape[1]
    block_sums = jnp.sum(_weights(xb, *weight_args), axis=-1)  # [R, N]
    total = jnp.sum(block_sums, axis=-1)
    stream = 2 * jnp.asarray(round_, jnp.int32)
    block = gumbel_argmax(jnp.log(block_sums), keys, stream + BLOCK_STREAM,
                          jnp.arange(num_blocks, dtype=jnp.int32))
    xin = jnp.take_along_axis(xb, block[:, None, None], axis=1)[:, 0, :]  # [R, B]
    ids = block[:, None] * _BLOCK + jnp.arange(_BLOCK, dtype=jnp.int32)  # [R, B]
    inner = gumbel_argmax(_log_weights(xin, *weight_args), keys, stream + TOKEN_STREAM, ids)
    value = jnp.take_along_axis(xin, inner[:, None], axis=-1)[:, 0]
    return (block * _BLOCK + inner).reshape(num_rows), value, total


def _mass_above(logits: jax.Array, temperature, best, floor, value) -> jax.Array:
    """Weight of {logits >= floor, logits > value}: f32[...]."""
    return jnp.sum(_weights(logits, temperature, best, floor, value), axis=-1)


def draw(logits: jax.Array, best_logit: jax.Array, temperature: jax.Array, top_k: jax.Array,
         top_p: jax.Array, min_p: jax.Array, keys: jax.Array, greedy: jax.Array,
         proposal=None, branchless: bool | None = None) -> jax.Array:
    """Tokens i32[R] for logits f32[R, V] (penalised), best_logit f32[R] = their row max,
    temperature f32[R] (rows with `greedy` take the argmax), top_k i32[R] (0 off),
    top_p f32[R], min_p f32[R], keys u32[R, 2] the row keys (tensors.row_keys).
    proposal: None (the proposal path in XLA ops), or a function with the signature of
    pallas_kernels.native_sampling.proposal_draw_ref that runs it instead (the native CPU kernel).
    branchless: see by_platform (None: selects where this lowers for a GPU). Without branches
    every path is computed for every row, and the exact path's rows draw by `exact_rows`."""
    num_rows, vocab = logits.shape
    num_cands = min(NUM_CANDIDATES, vocab)
    temperature = jnp.where(greedy, 1.0, temperature)
    best = best_logit / temperature  # == max(x) exactly: x / t is monotone in x
    keys = keys.astype(jnp.uint32)
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
    cand_logits, cand_ids = by_platform(
        top_candidates, lambda x: jax.lax.switch(which, (no_candidates, argmax_only, top_candidates), x), logits,
        branchless=branchless)
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
    # the draw: Gumbel-max over the kept candidates, noise indexed by token id
    cand_scores = jnp.where(cand_logits >= floor[:, None], cand_logits / temperature[:, None] - best[:, None],
                            -jnp.inf)
    picked = gumbel_argmax(cand_scores, keys, TOKEN_STREAM, cand_ids)
    cand_token = jnp.take_along_axis(cand_ids, picked[:, None], -1)[:, 0]

    # ---- proposal: rows without top_k draw from the whole distribution, then check the draw.
    proposing = sampled & (top_k <= 0)
    no_floor = jnp.full((num_rows,), -jnp.inf, jnp.float32)

    def propose(logits):
        if proposal is not None:
            return proposal(logits, temperature, best, l_min, top_p, keys, proposing)
        token, value, total = two_level_draw(logits, (temperature, best, no_floor, no_floor), keys, 0)
        kept = value >= l_min

        def top_p_test(_):
            return _mass_above(logits, temperature, best, no_floor, value) < top_p * total

        checks_top_p = proposing & (top_p < 1.0)
        kept &= cond_or_select(jnp.any(checks_top_p), top_p_test, lambda _: jnp.ones((num_rows,), bool), None,
                               branchless=branchless) | ~checks_top_p
        return token, kept

    prop_token, accepted = cond_or_select(
        jnp.any(proposing), propose,
        lambda _: (jnp.zeros((num_rows,), jnp.int32), jnp.zeros((num_rows,), bool)), logits,
        branchless=branchless)

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
            token, value, _ = two_level_draw(lr[None], (t_r, best_r, floor, low), keys[r][None], round_)
            token, value = token[0], value[0]
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

    def one_row_at_a_time(tokens):
        return jax.lax.while_loop(lambda s: jnp.any(s[1]), next_row, (tokens, pending))[0]

    def every_row(tokens):
        exact = exact_rows(logits, temperature, best, top_k, top_p, l_min, keys)
        return jnp.where(pending, exact, tokens)

    return by_platform(every_row, one_row_at_a_time, tokens, branchless=branchless)


def exact_rows(logits: jax.Array, temperature: jax.Array, best: jax.Array, top_k: jax.Array,
               top_p: jax.Array, l_min: jax.Array, keys: jax.Array) -> jax.Array:
    """The exact path for every row at once, in a fixed number of passes (no data-dependent
    loop): the top-k threshold by bisection over the sortable keys, then top-p's (the largest
    key whose {keys >= it} holds top_p of the top-k set's mass: a token is kept exactly when
    the mass strictly above it is below the target, as on the one-row path), then one two-level
    draw (round 1's noise) from the kept set. About 70 passes over [R, V]: the branchless
    lowering pays them every sampled step, where the one-row path runs only for the rows the
    other paths leave. logits f32[R, V]; temperature, best (max logit / temperature), top_p,
    l_min (min-p's floor on logits) f32[R]; top_k i32[R] (0 off); keys u32[R, 2] -> i32[R]."""
    vocab = logits.shape[-1]
    sort_keys = sortable_keys(logits)  # [R, V]
    top_k = jnp.where(top_k > 0, top_k, vocab)[:, None]
    k_tau = largest_threshold(sort_keys, lambda kept: jnp.sum(kept, -1, keepdims=True) >= top_k)  # [R, 1]
    no_floor = jnp.full(best.shape, -jnp.inf, jnp.float32)
    weights = jnp.where(sort_keys >= k_tau, _weights(logits, temperature, best, no_floor, no_floor), 0.0)
    target = top_p[:, None] * jnp.sum(weights, -1, keepdims=True)
    p_tau = largest_threshold(
        sort_keys, lambda kept: jnp.sum(jnp.where(kept, weights, 0.0), -1, keepdims=True) >= target)
    tau = jnp.where(top_p[:, None] >= 1.0, k_tau, jnp.maximum(k_tau, p_tau))
    floor = jnp.min(jnp.where(sort_keys >= tau, logits, jnp.inf), axis=-1)  # the kept set's least logit
    token, _, _ = two_level_draw(logits, (temperature, best, jnp.maximum(floor, l_min), no_floor), keys, 1)
    return token
