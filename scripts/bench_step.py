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
matches, so every row is detokenised (the tiny model with SmolLM2's tokenizer, same vocabulary).
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
import gc
import json
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
from paxpage import attention_impl, compile_counter  # noqa: E402
from timing import median_seconds  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Case:
    key: str
    model: str  # "tiny" | "smollm2"
    rows: int  # running sequences
    context: int  # prompt tokens per sequence (the decode context at measurement)
    temperature: float = 0.0
    top_p: float = 1.0
    repetition_penalty: float = 1.0  # != 1: penalised rows (penalty tensors each step, general step)
    # Prefill tokens per step while filling the engine (the decode step does not depend on it).
    prefill_tokens: int = 8192
    # False: requests as generate() adds them (no per-step deltas, vLLM's FINAL_ONLY); True: as a
    # streaming client's (a StreamDelta per request per step)
    stream: bool = False
    # The cases below leave the steady state the rest measure (all rows added at once, one max_tokens):
    prefix_caching: bool = True  # False: EngineConfig(enable_prefix_caching=False)
    # > 0: prompts of context - prompt_spread .. context tokens (rows at different positions, crossing
    # page boundaries in different steps)
    prompt_spread: int = 0
    # > 0: this share of the rows reaches its max_tokens inside the measured window, at steps spread
    # over it (the batch shrinks while it is measured)
    ending: float = 0.0
    # > 0: a request of `context` prompt tokens arrives before every this-many-th measured step, so
    # that step carries its prefill chunk beside the decodes (max_num_seqs leaves room for them)
    arrivals_every: int = 0
    n: int = 1  # parallel samples per request: rows // n requests
    logprobs: int | None = None  # top alternatives reported per generated token
    # stop strings; the engine then detokenises every row (SmolLM2's tokenizer on the tiny model)
    stop: tuple[str, ...] = ()

    @property
    def steady(self) -> bool:
        """Every row added at once with one max_tokens, prefix caching on, no per-row extras."""
        return (self.prefix_caching, self.prompt_spread, self.ending, self.arrivals_every, self.n, self.logprobs,
                self.stop) == (True, 0, 0.0, 0, 1, None, ())


CASES = [
    Case("tiny-32x128", "tiny", 32, 128),
    Case("tiny-256x128", "tiny", 256, 128),
    Case("tiny-256x1536", "tiny", 256, 1536),
    Case("tiny-256x1536-t0.7", "tiny", 256, 1536, temperature=0.7),
    Case("tiny-256x1536-t0.7-p0.9", "tiny", 256, 1536, temperature=0.7, top_p=0.9),
    Case("tiny-256x1536-t0.7-rep1.1", "tiny", 256, 1536, temperature=0.7, repetition_penalty=1.1),
    Case("tiny-256x1536-t0.7-p0.9-stream", "tiny", 256, 1536, temperature=0.7, top_p=0.9, stream=True),
    Case("smollm2-64x65", "smollm2", 64, 65, prefill_tokens=2048),
    Case("smollm2-256x65", "smollm2", 256, 65, prefill_tokens=2048),
    Case("tiny-256x128-nocache", "tiny", 256, 128, prefix_caching=False),
    Case("tiny-256x1536-nocache", "tiny", 256, 1536, prefix_caching=False),
    Case("tiny-256x1536-spread", "tiny", 256, 1536, prompt_spread=768, ending=0.5),
    Case("tiny-256x1536-arrivals4", "tiny", 256, 1536, arrivals_every=4),
    Case("tiny-256x1536-t0.7-n2", "tiny", 256, 1536, temperature=0.7, n=2),
    Case("tiny-256x1536-logprobs5", "tiny", 256, 1536, logprobs=5),
    Case("tiny-256x1536-stop", "tiny", 256, 1536, stop=("xyz",)),
]
QUICK_CASES = [
    Case("tiny-8x32", "tiny", 8, 32, prefill_tokens=256),
    Case("tiny-8x32-t0.7-p0.9", "tiny", 8, 32, temperature=0.7, top_p=0.9, prefill_tokens=256),
    Case("tiny-8x32-mixed", "tiny", 8, 32, temperature=0.7, prefill_tokens=256, prefix_caching=False,
         prompt_spread=8, ending=0.5, arrivals_every=1, n=2, logprobs=2, stop=("xyz",)),
]
TINY_CONFIG = dict(vocab_size=49152, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, intermediate_size=128, max_position_embeddings=2048,
                   tie_word_embeddings=False)


def tiny_model(tmp: str) -> paxpage.Model:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**TINY_CONFIG)).save_pretrained(tmp)
    return paxpage.load(tmp)



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


