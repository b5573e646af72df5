"""/v1/embeddings with the real `openai` client against live servers on 127.0.0.1, compared with
HF transformers' last hidden states (after the final norm) on the same weights.

One tiny random llama with a BPE tokenizer, one engine, two apps on it: one pools the last
token (the default), one the mean, unnormalised. The engine's steps are small (32 tokens, one
prefill row: few compiled shapes) so a long input is prefilled in several chunks, and inputs
share steps with each other and with a generating request."""

from __future__ import annotations

import base64
import threading

import numpy as np
import pytest

from tests.server.conftest import LiveServer

TOL = 1e-4


@pytest.fixture(scope="module")
def setup(tiny_text_dir):
    import openai
    import torch
    from transformers import AutoModelForCausalLM

    import paxpage
    from paxpage.async_engine import AsyncEngine

    hf = AutoModelForCausalLM.from_pretrained(tiny_text_dir, dtype=torch.float32).eval()
    model = paxpage.load(tiny_text_dir)
    engine = AsyncEngine(model, paxpage.EngineConfig(num_pages=64, page_size=16, max_num_seqs=4,
                                                     max_num_batched_tokens=32, max_model_len=256))
    last = LiveServer(engine, served_model_name="tiny")
    mean = LiveServer(engine, served_model_name="tiny", pooling="mean-unnormalized")
    clients = [openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="unused", timeout=180.0, max_retries=0)
               for s in (last, mean)]
    yield hf, model.tokenizer, *clients
    for c in clients:
        c.close()
    for s in (last, mean):
        s.server.should_exit = True
        s.thread.join(timeout=15)
    engine.shutdown()


def hf_embedding(hf, ids: list[int], kind: str, normalize: bool) -> np.ndarray:
    """The HF model's last hidden state (after the final norm) of each token, pooled."""
    import torch

    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].double().numpy()
    vec = states[-1] if kind == "last" else states.mean(axis=0)
    return vec / np.linalg.norm(vec) if normalize else vec


def test_inputs_of_every_form_match_hf(setup):
    hf, tok, last, _ = setup
    rng = np.random.default_rng(0)
    texts = ["The quick brown fox", "yes", "0123456789 true false null " * 6]
    ids = [rng.integers(1, 320, n).tolist() for n in (1, 7, 150)]  # 150: five chunks of a 32-token step
    cases = [(texts[0], [tok.encode(texts[0])]), (texts, [tok.encode(t) for t in texts]),
             (ids[1], [ids[1]]), (ids, ids)]
    for given, expected_ids in cases:
        r = last.embeddings.create(model="tiny", input=given, encoding_format="float")
        assert [d.index for d in r.data] == list(range(len(expected_ids)))
        for d, want in zip(r.data, expected_ids):
            assert len(d.embedding) == hf.config.hidden_size
            np.testing.assert_allclose(d.embedding, hf_embedding(hf, want, "last", True), atol=TOL)
        n = sum(len(x) for x in expected_ids)
        assert (r.usage.prompt_tokens, r.usage.total_tokens) == (n, n)
    # the client's default asks for base64 and decodes it (the prefix cache now holds the long
    # input's first pages: its last chunk attends to them, the same values in another order)
    b64 = last.embeddings.create(model="tiny", input=ids)
    for d, want in zip(b64.data, ids):
        np.testing.assert_allclose(d.embedding, hf_embedding(hf, want, "last", True), atol=TOL)


def test_mean_pooling_unnormalised(setup):
    hf, _, _, mean = setup
    rng = np.random.default_rng(1)
    ids = [rng.integers(1, 320, n).tolist() for n in (150, 3, 64, 1)]
    r = mean.embeddings.create(model="tiny", input=ids, encoding_format="float")
    for d, want in zip(r.data, ids):
        np.testing.assert_allclose(d.embedding, hf_embedding(hf, want, "mean", False), atol=TOL)


def test_embedding_beside_a_generating_request(setup):
    hf, _, last, _ = setup
    prompt = [5, 17, 99, 3, 250]
    body = dict(model="tiny", prompt=prompt, max_tokens=120, temperature=0.0, extra_body={"ignore_eos": True})
    alone = last.completions.create(**body).choices[0].text
    ids = np.random.default_rng(2).integers(1, 320, 100).tolist()
    stream = last.completions.create(**body, stream=True)
    pieces, embedded, after = [next(iter(stream)).choices[0].text], [], []
    worker = threading.Thread(target=lambda: embedded.append(last.embeddings.create(model="tiny", input=ids,
                                                                                    encoding_format="float")))
    worker.start()
    for chunk in stream:
        pieces.append(chunk.choices[0].text)
        if embedded and not after:
            after.append(len(pieces))
    worker.join(timeout=120)
    assert "".join(pieces) == alone
    assert after, "the generation ended before the embedding came back"
    np.testing.assert_allclose(embedded[0].data[0].embedding, hf_embedding(hf, ids, "last", True), atol=TOL)


def test_embedding_errors(setup):
    import openai

    _, _, last, _ = setup
    with pytest.raises(openai.BadRequestError) as e:
        last.embeddings.create(model="tiny", input="hello", dimensions=8)
    assert e.value.body["param"] == "dimensions" and "cannot be truncated" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        last.embeddings.create(model="tiny", input=[[1, 2], [320]])
    assert e.value.body["param"] == "input" and "320" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        last.embeddings.create(model="tiny", input=[], encoding_format="float")
    assert e.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as e:
        last.embeddings.create(model="tiny", input="hi", extra_body={"truncate_prompt_tokens": 4})
    assert e.value.body["param"] == "truncate_prompt_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        last.embeddings.create(model="tiny", input=[1] * 300)
    assert "max_model_len" in e.value.body["message"]


def test_base64_is_little_endian_float32():
    from paxpage.server.embedding_routes import encode_embedding

    vec = [1.0, -2.5, 3.25]
    assert np.frombuffer(base64.b64decode(encode_embedding(vec, "base64")), "<f4").tolist() == vec
    assert encode_embedding(vec, "float") is vec
