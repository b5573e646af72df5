"""The workload of scripts/bench_step.py: its cases, an engine filled until every row decodes,
and the measured steps (host / device / wall / thread CPU per step, each step's extras, the
device's busy time), alone or with several engines in turns.
"""

from __future__ import annotations

import dataclasses
import gc
import time

import numpy as np

import paxpage
from paxpage import compile_counter, process_tuning


@dataclasses.dataclass(frozen=True)
class Case:
    key: str
    model: str  # "tiny" | "smollm2"
    rows: int  # running sequences
    context: int  # prompt tokens per sequence (the decode context at measurement)
    temperature: float = 0.0
    top_p: float = 1.0
    repetition_penalty: float = 1.0  # != 1: penalised rows (penalty tensors each step)
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
    # rows whose output follows a grammar (STRUCTURED: a regex that no measured step completes), the
    # first requests' samples; SmolLM2's tokenizer on the tiny model, as for stop strings
    structured: int = 0

    @property
    def steady(self) -> bool:
        """Every row added at once with one max_tokens, prefix caching on, no per-row extras."""
        return (self.prefix_caching, self.prompt_spread, self.ending, self.arrivals_every, self.n, self.logprobs,
                self.stop, self.structured) == (True, 0, 0.0, 0, 1, None, (), 0)


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
    Case("tiny-256x1536-t0.7-n2-arrivals4", "tiny", 256, 1536, temperature=0.7, n=2, arrivals_every=4),
    Case("tiny-256x1536-logprobs5", "tiny", 256, 1536, logprobs=5),
    Case("tiny-256x1536-stop", "tiny", 256, 1536, stop=("xyz",)),
    Case("tiny-256x1536-regex1", "tiny", 256, 1536, structured=1),
]
STRUCTURED = {"regex": "[a-z]{4000}"}
QUICK_CASES = [
    Case("tiny-8x32", "tiny", 8, 32, prefill_tokens=256),
    Case("tiny-8x32-t0.7-p0.9", "tiny", 8, 32, temperature=0.7, top_p=0.9, prefill_tokens=256),
    Case("tiny-8x32-mixed", "tiny", 8, 32, temperature=0.7, prefill_tokens=256, prefix_caching=False,
         prompt_spread=8, ending=0.5, arrivals_every=1, n=2, logprobs=2, stop=("xyz",), structured=1),
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
    tokens left for `steps` more. With arrivals the warm-up is at least four steps and two of
    them carry an arriving request, so the measured steps meet shapes already compiled (a
    prefill chunk beside the decodes, the batch a row or two larger). `window`: the measured steps among them (default all), after
    `before_window` unmeasured ones; a case's ending rows finish inside it.
    -> (engine, cfg, fill steps, fill seconds, arrive: adds one arriving request)."""
    window = steps if window is None else window
    warm_arrivals = 2 if case.arrivals_every else 0
    warmup = max(warmup, 2 * warm_arrivals)
    page_size = 16
    tokens_per_row = case.context + warmup + steps + 4
    # Prefill finishes for different requests in different steps: room for that spread too.
    spread = -(-case.rows * case.context // case.prefill_tokens) + 2
    pages_per_row = -(-(tokens_per_row + spread) // page_size)
    num_arrivals = (-(-steps // case.arrivals_every) if case.arrivals_every else 0) + warm_arrivals
    num_seqs = case.rows + num_arrivals * case.n
    cfg = paxpage.EngineConfig(page_size=page_size, num_pages=num_seqs * pages_per_row + 8,
                               max_num_seqs=num_seqs,
                               max_num_batched_tokens=max(case.prefill_tokens, case.rows),
                               enable_prefix_caching=case.prefix_caching)
    # A fresh engine (the model's weights shared), not model.engine(cfg): that one is kept per
    # config, so two cases with equal configs would step one engine holding both cases' requests.
    tokenizer = stop_tokenizer(model) if case.stop or case.structured else model.tokenizer
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
    structured = dataclasses.replace(params, structured_outputs=STRUCTURED)
    requests = [engine.request(engine.add_request(rng.integers(0, model.config.vocab_size, length).tolist(),
                                                  dataclasses.replace(structured if i < case.structured else params,
                                                                      max_tokens=limit), stream=case.stream))
                for i, (length, limit) in enumerate(zip(lens, max_tokens))]
    t = time.perf_counter()
    fill_steps = 0
    while any(r.first_token_time is None for r in requests):  # prefill, until each has its first token
        engine.step()
        fill_steps += 1
    fill_s = time.perf_counter() - t
    arrival = dataclasses.replace(params, max_tokens=warmup + steps + 2)

    def arrive():
        engine.add_request(rng.integers(0, model.config.vocab_size, case.context).tolist(), arrival,
                           stream=case.stream)

    for i in range(warmup):
        if i % 2 == 0 and i // 2 < warm_arrivals:
            arrive()
        engine.step()
    engine.wait_for_compiles()  # shapes the fill met, compiling in the background
    process_tuning.freeze_startup_heap()  # as paxpage serve does once its engine is built

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

