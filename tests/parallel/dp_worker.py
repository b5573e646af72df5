"""Subprocess worker for data parallelism (forced host devices set by the caller): runs the same
prompts on one engine and on data-parallel replicas and prints one JSON object.

    python -m tests.parallel.dp_worker MODEL_DIR MAX_TOKENS
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> None:
    source, max_tokens = argv[0], int(argv[1])
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import paxpage

    model = paxpage.load(source)
    shared = [(5 * i + 1) % 100 for i in range(16)]  # a 4-page prefix (page_size 4)
    prompts = [shared + [1, 2], [3] * 9, shared + [7], [11, 12, 13, 14, 15]]
    result = {}
    # an explicit mesh, devices in reverse order: replica 0 must run on devices 3 and 2
    reverse = Mesh(np.array(jax.devices()[::-1], dtype=object).reshape(2, 2), ("data", "model"))
    for name, tp, dp, mesh in (("one", 1, 1, None), ("dp2", 1, 2, None), ("dp2tp2", 2, 2, reverse)):
        config = paxpage.EngineConfig(tensor_parallel_size=tp, data_parallel_size=dp, mesh=mesh, num_pages=48, page_size=4,
                                      max_num_seqs=4, max_num_batched_tokens=64, prefill_row_len=8)
        greedy = paxpage.generate(model, prompts, engine_config=config, max_tokens=max_tokens, temperature=0,
                                  ignore_eos=True, use_tqdm=False)
        sampled = paxpage.generate(model, prompts, engine_config=config, max_tokens=max_tokens, temperature=1.0,
                                   seed=5, ignore_eos=True, use_tqdm=False)
        engines = model.replicas(config)
        result[name] = {
            "greedy": [o.outputs[0].token_ids for o in greedy],
            "sampled": [o.outputs[0].token_ids for o in sampled],
            # prompt tokens each replica received (both calls): shows where requests went
            "prompt_tokens": [e.stats.prompt_tokens for e in engines],
            "devices": [sorted(d.id for d in e.runner.kv_cache[0].sharding.device_set) for e in engines],
            # how each replica's dense layers multiply (paxpage/held_form.py)
            "matmul": [e.runner.matmul_impl for e in engines],
        }
        model.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
