"""Triton kernel launches of a function lowered for CUDA, read from its exported StableHLO.

`jax.export(..., platforms=["cuda"])` runs the whole Pallas -> Triton lowering on any host, a
CPU-only one included, and each Pallas kernel becomes one `__gpu$xla.gpu.triton` custom call whose
backend config holds the launch: grid (x, y, z), num_warps, num_stages and the kernel's name.
Tests hold grid sizes with this; scripts/kernel_report.py prints it beside the bytes and FLOPs.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
from jax import export

TRITON_CALL = "__gpu$xla.gpu.triton"
# Kernel custom calls carry no serialisation-compatibility promise; these are lowered, never stored.
KERNEL_CALLS = (TRITON_CALL, "tpu_custom_call", "mosaic_gpu_v2")

_IR = re.compile(r'ir = "(?:[^"\\]|\\.)*"')  # the serialised Triton IR: may hold any byte
_CALL = re.compile(r"stablehlo\.custom_call @__gpu\$xla\.gpu\.triton\([^)]*\) \{mhlo\.backend_config = \{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Launch:
    name: str
    grid: tuple[int, int, int]
    num_warps: int
    num_stages: int

    @property
    def programs(self) -> int:
        return math.prod(self.grid)


def export_for(fn, args, platform: str = "cuda") -> export.Exported:
    """`fn` (jitted here) lowered for `platform` on this host; args may be ShapeDtypeStructs."""
    checks = [export.DisabledSafetyCheck.custom_call(name) for name in KERNEL_CALLS]
    return export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(*args)


def _int_attr(config: str, key: str) -> int:
    match = re.search(rf"\b{key} = (\d+) : i32", config)
    if match is None:
        raise ValueError(f"no {key} in a Triton call's backend config")
    return int(match.group(1))


def triton_launches(module_text: str) -> list[Launch]:
    """Every Triton launch in an exported module's text (`Exported.mlir_module()`), in order."""
    launches = []
    for match in _CALL.finditer(_IR.sub('ir = ""', module_text)):
        config = match.group(1)
        name = re.search(r'name = "([^"]*)"', config)
        launches.append(Launch(
            name=name.group(1) if name else "",
            grid=tuple(_int_attr(config, f"grid_{axis}") for axis in "xyz"),
            num_warps=_int_attr(config, "num_warps"),
            num_stages=_int_attr(config, "num_stages"),
        ))
    return launches


def triton_irs(exported: export.Exported) -> list[bytes]:
    """The serialised Triton IR (MLIR bytecode) of every Triton launch, in module order."""
    from jax._src.interpreters import mlir as jax_mlir  # jax's own MLIR bindings and dialects
    from jax._src.lib.mlir import ir

    found = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    child = child.operation
                    if child.name == "stablehlo.custom_call" and \
                            ir.StringAttr(child.attributes["call_target_name"]).value == TRITON_CALL:
                        config = child.attributes["mhlo.backend_config"]
                        found.append(bytes(ir.StringAttr(config["ir"]).value_bytes))
                    walk(child)

    with jax_mlir.make_ir_context():
        walk(ir.Module.parse(exported.mlir_module()).operation)
    return found
