"""The native CPU penalties (pallas_kernels/native_penalties.py) against a float64 numpy
reference written from the definitions (HF's repetition penalty, OpenAI's frequency and presence
penalties, banned ids), against the sampler's XLA version, and through the sampler."""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import native_penalties
from pallas_kernels.native_penalties import apply_penalties_native, apply_penalties_ref
from paxpage.sampling import sampler as sampler_lib
from paxpage.sampling.tensors import RowInfo, SamplingTensors
from paxpage.sampling.params import SamplingParams

pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the native kernel"),
    pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU kernel; the default backend is not CPU"),
]

NATIVE = jax.jit(apply_penalties_native)
REF = jax.jit(apply_penalties_ref)
TOL = dict(rtol=1e-6, atol=1e-6)  # a few f32 roundings of logits of order 1


@pytest.fixture(scope="module", autouse=True)
def native():
    from models.cache import NATIVE_DIR, cache_dir

    assert native_penalties.load(os.path.join(cache_dir(), NATIVE_DIR)), native_penalties.LIBRARY.error


def _definition(logits, params, prompts, outputs, banned, pending):
    """float64, token by token: a row's seen tokens (its prompt, when it has a repetition
    penalty, and its outputs, the pending one included) get x * rep where x < 0 else x / rep
    (HF), then - frequency * count - presence * (count > 0) over its outputs (OpenAI); banned ids
    -inf. Rows without a penalty ignore `pending`."""
    out = logits.astype(np.float64)
    for r, p in enumerate(params):
        penalised = p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        outs = list(outputs[r]) + ([pending[r]] if penalised and pending[r] >= 0 else [])
        seen = set(outs) | (set(prompts[r]) if p.repetition_penalty != 1.0 else set())
        for token in seen if penalised else ():
            x = out[r, token]
            x = x * p.repetition_penalty if x < 0 else x / p.repetition_penalty
            count = outs.count(token)
            out[r, token] = x - p.frequency_penalty * count - p.presence_penalty * (count > 0)
        for token in banned.get(r, ()):
            out[r, token] = -np.inf
    return out


def _case(seed, num_rows=12, vocab=1000, prompt_len=40, output_len=30):
    rng = np.random.default_rng(seed)
    reps, freqs, press = [1.0, 1.3, 0.8], [0.0, 0.5, -0.4], [0.0, 0.6, -0.2]
    params = [SamplingParams(temperature=0.7, repetition_penalty=reps[r % 3], frequency_penalty=freqs[(r // 3) % 3],
                             presence_penalty=press[(r // 2) % 3]) for r in range(num_rows)]
    prompts = [rng.integers(0, vocab, prompt_len).tolist() for _ in range(num_rows)]
    outputs = [rng.integers(0, vocab // 4, rng.integers(0, output_len)).tolist() for _ in range(num_rows)]
    banned = {r: rng.choice(vocab, 3, replace=False).tolist() + [outputs[r][0]] if outputs[r] else [7]
              for r in range(0, num_rows, 4)}  # some banned ids are also listed
    # pending: a listed output, a new token, or none
    pending = np.array([(outputs[r][-1] if outputs[r] and r % 3 == 0 else rng.integers(0, vocab)) if r % 3 != 2 else -1
                        for r in range(num_rows)], np.int32)
    rows = [RowInfo(p, prompts[r], outputs[r], r) for r, p in enumerate(params)]
    t = SamplingTensors.build(rows, vocab)
    ids = np.asarray(t.banned_ids).copy()
    for r, b in banned.items():
        ids[r, :len(b)] = b
    t = t.__class__(**{**{f: getattr(t, f) for f in t.__dataclass_fields__}, "banned_ids": ids, "penalised": True})
    logits = (rng.standard_normal((num_rows, vocab)) * 3).astype(np.float32)
    return logits, t, params, prompts, outputs, banned, pending


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("with_pending", [False, True])
def test_native_matches_the_definition_and_the_xla_version(seed, with_pending):
    logits, t, params, prompts, outputs, banned, pending = _case(seed)
    p = jnp.asarray(pending) if with_pending else None
    want = _definition(logits, params, prompts, outputs, banned, pending if with_pending else -np.ones_like(pending))
    got = np.asarray(NATIVE(jnp.asarray(logits), t, p))
    np.testing.assert_allclose(got, want, **TOL)
    np.testing.assert_allclose(np.asarray(REF(jnp.asarray(logits), t, p)), got, **TOL)
    untouched = want == logits  # tokens no penalty or ban reaches keep their bits
    np.testing.assert_array_equal(got[untouched], logits[untouched])


def test_padding_rows_and_shapes():
    """Padding rows (greedy, no penalty, ids -1) stay as they are; ids past the vocabulary are
    ignored as padding is; a shape mismatch is refused by the kernel."""
    logits, t, *_ = _case(3, num_rows=5)
    t = SamplingTensors.build([RowInfo(SamplingParams(repetition_penalty=1.5), [1, 2], [3], 0)],
                                          1000, pad_rows_to=5)
    got = np.asarray(NATIVE(jnp.asarray(logits), t, jnp.asarray([-1, 5, 5, 5, 5], jnp.int32)))
    np.testing.assert_array_equal(got[1:], logits[1:])
    changed = np.flatnonzero(got[0] != logits[0])
    assert set(changed.tolist()) <= {1, 2, 3}


def test_the_sampler_penalises_through_the_native_kernel():
    """Greedy penalised rows: the token sample() draws with draw_impl="native" (both native
    kernels) is the argmax of the definition's penalised logits, as with "xla"."""
    assert sampler_lib.resolve_draw_impl(True) == "native"  # builds and loads both native kernels
    logits, t, params, prompts, outputs, banned, pending = _case(4, num_rows=16, vocab=2000)
    t = t.__class__(**{**{f: getattr(t, f) for f in t.__dataclass_fields__},
                       "temperature": np.zeros(16, np.float32)})  # greedy, still penalised
    want = _definition(logits, params, prompts, outputs, banned, pending).argmax(-1)
    for impl in ("native", "xla"):
        out = sampler_lib.sample(jnp.asarray(logits), t, draw_impl=impl, pending=jnp.asarray(pending))
        np.testing.assert_array_equal(np.asarray(out.token_ids), want)


def test_speculative_verify_penalises_through_the_native_kernel():
    """A verify step (paxpage/speculative/verify.py) with the runner's draw_impl "native": greedy
    penalised rows take the definition's argmax and accept the drafts that equal it, as with "xla"."""
    from paxpage.speculative.verify import verify

    assert sampler_lib.resolve_draw_impl(True) == "native"
    logits, t, params, prompts, outputs, banned, pending = _case(5, num_rows=8, vocab=500)
    t = t.__class__(**{**{f: getattr(t, f) for f in t.__dataclass_fields__},
                       "temperature": np.zeros(8, np.float32)})
    want = _definition(logits, params, prompts, outputs, banned, pending).argmax(-1)
    drafts = np.where(np.arange(8) % 2 == 0, want, (want + 1) % 500).astype(np.int32)
    drafts[7] = -1
    for impl in ("native", "xla"):
        out, accepted = verify(jnp.asarray(logits), t, jnp.asarray(drafts),
                               pending=(jnp.arange(8, dtype=jnp.int32), jnp.asarray(pending)), draw_impl=impl)
        np.testing.assert_array_equal(np.asarray(out.token_ids), want)
        np.testing.assert_array_equal(np.asarray(accepted), (np.arange(8) % 2 == 0) & (drafts >= 0))
