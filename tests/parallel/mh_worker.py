"""One process of the multi-host test (2 processes x 2 forced host devices on 127.0.0.1): joins
the others with paxpage.multihost.initialize, builds a TP=4 engine over the global mesh;
process 0 generates and prints the tokens as JSON, process 1 follows.

    python -m tests.parallel.mh_worker COORDINATOR NUM_PROCESSES PROCESS_ID MODEL_DIR MAX_TOKENS
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> None:
    coordinator, num_processes, process_id, source, max_tokens = argv[0], int(argv[1]), int(argv[2]), argv[3], int(argv[4])
    from paxpage import multihost

    multihost.initialize(coordinator, num_processes, process_id, timeout_s=60)
    import jax

    import paxpage

    model = paxpage.load(source)
    vocab = model.config.vocab_size
    prompts = [[(7 * i + 3) % vocab for i in range(n)] for n in (5, 19)]
    config = paxpage.EngineConfig(tensor_parallel_size=4, num_pages=48, page_size=4, max_num_seqs=4,
                                  max_num_batched_tokens=64, prefill_row_len=8)
    result = {"process": process_id, "devices": jax.device_count(), "local_devices": jax.local_device_count()}
    if multihost.is_leader():
        outs = paxpage.generate(model, prompts, engine_config=config, max_tokens=max_tokens, temperature=0,
                                ignore_eos=True, use_tqdm=False)
        result["greedy"] = [o.outputs[0].token_ids for o in outs]
        # penalised rows stay in flight: the followers add the in-flight token to the counts too
        outs = paxpage.generate(model, prompts, engine_config=config, max_tokens=max_tokens, temperature=0,
                                repetition_penalty=1.8, ignore_eos=True, use_tqdm=False)
        result["penalised"] = [o.outputs[0].token_ids for o in outs]
        model.engine(config).runner.stop_followers()
    else:
        result["followed_steps"] = model.engine(config).runner.follow()
    runner = model.engine(config).runner
    # one layer's view: the scanned path's stacked pool [2, L, P, ...] less its (unsplit) layer axis
    pool = runner.kv_cache if runner.scanned else runner.kv_cache[0]
    result["kv_local_shards"] = [[d for i, d in enumerate(s.data.shape) if not (runner.scanned and i == 1)]
                                 for s in pool.addressable_shards]
    print(json.dumps(result), flush=True)
    model.close()
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
