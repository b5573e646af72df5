"""One timed paxpage pass for scripts/bench_throughput.py: every request of the workload queued
at t=0, the engine driven step by step to stamp each request's first token and finish (TTFT,
TPOT), how many of the step shapes' token slots and rows held real work, and the rates.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

import paxpage
import workload as wl

FIRST_TOKENS = 8  # of each output, compared across systems (greedy: the same tokens)


def _step(engine, first: list, finish: list, counts: list, tokens: list) -> None:
    """One engine step; stamps each request's first token and finish with the time, and keeps
    each request's first FIRST_TOKENS token ids."""
    results = engine.step()
    now = time.perf_counter()
    for request, deltas in results:
        i = request.index
        for d in deltas:
            if d.token_ids:
                if first[i] is None:
                    first[i] = now
                counts[i] += len(d.token_ids)
                if len(tokens[i]) < FIRST_TOKENS:
                    tokens[i] += list(d.token_ids)[:FIRST_TOKENS - len(tokens[i])]
            if d.finish_reason is not None:
                finish[i] = now


def run_paxpage(model: paxpage.Model, work: wl.Workload, cfg: paxpage.EngineConfig) -> dict:
    """One pass over the workload, step by step; per-request TTFT / TPOT and engine stats."""
    engine = model.engine(cfg)
    stats0 = dataclasses.replace(engine.stats)
    preempt0 = engine.scheduler.num_preemptions
    n = work.num_requests
    first, finish, counts, tokens = [None] * n, [None] * n, [0] * n, [[] for _ in range(n)]
    start = time.perf_counter()
    for i, (prompt, out_len) in enumerate(zip(work.prompts, work.output_lens)):
        engine.add_request(prompt, paxpage.SamplingParams(max_tokens=out_len, temperature=0,
                                                          ignore_eos=True), index=i)
    max_running = 0
    pad = dict.fromkeys(("tokens", "token_slots", "decode_rows", "decode_row_slots",
                         "prefill_tokens", "prefill_token_slots"), 0)
    packer = engine.runner.packer
    pack = packer.pack

    def counting_pack(*a, **kw):  # what the padded shapes cost: real vs padded tokens and rows
        packed = pack(*a, **kw)
        b = packed[0]
        real_dec = int(np.count_nonzero(b.dec_kv_lens))
        pad["tokens"] += int(np.count_nonzero(b.slot_mapping >= 0))
        pad["token_slots"] += len(b.token_ids)
        pad["decode_rows"] += real_dec
        pad["decode_row_slots"] += len(b.dec_kv_lens)
        pad["prefill_tokens"] += int(np.sum(b.pre_q_lens))
        pad["prefill_token_slots"] += len(b.token_ids) - len(b.dec_kv_lens)
        return packed

    packer.pack = counting_pack
    try:
        while engine.has_unfinished():
            _step(engine, first, finish, counts, tokens)
            max_running = max(max_running, engine.scheduler.num_running)
    finally:
        del packer.pack  # back to the class method

    wall = time.perf_counter() - start
    if counts != work.output_lens:
        raise RuntimeError(f"paxpage generated {sum(counts)} tokens, expected {work.num_output_tokens}")
    st = engine.stats
    ttft = [f - start for f in first]
    tpot = [(e - f) / (c - 1) for f, e, c in zip(first, finish, counts) if c > 1]
    steps = st.steps - stats0.steps
    return {
        "wall_s": wall,
        "steps": steps,
        "host_s": st.host_seconds - stats0.host_seconds,
        "device_s": st.device_seconds - stats0.device_seconds,
        "host_share": (st.host_seconds - stats0.host_seconds) / wall,
        "mean_kv_utilisation": (st.kv_utilisation_sum - stats0.kv_utilisation_sum)
        / max(1, st.kv_utilisation_samples - stats0.kv_utilisation_samples),
        "preemptions": engine.scheduler.num_preemptions - preempt0,
        "max_running": max_running,
        "padding": pad,
        "ttft_s": wl.percentiles(ttft),
        "tpot_s": wl.percentiles(tpot),
        "first_tokens": tokens,
    }


def rates(work: wl.Workload, seconds: float) -> dict:
    return {
        "requests_per_s": work.num_requests / seconds,
        "output_tok_per_s": work.num_output_tokens / seconds,
        "total_tok_per_s": (work.num_prompt_tokens + work.num_output_tokens) / seconds,
    }
