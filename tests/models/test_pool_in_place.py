"""The compiled step updates the KV pool in place: no instruction copies or converts a whole leaf
of the pool, at one row (where XLA turns the KV scatter into a dynamic-update-slice) and at
several, on the XLA and native attention paths, f32 and bf16, plain and quantised."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paxpage
from models import layer_stack
from paxpage.engine import LLMEngine
from paxpage.packing import RowPlan
from tests.conftest import random_prompts, save_tiny_deepseek

HLO_TYPES = {"float32": "f32", "bfloat16": "bf16", "int8": "s8", "float8_e4m3fn": "f8e4m3fn", "uint16": "u16"}
INSTRUCTION = re.compile(r"%\S+ = (\w+)\[([0-9,]*)\]\{[^}]*\} (\S+)\(")


def whole_leaf_copies(hlo: str, cache) -> list[str]:
    """Instructions that materialise a new array with as many elements as a leaf of the pool: a
    copy of it, or a conversion to another type (an in-place scatter or update keeps the leaf's
    type). Only arrays the program holds count: a fusion's inner instructions (a convert fused
    into a gather reads only the gathered elements) are not buffers of their own."""
    fused = set(re.findall(r"calls=(%[\w.-]+)", hlo))
    found, inside = [], False
    for line in hlo.splitlines():
        head = re.match(r"(?:ENTRY )?(%[\w.-]+) .*\{$", line)
        if head:
            inside = head.group(1) in fused
            continue
        m = INSTRUCTION.search(line)
        if inside or not m or not m.group(2):
            continue
        size = int(np.prod([int(x) for x in m.group(2).split(",")]))
        for leaf in jax.tree.leaves(cache):
            if size != int(np.prod(leaf.shape)):
                continue
            other_type = m.group(1) != HLO_TYPES[jnp.dtype(leaf.dtype).name]
            if m.group(3) == "copy" or (other_type and m.group(3) not in ("bitcast", "parameter", "get-tuple-element")):
                found.append(line.strip()[:160])
    return found


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_dir):
    return paxpage.load(tiny_llama_dir)


def decode_step_hlo(model, rows: int, **config) -> tuple[str, object]:
    """The compiled step of `rows` one-token rows (the pool donated, as the engine's step does) and
    the runner's pool; None when the asked attention impl does not build here."""
    cfg = paxpage.EngineConfig(page_size=16, num_pages=512, max_num_seqs=4, max_num_batched_tokens=64,
                               **config)
    runner = LLMEngine(model.config, model.params, None, cfg).runner
    if "attention_impl" in config and runner.cfg.attention_impl != config["attention_impl"]:
        return None, None
    prompts = random_prompts(rows, 128, [13] * rows, seed=3)
    plans = [RowPlan(p, list(range(4 * i, 4 * i + 4)), 12, 1, 1) for i, p in enumerate(prompts)]
    batch = runner.packer.pack(plans)[0]
    assert batch.dec_kv_lens.shape[0] >= rows  # the one-token rows form the decode part (padded to a bucket)
    step = jax.jit(runner.model.apply, donate_argnums=(2,))
    return step.lower(layer_stack.variables(runner.params), batch, runner.kv_cache).compile().as_text(), runner.kv_cache


# (attention impl, model dtype, kv_cache_dtype). The KV write is the native kernel on CPU
# (native_kv_write.py); XLA CPU's gather converts a bf16 or fp8 operand whole, so the "xla" path's
# reads of a bf16 pool and every path's reads of an fp8 pool are not held to it (docs/architecture.md).
CASES = [("native", "float32", "auto"), ("native", "float32", "int8"), ("native", "float32", "fp8"),
         ("native", "bfloat16", "auto"), ("native", "bfloat16", "int8"), ("xla", "float32", "auto"),
         ("xla", "float32", "int8")]


@pytest.mark.parametrize("impl,dtype,kv_cache_dtype", CASES)
@pytest.mark.parametrize("rows", [1, 3])
def test_a_decode_step_writes_the_pool_in_place(tiny_model, impl, dtype, kv_cache_dtype, rows):
    hlo, cache = decode_step_hlo(tiny_model, rows, attention_impl=impl, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                                 scan_layers=True)
    if hlo is None:
        pytest.skip(f"the {impl} attention kernel does not build here")
    found = whole_leaf_copies(hlo, cache)
    assert found == [], "\n".join(found)


@pytest.mark.parametrize("rows", [1, 3])
def test_a_latent_decode_step_writes_the_pool_in_place(tmp_path, rows):
    save_tiny_deepseek(tmp_path, vocab_size=128)
    hlo, cache = decode_step_hlo(paxpage.load(tmp_path), rows)
    found = whole_leaf_copies(hlo, cache)
    assert found == [], "\n".join(found)
