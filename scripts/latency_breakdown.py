"""Where a streamed token's time goes in paxpage's server: one request alone, then Poisson load.

    python scripts/latency_breakdown.py --json docs/benchmarks/latency_breakdown.json
    python scripts/latency_breakdown.py --rates single,1,4,8 --num-requests 16 --no-profile

The server runs with timing hooks (scripts/latency_trace.py: wrapped engine methods, no code
changes) and the load generator of bench_serving (scripts/serving_load.py) records when each
SSE chunk arrives; both use CLOCK_MONOTONIC, so every token is followed from the engine step
that produced it to the client. Requests: streamed `/v1/completions`, ShareGPT-like lengths,
random-word prompts, EOS ignored (forced lengths), greedy. `single` sends them one at a time.
Each rate runs once unmeasured first (compiles of new step shapes stay out of the figures).

Per rate, averaged over every output token after each request's first:
  engine   the time between two of a request's tokens leaving the engine loop, split into the
           engine loop's phases of the steps in between (latency_trace.py names them:
           schedule, pack, dispatch, device_wait, detokenise, outputs, engine_other, loop_send)
           plus loop_between_steps (the loop's own bookkeeping and the wait for new work)
  delivery each token's way out after the engine handed it over:
           handoff  engine thread -> the asyncio event loop's stream (call_soon_threadsafe, GIL)
           sse      stream -> formatted SSE event (the route, the merged stream)
           http     event -> the client read it (uvicorn, the socket, the client's parsing)
  ttft     the first token: http_in (request to the engine loop: parsing, tokenising, submit),
           to_next_step (added -> the next engine step begins: the step running when it came),
           steps_to_first_token (that step's begin -> its first token out of the engine: the
           steps it queued behind, its prompt's steps, and the step its token is read in),
           delivery; and for the slowest tenth of first tokens, the same split one by one
and the steps' batches: real and padded decode rows.

Then (unless --no-profile) the device step itself, timed alone at the padded decode batch each
rate ran most (step_profile.profile_decode_step) plus the LM head's matmul alone: layers
(matmuls and the rest), attention with the KV write, LM head, sampling, host packing.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import contextlib
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import serving_load as load  # noqa: E402
import serving_servers as srv  # noqa: E402
import workload as wl  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ENGINE_PHASES = ("schedule", "pack", "dispatch", "device_wait", "detokenise", "outputs", "engine_other",
                 "loop_send", "loop_between_steps")
DELIVERY = ("handoff", "sse", "http")


# ---------------------------------------------------------------------------------------- analysis
def breakdown(records: list, trace: dict) -> dict:
    """Per-token shares of a rate run from the client's records and the server's trace."""
    steps = sorted(trace["steps"], key=lambda s: s["begin"])
    begins = [s["begin"] for s in steps]
    engine = collections.defaultdict(float)
    delivery = collections.defaultdict(float)
    ttft = collections.defaultdict(float)
    itl_client, itl_engine = [], []
    firsts = []  # per request: (TTFT at the client, engine steps from its add to its first token, parts)
    num_tokens = num_firsts = num_requests = mismatched = 0
    step_ids = set()
    for r in records:
        if not r.ok or r.response_id is None:
            continue
        rid = f"{r.response_id}-0"
        sends, yields = trace["sends"].get(rid, []), trace["yields"].get(rid, [])
        events, client = trace["events"].get(r.response_id, []), r.chunk_times
        n = min(len(sends), len(yields), len(events), len(client))
        if n == 0 or rid not in trace["adds"]:
            mismatched += 1
            continue
        mismatched += len({len(sends), len(yields), len(events), len(client)}) > 1
        num_requests += 1
        for k in range(n):
            delivery["handoff"] += yields[k] - sends[k]
            delivery["sse"] += events[k] - yields[k]
            delivery["http"] += client[k] - events[k]
        added = trace["adds"][rid]
        first_step = bisect.bisect_left(begins, added)  # the first step that began after the add
        first_owner = bisect.bisect_right(begins, sends[0]) - 1  # the step its first token left in
        to_step = (begins[first_step] if first_step < len(begins) else sends[0]) - added
        parts = {"http_in": added - r.start, "to_next_step": to_step,
                 "steps_to_first_token": sends[0] - added - to_step, "delivery": client[0] - sends[0]}
        for name, seconds in parts.items():
            ttft[name] += seconds
        firsts.append((client[0] - r.start, max(0, first_owner - first_step + 1), parts))
        num_firsts += 1
        # the step each token left the engine in: the last one that began before its send
        owner = [bisect.bisect_right(begins, t) - 1 for t in sends[:n]]
        for k in range(1, n):
            itl_client.append(client[k] - client[k - 1])
            itl_engine.append(sends[k] - sends[k - 1])
            num_tokens += 1
            for j in range(owner[k - 1] + 1, owner[k] + 1):
                step_ids.add(j)
                for name, seconds in steps[j]["phases"].items():
                    engine[name] += seconds
                if j > 0:
                    engine["loop_between_steps"] += steps[j]["begin"] - steps[j - 1]["end"]
    batches = [steps[j]["batch"] for j in sorted(step_ids) if steps[j]["batch"]]
    rows = collections.Counter(b["decode_row_slots"] for b in batches if b["decode_row_slots"])

    def per(d, n):
        return {k: d.get(k, 0.0) / max(1, n) for k in d}

    return {
        "num_requests": num_requests, "num_tokens": num_tokens, "mismatched_requests": mismatched,
        "itl_client_s": float(np.mean(itl_client)) if itl_client else None,
        "itl_engine_s": float(np.mean(itl_engine)) if itl_engine else None,
        "engine_s_per_token": {k: per(engine, num_tokens).get(k, 0.0) for k in ENGINE_PHASES},
        "delivery_s_per_token": {k: per(delivery, num_tokens + num_firsts).get(k, 0.0) for k in DELIVERY},
        "ttft_s": per(ttft, num_firsts),
        "ttft_steps_mean": float(np.mean([n for _, n, _ in firsts])) if firsts else None,
        # the slowest tenth of first tokens, each split as ttft_s is: where a TTFT tail comes from
        "ttft_tail": [{"ttft_s": t, "steps": n, **p} for t, n, p in
                      sorted(firsts, key=lambda f: -f[0])[:max(1, len(firsts) // 10)]],
        "steps": len(step_ids),
        "compiles": len(trace.get("compiles", ())),
        "compile_s": float(sum(c[1] for c in trace.get("compiles", ()))),
        "decode_rows_real_mean": float(np.mean([b["decode_rows"] for b in batches])) if batches else None,
        "decode_rows_padded_mean": float(np.mean([b["decode_row_slots"] for b in batches])) if batches else None,
        "token_slots_real_share": (sum(b["tokens"] for b in batches) / max(1, sum(b["token_slots"] for b in batches))),
        "padded_decode_rows_histogram": dict(sorted(rows.items())),
    }


def window(trace: dict, begin: float, end: float) -> dict:
    """The trace's steps that began in [begin, end] and its compiles that ended then (other
    entries are keyed by request)."""
    return dict(trace, steps=[s for s in trace["steps"] if begin <= s["begin"] <= end],
                compiles=[c for c in trace.get("compiles", ()) if begin <= c[0] <= end])


# ---------------------------------------------------------------------------------------- device profile
def profile_device(model_path: str | None, rows_list: list[int], context: int, max_model_len: int,
                   iters: int) -> dict:
    """The decode step alone at each padded row count: bench_throughput's profile plus the LM head."""
    import jax
    import jax.numpy as jnp

    import paxpage
    from step_profile import profile_decode_step
    from timing import median_seconds

    model = paxpage.load(model_path)
    out = {}
    for rows in rows_list:
        pages = -(-(context + 1) // 16)
        cfg = paxpage.EngineConfig(max_num_seqs=rows, max_model_len=max_model_len, page_size=16,
                                   num_pages=max(64, rows * pages + 8))
        p = profile_decode_step(model, cfg, context, iters)
        hidden, vocab = model.config.hidden_size, model.config.vocab_size
        x = jnp.ones((rows, hidden), jnp.float32)
        w = jnp.ones((hidden, vocab), jnp.float32) * 0.01
        head = jax.jit(lambda a, b: a @ b)
        lm_head = median_seconds(lambda: jax.block_until_ready(head(x, w)), iters)
        t = p["seconds"]
        parts = {
            "layers_matmuls_and_rest": max(0.0, t["step_without_attention"] - t["sampler"] - lm_head),
            "attention_and_kv_write": max(0.0, t["step"] - t["step_without_attention"]),
            "lm_head": lm_head, "sampling": t["sampler"], "host_packing": t["host_pack"],
        }
        out[str(rows)] = {"context": p["context"], "step_s": t["step"], "parts_s": parts}
        print(f"  device step, {rows} rows padded, context {p['context']}: {t['step'] * 1e3:.1f} ms = "
              + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in parts.items()) + " ms", flush=True)
    return out


