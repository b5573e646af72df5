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
import os
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
    step_bytes: int  # working memory of the largest step (step_bytes_bound)
    utilization: float  # of the whole device, as vLLM's gpu_memory_utilization
    device_bytes: int | None = None  # the whole device's memory; None: bytes_limit is all of it

    @property
    def budget(self) -> int:
        return self.usable - self.bytes_in_use - self.step_bytes

    @property
    def whole(self) -> int:
        return self.bytes_limit if self.device_bytes is None else self.device_bytes

    @property
    def usable(self) -> int:
        """utilization x the whole device, but never past what jax's allocator may hand out."""
        return min(self.bytes_limit, int(self.whole * self.utilization))


def num_pages_from_memory(budget: MemoryBudget, page_bytes: int) -> int:
    """Pages that fit in what `budget` leaves; raises ValueError naming the figures when not one does."""
    assert page_bytes > 0, page_bytes
    pages = budget.budget // page_bytes
    if pages < 1:
        raise ValueError(
            f"no device memory left for the KV cache: gpu_memory_utilization {budget.utilization:g} of "
            f"{budget.whole / GIB:.2f} GiB is {budget.usable / GIB:.2f} GiB; "
            f"{budget.bytes_in_use / GIB:.2f} GiB are in use (weights and other buffers) and a step needs "
            f"{budget.step_bytes / GIB:.2f} GiB, leaving less than one page ({page_bytes} bytes). Raise "
            f"gpu_memory_utilization, or give num_pages or kv_cache_bytes")
    return pages


# jax's share of a GPU's memory when XLA_PYTHON_CLIENT_MEM_FRACTION is not set.
JAX_GPU_CLIENT_FRACTION = 0.75
CLIENT_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def device_bytes(bytes_limit: int, platform: str, environ: Mapping[str, str] = os.environ) -> int:
    """The whole device's memory, from the limit jax's allocator reports: on a GPU that limit is
    XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.75) of the device, unless the platform allocator
    is used (no limit of its own); a TPU's limit is its whole HBM."""
    if platform != "gpu" or environ.get("XLA_PYTHON_CLIENT_ALLOCATOR") == "platform":
        return bytes_limit
    try:
        fraction = float(environ.get(CLIENT_FRACTION_ENV, JAX_GPU_CLIENT_FRACTION))
    except ValueError:
        return bytes_limit
    return int(bytes_limit / fraction) if 0.0 < fraction <= 1.0 else bytes_limit


def claim_client_memory(utilization: float, environ=os.environ) -> bool:
    """Lets jax's GPU allocator hand out `utilization` of the device (its default is 0.75), as
    `paxpage generate / serve` do before jax starts. Left alone when the user set it. True if set."""
    if CLIENT_FRACTION_ENV in environ:
        return False
    environ[CLIENT_FRACTION_ENV] = f"{utilization:g}"
    return True


def step_bytes_bound(model: Any, num_tokens: int, num_logits: int, moe_tile_rows: int = 64) -> int:
    """An upper bound, from the model's dimensions alone, on what one step of `num_tokens` tokens
    and `num_logits` sampling rows allocates besides its donated pool: the live values of its
    widest layer for every token, counted as f32 however the step keeps them, plus the logits.
    The pool is sized with it instead of compiling the largest step first (a minute of XLA:GPU
    time for an 8B model). Layers run one after another, so one layer's values bound them all:
    - attention: the residual, the norm and a few H-wide values (6 H), q / k / v twice (rotated
      and not), the attention output and the kernel's per-split partial sums (N (D + 2));
    - MLP: gate, up and their product (3 F); mixture of experts: the routed rows' 3 F' and H
      each, k per token plus a partly filled tile per expert (models/moe.py), and the router's
      E logits;
    - logits: f32 [R, V], and one copy of them;
    - one layer's weights in f32: the slice a scanned step takes of its stacked weights, or the
      copy a backend makes to convert or lay them out for a product.
    Axis legend: T tokens, R sampling rows, H hidden, N / K heads, D head dim, F MLP width, V vocab."""
    m = model
    if getattr(m, "is_mla", False):
        attention = _latent_attention_values(m)
    else:
        qkv = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
        attention = 6 * m.hidden_size + 2 * qkv + 2 * m.num_heads * (m.head_dim + 2)
    mlp = 3 * m.intermediate_size
    routed_rows = 0
    if getattr(m, "num_experts", 0):
        routed_rows = num_tokens * m.num_experts_per_tok + m.num_experts * moe_tile_rows
        shared = 3 * getattr(m, "num_shared_experts", 0) * m.moe_intermediate_size
        mlp = max(mlp if m.dense_mlp_layers else 0, m.num_experts + shared)
    per_token = attention + mlp
    routed = routed_rows * (3 * m.moe_intermediate_size + m.hidden_size) if routed_rows else 0
    logits = 2 * num_logits * m.vocab_size
    return 4 * (num_tokens * per_token + routed + logits + layer_params(m))


