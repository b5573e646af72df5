"""Beam search in the engine: the host-side step against hand-worked values, the engine against
HF transformers' `generate(num_beams=...)` on the same weights, page sharing and page accounting."""

from __future__ import annotations

import numpy as np
import pytest

import paxpage
from paxpage.beam import BeamSearch, top_candidates
from paxpage.config import EngineConfig
from paxpage.sampling.params import SamplingParams

from tests.conftest import hf_greedy, save_tiny_hf

EOS = 3


def _beam(max_tokens=10, early_stopping="never", length_penalty=1.0, width=2):
    params = SamplingParams(beam_width=width, max_tokens=max_tokens, early_stopping=early_stopping,
                            length_penalty=length_penalty)
    return BeamSearch(params, num_prompt_tokens=4, eos_token_ids=(EOS,), vocab_size=32)


# Hand-worked example, W = 2, EOS = 3, K = 2 * W = 4 candidates per step.
STEP1 = ([[1, 3, 2, 0]], [[-0.5, -1.0, -2.0, -3.0]])
STEP2 = ([[3, 4, 6, 7], [5, 3, 8, 9]], [[-0.2, -0.4, -5.0, -6.0], [-0.1, -0.3, -5.0, -6.0]])
STEP3 = ([[3, 6, 7, 8], [3, 9, 10, 11]], [[-0.1, -0.2, -0.3, -0.4], [-0.05, -1.0, -2.0, -3.0]])


def _run(beam, steps, outputs=([],)):
    """Feeds steps; returns the running candidates of each step."""
    history = []
    outputs = [list(o) for o in outputs]
    for ids, lps in steps:
        running = beam.advance(outputs, np.array(ids), np.array(lps, np.float32))
        history.append([(c.parent, c.token, round(float(c.score), 4)) for c in running])
        outputs = [outputs[c.parent] + [c.token] for c in running]
        beam.scores = [c.score for c in running]
    return history


def test_top_candidates_hand_example():
    cands = top_candidates(np.float32([-0.5, -2.0]), np.array(STEP2[0]), np.array(STEP2[1], np.float32), 4)
    assert [(c.parent, c.token) for c in cands] == [(0, 3), (0, 4), (1, 5), (1, 3)]
    np.testing.assert_allclose([c.score for c in cands], [-0.7, -0.9, -2.1, -2.3], rtol=1e-6)


def test_advance_hand_example_never():
    beam = _beam(early_stopping="never")
    history = _run(beam, [STEP1, STEP2, STEP3])
    # step 1: EOS (rank 1 < W) finishes with -1.0 / 1; the two best non-EOS continue
    assert history[0] == [(0, 1, -0.5), (0, 2, -2.0)]
    # step 2: (0, 3) finishes with -0.7 / 2; (1, 3) is EOS but ranks 3 >= W: neither kept nor run
    assert history[1] == [(0, 4, -0.9), (1, 5, -2.1)]
    # step 3: both survivors extend beam 0 (a fork), beam 1 is dropped; (1, 4, 3) finishes -1.0 / 3
    assert history[2] == [(0, 6, -1.1), (0, 7, -1.2)]
    assert [(h.token_ids, round(float(h.score), 4), h.finish_reason) for h in beam.finished] == [
        ((1, 4, 3), -0.3333, "stop"), ((1, 3), -0.35, "stop")]
    assert not beam.done  # "never" with length_penalty > 0 bounds by max_tokens: -1.1 / 10 > -0.35


def test_advance_early_stopping_rules():
    beam = _beam(early_stopping=True)  # done as soon as W hypotheses are finished
    assert _run(beam, [STEP1, STEP2])[1] == []
    assert beam.done and [h.token_ids for h in beam.finished] == [(1, 3), (3,)]

    beam = _beam(early_stopping=False)  # heuristic: best running -1.1 / 3 cannot beat -0.35
    assert _run(beam, [STEP1, STEP2, STEP3])[2] == []
    assert beam.done and [h.token_ids for h in beam.finished] == [(1, 4, 3), (1, 3)]


def test_advance_max_length_finishes_top_w():
    beam = _beam(max_tokens=1)
    assert _run(beam, [STEP1]) == [[]]
    assert beam.done
    assert [(h.token_ids, h.finish_reason, h.stop_reason) for h in beam.finished] == [
        ((1,), "length", None), ((3,), "stop", 3)]


