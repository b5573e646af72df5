"""A runner's step and sampler compiled ahead (ahead_compile.py applied to paxpage/runner.py).

The runner's step and sampler calls go through `AheadCall`s keyed by the shapes that pick their
executables; the worker's job for a step shape lowers both against abstract arguments: the
step on an all-padding batch of that shape and an abstract pool, the sampler at its row count
in each form the engine has called it in (`note_sampler`).

Axis legend: Bd decode rows, Bp prefill rows, R logits rows, V vocabulary, S / E the penalty and
banned lists' widths.
"""

from __future__ import annotations

import jax
import numpy as np

from paxpage.ahead_compile import AheadCall, AheadCompiler
from paxpage.batch import StepBatch
from paxpage.packing import bucket, decode_rows


def step_key(params, kv_cache, batch: StepBatch, prev_rows, prev_tokens) -> tuple:
    """What picks a step executable of one runner: the batch's row counts (its params, pool,
    dtypes and LoRA rows never change)."""
    return (batch.token_ids.shape[0], batch.dec_kv_lens.shape[0], batch.pre_kv_lens.shape[0],
            batch.logits_indices.shape[0], batch.prompt_targets.shape[0], batch.pool_rows is None)


def sample_key(logits, sampling, pending, num_logprobs: int, num_rows: int) -> tuple:
    """What picks a sampler executable of one runner: R, the static variants, and the penalty and
    banned lists' widths (every SamplingTensors leaf is [R], [R, 2], [R, S] or [R, E])."""
    return (logits.shape[0], sampling.greedy_only, sampling.penalised, num_logprobs, num_rows, pending is None,
            sampling.token_ids.shape[1], sampling.banned_ids.shape[1])


class RunnerAhead:
    """The runner's calls wrapped for executables compiled ahead, and what compiles them.
    `compiler` (ahead_compile.AheadCompiler) is the runner's `ahead`.

    Reads from the runner: its jitted `_step` / `_sampler`, `_step_args`, `packer`, `pool_spec`,
    `cfg`, `single_row_decode`, `max_logits_rows` and `_no_prev_tokens`; wraps its `_calls`
    "step" and "sample" entries in place."""

    def __init__(self, runner):
        self.runner = runner
        self.step = runner._calls["step"] = AheadCall(runner._calls["step"], step_key)
        self.sample = runner._calls["sample"] = AheadCall(runner._calls["sample"], sample_key, static_argnums=(3, 4))
        self._forms: dict[tuple, tuple] = {}  # see note_sampler
        self.compiler = AheadCompiler(self._jobs, self._smaller_decode_shapes)

    def before_step(self, batch: StepBatch) -> tuple[int, int, int] | None:
        """Before a step dispatches: its shape if the worker knows such shapes (prefill rows of
        the usual width, no prompt logprobs), having waited if the worker is compiling it."""
        if batch.prompt_targets.shape[0]:
            return None
        dec, pre = batch.num_decode_rows, batch.num_prefill_rows
        if batch.num_tokens != dec + pre * self.runner.cfg.prefill_row_len:
            return None
        shape = (dec, pre, batch.logits_indices.shape[0])
        self.compiler.before(*shape)
        return shape

    def note_sampler(self, logits, sampling, pending, num_logprobs: int) -> None:
        """Keeps what a sampler call looked like apart from its row count R (every sampling
        tensor's leading axis), so the worker compiles the sampler for new shapes in the forms
        the engine uses. A few attribute reads per step once a form is known."""
        num_rows = self.runner.max_logits_rows
        key = sample_key(logits, sampling, pending, num_logprobs, num_rows)[1:]
        if key not in self._forms:
            leaves, treedef = jax.tree.flatten(sampling)
            self._forms[key] = ((logits.shape[1], logits.dtype), treedef,
                                [(np.shape(x)[1:], x.dtype) for x in leaves], pending is not None,
                                (num_logprobs, num_rows))

    def _smaller_decode_shapes(self, dec: int) -> list[tuple[int, int, int]]:
        """The decode-only step shapes (Bd, 0, R) below `dec` decode rows, largest first: what a
        batch of dec rows meets as its sequences finish."""
        rows = {decode_rows(n, 0, self.runner.single_row_decode) for n in range(1, dec)}
        return [(d, 0, bucket(d)) for d in sorted(rows, reverse=True) if d < dec]

    def _jobs(self, dec: int, pre: int, num_logits: int) -> list:
        """The compiles that make the step shape (dec, pre, num_logits) ready: the step, and the
        sampler at num_logits rows in every form it has been called in. Run on the worker thread:
        they lower against abstract arguments and touch nothing but the executables they add."""
        runner = self.runner
        batch = runner.packer.padding_batch(dec, pre)
        assert batch.logits_indices.shape[0] == num_logits, (dec, pre, num_logits)
        step_args = runner._step_args(batch, runner.pool_spec.abstract(runner.cfg.num_pages))

        def step():
            self.step.add(step_args, runner._step.lower(*step_args).compile())

        def sampler(form):
            (vocab, dtype), treedef, tails, pending, statics = form
            logits = jax.ShapeDtypeStruct((num_logits, vocab), dtype)
            sampling = treedef.unflatten([jax.ShapeDtypeStruct((num_logits, *tail), dt) for tail, dt in tails])
            pending = (jax.ShapeDtypeStruct((num_logits,), np.int32), runner._no_prev_tokens) if pending else None
            args = (logits, sampling, pending, *statics)
            self.sample.add(args, runner._sampler.lower(*args).compile())

        def samplers():  # the forms known once the step has compiled (the first step's sampler runs after it)
            for form in list(self._forms.values()):
                sampler(form)

        return [step, samplers]
