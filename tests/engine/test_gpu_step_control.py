"""The step and the sampler lowered for CUDA hold no loop or conditional that waits on the host.

Exported with jax.export(platforms=["cuda"]) on this CPU host (the Pallas kernels lower to their
Triton calls), then walked by paxpage.hlo_control: every while must have a fixed trip count and
every case / if a constant index, for greedy, sampled (top-k / top-p / min-p), penalised and MoE
steps, with the Pallas attention, the XLA one and latent attention, and for speculative decoding's
verify (rejection sampling against a draft distribution). The walker itself is checked on loops
and conds it must and must not report.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig
from models.param_layout import param_shapes
from pallas_kernels.gpu_launches import export_for
from paxpage.sampling import sampler as sampler_lib
from paxpage.sampling.tensors import SamplingTensors
from paxpage.config import EngineConfig
from paxpage.hlo_control import data_dependent_control
from paxpage.runner import ModelRunner

DENSE = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=16, max_position_embeddings=256)
MOE = dataclasses.replace(DENSE, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=32)
# DeepSeek-V3's latent attention (its XLA path on every backend) and grouped routing, tiny
LATENT = ModelConfig.from_hf_dict(dict(
    model_type="deepseek_v3", vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1, n_routed_experts=8, n_group=2,
    topk_group=1, num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False))
ROWS, VOCAB = 8, 300


def _exported(fn, *args, platform="cuda") -> str:
    return export_for(fn, args, platform).mlir_module()


def test_walker_reports_data_dependent_control_only():
    x, n = jax.ShapeDtypeStruct((3,), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32)
    static_loop = _exported(lambda x, n: jax.lax.fori_loop(0, 8, lambda i, y: y + 1.0, x), x, n)
    scan = _exported(lambda x, n: jax.lax.scan(lambda c, _: (c * 2.0, None), x, None, length=4)[0], x, n)
    on_platform = _exported(lambda x, n: jax.lax.platform_dependent(
        x, cpu=lambda y: jax.lax.fori_loop(0, n, lambda i, z: z + 1.0, y), default=lambda y: y * 2.0), x, n)
    assert data_dependent_control(static_loop) == data_dependent_control(scan) == []
    assert data_dependent_control(on_platform) == []
    counted = _exported(lambda x, n: jax.lax.fori_loop(0, n, lambda i, y: y + 1.0, x), x, n)
    until = _exported(lambda x, n: jax.lax.while_loop(lambda y: y[0] < 5.0, lambda y: y + 1.0, x), x, n)
    branch = _exported(lambda x, n: jax.lax.cond(n > 0, lambda y: y + 1.0, lambda y: y, x), x, n)
    assert [len(data_dependent_control(m)) for m in (counted, until, branch)] == [1, 1, 1]
    assert data_dependent_control(branch)[0].startswith("stablehlo.case")


@pytest.mark.parametrize("model,impl", [(DENSE, None), (MOE, None), (DENSE, "xla"), (LATENT, None)],
                         ids=["dense", "moe", "dense-xla-attention", "latent"])
def test_step_for_cuda_has_no_data_dependent_control(model, impl):
    cfg = EngineConfig(num_pages=32, max_num_seqs=4, max_num_batched_tokens=64,
                       attention_impl=impl).resolve(model, backend="gpu")
    want_impl = "xla" if impl or model.is_mla else "pallas"
    assert (cfg.attention_impl, cfg.dtype) == (want_impl, "bfloat16")
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16), param_shapes(model),
                          is_leaf=lambda x: isinstance(x, tuple))
    runner = ModelRunner(model, params, cfg, abstract=True)
    for dec, pre in ((4, 0), (4, 1)):  # decode, and decode + a prefill row
        module = runner.export_step(dec, pre, "cuda").mlir_module()
        # the Pallas GPU attention, not an XLA fallback; the XLA paths' chunk loops over the table
        assert ("__gpu$xla.gpu.triton" in module) == (want_impl == "pallas")
        assert data_dependent_control(module) == [], (dec, pre)
        if want_impl == "xla":  # the same step lowered for the CPU stops at the longest row
            assert data_dependent_control(runner.export_step(dec, pre, "cpu").mlir_module()), (dec, pre)


def _sampler_variants():
    greedy = SamplingTensors.build([], VOCAB, pad_rows_to=ROWS)
    sampled = dataclasses.replace(greedy, greedy_only=False, penalised=False)
    return {"greedy": greedy, "sampled": sampled, "penalised": dataclasses.replace(sampled, penalised=True)}


def test_sampler_for_cuda_has_no_data_dependent_control():
    logits = jax.ShapeDtypeStruct((ROWS, VOCAB), jnp.float32)
    fn = functools.partial(sampler_lib.sample_rows, num_logprobs=0, num_rows=ROWS)
    for name, t in _sampler_variants().items():
        pending = (np.full(ROWS, -1, np.int32), np.zeros(ROWS, np.int32)) if t.penalised else None
        sample = lambda logits, t, pending: fn(logits, t, pending)
        assert data_dependent_control(_exported(sample, logits, t, pending)) == [], name
        if name == "sampled":  # the CPU keeps its branches: the costly stages run only when needed
            assert data_dependent_control(_exported(sample, logits, t, pending, platform="cpu")), name


def test_speculative_verify_for_cuda_has_no_data_dependent_control():
    from paxpage.speculative.verify import verify

    logits = jax.ShapeDtypeStruct((ROWS, VOCAB), jnp.float32)
    draft_ids = jax.ShapeDtypeStruct((ROWS,), jnp.int32)
    dists = jax.ShapeDtypeStruct((ROWS, VOCAB), jnp.float32)
    for name, t in _sampler_variants().items():
        pending = (np.full(ROWS, -1, np.int32), np.zeros(ROWS, np.int32)) if t.penalised else None
        for q in (None, dists):  # one-hot drafts (n-gram) and a draft model's distributions
            check = lambda logits, ids, q, t=t, pending=pending: verify(logits, t, ids, q, pending=pending)
            assert data_dependent_control(_exported(check, logits, draft_ids, q)) == [], (name, q is None)
    # the CPU keeps the branch: rejection sampling runs only when a sampled row has a draft
    cpu = lambda logits, ids, q: verify(logits, _sampler_variants()["sampled"], ids, q)
    assert data_dependent_control(_exported(cpu, logits, draft_ids, dists, platform="cpu"))
