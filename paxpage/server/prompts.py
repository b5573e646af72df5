"""Turns request prompts into token ids: chats through the model's chat template, completion
prompts as text or ids. Raises APIError(400) naming the field for what cannot be encoded."""

from __future__ import annotations

from typing import Any

from paxpage.server.errors import bad_request
from paxpage.server.protocol import ChatMessage
from paxpage.server.tools import ToolPlan, ToolRendering, template_messages


def chat_text(tokenizer: Any, messages: list[ChatMessage], add_generation_prompt: bool = True,
              rendering: ToolRendering | None = None, tools: ToolPlan | None = None) -> str:
    """rendering: how the template meets tool turns (server/tools.py); tools: the request's tools."""
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    chat, tool_dicts = template_messages(messages, rendering, tools)
    kw = {"tools": tool_dicts} if tool_dicts is not None else {}
    try:
        return tokenizer.apply_chat_template(chat, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **kw)
    except Exception as e:  # a template may reject a role order (jinja raise_exception)
        raise bad_request(f"the chat template rejected these messages: {e}", "messages") from None


def encode_chat(tokenizer: Any, messages: list[ChatMessage], tools: ToolPlan) -> tuple[list[int], str]:
    """As paxpage.api does: template to text, then encode without adding special tokens again."""
    text = chat_text(tokenizer, messages, tools=tools)
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if not ids:
        raise bad_request("messages encode to an empty prompt", "messages")
    return ids, text


def encode_completion_prompts(tokenizer: Any, prompt, vocab_size: int, field: str = "prompt"
                              ) -> list[tuple[list[int], str | None]]:
    """One (token ids, text or None) per prompt; a list of str or of id lists is several prompts.
    field: the body's name for them, in errors."""
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
    if not prompts:
        raise bad_request(f"{field} must not be empty", field)
    out = []
    for i, p in enumerate(prompts):
        where = field if len(prompts) == 1 else f"{field}[{i}]"
        if isinstance(p, str):
            if not p:
                raise bad_request(f"{where} is empty; at least 1 prompt token is required", field)
            if tokenizer is None:
                raise bad_request(f"{where} is text but this model has no tokenizer; send token ids", field)
            ids, text = list(tokenizer.encode(p)), p
        else:
            ids, text = list(p), None
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise bad_request(f"{where} contains token id {bad[0]}, outside the vocabulary "
                                  f"[0, {vocab_size})", field)
        if not ids:
            raise bad_request(f"{where} is empty; at least 1 prompt token is required", field)
        out.append((ids, text))
    return out
