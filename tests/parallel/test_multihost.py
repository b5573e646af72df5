"""Multi-host on one machine: two processes on 127.0.0.1, each with 2 forced host devices, joined
by jax.distributed (gloo collectives) into one 4-device mesh; TP = 4 across them gives HF
transformers' greedy tokens (what one process gives). Both processes are killed at the deadline."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

from tests.conftest import hf_greedy, save_tiny_hf
from tests.parallel.helpers import ROOT, device_env

DEADLINE_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_processes(args_of, num_processes: int):
    procs = [subprocess.Popen([sys.executable, "-m", "tests.parallel.mh_worker", *args_of(i)], cwd=ROOT,
                              env=device_env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(num_processes)]
    deadline = time.monotonic() + DEADLINE_S
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
    finally:
        for p in procs:  # on timeout or any error: no process outlives the test
            if p.poll() is None:
                p.kill()
                p.communicate()
    return procs, outs


def test_tp4_across_two_processes_matches_hf(tmp_path):
    hf = save_tiny_hf(tmp_path, "llama", num_attention_heads=4, num_key_value_heads=4)
    address = f"127.0.0.1:{_free_port()}"
    procs, outs = _run_processes(lambda i: [address, "2", str(i), str(tmp_path), "4"], 2)
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    prompts = [[(7 * i + 3) % 128 for i in range(n)] for n in (5, 19)]
    assert results[0]["greedy"] == [hf_greedy(hf, prompt, 4) for prompt in prompts]
    import torch

    for prompt, got in zip(prompts, results[0]["penalised"]):  # HF's repetition penalty, same weights
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=4, min_new_tokens=4, do_sample=False,
                               repetition_penalty=1.8, pad_token_id=0,
                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert got == want[0, len(prompt):].tolist()
    assert results[0]["devices"] == results[1]["devices"] == 4
    assert results[1]["followed_steps"] >= 4  # the follower ran every step with process 0
    # each process holds 2 of the 4 KV-head shards, one head each
    assert results[0]["kv_local_shards"] == results[1]["kv_local_shards"] == [[2, 48, 4, 1, 16]] * 2
