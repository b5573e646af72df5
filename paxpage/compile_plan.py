"""The compile plan: every step shape a config can run, and compiling them all before serving.

A step's shape is its (decode rows, prefill rows) pair, each padded to a bucket (packing.bucket,
packing.decode_rows); the logits rows R follow from the two, and the sampler's shape is R alone.
So the set of pairs a scheduler can produce is finite and small, and a run that compiled them
all up front (`CompilePlan.warm_up`) never compiles again. The same set tells the pool's sizing
which step is largest (`largest_step_tokens`).

The plan drives a runner through its public calls: `packer.padding_batch`, `forward`, `sample`,
and with the executable cache `prepare_step` / `prepare_sample` (paxpage/runner.py).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

from paxpage.packing import bucket, decode_rows, mask_row_counts
from paxpage.sampling import sampler as sampler_lib
from paxpage.structured_backend import RowMasks


def step_shapes(max_num_seqs: int, max_num_batched_tokens: int, prefill_row_len: int,
                max_prefill_rows: int, single_row_decode: bool = False) -> list[tuple[int, int]]:
    """Every (decode rows, prefill rows) bucket pair a step of this config can have, sorted."""
    seqs, tokens = max_num_seqs, max_num_batched_tokens
    # each prefill row holds >= 1 token; a sequence's chunk adds at most one partial row; the
    # scheduler never schedules more than max_prefill_rows
    max_pre = min(tokens, seqs + tokens // prefill_row_len, max_prefill_rows)
    shapes = set()
    for dec in range(seqs + 1):
        for pre in range(max_pre + 1):
            if (dec or pre) and dec + pre <= tokens and dec + (1 if pre else 0) <= seqs:
                shapes.add((decode_rows(dec, pre, single_row_decode), bucket(pre)))
    return sorted(shapes)


@dataclasses.dataclass(frozen=True)
class CompilePlan:
    """The step shapes of one config (`step_shapes`) and what follows from them."""

    shapes: tuple[tuple[int, int], ...]  # (decode rows, prefill rows) bucket pairs, sorted
    prefill_row_len: int  # tokens per prefill row
    max_num_seqs: int

    @classmethod
    def for_config(cls, cfg, single_row_decode: bool) -> "CompilePlan":
        """The plan of a ResolvedConfig; single_row_decode: the compile target's (packing.decode_rows)."""
        shapes = step_shapes(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.prefill_row_len,
                             cfg.prefill_rows, single_row_decode)
        return cls(tuple(shapes), cfg.prefill_row_len, cfg.max_num_seqs)

    @property
    def max_logits_rows(self) -> int:
        """The most sampling rows a step that can stay in flight has (one per sequence row)."""
        return max(bucket(dec + pre) for dec, pre in self.shapes)

    @property
    def largest_step(self) -> tuple[int, int]:
        """The shape with the most token slots (ties: the most rows)."""
        row_len = self.prefill_row_len
        return max(self.shapes, key=lambda s: (s[0] + s[1] * row_len, s[0] + s[1]))

    def largest_step_tokens(self) -> tuple[int, int]:
        """(tokens, sampling rows) the largest step may hold: what its working memory is bounded by."""
        dec, pre = self.largest_step
        return dec + pre * self.prefill_row_len, bucket(max(dec + pre, self.max_num_seqs))  # n > 1 samples add rows

    def warm_up(self, runner, sampling_for_rows, num_mask_words: int = 0) -> None:
        """Compiles every shape by running it on an all-padding batch (whose K/V writes are
        dropped), and for each logits-row count R the sampler's variants
        (sampler.sampler_variants) and, with num_mask_words, the structured-outputs masking at
        every mask-row count (packing.mask_row_counts)."""
        sampled: set[int] = set()
        for dec, pre in self.shapes:
            batch = runner.packer.padding_batch(dec, pre)
            num_logits = batch.logits_indices.shape[0]
            logits = runner.forward(batch)
            results = [logits]
            if num_logits not in sampled:
                sampled.add(num_logits)
                variants = sampler_lib.sampler_variants(sampling_for_rows, num_logits)
                results = [runner.sample(batch, logits, sampling)[2] for sampling in variants]
                if num_mask_words:  # last: masking writes the logits in place (each call consumes them)
                    for num_masks in mask_row_counts(num_logits):
                        logits = runner.mask(logits, RowMasks.padding(num_logits, num_masks, num_mask_words))
                    results.append(logits)
            jax.block_until_ready(results)

    def load_executables(self, runner, sampling_for_rows, num_mask_words: int = 0) -> bool:
        """`warm_up` with the executable cache: each executable loaded (or compiled and stored)
        without running it; a warm start then costs the loads alone (running every shape once
        on a padding batch took as long again on CPU). Compiles run on a few threads (XLA's
        compile releases the GIL; tracing does not). False if some executable took the plain
        jit path (it must run to be compiled): warm_up then runs them all."""
        from concurrent.futures import ThreadPoolExecutor

        batches = [runner.packer.padding_batch(dec, pre) for dec, pre in self.shapes]
        first = {}  # R -> the first shape with R logits rows
        for i, batch in enumerate(batches):
            first.setdefault(batch.logits_indices.shape[0], i)
        workers = max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1, 8))
        with ThreadPoolExecutor(workers) as pool:
            steps = list(pool.map(runner.prepare_step, batches))
            if any(step is None for step in steps):
                return False
            samplers, masked = [], []
            for num_logits, i in sorted(first.items()):
                info = steps[i].out_info[1]
                logits = jnp.zeros(info.shape, info.dtype)
                samplers += [(batches[i], logits, sampling)
                             for sampling in sampler_lib.sampler_variants(sampling_for_rows, num_logits)]
                if num_mask_words:
                    masked += [(logits, RowMasks.padding(num_logits, num_masks, num_mask_words))
                               for num_masks in mask_row_counts(num_logits)]
            # The full sampler (draws, penalties; 1 MB and ~0.5 s to load per R on CPU, ~12 s to
            # compile) is only made sure of on disk: a first sampled batch loads it, no compile.
            done = list(pool.map(lambda args: runner.prepare_sample(*args, load=args[2].greedy_only), samplers))
            done += list(pool.map(lambda args: runner.prepare_mask(*args), masked))
        return all(done)
