"""Compiles every TPU kernel and the engine's whole step for TPU v5e and v6e on a host without a TPU.

    python scripts/tpu_compile_check.py [--quick] [--strict] [--json out.json]

Needs libtpu (`pip install "jax[tpu]"`; tests/kernels/test_tpu_compile.py builds a separate
environment for it). jax then compiles for a TPU topology it describes but does not have
(`jax.experimental.topologies`): the real XLA TPU compiler and Mosaic run, nothing executes.
Each compile reports its executable's memory analysis. Exit status 1 if anything fails to
compile; the other checks print FINDING lines, fatal with --strict:

1. kernels: decode, ragged (prefill / mixed) and KV write, at SmolLM2 (9 / 3 heads, D = 64) and
   Llama-3-8B (32 / 8, D = 128) shapes, bf16 / int8 / fp8 pools, sliding window, soft cap, each
   for v5e and v6e;
2. page layout: the pool's compiled argument bytes over its logical bytes (values and scales) at
   K = 3 / D = 64, K = 1 / D = 128 and K = 8 / D = 128, bf16, int8 and fp8, in the canonical and
   the tpu layout (pallas_kernels/kv_layout.py), measured as the difference between pools of P
   and 2P pages so the other arguments cancel, and the pool-sized copies (relayouts) the decode,
   mixed and KV write kernels make of its values and of its scales; the layout the TPU backend's
   pool gets must be <= 1.1x and never copied (a FINDING otherwise; docs/gpu-tpu.md);
3. the engine step (paxpage.runner.ModelRunner's own jitted step, built from abstract params:
   no weights are made) for SmolLM2 and a Llama-3-8B-shaped config, on one chip and tensor
   parallel over v5e:2x4, decode and mixed shapes, bf16 and int8 pools: argument, output, temp and alias bytes; no
   pool-sized copy (a relayout) and no temporary as large as one layer's pool beyond the logits
   (XLA staging a pool through VMEM is counted apart), the step's working bytes within the
   pool sizing's bound (kv_sizing.step_bytes_bound), no weight-shaped f32 array (an upcast), and
   the copies it makes of whole weights in every step (a relayout, wherever it lands: one staged
   in VMEM adds no temporary bytes);
4. a roofline for decoding the 8B shape at batch 64 and 256 from the compiled step's
   cost_analysis and the chips' HBM bandwidth: compiled, not run.

--quick (what the test runs, ~2 minutes): twelve kernel cases per chip, the layout on v5e (a
quantised pool in the TPU pool's layout only), and the engine step of SmolLM2 (one chip) and of
the 8B shape (tp 8, bf16 and int8) with two of their layers (every layer is the same program;
the full layer counts take minutes per compile), no roofline.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time

# Before jax is imported: libtpu otherwise looks for a GCE metadata server, and the default
# backend stays the CPU (kernels compile for the TPU device they are given).
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compiling only: no chip to share
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from models.config import ModelConfig  # noqa: E402
from models.param_layout import param_shapes  # noqa: E402
from pallas_kernels import dispatch, kv_layout, kv_quant  # noqa: E402
from paxpage import kv_sizing  # noqa: E402
from paxpage.config import EngineConfig  # noqa: E402
from paxpage.packing import bucket  # noqa: E402
from paxpage.runner import ModelRunner  # noqa: E402
from paxpage.sharding import MODEL_AXIS  # noqa: E402

SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, tie_word_embeddings=True, max_position_embeddings=8192)
LLAMA3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                        max_position_embeddings=8192)
# (name, topology, HBM bytes/s, peak bf16 flop/s per chip) of the chips compiled for.
CHIPS = {"v5e": ("v5e:2x2", 819e9, 197e12), "v6e": ("v6e:2x2", 1.6e12, 918e12)}
TP_TOPOLOGY = "v5e:2x4"
MAX_POOL_RATIO = 1.1
PAGE_SIZE = 16


def devices(topology: str) -> list:
    return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)


def mib(x: float) -> str:
    return f"{x / 2**20:.1f} MiB"


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def abstract_pool(num_pages: int, num_kv_heads: int, head_dim: int, kv_dtype: str, layout: str = "canonical"):
    shape = kv_layout.get(layout).shape(num_pages, PAGE_SIZE, num_kv_heads, head_dim)
    return jax.eval_shape(lambda: kv_quant.zeros(shape, kv_dtype, jnp.bfloat16, layout))


def logical_bytes(tree) -> int:
    """Bytes of the leaves' logical shapes; per device for leaves that carry a sharding."""
    total = 0
    for x in jax.tree.leaves(tree):
        sharding = getattr(x, "sharding", None)
        shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
        total += int(np.prod(shape)) * jnp.dtype(x.dtype).itemsize
    return total


