"""The engine's whole step compiled for TPU with no TPU here (scripts/tpu_compile_check.py, part 3
and 4): paxpage.runner.ModelRunner's own jitted step on abstract params (no weights are made) for
SmolLM2 and a Llama-3-8B-shaped config, on one chip and tensor parallel over v5e:2x4, decode and
mixed shapes; per step its memory analysis, its copies of the pool and of weights (tpu_hlo.py) and
its working bytes against the pool sizing's bound; then a decode roofline of the 8B shape from the
compiled steps' cost analysis.
"""

from __future__ import annotations

import dataclasses
import time

from tpu_targets import (CHIPS, LLAMA3_8B, PAGE_SIZE, SMOLLM2, TP_TOPOLOGY, device_shape, devices,  # noqa: I001
                         logical_bytes, mib, sds)

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from models.config import ModelConfig
from models.param_layout import param_shapes
from paxpage import kv_sizing
from paxpage.config import EngineConfig
from paxpage.packing import bucket
from paxpage.runner import ModelRunner
from paxpage.sharding import MODEL_AXIS
from tpu_hlo import f32_weight_arrays, pool_copies, pool_staging, weight_copies


def engine_config(max_num_seqs: int, num_pages: int, tp: int, max_model_len: int,
                  kv_cache_dtype: str = "auto", scan_layers="auto") -> EngineConfig:
    return EngineConfig(page_size=PAGE_SIZE, num_pages=num_pages, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max(512, max_num_seqs), max_model_len=max_model_len,
                        dtype="bfloat16", attention_impl="pallas", tensor_parallel_size=tp,
                        kv_cache_dtype=kv_cache_dtype, scan_layers=scan_layers)


def abstract_runner(model_cfg: ModelConfig, config: EngineConfig, mesh_devices: list) -> ModelRunner:
    """The engine's ModelRunner on abstract bf16 params: its model, sharding and jitted step."""
    cfg = config.resolve(model_cfg, backend="tpu")
    params = jax.tree.map(lambda shape: sds(shape, jnp.bfloat16), param_shapes(model_cfg),
                          is_leaf=lambda x: isinstance(x, tuple))
    if len(mesh_devices) > 1:
        return ModelRunner(model_cfg, params, cfg, Mesh(np.array(mesh_devices), (MODEL_AXIS,)), abstract=True)
    with jax.default_device(mesh_devices[0]):  # one chip: what it places goes on jax's default device
        return ModelRunner(model_cfg, params, cfg, None, abstract=True)


def weight_shapes(runner: ModelRunner) -> set[tuple[int, ...]]:
    """Per-device shapes of the runner's large weights (an f32 array of one of them is an upcast)."""
    return {device_shape(leaf) for leaf in jax.tree.leaves(runner.params) if int(np.prod(leaf.shape)) >= 1 << 16}


def compile_step(runner: ModelRunner, dec: int, pre: int, device):
    with jax.default_device(device):  # one chip: the step compiles for jax's default device
        return runner.lower_step(dec, pre).compile()


