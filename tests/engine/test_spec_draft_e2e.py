"""speculative_method="draft" end to end on a tiny random llama: a 1-layer truncated copy drafts
for its 2-layer target, whose second layer is damped so the two mostly (not always) agree.

Greedy outputs must equal HF transformers' greedy continuation of the same weights (what the
engine without speculation produces) token for token, through stop tokens, max_tokens, prefix
caching, n > 1 and preemption in a tight pool; every page is free at the end."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import hf_greedy, save_tiny_hf

K = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import torch

    import paxpage

    path = tmp_path_factory.mktemp("tiny_damped")
    hf = save_tiny_hf(path, "llama", seed=3)
    with torch.no_grad():  # the last layer adds little: the first layer alone is a good draft
        layer = hf.model.layers[1]
        layer.self_attn.o_proj.weight.mul_(0.1)
        layer.mlp.down_proj.weight.mul_(0.1)
    hf.save_pretrained(path)
    target = paxpage.load(path)
    return target, target.truncated(1), hf.eval()


def _run(target, prompts, params, **config):
    import paxpage

    cfg = paxpage.EngineConfig(page_size=4, max_model_len=96, **config)
    engine = paxpage.LLMEngine(target.config, target.params, None, cfg)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    requests = [engine.request(i) for i in ids]
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished()
    stats = engine.scheduler.stats()
    assert stats.num_running == 0 and stats.num_used_pages == 0, stats
    outputs = [[list(c.token_ids) for c in engine.output(r).outputs] for r in requests]
    return outputs, engine


def _prompts():
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 128, 9).tolist()  # a common prefix: prefix-cache hits once one has run
    return ([shared + rng.integers(0, 128, 3).tolist()]
            + [rng.integers(0, 128, n).tolist() for n in (1, 6, 21)]
            + [shared + rng.integers(0, 128, 8).tolist()])


@pytest.mark.extended
def test_greedy_outputs_equal_no_speculation(models):
    """One tight pool (preemptions), stop tokens, max_tokens, a prefix shared with a finished
    request, n = 2: token for token HF's greedy outputs. Two sampled requests share the run (their
distribution is checked at unit level: test_spec_verify.py, test_spec_draft_runner.py)."""
    from paxpage import SamplingParams

    target, draft, hf = models
    prompts = _prompts()
    max_tokens = [30, 40, 9, 40, 30, 12]
    prompts.append(prompts[2])
    wants = [hf_greedy(hf, prompt, m) for prompt, m in zip(prompts, max_tokens)]
    # a stop token first met mid-way through request 3's output
    stop = next(t for j, t in enumerate(wants[3]) if j >= 10 and t not in wants[3][:j])
    wants[3] = wants[3][:wants[3].index(stop) + 1]
    assert len(wants[3]) < max_tokens[3]
    params = [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens]
    params[3] = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop])
    params[5] = SamplingParams(temperature=0, max_tokens=12, n=2)
    # sampled requests in the same run: their drafts come with q and go through rejection sampling
    sampled = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=s) for s in (1, 2)]
    outputs, engine = _run(target, prompts + prompts[:2], params + sampled, num_pages=16, max_num_seqs=2, speculative_method="draft",
                           draft_model=draft, num_speculative_tokens=K, speculative_max_batch=2)
    for i, (want, p) in enumerate(zip(wants, params)):
        assert outputs[i] == [want] * p.n, i
    assert [len(o[0]) for o in outputs[len(params):]] == [20, 20]
    assert all(0 <= t < 128 for o in outputs[len(params):] for t in o[0])
    stats, sched = engine.stats, engine.scheduler.stats()
    assert stats.spec_steps > 5, stats
    assert 0.5 < stats.acceptance_rate < 1.0, stats
    assert 1.5 < stats.mean_accepted_length <= K + 1, stats
    assert sched.prefix_hit_rate > 0 and sched.num_preemptions > 0, sched


@pytest.mark.extended
def test_draft_pool_follows_the_persistent_batch_steps(models):
    """Four requests with speculative_max_batch 2: while more than two run, steps are the
    persistent batch's (no drafts) and must still fill the draft's pool; once the short ones end,
    the long ones speculate from it. Acceptance stays as high as with speculation throughout."""
    from paxpage import SamplingParams

    target, draft, hf = models
    prompts = _prompts()[1:]
    max_tokens = [6, 8, 40, 40]
    params = [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens]
    outputs, engine = _run(target, prompts, params, num_pages=64, max_num_seqs=4, speculative_method="draft",
                           draft_model=draft, num_speculative_tokens=K, speculative_max_batch=2)
    assert outputs == [[hf_greedy(hf, p, m)] for p, m in zip(prompts, max_tokens)]
    stats = engine.stats
    assert stats.decode_batch_steps > 3 and stats.spec_steps > 5, stats
    assert stats.acceptance_rate > 0.5, stats
