"""One decode step taken apart (bench_throughput's `--profile`, latency_breakdown's device
profile): the engine's jitted step, the same step with attention and the KV write swapped for
no-ops, the sampler alone and the host's packing, timed interleaved on the real engine."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import paxpage
from timing import interleaved_medians


def profile_decode_step(model: paxpage.Model, cfg: paxpage.EngineConfig, context: int,
                        iters: int) -> dict:
    """Rough breakdown of one decode step of cfg.max_num_seqs rows at `context` tokens each:
    the engine's jitted step; the same step with attention and the KV write swapped for
    no-ops (XLA then also drops the K/V projections); the sampler alone; host packing.
    On the XLA attention path also the step with one-page attention chunks.

    Run after the measured passes: it writes K/V into the pool's first pages (finished
    sequences' prefix-cache entries there become stale; nothing runs on this engine after)."""
    import functools
    import inspect

    from models.families import build_model
    from pallas_kernels import reference
    from pallas_kernels.xla_attention import paged_attention_xla
    from paxpage.sampling import sampler as sampler_lib
    from paxpage.sampling.tensors import RowInfo, SamplingTensors
    from paxpage.packing import RowPlan

    engine = model.engine(cfg)
    runner, rcfg = engine.runner, engine.config
    rows = rcfg.max_num_seqs
    context = max(1, min(context, rcfg.max_model_len - 1, rcfg.num_pages * rcfg.page_size // rows - 1))
    pages_per_row = -(-(context + 1) // rcfg.page_size)
    rng = np.random.default_rng(0)
    sp = paxpage.SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def host_pack():
        plans, infos = [], []
        for r in range(rows):
            tokens = rng.integers(0, model.config.vocab_size, context + 1).tolist()
            table = list(range(r * pages_per_row, (r + 1) * pages_per_row))
            plans.append(RowPlan(tokens, table, context, 1, 1))
            infos.append(RowInfo(sp, tokens[:context], tokens[context:], r))
        batch = runner.packer.pack(plans)[0]
        tensors = SamplingTensors.build(
            infos, model.config.vocab_size, pad_rows_to=len(batch.logits_indices),
            eos_token_ids=engine.eos_token_ids, token_width=rcfg.max_model_len)
        return batch, tensors

    batch, tensors = host_pack()
    num_rows = len(batch.logits_indices)  # the model returns the sampling rows' logits first
    dtype = jnp.dtype(rcfg.dtype)

    def variant(attention, write_kv):
        """A donated step like the engine's (no copy of the pool), with other attention."""
        m = build_model(model.config, attention, write_kv, dtype, scan_period=rcfg.scan_period,
                        matmul_impl=runner.matmul_impl)

        def step(p, kv, b, s):
            logits, kv = m.apply({"params": p}, b, kv)
            return kv, sampler_lib.sample(logits[:num_rows], s, 0).token_ids

        jitted = jax.jit(step, donate_argnums=(1,))

        def call():
            runner.kv_cache, out = jitted(runner.params, runner.kv_cache, batch, tensors)
            jax.block_until_ready(out)
        return call

    def no_attention(q, kv_pages, page_indices, kv_lens, q_lens, *, sm_scale):
        return q

    logits = jnp.zeros((num_rows, model.config.vocab_size), jnp.float32)
    sample = jax.jit(lambda lg, s: sampler_lib.sample(lg, s, 0))
    fns = {
        "step": lambda: runner.run(batch, tensors),
        "step_without_attention": variant(no_attention, lambda pages, k, v, slots: pages),
        "sampler": lambda: jax.block_until_ready(sample(logits, tensors)),
        "host_pack": host_pack,
    }
    if rcfg.attention_impl == "xla" and "chunk_tokens" in inspect.signature(paged_attention_xla).parameters:
        # The XLA path walks the context in chunks; one page per chunk is its smallest setting.
        fns[f"step_attention_chunk_{rcfg.page_size}_tokens"] = variant(
            functools.partial(paged_attention_xla, chunk_tokens=rcfg.page_size), reference.write_kv)
    t = interleaved_medians(fns, iters)
    total = t["step"] + t["host_pack"]
    attention = max(0.0, t["step"] - t["step_without_attention"])
    return {
        "rows": rows, "context": context, "seconds": t,
        "shares": {  # of (jitted step + host packing)
            "matmuls_and_rest": max(0.0, t["step_without_attention"] - t["sampler"]) / total,
            "attention_and_kv_write": attention / total,
            "sampling": t["sampler"] / total,
            "host_packing": t["host_pack"] / total,
        },
    }
