"""Engine configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax

from models.config import ModelConfig
from paxpage.sharding import ShardingPlan, kv_page_bytes_per_device
from paxpage.speculative.draft_model import draft_page_bytes, validate_draft_model

from paxpage import attention_impl
from paxpage.kv_sizing import DEFAULT_KV_CACHE_BYTES

ATTENTION_IMPLS = attention_impl.NAMES  # what each is: paxpage/attention_impl.py
DTYPES = ("float32", "bfloat16")
# "auto": the pool in the model's dtype; "int8" / "fp8" (float8_e4m3fn): quantised per (token,
# kv head) with bf16 scales beside the pages (pallas_kernels/kv_quant.py).
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
SPECULATIVE_METHODS = (None, "ngram", "draft")
MAX_SPECULATIVE_TOKENS = 16
# Decoding sequences up to which a step speculates by default. Provisional: to be measured
# with scripts/bench_speculative.py --sweep on a quiet machine (docs/speculative-decoding.md).
AUTO_SPECULATIVE_MAX_BATCH = 4


@dataclasses.dataclass(frozen=True)
class BackendDefaults:
    """What an EngineConfig field left at None becomes on one backend (docs/engine-options.md)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    prefill_row_len: int
    scan_pallas: bool  # scan_layers="auto" also scans the layers when attention is the Pallas kernel
    precompile: bool


# CPU: tuned for a few cores (a wide step mostly waits on the matmuls). GPU / TPU: one
# accelerator, where a step of few rows leaves it idle. Accelerator figures are provisional
# until scripts/device_check.sh measures them on a lent device.
BACKEND_DEFAULTS = {
    "cpu": BackendDefaults(max_num_seqs=64, max_num_batched_tokens=512, prefill_row_len=32,
                           scan_pallas=False, precompile=False),
    # Compiles on first use (kept by the executable cache): every shape up front is minutes of
    # XLA:GPU compiles at the default step sizes.
    "gpu": BackendDefaults(max_num_seqs=256, max_num_batched_tokens=2048, prefill_row_len=64,
                           scan_pallas=True, precompile=False),
    # Every shape up front: an XLA:TPU compile met under load stalls all running streams. Layers
    # unrolled until a TPU run times the two: compiled for TPU, the scanned step (scan_layers=True)
    # makes no pool copy either, and compiles one layer (scripts/tpu_compile_check.py).
    "tpu": BackendDefaults(max_num_seqs=256, max_num_batched_tokens=2048, prefill_row_len=64,
                           scan_pallas=False, precompile=True),
}
STEP_DEFAULT_FIELDS = ("max_num_seqs", "max_num_batched_tokens", "prefill_row_len", "precompile")