# ---------------------------------------------------------------- 1. kernels
QUICK_KERNELS = ("decode smollm2 bf16", "decode llama8b int8", "decode window 512", "mixed 512 fp8",
                 "mixed soft-cap 50", "kv write 512 int8", "decode smollm2 bf16 tpu-layout",
                 "mixed 512 smollm2 tpu-layout", "kv write 512 tpu-layout", "decode llama8b int8 tpu-layout",
                 "mixed 512 fp8 tpu-layout", "kv write 512 int8 tpu-layout")


def kernel_cases(quick: bool):
    """(name, heads (N, K, D), kind, rows B or tokens T, max keys S, kv dtype, window, soft cap[,
    pool layout]): the canonical pool layout unless a case names one (kv_layout.py)."""
    small, large = (9, 3, 64), (32, 8, 128)
    cases = [
        ("decode smollm2 bf16", small, "decode", 8, 2048, "auto", None, None),
        ("decode llama8b bf16", large, "decode", 8, 4096, "auto", None, None),
        ("decode llama8b int8", large, "decode", 8, 4096, "int8", None, None),
        ("decode smollm2 fp8", small, "decode", 8, 2048, "fp8", None, None),
        ("decode window 512", large, "decode", 8, 4096, "auto", 512, None),
        ("decode soft-cap 50", small, "decode", 8, 2048, "auto", None, 50.0),
        ("prefill 512 smollm2 bf16", small, "ragged", 512, 2048, "auto", None, None),
        ("mixed 512 llama8b bf16", large, "ragged", 512, 4096, "auto", None, None),
        ("mixed 512 llama8b int8", large, "ragged", 512, 4096, "int8", None, None),
        ("mixed 512 fp8", small, "ragged", 512, 2048, "fp8", None, None),
        ("mixed window 512", large, "ragged", 512, 4096, "auto", 512, None),
        ("mixed soft-cap 50", small, "ragged", 512, 2048, "auto", None, 50.0),
        ("kv write 512 bf16", large, "write", 512, 4096, "auto", None, None),
        ("kv write 512 int8", small, "write", 512, 2048, "int8", None, None),
        ("kv write 64 fp8", large, "write", 64, 4096, "fp8", None, None),
        ("decode smollm2 bf16 tpu-layout", small, "decode", 8, 2048, "auto", None, None, "tpu"),
        ("decode llama8b bf16 tpu-layout", large, "decode", 8, 4096, "auto", None, None, "tpu"),
        ("decode window 512 tpu-layout", large, "decode", 8, 4096, "auto", 512, None, "tpu"),
        ("mixed 512 smollm2 tpu-layout", small, "ragged", 512, 2048, "auto", None, None, "tpu"),
        ("mixed soft-cap 50 tpu-layout", small, "ragged", 512, 2048, "auto", None, 50.0, "tpu"),
        ("kv write 512 tpu-layout", small, "write", 512, 2048, "auto", None, None, "tpu"),
        ("decode llama8b int8 tpu-layout", large, "decode", 8, 4096, "int8", None, None, "tpu"),
        ("decode smollm2 fp8 tpu-layout", small, "decode", 8, 2048, "fp8", None, None, "tpu"),
        ("decode window 512 int8 tpu-layout", large, "decode", 8, 4096, "int8", 512, None, "tpu"),
        ("mixed 512 llama8b int8 tpu-layout", large, "ragged", 512, 4096, "int8", None, None, "tpu"),
        ("mixed 512 fp8 tpu-layout", small, "ragged", 512, 2048, "fp8", None, None, "tpu"),
        ("mixed soft-cap 50 int8 tpu-layout", small, "ragged", 512, 2048, "int8", None, 50.0, "tpu"),
        ("kv write 512 int8 tpu-layout", small, "write", 512, 2048, "int8", None, None, "tpu"),
        ("kv write 64 fp8 tpu-layout", large, "write", 64, 4096, "fp8", None, None, "tpu"),
    ]
    return [c for c in cases if c[0] in QUICK_KERNELS] if quick else cases