# ---------------------------------------------------------------------------------------- driver
def run_rate(url: str, specs: list, rate: str, seed: int, timeout: float) -> list:
    if rate == "single":  # one at a time: each request alone in the engine
        records = []
        for spec in specs:
            records += asyncio.run(load.run_rate(url, [spec], float("inf"), seed, timeout, timeout))
        return records
    return asyncio.run(load.run_rate(url, specs, float(rate), seed, timeout, 10 * timeout))


def print_rate(rate: str, b: dict, summary: dict) -> None:
    ms = lambda x: "-" if x is None else f"{x * 1e3:.1f}"  # noqa: E731
    print(f"rate {rate}: {b['num_requests']} requests, {b['num_tokens']} tokens, {b['steps']} steps; client ITL "
          f"{ms(b['itl_client_s'])} ms, engine ITL {ms(b['itl_engine_s'])} ms; TPOT p50 "
          f"{ms(summary['tpot_s']['p50'])} ms, TTFT p50/p99 {ms(summary['ttft_s']['p50'])}/"
          f"{ms(summary['ttft_s']['p99'])} ms; decode rows {b['decode_rows_real_mean'] or 0:.1f} real in "
          f"{b['decode_rows_padded_mean'] or 0:.1f} padded; {b['compiles']} compiles ({b['compile_s']:.1f} s)",
          flush=True)
    print("  engine per token: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in b["engine_s_per_token"].items())
          + " ms", flush=True)
    print("  delivery per token: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in b["delivery_s_per_token"].items())
          + " ms; TTFT: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in b["ttft_s"].items()) + " ms", flush=True)
    print(f"  TTFT: {b['ttft_steps_mean'] or 0:.1f} engine steps from the add to the first token on average; "
          "slowest tenth: " + "; ".join(
              f"{t['ttft_s'] * 1e3:.0f} ms = " + ", ".join(f"{k} {t[k] * 1e3:.0f}" for k in b["ttft_s"])
              + f" ({t['steps']} steps)" for t in b["ttft_tail"]), flush=True)


def doc_tables(data: dict) -> dict:
    results = data["results"]
    # compiles met while measuring: counted by the script since it was first recorded
    counted = all("compiles" in r["breakdown"] for r in results.values())
    cols = ["rate", "client ITL ms", *ENGINE_PHASES, *DELIVERY, "decode rows real / padded"] + ["compiles"] * counted
    rows = []
    for rate in data.get("rates", list(results)):  # the run's order (a JSON file's keys may be sorted)
        b = results[rate]["breakdown"]
        rows.append([rate, round((b["itl_client_s"] or 0) * 1e3, 1),
                     *[round(b["engine_s_per_token"][k] * 1e3, 2) for k in ENGINE_PHASES],
                     *[round(b["delivery_s_per_token"][k] * 1e3, 2) for k in DELIVERY],
                     f"{b['decode_rows_real_mean'] or 0:.1f} / {b['decode_rows_padded_mean'] or 0:.1f}"]
                    + ([b["compiles"]] if counted else []))
    caption = ("Per output token, ms: the engine loop's phases between two of a request's tokens, then the "
               "delivery of each token (engine thread to event loop, SSE, HTTP); streamed /v1/completions, "
               "EOS ignored, one request at a time (single) or Poisson arrivals at each rate (req/s)")
    return {"latency_breakdown": {"columns": cols, "rows": rows, "caption": caption}}


def main(argv=None) -> int:
    from bench_serving import load_tokenizer, request_body, text_prompts, word_vocab

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="GGUF or HF dir (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--rates", default="single,1,4,8", help="'single' (one request at a time) and req/s")
    parser.add_argument("--num-requests", type=int, default=16, help="per rate")
    parser.add_argument("--prompt-range", type=int, nargs=2, default=(16, 128))
    parser.add_argument("--output-range", type=int, nargs=2, default=(16, 128))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--paxpage-args", default="", help="extra `paxpage serve` arguments (one string)")
    parser.add_argument("--no-warmup", action="store_true", help="skip the unmeasured pass at each rate")
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--no-profile", action="store_true", help="skip the device-step profile")
    parser.add_argument("--profile-iters", type=int, default=5)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    rates = [r for r in args.rates.split(",") if r]
    for r in rates:
        if r != "single" and not (r.replace(".", "", 1).isdigit() and float(r) > 0):
            parser.error(f"--rates: {r!r} is neither 'single' nor a rate > 0")

    from models.loading import default_model_path

    source = args.model or default_model_path()
    tokenizer = load_tokenizer(source)
    words = word_vocab(tokenizer)
    lengths = wl.sharegpt_lengths(args.num_requests, args.seed, tuple(args.prompt_range), tuple(args.output_range))
    max_model_len = 1 << (max(p + o for p, o in lengths) - 1).bit_length()

    def specs(seed):
        texts, _ = text_prompts(tokenizer, words, [p for p, _ in lengths], seed)
        return [load.RequestSpec(request_body("paxpage", "forced", "smollm2", t, o), o)
                for t, (_, o) in zip(texts, lengths)]

    results = {}
    with contextlib.ExitStack() as stack:
        trace_path = os.path.join(stack.enter_context(tempfile.TemporaryDirectory(prefix="latency_")), "trace.json")
        port = srv.free_port()
        serve = srv.paxpage_command(source, port, "smollm2", ["--max-model-len", str(max_model_len),
                                                             *args.paxpage_args.split()])
        command = [sys.executable, os.path.join(HERE, "latency_trace.py"), trace_path, *serve[3:]]
        print(f"starting paxpage with timing hooks: {' '.join(command)}", flush=True)
        server = srv.ServerProcess("paxpage", command, port, args.startup_timeout)
        stack.enter_context(server)
        url = f"{server.base_url}/v1/completions"
        windows = {}
        for i, rate in enumerate(rates):
            if not args.no_warmup:
                run_rate(url, specs(args.seed + 7919 * (2 * i + 1)), rate, args.seed + i, args.request_timeout)
            t0 = time.perf_counter()
            work = specs(args.seed + 7919 * (2 * i + 2))
            records = run_rate(url, work, rate, args.seed + 100 + i, args.request_timeout)
            windows[rate] = (t0, time.perf_counter(), records, load.summarise(records, work))
            errors = sorted({str(r.error) for r in records if r.error})
            print(f"rate {rate}: {windows[rate][3]['num_finished']} requests finished in "
                  f"{windows[rate][1] - t0:.1f} s" + (f"; errors: {errors[:3]}" if errors else ""), flush=True)
        server.stop()
        with open(trace_path) as f:
            trace = json.load(f)
    for rate, (t0, t1, records, summary) in windows.items():
        b = breakdown(records, window(trace, t0, t1))
        print_rate(rate, b, summary)
        summary = {k: summary.get(k) for k in ("num_finished", "requests_per_s", "output_tok_per_s", "ttft_s",
                                           "tpot_s", "normalised_latency_s", "max_token_gap_s")}
        results[rate] = {"breakdown": b, "summary": summary}

    profile = None
    if not args.no_profile:
        hist = collections.Counter()
        for r in results.values():
            hist.update({int(k): v for k, v in r["breakdown"]["padded_decode_rows_histogram"].items()})
        rows = sorted(k for k, _ in hist.most_common(3)) or [4]  # the padded batches met most
        context = int(np.mean([p for p, _ in lengths]) + np.mean([o for _, o in lengths]) / 2)
        print("device step alone (noisy shared machine):", flush=True)
        profile = profile_device(args.model, rows, context, max_model_len, args.profile_iters)
    if args.json:
        data = {"model": args.model or "SmolLM2-135M-Instruct", "rates": rates, "lengths": lengths,
                "results": results, "device_profile": profile}
        wl.write_json(args.json, data, tables=doc_tables(data))
    return 0


if __name__ == "__main__":
    from paxpage.process_tuning import tune_malloc

    tune_malloc()
    sys.exit(main())
