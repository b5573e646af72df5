"""One steady decode step, measured: host / device / wall ms per step, attention share and GB/s.

Each case fills an `LLMEngine` with `rows` requests of `context` random prompt tokens (EOS
ignored), steps it until every request is decoding, runs --warmup decode steps (compiles),
then --steps measured ones (default 16, the page size: every row then crosses one page boundary,
where it allocates a page, in the window, however the rows are aligned). From `engine.stats` (deltas over the measured steps):
    host    scheduling + packing + stop checks + detokenisation, ms per step
    device  the jitted step incl. fetching the sampled tokens, ms per step
    wall    perf_counter around the measured `step()` calls, ms per step
    busy    the device's own time per step: `steps` more steps with each device call (step,
            sampler, ...) timed to its completion (ModelRunner.time_device_calls): each call's
            median times its calls per step, summed. On CPU the "device" wait above also holds dispatch and the host's share of the cores;
            a sampled case is compared with its greedy twin on this figure, and wall per step
            with max(host CPU, busy): 1.0 when the host's work hides entirely behind the device's
    host CPU  CPU time of the engine's thread over the measured steps, ms per step: the host
            work (with jax's dispatch and fetches) without the time other processes or the
            device's own threads took the cores from it, so it stays comparable on a loaded machine
    overlap (host + busy - wall) / min(host, busy), clipped to 0..1: the share of the shorter of
            the two that ran under the other (0 = serial, 1 = fully hidden). Busy comes from other
            steps than wall, so on a loaded machine it is a rough figure

Attention is timed alone, not inside the engine: one jitted call that does, for every layer,
the engine's KV write of `rows` tokens and its paged attention over `rows` x `context` keys,
on a pool of the engine's shape with a permuted page table (pages scattered as after many
allocations). Its share is that time over the engine's device busy ms per step, and its GB/s is
the K/V bytes it must read (2 x layers x rows x context x kv_heads x head_dim x itemsize)
over that time, set against this machine's read bandwidth (the best of a jitted sum and max over 512 MiB).

Requests are added as generate() adds them (stream=False: no per-step StreamDelta, vLLM's
FINAL_ONLY); a "-stream" case adds them as a streaming client does (one delta per request per step).

Cases off the steady state (the rest add every request at once with one max_tokens, prefix caching
on): "-nocache" turns prefix caching off; "-spread" gives prompts of different lengths and half the
rows a max_tokens that ends inside the measured window (the batch shrinks while it is measured);
"-arrivalsK" adds a request of `context` prompt tokens before every K-th measured step (that step
carries its prefill chunk beside the decodes); "-n2" samples two completions per request, rows / 2
requests; "-logprobs5" reports 5 top alternatives per token; "-stop" has a stop string that never
matches, so every row is detokenised (the tiny model with SmolLM2's tokenizer, same vocabulary);
"-regex1" has one row whose output follows a regex (structured outputs: its bitmask every step).
For every case the output also holds each measured step's host CPU and its max (the target is
every step's, not the mean), how many of the measured steps took the steady decode step
(engine.stats.decode_batch_steps over engine.stats.steps), the running rows as each step starts,
and with arrivals the mean and max host CPU of the steps with and without an arrival's prefill.
An arriving request is added between steps, outside the timed step.

Models: "tiny" is a random 2-layer Llama (hidden 64, 4 heads, 4 kv heads of 16, vocab
49152) written with transformers' LlamaConfig + save_pretrained to a temp dir, so the model's
matmuls are negligible next to attention, sampling and host work; "smollm2" is
`paxpage.load()`'s SmolLM2-135M-Instruct.

--interleave fills every case's engine first and then steps them in turns, one step each per
round, so a loaded machine's noise falls on all cases alike; compare cases on host CPU and device
busy there. With --rounds R it takes R windows of --steps steps each and reports every
window's host CPU ratios as well as the totals.

Context: cases that differ only in their context (tiny-256x128, tiny-256x1536) print their host
CPU per step side by side, the longer context's over the shorter's. Host work per step does not
depend on the context (the steady step touches O(1) data per row), but run alone, the longer
context's engine has the device's threads stream ~400 MB of K/V per step through both cores'
caches while the host works, and the host's cache misses cost more under that load (every phase
of its step is slower, none grows with the context). Side by side (--interleave) both run under
the same mix of the two devices' loads, which measures the host's own work. Its device wait and wall figures are not a lone engine's: each engine's step stays in
flight through the other engines' turns (a case beside a slow synchronous one, such as the
penalised case, looks almost free), so take wall and wall / max(host CPU, busy) from a run
without it. A sampled case also reports its device busy time over the greedy case of the same
model and shape (either way).

Usage:
    python scripts/bench_step.py --json /tmp/step.json           # the whole table (minutes)
    python scripts/bench_step.py --interleave --steps 10 --cases tiny-256x1536 tiny-256x1536-t0.7-p0.9
    python scripts/bench_step.py --cases tiny-256x1536 smollm2-64x65
    python scripts/bench_step.py --quick                          # CI smoke: tiny shapes
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import paxpage  # noqa: E402
from paxpage import attention_impl  # noqa: E402
# Case, case_label and context_ratios unused here: the script is where its cases, labels and
# pairings are looked up
from step_report import (case_label, compare_contexts, compare_to_greedy, context_ratios,  # noqa: E402,F401
                         doc_tables, print_case, print_tables)
from step_workload import CASES, QUICK_CASES, Case, overlap, run_case, run_interleaved, tiny_model  # noqa: E402,F401
from timing import median_seconds  # noqa: E402


def read_bandwidth(num_bytes: int = 512 << 20, iters: int = 10) -> float:
    """GB/s of a jitted sum and a jitted max over a large f32 array (well past any cache): the
    best of `iters` calls of each. The first calls run far slower (34 -> 70 GB/s over six calls
    on the 2-core EPYC), and in some processes XLA's library reduction runs the sum on one thread
    (~35 GB/s throughout), so a median, or the sum alone, under-reports the machine and flatters
    every ratio to it."""
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    seconds = []
    for reduce in (jnp.sum, jnp.max):
        fn = jax.jit(reduce)
        jax.block_until_ready(fn(x))
        for _ in range(iters):
            t = time.perf_counter()
            jax.block_until_ready(fn(x))
            seconds.append(time.perf_counter() - t)
    return num_bytes / min(seconds) / 1e9


def time_attention(model: paxpage.Model, cfg: paxpage.EngineConfig, rows: int, context: int,
                   iters: int) -> dict:
    """Seconds of every layer's KV write + decode attention for rows x context, and GB/s."""
    resolved = cfg.resolve(model.config)
    mc = model.config
    attention, write_kv = attention_impl.functions(attention_impl.resolve(resolved.attention_impl))
    dtype = jnp.dtype(resolved.dtype)
    page_size, pages_per_seq = resolved.page_size, resolved.pages_per_seq
    pages_per_row = -(-context // page_size)
    num_pages = max(resolved.num_pages or 0, rows * pages_per_row + 1)  # None: sized on GPU / TPU
    rng = np.random.default_rng(0)
    table = np.zeros((rows, pages_per_seq), np.int32)
    table[:, :pages_per_row] = rng.permutation(num_pages)[:rows * pages_per_row].reshape(rows, -1)
    kv_lens = np.full(rows, context, np.int32)
    last = context - 1
    slots = table[:, last // page_size] * page_size + last % page_size
    shape = (2, num_pages, page_size, mc.num_kv_heads, mc.head_dim)
    pools = [jnp.asarray(rng.standard_normal(shape, np.float32), dtype) for _ in range(mc.num_layers)]
    q = jnp.asarray(rng.standard_normal((rows, 1, mc.num_heads, mc.head_dim), np.float32), dtype)
    k = jnp.asarray(rng.standard_normal((rows, mc.num_kv_heads, mc.head_dim), np.float32), dtype)
    args = [jnp.asarray(a) for a in (table, kv_lens, np.ones(rows, np.int32), slots)]

    def layers(pools, q, k, table, kv_lens, q_lens, slots):
        out = []
        for pool in pools:  # the model's order: write this step's K/V, then attend
            pool = write_kv(pool, k, k, slots)
            q = attention(q, pool, table, kv_lens, q_lens, sm_scale=mc.head_dim ** -0.5)
            out.append(pool)
        return out, q

    step = jax.jit(layers, donate_argnums=(0,))
    state = {"pools": pools}

    def call():
        state["pools"], out = step(state["pools"], q, k, *args)
        jax.block_until_ready(out)

    seconds = median_seconds(call, iters)
    kv_bytes = 2 * mc.num_layers * rows * context * mc.num_kv_heads * mc.head_dim * dtype.itemsize
    return {"seconds": seconds, "kv_bytes": kv_bytes, "gb_per_s": kv_bytes / seconds / 1e9}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", metavar="KEY",
                        help="subset of: " + ", ".join(c.key for c in CASES))
    parser.add_argument("--quick", action="store_true", help="tiny shapes only (CI smoke test)")
    parser.add_argument("--steps", type=int, default=None,
                        help="measured decode steps (default 16, the page size: each row then crosses one page "
                             "boundary in the window, whatever its alignment; quick 2)")
    parser.add_argument("--warmup", type=int, default=2, help="decode steps before measuring")
    parser.add_argument("--attention-iters", type=int, default=None, help="timed attention calls")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--interleave", action="store_true",
                        help="fill every case's engine first, then take their measured steps in turns "
                             "(side by side under the same load: compare host CPU and busy; wall and "
                             "device wait are not a lone engine's; needs all engines' pools in memory)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="with --interleave: measured windows of --steps steps each (host CPU per window)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if args.rounds < 1 or (args.rounds > 1 and not args.interleave):
        parser.error(f"--rounds {args.rounds}: needs --interleave and at least 1")
    cases = QUICK_CASES if args.quick else CASES
    if args.cases:
        known = {c.key: c for c in CASES + QUICK_CASES}
        unknown = [k for k in args.cases if k not in known]
        if unknown:
            parser.error(f"unknown case(s) {unknown}; expected some of {sorted(known)}")
        cases = [known[k] for k in args.cases]
    steps = args.steps or (2 if args.quick else 16)
    iters = args.attention_iters or (2 if args.quick else 5)

    bandwidth = read_bandwidth(64 << 20 if args.quick else 512 << 20)
    print(f"jax {jax.__version__} on {jax.default_backend()}: read bandwidth {bandwidth:.1f} GB/s "
          "(jitted sum / max)", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        models = {}
        for case in cases:
            if case.model not in models:
                models[case.model] = tiny_model(tmp) if case.model == "tiny" else paxpage.load()
        if args.interleave:
            measured = run_interleaved(models, cases, steps, args.warmup, args.seed, args.rounds)
        for i, case in enumerate(cases):
            model = models[case.model]
            r = measured[i] if args.interleave else run_case(model, case, steps, args.warmup, args.seed)
            att = time_attention(model, r.pop("cfg"), case.rows, case.context, iters)
            r["overlap"] = overlap(r["host_s"], r["busy_s"], r["wall_s"])
            row = {"case": case.key, **dataclasses.asdict(case), **r,
                   "attention_s": att["seconds"], "attention_share": att["seconds"] / r["busy_s"],
                   "attention_kv_bytes": att["kv_bytes"], "attention_gb_per_s": att["gb_per_s"],
                   "attention_vs_bandwidth": att["gb_per_s"] / bandwidth}
            results.append(row)
            print_case(case, row, att)
    compare_to_greedy(results)
    compare_contexts(results, args.interleave)

    for row in results:
        row["wall_vs_bound"] = row["wall_s"] / max(row["host_cpu_s"], row["busy_s"])
    data = {"backend": jax.default_backend(), "read_bandwidth_gb_per_s": bandwidth, "steps": steps, "cases": results}
    print_tables(data)
    if args.json:
        from provenance import write_record  # the figures with machine, versions, date, command, commit

        write_record(args.json, data, doc_tables(data))
    return 0


if __name__ == "__main__":
    from paxpage.process_tuning import tune_malloc

    tune_malloc()  # glibc keeps large freed buffers for reuse (paxpage/process_tuning.py)
    sys.exit(main())
