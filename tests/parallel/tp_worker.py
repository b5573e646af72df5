"""Runs in a subprocess with forced host devices (XLA_FLAGS set by the caller before jax starts):
generates with several tensor-parallel sizes and prints one JSON object on its last line.

    python -m tests.parallel.tp_worker MODEL_DIR_OR_default TP,TP,... MAX_TOKENS [--pallas] [--sampling] [--one]
        [--eight] [--dp] [--int8-kv] [--int8-weights]

--sampling: also a seeded sampled run ("sampled"): temperature 0.9, top_p 0.95, seed 11; with --eight
temperature 1.0 and seed 11 alone (the default sampler, no filter).
--one: only the second prompt (19 tokens), for the real model's shorter run.
--eight: eight prompts (the second is --one's), a pool and batch that hold them all, and no repeated run
(no "recompiles").
--dp: one more layout, data_parallel_size 2 at tp 1, reported under the key "dp2".
--int8-kv: an int8 KV cache ("kv" describes its pages, "kv_scales" its scales).
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
    eight = "--eight" in argv
    if eight:  # offsets 13 k keep the prompts apart (no shared pages)
        prompts = [[(7 * i + 3 + 13 * k) % vocab for i in range(n)]
                   for k, n in zip((1, 0, 2, 3, 4, 5, 6, 7), (5, 19, 40, 11, 27, 8, 33, 16))]
    else:
        prompts = [[(7 * i + 3) % vocab for i in range(n)] for n in ((19,) if "--one" in argv else (5, 19, 40))]
    impl = "pallas-interpret" if "--pallas" in argv else None
    kv_cache_dtype = "int8" if "--int8-kv" in argv else "auto"
    sampling = dict(temperature=1.0, seed=11) if eight else dict(temperature=0.9, top_p=0.95, seed=11)
    result = {"num_devices": jax.device_count(), "greedy": {}, "sampled": {}, "kv": {}, "kv_scales": {}, "params": {},
              "weight_bytes": {}, "recompiles": {}}
    layouts = [(tp, 1, tp) for tp in sizes] + ([("dp2", 2, 1)] if "--dp" in argv else [])
    for name, dp, tp in layouts:
        config = paxpage.EngineConfig(tensor_parallel_size=tp, data_parallel_size=dp,
                                      num_pages=(8 * 80 // 4 if eight else 48), page_size=4,
                                      max_num_seqs=(8 if eight else 4), max_num_batched_tokens=64,
                                      prefill_row_len=8, attention_impl=impl, kv_cache_dtype=kv_cache_dtype)
        outs = paxpage.generate(model, prompts, engine_config=config, max_tokens=max_tokens, temperature=0,
                                ignore_eos=True, use_tqdm=False)
        result["greedy"][name] = [o.outputs[0].token_ids for o in outs]
        if not eight:
            # the same shapes again (other tokens, so no prefix-cache hits): the pool kept its
            # sharding through the donated steps, so nothing recompiles
            before = compile_counter.compiles()
            paxpage.generate(model, [[(t + 1) % vocab for t in p] for p in prompts], engine_config=config,
                             max_tokens=max_tokens, temperature=0, ignore_eos=True, use_tqdm=False)
            result["recompiles"][name] = compile_counter.compiles() - before
        if "--sampling" in argv:
            outs = paxpage.generate(model, prompts, engine_config=config, max_tokens=max_tokens,
                                    ignore_eos=True, use_tqdm=False, **sampling)
            result["sampled"][name] = [o.outputs[0].token_ids for o in outs]
        if dp > 1:  # data parallelism: the replicas' own layout is tp's, reported above
            model.close()
            continue
        runner = model.engine(config).runner
        # Scanned layers (the XLA path's default): the cache is one stacked [2, L, P, ...] pytree and
        # the layer params are stacked [L, ...]; report one layer's view of both, and the layer
        # axis's own split (it must be none).
        from pallas_kernels.kv_quant import split

        layer_axis = 1 if runner.scanned else None

        def drop(dims, axis):
            return [d for i, d in enumerate(dims) if i != axis]

        pool, scales = split(runner.kv_cache if runner.scanned else runner.kv_cache[0])
        for key, array in (("kv", pool), ("kv_scales", scales)):
            if array is None:
                continue
            spec = list(getattr(array.sharding, "spec", ()))
            spec += [None] * (array.ndim - len(spec))
            result[key][name] = {"spec": drop(spec, layer_axis), "shape": drop(array.shape, layer_axis),
                               "shard_shapes": [drop(s.data.shape, layer_axis) for s in array.addressable_shards],
                               "devices": len(array.sharding.device_set), "scanned": runner.scanned,
                               "layer_axis_split": None if layer_axis is None else spec[layer_axis]}
        layer0 = runner.params["layers"]["0"] if runner.scanned else runner.params["layers_0"]
        param_axis = 0 if runner.scanned else None
        # a MoE layer's expert gate_up_proj stands in for the dense MLP's up_proj
        mlp = layer0["up_proj"] if "up_proj" in layer0 else {"kernel": layer0["moe"]["gate_up_proj"]}
        # one device holds its kernels in column panels on CPU (models/panel_layout.py)
        q, up = (p.get("kernel", p.get("kernel_q", p.get("kernel_panels"))) for p in (layer0["q_proj"], mlp))
        from paxpage.mesh import bytes_per_device
        from paxpage.sharding import ShardingPlan, param_bytes_per_device

        itemsize = jax.numpy.dtype(runner.cfg.dtype).itemsize
        result["weight_bytes"][name] = {
            "measured": sorted(set(bytes_per_device(runner.params).values())),
            "rules": param_bytes_per_device(model.config, ShardingPlan.for_model(model.config, tp), itemsize)}
        result["params"][name] = {"q_proj": [drop(s.data.shape, param_axis) for s in q.addressable_shards],
                                "up_proj": [drop(s.data.shape, param_axis) for s in up.addressable_shards],
                                "layer_axis_split": (list(getattr(q.sharding, "spec", ())) + [None])[0]}
        model.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
