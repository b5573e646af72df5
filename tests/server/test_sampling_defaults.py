"""Request bodies set only the sampling fields the client sent, so the model's generation-config
defaults fill the rest in the engine (as in vLLM's server)."""

from __future__ import annotations

from paxpage.server.protocol import ChatCompletionRequest, CompletionRequest
from paxpage.server.sampling import chat_sampling_params, completion_sampling_params

MODEL_DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}


def test_fields_the_client_did_not_send_take_the_model_defaults():
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=5)
    p = chat_sampling_params(chat, prompt_len=3, token_budget=100).with_defaults(MODEL_DEFAULTS)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.6, 0.9, 20, 0.05, 1.1)
    completion = CompletionRequest(prompt="x", temperature=0, top_k=-1)
    p = completion_sampling_params(completion).with_defaults(MODEL_DEFAULTS)
    assert (p.temperature, p.top_k, p.top_p) == (0.0, -1, 0.9) and p.greedy
