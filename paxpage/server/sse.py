"""Server-Sent Events as OpenAI sends them: `data: {json}\n\n` per chunk, then `data: [DONE]\n\n`."""

from __future__ import annotations

import json
from typing import AsyncIterator

from fastapi.responses import StreamingResponse

DONE = b"data: [DONE]\n\n"


def event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8") + b"\n\n"


def response(body: AsyncIterator[bytes]) -> StreamingResponse:
    # no-cache / no buffering: proxies must pass each chunk on as it comes
    return StreamingResponse(body, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
