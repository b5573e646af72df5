"""Runs in a subprocess with forced host devices (XLA_FLAGS set by the caller before jax starts): a
latent-attention model (DeepSeek-V3) generated with several tensor-parallel sizes; prints one JSON
object on its last line.

    python -m tests.parallel.latent_tp_worker MODEL_DIR TP,TP,... MAX_TOKENS
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> None:
    source, sizes, max_tokens = argv[0], [int(x) for x in argv[1].split(",")], int(argv[2])
    import jax

    import paxpage
    from paxpage.mesh import bytes_per_device
    from paxpage.sharding import ShardingPlan, param_bytes_per_device

    model = paxpage.load(source)
    vocab = model.config.vocab_size
    prompts = [[(7 * i + 3) % vocab for i in range(n)] for n in (5, 19, 40)]
    result = {"num_devices": jax.device_count(), "greedy": {}, "pool": {}, "params": {}, "weight_bytes": {}}
    for tp in sizes:
        config = paxpage.EngineConfig(tensor_parallel_size=tp, num_pages=48, page_size=4, max_num_seqs=4,
                                      max_num_batched_tokens=32, prefill_row_len=8)
        outs = paxpage.generate(model, prompts, engine_config=config, max_tokens=max_tokens, temperature=0,
                                ignore_eos=True, use_tqdm=False)
        result["greedy"][tp] = [o.outputs[0].token_ids for o in outs]
        runner = model.engine(config).runner
        pool = runner.kv_cache[0]
        spec = list(getattr(pool.sharding, "spec", ()))
        result["pool"][tp] = {"shape": list(pool.shape), "spec": spec + [None] * (pool.ndim - len(spec)),
                              "shard_shapes": [list(s.data.shape) for s in pool.addressable_shards]}
        layer = runner.params["layers_1"]
        result["params"][tp] = {name: [list(s.data.shape) for s in layer[name]["kernel"].addressable_shards]
                                for name in ("kv_b_proj", "o_proj", "kv_a_proj_with_mqa")}
        itemsize = jax.numpy.dtype(runner.cfg.dtype).itemsize
        result["weight_bytes"][tp] = {
            "measured": sorted(set(bytes_per_device(runner.params).values())),
            "rules": param_bytes_per_device(model.config, ShardingPlan.for_model(model.config, tp), itemsize)}
        model.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
