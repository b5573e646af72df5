"""Runs in a subprocess with forced host devices (XLA_FLAGS set by the caller before jax starts):
generates with several tensor-parallel sizes and prints one JSON object on its last line.

    python -m tests.parallel.tp_worker MODEL_DIR_OR_default TP,TP,... MAX_TOKENS [--pallas] [--sampling] [--one] [--int8-weights]

--one: only the second prompt (19 tokens), for the real model's shorter run.
--int8-weights: load with quantization="int8" (quantised weights shard like float ones; weight_bytes then
counts int8 values and f32 scales, so its "rules" figure, which assumes one float dtype, differs).
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> None:
    source, sizes, max_tokens = argv[0], [int(x) for x in argv[1].split(",")], int(argv[2])
    import jax

    import paxpage
    from paxpage import compile_counter

    model = paxpage.load(None if source == "default" else source,
                         quantization="int8" if "--int8-weights" in argv else None)
    vocab = model.config.vocab_size
    prompts = [[(7 * i + 3) % vocab for i in range(n)] for n in ((19,) if "--one" in argv else (5, 19, 40))]
    impl = "pallas-interpret" if "--pallas" in argv else None
    result = {"num_devices": jax.device_count(), "greedy": {}, "sampled": {}, "kv": {}, "params": {}, "weight_bytes": {}, "recompiles": {}}
    for tp in sizes:
        config = paxpage.EngineConfig(tensor_parallel_size=tp, num_pages=48, page_size=4, max_num_seqs=4,
                                      max_num_batched_tokens=64, prefill_row_len=8, attention_impl=impl)
        outs = paxpage.generate(model, prompts, engine_config=config, max_tokens=max_tokens, temperature=0,
                                ignore_eos=True, use_tqdm=False)
        result["greedy"][tp] = [o.outputs[0].token_ids for o in outs]
        # the same shapes again (other tokens, so no prefix-cache hits): the pool kept its
        # sharding through the donated steps, so nothing recompiles
        before = compile_counter.compiles()
        paxpage.generate(model, [[(t + 1) % vocab for t in p] for p in prompts], engine_config=config,
                         max_tokens=max_tokens, temperature=0, ignore_eos=True, use_tqdm=False)
        result["recompiles"][tp] = compile_counter.compiles() - before
        if "--sampling" in argv:
            outs = paxpage.generate(model, prompts, engine_config=config, max_tokens=max_tokens,
                                    temperature=0.9, top_p=0.95, seed=11, ignore_eos=True, use_tqdm=False)
            result["sampled"][tp] = [o.outputs[0].token_ids for o in outs]
        runner = model.engine(config).runner
        pool = runner.kv_cache[0]
        spec = list(getattr(pool.sharding, "spec", ()))
        result["kv"][tp] = {"spec": spec + [None] * (pool.ndim - len(spec)),
                            "shape": list(pool.shape),
                            "shard_shapes": [list(s.data.shape) for s in pool.addressable_shards],
                            "devices": len(pool.sharding.device_set)}
        layer = runner.params["layers_0"]
        q, up = (layer[name].get("kernel", layer[name].get("kernel_q")) for name in ("q_proj", "up_proj"))
        from paxpage.mesh import bytes_per_device
        from paxpage.sharding import ShardingPlan, param_bytes_per_device

        itemsize = jax.numpy.dtype(runner.cfg.dtype).itemsize
        result["weight_bytes"][tp] = {
            "measured": sorted(set(bytes_per_device(runner.params).values())),
            "rules": param_bytes_per_device(model.config, ShardingPlan.for_model(model.config, tp), itemsize)}
        result["params"][tp] = {"q_proj": [list(s.data.shape) for s in q.addressable_shards],
                                "up_proj": [list(s.data.shape) for s in up.addressable_shards]}
        model.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
