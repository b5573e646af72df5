"""What an engine counts while it steps (`LLMEngine.stats`): tokens, host and device seconds,
KV utilisation samples and speculative-decoding acceptance. Plain numbers, read by the benchmark
scripts and the server's metrics."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    overlapped_steps: int = 0  # steps left in flight while the next one was scheduled
    decode_batch_steps: int = 0  # of those, steps of the persistent batch, booked from arrays (decode_batch.py)
    joined_rows: int = 0  # rows that joined the persistent batch in its steps (prompts that ended, their forks)
    host_seconds: float = 0.0  # scheduling + packing + stop checks
    device_seconds: float = 0.0  # jitted step incl. the token transfer
    # KV utilisation sampled every booking.KV_SAMPLE_EVERY steps (shared pages are counted page by page)
    kv_utilisation_sum: float = 0.0
    kv_utilisation_samples: int = 0
    # speculative decoding: steps with drafts, sequence rows that carried drafts, drafts
    # proposed and accepted, and tokens those rows emitted (accepted + one each)
    spec_steps: int = 0
    spec_rows: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / max(1, self.draft_tokens)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a speculating row emits per step: accepted drafts + the target's token."""
        return (self.accepted_tokens + self.spec_rows) / max(1, self.spec_rows)

    @property
    def mean_kv_utilisation(self) -> float:
        return self.kv_utilisation_sum / max(1, self.kv_utilisation_samples)
