"""Runs in a subprocess with forced host devices (XLA_FLAGS set by the caller before jax starts):
batch_invariant=True requests alone and batched, per layout, printing one JSON object on its last line.

    python -m tests.parallel.invariant_worker MODEL_DIR LAYOUT,LAYOUT,... [--default]

Layouts: "tp2" (tensor_parallel_size 2), "dp2" (two data-parallel replicas: the batched prompts
spread over both, each alone runs on the first). For each: "alone",
every prompt run by itself, and "batched", all of them together with chunked prefill beside decodes;
each an entry per prompt of [tokens, sampled-token logprobs]. --default: batch_invariant=False.
"""

from __future__ import annotations

import json
import sys

PROMPT_LENS = (23, 5, 17, 9)
LAYOUTS = {"tp2": dict(tensor_parallel_size=2), "dp2": dict(data_parallel_size=2)}


def main(argv: list[str]) -> None:
    import numpy as np

    import paxpage

    model = paxpage.load(argv[0])
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, model.config.vocab_size, size=n).tolist() for n in PROMPT_LENS]
    invariant = "--default" not in argv
    result = {}
    for name in argv[1].split(","):
        layout = LAYOUTS[name]
        config = paxpage.EngineConfig(batch_invariant=invariant, attention_impl="native", page_size=4,
                                      num_pages=96, max_model_len=48, max_num_seqs=4, max_num_batched_tokens=16,
                                      prefill_row_len=8, **layout)

        def run(batch):
            outs = paxpage.generate(model, batch, engine_config=config, max_tokens=6, temperature=0.9, seed=13,
                                    logprobs=0, ignore_eos=True, use_tqdm=False)
            return [[o.outputs[0].token_ids, [next(iter(d.values())) for d in o.outputs[0].logprobs]] for o in outs]

        result[name] = {"alone": [run([p])[0] for p in prompts], "batched": run(prompts)}
        model.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
