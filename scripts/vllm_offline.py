"""Offline vLLM passes for scripts/bench_throughput.py, run by the python of vLLM's venv
(scripts/vllm_peer.py starts it; it imports nothing of paxpage's).

Reads one JSON command per line on stdin and answers each with one stdout line that starts
with "@@vllm-result " (vLLM's own logging goes to stderr):
    {"command": "start", "model": DIR, "max_model_len": .., "max_num_seqs": ..,
     "max_num_batched_tokens": ..}
        builds `vllm.LLM` (float32, seed 0): {"startup_s", "vllm", "torch"}
    {"command": "generate", "prompts": [[token ids]], "output_lens": [..]}
        one pass, all requests queued at once, greedy, EOS ignored:
        {"wall_s", "output_lens": tokens generated per request, "first_tokens": the first
         few token ids of each output, to compare greedy outputs across systems}
Stdin closing ends it.
"""

from __future__ import annotations

import json
import sys
import time
import traceback

RESULT = "@@vllm-result "
FIRST_TOKENS = 8


def main() -> int:
    out = sys.stdout
    sys.stdout = sys.stderr  # anything vLLM prints stays off the answer channel
    llm = None
    for line in sys.stdin:
        if not line.strip():
            continue
        message = json.loads(line)
        try:
            if message["command"] == "start":
                llm, reply = start(message)
            elif message["command"] == "generate":
                if llm is None:
                    raise ValueError("'generate' before 'start'")
                reply = generate(llm, message["prompts"], message["output_lens"])
            else:
                raise ValueError(f"unknown command {message['command']!r}")
        except Exception as e:  # noqa: BLE001 - reported to the benchmark, which stops
            traceback.print_exc()
            reply = {"error": f"{type(e).__name__}: {e}"}
        out.write(RESULT + json.dumps(reply) + "\n")
        out.flush()
    return 0


def start(message: dict):
    import torch
    import vllm

    t = time.perf_counter()
    kwargs = {k: message[k] for k in ("max_model_len", "max_num_seqs", "max_num_batched_tokens")
              if message.get(k) is not None}
    llm = vllm.LLM(model=message["model"], dtype="float32", seed=0, **kwargs)
    return llm, {"startup_s": time.perf_counter() - t, "vllm": vllm.__version__, "torch": torch.__version__,
                 "engine": kwargs}


def generate(llm, prompts: list[list[int]], output_lens: list[int]) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True) for n in output_lens]
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    t = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    wall = time.perf_counter() - t
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return {"wall_s": wall, "output_lens": [len(x) for x in tokens],
            "first_tokens": [x[:FIRST_TOKENS] for x in tokens]}


if __name__ == "__main__":
    sys.exit(main())
