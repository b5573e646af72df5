"""The merged stream's start(): a client gone before any first token aborts every prompt and
leaves no future whose exception nobody retrieved (asyncio logs each such one when it is freed)."""

from __future__ import annotations

import asyncio
import gc

import pytest

from paxpage.server.dispatch import ClientGone, MergedStream


class _Engine:
    def __init__(self):
        self.aborted: list[str] = []

    async def stream(self, prompt_ids, params, request_id, prompt, lora):
        await asyncio.Event().wait()  # never a first token
        yield None

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


class _Ctx:
    def __init__(self):
        self.engine, self.metrics = _Engine(), None


class _GoneRequest:
    async def receive(self):
        return {"type": "http.disconnect"}


def test_client_gone_before_first_token():
    async def run():
        loop = asyncio.get_running_loop()
        reported: list[dict] = []
        loop.set_exception_handler(lambda _loop, context: reported.append(context))
        ctx = _Ctx()
        stream = MergedStream(ctx, [([1, 2], None), ([3], None)], None, "req", "prompt")
        with pytest.raises(ClientGone):
            await stream.start(_GoneRequest())
        for _ in range(5):
            await asyncio.sleep(0)
        del stream
        gc.collect()
        await asyncio.sleep(0)
        return ctx.engine.aborted, reported

    aborted, reported = asyncio.run(run())
    assert aborted == ["req-0", "req-1"]
    assert reported == [], [c.get("message") for c in reported]
