"""How many KV pages an engine gets when the user gives neither num_pages nor kv_cache_bytes.

On CPU the pool is a fixed DEFAULT_KV_CACHE_BYTES (host memory is shared with everything else,
and jax reports no limit for it). On an accelerator it is what is left of the device memory, as
vLLM's gpu_memory_utilization does it: of `gpu_memory_utilization` x the device's memory, take
away what is in use once the weights are placed (weights, other engines' pools, anything else
the process holds) and the working memory of the largest compiled step; the rest is pages.
`num_pages_from_memory` is that arithmetic alone, so it can be checked with made-up numbers.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping

import jax

log = logging.getLogger("paxpage")

GIB = 1 << 30
DEFAULT_KV_CACHE_BYTES = GIB  # the pool on CPU when neither num_pages nor kv_cache_bytes is given


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """The figures a pool size was derived from, for the start-up line."""

    bytes_limit: int  # the device's memory that jax may use
    bytes_in_use: int  # after the weights were placed
    step_bytes: int  # working memory of the largest compiled step
    utilization: float

    @property
    def budget(self) -> int:
        return int(self.bytes_limit * self.utilization) - self.bytes_in_use - self.step_bytes


def num_pages_from_memory(budget: MemoryBudget, page_bytes: int) -> int:
    """Pages that fit in what `budget` leaves; raises ValueError naming the figures when not one does."""
    assert page_bytes > 0, page_bytes
    pages = budget.budget // page_bytes
    if pages < 1:
        raise ValueError(
            f"no device memory left for the KV cache: gpu_memory_utilization {budget.utilization:g} of "
            f"{budget.bytes_limit / GIB:.2f} GiB is {budget.bytes_limit * budget.utilization / GIB:.2f} GiB; "
            f"{budget.bytes_in_use / GIB:.2f} GiB are in use (weights and other buffers) and a step needs "
            f"{budget.step_bytes / GIB:.2f} GiB, leaving less than one page ({page_bytes} bytes). Raise "
            f"gpu_memory_utilization, or give num_pages or kv_cache_bytes")
    return pages


def device_memory_stats(device: Any = None) -> Mapping[str, int] | None:
    """jax's memory statistics of `device` (default: the first), or None where the backend keeps none."""
    device = device if device is not None else jax.devices()[0]
    try:
        return device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        return None


MB = 1e6


def describe_weights(bytes_by_dtype: Mapping[str, int]) -> str:
    """"weights 170.4 MB (int8 134.9 MB, float32 35.5 MB)": the bytes a params tree holds, by dtype."""
    parts = ", ".join(f"{name} {num / MB:.1f} MB" for name, num in sorted(bytes_by_dtype.items(), key=lambda kv: -kv[1]))
    return f"weights {sum(bytes_by_dtype.values()) / MB:.1f} MB ({parts})"


def describe_kv_per_sequence(page_bytes: int, page_size: int, max_model_len: int) -> str:
    """KV bytes one token holds (K and V, all layers) and one sequence of max_model_len tokens."""
    per_token = page_bytes // page_size
    return (f"KV {per_token} bytes per token, {per_token * max_model_len / MB:.1f} MB per sequence of "
            f"{max_model_len} tokens")


def describe_pool(num_pages: int, page_size: int, page_bytes: int, source: str) -> str:
    """The start-up line: pages, tokens, GiB and where the size came from."""
    return (f"KV cache: {num_pages} pages x {page_size} tokens = {num_pages * page_size} tokens, "
            f"{num_pages * page_bytes / GIB:.2f} GiB ({source})")
