"""Which device a kernel traced now compiles for, and pinning that device for the Mosaic TPU lowering.

Mosaic's lowering asks which TPU generation it lowers for (lane and sublane counts, native bf16)
and reads it from jax's abstract mesh, else from jax's default device. Without care a kernel
compiled for a TPU from a host whose default backend is the CPU (ahead-of-time compilation
against `jax.experimental.topologies`, scripts/tpu_compile_check.py) is asked about the CPU and
fails ("Unsupported TPU device kind: cpu").

The compile target is, in jax's own order:
1. the abstract mesh's device: inside `shard_map` over a mesh of TPU devices, or under
   `jax.set_mesh(mesh)`;
2. else jax's default device (`jax.default_device(device)` sets it; by default the first device
   of the default backend).

`pinned(backend, interpret)` wraps a TPU `pallas_call`: it records the target as the call's
abstract device at trace time, so the lowering, whenever it runs, asks about that TPU.
"""

from __future__ import annotations

import contextlib

import jax


def _context_device():
    """The abstract mesh's device, or None (no mesh, or a jax without abstract devices)."""
    get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
    return getattr(get_mesh(), "abstract_device", None) if get_mesh is not None else None


def compile_target():
    """The device (or jax.sharding.AbstractDevice) a function traced now compiles for; it has
    `platform` and `device_kind`."""
    abstract = _context_device()
    if abstract is not None:
        return abstract
    default = getattr(jax.config, "jax_default_device", None)
    if isinstance(default, str):
        return jax.devices(default)[0]
    return default if default is not None else jax.devices()[0]


def compile_platform() -> str:
    """"cpu", "gpu" or "tpu": the platform of `compile_target()`."""
    platform = compile_target().platform
    return "gpu" if platform in ("cuda", "rocm") else platform


def pinned(backend: str, interpret: bool):
    """Context for tracing a TPU kernel's pallas_call: the abstract mesh names the compile
    target, unless one already does (shard_map, jax.set_mesh) or nothing is lowered for a TPU
    (interpret mode, or a GPU kernel)."""
    if backend != "tpu" or interpret or _context_device() is not None:
        return contextlib.nullcontext()
    target = compile_target()
    if target.platform != "tpu":
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice(device_kind=target.device_kind, num_cores=getattr(target, "num_cores", 1),
                                         platform="tpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device))
