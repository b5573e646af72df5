"""The one pytree that describes a device step.

Flat tokens T = Bd + Bp * Tq: Bd decode rows of one token, then Bp prefill rows of Tq
tokens each. A prefill row is a contiguous run of one sequence's new tokens; a long
prompt chunk spans several rows, each attending to the cache up to its own last token
(every token's K/V is written before attention, and the causal mask is by position), so
rows are independent. Fixed-width rows keep padding per sequence under Tq tokens while
the step's shape depends only on (Bd, Bp): few buckets, few compiles.

Axis legend: T flat tokens, Bd decode rows, Bp prefill rows, Tq prefill row width,
R logits rows, pages_per_seq = ceil(max_model_len / page_size).
"""

from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    token_ids: jax.Array  # i32[T]
    positions: jax.Array  # i32[T] position of each token in its sequence
    slot_mapping: jax.Array  # i32[T] page * page_size + offset; -1 for padding
    dec_page_indices: jax.Array  # i32[Bd, pages_per_seq]
    dec_kv_lens: jax.Array  # i32[Bd] tokens in cache incl. this one; 0 = padding row
    pre_page_indices: jax.Array  # i32[Bp, pages_per_seq]
    pre_kv_lens: jax.Array  # i32[Bp] tokens in cache up to the row's last token; 0 = padding
    pre_q_lens: jax.Array  # i32[Bp] real tokens in the row (<= Tq)
    logits_indices: jax.Array  # i32[R] flat token index of each sampling row (may repeat)
    # Prompt logprobs (only requests that ask): row i scores token prompt_targets[i] given the
    # prefix ending at flat token prompt_logits_indices[i]. Rp = 0 in the common case.
    prompt_logits_indices: jax.Array  # i32[Rp]
    prompt_targets: jax.Array  # i32[Rp]
    # Embedding requests (paxpage/embedding.py): the pooled-output row each token's normed hidden
    # state adds into, R for none; the model then also returns f32[R, H] sums. None in a step
    # that pools nothing (its own compiled variant, like Rp = 0).
    pool_rows: jax.Array | None = None  # i32[T]
    # LoRA (max_loras > 0): each row's adapter slot, decode rows then prefill rows; -1 = the
    # base model. None without LoRA, so such an engine's step is the same as before.
    lora_slots: jax.Array | None = None  # i32[Bd + Bp]
    # Inside a scanned layer stack (models/layer_stack.py): the group of layers the scan runs, by
    # which a native matmul reads its stacked panels (models/layers.MatmulStep). None outside.
    scan_group: jax.Array | None = None  # i32[]

    @property
    def num_decode_rows(self) -> int:
        return self.dec_kv_lens.shape[0]

    @property
    def num_prefill_rows(self) -> int:
        return self.pre_kv_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    def live_tokens(self) -> jax.Array:
        """bool[T]: the step's real tokens. Every real token writes its K/V; padding's slot is -1.
        A native matmul computes only these rows (models/layers.Linear's `live`)."""
        return self.slot_mapping >= 0
