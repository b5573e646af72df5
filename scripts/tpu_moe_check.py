"""The routed experts' grouped matmuls compiled for a TPU (scripts/tpu_compile_check.py's fifth
check): models/moe.expert_sums at gpt-oss-20b's expert shapes (E = 32 experts of width 2880,
hidden 2880, 4 per token) with the experts held as bf16, as int8 with one scale per output
channel (`quantization="int8"`), as int8 with one scale per 32 inputs (a GGUF's Q8_0 experts) and
as gpt-oss's MXFP4 experts are held (two 4-bit codes a byte, one scale per 32 inputs), through "ragged_dot" (the TPU's default) and "tiled", at 64 tokens (decode) and 2,048
(a prefill). A quantised form must not write its experts out again in floats: temporaries beyond
the bf16 form's (same chip, tokens and impl) reaching half of all the experts' bf16 expansion
are a FINDING (XLA fusing each tile's expansion into its matmul, or the grouped matmul reading
the int8 values as they are, keeps them at about 1 MiB at 64 tokens).

Axis legend: T tokens, H hidden, E experts, k experts per token, F expert width, G inputs per scale.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tpu_targets import CHIPS, devices, mib  # noqa: I001

# gpt-oss-20b: hidden 2880, 32 experts of width 2880, 4 per token.
EXPERTS, HIDDEN, WIDTH, TOP_K = 32, 2880, 2880, 4
# form -> (inputs per scale, None: one per output channel; bits per value); None: bf16
FORMS = {"bf16": None, "int8 per channel": (None, 8), "int8, G=32 (GGUF Q8_0)": (32, 8),
         "mxfp4 4-bit, G=32": (32, 4)}


def _weights(form: str, sds):
    """(gate_up, down) abstract expert weights in `form`: [E, H, 2F] and [E, F, H], float or quantised
    (models/quant.QuantizedWeight: int8 values, or two e2m1 codes a byte as u8[E, I / 2, O])."""
    from models.quant import QuantizedWeight

    shapes = ((EXPERTS, HIDDEN, 2 * WIDTH), (EXPERTS, WIDTH, HIDDEN))
    if FORMS[form] is None:
        return tuple(sds(shape, jnp.bfloat16) for shape in shapes)
    group, bits = FORMS[form]
    weights = []
    for experts, inputs, outputs in shapes:
        values = sds((experts, inputs * bits // 8, outputs), jnp.int8 if bits == 8 else jnp.uint8)
        weights.append(QuantizedWeight(values, sds((experts, 1 if group is None else inputs // group, outputs),
                                                   jnp.float32)))
    return tuple(weights)


def check_moe(quick: bool, report: dict) -> tuple[list[str], list[str]]:
    """Compiles each form x impl x token count; returns (failures, findings)."""
    from models.moe import expert_sums

    failures, findings, rows = [], [], []
    expansion = EXPERTS * 3 * HIDDEN * WIDTH * 2  # every expert's gate_up and down in bf16
    floats = {}  # (chip, tokens, impl) -> the bf16 form's temporaries
    for chip in ("v5e",) if quick else tuple(CHIPS):
        device = devices(CHIPS[chip][0])[0]
        sharding = jax.sharding.SingleDeviceSharding(device)
        sds = functools.partial(jax.ShapeDtypeStruct, sharding=sharding)
        for tokens in (64,) if quick else (64, 2048):
            for form in FORMS:
                for impl in ("ragged_dot", "tiled"):
                    label = f"{chip} T={tokens} {form} {impl}"
                    gate_up, down = _weights(form, sds)
                    try:
                        compiled = jax.jit(functools.partial(expert_sums, impl=impl)).lower(
                            sds((tokens, HIDDEN), jnp.bfloat16), sds((tokens, TOP_K), jnp.float32),
                            sds((tokens, TOP_K), jnp.int32), gate_up, down).compile()
                    except Exception as e:  # noqa: BLE001 (a compile error is the finding)
                        failures.append(f"moe {label}: {type(e).__name__}: {str(e)[:300]}")
                        continue
                    memory = compiled.memory_analysis()
                    row = {"chip": chip, "tokens": tokens, "form": form, "impl": impl,
                           "argument_bytes": memory.argument_size_in_bytes, "temp_bytes": memory.temp_size_in_bytes}
                    rows.append(row)
                    print(f"  {label}: weights + inputs {mib(row['argument_bytes'])}, "
                          f"temporaries {mib(row['temp_bytes'])}")
                    if form == "bf16":
                        floats[chip, tokens, impl] = row["temp_bytes"]
                    elif row["temp_bytes"] - floats.get((chip, tokens, impl), 0) >= expansion / 2:
                        findings.append(f"moe {label}: {mib(row['temp_bytes'])} of temporaries, against half "
                                        f"of the experts' bf16 expansion ({mib(expansion / 2)}) beyond the bf16 "
                                        "form's: the experts are expanded")
    report["moe"] = rows
    return failures, findings
