"""Embeddings from a decoder model: a prompt's last-layer hidden states (after the final norm),
pooled over its tokens. Pure Python and numpy (no jax).

An embedding request runs through the engine's scheduler like a prompt whose prefill is all
its work: its chunks share steps with generating sequences, its pages are freed when its last
chunk has run, and it never samples. The step adds the normed hidden states of the tokens that
pool into one f32 row per request (the model's `pool_rows`, models/layers.py); the host sums
those rows over the request's chunks and finishes the pooling here.

Pooling: "last" takes the last token's state (what decoder embedding models such as
e5-mistral or gte-Qwen are trained for, and vLLM's default for them), "mean" the average over
every token. Both are L2-normalised by default.
"""

from __future__ import annotations

import dataclasses

import numpy as np

POOLING_KINDS = ("last", "mean")
# the names of `--pooling` and of paxpage.embed's `pooling`
POOLING_CHOICES = ("last", "mean", "last-unnormalized", "mean-unnormalized")


@dataclasses.dataclass(frozen=True)
class Pooling:
    kind: str = "last"  # "last" | "mean"
    normalize: bool = True  # L2-normalise the pooled vector

    def __post_init__(self):
        if self.kind not in POOLING_KINDS:
            raise ValueError(f"pooling is {self.kind!r}; must be one of {list(POOLING_KINDS)}")
        if not isinstance(self.normalize, bool):
            raise TypeError(f"normalize must be a bool, got {type(self.normalize).__name__}")

    @classmethod
    def parse(cls, name: "str | Pooling") -> "Pooling":
        """A name of POOLING_CHOICES ("last", "mean-unnormalized", ...) as a Pooling."""
        if isinstance(name, Pooling):
            return name
        if not isinstance(name, str) or name not in POOLING_CHOICES:
            raise ValueError(f"pooling is {name!r}; must be one of {list(POOLING_CHOICES)}")
        kind, _, rest = name.partition("-")
        return cls(kind, normalize=not rest)

    @property
    def name(self) -> str:
        return self.kind if self.normalize else f"{self.kind}-unnormalized"

    def first_pooled(self, num_tokens: int) -> int:
        """The first position whose hidden state enters the pool of a num_tokens-token input."""
        return 0 if self.kind == "mean" else num_tokens - 1


@dataclasses.dataclass(frozen=True)
class EmbeddingOutput:
    """One input's embedding."""

    index: int  # the input's position in the caller's list
    embedding: list[float] | None  # None when aborted
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" | "abort"


@dataclasses.dataclass(eq=False)
class EmbeddingRequest:
    """Host state of one embedding request in the engine (engine.py owns it)."""

    request_id: int
    index: int
    prompt_ids: list[int]
    pooling: Pooling
    seq: object  # its paxpage.sequence.Sequence
    total: np.ndarray | None = None  # f64[H]: the pooled hidden states summed so far
    embedding: list[float] | None = None
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def pools(self, start: int, end: int) -> bool:
        """Whether a chunk computing positions [start, end) adds to the pool."""
        return end > self.pooling.first_pooled(len(self.prompt_ids))

    def add(self, start: int, pooled_row: np.ndarray) -> None:
        """A chunk's pooled row (f32[H], the sum of its pooling tokens' states). A chunk from
        position 0 starts afresh: a preempted request is computed again from its first token."""
        row = np.asarray(pooled_row, np.float64)
        self.total = row if start == 0 or self.total is None else self.total + row

    def finish(self) -> None:
        """The pooled vector from the summed rows, normalised if asked."""
        vec = self.total / (len(self.prompt_ids) if self.pooling.kind == "mean" else 1)
        if self.pooling.normalize:
            norm = float(np.linalg.norm(vec))
            vec = vec / max(norm, 1e-12)  # as torch.nn.functional.normalize
        self.embedding = vec.astype(np.float32).tolist()
        self.finish_reason = "stop"

    def output(self) -> EmbeddingOutput:
        return EmbeddingOutput(self.index, self.embedding, list(self.prompt_ids), self.finish_reason or "abort")
