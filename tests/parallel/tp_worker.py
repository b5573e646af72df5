"""Runs in a subprocess with forced host devices (XLA_FLAGS set by the caller before jax starts):
generates with several tensor-parallel sizes and prints one JSON object on its last line.

    python -m tests.parallel.tp_worker MODEL_DIR_OR_default TP,TP,... MAX_TOKENS [--pallas] [--sampling] [--one]

--one: only the second prompt (19 tokens), for the real model's shorter run.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> None:
    source, sizes, max_tokens = argv[0], [int(x) for x in argv[1].split(",")], int(argv[2])
    import jax

    import paxpage
    from paxpage import compile_counter

    model = paxpage.load(None if source == "default" else source)
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
        # Scanned layers (the XLA path's default): the pool is one stacked [2, L, P, ...] array and
        # the layer params are stacked [L, ...]; report one layer's view of both, and the layer
        # axis's own split (it must be none).
        pool = runner.kv_cache if runner.scanned else runner.kv_cache[0]
        layer_axis = 1 if runner.scanned else None
        spec = list(getattr(pool.sharding, "spec", ()))
        spec += [None] * (pool.ndim - len(spec))

        def drop(dims, axis):
            return [d for i, d in enumerate(dims) if i != axis]

        result["kv"][tp] = {"spec": drop(spec, layer_axis), "shape": drop(pool.shape, layer_axis),
                            "shard_shapes": [drop(s.data.shape, layer_axis) for s in pool.addressable_shards],
                            "devices": len(pool.sharding.device_set), "scanned": runner.scanned,
                            "layer_axis_split": None if layer_axis is None else spec[layer_axis]}
        layer0 = runner.params["layers"]["0"] if runner.scanned else runner.params["layers_0"]
        param_axis = 0 if runner.scanned else None
        q = layer0["q_proj"]["kernel"]
        up = layer0["up_proj"]["kernel"]
        from paxpage.mesh import bytes_per_device
        from paxpage.sharding import ShardingPlan, param_bytes_per_device

        itemsize = jax.numpy.dtype(runner.cfg.dtype).itemsize
        result["weight_bytes"][tp] = {
            "measured": sorted(set(bytes_per_device(runner.params).values())),
            "rules": param_bytes_per_device(model.config, ShardingPlan.for_model(model.config, tp), itemsize)}
        result["params"][tp] = {"q_proj": [drop(s.data.shape, param_axis) for s in q.addressable_shards],
                                "up_proj": [drop(s.data.shape, param_axis) for s in up.addressable_shards],
                                "layer_axis_split": (list(getattr(q.sharding, "spec", ())) + [None])[0]}
        model.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
