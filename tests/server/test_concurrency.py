"""16 concurrent streams on one server each get their own text: the offline greedy answer to
their own prompt."""

from __future__ import annotations

import asyncio

import pytest

import paxpage

pytestmark = pytest.mark.slow

NUM_STREAMS = 16
MAX_TOKENS = 8
CHATS = [[{"role": "user", "content": f"Write the number {i} in words, then name a fruit."}]
         for i in range(NUM_STREAMS)]


def test_concurrent_streams_get_their_own_text(smol_server, smollm2, smol_config):
    import openai

    offline = paxpage.generate(smollm2, CHATS, temperature=0, max_tokens=MAX_TOKENS,
                               engine_config=smol_config, use_tqdm=False)
    assert len({o.text for o in offline}) > NUM_STREAMS // 2  # the prompts do tell them apart

    async def one(client, messages):
        stream = await client.chat.completions.create(model="smollm2", messages=messages, temperature=0,
                                                      max_tokens=MAX_TOKENS, stream=True)
        parts, finish = [], None
        async for chunk in stream:
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        return "".join(parts), finish

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{smol_server.base_url}/v1", api_key="unused",
                                      timeout=300.0, max_retries=0) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, m) for m in CHATS)), timeout=600)

    results = asyncio.run(main())
    assert [text for text, _ in results] == [o.text for o in offline]
    assert [finish for _, finish in results] == [o.finish_reason for o in offline]
