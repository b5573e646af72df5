"""A soak of `paxpage serve`: many requests with random parameters, random arrivals, and about
--cancel-fraction of them cancelled at random moments (the client disconnects mid-stream, or
while waiting for a whole answer). Then checks that nothing leaked or drifted:
  - every KV page is free again (free pages == the pool) and no request is live;
  - /metrics adds up: requests received = finished + aborted + failed;
  - resident memory grows by at most --max-rss-mb-per-1000 MB per 1,000 requests: RSS and the
    compile count are read at each tenth of the load (nothing in flight), and a least-squares fit
    RSS = a + b * requests + c * compiles separates what the requests leave behind (b) from the
    compiles of the sampler for new combinations of request options (c; every step shape is
    compiled when the engine is built);
  - every finished greedy request (up to --recheck of them) gives the same tokens when sent
    again alone.
The server runs in this process (uvicorn on 127.0.0.1, an ephemeral port) so the engine's pool
can be inspected. Exit status 1 when a check fails; --out writes the figures (JSON).

    python scripts/soak.py --num-requests 5000 --out soak.json
    python scripts/soak.py --model /path/to/tiny --num-requests 200      # what CI runs
"""

from __future__ import annotations

import argparse
import asyncio
import random
import resource
import os
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from provenance import write_record  # noqa: E402

GREEDY_KEYS = ("prompt", "max_tokens", "temperature", "stop", "logprobs", "n", "presence_penalty",
               "frequency_penalty", "repetition_penalty", "seed", "guided_choice", "guided_json")


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def random_body(rng: random.Random, vocab: int, has_tokenizer: bool, max_tokens: int) -> dict:
    """One request's body: the sampling fields the API takes, drawn at random."""
    body = {"prompt": [rng.randrange(1, vocab) for _ in range(rng.randint(1, 40))],
            "max_tokens": rng.randint(1, max_tokens), "stream": rng.random() < 0.5}
    greedy = rng.random() < 0.5
    body["temperature"] = 0.0 if greedy else rng.choice([0.5, 0.8, 1.0, 1.3])
    if not greedy:
        body["seed"] = rng.randrange(1 << 20) if rng.random() < 0.7 else None
        body["top_p"] = rng.choice([None, 0.9, 0.5])
    if rng.random() < 0.3:
        body["n"] = rng.randint(2, 4)
    if rng.random() < 0.3:
        body["logprobs"] = rng.randint(0, 5)
    if rng.random() < 0.3:
        body["presence_penalty"] = rng.uniform(-1, 1)
        body["frequency_penalty"] = rng.uniform(-1, 1)
    if rng.random() < 0.2:
        body["repetition_penalty"] = rng.uniform(0.8, 1.3)
    if has_tokenizer and rng.random() < 0.3:
        body["stop"] = [rng.choice(["a", "e", " the", "\n", "1"]) for _ in range(rng.randint(1, 4))]
    if has_tokenizer and rng.random() < 0.15:
        if rng.random() < 0.5:
            body["guided_choice"] = ["yes", "no", "maybe"]
        else:
            body["guided_json"] = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    return {k: v for k, v in body.items() if v is not None}


class Outcome:
    def __init__(self):
        self.status: dict[str, int] = {}
        self.greedy_done: list[tuple[dict, list]] = []  # (body, choices' texts and token logprobs)
        self.errors: list[str] = []

    def count(self, key: str) -> None:
        self.status[key] = self.status.get(key, 0) + 1


def _answer(choices: list[dict]) -> list:
    return sorted((c["index"], c["text"], (c.get("logprobs") or {}).get("tokens")) for c in choices)


async def one_request(client, body: dict, cancel_after: float | None, outcome: Outcome) -> None:
    """cancel_after: seconds after which the client gives up (closes the connection)."""
    import httpx

    try:
        if body.get("stream"):
            async def read():
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        outcome.count(f"http {r.status_code}")
                        outcome.errors.append((await r.aread()).decode()[:300])
                        return
                    async for line in r.aiter_lines():
                        if line.startswith("data: {") and '"error"' in line:
                            outcome.errors.append(line[:300])
                    outcome.count("finished")
            await asyncio.wait_for(read(), cancel_after)
        else:
            async def call():
                return await client.post("/v1/completions", json=body)
            r = await asyncio.wait_for(call(), cancel_after)
            if r.status_code != 200:
                outcome.count(f"http {r.status_code}")
                outcome.errors.append(r.text[:300])
                return
            outcome.count("finished")
            if body["temperature"] == 0 and "guided_json" not in body:
                outcome.greedy_done.append((body, _answer(r.json()["choices"])))
    except asyncio.TimeoutError:
        outcome.count("cancelled")
    except httpx.HTTPError as e:
        outcome.count("client error")
        outcome.errors.append(repr(e))


