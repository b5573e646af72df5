"""`paxpage.load(..., quantization=...)`: int8 per-channel weights on a tiny HF Llama, and the
default GGUF kept in its own quantised form, each against HF transformers.

References: for int8, HF run on the int8 weights dequantised here in numpy (q * scale: the
tight check of the quantised matmuls and lookups), and HF on the original f32 weights (the
quantisation error itself, within a bound derived below). For the GGUF, transformers dequantises
the file itself, so its model holds exactly the values our grouped form holds."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import paxpage
from models.param_layout import flatten, param_specs
from tests.conftest import hf_greedy, random_prompts, save_tiny_hf


def _logprobs(model, prompt, k):
    out = paxpage.generate(model, [prompt], max_tokens=1, temperature=0, logprobs=k, ignore_eos=True,
                           page_size=4, num_pages=32, use_tqdm=False)[0]
    return out.outputs[0].logprobs[0]


def _hf_logprobs(hf, prompt):
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1], -1).numpy()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_q")
    hf = save_tiny_hf(path, "llama", tie_word_embeddings=True)  # the tied table is the LM head too
    return path, hf


def test_int8_tiny_llama_against_hf(tiny):
    path, hf = tiny
    model = paxpage.load(path, quantization="int8")
    flat = flatten(model.per_layer_params())
    kernels = [p for p, (_, _, transpose) in param_specs(model.config).items() if transpose]
    for p in kernels + ["embed_tokens/embedding"]:
        assert p not in flat and flat[p + "_q"].dtype == np.int8 and flat[p + "_scale"].dtype == np.float32
    assert flat["layers_0/q_proj/kernel_scale"].shape == (1, 64)  # one scale per output channel
    assert flat["embed_tokens/embedding_scale"].shape == (128, 1)  # per vocabulary row = LM-head output

    # HF on the dequantised int8 weights: what our quantised matmuls must compute, up to f32 rounding.
    deq = {p[:-2]: np.asarray(flat[p], np.float32) * np.asarray(flat[p[:-2] + "_scale"])
           for p in flat if p.endswith("_q")}
    reference = save_tiny_hf(path.parent / "unused", "llama", tie_word_embeddings=True)
    reference.load_state_dict(hf.state_dict())
    specs = param_specs(model.config)
    with torch.no_grad():
        state = reference.state_dict()
        for p, w in deq.items():
            _, hf_name, transpose = specs[p]
            state[hf_name].copy_(torch.from_numpy(w.T.copy() if transpose else w))
    prompts = random_prompts(2, 128, [9, 23], seed=5)
    spreads = []
    for prompt in prompts:
        ours = _logprobs(model, prompt, 5)
        on_deq, on_f32 = _hf_logprobs(reference, prompt), _hf_logprobs(hf, prompt)
        for token, logprob in ours.items():
            np.testing.assert_allclose(logprob, on_deq[token], atol=1e-4)
        # Against the f32 model: each weight moves by at most half a step, scale / 2 = max|w| / 254
        # (0.4% of its channel's largest weight); an output of a matmul over I inputs moves by at
        # most that times sum |x|, and the 2 x 7 matmuls plus the LM head on this tiny model are
        # composed in series, so logits move by at most ~15 x 0.4% = 6% of their spread. Checked
        # on the top-5 logprobs, relative to the spread of the reference logprobs.
        spread = float(on_f32.max() - on_f32.min())
        err = max(abs(logprob - on_f32[token]) for token, logprob in ours.items())
        assert 0 < err <= 0.06 * spread, (err, spread)
        spreads.append(err / spread)
    assert hf_greedy(reference, prompts[0], 8) == paxpage.generate(
        model, [prompts[0]], max_tokens=8, temperature=0, ignore_eos=True, page_size=4, num_pages=32,
        use_tqdm=False)[0].token_ids


def test_quantization_is_validated(tiny):
    path, _ = tiny
    with pytest.raises(ValueError, match=r"quantization 'int4' is not one of \(None, 'none', 'gguf', 'int8'\)"):
        paxpage.load(path, quantization="int4")
    with pytest.raises(ValueError, match="not a GGUF file"):
        paxpage.load(path, quantization="gguf")


def test_quantized_model_cannot_be_saved_as_float_checkpoint(tiny, tmp_path):
    path, _ = tiny
    with pytest.raises(ValueError, match="quantization='none'"):
        paxpage.save(paxpage.load(path, quantization="int8"), tmp_path / "ck")


def test_gguf_default_form_per_backend():
    """quantization=None keeps a GGUF's own form on accelerators and on CPU where the native matmul
    runs; the f32 expansion on CPU without it."""
    from models.loading import default_gguf_quantization

    assert default_gguf_quantization("cpu", native_matmul=True) == "gguf"
    assert default_gguf_quantization("cpu", native_matmul=False) == "none"
    assert default_gguf_quantization("gpu") == default_gguf_quantization("tpu") == "gguf"


@pytest.mark.slow
def test_gguf_native_greedy_equals_hf_and_holds_less(hf_smollm2):
    """quantization="gguf" keeps the GGUF's Q4_1 / Q8_0 weights as int8 + f32 scales: exactly what
    transformers dequantises, so greedy continuations agree token for token. On CPU the native
    matmul reads them in panels as held, each weight rounded as numpy's f32 expansion rounds it:
    the logprobs are those of the f32 expansion (quantization="none") bit for bit, which is why a
    GGUF's default form there is "gguf"."""
    import jax

    from models.loading import default_gguf_quantization

    smollm2_q = paxpage.load(quantization="gguf")
    flat = flatten(smollm2_q.per_layer_params())
    assert flat["layers_0/q_proj/kernel_q"].dtype == np.int8
    assert flat["layers_0/q_proj/kernel_scale"].shape == (576 // 32, 576)  # Q4_1: groups of 32
    assert "layers_0/q_proj/kernel_offset" in flat and "embed_tokens/embedding_offset" not in flat  # Q8_0
    held = sum(x.size * x.dtype.itemsize for x in flat.values())
    expanded = sum(int(np.prod(shape)) * 4 for shape, _, _ in param_specs(smollm2_q.config).values())
    assert held < 0.32 * expanded, (held, expanded)  # 1.25 bytes a 4-bit weight, 1.125 for Q8_0, vs 4
    prompts = [smollm2_q.tokenizer.encode(text) for text in ("The capital of France is", "def fibonacci(n):")]
    config = paxpage.EngineConfig(max_num_seqs=8, num_pages=256)  # test_smollm2.py's: its compiled steps
    outs = paxpage.generate(smollm2_q, prompts, engine_config=config, max_tokens=16, temperature=0,
                            ignore_eos=True, logprobs=3, use_tqdm=False)
    for ids, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf_smollm2, ids, 16), smollm2_q.tokenizer.decode(ids)
    if jax.default_backend() == "cpu" and smollm2_q.engine(config).runner.matmul_impl == "native":
        assert default_gguf_quantization() == "gguf"
        params = smollm2_q.params  # held in quantised panels, as the native matmul reads them
        assert params["layers"]["0"]["q_proj"]["kernel_panels_q"].dtype == np.int8
        assert params["embed_tokens"]["embedding_panels_q"].shape == (49152 // 64, 576, 64)
        expanded = paxpage.load(quantization="none")
        plain = paxpage.generate(expanded, prompts, engine_config=config, max_tokens=16, temperature=0,
                                 ignore_eos=True, logprobs=3, use_tqdm=False)
        expanded.close()
        for a, b in zip(outs, plain):
            assert a.outputs[0].logprobs == b.outputs[0].logprobs


@pytest.fixture(scope="module")
def outlier_dir(tmp_path_factory):
    """A tiny Llama whose residual stream carries a few huge channels (embedding columns x 30000,
    as real LLMs' massive activations) and whose layer-0 K/V projections are scaled x 100, so
    K and V reach the thousands: past fp8 e4m3's 448 and where bf16 keeps ~3 digits."""
    path = tmp_path_factory.mktemp("tiny_outliers")
    hf = save_tiny_hf(path, "llama")
    with torch.no_grad():
        hf.model.embed_tokens.weight[:, :3] *= 30000.0
        hf.model.layers[0].self_attn.k_proj.weight.mul_(100.0)
        hf.model.layers[0].self_attn.v_proj.weight.mul_(100.0)
    hf.save_pretrained(path)
    return path, hf


def _kv_variants():
    fields = paxpage.EngineConfig.field_names()
    return [{}] + ([{"kv_cache_dtype": d} for d in ("int8", "fp8")] if "kv_cache_dtype" in fields else [])


@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.extended
def test_large_activation_outliers_stay_finite(outlier_dir, quantization):
    """No NaN / inf and logprobs near HF f32's with outliers of ~1e4 in the residual stream and in
    K / V, computing in bf16 with float or int8 weights and (where the engine has them) int8 / fp8
    KV caches. Near: within 10% of the reference's logprob spread (bf16 keeps 8 mantissa bits)."""
    path, hf = outlier_dir
    model = paxpage.load(path, quantization=quantization)
    prompt = random_prompts(1, 128, [21], seed=8)[0]
    with torch.no_grad():
        hidden = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    assert max(float(h.abs().max()) for h in hidden) > 5000  # the outliers are there
    ref = _hf_logprobs(hf, prompt)
    spread = float(ref.max() - ref.min())
    for extra in _kv_variants():
        out = paxpage.generate(model, [prompt], max_tokens=3, temperature=0, logprobs=5, ignore_eos=True,
                               page_size=4, num_pages=32, dtype="bfloat16", use_tqdm=False, **extra)[0]
        for step in out.outputs[0].logprobs:
            assert all(math.isfinite(v) for v in step.values()), (extra, step)
        first = out.outputs[0].logprobs[0]
        err = max(abs(v - ref[t]) for t, v in first.items())
        assert err < 0.1 * spread, (extra, err, spread)