_STOP_TOKENIZER = []  # SmolLM2's tokenizer, read once: the tiny model's vocabulary is SmolLM2's


def stop_tokenizer(model: paxpage.Model):
    """The tokenizer a stop-string case detokenises with: the model's, or (the tiny model has none)
    the one in SmolLM2-135M-Instruct's GGUF, whose 49,152 tokens are the tiny model's vocabulary."""
    if model.tokenizer is not None:
        return model.tokenizer
    if not _STOP_TOKENIZER:
        from models.loading import default_model_path
        from models.tokenizer import gguf_tokenizer

        _STOP_TOKENIZER.append(gguf_tokenizer(default_model_path()))
    return _STOP_TOKENIZER[0]


def prefill_steps(prompt_lens: list[int], rows_per_request: int, budget: int) -> list[int]:
    """The fill step (0-based) in which each prompt's last chunk is prefilled, roughly as the
    scheduler takes them: in order, `budget` tokens per step less one per decoding row."""
    ends, step, done = [], 0, 0  # done: tokens of prompt len(ends) already prefilled
    while len(ends) < len(prompt_lens):
        left = budget - rows_per_request * len(ends)
        while left > 0 and len(ends) < len(prompt_lens):
            take = min(left, prompt_lens[len(ends)] - done)
            left, done = left - take, done + take
            if done == prompt_lens[len(ends)]:
                ends.append(step)
                done = 0
        step += 1
    return ends


