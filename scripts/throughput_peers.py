"""The peers of scripts/bench_throughput.py on the same weights and workload: HF transformers
`generate` in static padded batches (a small sweep of batch sizes, torch threads timed), and
vLLM's CPU build as an offline peer in its own venv (scripts/vllm_peer.py).
"""

from __future__ import annotations

import os
import time

import jax

import paxpage
import vllm_peer
import workload as wl
from throughput_pass import rates
from timing import median_seconds


# ---------------------------------------------------------------------------------------- HF
def hf_model_for(source: str | None):
    """The same weights in transformers (GGUF via gguf_file, HF dir); None if it cannot load them."""
    import torch
    from transformers import AutoModelForCausalLM

    from models.hf_loader import is_hf_dir
    from models.loading import default_model_path

    path = source or default_model_path()
    on_gpu = torch.cuda.is_available() and jax.default_backend() == "gpu"
    dtype = torch.bfloat16 if on_gpu else torch.float32  # what paxpage uses on that backend
    if path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                     gguf_file=os.path.basename(path), dtype=dtype)
    elif os.path.isdir(path) and is_hf_dir(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        return None
    return model.to("cuda" if on_gpu else "cpu").eval()


def hf_generate(model, work: wl.Workload, batch_size: int) -> float:
    """Seconds to serve the workload in static padded batches of batch_size (arrival order)."""
    import torch

    device = next(model.parameters()).device
    start = time.perf_counter()
    for lo in range(0, work.num_requests, batch_size):
        prompts = work.prompts[lo:lo + batch_size]
        wanted = work.output_lens[lo:lo + batch_size]
        width = max(map(len, prompts))
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):  # left padding
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        new = max(wanted)
        with torch.no_grad():
            out = model.generate(ids.to(device), attention_mask=mask.to(device), do_sample=False,
                                 max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
        if out.shape[1] - width != new:
            raise RuntimeError(f"HF generated {out.shape[1] - width} tokens, expected {new}")
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def pick_threads(model, vocab_size: int, candidates) -> int:
    """The fastest torch thread count for a batch-8 decode-sized forward. On a loaded machine
    OpenMP's barriers can make 2 threads ~10x slower than 1; the baseline gets the better one."""
    import torch

    x = torch.randint(0, vocab_size, (8, 1), device=next(model.parameters()).device)
    best, best_s = None, float("inf")
    for threads in dict.fromkeys(candidates):
        torch.set_num_threads(threads)
        with torch.no_grad():
            model(x)
            seconds = median_seconds(lambda: model(x), 3)
        if seconds < best_s:
            best, best_s = threads, seconds
    torch.set_num_threads(best)
    return best


def run_hf(source: str | None, work: wl.Workload, batch_sizes, threads: int | None) -> dict | None:
    import torch

    model = hf_model_for(source)
    if model is None:
        print(f"HF baseline skipped: transformers cannot load {source!r}", flush=True)
        return None
    if threads is None:
        threads = pick_threads(model, model.config.vocab_size, (os.cpu_count(), 1))
    torch.set_num_threads(threads)
    print(f"  torch threads: {threads}", flush=True)
    hf_generate(model, wl.Workload([work.prompts[0][:8]] * 2, [4, 4]), 2)  # warm-up
    sweep = {}
    for bs in batch_sizes:
        seconds = hf_generate(model, work, bs)
        sweep[bs] = {"wall_s": seconds, **rates(work, seconds)}
        print(f"  HF batch {bs:3d}: {sweep[bs]['output_tok_per_s']:7.1f} output tok/s "
              f"({seconds:.1f} s)", flush=True)
    best = max(sweep, key=lambda b: sweep[b]["output_tok_per_s"])
    return {"best_batch_size": best, "threads": threads, "sweep": {str(b): v for b, v in sweep.items()},
            **sweep[best]}


# ---------------------------------------------------------------------------------------- vLLM
def start_vllm(args, cfg: paxpage.EngineConfig, warm: wl.Workload):
    """The vLLM peer, built and warmed up on `warm`; (peer, record) or (None, None) when skipped."""
    if args.no_vllm:
        return None, None
    python, why = vllm_peer.find_python(args.vllm_python)
    if python is None:
        vllm_peer.skipped(why)
        return None, None
    model_dir = vllm_peer.model_dir(args.vllm_model, args.model)
    engine = {"max_model_len": cfg.max_model_len, "max_num_seqs": cfg.max_num_seqs,
              "max_num_batched_tokens": max(cfg.max_num_batched_tokens, cfg.max_model_len),
              "kv_cache_gib": (cfg.kv_cache_bytes or 1 << 30) / (1 << 30)}
    print(f"vLLM {why} ({python}) on {model_dir}:", flush=True)
    peer = vllm_peer.OfflinePeer(python, model_dir, engine, args.vllm_timeout)
    try:
        started = peer.start()
        print(f"  vLLM start-up (load, compile): {started['startup_s']:.1f} s; log {peer.log.name}", flush=True)
        t = time.perf_counter()
        warm_pass = vllm_pass(peer, warm)
        started.update(warmup_pass_s=time.perf_counter() - t, version=why, python=python, model_dir=model_dir)
    except BaseException:
        peer.close()
        raise
    print(f"  vLLM warm-up pass: {started['warmup_pass_s']:.1f} s "
          f"({warm_pass['output_tok_per_s']:.1f} output tok/s)", flush=True)
    return peer, started


def vllm_pass(peer, work: wl.Workload) -> dict:
    out = peer.run(work.prompts, work.output_lens)
    if out["output_lens"] != work.output_lens:
        raise RuntimeError(f"vLLM generated {sum(out['output_lens'])} tokens, expected {work.num_output_tokens}")
    out.update(rates(work, out["wall_s"]))
    return out


def same_tokens(a: list, b: list) -> float:
    """Share of requests whose first tokens (FIRST_TOKENS of them) agree in both systems."""
    return sum(x == y for x, y in zip(a, b)) / max(1, len(a))