def test_sampling_params_beam_validation():
    assert SamplingParams(beam_width=4, early_stopping="never").beam_width == 4
    with pytest.raises(ValueError, match="beam_width"):
        SamplingParams(beam_width=0)
    with pytest.raises(TypeError, match="beam_width"):
        SamplingParams(beam_width=2.0)
    with pytest.raises(ValueError, match="early_stopping"):
        SamplingParams(early_stopping="sometimes")
    with pytest.raises(ValueError, match="n must be 1"):
        SamplingParams(beam_width=2, n=2)
    with pytest.raises(ValueError, match="stop strings"):
        SamplingParams(beam_width=2, stop="x")
    with pytest.raises(ValueError, match="beam_width"):
        _beam(width=20)  # K = 40 candidates > 32 tokens


# ---------------------------------------------------------------- engine vs HF transformers
PROMPTS = [[5, 17, 33, 2, 90, 11], [9, 8, 7, 6, 5], list(range(40, 70))]
# A small pool and few rows on purpose: beams get preempted, and max_num_seqs cuts through a
# request's beams, so the engine must hold those back (one shared config: fewer compiles).
CONFIG = EngineConfig(page_size=4, num_pages=44, max_num_seqs=6, max_model_len=128)


@pytest.fixture(scope="module")
def tiny_eos(tmp_path_factory):
    """Tiny llama whose EOS is a token greedy decoding emits, so beams do end on EOS."""
    hf = save_tiny_hf(tmp_path_factory.mktemp("probe"), "llama")
    eos = hf_greedy(hf, PROMPTS[0], 4)[3]
    path = tmp_path_factory.mktemp("tiny_eos")
    hf = save_tiny_hf(path, "llama", eos_token_id=eos)
    return paxpage.load(path), hf, eos


def _hf_beams(hf, prompt, eos, width, max_tokens, **kw):
    import torch

    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
                          do_sample=False, max_new_tokens=max_tokens, pad_token_id=eos,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          return_dict_in_generate=True, output_scores=True, **kw)
    rows = out.sequences[:, len(prompt):].tolist()
    # padding is EOS: a beam ends at its first EOS, inclusive
    return [row[:row.index(eos) + 1] if eos in row else row for row in rows], out.sequences_scores.tolist()


@pytest.mark.parametrize("width,early_stopping,length_penalty", [
    (2, False, 1.0), (4, True, 1.0), (4, "never", 2.0), (4, False, 0.0)])
def test_matches_hf_beam_search(tiny_eos, width, early_stopping, length_penalty):
    model, hf, eos = tiny_eos
    outs = paxpage.generate(model, PROMPTS, engine_config=CONFIG, beam_width=width, max_tokens=10,
                            early_stopping=early_stopping, length_penalty=length_penalty, use_tqdm=False)
    engine = model.engine(CONFIG)
    assert engine.scheduler.page_manager.num_free_pages == engine.config.num_pages
    ended_on_eos = 0
    for prompt, out in zip(PROMPTS, outs):
        tokens, scores = _hf_beams(hf, prompt, eos, width, 10, early_stopping=early_stopping,
                                   length_penalty=length_penalty)
        assert [c.token_ids for c in out.outputs] == tokens
        assert out.token_ids == tokens[0]
        np.testing.assert_allclose([c.score for c in out.outputs], scores, rtol=1e-4, atol=1e-5)
        ended_on_eos += sum(c.finish_reason == "stop" for c in out.outputs)
        for c in out.outputs:
            assert (c.finish_reason == "stop") == (c.token_ids[-1] == eos)
    assert ended_on_eos > 0


def test_held_back_and_preempted_beams_match_hf(tiny_eos):
    """max_num_seqs cuts through a request's beams and a small pool preempts beams: results
    must not change, and every page comes back."""
    model, hf, eos = tiny_eos
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 128, 25).tolist() for _ in range(5)]
    engine = model.engine(CONFIG)
    preemptions, held_back = engine.scheduler.num_preemptions, engine._beams.num_held_back
    # 4 beams x 41 tokens need up to 44 pages: the smallest pool that takes one request
    outs = paxpage.generate(model, prompts, engine_config=CONFIG, beam_width=4, max_tokens=16,
                            use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        tokens, _ = _hf_beams(hf, prompt, eos, 4, 16)
        assert [c.token_ids for c in out.outputs] == tokens
    assert engine.scheduler.num_preemptions > preemptions
    assert engine._beams.num_held_back > held_back
    assert engine.scheduler.page_manager.num_free_pages == engine.config.num_pages


def test_mixed_with_sampling_requests(tiny_eos):
    """Beam rows share the step with ordinary greedy requests, which are unaffected."""
    model, hf, eos = tiny_eos
    beam = SamplingParams(beam_width=2, max_tokens=10)
    params = [beam, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), beam]
    outs = paxpage.generate(model, PROMPTS, engine_config=CONFIG, sampling_params=params, use_tqdm=False)
    for i in (0, 2):
        assert [c.token_ids for c in outs[i].outputs] == _hf_beams(hf, PROMPTS[i], eos, 2, 10)[0]
    assert outs[1].token_ids == hf_greedy(hf, PROMPTS[1], 10)
    assert len(outs[1].outputs) == 1