def fill_case(model: paxpage.Model, case: Case, steps: int, warmup: int, seed: int, window: int | None = None,
              before_window: int = 0):
    """An engine with case.rows decoding sequences, after `warmup` decode steps (compiles), with
    tokens left for `steps` more. `window`: the measured steps among them (default all), after
    `before_window` unmeasured ones; a case's ending rows finish inside it.
    -> (engine, cfg, fill steps, fill seconds, arrive: adds one arriving request)."""
    window = steps if window is None else window
    page_size = 16
    tokens_per_row = case.context + warmup + steps + 4
    # Prefill finishes for different requests in different steps: room for that spread too.
    spread = -(-case.rows * case.context // case.prefill_tokens) + 2
    pages_per_row = -(-(tokens_per_row + spread) // page_size)
    num_arrivals = -(-steps // case.arrivals_every) if case.arrivals_every else 0
    num_seqs = case.rows + num_arrivals
    cfg = paxpage.EngineConfig(page_size=page_size, num_pages=num_seqs * pages_per_row + 8,
                               max_num_seqs=num_seqs,
                               max_num_batched_tokens=max(case.prefill_tokens, case.rows),
                               enable_prefix_caching=case.prefix_caching)
    # A fresh engine (the model's weights shared), not model.engine(cfg): that one is kept per
    # config, so two cases with equal configs would step one engine holding both cases' requests.
    tokenizer = stop_tokenizer(model) if case.stop else model.tokenizer
    engine = paxpage.LLMEngine(model.config, model.param_forms, tokenizer, cfg)
    rng = np.random.default_rng(seed)
    num_requests = case.rows // case.n
    params = paxpage.SamplingParams(max_tokens=warmup + steps + spread + 2, temperature=case.temperature,
                                    top_p=case.top_p, repetition_penalty=case.repetition_penalty,
                                    ignore_eos=True, seed=seed, n=case.n, logprobs=case.logprobs,
                                    stop=list(case.stop))
    lens = [case.context] * num_requests
    if case.prompt_spread:
        lens = rng.integers(case.context - case.prompt_spread, case.context + 1, num_requests).tolist()
    max_tokens = [params.max_tokens] * num_requests
    if case.ending:
        # Row i's prompt ends in fill step e_i; the fill lasts ~max(e) + 2 steps (the last first
        # token is read a step late), then `warmup` + `before_window` steps: its j-th window step is
        # engine step max(e) + 2 + warmup + before_window + j, by which it has made that - e_i + 1 tokens.
        ends = prefill_steps(lens, case.n, cfg.max_num_batched_tokens)
        first = max(ends) + 2 + warmup + before_window
        chosen = rng.permutation(num_requests)[:round(case.ending * num_requests)]
        for k, i in enumerate(chosen):
            max_tokens[i] = max(1, first + k * window // len(chosen) - ends[i] + 1)
    requests = [engine.request(engine.add_request(rng.integers(0, model.config.vocab_size, length).tolist(),
                                                  dataclasses.replace(params, max_tokens=limit), stream=case.stream))
                for length, limit in zip(lens, max_tokens)]
    t = time.perf_counter()
    fill_steps = 0
    while any(r.first_token_time is None for r in requests):  # prefill, until each has its first token
        engine.step()
        fill_steps += 1
    fill_s = time.perf_counter() - t
    for _ in range(warmup):
        engine.step()
    arrival = dataclasses.replace(params, max_tokens=steps + 2)

    def arrive():
        engine.add_request(rng.integers(0, model.config.vocab_size, case.context).tolist(), arrival,
                           stream=case.stream)

    return engine, cfg, fill_steps, fill_s, arrive


class _Totals:
    """Sums of one engine's measured steps: host / device (engine.stats), wall, thread CPU; and
    each step's thread CPU, whether it was the steady decode step, whether it carried an arrival."""

    def __init__(self, case: Case | None = None, arrive=None):
        self.steps, self.host, self.device, self.wall, self.cpu = 0, 0.0, 0.0, 0.0, 0.0
        self.every = case.arrivals_every if case is not None else 0
        self.arrive = arrive
        self.step_cpu: list[float] = []
        self.step_decode_batch: list[bool] = []
        self.step_arrival: list[bool] = []
        self.step_rows: list[int] = []  # running sequences as the step starts
        # what else may take a step's time: XLA compiles (a shape first seen), full garbage collections
        self.step_compiles: list[int] = []
        self.step_full_gcs: list[int] = []

    def step(self, engine) -> None:
        arrival = bool(self.every) and self.steps % self.every == 0
        if arrival:  # added between steps, outside the step's timing, as a server's engine loop does
            self.arrive()
        self.step_rows.append(len(engine.scheduler.running))
        before = dataclasses.replace(engine.stats)
        compiles, full_gcs = compile_counter.compiles(), gc.get_stats()[2]["collections"]
        t, cpu = time.perf_counter(), time.thread_time()
        engine.step()
        cpu = time.thread_time() - cpu
        self.step_compiles.append(compile_counter.compiles() - compiles)
        self.step_full_gcs.append(gc.get_stats()[2]["collections"] - full_gcs)
        self.cpu += cpu
        self.wall += time.perf_counter() - t
        after = engine.stats
        assert after.steps == before.steps + 1
        self.steps += 1
        self.host += after.host_seconds - before.host_seconds
        self.device += after.device_seconds - before.device_seconds
        self.step_cpu.append(cpu)
        self.step_decode_batch.append(after.decode_batch_steps > before.decode_batch_steps)
        self.step_arrival.append(arrival)

    def result(self) -> dict:
        n = self.steps
        host, device, wall = self.host / n, self.device / n, self.wall / n
        out = {"host_s": host, "device_s": device, "wall_s": wall, "host_cpu_s": self.cpu / n,
               "host_cpu_max_s": max(self.step_cpu), "measured_steps": n,
               "decode_batch_steps": sum(self.step_decode_batch), "step_host_cpu_s": self.step_cpu,
               "step_decode_batch": self.step_decode_batch, "step_rows": self.step_rows,
               "step_compiles": self.step_compiles, "step_full_gcs": self.step_full_gcs,
               # the max over the steps without a compile: the figure once every shape has been seen
               "host_cpu_max_warm_s": max([c for c, k in zip(self.step_cpu, self.step_compiles) if not k],
                                          default=0.0)}
        if self.every:  # steps with an arrival's prefill chunk, and the decode-only rest
            for name, steps in (("arrival", [c for c, a in zip(self.step_cpu, self.step_arrival) if a]),
                                ("decode", [c for c, a in zip(self.step_cpu, self.step_arrival) if not a])):
                out[f"{name}_steps"] = len(steps)
                out[f"{name}_host_cpu_s"] = sum(steps) / max(1, len(steps))
                out[f"{name}_host_cpu_max_s"] = max(steps, default=0.0)
            out["step_arrival"] = self.step_arrival
        return out


def overlap(host: float, busy_s: float, wall: float) -> float:
    """The share of the shorter of host and device busy time hidden under the other, 0..1."""
    return min(1.0, max(0.0, host + busy_s - wall) / max(1e-9, min(host, busy_s)))


def busy(engines: list, steps: int) -> list[float]:
    """Device busy seconds per step of each engine: `steps` more steps (in turns) with every
    device call timed to its completion (ModelRunner.time_device_calls), summed per step."""
    timings = [engine.runner.time_device_calls() for engine in engines]
    for _ in range(steps):
        for engine in engines:
            engine.step()
    # each call's median (one slow call on a shared machine does not count) times its calls per step
    return [sum(float(np.median(v)) * len(v) / steps for v in t.values()) for t in timings]


def run_case(model: paxpage.Model, case: Case, steps: int, warmup: int, seed: int) -> dict:
    """Fills an engine with case.rows decoding sequences and measures `steps` decode steps,
    then `steps` more for the device's busy time."""
    engine, cfg, fill_steps, fill_s, arrive = fill_case(model, case, 2 * steps, warmup, seed, window=steps)
    totals = _Totals(case, arrive)
    for _ in range(steps):
        totals.step(engine)
    return {"cfg": cfg, **totals.result(), "busy_s": busy([engine], steps)[0],
            "fill_steps": fill_steps, "fill_s": fill_s}


def run_interleaved(models: dict, cases: list, steps: int, warmup: int, seed: int,
                    rounds: int = 1) -> list[dict]:
    """Every case's engine filled first, then `rounds` windows of `steps` measured steps, taken
    in turns (one step of each case at a time), so the machine's load falls on all cases alike.
    Each result also holds its host CPU per step in every window ("window_host_cpu_s")."""
    filled = [fill_case(models[case.model], case, (rounds + 1) * steps + 1, warmup, seed, window=steps,
                        before_window=1) for case in cases]
    for engine, *_ in filled:  # one untimed round: the first step after the other fills is slow
        engine.step()
    totals = [_Totals(case, f[4]) for case, f in zip(cases, filled)]
    windows = [[] for _ in cases]
    for _ in range(rounds):
        start = [total.cpu for total in totals]
        for _ in range(steps):
            for (engine, *_), total in zip(filled, totals):
                total.step(engine)
        for out, total, cpu in zip(windows, totals, start):
            out.append((total.cpu - cpu) / steps)
    busy_s = busy([engine for engine, *_ in filled], steps)
    return [{"cfg": cfg, **total.result(), "busy_s": b, "fill_steps": fill_steps, "fill_s": fill_s,
             "window_host_cpu_s": w}
            for (_, cfg, fill_steps, fill_s, _), total, b, w in zip(filled, totals, busy_s, windows)]


def context_ratios(results: list[dict]) -> list[tuple[dict, dict]]:
    """(shorter, longer) context pairs among cases that differ in nothing else."""
    def rest(row):
        return tuple(row[f.name] for f in dataclasses.fields(Case) if f.name not in ("key", "context"))
    pairs = []
    for short in results:
        for long in results:
            if rest(short) == rest(long) and short["context"] < long["context"]:
                pairs.append((short, long))
    return pairs


def case_label(row: dict) -> str:
    """A case as the docs name it: "tiny 256 x 1536, temperature 0.7, top-p 0.9"."""
    parts = [f"{'SmolLM2' if row['model'] == 'smollm2' else row['model']} {row['rows']} x {row['context']}"]
    if row["temperature"]:
        parts.append(f"temperature {row['temperature']:g}")
    if row["top_p"] != 1:
        parts.append(f"top-p {row['top_p']:g}")
    if row["repetition_penalty"] != 1:
        parts.append(f"repetition penalty {row['repetition_penalty']:g}")
    if row["stream"]:
        parts.append("streamed")
    if not row.get("prefix_caching", True):
        parts.append("prefix caching off")
    if row.get("prompt_spread"):
        parts.append(f"prompts of {row['context'] - row['prompt_spread']} to {row['context']} tokens")
    if row.get("ending"):
        parts.append(f"{row['ending']:.0%} of rows ending in the window")
    if row.get("arrivals_every"):
        k = row["arrivals_every"]
        parts.append("a request arriving every step" if k == 1 else f"a request arriving every {k} steps")
    if row.get("n", 1) != 1:
        parts.append(f"n {row['n']}")
    if row.get("logprobs") is not None:
        parts.append(f"logprobs {row['logprobs']}")
    if row.get("stop"):
        parts.append("stop " + json.dumps(list(row["stop"])))
    return ", ".join(parts)


def doc_tables(data: dict) -> dict:
    """The docs' table (docs/benchmarks.md): one row per case, times in ms per step."""
    def ms(seconds):
        return round(seconds * 1e3, 1)

    rows = [[case_label(r), ms(r["host_s"]), ms(r["host_cpu_s"]), ms(r["device_s"]), ms(r["busy_s"]), ms(r["wall_s"]),
             round(r["wall_s"] / max(r["host_cpu_s"], r["busy_s"]), 2), f"{r['overlap']:.0%}",
             f"{r['attention_share']:.0%}", round(r["attention_gb_per_s"], 1)] for r in data["cases"]]
    tiny = TINY_CONFIG
    caption = (f"One steady decode step per case ({data['steps']} measured), rows x context; tiny: a random "
               f"{tiny['num_hidden_layers']}-layer Llama (hidden {tiny['hidden_size']}, vocabulary "
               f"{tiny['vocab_size']:,}); this machine's read bandwidth {data['read_bandwidth_gb_per_s']:.1f} GB/s")
    every = []  # every measured step: the target is each step's, not only the mean
    for r in data["cases"]:
        split = {name: (f"{ms(r[f'{name}_host_cpu_s'])} / {ms(r[f'{name}_host_cpu_max_s'])}"
                        if f"{name}_steps" in r else "") for name in ("decode", "arrival")}
        every.append([case_label(r), ms(r["host_cpu_s"]), ms(r["host_cpu_max_s"]), ms(r["host_cpu_max_warm_s"]),
                      f"{r['decode_batch_steps']} / {r['measured_steps']}",
                      f"{r['step_rows'][0]} to {r['step_rows'][-1]}", split["decode"], split["arrival"]])
    return {"step": {"caption": caption,
                     "columns": ["case", "host ms", "host CPU ms", "device wait ms", "device busy ms", "wall ms",
                                 "wall / max(host CPU, busy)", "overlap", "attention share", "attention GB/s"],
                     "rows": rows},
            "step_every": {"caption": f"Host CPU of every measured step per case ({data['steps']} measured), ms: "
                                      "mean, max, and max over the steps that compiled nothing; the steps that "
                                      "took the steady decode step; running rows "
                                      "in the first and last step; with arrivals, the steps without and with "
                                      "an arriving request's prefill (mean / max)",
                           "columns": ["case", "host CPU ms", "max host CPU ms", "max without compiles",
                                       "steady decode steps", "rows",
                                       "decode-only steps' host CPU ms", "prefill steps' host CPU ms"],
                           "rows": every}}


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
            print(f"{case.key:26s} host {r['host_s'] * 1e3:7.1f} (CPU {r['host_cpu_s'] * 1e3:.1f})  "
                  f"device {r['device_s'] * 1e3:8.1f} (busy {r['busy_s'] * 1e3:.1f})  "
                  f"wall {r['wall_s'] * 1e3:8.1f} ms/step  overlap {r['overlap']:4.0%}  attention "
                  f"{att['seconds'] * 1e3:6.1f} ms ({row['attention_share']:4.0%} of device busy), "
                  f"{att['gb_per_s']:5.1f} GB/s ({row['attention_vs_bandwidth']:.2f}x read bandwidth)  "
                  f"[fill {r['fill_steps']} steps, {r['fill_s']:.0f} s]", flush=True)
            split = "".join(f"; {name} steps ({r[f'{name}_steps']}) CPU {r[f'{name}_host_cpu_s'] * 1e3:.2f} "
                            f"max {r[f'{name}_host_cpu_max_s'] * 1e3:.2f}" for name in ("decode", "arrival")
                            if f"{name}_steps" in r)
            print(f"{'':26s} host CPU max {r['host_cpu_max_s'] * 1e3:.2f} ms/step "
                  f"({r['host_cpu_max_warm_s'] * 1e3:.2f} "
                  f"without the {sum(map(bool, r['step_compiles']))} steps that compiled); steady decode step in "
                  f"{r['decode_batch_steps']} / {r['measured_steps']} steps; rows {r['step_rows'][0]} to "
                  f"{r['step_rows'][-1]}{split}", flush=True)
            if not case.steady:
                print(f"{'':26s} per step (ms): " + " ".join(
                    f"{c * 1e3:.1f}{'' if d else '*'}{'+' if a else ''}{'c' if k else ''}{'g' if g else ''}"
                    for c, d, a, k, g in zip(r["step_host_cpu_s"], r["step_decode_batch"],
                                             r.get("step_arrival", [False] * r["measured_steps"]),
                                             r["step_compiles"], r["step_full_gcs"])) +
                      "  (* general step, + an arrival's prefill, c compiled, g full gc)", flush=True)
    # Sampled cases against the greedy case of the same model and shape, when both ran.
    def steady(row):
        return Case(**{f.name: row[f.name] for f in dataclasses.fields(Case)}).steady

    greedy = {(r["model"], r["rows"], r["context"]): r for r in results if r["temperature"] == 0 and steady(r)}
    for row in results:
        base = greedy.get((row["model"], row["rows"], row["context"]))
        if row["temperature"] != 0 and base is not None and steady(row):
            row["device_vs_greedy"] = row["device_s"] / base["device_s"]
            row["busy_vs_greedy"] = row["busy_s"] / base["busy_s"]
            print(f"{row['case']}: device busy {row['busy_vs_greedy']:.2f}x {base['case']}'s "
                  f"(device wait {row['device_vs_greedy']:.2f}x)", flush=True)

    for short, long in context_ratios(results):
        long.setdefault("host_cpu_vs_context", {})[short["case"]] = ratio = long["host_cpu_s"] / short["host_cpu_s"]
        windows = ""
        if "window_host_cpu_s" in long:
            windows = " (per window: " + ", ".join(
                f"{a / b:.2f}" for a, b in zip(long["window_host_cpu_s"], short["window_host_cpu_s"])) + ")"
        print(f"{long['case']}: host CPU {ratio:.2f}x {short['case']}'s "
              f"({long['host_cpu_s'] * 1e3:.2f} vs {short['host_cpu_s'] * 1e3:.2f} ms/step"
              f"{', side by side' if args.interleave else ', one after the other'}){windows}", flush=True)

    for row in results:
        row["wall_vs_bound"] = row["wall_s"] / max(row["host_cpu_s"], row["busy_s"])
    data = {"backend": jax.default_backend(), "read_bandwidth_gb_per_s": bandwidth, "steps": steps, "cases": results}
    for table in doc_tables(data).values():
        print("\n| " + " | ".join(table["columns"]) + " |\n" + "|---" * len(table["columns"]) + "|")
        for cells in table["rows"]:
            print("| " + " | ".join(str(c) for c in cells) + " |")
    if args.json:
        from provenance import write_record  # the figures with machine, versions, date, command, commit

        write_record(args.json, data, doc_tables(data))
    return 0


if __name__ == "__main__":
    from paxpage.process_tuning import tune_malloc

    tune_malloc()  # glibc keeps large freed buffers for reuse (paxpage/process_tuning.py)
    sys.exit(main())
