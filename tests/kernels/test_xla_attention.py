"""The engine's CPU fast path (XLA while loop over page chunks) against the jnp reference."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import CONFIGS, assert_close, config_id, make_case
from pallas_kernels.reference import paged_attention_ref
from pallas_kernels.xla_attention import paged_attention_xla


def _finite_garbage(pool: np.ndarray) -> np.ndarray:
    """Unused slots hold stale finite K/V in the engine (the pool starts zeroed); large values
    there make any slot that escapes the mask visible in the output."""
    pool = np.asarray(jnp.asarray(pool, jnp.float32)).copy()
    pool[np.isnan(pool)] = 1e4
    return pool


@pytest.mark.parametrize("cfg", CONFIGS, ids=config_id)
@pytest.mark.parametrize("chunk_tokens", [8, 64])
@pytest.mark.parametrize(
    "kv_lens,q_lens",
    [([1, 17, 64, 0, 33], [1, 1, 1, 0, 1]), ([40, 7, 96, 0], [9, 7, 5, 0])],
    ids=["decode", "prefill"],
)
def test_xla_matches_reference(cfg, chunk_tokens, kv_lens, q_lens):
    dtype, page_size, ratio, head_dim, num_kv_heads = cfg
    rng = np.random.default_rng(3)
    case = make_case(rng, dtype=dtype, page_size=page_size, ratio=ratio, head_dim=head_dim,
                     num_kv_heads=num_kv_heads, kv_lens=kv_lens, q_lens=q_lens,
                     pages_per_seq=-(-96 // page_size) + 1)
    pool = jnp.asarray(_finite_garbage(case.kv_pages), dtype)
    got = paged_attention_xla(jnp.asarray(case.q), pool, case.page_indices, case.kv_lens,
                              case.q_lens, sm_scale=head_dim ** -0.5, chunk_tokens=chunk_tokens)
    clean = np.nan_to_num(np.asarray(jnp.asarray(case.kv_pages, jnp.float32)))
    want = paged_attention_ref(jnp.asarray(case.q), jnp.asarray(clean, dtype), case.page_indices,
                               case.kv_lens, case.q_lens, sm_scale=head_dim ** -0.5)
    assert_close(got, want, dtype)
