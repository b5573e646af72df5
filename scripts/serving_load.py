"""Online load generator for OpenAI-compatible servers: Poisson arrivals, streamed completions.

One request is one `POST /v1/completions` with `stream: true`; the response is read as
Server-Sent Events (`data: {json}` lines; `data: [DONE]` or the end of the body ends it).
Per request it records, on one monotonic clock:
    start        when the request was sent (its Poisson arrival time)
    first_token  when the first chunk carrying non-empty text arrived (TTFT = first_token - start)
    max_gap      the longest wait between two such chunks (a stall: a compile, a long prefill)
    chunk_times  when each such chunk arrived (and response_id, the chunks' "id")
    end          when the stream ended (end-to-end latency = end - start)
    output_tokens  `usage.completion_tokens` of the final chunk when the server sends usage,
                 else the number of chunks that carried text (one token per chunk)
A rate run sends N requests at seeded exponential gaps (a Poisson process at `rate` req/s)
and returns when every request finished, failed or ran out of time.

Metrics over the requests that finished (the vLLM paper's and its benchmark_serving's):
    throughput   finished requests / (last end - first start); output tokens / same span
    TTFT         p50/p90/p99 of first_token - start
    TPOT         p50/p90/p99 of (end - first_token) / (output_tokens - 1), requests with > 1 token
    normalised latency  mean over requests of (end - start) / output_tokens, in s/token
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import httpx
import numpy as np


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    body: dict  # the JSON body sent to /v1/completions (stream is set by the sender)
    output_len: int  # tokens asked for (max_tokens)


@dataclasses.dataclass
class RequestRecord:
    start: float
    first_token: float | None = None
    end: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None  # from usage, when sent
    counted_from_usage: bool = False
    max_gap: float = 0.0  # longest wait between text chunks: a stall (a compile, a long prefill)
    error: str | None = None
    response_id: str | None = None  # the chunks' "id"
    chunk_times: list = dataclasses.field(default_factory=list)  # arrival of each text chunk

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None and self.output_tokens > 0


def poisson_offsets(num_requests: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds after the run starts: the first at 0, then exponential gaps of
    mean 1/rate (a Poisson process). rate = inf sends everything at once."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if not rate > 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if np.isinf(rate):
        return [0.0] * num_requests
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


async def send_one(client: httpx.AsyncClient, url: str, spec: RequestSpec, timeout: float,
                   start: float) -> RequestRecord:
    """Streams one completion; never raises (errors and timeouts land in `error`)."""
    record = RequestRecord(start=start)
    body = dict(spec.body, stream=True)
    try:
        await asyncio.wait_for(_stream(client, url, body, record), timeout)
    except asyncio.TimeoutError:
        record.error = f"timed out after {timeout:g} s"
    except (httpx.HTTPError, ValueError) as e:
        record.error = f"{type(e).__name__}: {e}"
    if record.error is None and record.output_tokens == 0:
        record.error = "no output tokens"
    return record


async def _stream(client: httpx.AsyncClient, url: str, body: dict, record: RequestRecord) -> None:
    chunks_with_text = 0
    last = 0.0  # when the last chunk with text came
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            record.error = f"HTTP {response.status_code}: {text[:300]}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments, event names
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                record.error = f"stream error: {chunk['error']}"
                return
            if any(choice.get("text") for choice in chunk.get("choices") or ()):
                chunks_with_text += 1
                now = time.perf_counter()
                record.chunk_times.append(now)
                record.response_id = chunk.get("id", record.response_id)
                if record.first_token is None:
                    record.first_token = now
                else:
                    record.max_gap = max(record.max_gap, now - last)
                last = now
            usage = chunk.get("usage")
            if usage:
                record.output_tokens = int(usage["completion_tokens"])
                record.prompt_tokens = int(usage["prompt_tokens"])
                record.counted_from_usage = True
    record.end = time.perf_counter()
    if not record.counted_from_usage:
        record.output_tokens = chunks_with_text


async def run_rate(url: str, specs: list[RequestSpec], rate: float, seed: int,
                   request_timeout: float, run_timeout: float,
                   headers: dict | None = None) -> list[RequestRecord]:
    """Sends `specs` at Poisson arrivals of `rate` req/s; returns one record per spec, in order.
    Requests still running when `run_timeout` expires are cancelled and marked as errors."""
    offsets = poisson_offsets(len(specs), rate, seed)
    limits = httpx.Limits(max_connections=len(specs) + 1, max_keepalive_connections=len(specs) + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout), limits=limits,
                                 headers=headers) as client:
        t0 = time.perf_counter()

        async def delayed(spec: RequestSpec, offset: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            return await send_one(client, url, spec, request_timeout, time.perf_counter())

        tasks = [asyncio.create_task(delayed(s, o)) for s, o in zip(specs, offsets)]
        done, pending = await asyncio.wait(tasks, timeout=run_timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    records = []
    for task, offset in zip(tasks, offsets):
        if task in done:
            records.append(task.result())
        else:
            records.append(RequestRecord(start=t0 + offset, error=f"run timed out after {run_timeout:g} s"))
    return records


def _percentiles(values) -> dict[str, float | None]:
    if len(values) == 0:
        return {"p50": None, "p90": None, "p99": None}
    return {f"p{q}": float(np.percentile(values, q)) for q in (50, 90, 99)}


def summarise(records: list[RequestRecord], specs: list[RequestSpec] | None = None) -> dict:
    """Throughput, TTFT / TPOT percentiles and normalised latency over the finished requests
    (see the module docstring). `specs` adds how many requests got exactly the tokens asked for."""
    ok = [r for r in records if r.ok]
    out = {"num_requests": len(records), "num_finished": len(ok),
           "errors": sorted({r.error for r in records if r.error is not None})}
    if not ok:
        return dict(out, duration_s=None, requests_per_s=0.0, output_tok_per_s=0.0,
                    ttft_s=_percentiles([]), tpot_s=_percentiles([]),
                    normalised_latency_s=None, mean_latency_s=None, mean_output_tokens=None)
    span = max(r.end for r in ok) - min(r.start for r in ok)
    latency = np.array([r.end - r.start for r in ok])
    tokens = np.array([r.output_tokens for r in ok])
    ttft = [r.first_token - r.start for r in ok if r.first_token is not None]
    tpot = [(r.end - r.first_token) / (r.output_tokens - 1) for r in ok
            if r.first_token is not None and r.output_tokens > 1]
    out.update(
        duration_s=float(span),
        requests_per_s=len(ok) / span if span > 0 else float("inf"),
        output_tok_per_s=float(tokens.sum()) / span if span > 0 else float("inf"),
        ttft_s=_percentiles(ttft), tpot_s=_percentiles(tpot),
        normalised_latency_s=float(np.mean(latency / tokens)),
        mean_latency_s=float(latency.mean()), mean_output_tokens=float(tokens.mean()),
        mean_prompt_tokens=(float(np.mean([r.prompt_tokens for r in ok]))
                            if all(r.prompt_tokens is not None for r in ok) else None),
        tokens_from_usage=all(r.counted_from_usage for r in ok),
        max_token_gap_s=max(r.max_gap for r in ok),
    )
    if specs is not None:
        exact = sum(r.ok and r.output_tokens == s.output_len for r, s in zip(records, specs))
        out["share_exact_length"] = exact / len(records)
    return out