def backend_defaults(backend: str | None = None) -> BackendDefaults:
    """The defaults of `backend` (jax's default backend when None)."""
    backend = backend or jax.default_backend()
    if backend not in BACKEND_DEFAULTS:
        raise ValueError(f"backend is {backend!r}; expected one of {tuple(BACKEND_DEFAULTS)}")
    return BACKEND_DEFAULTS[backend]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16  # tokens per KV page
    num_pages: int | None = None  # pool size; derived from kv_cache_bytes when None
    # KV memory budget per device. When both are None: a fixed 1 GiB on CPU; on GPU / TPU what
    # gpu_memory_utilization of the device leaves after the weights and a compiled step.
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9  # fraction of device memory the process may fill (GPU / TPU)
    # None: the backend's default (BACKEND_DEFAULTS; CPU 64 / 512 / 32, GPU and TPU 256 / 2048 / 64).
    max_num_seqs: int | None = None  # sequences per step
    max_num_batched_tokens: int | None = None  # new tokens per step (prefill chunks + decodes)
    max_model_len: int | None = None  # prompt + output tokens; model's limit when None
    prefill_row_len: int | None = None  # Tq: prefill tokens are packed in rows of this width
    # Prefill rows per step; None: max_num_batched_tokens // prefill_row_len (at least 1). A cap
    # keeps the step shapes few: without one every admitted short prompt is a row of its own, so
    # a step could hold max_num_seqs + tokens // Tq mostly empty rows (compile_plan.step_shapes).
    max_prefill_rows: int | None = None
    dtype: str | None = None  # "float32" on CPU, "bfloat16" on GPU/TPU when None
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    attention_impl: str | None = None  # "native" on CPU, "pallas" on GPU/TPU when None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # "paged": pages on demand. "contiguous": the pre-paging scheme, reserving max_model_len
    # tokens per sequence at admission; kept as a baseline for the memory benchmark.
    kv_allocation: str = "paged"
    # Dispatch step t+1 while step t runs (its tokens are read one step late); False: every
    # step waits for its tokens before the next is scheduled. Outputs are the same.
    async_scheduling: bool = True
    # Compile every step shape when the engine is built (LLMEngine.precompile), not on first use.
    # None: the backend's default (on TPU only).
    precompile: bool | None = None
    # A directory for compiled executables (paxpage/exec_cache.py): a later engine of the same
    # model, config and code loads its steps from here without tracing or compiling. None: off
    # (the CLI and `paxpage serve` turn it on in paxpage's cache directory). Single-device only.
    executable_cache_dir: str | None = None
    # Run the decoder layers as one lax.scan over stacked params and a stacked KV pool
    # (models/layer_stack.py): a step compiles in about the time of one layer instead of L.
    # "auto": where the layer kinds repeat and attention is "native" or "xla", and on GPU / TPU
    # with the Pallas kernels too (BACKEND_DEFAULTS.scan_pallas; the kernels then see one pool of
    # L * P pages); True: wherever they repeat (an error where they do not); False: the unrolled loop.
    scan_layers: bool | str = "auto"
    # Parallelism (paxpage/sharding.py, paxpage/mesh.py, docs/parallelism.md): weights and the
    # KV pool split over tensor_parallel_size devices; data_parallel_size such engine replicas
    # behind one front door. `mesh`: an explicit jax.sharding.Mesh with a "model" axis (and a
    # "data" axis when data_parallel_size > 1) instead of the first tp * dp devices.
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    mesh: jax.sharding.Mesh | None = None
    # Expert parallelism: a MoE model's routed experts split whole over the tensor-parallel
    # devices (E / tp experts each, full width) instead of each expert's width over them.
    enable_expert_parallel: bool = False
    # Speculative decoding (paxpage/speculative/, docs/speculative-decoding.md): None, "ngram" (prompt
    # lookup of the sequence's own earlier tokens) or "draft" (a smaller paxpage model,
    # `draft_model`). Each decoding sequence proposes up to num_speculative_tokens tokens that
    # the target verifies in one step; outputs keep the target's distribution (greedy: token for
    # token). ngram_min / ngram_max: the n-gram lengths looked up, longest first.
    speculative_method: str | None = None
    num_speculative_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 4
    draft_model: Any = None
    # Adaptive: a step speculates only while at most this many sequences run ("auto":
    # AUTO_SPECULATIVE_MAX_BATCH); past it verification costs more than it saves.
    speculative_max_batch: int | str = "auto"
    # A request's logits and tokens bitwise the same whatever shares its step: row-stable matmuls,
    # norms and softmax sums in a fixed order (models/invariant_ops.py), attention whose order per
    # token is fixed: the native kernel, the XLA path's token-per-row form or the Pallas GPU kernel's
    # fixed key segments (the TPU kernels are refused when the runner resolves them).
    batch_invariant: bool = False
    # LoRA adapters (docs/lora.md): max_loras > 0 gives the step a device slab of that many
    # adapter slots, each up to max_lora_rank; requests then name an adapter (or the base).
    # More adapters may be loaded than fit: they swap into slots least recently used first.
    # 0: no slab, and the step is the base model's alone.
    max_loras: int = 0
    max_lora_rank: int = 16

    def __post_init__(self):
        for name in ("page_size", "tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("num_pages", "kv_cache_bytes", "max_model_len", "max_prefill_rows", "max_num_seqs",
                     "max_num_batched_tokens", "prefill_row_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if self.num_pages is not None and self.kv_cache_bytes is not None:
            raise ValueError(
                f"give num_pages ({self.num_pages}) or kv_cache_bytes ({self.kv_cache_bytes}), not both"
            )
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0.0 < u <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {u!r}")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.precompile is not None and not isinstance(self.precompile, bool):
            raise TypeError(f"precompile must be a bool or None, got {self.precompile!r}")
        if not (isinstance(self.scan_layers, bool) or self.scan_layers == "auto"):
            raise ValueError(f"scan_layers must be True, False or 'auto', got {self.scan_layers!r}")
        if self.executable_cache_dir is not None and not isinstance(self.executable_cache_dir, (str, os.PathLike)):
            raise TypeError(f"executable_cache_dir must be a path or None, got {self.executable_cache_dir!r}")
        if self.kv_allocation not in ("paged", "contiguous"):
            raise ValueError(f"kv_allocation must be 'paged' or 'contiguous', got {self.kv_allocation!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.attention_impl is not None:
            attention_impl.get(self.attention_impl)
        self._validate_speculative()
        for name, low in (("max_loras", 0), ("max_lora_rank", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if not isinstance(self.batch_invariant, bool):
            raise TypeError(f"batch_invariant must be a bool, got {self.batch_invariant!r}")
        if not isinstance(self.enable_expert_parallel, bool):
            raise TypeError(f"enable_expert_parallel must be a bool, got {self.enable_expert_parallel!r}")
        if self.mesh is not None and not isinstance(self.mesh, jax.sharding.Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got {type(self.mesh).__name__}")

    def _validate_speculative(self) -> None:
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be one of {SPECULATIVE_METHODS}, "
                             f"got {self.speculative_method!r}")
        for name in ("num_speculative_tokens", "ngram_min", "ngram_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens is {self.num_speculative_tokens}; "
                             f"at most {MAX_SPECULATIVE_TOKENS}")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})")
        limit = self.speculative_max_batch
        if limit != "auto" and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
            raise ValueError(f"speculative_max_batch must be 'auto' or an int >= 0, got {limit!r}")
        if (self.speculative_method == "draft") != (self.draft_model is not None):
            raise ValueError("draft_model is given exactly when speculative_method is 'draft'; got "
                             f"speculative_method={self.speculative_method!r}, draft_model={self.draft_model!r}")

    @property
    def resolved_speculative_max_batch(self) -> int:
        limit = self.speculative_max_batch
        return AUTO_SPECULATIVE_MAX_BATCH if limit == "auto" else limit

    @property
    def is_parallel(self) -> bool:
        """False on the one-device path (no mesh, tp = dp = 1), which runs exactly as before."""
        return self.mesh is not None or self.tensor_parallel_size > 1 or self.data_parallel_size > 1

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def resolve(self, model: ModelConfig, backend: str | None = None) -> "ResolvedConfig":
        """Fills the defaults that depend on the model and the backend (jax's default one unless
        given). On GPU / TPU without num_pages or kv_cache_bytes, num_pages stays None: the
        runner sizes the pool from the device's free memory once the weights are placed."""
        backend = backend or jax.default_backend()
        defaults = backend_defaults(backend)
        on_cpu = backend == "cpu"
        dtype = self.dtype or ("float32" if on_cpu else "bfloat16")
        impl = self.attention_impl or attention_impl.default(backend)
        if model.is_mla:
            impl = attention_impl.latent_impl(impl if self.attention_impl else "xla")
            if self.max_loras:
                raise ValueError(f"LoRA adapters are not supported with latent attention ({model.model_type}); "
                                 f"got max_loras={self.max_loras}")
        if attention_impl.get(impl).cpu_only and not on_cpu:
            raise ValueError(f"attention_impl='native' is a CPU kernel, but the backend is "
                             f"{backend!r}; use 'pallas'")
        max_model_len = self.max_model_len or model.max_position_embeddings
        if max_model_len > model.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's "
                f"max_position_embeddings {model.max_position_embeddings}"
            )
        itemsize = 4 if dtype == "float32" else 2
        # Per device: a tensor-parallel split of the KV heads shrinks it (kv_cache_bytes is a
        # per-device budget, so tp devices hold up to tp times the pages; sharding.py).
        # A quantised pool counts its 1-byte values and its scales.
        plan = ShardingPlan.for_model(model, self.tensor_parallel_size, self.enable_expert_parallel)
        scan_period = self._scan_period(model, impl, defaults.scan_pallas)
        layout = attention_impl.pool_layout(impl, backend, model.is_mla)  # as the runner's
        page_bytes = kv_page_bytes_per_device(model, plan, self.page_size, itemsize, self.kv_cache_dtype, layout)
        if self.speculative_method == "draft":
            # The draft's pool has a page for each of the target's (paxpage/speculative/draft.py): one
            # budget pays for both, so a page costs the two models' K/V bytes.
            validate_draft_model(self.draft_model, model)
            page_bytes += draft_page_bytes(self.draft_model.config, self.page_size, itemsize,
                                           self.kv_cache_dtype, layout)
        if self.num_pages is not None:
            num_pages, source = self.num_pages, "num_pages"
        elif self.kv_cache_bytes is None and not on_cpu:
            num_pages, source = None, "device memory"
        else:
            budget = self.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES
            source = "kv_cache_bytes" if self.kv_cache_bytes else "fixed default on CPU"
            num_pages = budget // page_bytes
            if num_pages < 1:
                raise ValueError(
                    f"kv_cache_bytes {budget} is smaller than one page ({page_bytes} bytes)"
                )
        step = {name: getattr(defaults, name) if getattr(self, name) is None else getattr(self, name)
                for name in STEP_DEFAULT_FIELDS}
        return ResolvedConfig(self, dtype, impl, max_model_len, num_pages, page_bytes, source,
                              scan_period, backend, **step)

    def _scan_period(self, model: ModelConfig, impl: str, scan_pallas: bool = False) -> int:
        """Layers per scanned group (models/layer_stack.py), 0 for the unrolled loop."""
        from models.layer_stack import scan_period

        if self.scan_layers is False:
            return 0
        period = scan_period(model)
        if self.scan_layers is True and period is None:
            raise ValueError(f"scan_layers=True, but the {model.num_layers} layers of this "
                             f"{model.model_type} model do not repeat one pattern (sliding windows "
                             "or MoE / dense MLPs differ); use scan_layers='auto' or False")
        if period is None or (self.scan_layers == "auto" and attention_impl.get(impl).pallas and not scan_pallas):
            return 0
        return period


@dataclasses.dataclass(frozen=True)
class ResolvedConfig:
    """EngineConfig with every default filled for one model on one backend."""

    engine: EngineConfig
    dtype: str
    attention_impl: str
    max_model_len: int
    num_pages: int | None  # None only until ModelRunner sizes the pool from device memory
    page_bytes: int  # one page's K and V over all layers, on one device (+ the draft model's, if any)
    kv_source: str = "num_pages"  # where num_pages came from, for the start-up line
    scan_period: int = 0  # > 0: layers under a scan in groups of this many; 0: unrolled
    # The platform family the step compiles for ("cpu", "gpu", "tpu"): Pallas kernels lower for
    # it, so a runner resolved for "gpu" can be exported for CUDA from a CPU-only host.
    backend: str = "cpu"
    # The step sizes and precompile, the engine's or else the backend's (BACKEND_DEFAULTS).
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    prefill_row_len: int = 32
    precompile: bool = False

    def __getattr__(self, name):
        # Only reached for names ResolvedConfig lacks. `copy` and `pickle` probe dunders on an
        # instance whose fields are not set yet; reading self.engine then would recurse forever.
        engine = self.__dict__.get("engine")
        if engine is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(engine, name)

    @property
    def prefill_rows(self) -> int:
        """Prefill rows one step may hold (max_prefill_rows, or its default)."""
        if self.engine.max_prefill_rows is not None:
            return self.engine.max_prefill_rows
        return max(1, self.max_num_batched_tokens // self.prefill_row_len)

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.engine.page_size)
