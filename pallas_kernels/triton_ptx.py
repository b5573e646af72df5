"""Registers, spills and shared memory of a Pallas Triton kernel, compiled here without a GPU.

The exported module holds each kernel's Triton IR (gpu_launches.triton_irs). When the standalone
`triton` package and CUDA's `ptxas` are installed, that IR is compiled for sm_90a to PTX and
`ptxas -v` reports the resources. The standalone Triton need not be the version XLA bundles, so
these figures are indicative; the device compiles the IR with its own.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile


def unavailable_reason() -> str | None:
    """Why this host cannot compile Triton IR to PTX, else None."""
    try:
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001 - missing or broken both mean "cannot"
        return f"no triton package ({type(e).__name__})"
    if shutil.which("ptxas") is None:
        return "no ptxas on PATH"
    return None


def resources(ir_bytes: bytes, *, num_warps: int, num_stages: int, arch: int = 90) -> dict:
    """{registers, spill_stores, spill_loads, shared_bytes, mma} of one kernel's Triton IR."""
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as tmp:
        bytecode = os.path.join(tmp, "kernel.mlirbc")
        with open(bytecode, "wb") as f:
            f.write(ir_bytes)
        context = ir.context()
        ir.load_dialects(context)
        source = os.path.join(tmp, "kernel.ttir")  # triton.compile reads text IR by suffix
        with open(source, "w") as f:
            f.write(str(ir.parse_mlir_module(bytecode, context)))
        kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                                options=dict(num_warps=num_warps, num_stages=num_stages))
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        log = subprocess.run(["ptxas", "-v", f"--gpu-name=sm_{arch}a", ptx, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, timeout=120, check=True).stderr
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    mma = sorted(set(re.findall(r"\b(w?g?mma[.a-z0-9_]*)", kernel.asm["ptx"])))
    return dict(registers=int(re.search(r"Used (\d+) registers", log).group(1)),
                spill_stores=int(spills.group(1)), spill_loads=int(spills.group(2)),
                shared_bytes=int(kernel.metadata.shared), mma=mma[:3])
