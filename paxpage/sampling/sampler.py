"""One jitted sampler for the whole batch; every sampling parameter is a per-row array.

Axis legend: R logits rows (sequences sampled this step, padded), V vocabulary,
S distinct penalty-token slots per row, E banned-token slots per row,
L number of top logprobs reported, W = ceil(V / 32) words of an allowed-token bitmask.

Structured outputs come first, in their own call (`apply_bitmask`, before `sample` or
speculative verify): tokens outside a constrained row's allowed-token bitmask -> -inf. Only the
constrained rows' masks travel and are applied, so the sampler has no bitmask variant and a step
with one constrained row among hundreds pays for one row.

Order of operations in `sample` (vLLM semantics):
  1. banned ids (min_tokens: EOS / stop tokens) -> -inf
  2. repetition penalty (HF) over prompt + output tokens, then presence / frequency penalties
     (OpenAI) over output tokens
  3. logprobs = log_softmax(penalised logits): the reported logprobs, before temperature
  4. greedy rows (temperature ~ 0) take argmax of the penalised logits
  5. sampled rows: / temperature, top-k, top-p, min-p filtering, then one draw with the row key
     (paxpage/sampling/draw.py: an exact Gumbel-max, without sorting the vocabulary, whose token
     moves under a rounding change of the logits only at a near tie of two noisy scores)

The host never builds [R, V] arrays: penalties get each row's distinct token ids with their
output counts, and only those logits are gathered, penalised and scattered back. Which rows are
greedy / filtered is data: the costly stages sit behind `lax.cond(any row needs it)` (lowered
for a GPU, where a conditional waits on the host, every stage runs and selects combine them:
draw.py by_platform). Two host
facts are static (SamplingTensors.greedy_only, .penalised), so a shape has three variants: all
greedy, none penalised, any. Only the shapes compile besides: R, V, S (powers of two >= 16
capped at `token_width`), E (powers of two >= 4) and the static num_logprobs.

CPU cost notes (V = 49152): XLA's CPU sort takes ~8 ms per row, so `filter_logits` finds the
top-k / top-p thresholds by an exact 32-step bisection over the float bits, and `sample` does not
need them at all on its common paths; argmax is draw.py argmax_rows (block maxima, then
one block), ~4x faster than lax.top_k(x, 1) and ~15x faster than jnp.argmax on CPU; the [R, V]
log-softmax is only built when top logprobs are asked for.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from models.invariant_ops import pairwise_sum
from paxpage.sampling import fields
from paxpage.sampling.draw import (argmax_rows, by_platform, cond_or_select, draw, largest_threshold,
                                   sortable_keys)
from paxpage.sampling.params import GREEDY_TEMPERATURE
from paxpage.sampling.tensors import SamplingTensors


@functools.partial(jax.tree_util.register_dataclass, data_fields=["packed"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    """A step's sampled tokens, their logprobs and the top alternatives, held as one array: what
    the host reads of a step is then one transfer (one wait, one copy from an accelerator, one
    first read of the memory the CPU backend just wrote), not one per field. Build it with `of`;
    the fields read as views of `packed`, on the device (jax arrays) or the host (numpy)."""

    packed: jax.Array  # i32[R, 2 + 2L]: token, the logprob's bits, L top ids, their logprobs' bits

    @classmethod
    def of(cls, token_ids: jax.Array, logprobs: jax.Array, top_ids: jax.Array, top_logprobs: jax.Array
           ) -> SamplerOutput:
        """token_ids i32[R] sampled token per row; logprobs f32[R] the sampled token's logprob
        (penalised logits, no temperature); top_ids i32[R, L] most likely tokens, descending, and
        top_logprobs f32[R, L] theirs (L may be 0)."""
        def bits(x):
            return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)

        return cls(jnp.concatenate([token_ids.astype(jnp.int32)[:, None], bits(logprobs)[:, None],
                                    top_ids.astype(jnp.int32), bits(top_logprobs)], axis=1))

    @property
    def num_top(self) -> int:
        return (self.packed.shape[1] - 2) // 2

    @property
    def token_ids(self):  # i32[R]
        return self.packed[:, 0]

    @property
    def logprobs(self):  # f32[R]
        return _as_float(self.packed[:, 1])

    @property
    def top_ids(self):  # i32[R, L]
        return self.packed[:, 2:2 + self.num_top]

    @property
    def top_logprobs(self):  # f32[R, L]
        return _as_float(self.packed[:, 2 + self.num_top:])


def _as_float(bits):
    if isinstance(bits, np.ndarray):
        return bits.view(np.float32)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def counted_pending(t: SamplingTensors, pending: jax.Array) -> jax.Array:
    """i32[R]: `pending` (apply_penalties') where a row has a penalty, else -1 (a row that only
    bans ids counts no tokens)."""
    return jnp.where(fields.counted_rows(lambda name: getattr(t, name)), pending, -1).astype(jnp.int32)


def apply_penalties(logits: jax.Array, t: SamplingTensors, pending: jax.Array | None = None) -> jax.Array:
    """Banned ids, then repetition (HF), presence and frequency (OpenAI) penalties. [R, V].

    Penalties touch only the listed tokens: gather their logits [R, S], penalise, and write them
    back with the banned ids' -inf in one scatter (each materialised [R, V] array costs tens of
    ms on CPU at R = 256, V = 49152). The ids of a row are distinct, so the scatter is a plain
    set; unpenalised rows write back their own values (x / 1 - 0 == x), so no lax.cond.

    pending: None, or i32[R] one more output token per row (-1: none) that t's lists leave out:
    with async scheduling a row's last token is still on the device when the host builds t. It
    counts as if listed: one more occurrence of an id already there, else a new id of count 1."""
    num_rows, vocab_size = logits.shape
    ids, counts = t.token_ids, t.token_counts  # [R, S]
    if pending is not None:
        pending = counted_pending(t, pending)[:, None]  # [R, 1]
        listed = (ids == pending) & (pending >= 0)  # [R, S]: at most one per row (ids are distinct)
        new = jnp.where(jnp.any(listed, axis=-1, keepdims=True), -1, pending)
        ids = jnp.concatenate([ids, new], axis=1)  # [R, S + 1]
        counts = jnp.concatenate([counts + listed, (new >= 0).astype(counts.dtype)], axis=1)
    x = jnp.take_along_axis(logits, jnp.maximum(ids, 0), axis=-1)
    x = jnp.where(jnp.any(ids[:, :, None] == t.banned_ids[:, None, :], axis=-1), -jnp.inf, x)
    rep = t.repetition_penalty[:, None]
    x = jnp.where(x < 0, x * rep, x / rep)
    counts = counts.astype(jnp.float32)
    x = x - t.frequency_penalty[:, None] * counts
    x = x - t.presence_penalty[:, None] * (counts > 0)
    banned = jnp.full(t.banned_ids.shape, -jnp.inf, jnp.float32)
    all_ids = jnp.concatenate([t.banned_ids, ids], axis=1)  # [R, E + S]
    rows = jnp.broadcast_to(jnp.arange(num_rows)[:, None], all_ids.shape)
    cols = jnp.where(all_ids < 0, vocab_size, all_ids)  # padding goes out of bounds and is dropped
    return logits.at[rows, cols].set(jnp.concatenate([banned, x], axis=1), mode="drop")


def filter_logits(scaled: jax.Array, t: SamplingTensors) -> jax.Array:
    """Top-k, then top-p on the renormalised top-k set, then min-p; dropped tokens -> -inf.

    Each filter keeps {x >= threshold} per row, so ties at the threshold are all kept
    (as in vLLM). The best token is always kept."""
    vocab_size = scaled.shape[-1]
    needs_top_k_top_p = jnp.any((t.top_k > 0) | (t.top_p < 1.0))

    def top_k_top_p(scaled):
        keys = sortable_keys(scaled)  # [R, V]
        top_k = jnp.where(t.top_k > 0, t.top_k, vocab_size)[:, None]
        k_floor = largest_threshold(keys, lambda kept: jnp.sum(kept, -1, keepdims=True) >= top_k)
        in_top_k = keys >= k_floor
        probs = jnp.where(in_top_k, jnp.exp(scaled - jnp.max(scaled, -1, keepdims=True)), 0.0)
        # top-p on the top-k set renormalised: kept mass >= top_p * (mass of the top-k set)
        target = t.top_p[:, None] * jnp.sum(probs, -1, keepdims=True)
        p_floor = largest_threshold(
            keys, lambda kept: jnp.sum(jnp.where(kept, probs, 0.0), -1, keepdims=True) >= target)
        # top_p == 1 keeps the whole top-k set, whatever the rounding of the sums.
        p_floor = jnp.where(t.top_p[:, None] >= 1.0, k_floor, p_floor)
        return jnp.where(keys >= jnp.maximum(k_floor, p_floor), scaled, -jnp.inf)

    scaled = cond_or_select(needs_top_k_top_p, top_k_top_p, lambda s: s, scaled)
    # min-p compares probabilities to the best one: p_i >= min_p * p_max
    # <=> x_i >= x_max + log(min_p), unaffected by the renormalisation after top-k / top-p.
    best = jnp.max(scaled, axis=-1, keepdims=True)
    min_p = t.min_p[:, None]
    floor = jnp.where(min_p > 0, best + jnp.log(jnp.where(min_p > 0, min_p, 1.0)), -jnp.inf)
    return jnp.where(scaled >= floor, scaled, -jnp.inf)


def apply_bitmask(logits: jax.Array, masks) -> jax.Array:
    """logits f32[R, V], masks a structured_backend.RowMasks: rows i32[K] (a row >= R is padding,
    ignored; no row twice) and words i32[K, W] (bit j of word w allows token 32 w + j; W * 32 >= V,
    bits past V ignored) -> logits with the tokens that row masks[k] disallows at -inf. Rows not
    listed are unchanged. Jitted with the logits donated, it writes them in place: the [K, V]
    rows are gathered, masked and scattered back, never an [R, V] mask."""
    rows, words = masks
    num_masks, vocab_size = words.shape[0], logits.shape[1]
    shifts = jnp.arange(32, dtype=jnp.uint32)
    bits = (words.astype(jnp.uint32)[:, :, None] >> shifts) & 1  # [K, W, 32]
    bits = bits.reshape(num_masks, -1)[:, :vocab_size]
    x = logits.at[rows].get(mode="fill", fill_value=0)  # [K, V]
    return logits.at[rows].set(jnp.where(bits != 0, x, -jnp.inf).astype(logits.dtype), mode="drop")


@functools.partial(jax.jit, static_argnames=("num_logprobs", "draw_impl"))
def sample(logits: jax.Array, t: SamplingTensors, num_logprobs: int = 0, draw_impl: str = "xla",
           pending: jax.Array | None = None) -> SamplerOutput:
    """logits [R, V] (any float dtype) -> SamplerOutput. Rows are independent of each other.

    Which rows are greedy or filtered is data, not a compile parameter: the costly parts sit
    behind lax.cond on "does any row need this". Three executables per shape serve any mix:
    all rows greedy and unpenalised (t.greedy_only), no row penalised (t.penalised False), and
    any rows.
    draw_impl: "xla", or "native" (CPU only, once `resolve_draw_impl` returned it): the proposal
    draw of sampled rows without top-k runs as the native kernel (pallas_kernels/native_sampling.py),
    and the penalties as theirs (pallas_kernels/native_penalties.py);
    or "select": no stage behind a branch on any platform, as "xla" lowers for a GPU on its own
    (draw.py by_platform; tests run it on the CPU).
    pending: None, or i32[R] each row's output token that t's penalty lists leave out (-1: none;
    see apply_penalties)."""
    logits = logits.astype(jnp.float32)
    if t.greedy_only:  # nothing to ban or penalise, every row takes its argmax
        return _sample(logits, t, num_logprobs, greedy_only=True)
    if t.penalised:
        logits = penalties(draw_impl)(logits, t, pending)
    return _sample(logits, t, num_logprobs, proposal=_proposal(draw_impl),
                   branchless=True if draw_impl == "select" else None)


DRAW_IMPLS = ("xla", "native", "select")


def resolve_draw_impl(native_allowed: bool) -> str:
    """"native" when native kernels are allowed here (the runner's attention resolved to its native
    CPU kernel) and the native proposal draw and penalties build and load, else "xla"."""
    if not native_allowed:
        return "xla"
    from models.cache import native_dir
    from pallas_kernels import native_penalties, native_sampling

    ok = native_sampling.load(native_dir()) and native_penalties.load(native_dir())
    return "native" if ok else "xla"


def penalties(draw_impl: str):
    """`apply_penalties`, or its native CPU kernel where draw_impl is "native"."""
    if draw_impl != "native":
        return apply_penalties
    from pallas_kernels.native_penalties import apply_penalties_native

    return apply_penalties_native


def _proposal(draw_impl: str):
    if draw_impl not in DRAW_IMPLS:
        raise ValueError(f"draw_impl is {draw_impl!r}; expected one of {DRAW_IMPLS}")
    if draw_impl != "native":
        return None
    from pallas_kernels.native_sampling import proposal_draw_native

    return proposal_draw_native


def _sample(logits: jax.Array, t: SamplingTensors, num_logprobs: int, greedy_only: bool = False,
            proposal=None, branchless: bool | None = None) -> SamplerOutput:
    """`sample` on penalised f32 logits (greedy_only: every row is greedy; no draw compiled;
    proposal, branchless: see draw.py draw)."""
    best = jnp.max(logits, axis=-1)  # [R]
    # log_softmax's own terms, so a gathered logprob equals its entry of log_softmax(logits)
    log_total = log_normaliser(logits, best)  # [R]
    greedy = t.temperature <= GREEDY_TEMPERATURE

    def draw_rows(logits):
        return draw(logits, best, t.temperature, t.top_k, t.top_p, t.min_p, t.keys, greedy, proposal, branchless)

    def greedy_or_draw(logits):  # the draw's stages only when some row draws
        return jax.lax.cond(jnp.all(greedy), argmax_rows, draw_rows, logits)

    # Without branches the draw serves greedy rows too (their argmax is its candidates' first).
    token_ids = argmax_rows(logits) if greedy_only else by_platform(draw_rows, greedy_or_draw, logits,
                                                                    branchless=branchless)
    if num_logprobs > 0:
        logprobs = (logits - best[:, None]) - log_total[:, None]  # [R, V]
        chosen = jnp.take_along_axis(logprobs, token_ids[:, None], axis=-1)[:, 0]
        top_logprobs, top_ids = jax.lax.top_k(logprobs, num_logprobs)
    else:
        chosen = (jnp.take_along_axis(logits, token_ids[:, None], axis=-1)[:, 0] - best) - log_total
        top_logprobs = jnp.zeros((logits.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return SamplerOutput.of(token_ids, chosen, top_ids, top_logprobs)


def log_normaliser(logits: jax.Array, best: jax.Array) -> jax.Array:
    """log sum exp(logits - best) per row of f32[R, V] -> f32[R], summed in a fixed pairwise order:
    XLA CPU's reduce over V orders a row's sum by the row count at some widths (V = 128: from 33
    rows), and a reported logprob must not depend on what shares the step (batch_invariant)."""
    return jnp.log(pairwise_sum(jnp.exp(logits - best[:, None])))


def _logprobs_of(logprobs: jax.Array, token_ids: jax.Array, num_top: int):
    """logprobs f32[R, V], token_ids i32[R] -> (chosen f32[R], top ids i32[R, L], top f32[R, L])."""
    chosen = jnp.take_along_axis(logprobs, token_ids[:, None], axis=-1)[:, 0]
    if num_top > 0:
        top_logprobs, top_ids = jax.lax.top_k(logprobs, num_top)
    else:
        top_logprobs = jnp.zeros((logprobs.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logprobs.shape[0], 0), jnp.int32)
    return chosen, top_ids.astype(jnp.int32), top_logprobs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    target_logprobs: jax.Array  # f32[Rp] logprob of each prompt token given its prefix
    top_ids: jax.Array  # i32[Rp, L]
    top_logprobs: jax.Array  # f32[Rp, L]


@functools.partial(jax.jit, static_argnames=("num_top",))
def score_prompt(logits: jax.Array, targets: jax.Array, num_top: int) -> PromptLogprobs:
    """Prompt logprobs, vLLM semantics: log-softmax of the raw model logits (no penalties,
    no temperature). logits f32[Rp, V], targets i32[Rp]."""
    logits = logits.astype(jnp.float32)
    best = jnp.max(logits, axis=-1)
    logprobs = (logits - best[:, None]) - log_normaliser(logits, best)[:, None]
    return PromptLogprobs(*_logprobs_of(logprobs, targets, num_top))


def sample_rows(logits, sampling, pending, num_logprobs: int, num_rows: int, draw_impl: str = "xla"):
    """The runner's sampler executable: `sample`, and its tokens i32[R] cut or zero-padded to
    i32[num_rows] (async scheduling's `next_tokens`), in one executable: a separate jit would be
    one more compile per R. pending: None, or (rows i32[R], prev i32[R_max]): row r's last
    output, which its penalty lists lack, is prev[rows[r]] (-1: none; see apply_penalties)."""
    out = sample(logits, sampling, num_logprobs, draw_impl=draw_impl, pending=pending_tokens(pending))
    token_ids = out.token_ids
    return out, jnp.zeros(num_rows, jnp.int32).at[:token_ids.shape[0]].set(token_ids[:num_rows])


def pending_tokens(pending) -> jax.Array | None:
    """None, or (rows i32[R], prev i32[R_max]) -> i32[R] prev[rows] where rows >= 0, else -1."""
    if pending is None:
        return None
    rows, prev = pending
    return jnp.where(rows >= 0, prev[jnp.maximum(rows, 0)], -1)


def sampler_variants(sampling_for_rows, num_logits: int) -> list[SamplingTensors]:
    """The SamplingTensors whose sampler executables the runner's precompile makes for
    R = num_logits rows: all-greedy (argmax only), unpenalised and any rows."""
    greedy = sampling_for_rows(num_logits)
    plain = dataclasses.replace(greedy, greedy_only=False, penalised=False)
    return [greedy, plain, dataclasses.replace(plain, penalised=True)]
