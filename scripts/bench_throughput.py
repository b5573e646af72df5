"""Offline throughput: paxpage against HF transformers `generate` and vLLM on the same weights.

Every request is queued at t=0 (offline batch inference, as in vLLM's benchmark_throughput):
N requests with ShareGPT-like prompt / output lengths (scripts/workload.py), random token
ids, EOS ignored so each request generates exactly its output length, fixed seed.

paxpage: one warm-up pass over the same lengths with other random prompts (it meets every
shape bucket the measured passes meet, and leaves no prefix-cache entries they could hit),
then --repeats measured passes (the first before the HF sweep, the rest after it with fresh
prompts, so both systems see similar load on a noisy machine; the fastest pass counts, as
the fastest HF batch size does), driven step by step to time each request:
    TTFT  time from the start of the pass to the request's first output token
    TPOT  (finish - first token) / (output tokens - 1)
Any XLA compile during a measured pass fails the run (exit 1) unless --allow-compiles.
Padding figures say how many of the step shapes' token slots and rows held real work.
The pass itself is scripts/throughput_pass.py.

HF baseline (scripts/throughput_peers.py, as is the vLLM peer): static padded batches, as
users write them: requests in arrival order, chunks of `batch size`, left padding + attention
mask, greedy, min_new_tokens = max_new_tokens = the chunk's longest output; only each
request's wanted tokens count. The batch size is the best of a small sweep (--hf-batch-sizes),
every size measured on the whole workload. torch gets as many threads as the machine has
cores (as jax does), or 1 if a quick timing finds that faster (on a loaded machine OpenMP's
spinning barriers can make 2 threads ~10x slower).

vLLM peer (optional, scripts/vllm_peer.py): vLLM's CPU build from its own venv
(--vllm-python or $PAXPAGE_VLLM_PYTHON; skipped with a message without one), one `vllm.LLM`
in a subprocess with the same engine limits (max_num_seqs, max_num_batched_tokens,
max_model_len, KV budget, float32), fed the same token-id prompts and lengths, greedy, EOS
ignored (its own page size: its CPU attention takes multiples of 32). Its start-up (model load, torch.compile) and its warm-up pass (the same prompts as
paxpage's) are timed apart; then its passes alternate with paxpage's on the same prompts, the
fastest counts. The first tokens of every output are compared (same greedy tokens).

Then the passes' matmul FLOPs (every prompt and fed-back token through each layer's projections,
every sampled token through the LM head) over each system's wall time, beside numpy's f32 matmul
rate on the same machine (timed first, on idle cores): how far either is from the f32 ceiling.

Last, one steady decode step of max_num_seqs rows is profiled: full jitted step, the step
with attention (and the KV write) swapped for no-ops, the model without the sampler, the
sampler alone, and host packing; shares are rough (separately timed parts, noisy machine).
What is printed and the docs' tables come from scripts/throughput_report.py.

Usage:
    python scripts/bench_throughput.py --json /tmp/throughput.json
    python scripts/bench_throughput.py --num-requests 8 --no-hf --model PATH
    python scripts/bench_throughput.py --no-hf --vllm-python ~/venvs/vllm-cpu/bin/python
    python scripts/bench_throughput.py --exec-cache /tmp/exe   # twice: the second warm-up loads its executables
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import paxpage  # noqa: E402
import vllm_peer  # noqa: E402
import workload as wl  # noqa: E402
from paxpage import attention_impl, compile_counter, process_tuning  # noqa: E402
from step_profile import profile_decode_step  # noqa: E402
from throughput_pass import FIRST_TOKENS, rates, run_paxpage  # noqa: E402
# the peers (scripts/throughput_peers.py) and the run's figures (scripts/throughput_report.py);
# the tests reach them as bench_throughput.<name>
from throughput_peers import run_hf, same_tokens, start_vllm, vllm_pass  # noqa: E402
from throughput_report import (doc_charts, doc_tables, matmul_ceiling, print_pass, print_profile,  # noqa: E402
                               sgemm_gflops, vllm_summary)


def compare_batch_invariant(model, work: wl.Workload, cfg: paxpage.EngineConfig, default_pass, args) -> dict:
    """The workload on EngineConfig(batch_invariant=True) beside the default: a warm-up, then
    `args.repeats` passes of each, interleaved so both see the same machine load; the fastest of
    each counts. Returns both walls and their ratio (invariant / default time)."""
    inv_cfg = dataclasses.replace(cfg, batch_invariant=True)
    t = time.perf_counter()
    run_paxpage(model, work.with_fresh_prompts(model.config.vocab_size, args.seed + 104729), inv_cfg)
    print(f"batch-invariant warm-up: {time.perf_counter() - t:.1f} s (engine build included)", flush=True)
    inv, default = [], []
    for k in range(args.repeats):
        w = work if k == 0 else work.with_fresh_prompts(model.config.vocab_size, args.seed + 104729 * (k + 1))
        result = run_paxpage(model, w, inv_cfg)
        result.update(rates(w, result["wall_s"]))
        inv.append(result)
        default.append(default_pass(k + args.repeats))
    best_inv = min(r["wall_s"] for r in inv)
    best_default = min(r["wall_s"] for r in default)
    ratio = best_inv / best_default
    print(f"default: {best_default:.2f} s, {max(r['output_tok_per_s'] for r in default):.1f} output tok/s | "
          f"batch-invariant: {best_inv:.2f} s, {max(r['output_tok_per_s'] for r in inv):.1f} output tok/s | "
          f"time ratio batch-invariant / default: {ratio:.2f}x (fastest of {args.repeats} passes each)",
          flush=True)
    return {"default_wall_s": best_default, "invariant_wall_s": best_inv, "time_ratio": ratio,
            "invariant_passes": inv, "default_passes": default}


def main(argv=None) -> int:
    defaults = wl.backend_defaults()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    wl.add_workload_args(parser, defaults)
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--prefill-row-len", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="default: the workload's longest request rounded up to a power of two")
    memory = parser.add_mutually_exclusive_group()
    memory.add_argument("--kv-cache-bytes", type=int, default=None, help="default: the engine's (1 GiB)")
    memory.add_argument("--num-pages", type=int, default=None)
    parser.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    parser.add_argument("--hf-batch-sizes", type=int, nargs="+", default=list(defaults.hf_batch_sizes))
    parser.add_argument("--hf-threads", type=int, default=None,
                        help="torch threads; default: the faster of all cores and 1, timed")
    parser.add_argument("--repeats", type=int, default=2,
                        help="measured paxpage passes (first before, the rest after HF); the fastest counts")
    parser.add_argument("--allow-compiles", action="store_true",
                        help="do not fail when the measured pass compiles")
    parser.add_argument("--no-profile", action="store_true", help="skip the decode-step profile")
    parser.add_argument("--profile-iters", type=int, default=5)
    parser.add_argument("--precompile", action="store_true",
                        help="compile every step shape when the engine is built (EngineConfig.precompile)")
    parser.add_argument("--xla-cache", metavar="DIR", default=None,
                        help="jax's persistent compilation cache directory (paxpage/xla_cache.py); off by default")
    parser.add_argument("--exec-cache", metavar="DIR", default=None,
                        help="paxpage's executable cache (EngineConfig.executable_cache_dir, which `paxpage "
                             "generate` and `paxpage serve` use by default); off by default. A second run "
                             "with the same DIR warms up from it, as vLLM's warm-up follows its cached "
                             "torch.compile")
    parser.add_argument("--attention-impl", default=None, choices=list(attention_impl.NAMES),
                        help="the engine's attention (default: the backend's, native on CPU)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="also time EngineConfig(batch_invariant=True) on the same workload, passes "
                             "interleaved with the default's, and print the two side by side")
    parser.add_argument("--json", metavar="PATH", help="write every figure here")
    vllm_peer.add_args(parser)
    args = parser.parse_args(argv)

    compile_counter.install()
    # numpy's f32 matmul rate before anything else runs (a vLLM peer's idle process, or XLA's
    # threads just after a step, would share the cores)
    args.sgemm_gflops = sgemm_gflops()
    if args.xla_cache:
        from paxpage import xla_cache

        print(f"persistent compilation cache: {xla_cache.enable(args.xla_cache)}", flush=True)
    t = time.perf_counter()
    model = paxpage.load(args.model)
    print(f"loaded {args.model or 'SmolLM2-135M-Instruct'} in {time.perf_counter() - t:.1f} s "
          f"(backend {jax.default_backend()})", flush=True)
    work = wl.workload_from_args(args, model.config.vocab_size)
    longest = max(p + o for p, o in zip(work.prompt_lens, work.output_lens))
    max_model_len = args.max_model_len or min(model.config.max_position_embeddings,
                                              1 << (longest - 1).bit_length())
    cfg = paxpage.EngineConfig(page_size=args.page_size, prefill_row_len=args.prefill_row_len,
                               max_num_seqs=args.max_num_seqs,
                               max_num_batched_tokens=args.max_num_batched_tokens,
                               max_model_len=max_model_len, kv_cache_bytes=args.kv_cache_bytes,
                               num_pages=args.num_pages, precompile=args.precompile,
                               attention_impl=args.attention_impl, executable_cache_dir=args.exec_cache)
    summary = work.summary()
    print(f"workload: {summary['num_requests']} requests, {summary['prompt_tokens']} prompt + "
          f"{summary['output_tokens']} output tokens; prompt len median {summary['prompt_len']['median']:.0f} "
          f"(max {summary['prompt_len']['max']}), output len median {summary['output_len']['median']:.0f} "
          f"(max {summary['output_len']['max']})", flush=True)

    t = time.perf_counter()
    c0, s0 = compile_counter.compiles(), compile_counter.compile_seconds()
    h0, m0 = compile_counter.cache_hits(), compile_counter.cache_misses()
    run_paxpage(model, work.with_fresh_prompts(model.config.vocab_size, args.seed + 7919), cfg)
    wall = time.perf_counter() - t
    model.engine(cfg).wait_for_compiles()  # the shapes its shrinking tail borrowed, compiled meanwhile
    warm = {"wall_s": wall, "background_compile_s": time.perf_counter() - t - wall,
            "compiles": compile_counter.compiles() - c0,
            "compile_s": compile_counter.compile_seconds() - s0,
            "cache_hits": compile_counter.cache_hits() - h0, "cache_misses": compile_counter.cache_misses() - m0,
            "precompiled": model.engine(cfg).precompiled, "executable_cache": wl.exec_cache_stats(model.engine(cfg))}
    print(f"paxpage warm-up: {warm['wall_s']:.1f} s (engine build included; background compiles "
          f"{warm['background_compile_s']:.1f} s more), {warm['compiles']} compiles "
          f"({warm['compile_s']:.1f} s), persistent cache {warm['cache_hits']} hits / {warm['cache_misses']} "
          f"misses" + (f", precompiled {warm['precompiled'][0]} shapes in {warm['precompiled'][1]:.1f} s"
                       if warm["precompiled"] else "")
          + (f"; executable cache {warm['executable_cache']}" if warm["executable_cache"] else ""), flush=True)
    process_tuning.freeze_startup_heap()  # as paxpage serve does once its engine is built

    vllm, vllm_info = start_vllm(args, cfg, work.with_fresh_prompts(model.config.vocab_size, args.seed + 7919))
    try:
        return _measure(args, model, cfg, work, summary, warm, vllm, vllm_info)
    finally:
        if vllm is not None:
            vllm.close()


def _measure(args, model, cfg, work, summary, warm, vllm, vllm_info) -> int:
    vllm_passes = []

    def measured_pass(k: int) -> dict:
        # Pass k > 0 gets fresh prompts of the same lengths: no prefix-cache hits on earlier passes.
        c0 = compile_counter.compiles()
        w = work if k == 0 else work.with_fresh_prompts(model.config.vocab_size, args.seed + 7919 * (k + 1))
        result = run_paxpage(model, w, cfg)
        result.update(rates(w, result["wall_s"]), compiles=compile_counter.compiles() - c0)
        print_pass(k, result)
        if vllm is not None:  # the same prompts, right after: the same machine load for both
            v = vllm_pass(vllm, w)
            v["same_first_tokens"] = same_tokens(result["first_tokens"], v.pop("first_tokens"))
            vllm_passes.append(v)
            print(f"vLLM pass {k}: {v['requests_per_s']:.2f} req/s, {v['output_tok_per_s']:.1f} output tok/s, "
                  f"{v['total_tok_per_s']:.1f} total tok/s ({v['wall_s']:.1f} s); first {FIRST_TOKENS} "
                  f"tokens equal to paxpage's in {v['same_first_tokens']:.0%} of requests", flush=True)
        result.pop("first_tokens")
        return result

    # Passes alternate with the HF sweep so that both see similar machine load (noisy machine).
    passes = [measured_pass(0)]
    hf = None
    if not args.no_hf:
        print("HF transformers baseline:", flush=True)
        hf = run_hf(args.model, work, args.hf_batch_sizes, args.hf_threads)
    passes += [measured_pass(k) for k in range(1, args.repeats)]
    pax = dict(max(passes, key=lambda r: r["output_tok_per_s"]))
    pax["passes_output_tok_per_s"] = [r["output_tok_per_s"] for r in passes]
    compiles_after = sum(r["compiles"] for r in passes)
    print(f"paxpage (fastest of {len(passes)} passes): {pax['output_tok_per_s']:.1f} output tok/s; "
          f"compiles after warm-up: {compiles_after}", flush=True)
    ratio = pax["output_tok_per_s"] / hf["output_tok_per_s"] if hf else None
    if hf:
        print(f"HF (batch {hf['best_batch_size']}): {hf['requests_per_s']:.2f} req/s, "
              f"{hf['output_tok_per_s']:.1f} output tok/s, {hf['total_tok_per_s']:.1f} total tok/s", flush=True)
        print(f"ratio paxpage / HF (output tok/s): {ratio:.2f}x", flush=True)
    vllm_record, vllm_ratios = None, None
    if vllm_passes:
        vllm_record, vllm_ratios = vllm_summary(pax, passes, vllm_passes, vllm_info, warm)

    # How far the passes are from this machine's f32 matmul rate (the matmuls are most of a step)
    matmuls = matmul_ceiling(model.config, work, pax, vllm_record, args.sgemm_gflops)

    invariant = compare_batch_invariant(model, work, cfg, measured_pass, args) if args.batch_invariant else None

    profile = None
    if not args.no_profile:
        context = int(np.mean(work.prompt_lens) + np.mean(work.output_lens) / 2)
        profile = profile_decode_step(model, cfg, context, args.profile_iters)
        print_profile(profile)

    if args.json:
        data = {
            "backend": jax.default_backend(), "model": args.model or "SmolLM2-135M-Instruct",
            "workload": summary, "engine_config": dataclasses.asdict(cfg),
            "paxpage": pax, "warmup": warm, "hf": hf, "ratio": ratio,
            "vllm": vllm_record, "ratio_paxpage_over_vllm": vllm_ratios,
            "compiles_after_warmup": compiles_after, "profile": profile, "batch_invariant": invariant,
            "matmuls": matmuls,
        }
        wl.write_json(args.json, data, tables=doc_tables(data), charts=doc_charts(data))
    if compiles_after and not args.allow_compiles:
        print(f"FAIL: {compiles_after} XLA compiles during the measured pass (after warm-up): a shape "
              "escaped its bucket. Pass --allow-compiles to ignore.", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    from paxpage.process_tuning import tune_malloc

    tune_malloc()  # glibc keeps large freed buffers for reuse (paxpage/process_tuning.py)
    sys.exit(main())
