"""The draft model of draft-model speculation: its weights, its own KV pool, and the jitted
calls that keep that pool complete and propose tokens.

The pool is parallel to the target's: the same number of pages of the same page size, each
slot holding the draft's K/V (its layers, KV heads and head dim) for the token the target's
pool holds at that slot. So the draft needs no allocator of its own: it is addressed by the
page tables and slot mappings the scheduler gives the target, and preemption, prefix caching
(a cached page holds both models' K/V of its tokens), copy-on-write (`copy_pages` with the
same pairs) and rollback (lengths are cut; K/V past a sequence's length is never read) apply
to both pools at once. The price is pool bytes: `draft_page_bytes` (draft_model.py) per page on top of the
target's, which the pool sizing counts (paxpage/config.py).

Proposing runs before the scheduler gives the step's draft tokens their pages, so the draft's
pool has a few scratch pages past the target's: `scratch_pages_per_row` for each row of a
proposal batch. Row b's proposals past its last allocated page go to row b's scratch pages,
which only `propose` reads and writes (the target's page ids never reach them, so copies and
rollback leave them alone); proposals inside allocated pages land where the verify step writes
the same positions again.

Two jitted calls, both with the pool donated:
  `fill`     the draft over the target's StepBatch (same tokens, positions, slots, tables),
             writing K/V only (no logits are computed), so after every step the draft's pool
             holds K/V for every token the target's does;
  `propose`  k decode steps over B speculating rows: row b feeds its last token (whose K/V
             neither pool has yet) at position positions[b], then each proposed token in turn,
             writing their K/V at the slots the scheduler reserved for them; greedy rows take
             the argmax, sampled rows draw from the draft's processed distribution q
             (temperature, top-k, top-p, min-p; no penalties), which comes back for rejection
             sampling.

Axis legend: B speculating rows (padded), k proposed tokens per row, V vocabulary,
P pages per sequence (pages_per_seq).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models import layer_stack
from models.config import ModelConfig
from paxpage.batch import StepBatch
from paxpage.config import ResolvedConfig
from paxpage.packing import bucket
from paxpage.runner import ModelRunner
from paxpage.sampling import fields
from paxpage.sampling.draw import argmax_rows
from paxpage.sampling.params import GREEDY_TEMPERATURE, SamplingParams
from paxpage.sampling.sampler import filter_logits
from paxpage.sampling.tensors import row_key

# Mixed into each sampled row's seed so the draft's draws are independent of the target's
# (the acceptance test's uniforms must not be correlated with how the draft picked its token).
_DRAFT_SEED_SALT = 0x5EC0D1A7


class DraftRow(NamedTuple):
    """One speculating sequence, as `DraftRunner.propose` needs it."""

    last_token: int  # the sequence's last token: its K/V is in neither pool yet
    position: int  # that token's position (the sequence's length - 1)
    page_table: Sequence[int]  # the sequence's pages now (later positions use scratch pages)
    params: SamplingParams | None = None  # None: greedy
    seed: int = 0  # the request's sample seed (sampled rows)
    step: int = 0  # output tokens so far (sampled rows: with the seed, picks the row's key)


class Proposal(NamedTuple):
    """`propose`'s result, device arrays (rows past the real ones are padding)."""

    token_ids: jax.Array  # i32[B, k] proposed tokens
    probs: jax.Array | None  # f32[B, k, V] q: the distribution each token was drawn from; None: all greedy


class _Filters(NamedTuple):  # the fields `sampler.filter_logits` reads
    top_k: jax.Array  # i32[B]; 0 = off
    top_p: jax.Array  # f32[B]; 1 = off
    min_p: jax.Array  # f32[B]; 0 = off