def compile_kernel(case, device, num_pages: int | None = None):
    name, (n, k, d), kind, rows, keys, kv_dtype, window, cap = case[:8]
    layout = case[8] if len(case) > 8 else "canonical"
    pages_per_seq = keys // PAGE_SIZE
    num_pages = num_pages or 2048
    pool = abstract_pool(num_pages, k, d, kv_dtype, layout)
    masking = dict(sliding_window=window, soft_cap=cap, layout=layout)
    if kind == "write":
        args = (pool, _sds((rows, k, d), jnp.bfloat16), _sds((rows, k, d), jnp.bfloat16), _sds((rows,), jnp.int32))
        fn = jax.jit(lambda *a: dispatch.write_kv(*a, impl="pallas", layout=layout), donate_argnums=(0,))
    else:
        batch, tq = (rows, 1) if kind == "decode" else (rows // 32, 32)  # ragged: rows of 32 tokens
        args = (_sds((batch, tq, n, d), jnp.bfloat16), pool, _sds((batch, pages_per_seq), jnp.int32),
                _sds((batch,), jnp.int32), _sds((batch,), jnp.int32))
        fn = jax.jit(lambda *a: dispatch.paged_attention(*a, sm_scale=d ** -0.5, impl="pallas", **masking))
    with jax.default_device(device):  # the compile target: tpu_target.compile_target()
        return fn.lower(*args).compile()


def check_kernels(quick: bool, report: dict) -> list[str]:
    failures = []
    for chip, (topology, _, _) in CHIPS.items():
        device = devices(topology)[0]
        for case in kernel_cases(quick):
            t = time.perf_counter()
            try:
                mem = compile_kernel(case, device).memory_analysis()
            except Exception as e:  # noqa: BLE001 - every failure is reported, then the script fails
                failures.append(f"kernel {case[0]} on {chip}: {type(e).__name__}: {str(e)[:300]}")
                print(f"  {chip:4} {case[0]:28} FAILED {type(e).__name__}: {str(e)[:200]}")
                continue
            seconds = time.perf_counter() - t
            print(f"  {chip:4} {case[0]:31} compiled in {seconds:4.2f} s; args {mib(mem.argument_size_in_bytes)}, "
                  f"temp {mib(mem.temp_size_in_bytes)}")
            report.setdefault("kernels", []).append({"chip": chip, "case": case[0], "seconds": round(seconds, 2),
                                                     "argument_bytes": mem.argument_size_in_bytes,
                                                     "temp_bytes": mem.temp_size_in_bytes})
    return failures


# ---------------------------------------------------------------- 2. page layout
LAYOUT_HEADS = ((9, 3, 64), (8, 1, 128), (32, 8, 128))  # SmolLM2, one kv head, Llama-3-8B


def pool_ratio(device, heads, kv_dtype: str, layout: str = "canonical") -> tuple[float, int, int]:
    """(compiled argument bytes per logical byte of the pool, from pools of P and 2P pages; how
    many pool-sized copies (relayouts) the decode, mixed and KV write kernels make of its values,
    and of its scales: 0 for a plain pool)."""
    n, k, d = heads
    small, large = 1024, 2048
    case = ("layout", heads, "decode", 8, 2048, kv_dtype, None, None, layout)
    a = compile_kernel(case, device, small).memory_analysis().argument_size_in_bytes
    compiled = compile_kernel(case, device, large)
    b = compiled.memory_analysis().argument_size_in_bytes
    pool = abstract_pool(large, k, d, kv_dtype, layout)
    extra = logical_bytes(pool) - logical_bytes(abstract_pool(small, k, d, kv_dtype, layout))
    copies = leaf_copies(compiled.as_text(), pool)
    for kind, rows in (("ragged", 256), ("write", 256)):
        hlo = compile_kernel(("layout", heads, kind, rows, 2048, kv_dtype, None, None, layout), device,
                             large).as_text()
        copies = [x + y for x, y in zip(copies, leaf_copies(hlo, pool))]
    return (b - a) / extra, copies[0], sum(copies[1:])


def check_layout(quick: bool, report: dict) -> list[str]:
    """Both layouts of each pool measured (--quick: a quantised pool in the TPU pool's only); the
    one the TPU backend's pool gets (kv_layout.for_backend) must be <= MAX_POOL_RATIO and never
    copied, its scales included."""
    findings = []
    for chip, (topology, _, _) in list(CHIPS.items())[:1 if quick else None]:
        device = devices(topology)[0]
        for heads in LAYOUT_HEADS:
            for kv_dtype in ("auto", "int8", "fp8"):
                for layout in kv_layout.LAYOUTS:
                    chosen = kv_layout.for_backend("tpu").name == layout
                    if quick and kv_dtype != "auto" and not chosen:
                        continue
                    ratio, copies, scale_copies = pool_ratio(device, heads, kv_dtype, layout)
                    label = f"K={heads[1]} D={heads[2]} {'bf16' if kv_dtype == 'auto' else kv_dtype} {layout}"
                    scales = "" if kv_dtype == "auto" else f", scales {scale_copies} times"
                    print(f"  {chip:4} pool {label:28} compiled / logical bytes {ratio:.3f}x, values copied "
                          f"{copies} times{scales} by the decode, mixed and write kernels"
                          f"{'' if chosen else ' (not the TPU pool)'}")
                    report.setdefault("pool_layout", []).append({
                        "chip": chip, "pool": label, "layout": layout, "kv_dtype": kv_dtype, "tpu_pool": chosen,
                        "ratio": round(ratio, 4), "pool_copies": copies, "scale_copies": scale_copies})
                    if chosen and (ratio > MAX_POOL_RATIO or copies or scale_copies):
                        findings.append(f"pool {label} on {chip}: {ratio:.3f}x logical bytes (limit "
                                        f"{MAX_POOL_RATIO}x), {copies} pool-sized copies of its values, "
                                        f"{scale_copies} of its scales")
    return findings


# ---------------------------------------------------------------- 3. engine step
def engine_config(max_num_seqs: int, num_pages: int, tp: int, max_model_len: int,
                  kv_cache_dtype: str = "auto", scan_layers="auto") -> EngineConfig:
    return EngineConfig(page_size=PAGE_SIZE, num_pages=num_pages, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max(512, max_num_seqs), max_model_len=max_model_len,
                        dtype="bfloat16", attention_impl="pallas", tensor_parallel_size=tp,
                        kv_cache_dtype=kv_cache_dtype, scan_layers=scan_layers)


def abstract_runner(model_cfg: ModelConfig, config: EngineConfig, mesh_devices: list) -> ModelRunner:
    """The engine's ModelRunner on abstract bf16 params: its model, sharding and jitted step."""
    cfg = config.resolve(model_cfg, backend="tpu")
    params = jax.tree.map(lambda shape: _sds(shape, jnp.bfloat16), param_shapes(model_cfg),
                          is_leaf=lambda x: isinstance(x, tuple))
    mesh = Mesh(np.array(mesh_devices), (MODEL_AXIS,)) if len(mesh_devices) > 1 else None
    return ModelRunner(model_cfg, params, cfg, mesh, abstract=True)


def weight_shapes(runner: ModelRunner) -> set[tuple[int, ...]]:
    """Per-device shapes of the runner's large weights (an f32 array of one of them is an upcast)."""
    shapes = set()
    for leaf in jax.tree.leaves(runner.params):
        if int(np.prod(leaf.shape)) < 1 << 16:
            continue
        sharding = getattr(leaf, "sharding", None)
        shapes.add(tuple(sharding.shard_shape(leaf.shape)) if sharding is not None else tuple(leaf.shape))
    return shapes


HLO_ITEMSIZE = {"bf16": 2, "f16": 2, "f32": 4, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s32": 4}
COPY = re.compile(r"= (\w+)\[([0-9,]+)\]\{[^}]*\} copy\(%([^),\s]+)\)")


def weight_copies(hlo: str) -> list[tuple[str, int]]:
    """The compiled program's copies of a whole weight, (shape, bytes) each: a relayout of one of the
    step's params in every step (e.g. a tied embedding table whose token gather and LM-head product
    want different layouts). Counted wherever the copy lands, VMEM included, where it adds no
    temporary bytes to the memory analysis."""
    params = set(re.findall(r"%(\S+) = [^\n]*? parameter\(\d+\)[^\n]*op_name=\"params\[", hlo))
    found = []
    for dtype, dims, operand in COPY.findall(hlo):
        if operand in params:
            shape = [int(x) for x in dims.split(",")]
            found.append((f"{dtype}{shape}", int(np.prod(shape)) * HLO_ITEMSIZE.get(dtype, 4)))
    return found


def f32_weight_arrays(hlo: str, shapes: set[tuple[int, ...]]) -> list[str]:
    found = set()
    for dims in re.findall(r"f32\[([0-9,]+)\]", hlo):
        shape = tuple(int(x) for x in dims.split(","))
        if shape in shapes or shape[::-1] in shapes:
            found.add(f"f32{list(shape)}")
    return sorted(found)


def compile_step(runner: ModelRunner, dec: int, pre: int, device):
    with jax.default_device(device):  # one chip: the step compiles for jax's default device
        return runner.lower_step(dec, pre).compile()


def step_cases(quick: bool):
    """(label, model, chip topology, tp, max_num_seqs, num_pages, [(decode rows, prefill rows)],
    kv_cache_dtype, scan_layers)."""
    if quick:
        two = lambda m: dataclasses.replace(m, num_layers=2)
        return [("smollm2 1 chip, 2 layers", two(SMOLLM2), "v5e:2x2", 1, 64, 4096, [(64, 0)], "auto", "auto"),
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


def leaf_copies(hlo: str, cache) -> list[int]:
    """Per leaf of one layer's cache (a plain pool's one array; a quantised pool's values, then
    its scales): the compiled program's instructions that copy the whole leaf (a relayout)."""
    counts = []
    for leaf in jax.tree.leaves(cache):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
        name = {"bfloat16": "bf16", "int8": "s8", "float8_e4m3fn": "f8e4m3fn",
                "float32": "f32"}[jnp.dtype(leaf.dtype).name]
        pattern = re.compile(re.escape(f"{name}[{','.join(map(str, shape))}]") + r"\{[^}]*\} copy\(")
        counts.append(len(pattern.findall(hlo)))
    return counts


def pool_copies(hlo: str, cache) -> int:
    """Instructions of the compiled program that copy a whole leaf of a layer's pool (a relayout)."""
    return sum(leaf_copies(hlo, cache))


def pool_staging(hlo: str, cache) -> int:
    """Asynchronous copies of a whole layer's pool (XLA's memory-space assignment staging it
    through VMEM and back: a scheduling choice, not a relayout)."""
    leaf = jax.tree.leaves(cache)[0]
    shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
    dims = re.escape(f"[{','.join(map(str, shape))}]")
    return len(re.findall(r"= \([a-z0-9]+" + dims + r"\{[^}]*\}[^=]*copy-start\(", hlo))


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
                                f"pool stagings through VMEM)")
            if copied:
                findings.append(f"step {label} ({dec}, {pre}): copies {', '.join(shape for shape, _ in copied)} "
                                f"of its params in every step (a relayout)")
            upcasts = f32_weight_arrays(hlo, upcast_shapes)
            if upcasts:
                failures.append(f"step {label} ({dec}, {pre}): f32 arrays of weight shapes {upcasts}")
            costs[(label, dec, pre)] = row
    return failures, findings, costs


# ---------------------------------------------------------------- 4. roofline
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


def _weight_copies_cell(row: dict) -> str:
    return f"{row['weight_copies']} ({row['weight_copy_bytes'] / 2**20:,.0f})" if row["weight_copies"] else "0"


def doc_tables(report: dict) -> dict:
    """docs/gpu-tpu.md's tables (scripts/docs_figures.py renders them), compiled, not run: the pool
    layout per chip and pool; the engine steps per device; the 8B decode roofline."""
    tables = {}
    if "pool_layout" in report:
        rows = [[r["chip"], r["pool"].rsplit(" ", 1)[0], r["layout"], "yes" if r["tpu_pool"] else "no",
                 f"{r['ratio']:.2f}x", r["pool_copies"], "-" if r["kv_dtype"] == "auto" else r["scale_copies"]]
                for r in report["pool_layout"]]
        columns = ["chip", "pool", "layout", "the TPU pool", "compiled / logical bytes",
                   "value copies (decode + mixed + write)", "scale copies"]
        tables["pool_layout"] = {"columns": columns, "rows": rows}
    if "steps" in report:
        as_mib = lambda x: f"{x / 2**20:,.0f}"
        rows = [[r["step"], r.get("topology", ""), r["decode_rows"], r["prefill_rows"], as_mib(r["argument_bytes"]),
                 as_mib(r["output_bytes"]), as_mib(r["temp_bytes"]), as_mib(r["layer_pool_bytes"]),
                 r["pool_copies"], r["pool_staging"], _weight_copies_cell(r),
                 f"{as_mib(r['working_bytes'])} / {as_mib(r['bound_bytes'])}"]
                for r in report["steps"]]
        columns = ["step", "chips", "decode rows", "prefill rows", "arguments", "outputs", "temporaries",
                   "one layer's pool", "pool copies", "VMEM stagings", "weight copies (MiB)",
                   "working / sizing bound"]
        tables["steps"] = {"columns": columns, "rows": rows}
    if "roofline" in report:
        rows = [[r["step"], r["chip"], r["batch"], r["context"], f"{r['weight_bytes'] / 1e9:.2f}",
                 f"{r['kv_bytes'] / 1e9:.2f}", f"{r['tokens_per_second_bound']:,}",
                 f"{r['compiled_bytes'] / 1e9:.2f}", f"{r['tokens_per_second_as_compiled']:,}"]
                for r in report["roofline"]]
        columns = ["step", "chip", "B", "context", "weights (GB)", "KV (GB)", "bound from weights + KV (tok/s)",
                   "compiled bytes (GB)", "bound as compiled (tok/s)"]
        tables["roofline"] = {"columns": columns, "rows": rows}
    return tables


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a third of the kernel cases and two engine configs")
    ap.add_argument("--json", help="write the measurements here")
    ap.add_argument("--strict", action="store_true", help="FINDING lines (layout, hidden copies) fail too")
    ap.add_argument("--skip", nargs="*", default=[], choices=["kernels", "layout", "steps"])
    ap.add_argument("--steps", default="", metavar="TEXT", help="only the engine steps whose label holds TEXT")
    ap.add_argument("--roofline-from", metavar="JSON", help="only print the roofline of a --json report's steps")
    args = ap.parse_args(argv)
    if args.roofline_from:
        with open(args.roofline_from) as f:
            rows = json.load(f)["steps"]
        roofline({(r["step"], r["decode_rows"], r["prefill_rows"]): r for r in rows}, {})
        return 0
    print(f"jax {jax.__version__}; compiling for TPU v5e / v6e with no TPU here (compiled, not run)")
    report: dict = {"jax": jax.__version__}
    failures: list[str] = []
    findings: list[str] = []
    t = time.perf_counter()
    if "kernels" not in args.skip:
        print("kernels:")
        failures += check_kernels(args.quick, report)
    if "layout" not in args.skip:
        print("page layout:")
        findings += check_layout(args.quick, report)
    if "steps" not in args.skip:
        print("engine step (per device):")
        step_failures, step_findings, costs = check_steps(args.quick, report, args.steps)
        failures += step_failures
        findings += step_findings
        if not args.quick:
            print("roofline, 8B decode:")
            roofline(costs, report)
    print(f"total {time.perf_counter() - t:.0f} s")
    report["failures"], report["findings"] = failures, findings
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from provenance import write_record  # the figures with machine, versions, date, command, commit

        write_record(args.json, report, tables=doc_tables(report))
    for finding in findings:
        print("FINDING:", finding)
    for failure in failures:
        print("FAIL:", failure)
    return 1 if failures or (args.strict and findings) else 0


if __name__ == "__main__":
    sys.exit(main())
