"""Embedding requests in the engine (paxpage/embedding.py): the pooling arithmetic by hand, and
pooled hidden states against HF transformers' last hidden states (after the final norm) on the
same tiny random weights, through chunked prefill beside a generating request and through
preemption, whose recompute must start the pool afresh."""

from __future__ import annotations

import numpy as np
import pytest

from paxpage.embedding import EmbeddingRequest, Pooling


def test_pooling_names():
    assert [Pooling.parse(n) for n in ("last", "mean", "last-unnormalized", "mean-unnormalized")] == [
        Pooling("last"), Pooling("mean"), Pooling("last", False), Pooling("mean", False)]
    assert Pooling("mean", False).name == "mean-unnormalized"
    for bad in ("max", "cls", "", None):
        with pytest.raises(ValueError, match="pooling is"):
            Pooling.parse(bad)


def test_chunks_add_up_and_a_recompute_starts_afresh():
    req = EmbeddingRequest(0, 0, [5, 6, 7, 8], Pooling("mean", False), seq=None)
    assert req.pools(0, 2) and Pooling("last").first_pooled(4) == 3
    req.add(0, [1.0, 2.0])
    req.add(2, [100.0, 100.0])  # then preempted: computed again from position 0
    req.add(0, [1.0, 2.0])
    req.add(2, [3.0, 6.0])
    req.finish()
    assert req.embedding == [1.0, 2.0] and req.output().finish_reason == "stop"  # (1+3)/4, (2+6)/4
    last = EmbeddingRequest(1, 0, [1, 2], Pooling("last"), seq=None)
    assert not last.pools(0, 1) and last.pools(1, 2)
    last.add(1, [3.0, -4.0])
    last.finish()
    assert last.embedding == pytest.approx([0.6, -0.8], abs=1e-7)  # f32


def _hf_pooled(hf, ids, kind):
    import torch

    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].double().numpy()
    return states[-1] if kind == "last" else states.mean(axis=0)


def test_embeddings_beside_generation_and_through_preemption_match_hf(tiny_llama_dir):
    import transformers

    import paxpage
    from paxpage.engine import LLMEngine

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    model = paxpage.load(tiny_llama_dir)
    # 5 pages of 4 tokens, 4 tokens a step: the growing generation preempts the embedding
    engine = LLMEngine(model.config, model.params, None, paxpage.EngineConfig(
        num_pages=5, page_size=4, max_num_seqs=2, max_num_batched_tokens=4, max_model_len=64))
    rng = np.random.default_rng(0)
    engine.add_request(rng.integers(0, 128, 7).tolist(), paxpage.SamplingParams(max_tokens=12, temperature=0,
                                                                                 ignore_eos=True))
    ids = rng.integers(0, 128, 14).tolist()
    embed = engine.request(engine.add_embedding(ids, "mean-unnormalized"))
    done = []
    while engine.has_unfinished():
        done += [engine.output(r) for r, _ in engine.step() if r is embed]
    assert embed.seq.num_preemptions > 0 and engine.scheduler.page_manager.num_free_pages == 5
    np.testing.assert_allclose(done[0].embedding, _hf_pooled(hf, ids, "mean"), atol=1e-4)
    # paxpage.embed: in input order, normalised (one sequence a step: one compiled shape)
    inputs = [rng.integers(0, 128, n).tolist() for n in (40, 3)]
    outs = paxpage.embed(model, inputs, pooling="last", num_pages=32, page_size=4, max_num_seqs=1,
                         max_num_batched_tokens=16)
    assert [o.index for o in outs] == [0, 1]
    for out, ids in zip(outs, inputs):
        want = _hf_pooled(hf, ids, "last")
        np.testing.assert_allclose(out.embedding, want / np.linalg.norm(want), atol=1e-4)
    with pytest.raises(ValueError, match="tokens; an embedding input needs"):
        engine.add_embedding([1] * 64)