def test_beam_pages_are_shared(tiny_eos):
    """W = 4 beams on a 200-token prompt hold far fewer pages than 4 separate sequences."""
    model, _, _ = tiny_eos
    config = EngineConfig(page_size=16, num_pages=64, max_num_seqs=8, max_model_len=256)
    engine = model.engine(config)
    prompt = np.random.default_rng(0).integers(0, 128, 200).tolist()

    def peak(params):
        engine.add_request(prompt, params)
        pages = 0
        while engine.has_unfinished():
            engine.step()
            engine.scheduler.check_invariants()
            pages = max(pages, engine.scheduler.page_manager.num_used_pages)
        assert engine.scheduler.page_manager.num_free_pages == config.num_pages
        return pages

    single = peak(SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    beams = peak(SamplingParams(beam_width=4, max_tokens=16, ignore_eos=True))
    assert single == 216 // 16 + 1
    # at most: the 12 full prompt pages once, and per beam its copy of the partial prompt page
    # plus one page for the rest of its 16 tokens
    assert beams <= 12 + 4 * 2 < 4 * single, (beams, single)
    print(f"peak pages: 4 beams {beams}, one sequence {single}, 4 x one sequence {4 * single}")


def test_prompt_logprobs_match_hf(tiny_eos):
    """Beam requests return the prompt logprobs they ask for (HF's log-softmax as reference)."""
    import torch

    model, hf, _ = tiny_eos
    prompt = PROMPTS[1]
    out = paxpage.generate(model, [prompt], engine_config=CONFIG, beam_width=2, max_tokens=6,
                           prompt_logprobs=2, use_tqdm=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], -1).numpy()
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    for p in range(1, len(prompt)):
        entry = out.prompt_logprobs[p]
        assert prompt[p] in entry and set(np.argsort(-ref[p - 1])[:2].tolist()) <= set(entry)
        for token, lp in entry.items():
            np.testing.assert_allclose(lp, ref[p - 1, token], atol=1e-4)
    assert [c.token_ids for c in out.outputs] == _hf_beams(hf, prompt, tiny_eos[2], 2, 6)[0]


def _metaspace_tokenizer(vocab_size: int):
    """A SentencePiece-like tokenizer: every token is "▁word", and decoding drops the space of
    the first token, so a completion's leading space exists only with the prompt as context."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"\u2581w{i}": i for i in range(vocab_size)}, unk_token="\u2581w0"))
    backend.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def test_beam_text_is_decoded_after_the_prompt(tiny_eos):
    model, _, _ = tiny_eos
    tok = _metaspace_tokenizer(model.config.vocab_size)
    with_text = paxpage.Model(model.config, model.params, tok)
    prompt = PROMPTS[0]
    outs = paxpage.generate(with_text, [prompt, prompt], engine_config=CONFIG, use_tqdm=False,
                            sampling_params=[SamplingParams(beam_width=2, max_tokens=6),
                                             SamplingParams(temperature=0, max_tokens=6)])
    prompt_text = tok.decode(prompt)
    for c in outs[0].outputs + outs[1].outputs:  # beams, then the sampling path's answer
        assert c.text == tok.decode(prompt + c.token_ids)[len(prompt_text):]
        assert c.text.startswith(" w")
    with_text.close()


CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "user", "content": "Write a haiku about the sea."}],
         [{"role": "user", "content": "Name three primary colors."}]]


@pytest.mark.slow
@pytest.mark.extended
def test_smollm2_matches_hf_beam_search(smollm2, hf_smollm2):
    import torch

    tok = smollm2.tokenizer
    eos = list(smollm2.config.eos_token_ids)
    assert hf_smollm2.generation_config.eos_token_id in (eos, eos[0])
    outs = paxpage.generate(smollm2, CHATS, beam_width=4, max_tokens=20, early_stopping=True,
                            length_penalty=1.0, use_tqdm=False)
    for out in outs:
        with torch.no_grad():
            ref = hf_smollm2.generate(torch.tensor([out.prompt_token_ids]), num_beams=4, num_return_sequences=4,
                                      do_sample=False, max_new_tokens=20, early_stopping=True,
                                      length_penalty=1.0, pad_token_id=eos[0],
                                      attention_mask=torch.ones(1, len(out.prompt_token_ids), dtype=torch.long))
        rows = ref[:, len(out.prompt_token_ids):].tolist()
        expected = [row[:row.index(eos[0]) + 1] if eos[0] in row else row for row in rows]
        assert [c.token_ids for c in out.outputs] == expected
        assert out.text == tok.decode(expected[0], skip_special_tokens=True)
