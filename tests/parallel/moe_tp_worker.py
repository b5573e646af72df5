"""Runs in a subprocess with forced host devices (XLA_FLAGS set by the caller before jax starts): a
mixture-of-experts model generated with several tensor-parallel sizes; prints one JSON object on
its last line.

    python -m tests.parallel.moe_tp_worker MODEL_DIR TP,TP,... MAX_TOKENS [--hlo] [--one] [--ep]

Per tp: "greedy" tokens and "logprobs" (each sampled token's) of three prompts (--one: only the
second, 19 tokens: fewer step shapes to compile), the "plan"
(ShardingPlan.describe), "experts" (the first MoE layer's expert leaves: each device's shard
shape), "weight_bytes" (measured from the placed arrays and by the shape rules). --hlo: also
"collectives", the compiled decode step's all-reduce / all-gather / reduce-scatter / all-to-all
counts, the shapes each all-gather produces, and the all-reduces inside a MoE block ("moe_all_reduces";
a scanned step holds one layer's body once). --ep: with expert parallelism (whole experts per
device).
"""

from __future__ import annotations

import json
import re
import sys


def collectives(hlo: str) -> dict:
    """Counts of the collectives in a compiled module's text (its async starts counted once)."""
    counts = {}
    for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all"):
        counts[op] = len(re.findall(rf"= \S+ {op}(?:-start)?\(", hlo))
    counts["all_gather_shapes"] = re.findall(r"= (\S+) all-gather(?:-start)?\(", hlo)
    counts["moe_all_reduces"] = len(re.findall(r"all-reduce(?:-start)?\(.*op_name=\"[^\"]*/moe/", hlo))
    return counts


def main(argv: list[str]) -> None:
    source, sizes, max_tokens = argv[0], [int(x) for x in argv[1].split(",")], int(argv[2])
    import jax

    import paxpage
    from paxpage.mesh import bytes_per_device
    from paxpage.sharding import ShardingPlan, param_bytes_per_device

    model = paxpage.load(source)
    cfg = model.config
    lengths = (19,) if "--one" in argv else (5, 19, 40)
    prompts = [[(7 * i + 3) % cfg.vocab_size for i in range(n)] for n in lengths]
    result = {"num_devices": jax.device_count(), "greedy": {}, "logprobs": {}, "plan": {}, "experts": {},
              "weight_bytes": {}, "collectives": {}}
    ep = "--ep" in argv
    for tp in sizes:
        config = paxpage.EngineConfig(tensor_parallel_size=tp, num_pages=48, page_size=4, max_num_seqs=4,
                                      max_num_batched_tokens=64, prefill_row_len=8, enable_expert_parallel=ep)
        outs = paxpage.generate(model, prompts, engine_config=config, max_tokens=max_tokens, temperature=0,
                                logprobs=0, ignore_eos=True, use_tqdm=False)
        result["greedy"][tp] = [o.outputs[0].token_ids for o in outs]
        result["logprobs"][tp] = [[next(iter(d.values())) for d in o.outputs[0].logprobs] for o in outs]
        runner = model.engine(config).runner
        plan = ShardingPlan.for_model(cfg, tp, ep)
        result["plan"][tp] = plan.describe()
        first = next(i for i in range(cfg.num_layers) if cfg.is_moe_layer(i))
        if runner.scanned:  # stacked [L, ...] leaves: drop the layer axis (never split)
            moe, drop = runner.params["layers"][str(first)]["moe"], 1
        else:
            moe, drop = runner.params[f"layers_{first}"]["moe"], 0
        result["experts"][tp] = {name: [list(s.data.shape[drop:]) for s in leaf.addressable_shards]
                                 for name, leaf in moe.items()}
        itemsize = jax.numpy.dtype(runner.cfg.dtype).itemsize
        # experts held quantised (gpt-oss's MXFP4: two 4-bit codes a byte, one f32 scale per G inputs)
        groups = {}
        for name in ("gate_up_proj", "down_proj"):
            if name + "_q" in moe:
                q, bits = moe[name + "_q"], 4 if moe[name + "_q"].dtype == jax.numpy.uint8 else 8
                groups[f"moe/{name}"] = (q.shape[-2] * 8 // bits // moe[name + "_scale"].shape[-2], bits)
        result["weight_bytes"][tp] = {"measured": sorted(set(bytes_per_device(runner.params).values())),
                                      "rules": param_bytes_per_device(cfg, plan, itemsize, groups)}
        if "--hlo" in argv:
            dec, pre = min(shape for shape in runner.step_shapes() if shape[1] == 0)
            result["collectives"][tp] = collectives(runner.lower_step(dec, pre).compile().as_text())
        model.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
