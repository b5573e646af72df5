"""Page sharing: prefix caching throughput, and KV pages saved by parallel sampling and beams.

    python scripts/bench_sharing.py --json /tmp/sharing.json

1. A shared-prefix workload (every prompt starts with the same system prompt) runs with
   prefix caching on and off, side by side: output tok/s, prefix hit rate, identical tokens.
2. n=4 parallel samples and beam width 4 on one long prompt: peak pages in use, against
   n=1 (and 4x n=1, what four unshared copies would hold).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import workload as wl  # noqa: E402

import paxpage  # noqa: E402
from paxpage import SamplingParams  # noqa: E402


def _run(model, prompts, warmup_prompts, max_tokens, config):
    engine = model.engine(config)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    # The warm-up compiles the shapes; with caching on it also leaves the shared prefix (not
    # the measured prompts' own suffixes) cached, as a running server would have it.
    paxpage.generate(model, warmup_prompts, sampling_params=params, engine_config=config, use_tqdm=False)
    start = time.perf_counter()
    outs = paxpage.generate(model, prompts, sampling_params=params, engine_config=config, use_tqdm=False)
    wall = time.perf_counter() - start
    stats = engine.scheduler.stats()
    return outs, sum(len(o.token_ids) for o in outs) / wall, stats.prefix_hit_rate


def prefix_caching(model, args):
    rng_lengths = wl.sharegpt_lengths(args.num_requests, args.seed, (8, 48), (8, 16))
    lengths = [(args.prefix + p, args.max_tokens) for p, _ in rng_lengths]
    work = wl.make_workload(lengths, model.config.vocab_size, args.seed, shared_prefix=args.prefix)
    vocab = model.config.vocab_size
    warmup = [p[:args.prefix] + [(t + 1) % vocab for t in p[args.prefix:]] for p in work.prompts]
    results = {}
    for on in (False, True):
        config = paxpage.EngineConfig(enable_prefix_caching=on, max_num_seqs=args.max_num_seqs)
        outs, tok_s, hit = _run(model, work.prompts, warmup, args.max_tokens, config)
        results["on" if on else "off"] = dict(output_tok_s=tok_s, prefix_hit_rate=hit,
                                              tokens=[o.token_ids for o in outs])
        print(f"prefix caching {'on ' if on else 'off'}: {tok_s:7.1f} output tok/s, hit rate {hit:.1%}")
    same = results["on"].pop("tokens") == results["off"].pop("tokens")
    ratio = results["on"]["output_tok_s"] / results["off"]["output_tok_s"]
    print(f"  identical greedy tokens: {same}; on / off: {ratio:.2f}x")
    return dict(results, identical_tokens=same, ratio=ratio, num_requests=args.num_requests,
                shared_prefix_tokens=args.prefix)


def peak_pages(model, prompt, params):
    config = paxpage.EngineConfig(enable_prefix_caching=False, num_pages=1024)
    engine = model.engine(config)
    engine.add_request(prompt, params)
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.scheduler.stats().num_used_pages)
    return peak


def fork_sharing(model, args):
    prompt = wl.make_workload([(args.fork_prompt, 1)], model.config.vocab_size, args.seed).prompts[0]
    one = peak_pages(model, prompt, SamplingParams(max_tokens=args.fork_tokens, temperature=0,
                                                   ignore_eos=True))
    n4 = peak_pages(model, prompt, SamplingParams(n=4, max_tokens=args.fork_tokens, temperature=1.0,
                                                  seed=0, ignore_eos=True))
    beam4 = peak_pages(model, prompt, SamplingParams(beam_width=4, max_tokens=args.fork_tokens))
    print(f"{args.fork_prompt}-token prompt, {args.fork_tokens} new tokens: peak pages n=1 {one}, "
          f"n=4 {n4} (unshared {4 * one}), beam 4 {beam4} (unshared {4 * one})")
    return dict(prompt_tokens=args.fork_prompt, new_tokens=args.fork_tokens, pages_n1=one,
                pages_n4=n4, pages_beam4=beam4, pages_unshared_x4=4 * one,
                saved_n4=1 - n4 / (4 * one), saved_beam4=1 - beam4 / (4 * one))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prefix", type=int, default=256, help="shared system-prompt tokens")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--fork-prompt", type=int, default=200)
    parser.add_argument("--fork-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    model = paxpage.load(args.model)
    result = dict(prefix_caching=prefix_caching(model, args), forks=fork_sharing(model, args))
    if args.json:
        wl.write_json(args.json, result, tables=doc_tables(result))
    return 0


def doc_tables(result: dict) -> dict:
    """The docs' table (docs/benchmarks.md): each measurement without and with sharing."""
    p, f = result["prefix_caching"], result["forks"]
    rows = [
        [f"{p['num_requests']} requests behind one {p['shared_prefix_tokens']}-token prefix: output tok/s "
         f"(prefix hit rate {p['on']['prefix_hit_rate']:.0%}; greedy tokens identical: {p['identical_tokens']})",
         round(p["off"]["output_tok_s"], 1), f"{p['on']['output_tok_s']:.1f} ({p['ratio']:.2f}x)"],
        [f"n = 4 parallel samples, {f['prompt_tokens']}-token prompt, {f['new_tokens']} new tokens: peak KV pages",
         f"{f['pages_unshared_x4']} (4 x n = 1's {f['pages_n1']})", f"{f['pages_n4']} ({f['saved_n4']:.0%} saved)"],
        ["beam width 4, same prompt: peak KV pages", f["pages_unshared_x4"],
         f"{f['pages_beam4']} ({f['saved_beam4']:.0%} saved)"],
    ]
    return {"sharing": {"columns": ["measurement", "without sharing", "with sharing"], "rows": rows}}


if __name__ == "__main__":
    from paxpage.process_tuning import tune_malloc

    tune_malloc()  # glibc keeps large freed buffers for reuse (paxpage/process_tuning.py)
    sys.exit(main())
