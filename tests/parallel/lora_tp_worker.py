"""Runs in a subprocess with forced host devices: greedy tokens of a mixed LoRA batch (each
prompt on its adapter, one on the base) at several tensor-parallel sizes; prints one JSON
object on its last line.

    python -m tests.parallel.lora_tp_worker MODEL_DIR TP,TP,... MAX_TOKENS NAME=ADAPTER_DIR ...
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> None:
    source, sizes, max_tokens = argv[0], [int(x) for x in argv[1].split(",")], int(argv[2])
    import paxpage

    model = paxpage.load(source)
    names = []
    for item in argv[3:]:
        name, path = item.split("=", 1)
        model.load_lora(name, path)
        names.append(name)
    loras = names + [None]
    vocab = model.config.vocab_size
    prompts = [[(7 * i + 3 + 11 * k) % vocab for i in range(n)] for k, n in enumerate((5, 19, 12)[:len(loras)])]
    result = {"greedy": {}, "lora_b_shards": {}}
    for tp in sizes:
        config = paxpage.EngineConfig(tensor_parallel_size=tp, num_pages=48, page_size=4, max_num_seqs=4,
                                      max_num_batched_tokens=64, prefill_row_len=8, max_loras=1, max_lora_rank=8)
        outs = paxpage.generate(model, prompts, lora=loras, engine_config=config, max_tokens=max_tokens,
                                temperature=0, use_tqdm=False)
        result["greedy"][str(tp)] = [o.token_ids for o in outs]
        slab = model.engine(config).runner.lora_slab
        leaf = slab["layers"]["0"]["q_proj"]["lora_b"] if "layers" in slab else slab["layers_0"]["q_proj"]["lora_b"]
        result["lora_b_shards"][str(tp)] = [list(s.data.shape) for s in leaf.addressable_shards]
        model.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