def step_cases(quick: bool):
    """(label, model, chip topology, tp, max_num_seqs, num_pages, [(decode rows, prefill rows)],
    kv_cache_dtype, scan_layers)."""
    if quick:
        two = lambda m: dataclasses.replace(m, num_layers=2)
        return [("smollm2 1 chip, 2 layers", two(SMOLLM2), "v5e:2x2", 1, 64, 4096, [(64, 0)], "auto", "auto"),
                ("smollm2 1 chip int8, 2 layers", two(SMOLLM2), "v5e:2x2", 1, 64, 4096, [(48, 8)], "int8", "auto"),
                ("smollm2 tp8, 2 layers", two(SMOLLM2), TP_TOPOLOGY, 8, 64, 4096, [(64, 0)], "auto", "auto"),
                ("llama8b tp8, 2 layers", two(LLAMA3_8B), TP_TOPOLOGY, 8, 64, 8192, [(64, 0)], "auto", "auto"),
                ("llama8b tp8 int8, 2 layers", two(LLAMA3_8B), TP_TOPOLOGY, 8, 64, 8192, [(64, 0)], "int8",
                 "auto")]
    cases = [
        ("smollm2 1 chip", SMOLLM2, "v5e:2x2", 1, 64, 4096, [(64, 0), (48, 8)], "auto", "auto"),
        ("smollm2 1 chip int8", SMOLLM2, "v5e:2x2", 1, 64, 4096, [(64, 0), (48, 8)], "int8", "auto"),
        ("smollm2 1 chip scanned", SMOLLM2, "v5e:2x2", 1, 64, 4096, [(64, 0), (48, 8)], "auto", True),
        ("smollm2 tp8", SMOLLM2, TP_TOPOLOGY, 8, 64, 4096, [(64, 0), (48, 8)], "auto", "auto"),
        ("llama8b 1 chip", LLAMA3_8B, "v6e:2x2", 1, 256, 2048, [(64, 0), (256, 0), (48, 8)], "auto", "auto"),
        ("llama8b tp8", LLAMA3_8B, TP_TOPOLOGY, 8, 256, 8192, [(64, 0), (256, 0)], "auto", "auto"),
        ("llama8b tp8 int8", LLAMA3_8B, TP_TOPOLOGY, 8, 256, 8192, [(64, 0), (48, 8)], "int8", "auto"),
        ("llama8b tp8 int8 scanned", LLAMA3_8B, TP_TOPOLOGY, 8, 256, 8192, [(64, 0)], "int8", True),
    ]
    return cases


def logits_bytes(model_cfg, num_logits: int) -> int:
    """The step's f32 logits [R, V] and one copy of them (as kv_sizing.step_bytes_bound counts
    them): a temporary that size is the sampler's, not a hidden copy of the pool."""
    return 2 * 4 * num_logits * model_cfg.vocab_size


def check_steps(quick: bool, report: dict, only: str = "") -> tuple[list[str], list[str], dict]:
    failures, findings, costs = [], [], {}
    for label, model_cfg, topology, tp, max_seqs, num_pages, shapes, kv_dtype, scan in step_cases(quick):
        if only not in label:
            continue
        devs = devices(topology)[:tp]
        runner = abstract_runner(model_cfg, engine_config(max_seqs, num_pages, tp, 4096, kv_dtype, scan), devs)
        # one layer's pool on one device (a scanned step holds all layers' pages in one pool)
        layer_pool = logical_bytes(runner.kv_cache) // model_cfg.num_layers
        first_pool = runner.kv_cache[0] if isinstance(runner.kv_cache, (list, tuple)) else runner.kv_cache
        upcast_shapes = weight_shapes(runner)
        for dec, pre in shapes:
            t = time.perf_counter()
            try:
                compiled = compile_step(runner, dec, pre, devs[0])
            except Exception as e:  # noqa: BLE001
                failures.append(f"step {label} ({dec}, {pre}): {type(e).__name__}: {str(e)[:300]}")
                print(f"  {label:15} decode {dec:3} prefill rows {pre:2}: FAILED {type(e).__name__}: {str(e)[:300]}")
                continue
            seconds = time.perf_counter() - t
            mem = compiled.memory_analysis()
            hlo = compiled.as_text()
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, (list, tuple)) else cost
            row = {"step": label, "topology": topology, "decode_rows": dec, "prefill_rows": pre, "seconds": round(seconds, 1),
                   "argument_bytes": mem.argument_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
                   "temp_bytes": mem.temp_size_in_bytes, "alias_bytes": mem.alias_size_in_bytes,
                   "layer_pool_bytes": layer_pool, "pool_bytes": logical_bytes(runner.kv_cache), "flops": float(cost.get("flops", 0.0)),
                   "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
                   "pool_copies": pool_copies(hlo, first_pool), "pool_staging": pool_staging(hlo, first_pool)}
            copied = weight_copies(hlo)
            row["weight_copies"], row["weight_copy_bytes"] = len(copied), sum(n for _, n in copied)
            # What the pool is sized against on a TPU (no compile): must hold what XLA allocates.
            row["working_bytes"] = row["temp_bytes"] + row["output_bytes"] - row["alias_bytes"]
            row["bound_bytes"] = kv_sizing.step_bytes_bound(runner.step_model_cfg, dec + pre * runner.cfg.prefill_row_len,
                                                            bucket(dec + pre))
            report.setdefault("steps", []).append(row)
            print(f"  {label:15} decode {dec:3} prefill rows {pre:2}: {seconds:5.1f} s; per device args "
                  f"{mib(row['argument_bytes'])}, out {mib(row['output_bytes'])}, temp {mib(row['temp_bytes'])}, "
                  f"aliased {mib(row['alias_bytes'])}; one layer's pool {mib(layer_pool)}, copied "
                  f"{row['pool_copies']} times, staged through VMEM {row['pool_staging']} times; weights copied "
                  f"{row['weight_copies']} times ({mib(row['weight_copy_bytes'])}); working {mib(row['working_bytes'])} against the sizing bound "
                  f"{mib(row['bound_bytes'])}")
            if row["working_bytes"] > row["bound_bytes"]:
                findings.append(f"step {label} ({dec}, {pre}): works in {row['working_bytes']} bytes, past "
                                f"kv_sizing.step_bytes_bound's {row['bound_bytes']}")
            if row["pool_copies"]:
                findings.append(f"step {label} ({dec}, {pre}): {row['pool_copies']} pool-sized copies: the pool "
                                f"is relaid out")
            elif mem.temp_size_in_bytes - logits_bytes(model_cfg, bucket(dec + pre)) >= layer_pool:
                findings.append(f"step {label} ({dec}, {pre}): temp {mem.temp_size_in_bytes} bytes, less the "
                                f"logits, >= one layer's pool {layer_pool} with no relayout ({row['pool_staging']} "
                                f"stagings of a pool leaf through VMEM, each written back to a fresh buffer)")
            if copied:
                findings.append(f"step {label} ({dec}, {pre}): copies {', '.join(shape for shape, _ in copied)} "
                                f"of its params in every step (a relayout)")
            upcasts = f32_weight_arrays(hlo, upcast_shapes)
            if upcasts:
                failures.append(f"step {label} ({dec}, {pre}): f32 arrays of weight shapes {upcasts}")
            costs[(label, dec, pre)] = row
    return failures, findings, costs


