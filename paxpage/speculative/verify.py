"""Acceptance of a step's drafts, on device, row by row.

Every logits row r of a verify step carries the draft token the target is asked to judge there,
`draft_ids[r]` (-1: no draft, e.g. a plain decode row or the bonus row after a sequence's last
draft). Row r computes, independently of every other row, `target`: the token the plain sampler
draws from the row (paxpage/sampling/sampler.py, unchanged: penalties, temperature, top-k / top-p /
min-p, the row's key), then `accept` and `token`:
  * deterministic drafts (q one-hot on the draft x; n-gram): accept iff target == x, and
    token = target. Drawing target ~ p and accepting when it equals x accepts with probability
    p(x) = min(1, p(x) / q(x)) and, on rejection, emits target given target != x, which is the
    residual norm(max(p - q, 0)): this is rejection sampling, coupled to the plain sampler's
    draw, so a seeded request emits exactly the tokens it emits without speculation.
  * drafts with a distribution q (a draft model): greedy rows as above (q plays no part); sampled
    rows accept iff u < p(x) / q(x), with p the request's processed distribution (the sampler's
    `apply_penalties` and `filter_logits`, softmax at the temperature) and u a uniform from the
    row's key; token = x when accepted, else a draw from norm(max(p - q, 0)).
The host then keeps, per sequence, the drafts up to its first rejected row and one more token:
the `token` of that row (a correction, or the bonus row's target when all were accepted). This
is standard speculative rejection sampling (Leviathan et al., Chen et al.): each emitted token
is distributed exactly as the target's, and greedy outputs equal non-speculative ones token for
token. The reported logprob of a row is its `token`'s under the penalised logits before
temperature, as the sampler reports it.

Axis legend: R logits rows, V vocabulary, L top logprobs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from paxpage.sampling import sampler as sampler_lib
from paxpage.sampling.tensors import SamplingTensors
from paxpage.sampling.draw import cond_or_select
from paxpage.sampling.params import GREEDY_TEMPERATURE

_ACCEPT_SALT = 0x5EC0  # fold_in constants: the row key's draws for acceptance and the residual
_RESIDUAL_SALT = 0x5EC1


def target_probs(penalised: jax.Array, t: SamplingTensors) -> jax.Array:
    """The processed distribution p f32[R, V] of sampled rows: penalised logits / temperature,
    top-k / top-p / min-p filtered (as the sampler filters), softmax."""
    temperature = jnp.maximum(t.temperature, GREEDY_TEMPERATURE)[:, None]
    return jax.nn.softmax(sampler_lib.filter_logits(penalised / temperature, t), axis=-1)


def residual_draw(p: jax.Array, q: jax.Array, keys: jax.Array) -> jax.Array:
    """One token per row from norm(max(p - q, 0)), f32[R, V] each; rows where that is all zero
    (p == q: rejection was impossible) draw from p. keys: typed [R]. -> i32[R]."""
    residual = jnp.maximum(p - q, 0.0)
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p)
    draw = jax.vmap(lambda key, w: jax.random.categorical(
        jax.random.fold_in(key, _RESIDUAL_SALT), jnp.log(w)))
    return draw(keys, residual).astype(jnp.int32)


def accept_rows(p: jax.Array, draft_ids: jax.Array, q: jax.Array | None, keys: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
    """Rejection sampling of drafts, per row. p f32[R, V] target distributions, draft_ids i32[R]
    (>= 0), q f32[R, V] draft distributions or None (one-hot on the draft), keys typed [R].
    Returns (accepted bool[R], residual token i32[R], meaningful where not accepted)."""
    num_rows, vocab = p.shape
    p_x = jnp.take_along_axis(p, draft_ids[:, None], -1)[:, 0]
    if q is None:
        q_x = jnp.ones((num_rows,), p.dtype)
        q = jax.nn.one_hot(draft_ids, vocab, dtype=p.dtype)
    else:
        q_x = jnp.take_along_axis(q, draft_ids[:, None], -1)[:, 0]
    u = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, _ACCEPT_SALT)))(keys)
    accepted = u * q_x < p_x  # accept with probability min(1, p(x) / q(x))
    return accepted, residual_draw(p, q, keys)


@functools.partial(jax.jit, static_argnames=("num_logprobs", "draw_impl"))
def verify(logits: jax.Array, t: SamplingTensors, draft_ids: jax.Array,
           draft_dists: jax.Array | None = None, num_logprobs: int = 0, pending=None,
           draw_impl: str = "xla") -> tuple[sampler_lib.SamplerOutput, jax.Array]:
    """logits f32[R, V], draft_ids i32[R] (-1 none), draft_dists f32[R, V] or None (one-hot),
    (structured outputs' masks applied to the logits already), pending None or (rows, prev) (as the
    runner's sampler takes them: sampler.sample_rows), draw_impl the runner's (sampler.sample)
    -> (SamplerOutput whose token_ids / logprobs are each row's `token`, accepted bool[R])."""
    logits = logits.astype(jnp.float32)
    pending = sampler_lib.pending_tokens(pending)
    out = sampler_lib.sample(logits, t, num_logprobs, draw_impl=draw_impl, pending=pending)
    has_draft = draft_ids >= 0
    drafts = jnp.maximum(draft_ids, 0)
    # t.penalised: the host knows whether a row is penalised or bans tokens (as `sample` does)
    penalised = sampler_lib.penalties(draw_impl)(logits, t, pending) if t.penalised else logits
    accepted = has_draft & (drafts == out.token_ids)
    tokens = out.token_ids
    if draft_dists is not None:  # rejection sampling against the draft's q
        greedy = t.temperature <= GREEDY_TEMPERATURE
        keys = jax.random.wrap_key_data(t.keys, impl="threefry2x32")

        def sampled_rows(penalised):
            return accept_rows(target_probs(penalised, t), drafts, draft_dists, keys)

        no_rows = (jnp.zeros(has_draft.shape, bool), jnp.zeros(has_draft.shape, jnp.int32))
        # on a GPU both branches and a select (no predicate copied to the host and waited on)
        accepted_s, residual = cond_or_select(jnp.any(has_draft & ~greedy), sampled_rows,
                                              lambda _: no_rows, penalised)
        sampled = has_draft & ~greedy
        accepted = jnp.where(sampled, accepted_s, accepted)
        tokens = jnp.where(sampled, jnp.where(accepted_s, drafts, residual), tokens)
    best = jnp.max(penalised, axis=-1)
    log_total = sampler_lib.log_normaliser(penalised, best)
    chosen = (jnp.take_along_axis(penalised, tokens[:, None], -1)[:, 0] - best) - log_total
    return sampler_lib.SamplerOutput.of(tokens, chosen, out.top_ids, out.top_logprobs), accepted