async def load(base_url: str, args, vocab: int, has_tokenizer: bool, on_tenth) -> Outcome:
    import httpx

    rng = random.Random(args.seed)
    outcome = Outcome()
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        pending: set = set()
        tenth = max(1, args.num_requests // 10)
        for i in range(args.num_requests):
            if i and i % tenth == 0:  # a quiet point (nothing in flight) to read the memory at
                await asyncio.gather(*pending)
                pending.clear()
                on_tenth(i)
            if i % tenth == 0:
                print(f"  {i} requests sent: {outcome.status}", flush=True)
            body = random_body(rng, vocab, has_tokenizer, args.max_tokens)
            cancel_after = rng.uniform(0.0, args.cancel_window) if rng.random() < args.cancel_fraction else None
            pending.add(asyncio.ensure_future(one_request(client, body, cancel_after, outcome)))
            while len(pending) >= args.concurrency:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.sleep(rng.expovariate(rng.choice(args.rates)))  # a random arrival rate
        await asyncio.gather(*pending)
        # the same greedy requests again, each alone
        mismatches = []
        for body, answer in outcome.greedy_done[:args.recheck]:
            r = await client.post("/v1/completions", json={**body, "stream": False})
            again = _answer(r.json()["choices"]) if r.status_code == 200 else r.text
            if again != answer:
                mismatches.append({"body": body, "under_load": answer, "alone": again})
        outcome.mismatches = mismatches
    return outcome


def rss_growth(trace: list[tuple[int, float, int]]) -> tuple[float, float]:
    """(MB per 1,000 requests, MB per compile): the least-squares fit RSS = a + b * requests +
    c * compiles over the trace's points (requests sent, RSS MB, compiles so far). A leak grows
    with the requests; each compile of the sampler for a new combination of request options
    (which come early and taper off) adds its executable and the compiler's high-water mark."""
    import numpy as np

    sent, mb, compiles = (np.asarray(column, np.float64) for column in zip(*trace))
    if len(sent) < 2:
        return 0.0, 0.0
    columns = [np.ones_like(sent), sent] + ([compiles] if np.ptp(compiles) > 0 else [])
    fit, *_ = np.linalg.lstsq(np.stack(columns, axis=1), mb, rcond=None)
    return float(fit[1] * 1000), float(fit[2]) if len(fit) == 3 else 0.0


def start_server(app):
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


def wait_idle(engine, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        s = engine.stats()
        if s.num_running == 0 and s.num_waiting == 0 and engine._loop.idle:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"engine not idle after {timeout} s: {s}")
        time.sleep(0.05)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=16, help="most requests open at once")
    ap.add_argument("--rates", type=float, nargs="+", default=[5.0, 20.0, 100.0],
                    help="arrival rates (requests/s); each gap is drawn at one of them")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--cancel-fraction", type=float, default=0.3)
    ap.add_argument("--cancel-window", type=float, default=1.0, help="cancel at a random moment in [0, this] s")
    ap.add_argument("--recheck", type=int, default=50, help="finished greedy requests sent again alone")
    ap.add_argument("--max-rss-mb-per-1000", type=float, default=100.0)
    ap.add_argument("--num-pages", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512,
                    help="fewer: fewer step shapes to compile (a short run's RSS is mostly compiles)")
    ap.add_argument("--no-precompile", action="store_true",
                    help="compile step shapes on first use, not when the engine is built (then the RSS "
                         "measured still grows by the compiles that come later)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import paxpage
    from paxpage import compile_counter
    from paxpage.async_engine import AsyncEngine
    from paxpage.server import build_app

    compile_counter.install()
    model = paxpage.load(args.model)
    config = paxpage.EngineConfig(num_pages=args.num_pages, page_size=16, max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_model_len=min(model.config.max_position_embeddings, args.num_pages * 16),
                                  precompile=not args.no_precompile)
    engine = AsyncEngine(model, config, restart_on_error=True)
    server, thread, base_url = start_server(build_app(engine, served_model_name="soak"))
    trace = []  # (requests sent, RSS MB, compiles so far) at each tenth of the load and at the end

    def on_tenth(sent: int):
        trace.append((sent, rss_mb(), compile_counter.compiles()))

    t0 = time.monotonic()
    try:
        outcome = asyncio.run(load(base_url, args, model.config.vocab_size, model.tokenizer is not None,
                                   on_tenth))
        wait_idle(engine)
        trace.append((args.num_requests, rss_mb(), compile_counter.compiles()))
        seconds = time.monotonic() - t0
        s = engine.stats()
        pool = engine.engine.scheduler.page_manager
        growth, per_compile = rss_growth(trace)
        rss = {"from": trace[0][1], "end": trace[-1][1]}
        compiles = {"from": trace[0][2], "end": trace[-1][2]}
        checks = {
            "free pages == pool": pool.num_free_pages == engine.config.num_pages,
            "no live requests": s.num_running == s.num_waiting == 0 and len(engine.engine.outputs) == 0,
            "received == finished + aborted + failed":
                s.num_received == s.num_finished + s.num_aborted + s.num_failed,
            "no failed requests": s.num_failed == 0,
            f"RSS growth <= {args.max_rss_mb_per_1000:g} MB / 1000 requests": growth <= args.max_rss_mb_per_1000,
            "greedy requests equal alone": not outcome.mismatches,
            "no 5xx, no error events": not outcome.errors,
        }
        report = {"num_requests": args.num_requests, "seconds": seconds, "outcomes": outcome.status,
                  "engine": {"received": s.num_received, "finished": s.num_finished, "aborted": s.num_aborted,
                             "failed": s.num_failed, "free_pages": pool.num_free_pages,
                             "num_pages": engine.config.num_pages},
                  "rss_mb": rss, "rss_growth_mb_per_1000": growth, "compiles": compiles,
                  "rss_mb_per_compile": per_compile, "trace": trace,
                  "greedy_rechecked": min(args.recheck, len(outcome.greedy_done)),
                  "mismatches": outcome.mismatches[:3], "errors": outcome.errors[:5], "checks": checks,
                  "args": vars(args)}
    finally:
        server.should_exit = True
        thread.join(15)
        engine.shutdown()
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    print(f"{args.num_requests} requests in {seconds:.0f} s: {outcome.status}; engine {report['engine']}; "
          f"RSS {rss['from']:.0f} -> {rss['end']:.0f} MB from request {trace[0][0]} on, "
          f"{compiles['end'] - compiles['from']} compiles: {growth:.1f} MB / 1000 requests and "
          f"{per_compile:.1f} MB / compile")
    print("  requests sent / RSS MB / compiles: " + ", ".join(f"{n} / {m:.0f} / {c}" for n, m, c in trace))
    report["ok"] = all(checks.values())
    if args.out:
        write_record(args.out, report, tables=doc_tables(report), argv=["scripts/soak.py", *(argv or sys.argv[1:])])
    return report


def doc_tables(report: dict) -> dict:
    e, o = report["engine"], report["outcomes"]
    return {"soak": {"columns": ["requests sent", "finished", "cancelled by the client", "engine: received / "
                                 "finished / aborted / failed", "free pages / pool", "RSS after the first tenth -> end (MB)",
                                 "RSS growth per 1,000 requests (MB)", "MB per compile", "compiles after the first tenth",
                                 "greedy rechecked alone / equal", "seconds", "all checks"],
                     "rows": [[report["num_requests"], o.get("finished", 0), o.get("cancelled", 0),
                               f"{e['received']} / {e['finished']} / {e['aborted']} / {e['failed']}",
                               f"{e['free_pages']} / {e['num_pages']}",
                               f"{report['rss_mb']['from']:.0f} -> {report['rss_mb']['end']:.0f}",
                               round(report["rss_growth_mb_per_1000"], 1), round(report["rss_mb_per_compile"], 1),
                               report["compiles"]["end"] - report["compiles"]["from"],
                               f"{report['greedy_rechecked']} / "
                               f"{report['greedy_rechecked'] - len(report['mismatches'])}",
                               round(report["seconds"]), "pass" if report["ok"] else "FAIL"]]}}


if __name__ == "__main__":
    raise SystemExit(0 if main()["ok"] else 1)