def roofline(costs: dict, report: dict) -> None:
    """Decode tok/s bounds of the 8B shape at batch B, context S (per device, HBM-bound: a step
    takes at least bytes / bandwidth, and flops / peak):
    - "compiled": the compiled step's cost_analysis bytes accessed (XLA's count, Pallas calls
      counted by their operands, relayout copies included);
    - "weights + KV": the step's argument bytes less its pool (the weights it reads once) plus
      the keys and values the B rows attend to, B * S * 2 * L * K * D * 2 bytes (bf16)."""
    m = LLAMA3_8B
    for label, chip in (("llama8b 1 chip", "v6e"), ("llama8b tp8", "v5e")):
        tp = 8 if "tp8" in label else 1
        kv_per_key = 2 * m.num_layers * m.num_kv_heads * m.head_dim * 2 / tp  # bf16 K and V, per device
        _, bandwidth, peak = CHIPS[chip]
        for batch in (64, 256):
            row = costs.get((label, batch, 0))
            if row is None:
                continue
            weights = row["argument_bytes"] - row.get("pool_bytes", m.num_layers * row["layer_pool_bytes"])
            compiled_s = max(row["bytes_accessed"] / bandwidth, row["flops"] / peak)
            for context in (1024, 4096):
                kv_bytes = batch * context * kv_per_key
                model_s = max((weights + kv_bytes) / bandwidth, row["flops"] / peak)
                print(f"  {label:15} {chip} B={batch:3} S={context:4}: weights {weights / 1e9:5.2f} GB + KV "
                      f"{kv_bytes / 1e9:5.2f} GB -> <= {batch / model_s:6.0f} tok/s; as compiled "
                      f"({row['bytes_accessed'] / 1e9:.2f} GB, {row['flops'] / 1e12:.2f} TFLOP) <= "
                      f"{batch / compiled_s:6.0f} tok/s (compiled, not run)")
                report.setdefault("roofline", []).append({
                    "step": label, "chip": chip, "batch": batch, "context": context,
                    "weight_bytes": weights, "kv_bytes": kv_bytes, "compiled_bytes": row["bytes_accessed"],
                    "flops": row["flops"], "tokens_per_second_bound": round(batch / model_s),
                    "tokens_per_second_as_compiled": round(batch / compiled_s)})