class DraftRunner:
    def __init__(self, draft_cfg: ModelConfig, params, cfg: ResolvedConfig, num_speculative_tokens: int):
        """`cfg`: the target's resolved config with num_pages set; the draft's pool gets as many
        pages of the same size. The draft runs in the engine's dtype on the default device."""
        assert cfg.num_pages is not None, "the target's pool must be sized first"
        if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, int) \
                or num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be a positive int, got {num_speculative_tokens!r}")
        self.num_speculative_tokens = num_speculative_tokens
        # k proposals write positions n-1 .. n+k-2: past the last allocated page they span at most this many pages
        self.scratch_pages_per_row = (num_speculative_tokens - 1) // cfg.page_size + 2
        self.max_rows = bucket(cfg.max_num_seqs)
        self.first_scratch_page = cfg.num_pages
        pool_cfg = dataclasses.replace(cfg, num_pages=cfg.num_pages + self.max_rows * self.scratch_pages_per_row)
        self.runner = ModelRunner(draft_cfg, params, pool_cfg)
        self.model_cfg = draft_cfg
        self.cfg = cfg
        # the shape the engine's in-flight tokens have (the target's steps have the same shapes): one compile
        self._no_prev_tokens = jnp.zeros(self.runner.max_logits_rows, jnp.int32)
        self._fill = jax.jit(self._fill_fn, donate_argnums=(1,))
        self._propose = jax.jit(self._propose_fn, donate_argnums=(1,), static_argnames=("num_steps", "sampled"))

    @property
    def kv_cache(self) -> list[jax.Array]:
        return self.runner.kv_cache

    # ------------------------------------------------------------------ device calls
    def fill(self, batch: StepBatch, prev_rows: np.ndarray | None = None, prev_tokens: jax.Array | None = None) -> None:
        """Writes the draft's K/V of the target step `batch` (prev_rows / prev_tokens as
        `ModelRunner.forward` takes them). Dispatched without waiting."""
        if prev_rows is None:
            prev_rows = np.full(batch.token_ids.shape[0], -1, np.int32)
        if prev_tokens is None:
            prev_tokens = self._no_prev_tokens
        self.runner.kv_cache = self._fill(self.runner.params, self.runner.kv_cache, batch, prev_rows, prev_tokens)

    def copy_pages(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write of the target's pages: the same pairs in the draft's pool."""
        self.runner.copy_pages(copies)

    def propose(self, rows: Sequence[DraftRow], num_steps: int | None = None) -> Proposal:
        """k = num_steps (default num_speculative_tokens) draft tokens for each row; B = bucket(len(rows))."""
        k = self.num_speculative_tokens if num_steps is None else num_steps
        assert rows and k >= 1, (len(rows), k)
        page_size, pages_per_seq = self.cfg.page_size, self.cfg.pages_per_seq
        num_rows = bucket(len(rows))
        per_row = self.scratch_pages_per_row
        if num_rows > self.max_rows:
            raise ValueError(f"{len(rows)} rows to propose for; at most max_num_seqs ({self.cfg.max_num_seqs})")
        tokens = np.zeros(num_rows, np.int32)
        positions = np.zeros(num_rows, np.int32)
        limits = np.zeros(num_rows, np.int32)  # positions below this have a page; 0: padding row
        tables = np.zeros((num_rows, pages_per_seq), np.int32)
        arrays = fields.neutral_rows(num_rows)
        keys = np.zeros((num_rows, 2), np.uint32)
        vocab = self.model_cfg.vocab_size
        for i, r in enumerate(rows):
            n = len(r.page_table)
            assert 0 <= r.position < (n + 1) * page_size, (r.position, n)  # at most its next page is missing
            tables[i, :n] = r.page_table
            scratch = min(per_row, pages_per_seq - n)  # none past max_model_len
            first = self.first_scratch_page + i * per_row
            tables[i, n:n + scratch] = np.arange(first, first + scratch)
            tokens[i], positions[i], limits[i] = r.last_token, r.position, (n + scratch) * page_size
            p = r.params
            if p is not None and p.temperature > GREEDY_TEMPERATURE:
                fields.write_row(arrays, i, p, vocab)
                keys[i] = row_key(r.seed ^ _DRAFT_SEED_SALT, r.step)
        np.maximum(tables, 0, out=tables)  # RELEASED (-1) entries lie outside every window: any page will do
        temperature, top_k, top_p, min_p = (arrays[name] for name in ("temperature", "top_k", "top_p", "min_p"))
        sampled = bool(np.any(temperature > GREEDY_TEMPERATURE))
        self.runner.kv_cache, token_ids, probs = self._propose(
            self.runner.params, self.runner.kv_cache, tokens, positions, limits, tables,
            (temperature, top_k, top_p, min_p, keys), num_steps=k, sampled=sampled)
        return Proposal(token_ids, probs if sampled else None)

    # ------------------------------------------------------------------ jitted bodies
    def _fill_fn(self, params, kv_cache, batch: StepBatch, prev_rows, prev_tokens):
        token_ids = jnp.where(prev_rows >= 0, prev_tokens[jnp.maximum(prev_rows, 0)], batch.token_ids)
        batch = dataclasses.replace(batch, token_ids=token_ids)
        # Only the pool is returned: XLA drops the final norm and LM head of the logits rows.
        _, kv_cache = self.runner.model.apply(layer_stack.variables(params), batch, kv_cache)
        return kv_cache

    def _propose_fn(self, params, kv_cache, tokens, positions, limits, tables, sampling, *, num_steps: int,
                    sampled: bool):
        # tokens, positions, limits i32[B]; tables i32[B, P]; sampling: f32/i32[B] fields, keys u32[B, 2]
        temperature, top_k, top_p, min_p, keys = sampling
        num_rows = tokens.shape[0]
        page_size = self.cfg.page_size
        vocab = self.model_cfg.vocab_size
        rows = jnp.arange(num_rows)
        greedy = temperature <= GREEDY_TEMPERATURE
        typed_keys = jax.random.wrap_key_data(keys)
        empty_pages = jnp.zeros((0, tables.shape[1]), jnp.int32)
        empty = jnp.zeros(0, jnp.int32)

        def one_step(i, carry):
            kv_cache, token, drafts, probs = carry
            pos = positions + i
            has_page = pos < limits
            page = tables[rows, jnp.minimum(pos // page_size, tables.shape[1] - 1)]
            # A position past max_model_len (a proposal the engine will not use) writes nothing.
            slot = jnp.where(has_page, page * page_size + pos % page_size, -1)
            batch = StepBatch(token, pos, slot, tables, jnp.where(limits > 0, pos + 1, 0),
                              empty_pages, empty, empty, rows.astype(jnp.int32), empty, empty)
            logits, kv_cache = self.runner.model.apply(layer_stack.variables(params), batch, kv_cache)
            logits = logits[:num_rows].astype(jnp.float32)  # [B, V]
            best = argmax_rows(logits)
            if sampled:
                scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
                filtered = filter_logits(scaled, _Filters(top_k, top_p, min_p))
                q = jax.nn.softmax(filtered, axis=-1)  # [B, V]
                step_keys = jax.vmap(jax.random.fold_in, (0, None))(typed_keys, i)
                drawn = jax.vmap(jax.random.categorical)(step_keys, filtered).astype(jnp.int32)
                token = jnp.where(greedy, best, drawn)
                q = jnp.where(greedy[:, None], jax.nn.one_hot(best, vocab, dtype=jnp.float32), q)
                probs = probs.at[:, i].set(q)
            else:
                token = best
            return kv_cache, token, drafts.at[:, i].set(token), probs

        drafts = jnp.zeros((num_rows, num_steps), jnp.int32)
        probs = jnp.zeros((num_rows, num_steps, vocab) if sampled else (0,), jnp.float32)
        kv_cache, _, drafts, probs = jax.lax.fori_loop(0, num_steps, one_step, (kv_cache, tokens, drafts, probs))
        return kv_cache, drafts, probs