def layer_params(model: Any) -> int:
    """Parameters of the model's largest decoder layer (its norms aside)."""
    m = model
    if getattr(m, "is_mla", False):
        attention = _latent_attention_params(m)
    else:
        attention = (m.hidden_size * (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
                     + m.num_heads * m.head_dim * m.hidden_size)
    mlp = 3 * m.hidden_size * m.intermediate_size
    if getattr(m, "num_experts", 0):
        experts = ((m.num_experts + getattr(m, "num_shared_experts", 0)) * 3 * m.hidden_size * m.moe_intermediate_size
                   + m.hidden_size * m.num_experts)
        mlp = max(mlp if m.dense_mlp_layers else 0, experts)
    return attention + mlp


def _latent_attention_values(m: Any) -> int:
    """Live values per token of a latent-attention layer (models/deepseek.py): the residual and
    norms (6 H), the query before and after RoPE (N (Dn + Dr)) and its low-rank stage, the latent C
    a few times, then the larger of its two forms' values:
    - absorbed: the absorbed query (N C) twice, the latent-space output and its partial sums
      (N (Cr + 2)) twice, and the per-head values (N Dv);
    - expanded (prefill rows, pallas_kernels/latent_attention.py): the scaled query (N (Dn + Dr)),
      one loop step's expanded keys and values (at most N (Dn + Dv) per query token: the loop
      expands at most max(Tq, page_size) keys of a row at a time), the output and its partial
      sums (N (Dv + 2)) twice, and the per-head values (N Dv)."""
    n, c = m.num_heads, m.kv_lora_rank + m.qk_rope_head_dim
    dn, dr, dv = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    absorbed = 2 * n * c + 2 * n * (m.kv_lora_rank + 2) + n * dv
    expanded = n * (dn + dr) + n * (dn + dv) + 2 * n * (dv + 2) + n * dv
    return (6 * m.hidden_size + 2 * n * (dn + dr) + 2 * (m.q_lora_rank or 0) + 3 * c
            + max(absorbed, expanded))


def _latent_attention_params(m: Any) -> int:
    """Parameters of a latent-attention block; kv_b_proj counted twice (its W_UK / W_UV halves are
    sliced out of it in the step)."""
    n, q_width = m.num_heads, m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
    q = m.hidden_size * q_width if m.q_lora_rank is None else m.q_lora_rank * (m.hidden_size + q_width)
    kv_a = m.hidden_size * (m.kv_lora_rank + m.qk_rope_head_dim)
    kv_b = m.kv_lora_rank * n * (m.qk_nope_head_dim + m.v_head_dim)
    return q + kv_a + 2 * kv_b + n * m.v_head_dim * m.hidden_size


def device_memory_stats(device: Any = None) -> Mapping[str, int] | None:
    """jax's memory statistics of `device` (default: the first), or None where the backend keeps none."""
    device = device if device is not None else jax.devices()[0]
    try:
        return device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        return None


NO_STATS_SOURCE = "fixed default: no device memory statistics"  # kv_source when the device reports none


def pages_from_device(page_bytes: int, step_bytes: int, utilization: float,
                      platform: str) -> tuple[int, MemoryBudget | None]:
    """(num_pages, the budget they came from) from the first device's memory statistics, taken
    once the weights are placed. A backend without statistics gets DEFAULT_KV_CACHE_BYTES and no
    budget (kv_source NO_STATS_SOURCE)."""
    stats = device_memory_stats()
    if not stats or not stats.get("bytes_limit"):
        log.warning("paxpage: the device reports no memory statistics; the KV cache gets %d bytes",
                    DEFAULT_KV_CACHE_BYTES)
        return max(1, DEFAULT_KV_CACHE_BYTES // page_bytes), None
    limit = int(stats["bytes_limit"])
    budget = MemoryBudget(limit, int(stats["bytes_in_use"]), step_bytes, utilization, device_bytes(limit, platform))
    return num_pages_from_memory(budget, page_bytes), budget


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
