"""The attention implementations (`EngineConfig.attention_impl`): their one registry, and which
paged attention and KV write a runner's step runs for each.

"native" is the C++ CPU kernel (pallas_kernels/native_attention.py), built with g++ on first use
into paxpage's cache directory + /native; where it is off (PAXPAGE_NATIVE_ATTENTION=0) or cannot
be built or loaded, "xla" runs instead (the same attention in XLA ops). "pallas" and
"pallas-interpret" are the Pallas kernels (pallas_kernels/dispatch.py), imported only when used.

Every implementation takes gpt-oss's attention sinks (a `sinks` f32[N] argument).

Latent-attention models (DeepSeek-V2 / V3, ModelConfig.is_mla) have one path: the chunked XLA form over
the latent pool (pallas_kernels/latent_attention.py), "xla" here. `latent_impl` maps the choice.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

import jax

from pallas_kernels import kv_layout, latent_attention, reference
from pallas_kernels.xla_attention import paged_attention_xla


log = logging.getLogger("paxpage")


@dataclasses.dataclass(frozen=True)
class AttentionImpl:
    name: str
    summary: str  # for the logs and the CLI's help
    cpu_only: bool  # a CPU kernel: refused on GPU / TPU
    pallas: bool  # the Pallas kernels (pallas_kernels/dispatch.py), compiled or interpreted
    # kernel families ("cpu", "gpu", "tpu") where it has the batch-invariant form (a fixed order of
    # every reduction whatever shares the step)
    batch_invariant: tuple[str, ...]


REGISTRY: dict[str, AttentionImpl] = {impl.name: impl for impl in (
    AttentionImpl("native", "the C++ CPU kernel, built with g++ on first use (else xla)", True, False, ("cpu",)),
    AttentionImpl("xla", "paged attention in XLA ops", False, False, ("cpu",)),
    AttentionImpl("pallas", "the Pallas kernels (GPU / TPU default)", False, True, ("gpu",)),
    AttentionImpl("pallas-interpret", "the Pallas kernels, interpreted (tests)", False, True, ("gpu",)),
)}
NAMES = tuple(REGISTRY)


def get(name: str) -> AttentionImpl:
    """The registry entry of `name`; ValueError naming the choices."""
    if name not in REGISTRY:
        raise ValueError(f"attention_impl must be one of {NAMES}, got {name!r}")
    return REGISTRY[name]


def default(backend: str) -> str:
    """The implementation a backend runs when attention_impl is None."""
    return "native" if backend == "cpu" else "pallas"


def check_batch_invariant(impl: str, family: str | None) -> None:
    """ValueError unless `impl` has a batch-invariant form on its kernel family (None: the CPU's)."""
    if (family or "cpu") not in get(impl).batch_invariant:
        raise ValueError("batch_invariant needs the native or XLA CPU attention or the Pallas GPU kernel; "
                         f"attention_impl resolved to {impl!r}" + (f" for {family}" if family else ""))


def describe(impl: str, asked: str | None, backend: str | None) -> str:
    """One log line: what runs, and why it differs from what was asked."""
    line = f"attention {impl}: {get(impl).summary}"
    if backend:
        line += f", lowered for {backend}"
    if asked is not None and asked != impl:
        line += f" (asked for {asked!r}, unavailable here)"
    return line


def latent_impl(impl: str) -> str:
    """The impl a latent-attention model runs for the asked `impl`: "xla" (its one path). "native"
    falls back to it with a log line; the Pallas kernels have no latent-attention form and raise."""
    if get(impl).pallas:
        raise ValueError(f"attention_impl {impl!r} has no kernel for multi-head latent attention "
                         "(DeepSeek-V2 / V3); use 'xla' (or leave attention_impl unset)")
    if impl == "native":
        log.info("paxpage: latent attention has no native kernel; running its XLA path")
    return "xla"


def resolve(impl: str) -> str:
    """`impl`, or "xla" when it is "native" and the native kernel is off or cannot be built or
    loaded here (pallas_kernels.native_attention.load warns once why)."""
    if impl != "native":
        return impl
    if os.environ.get("PAXPAGE_NATIVE_ATTENTION", "1") == "0":
        return "xla"
    from models.cache import native_dir
    from pallas_kernels import native_attention

    return "native" if native_attention.load(native_dir()) else "xla"


def _on_cpu(backend: str | None) -> bool:
    """Whether a step for `backend` (the compile target's; None: this host's) runs on this CPU."""
    return backend in (None, "cpu") and jax.default_backend() == "cpu"


def _kv_write(backend: str | None, latent: bool):
    """The KV write of the "native" / "xla" / latent paths: on this CPU the native kernel where it
    builds and loads (pallas_kernels/native_kv_write.py; not with PAXPAGE_NATIVE_ATTENTION=0),
    else XLA's scatter (reference.write_kv, latent_attention.write_latent)."""
    if _on_cpu(backend) and os.environ.get("PAXPAGE_NATIVE_ATTENTION", "1") != "0":
        from models.cache import native_dir
        from pallas_kernels import native_kv_write

        if native_kv_write.load(native_dir()):
            return native_kv_write.write_latent if latent else native_kv_write.write_kv
    return latent_attention.write_latent if latent else reference.write_kv


def kernel_family(impl: str) -> str | None:
    """"gpu" or "tpu" for a Pallas impl (the kernels it runs here), None for "native" / "xla"."""
    if not get(impl).pallas:
        return None
    from pallas_kernels import dispatch

    return dispatch.resolve_impl(impl)[0]


def pool_layout(impl: str, backend: str | None, latent: bool = False) -> kv_layout.KVLayout:
    """The layout a runner's pool gets (pallas_kernels/kv_layout.py), scanned layers or not: its
    Pallas kernel family's (the TPU kernels' tiles on "tpu"), canonical for "native" (the kernel
    reads a quantised pool's bf16 scales as stored) and "xla" (with f32 scales,
    kv_layout.XLA_CANONICAL: XLA CPU's gather would convert a bf16 scales array whole in every
    layer) and for a latent pool. `impl` as asked: a "native" that resolves to "xla" keeps its
    pool (and its sizing). backend: the compile target's ("cpu" or None: this host's kernels;
    compiled "pallas" has none there, and the runner says so)."""
    if impl == "native":
        return kv_layout.CANONICAL
    if not get(impl).pallas:
        return kv_layout.XLA_CANONICAL
    if backend in ("gpu", "tpu"):
        family = backend
    else:
        family = None if impl == "pallas" and backend == "cpu" else kernel_family(impl)
    return kv_layout.for_backend(family, latent=latent)


def functions(impl: str, backend: str | None = None, batch_invariant: bool = False, latent: bool = False,
              layout: str = "canonical"):
    """(attention, write_kv) of a resolved impl ("native" only once `resolve` returned it).
    latent: those of a latent-attention model's pool (impl must be `latent_impl`'s "xla").
    backend: "gpu" or "tpu" makes the Pallas kernels lower for that family whatever this host
    is (pallas_kernels/dispatch.py); None: the compile target's. layout: the pool's
    pallas_kernels.kv_layout name, "tpu" only with the TPU family's Pallas kernels.
    batch_invariant: the Pallas GPU kernel's fixed-split plan, the XLA path's token-per-row form (the
    native kernel's order per row is fixed already)."""
    if layout != "canonical" and not get(impl).pallas:
        raise ValueError(f"attention impl {impl!r} reads the canonical KV layout; got {layout!r}")
    if latent:
        assert impl == "xla", impl
        attention = latent_attention.latent_attention_xla
        if batch_invariant:
            attention = functools.partial(attention, batch_invariant=True)
        return attention, _kv_write(backend, latent=True)
    if impl == "native":
        from pallas_kernels.native_attention import paged_attention_native

        return paged_attention_native, _kv_write(backend, latent=False)
    if impl == "xla":
        attention = paged_attention_xla
        if batch_invariant:
            attention = functools.partial(attention, batch_invariant=True)
        return attention, _kv_write(backend, latent=False)
    from pallas_kernels import dispatch  # imported lazily: Pallas is not needed on the fast CPU path

    return (
        functools.partial(dispatch.paged_attention, impl=impl, backend=backend, batch_invariant=batch_invariant,
                          layout=layout),
        functools.partial(dispatch.write_kv, impl=impl, backend=backend, layout=layout),
    )
