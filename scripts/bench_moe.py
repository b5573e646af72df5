"""MoE throughput: grouped expert matmuls against dense-over-experts, side by side on one model.

A tiny-but-not-trivial Qwen3-MoE-shaped model with random weights (default: 4 layers, hidden 256,
32 experts of width 256, top 4, vocabulary 2048) runs the same offline workload through the engine
once per MoE implementation (models/moe.py), on the same weights:
    grouped  --impl (default "auto": jax.lax.ragged_dot on TPU, the tiled jnp grouped matmul on
             CPU / GPU, where ragged_dot lowers to a product over every expert for every row)
    dense    every expert on every token, combined with the routing weights
Each system gets a warm-up pass (every step shape compiles), then --repeats measured passes,
interleaved so both see the same machine load; the fastest pass counts. All requests are
queued at t=0 with random prompt ids, greedy, EOS ignored. Also timed: the MoE MLP alone at
a decode-sized and a prefill-sized token count, and how many greedy outputs are identical.

Usage:
    python scripts/bench_moe.py --json /tmp/moe.json
    python scripts/bench_moe.py --experts 8 --top-k 2 --num-requests 8   # smaller
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import paxpage  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from models.moe import moe_mlp, resolve_impl  # noqa: E402
from models.param_layout import param_shapes  # noqa: E402
from paxpage import compile_counter  # noqa: E402
from paxpage.engine import LLMEngine  # noqa: E402


def moe_config(args) -> ModelConfig:
    return ModelConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_layers=args.layers, num_heads=8, num_kv_heads=2, head_dim=args.hidden // 8,
        qk_norm=True, max_position_embeddings=4096, model_type="qwen3_moe",
        num_experts=args.experts, num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.expert_width, norm_topk_prob=True)


def random_params(cfg: ModelConfig, seed: int) -> dict:
    """Normal weights scaled by 1/sqrt(fan-in); norm scales 1."""
    rng = np.random.default_rng(seed)

    def init(shape):
        if len(shape) == 1:
            return np.ones(shape, np.float32)
        fan_in = shape[-2] if len(shape) > 1 else 1
        return (rng.standard_normal(shape, np.float32) / np.sqrt(fan_in)).astype(np.float32)

    return jax.tree.map(init, param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))


def engine_for(cfg, params, impl: str, args) -> LLMEngine:
    ecfg = paxpage.EngineConfig(max_num_seqs=args.max_num_seqs, page_size=16,
                                num_pages=args.num_requests * (args.prompt_len + args.output_len) // 16 + 64)
    engine = LLMEngine(cfg, params, None, ecfg)
    # The runner builds the model with moe_impl="auto"; swap in the variant before anything is
    # traced (the jitted step reads runner.model when it first compiles).
    engine.runner.model = engine.runner.model.clone(moe_impl=impl)
    return engine


def run_pass(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    params = paxpage.SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    outputs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, index=i)
    while engine.has_unfinished():
        for request, deltas in engine.step():
            for d in deltas:
                outputs[request.index].extend(d.token_ids)
    wall = time.perf_counter() - start
    return wall, [outputs[i] for i in range(len(prompts))]


def time_layer(cfg, params, impl: str, num_tokens: int, repeats: int = 5) -> float:
    """Best-of wall ms of one jitted MoE MLP on layer 0's weights."""
    moe = params["layers_0"]["moe"]
    x = jnp.asarray(np.random.default_rng(num_tokens).standard_normal((num_tokens, cfg.hidden_size), np.float32))
    fn = jax.jit(lambda x, r, g, d: moe_mlp(x, r, g, d, top_k=cfg.num_experts_per_tok,
                                              renormalize=cfg.norm_topk_prob, impl=impl))
    w = [jnp.asarray(moe[k]) for k in ("router", "gate_up_proj", "down_proj")]
    fn(x, *w).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn(x, *w).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def doc_tables(result: dict) -> dict:
    """The docs' table (docs/benchmarks.md): one row for the model measured."""
    m = result["model"]
    grouped = result["grouped_impl"]
    systems = result["systems"]
    layer = " / ".join(f"{ms['dense'] / ms[grouped]:.1f}x" for _, ms in sorted(result["moe_layer_ms"].items(),
                                                                              key=lambda kv: int(kv[0])))
    row = [f"{m['num_experts']} experts of width {m['moe_intermediate_size']}, top {m['num_experts_per_tok']}",
           round(systems[grouped]["output_tok_s"]), round(systems["dense"]["output_tok_s"]),
           f"{result['ratio_output_tok_s']:.1f}x", layer]
    tokens = " / ".join(str(n) for n in sorted(int(n) for n in result["moe_layer_ms"]))
    w = result["workload"]
    caption = (f"Engine output tok/s on a Qwen3-MoE-shaped model with random weights ({m['num_layers']} layers, "
               f"hidden {m['hidden_size']}, vocabulary {m['vocab_size']}; {w['num_requests']} requests of "
               f"{w['prompt_len']} prompt + {w['output_len']} output tokens; greedy outputs identical: "
               f"{result['identical_greedy_outputs']}; compiles after warm-up: {result['compiles_after_warmup']})")
    return {"moe": {"caption": caption, "columns": ["model", f"grouped ({grouped})", "dense over experts", "ratio",
                                                    f"MoE MLP alone, {tokens} tokens"], "rows": [row]}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--impl", default="auto", help="grouped implementation: auto, ragged_dot or tiled")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--expert-width", type=int, default=256)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layer-tokens", default="32,512", help="token counts at which to time the MoE MLP alone")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    grouped = resolve_impl(args.impl)
    if grouped == "dense":
        p.error("--impl is the grouped side; dense is always the baseline")

    cfg = moe_config(args)
    params = random_params(cfg, args.seed)
    rng = np.random.default_rng(args.seed + 1)

    def prompts():
        return [rng.integers(0, cfg.vocab_size, args.prompt_len).tolist() for _ in range(args.num_requests)]

    compile_counter.install()
    impls = (grouped, "dense")
    engines = {impl: engine_for(cfg, params, impl, args) for impl in impls}
    warm = prompts()
    warmup_s = {}
    for impl in impls:
        t = time.perf_counter()
        run_pass(engines[impl], warm, args.output_len)
        warmup_s[impl] = time.perf_counter() - t
    compiles0 = compile_counter.compiles()
    walls = {impl: [] for impl in impls}
    outs = {}
    for r in range(args.repeats):
        work = prompts()
        for impl in (impls if r % 2 == 0 else impls[::-1]):
            wall, outs[impl] = run_pass(engines[impl], work, args.output_len)
            walls[impl].append(wall)
    compiles = compile_counter.compiles() - compiles0

    out_tokens = args.num_requests * args.output_len
    total_tokens = args.num_requests * (args.prompt_len + args.output_len)
    result = {
        "backend": jax.default_backend(), "grouped_impl": grouped,
        "model": {k: getattr(cfg, k) for k in ("num_layers", "hidden_size", "num_experts",
                                              "num_experts_per_tok", "moe_intermediate_size", "vocab_size")},
        "workload": {k: getattr(args, k) for k in ("num_requests", "prompt_len", "output_len", "max_num_seqs")},
        "compiles_after_warmup": compiles, "warmup_s": warmup_s, "systems": {},
    }
    print(f"backend {result['backend']}; model {result['model']}; workload {result['workload']}")
    print(f"{'system':>12} {'best wall s':>12} {'output tok/s':>13} {'total tok/s':>12}")
    for impl in impls:
        best = min(walls[impl])
        result["systems"][impl] = {"walls_s": walls[impl], "output_tok_s": out_tokens / best,
                                   "total_tok_s": total_tokens / best}
        print(f"{impl:>12} {best:12.2f} {out_tokens / best:13.1f} {total_tokens / best:12.1f}")
    ratio = result["systems"][grouped]["output_tok_s"] / result["systems"]["dense"]["output_tok_s"]
    same = sum(a == b for a, b in zip(outs[grouped], outs["dense"]))
    result["ratio_output_tok_s"] = ratio
    result["identical_greedy_outputs"] = f"{same}/{args.num_requests}"
    print(f"{grouped} / dense output tok/s: {ratio:.2f}x; identical greedy outputs {same}/{args.num_requests}; "
          f"compiles after warm-up {compiles}")

    layer = {}
    for num_tokens in [int(n) for n in args.layer_tokens.split(",") if n]:
        layer[num_tokens] = {impl: time_layer(cfg, params, impl, num_tokens) for impl in impls}
        ms = layer[num_tokens]
        print(f"MoE MLP alone, {num_tokens} tokens: {grouped} {ms[grouped]:.2f} ms, dense {ms['dense']:.2f} ms "
              f"({ms['dense'] / ms[grouped]:.2f}x)")
    result["moe_layer_ms"] = layer
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from provenance import write_record  # the figures with machine, versions, date, command, commit

        write_record(args.json, result, doc_tables(result))
    return 0


if __name__ == "__main__":
    from paxpage.process_tuning import tune_malloc

    tune_malloc()  # glibc keeps large freed buffers for reuse (paxpage/process_tuning.py)
    sys.exit(main())
