"""Data-dependent control flow in an exported StableHLO module.

On XLA:GPU a `while` whose trip count is not known at compile time, and a `case` / `if` whose
index or predicate is not, copy a value from the device to the host and wait for it, every
iteration or every time: a host round trip inside the step. A loop with a fixed trip count (a
`fori_loop` or `scan` with static bounds: a counter from a constant, stepped by a constant,
compared with a constant) runs without one, and so does a conditional on a constant (what
`lax.platform_dependent` leaves when lowering for one platform; XLA folds it).

`data_dependent_control(module_text)` lists the offending ops of a module (`Exported.mlir_module()`).
Values count as constant when they follow from `stablehlo.constant`s (and iotas) through ops
without regions; a function argument or a loop-carried value is data, except a loop counter as
described above. The rule is conservative: a loop bounded by a constant passed into a private
function is reported.
"""

from __future__ import annotations

import re

_CONDITIONALS = ("stablehlo.case", "stablehlo.if")
_LOC_NAME = re.compile(r'loc\("([^"]*)"')
_MAX_DEPTH = 64


def data_dependent_control(module_text: str) -> list[str]:
    """`name at location` of every while / case / if of the module whose trip count, index or
    predicate depends on data (module docstring); [] when there is none."""
    from jax._src.interpreters import mlir as jax_mlir  # jax's own MLIR bindings and dialects
    from jax._src.lib.mlir import ir

    found: list[str] = []

    def block_arg(value):  # the value as an ir.BlockArgument, or None
        down = value.maybe_downcast() if hasattr(value, "maybe_downcast") else value
        if isinstance(down, ir.BlockArgument):
            return down
        if hasattr(value, "maybe_downcast"):
            return None
        try:  # bindings without maybe_downcast
            return ir.BlockArgument(value)
        except (ValueError, TypeError):
            return None

    def owner_op(value):
        if block_arg(value) is not None:
            return None
        owner = value.owner
        return getattr(owner, "operation", owner)

    def is_constant(value, depth: int = 0) -> bool:
        op = None if depth > _MAX_DEPTH else owner_op(value)
        if op is not None and op.name in _CONDITIONALS:  # platform_dependent's index: a case of constants
            number = value.maybe_downcast().result_number if hasattr(value, "maybe_downcast") \
                else ir.OpResult(value).result_number
            return is_constant(op.operands[0], depth + 1) and all(
                is_constant(result_of(region.blocks[0], number), depth + 1) for region in op.regions)
        if op is None or len(op.regions) or op.name in ("stablehlo.custom_call", "func.call"):
            return False
        return all(is_constant(operand, depth + 1) for operand in op.operands)

    def result_of(block, index):  # the value a region's terminator returns at `index`
        return list(block.operations)[-1].operands[index]

    def fixed_trip_count(op) -> bool:
        cond, body = (region.blocks[0] for region in op.regions)
        compare = owner_op(result_of(cond, 0))
        if compare is None or compare.name != "stablehlo.compare":
            return False
        lhs, rhs = compare.operands
        for counter, bound in ((lhs, rhs), (rhs, lhs)):
            counter = block_arg(counter)
            if counter is None or not is_constant(bound) or not is_constant(op.operands[counter.arg_number]):
                continue
            index = counter.arg_number
            add = owner_op(result_of(body, index))
            if add is None or add.name not in ("stablehlo.add", "stablehlo.subtract"):
                continue
            for arg, inc in (tuple(add.operands), tuple(add.operands)[::-1]):
                arg = block_arg(arg)
                if arg is not None and arg.arg_number == index and arg.owner == body and is_constant(inc):
                    return True
        return False

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    child = child.operation
                    if (child.name == "stablehlo.while" and not fixed_trip_count(child)) or (
                            child.name in _CONDITIONALS and not is_constant(child.operands[0])):
                        where = _LOC_NAME.search(str(child.location))
                        found.append(f"{child.name} at {where.group(1) if where else child.location}")
                    walk(child)

    with jax_mlir.make_ir_context():
        walk(ir.Module.parse(module_text).operation)
    return found
