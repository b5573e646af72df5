"""The in-process stages of the device check (scripts/device_check.py runs each in its own process).

Each stage is `fn(quick, record) -> None`: it fills the dict `record` as it goes and calls
`record.save()` after each part, so a stage cut off by its timeout still leaves what it measured.
Models are random-weight (models/random_init.py), built on the device, token ids in and out.
quick: tiny shapes on CPU, Pallas in interpret mode; the figures then only show the stage runs.

Axis legend: B rows (sequences in a step), S context, L layers, K kv heads, D head dim.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import paxpage  # noqa: E402
from models import random_init  # noqa: E402
from models.quant import bytes_by_dtype  # noqa: E402
from paxpage import compile_counter  # noqa: E402
from paxpage.held_form import held_form  # noqa: E402
from paxpage.batch import StepBatch  # noqa: E402
from paxpage.packing import bucket  # noqa: E402
from paxpage.runner import ModelRunner  # noqa: E402

GiB = 1 << 30
HBM_BYTES_PER_S = 4.3e12  # H200's HBM3e peak: the share a decode step reaches is set against it


def pallas_impl(quick: bool) -> str:
    return "pallas-interpret" if quick else "pallas"


def median_ms(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


# ---------------------------------------------------------------------------------------------
# 1. environment and copy bandwidth


def env(quick: bool, record) -> None:
    devices = jax.devices()
    record.update(jax=jax.__version__, jaxlib=jaxlib.__version__, backend=jax.default_backend(),
                  devices=[str(d) for d in devices], device_kind=devices[0].device_kind,
                  python=sys.version.split()[0])
    stats = devices[0].memory_stats() or {}
    record["bytes_limit"] = stats.get("bytes_limit")
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20)
        record["nvidia_smi"] = smi.stdout.splitlines()
    record.save()
    num_bytes = (8 << 20) if quick else 4 * GiB
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0 + 0.0)  # elementwise, not a no-op XLA can elide
    jax.block_until_ready(copy(x))
    ms = median_ms(lambda: jax.block_until_ready(copy(x)), 10)
    record.update(copy_bytes=num_bytes, copy_ms=ms, copy_gb_per_s=2 * num_bytes / (ms / 1e3) / 1e9)
    record["headline"] = f"{record['device_kind']}, jax {jax.__version__}, copy {record['copy_gb_per_s']:.0f} GB/s"
    print(record["headline"], flush=True)


# ---------------------------------------------------------------------------------------------
# 2. end to end: Pallas against XLA, an int8 KV cache, n-gram speculation


def end_to_end(quick: bool, record) -> None:
    cfg = random_init.preset("llama-3.2-1b", tiny=quick)
    num_prompts, (low, high), max_tokens = (4, (10, 60), 8) if quick else (16, (50, 1500), 64)
    t = time.perf_counter()
    params = random_init.random_params(cfg, "bfloat16", seed=0)
    jax.block_until_ready(params)
    record.update(model=f"llama-3.2-1b{' (tiny)' if quick else ''}", num_params=random_init.num_params(cfg),
                  init_s=time.perf_counter() - t, prompts=num_prompts, max_tokens=max_tokens)
    model = paxpage.Model(cfg, held_form(cfg, params), None, source="random:llama-3.2-1b")  # as paxpage.load holds it
    rng = np.random.default_rng(0)
    lengths = rng.integers(low, high + 1, num_prompts)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lengths]
    record["prompt_lengths"] = lengths.tolist()
    pages = sum(-(-(n + max_tokens + 8) // 16) for n in lengths) + 16
    base = dict(page_size=16, num_pages=int(pages), max_num_seqs=num_prompts, max_model_len=int(high + max_tokens + 32),
                max_num_batched_tokens=256 if quick else 8192, dtype="bfloat16",
                enable_prefix_caching=False)  # each pass prefills its prompts in full
    variants = {
        "pallas": dict(attention_impl=pallas_impl(quick)),
        "xla": dict(attention_impl="xla"),
        "pallas-int8-kv": dict(attention_impl=pallas_impl(quick), kv_cache_dtype="int8"),
        "pallas-ngram": dict(attention_impl=pallas_impl(quick), speculative_method="ngram",
                             num_speculative_tokens=4, speculative_max_batch=num_prompts),
    }
    record["runs"] = {}
    tokens = {}
    for name, options in variants.items():
        run, tokens[name] = _generate_twice(model, paxpage.EngineConfig(**base, **options), prompts, max_tokens)
        if name != "pallas" and "pallas" in tokens:
            run["vs_pallas"] = agreement(tokens["pallas"], tokens[name])
        record["runs"][name] = run
        record.save()
        print(f"{name}: {run}", flush=True)
    vs = record["runs"]["xla"]["vs_pallas"]
    nans = sum(r["nan_logprobs"] for r in record["runs"].values())
    record["headline"] = (f"pallas/xla agree {vs['tokens_agreeing']}/{vs['tokens']} tokens, "
                          f"{record['runs']['pallas']['tok_per_s']:.0f} tok/s, NaN logprobs {nans}")
    if nans:
        raise RuntimeError(f"{nans} NaN logprobs across the runs")


def _generate_twice(model, config, prompts, max_tokens):
    """A cold pass over the prompts (it compiles) and a timed one over the same prompts, which
    must compile nothing; greedy, EOS ignored. -> (figures, the timed pass's tokens per prompt)."""
    t = time.perf_counter()
    engine = paxpage.LLMEngine(model.config, model.param_forms, None, config)
    run = {"build_s": time.perf_counter() - t}
    passes = []
    for _ in range(2):
        compiles, compile_s = compile_counter.compiles(), compile_counter.compile_seconds()
        passes.append(_one_pass(engine, prompts, max_tokens))
        passes[-1].update(compiles=compile_counter.compiles() - compiles,
                          compile_s=compile_counter.compile_seconds() - compile_s)
    cold, timed = passes
    run.update(cold_s=cold["wall_s"], compiles=cold["compiles"], compile_s=cold["compile_s"],
               steady_compiles=timed["compiles"], wall_s=timed["wall_s"],
               tok_per_s=timed["tokens"] / timed["wall_s"], ttft_ms=timed["ttft_ms"],
               nan_logprobs=cold["nan"] + timed["nan"], passes_agree=cold["ids"] == timed["ids"])
    stats = engine.stats
    if stats.draft_tokens:
        run.update(acceptance_rate=stats.acceptance_rate, mean_accepted_length=stats.mean_accepted_length)
    del engine
    return run, timed["ids"]


def _one_pass(engine, prompts, max_tokens) -> dict:
    params = paxpage.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0)
    t = time.perf_counter()
    requests = [engine.request(engine.add_request(p, params, index=i, stream=False)) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - t
    outputs = [engine.output(r) for r in requests]
    ids = [list(o.token_ids) for o in outputs]
    logprobs = [lp for o in outputs for step in (o.outputs[0].logprobs or []) for lp in step.values()]
    ttft = sorted(1e3 * o.metrics.time_to_first_token for o in outputs)
    return {"wall_s": wall, "ids": ids, "tokens": sum(map(len, ids)), "nan": int(np.isnan(logprobs).sum()),
            "ttft_ms": {"p50": ttft[len(ttft) // 2], "max": ttft[-1]}}


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Per prompt: positions where the two greedy runs give the same token, and the first where
    they differ (None: none does). Random weights leave near-ties, so bf16 rounding may part two
    correct implementations; a divergence at token 0 of many prompts is a bug."""
    same = [sum(x == y for x, y in zip(p, q)) for p, q in zip(a, b)]
    first = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), None) for p, q in zip(a, b)]
    return {"tokens_agreeing": int(sum(same)), "tokens": int(sum(map(len, a))), "per_prompt": same,
            "first_divergence": first, "identical_prompts": sum(f is None for f in first)}


# ---------------------------------------------------------------------------------------------
# 5. and 6. one decode step at scale


def decode_step(quick: bool, record, name: str, rows: int, context: int, num_layers: int | None = None) -> None:
    """One decode step of `rows` sequences at `context` tokens each, built by hand (no prefill):
    permuted page tables, every row at its last position, the pool zeros (the kernels' time does
    not depend on the values). Times the runner's own compiled step and reads its memory
    analysis: a temporary the size of the pool means the pool was copied. The bytes read count
    every weight once (a MoE step at 64 rows x 8 experts reaches almost all 128 experts) and the
    rows' K/V; a device with less memory than the H200 gets fewer rows (the record says how many)."""
    cfg = random_init.preset(name, tiny=quick, num_layers=num_layers)
    page_size = 16
    pages_per_row = -(-context // page_size)
    itemsize = 2
    kv_token_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
    weight_bytes = random_init.num_params(cfg) * itemsize
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    while limit and rows > 8 and weight_bytes + rows * context * kv_token_bytes > 0.8 * limit:
        rows //= 2  # a smaller device: fewer rows, said in the record
    record.update(model=f"{name}{' (tiny)' if quick else ''}", num_layers=cfg.num_layers, rows=rows, context=context,
                  weight_bytes=weight_bytes, kv_bytes=rows * context * kv_token_bytes)
    t = time.perf_counter()
    params = random_init.random_params(cfg, "bfloat16", seed=0)
    jax.block_until_ready(params)
    record["init_s"] = time.perf_counter() - t
    record.save()
    print(f"{record['model']}: {weight_bytes / 2**30:.1f} GiB of weights drawn in {record['init_s']:.1f} s; "
          f"{rows} rows x {context} tokens, K/V {record['kv_bytes'] / 2**30:.1f} GiB", flush=True)
    engine_cfg = paxpage.EngineConfig(page_size=page_size, num_pages=rows * pages_per_row + 1, max_num_seqs=rows,
                                      max_model_len=context + page_size, dtype="bfloat16",
                                      attention_impl=pallas_impl(quick))
    # held in the form the runner steps (stacked when it scans the layers), as paxpage.load does
    params = held_form(cfg, params, engine_cfg)
    runner = ModelRunner(cfg, params, engine_cfg.resolve(cfg))
    # the runner steps the very arrays drawn above (bf16 in, bf16 out: no cast or stacked copy)
    record["params_shared"] = all(x is y for x, y in zip(jax.tree.leaves(runner.params), jax.tree.leaves(params)))
    assert bytes_by_dtype(runner.params) == {"bfloat16": weight_bytes}
    t = time.perf_counter()
    compiled = runner.lower_step(rows, 0).compile()
    record["compile_s"] = time.perf_counter() - t
    analysis = compiled.memory_analysis()
    pool_bytes = sum(x.nbytes for x in jax.tree.leaves(runner.kv_cache))
    if analysis is not None:
        record.update(temp_bytes=int(analysis.temp_size_in_bytes), pool_bytes=pool_bytes,
                      temp_over_pool=analysis.temp_size_in_bytes / pool_bytes)
    record.save()
    print(f"compiled in {record['compile_s']:.1f} s; temp {record.get('temp_bytes')} bytes, pool {pool_bytes}",
          flush=True)
    batch = jax.tree.map(jnp.asarray, decode_batch(runner, rows, context, cfg.vocab_size))  # on device, untimed
    prev_rows = np.full(rows, -1, np.int32)
    no_prev = jnp.zeros(runner.max_logits_rows, jnp.int32)
    state = {"pool": runner.kv_cache}
    runner.kv_cache = None  # donated to every call below

    def call():
        state["pool"], logits, _ = compiled(runner.params, state["pool"], batch, prev_rows, no_prev)
        state["logits"] = jax.block_until_ready(logits)

    call()
    ms = median_ms(call, 3 if quick else 10)
    # every weight is read once, but an untied embedding table only at the rows' tokens
    unread = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * itemsize
    read = record["kv_bytes"] + weight_bytes - unread
    logits = np.asarray(state["logits"][:rows], np.float32)
    record.update(step_ms=ms, tok_per_s=rows / (ms / 1e3), bytes_read=read,
                  hbm_share=read / (ms / 1e3) / HBM_BYTES_PER_S, nan_logits=int(np.isnan(logits).sum()))
    temp = (f", temp {record['temp_bytes'] / 2**20:.0f} MiB ({record['temp_over_pool']:.2f}x pool)"
            if "temp_bytes" in record else "")
    record["headline"] = (f"{rows}x{context}: {ms:.2f} ms, {record['tok_per_s']:.0f} tok/s, "
                          f"{100 * record['hbm_share']:.0f}% of 4.3 TB/s{temp}")
    print(record["headline"], flush=True)
    if record["nan_logits"]:
        raise RuntimeError(f"{record['nan_logits']} NaN logits")


def decode_batch(runner: ModelRunner, rows: int, context: int, vocab_size: int) -> StepBatch:
    """`rows` decode rows, each writing its token `context` - 1 and attending to all `context`
    (pages scattered over the pool as after many allocations; see packing.Packer for the fields)."""
    page_size, pages_per_seq = runner.cfg.page_size, runner.cfg.pages_per_seq
    pages_per_row = -(-context // page_size)
    rng = np.random.default_rng(0)
    table = np.zeros((rows, pages_per_seq), np.int32)
    table[:, :pages_per_row] = rng.permutation(runner.cfg.num_pages)[:rows * pages_per_row].reshape(rows, -1)
    last = context - 1
    slots = (table[:, last // page_size] * page_size + last % page_size).astype(np.int32)
    num_logits = bucket(rows)
    logits_rows = np.zeros(num_logits, np.int32)
    logits_rows[:rows] = np.arange(rows)
    return StepBatch(
        rng.integers(0, vocab_size, rows).astype(np.int32), np.full(rows, last, np.int32), slots,
        table, np.full(rows, context, np.int32),
        np.zeros((0, pages_per_seq), np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32),
        logits_rows, np.zeros(0, np.int32), np.zeros(0, np.int32))


def dense_decode(quick: bool, record) -> None:
    rows, context = (4, 64) if quick else (256, 2048)
    decode_step(quick, record, "llama-3-8b", rows, context)


def moe_decode(quick: bool, record) -> None:
    rows, context = (4, 64) if quick else (64, 2048)
    decode_step(quick, record, "qwen3-30b-a3b", rows, context)


STAGES = {"env": env, "e2e": end_to_end, "decode_8b": dense_decode, "moe": moe_decode}
