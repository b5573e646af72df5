"""A dispatched step, as the engine keeps it until its tokens are read (engine.py)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from paxpage.decode_batch import DecodeBatch
from paxpage.output_processor import Request


PENDING_TOKEN = -1  # an in-flight step's token that the host does not have yet


@dataclasses.dataclass
class Launched:
    """A dispatched step: what it scheduled and its device results."""

    sched: object  # SchedulerOutput
    rows: list[tuple[Request, object, int]]  # (request, sample, first logits row) per sampling seq
    counts: list[int]  # logits rows of each entry of `rows` (n > 1 when a request forks)
    prompt_plan: list[tuple[int, int]]
    result: object  # SamplerOutput, device arrays
    prompt_result: object
    next_tokens: object  # i32[R_max] device: the sampled tokens, as the next step reads them
    row_of_seq: dict[int, int] = dataclasses.field(default_factory=dict)  # in flight: seq -> row
    # Until the sampler is dispatched (result None): its arguments, and the structured rows as
    # (matcher, first row, rows) whose bitmasks it waits for.
    sampler_args: tuple | None = None
    constrained: list = dataclasses.field(default_factory=list)
    # speculative decoding: the drafts of each entry of `rows` (() for none; its logits rows are
    # then row .. row + len(drafts)), and accepted bool[R] (device) from speculative/verify.py
    drafts: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    accepted: object = None
    # the sampling slot and output-token count of each logits row (paxpage/sampling/batch.py)
    sampling_rows: tuple[list[int], list[int]] = ((), ())
    # while in flight: the rows as a steady decode batch, when they are plain (decode_batch.py)
    decode: DecodeBatch | None = None
    # embedding chunks: (EmbeddingRequest, chunk start, last chunk, pooled row), and the step's
    # pooled hidden states f32[R, H] (device) that those rows index
    pooling: list = dataclasses.field(default_factory=list)
    pooled: object = None

    @property
    def speculates(self) -> bool:
        return any(self.drafts)


def fetch(results):
    """A step's device results (a pytree; None leaves stay None) as numpy arrays, waiting for them.

    Arrays in host memory (the CPU backend): np.asarray each, not jax.device_get, which first
    starts an asynchronous copy of each array at ~0.1 ms of the host's time per array while the
    next step runs (measured with jax 0.10.2), for arrays that are host memory already.
    Arrays on an accelerator: every device-to-host copy is started before the first is waited
    for (jax.device_get), so a step's results come back in one round trip, not one per array."""
    leaves = jax.tree.leaves(results)
    if not leaves or _in_host_memory(leaves[0]):  # a step's results all live on its devices
        return jax.tree.map(np.asarray, results)
    return jax.device_get(results)


def _in_host_memory(x) -> bool:
    devices = getattr(x, "devices", None)
    return devices is None or all(d.platform == "cpu" for d in devices())
