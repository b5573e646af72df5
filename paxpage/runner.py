"""Model runner: the device state (weights, KV pool, LoRA slab) and the jitted calls of a step.

Its packer (paxpage/packing.py) lays the scheduler's rows out as a StepBatch; its compile plan
(paxpage/compile_plan.py) holds the step shapes and compiles them; its pool spec
(paxpage/kv_pool.py) makes the KV pool, sized by paxpage/kv_sizing.py when num_pages is not given.

The step is one pure function of (params, kv_cache, batch, sampling tensors): the model
writes the step's K/V into the donated cache, computes logits for the rows that sample,
and the sampler picks tokens on device, so only token ids (and requested logprobs)
cross back to the host. Shapes are bucketed to powers of two in (decode rows, prefill
rows, logits rows), so a steady decoding phase never recompiles.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models import layer_stack, lora_ops, panel_layout, param_forms, table_layout
from models.families import build_model
from models.moe import routed_experts
from paxpage import attention_impl, held_form, kv_pool, kv_sizing, lora_slab
from paxpage.sampling import sampler as sampler_lib
from paxpage.batch import StepBatch
from paxpage.compile_plan import CompilePlan
from paxpage.config import ResolvedConfig
from paxpage.packing import Packer, bucket
from paxpage.runner_ahead import RunnerAhead
from paxpage.structured_backend import RowMasks


log = logging.getLogger("paxpage")


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, params, cfg: ResolvedConfig, mesh=None, *, abstract: bool = False):
        """`params`: the model's params (per-layer or stacked: models/layer_stack.py), or a
        models.param_forms.ParamForms whose
        runners share one cast / stacked copy (what paxpage.Model passes).
        `mesh`: a 1-D ("model",) jax Mesh to split weights and the KV pool over (tensor
        parallelism, paxpage/sharding.py); None runs on the default device, as before.
        `cfg.num_pages` None: the pool is sized from the device's free memory once the weights
        are placed (kv_sizing.py).
        `abstract`: for ahead-of-time compilation (`lower_step`; scripts/tpu_compile_check.py):
        `params` may be jax.ShapeDtypeStructs, nothing is placed or allocated, and `params` and
        `kv_cache` are ShapeDtypeStructs (with their shardings on a mesh; without a mesh the step
        compiles for jax's default device). Needs cfg.num_pages; such a runner cannot run."""
        if abstract and (cfg.num_pages is None or cfg.executable_cache_dir is not None):
            raise ValueError("an abstract ModelRunner needs num_pages set and no executable_cache_dir; got "
                             f"num_pages={cfg.num_pages!r}, executable_cache_dir={cfg.executable_cache_dir!r}")
        self.abstract = abstract
        self.model_cfg = model_cfg
        self.cfg = cfg
        self.mesh = mesh
        self.single_row_decode = cfg.backend == "cpu"  # decode_rows: the compile target's backend, not this host's
        dtype = jnp.dtype(cfg.dtype)
        asked, impl = cfg.attention_impl, attention_impl.resolve(cfg.attention_impl)
        if impl != cfg.attention_impl:  # what runs: the step's code and the executable cache's key
            self.cfg = cfg = dataclasses.replace(cfg, attention_impl=impl)
        backend = cfg.backend if cfg.backend != "cpu" else None
        family = backend or attention_impl.kernel_family(impl)
        if cfg.batch_invariant:
            attention_impl.check_batch_invariant(impl, family)
        if not abstract:
            log.info("paxpage: %s", attention_impl.describe(impl, asked, backend))
        # Scanned layers (models/layer_stack.py): the params are stacked and the pool is one
        # stacked array (or, in the tpu layout, one pool of L * P pages) instead of a list of L.
        self.scanned = cfg.scan_period > 0
        # The pool's layout (pallas_kernels/kv_layout.py): the TPU kernels' tiles on TPU.
        self.kv_layout = attention_impl.pool_layout(asked or impl, cfg.backend, model_cfg.is_mla)  # as sized
        attention, write_kv = attention_impl.functions(impl, backend, cfg.batch_invariant, latent=model_cfg.is_mla,
                                                       layout=self.kv_layout.name)
        pool_sharding = None  # None: the default device
        experts_fn = routed_experts  # MoE layers' routed experts (sharded on a mesh)
        num_layers = model_cfg.num_layers
        # On TPU the embedding table is held row-major (models/table_layout.py): its default
        # layout there is column-major, which the token gather would copy in every step.
        row_major_table = table_layout.holds_row_major(cfg.backend)
        # The native CPU kernels run where the attention does, on one device per model copy
        # (paxpage/held_form.py decides, for paxpage.load's held form too). The native matmul takes
        # the kernels held in panels (models/panel_layout.py); elsewhere, and for an abstract
        # (ahead-of-time) step, the runner takes them in the plain form.
        native = held_form.native_kernels(cfg) and not abstract
        self.matmul_impl = "native" if native and held_form.runs_native_matmul(model_cfg, cfg) else "xla"
        panels = self.matmul_impl == "native"
        if mesh is None and abstract:
            self.params = jax.eval_shape(functools.partial(param_forms.make_form, num_layers=num_layers,
                                                           period=cfg.scan_period, dtype=dtype.name,
                                                           panels=False),
                                         param_forms.own_tree(params))
            if row_major_table:
                self.params = table_layout.row_major_tables(self.params)
            step_shardings = copy_shardings = {}
        elif mesh is None:
            # Cast (and stacked) once per model: runners of one ParamForms share the arrays.
            self._param_form = param_forms.runner_params(params, num_layers, cfg.scan_period, dtype,
                                                         row_major_table, panels)
            self.params = self._param_form.tree
            step_shardings = copy_shardings = {}
        else:
            from paxpage import mesh as mesh_lib  # the sharded path only

            params = param_forms.own_tree(params)
            if not panels:  # sharding rules name plain kernels; panels run on one-device replicas
                params = panel_layout.unpack(params)
            params = (layer_stack.restack(params, num_layers, cfg.scan_period, stack=_stack_abstract)
                      if abstract else layer_stack.host_stack(params, num_layers, cfg.scan_period))
            (model_cfg, self.plan, self.params, pool_sharding, attention, write_kv, experts_fn, step_shardings,
             copy_shardings) = mesh_lib.shard_runner_state(model_cfg, params, dtype, mesh, attention, write_kv,
                                                           cfg.kv_cache_dtype, stacked_pool=self.scanned,
                                                           abstract=abstract, layout=self.kv_layout,
                                                           expert_parallel=cfg.enable_expert_parallel)
            if row_major_table:
                self.params = table_layout.row_major_tables(self.params)
        self.step_model_cfg = model_cfg  # the config the step runs (sharded: KV heads maybe replicated)
        self.pool_spec = kv_pool.KVPoolSpec(model_cfg, cfg.page_size, cfg.kv_cache_dtype, dtype, self.kv_layout,
                                            self.scanned, pool_sharding)
        # With native kernels the LoRA delta runs as the native kernel; under tensor parallelism
        # the slab is sharded and the delta stays in XLA ops (GSPMD partitions them).
        self.lora_impl = lora_ops.resolve_lora_impl(bool(cfg.max_loras) and native, cfg.max_lora_rank)
        self.model = build_model(model_cfg, attention, write_kv, dtype, scan_period=cfg.scan_period,
                                 batch_invariant=cfg.batch_invariant, lora_impl=self.lora_impl,
                                 experts_fn=experts_fn, matmul_impl=self.matmul_impl)
        # The model step and the sampler compile separately: sampler options (logprob widths,
        # penalty lists) then never recompile the model, and a new batch shape reuses the
        # sampler. Logits stay on device between the two calls.
        self.packer = Packer(cfg, with_lora=bool(cfg.max_loras), single_row_decode=self.single_row_decode,
                             keep_on_device=mesh is None and jax.process_count() == 1)
        self.compile_plan = CompilePlan.for_config(cfg, self.single_row_decode)
        self.max_logits_rows = self.compile_plan.max_logits_rows
        self._no_prev_tokens = (jax.ShapeDtypeStruct((self.max_logits_rows,), jnp.int32) if abstract
                                else jnp.zeros(self.max_logits_rows, jnp.int32))
        # Sharded: the pool keeps its sharding across steps (out_shardings), so a step never
        # reshards it or recompiles; logits come back replicated for the sampler.
        self._step = jax.jit(self._forward, donate_argnums=(1,), **step_shardings)
        self._copy = jax.jit(self.pool_spec.copy, donate_argnums=(0,), **copy_shardings)
        # The sampler and the fixed-width copy of its tokens are one executable per logits-row count.
        # With native kernels, sampled rows draw through the native proposal kernel.
        self.draw_impl = sampler_lib.resolve_draw_impl(native)
        self._sampler = jax.jit(functools.partial(sampler_lib.sample_rows, draw_impl=self.draw_impl),
                                static_argnums=(3, 4))
        # Structured outputs' masks, applied to their rows' logits in place before the sampler
        # (one small executable per (R, mask rows); the sampler has no bitmask variant).
        self._mask = jax.jit(sampler_lib.apply_bitmask, donate_argnums=(0,))
        self._scorer = jax.jit(_score_prompt, static_argnums=(2,))
        # Each device call goes through these: the jitted functions, or the same behind the
        # executable cache (exec_cache.py) when cfg.executable_cache_dir is set.
        self._calls = {"step": self._step, "copy_pages": self._copy, "sample": self._sampler,
                       "mask": self._mask, "score_prompt": self._scorer}
        self.exec_cache = None
        if cfg.executable_cache_dir is not None:
            if mesh is None and jax.process_count() == 1:
                from paxpage.exec_cache import ExecutableCache

                self.exec_cache = ExecutableCache(cfg.executable_cache_dir,
                                                  _cache_context(model_cfg, cfg, self.draw_impl,
                                                                 self.lora_impl, self.matmul_impl))
                static = {"sample": (3, 4), "score_prompt": (2,)}
                self._calls = {name: self.exec_cache.wrap(name, fn, static.get(name, ()))
                               for name, fn in self._calls.items()}
            else:  # sharded or multi-host executables are not serialised: the plain jit path
                log.info("paxpage: the executable cache is for single-device engines; not used here")
        # One process, one device: the decode shapes a shrinking batch will meet compile in the
        # background (runner_ahead.py). With the executable cache they load from disk instead.
        self._ahead = None  # RunnerAhead
        if mesh is None and jax.process_count() == 1 and not abstract and self.exec_cache is None:
            self._ahead = RunnerAhead(self)
        # Steps with embedding rows (batch.pool_rows set) also return the pooled hidden states;
        # they compile on first use and are not in the executable cache.
        pool_shardings = {}
        if step_shardings:
            outs = step_shardings["out_shardings"]
            pool_shardings = {"out_shardings": (*outs, outs[1])}
        self._calls["pool_step"] = jax.jit(functools.partial(self._forward, pooled=True), donate_argnums=(1,),
                                           **pool_shardings)
        # LoRA (paxpage/lora_slab.py): max_loras slots of stacked A / B, merged into the params the
        # step takes. None without LoRA: the step and its params are exactly the base model's.
        self.lora_slab = None
        self._step_params = self.params
        if cfg.max_loras:
            zeros = functools.partial(lora_slab.zeros, self.model_cfg, cfg.max_loras, cfg.max_lora_rank, dtype,
                                      cfg.scan_period)
            if mesh is not None:  # split with its layers' kernels (sharding.PARAM_AXES)
                from paxpage import mesh as mesh_lib

                self.lora_slab = mesh_lib.place_params(self._widen_kv(jax.eval_shape(zeros)), mesh, self.plan,
                                                       mesh_lib.place_abstract if abstract else _sharded_zeros)
            else:
                self.lora_slab = jax.eval_shape(zeros) if abstract else zeros()
            self._step_params = lora_slab.merge(self.params, self.lora_slab)
            shardings = ({} if mesh is None else
                         {"out_shardings": jax.tree.map(lambda x: x.sharding, self.lora_slab)})
            self._write_lora = jax.jit(lora_slab.write_slot, donate_argnums=(0,), **shardings)
        self.memory_budget: kv_sizing.MemoryBudget | None = None  # when sized from device memory
        if cfg.num_pages is None:  # now that the weights are placed
            num_pages, self.memory_budget = kv_sizing.pages_from_device(
                cfg.page_bytes, self.step_bytes_bound(), cfg.gpu_memory_utilization, cfg.backend)
            sized = {} if self.memory_budget is not None else {"kv_source": kv_sizing.NO_STATS_SOURCE}
            self.cfg = cfg = dataclasses.replace(cfg, num_pages=num_pages, **sized)
        self.kv_cache = (self.pool_spec.abstract if abstract else self.pool_spec.zeros)(cfg.num_pages)

    @property
    def ahead(self):
        """The compiler of smaller decode shapes in the background (ahead_compile.AheadCompiler),
        or None where the runner does not compile ahead."""
        return None if self._ahead is None else self._ahead.compiler

    def reset_state(self) -> None:
        """A fresh, empty KV pool and page tables in place of the current ones (a failed step may
        have consumed the pool: it is donated to each step). The old pool is released first, so
        a pool that fitted once fits again."""
        self.kv_cache = None
        self.kv_cache = self.pool_spec.zeros(self.cfg.num_pages)
        self.packer.reset()

    @property
    def tables(self):
        """The persistent page tables (paxpage/page_tables.py) the packer lays rows out over."""
        return self.packer.tables

    def step_bytes_bound(self) -> int:
        """kv_sizing.step_bytes_bound for this config's step with the most tokens: what the pool
        is sized against, with no compile."""
        return kv_sizing.step_bytes_bound(self.step_model_cfg, *self.compile_plan.largest_step_tokens())

    def step_memory_bytes(self) -> int:
        """Working memory (temporaries and outputs beside the donated pool) of the step with the
        most tokens, from its compiled executable: what step_bytes_bound bounds. It is compiled
        against a small abstract pool (nothing is allocated): what the step allocates besides the
        pool does not depend on the pool's size. Where the backend gives no figures, the bound."""
        dec, pre = self.compile_plan.largest_step
        estimate = self.step_bytes_bound()
        try:
            compiled = self.lower_step(dec, pre, self.cfg.pages_per_seq + 1).compile()
            stats = compiled.memory_analysis()
        except Exception as e:  # a backend that cannot compile or analyse it: estimate
            log.warning("paxpage: cannot measure the step's memory (%s: %s); assuming %d bytes",
                        type(e).__name__, e, estimate)
            return estimate
        if stats is None:
            return estimate
        return max(0, int(stats.temp_size_in_bytes) + int(stats.output_size_in_bytes)
                   - int(stats.alias_size_in_bytes))

    def lower_step(self, dec: int, pre: int, num_pages: int | None = None):
        """The step of `dec` decode rows and `pre` prefill rows (a `step_shapes()` pair), lowered
        (jax.stages.Lowered) against an abstract pool of num_pages pages (default: the runner's)
        and the runner's params: `.compile()` it for its memory and cost analyses. Nothing runs."""
        batch = self.packer.padding_batch(dec, pre)
        return self._step.lower(*self._step_args(batch, self.pool_spec.abstract(num_pages or self.cfg.num_pages)))

    def export_step(self, dec: int, pre: int, platform: str):
        """`lower_step`'s step exported (jax.export.Exported) for `platform` ("cuda", "rocm",
        "tpu", "cpu"), on any host: with a runner resolved for "gpu" the Pallas kernels lower to
        their Triton calls, which the export's safety check is told to accept."""
        from jax import export

        from pallas_kernels.gpu_launches import KERNEL_CALLS

        batch = self.packer.padding_batch(dec, pre)
        checks = [export.DisabledSafetyCheck.custom_call(name) for name in KERNEL_CALLS]
        return export.export(self._step, platforms=[platform], disabled_checks=checks)(
            *self._step_args(batch, self.pool_spec.abstract(self.cfg.num_pages)))

    def _step_args(self, batch: StepBatch, kv_cache):
        """The step's positional arguments for `batch` with no tokens pending on device."""
        return (self._step_params, kv_cache, batch, np.full(batch.token_ids.shape[0], -1, np.int32),
                self._no_prev_tokens)

    def _forward(self, params, kv_cache, batch: StepBatch, prev_rows, prev_tokens, pooled: bool = False):
        # prev_rows i32[T], prev_tokens i32[R_max]: async scheduling's tokens that are still on
        # device (the previous step's samples), merged here so they add no compiled shape.
        token_ids = jnp.where(prev_rows >= 0, prev_tokens[jnp.maximum(prev_rows, 0)], batch.token_ids)
        batch = dataclasses.replace(batch, token_ids=token_ids)
        num_rows = batch.logits_indices.shape[0]
        if not pooled:
            logits, kv_cache = self.model.apply(layer_stack.variables(params), batch, kv_cache)
            return kv_cache, logits[:num_rows], logits[num_rows:]
        (logits, kv_cache), state = self.model.apply(layer_stack.variables(params), batch, kv_cache,
                                                     mutable=["intermediates"])
        return kv_cache, logits[:num_rows], logits[num_rows:], state["intermediates"]["pooled"][0]

    def load_lora(self, slot: int, adapter) -> None:
        """Writes `adapter` (models.lora.LoraAdapter) into slab slot `slot` (ValueError when its
        rank exceeds max_lora_rank). A step still in flight keeps reading the slab it was given."""
        tree = self._widen_kv(lora_slab.slot_tree(adapter, self.model_cfg, self.cfg.max_lora_rank, np.float32,
                                                  self.cfg.scan_period))
        self.lora_slab = self._write_lora(self.lora_slab, np.int32(slot), tree)
        self._step_params = lora_slab.merge(self.params, self.lora_slab)

    def _widen_kv(self, tree):
        """A slab-shaped tree with its k / v output halves widened as the sharded kernels are
        (sharding.replicate_kv_heads); unchanged on one device."""
        if self.mesh is None:
            return tree
        from paxpage.sharding import replicate_kv_heads

        return replicate_kv_heads(self.plan, self.model_cfg, tree)

    def step_shapes(self) -> list[tuple[int, int]]:
        """Every (decode rows, prefill rows) bucket pair a step of this config can have: the
        step's shape depends on nothing else (the logits rows follow from the two)."""
        return list(self.compile_plan.shapes)

    def precompile(self, sampling_for_rows, num_mask_words: int = 0) -> int:
        """Compiles the step for every shape in `step_shapes()`, and for each logits-row count R
        the sampler's variants: all-greedy rows (`sampling_for_rows(R)`, padding SamplingTensors
        of R rows), unpenalised rows and any rows (sampler.sampler_variants). num_mask_words > 0:
        also the structured-outputs masking of R rows with masks of W = num_mask_words words,
        for every mask-row count (packing.mask_row_counts). With the executable cache the
        executables are loaded without running. Returns the number of shapes."""
        plan = self.compile_plan
        if self.exec_cache is None or not plan.load_executables(self, sampling_for_rows, num_mask_words):
            plan.warm_up(self, sampling_for_rows, num_mask_words)
        if self.ahead is not None:
            for dec, pre in plan.shapes:
                self.ahead.saw(dec, pre, bucket(dec + pre))
        return len(plan.shapes)

    def prepare_step(self, batch: StepBatch):
        """With the executable cache: loads (or compiles and stores) the step's executable for
        `batch`'s shape without running it. Its jax.stages.Compiled, or None on the plain jit path."""
        return self._calls["step"].prepare(*self._step_args(batch, self.kv_cache))

    def prepare_sample(self, batch: StepBatch, logits, sampling, *, load: bool = True) -> bool:
        """`prepare_step` for the sampler on `batch`'s logits f32[R, V] (no logprobs, no tokens
        pending on device); load False: only makes sure it is on disk, for its first call to load.
        False on the plain jit path."""
        args = (logits, sampling, self._pending(batch, sampling, None, None), 0, self.max_logits_rows)
        sample = self._calls["sample"]
        return sample.prepare(*args) is not None if load else sample.ensure_stored(*args)

    def prepare_mask(self, logits, masks) -> bool:
        """`prepare_step` for the structured-outputs masking of logits f32[R, V] by `masks`
        (structured_backend.RowMasks). False on the plain jit path."""
        return self._calls["mask"].prepare(logits, masks) is not None

    # ------------------------------------------------------------------ device calls
    def copy_pages(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: duplicates pages src -> dst in every layer, batched in one call."""
        if not copies:
            return
        n = bucket(len(copies), 4)
        src = np.zeros(n, np.int32)
        # Padding copies target a page past the pool, which the scatter drops.
        dst = np.full(n, self.cfg.num_pages, np.int32)
        src[:len(copies)], dst[:len(copies)] = zip(*copies)
        self.kv_cache = self._calls["copy_pages"](self.kv_cache, src, dst)

    def launch(self, batch: StepBatch, sampling, num_logprobs: int = 0, num_prompt_logprobs: int = 0,
               prev_rows: np.ndarray | None = None, prev_tokens: jax.Array | None = None,
               allowed: RowMasks | None = None):
        """Dispatches the step and returns (SamplerOutput, PromptLogprobs | None, next_tokens) as
        device arrays, without waiting for them. prev_rows i32[T] / prev_tokens i32[R_max]: the
        tokens the host does not have yet are the previous step's `next_tokens` rows. next_tokens
        i32[R_max] are this step's sampled tokens in that form. allowed: the structured-outputs
        masks of the constrained rows (applied to their logits first), or None."""
        logits = self.forward(batch, prev_rows, prev_tokens)
        return self.sample(batch, logits, sampling, num_logprobs, num_prompt_logprobs, allowed, prev_rows,
                           prev_tokens)

    def forward(self, batch: StepBatch, prev_rows: np.ndarray | None = None,
                prev_tokens: jax.Array | None = None):
        """Dispatches the model alone: (logits f32[R, V], prompt logits f32[Rp, V]) on device.
        The engine dispatches `sample` later when the sampler's inputs (structured outputs'
        bitmasks) need the previous step's tokens, so the host builds them during this one."""
        if prev_rows is None:
            prev_rows = np.full(batch.token_ids.shape[0], -1, np.int32)
        if prev_tokens is None:
            prev_tokens = self._no_prev_tokens
        shape = self._ahead.before_step(batch) if self._ahead is not None else None  # (may wait for the worker)
        self.kv_cache, logits, prompt_logits = self._calls["step"](self._step_params, self.kv_cache, batch,
                                                                   prev_rows, prev_tokens)
        if shape is not None:
            self.ahead.saw(*shape)
        return logits, prompt_logits

    def forward_pooled(self, batch: StepBatch, prev_rows: np.ndarray | None = None,
                       prev_tokens: jax.Array | None = None):
        """`forward` for a batch with pool_rows: ((logits, prompt logits), pooled f32[R, H]) on
        device, pooled row r the sum of the final-normed hidden states of the tokens that
        batch.pool_rows sends to r."""
        if batch.pool_rows is None:
            raise ValueError("forward_pooled needs a batch with pool_rows (a RowPlan with pool_row >= 0)")
        if prev_rows is None:
            prev_rows = np.full(batch.token_ids.shape[0], -1, np.int32)
        if prev_tokens is None:
            prev_tokens = self._no_prev_tokens
        self.kv_cache, logits, prompt_logits, pooled = self._calls["pool_step"](
            self._step_params, self.kv_cache, batch, prev_rows, prev_tokens)
        return (logits, prompt_logits), pooled

    def mask(self, logits, masks: RowMasks):
        """`forward`'s (logits, prompt logits) with structured outputs' `masks` applied to the
        logits rows they name (sampler.apply_bitmask), in place: the logits given are consumed."""
        logits, prompt_logits = logits
        return self._calls["mask"](logits, masks), prompt_logits

    def sample(self, batch: StepBatch, logits, sampling, num_logprobs: int = 0,
               num_prompt_logprobs: int = 0, allowed: RowMasks | None = None,
               prev_rows: np.ndarray | None = None, prev_tokens: jax.Array | None = None):
        """The sampler on `forward`'s logits; returns what `launch` does. prev_rows / prev_tokens:
        as `forward` took them: a penalised row whose last token is still on the device gets it
        added to its penalty counts there (the host's counts lack it)."""
        if allowed is not None:
            logits = self.mask(logits, allowed)
        logits, prompt_logits = logits
        pending = self._pending(batch, sampling, prev_rows, prev_tokens)
        if self._ahead is not None:
            self._ahead.note_sampler(logits, sampling, pending, num_logprobs)
        out, next_tokens = self._calls["sample"](logits, sampling, pending, num_logprobs, self.max_logits_rows)
        prompt = None
        if batch.prompt_targets.shape[0]:
            prompt = self._calls["score_prompt"](prompt_logits, batch.prompt_targets, num_prompt_logprobs)
        return out, prompt, next_tokens

    def _pending(self, batch: StepBatch, sampling, prev_rows, prev_tokens):
        """The sampler's `pending` (sampler.sample_rows): for a penalised batch, (rows i32[R],
        prev i32[R_max]), row r's token still on the device being prev[rows[r]] (-1: none),
        always a pair so the penalised sampler compiles once per R; else None."""
        if not sampling.penalised:
            return None
        rows = np.full(batch.logits_indices.shape[0], -1, np.int32)
        if prev_rows is not None and prev_tokens is not None:
            rows = np.asarray(prev_rows)[np.asarray(batch.logits_indices)]
        return rows, self._no_prev_tokens if prev_tokens is None else prev_tokens

    def verify(self, batch: StepBatch, logits, sampling, draft_ids: np.ndarray, draft_dists=None,
               num_logprobs: int = 0, num_prompt_logprobs: int = 0, allowed: RowMasks | None = None,
               prev_rows: np.ndarray | None = None, prev_tokens: jax.Array | None = None):
        """`sample` for a step with speculative drafts (paxpage/speculative/verify.py): draft_ids i32[R]
        (-1: none), draft_dists f32[R, V] or None (one-hot). Returns (SamplerOutput, prompt
        logprobs | None, accepted bool[R]) as device arrays; the step cannot stay in flight."""
        from paxpage.speculative import verify as verify_lib

        if allowed is not None:
            logits = self.mask(logits, allowed)
        logits, prompt_logits = logits
        out, accepted = verify_lib.verify(logits, sampling, draft_ids, draft_dists, num_logprobs,
                                          self._pending(batch, sampling, prev_rows, prev_tokens),
                                          draw_impl=self.draw_impl)
        prompt = None
        if batch.prompt_targets.shape[0]:
            prompt = self._calls["score_prompt"](prompt_logits, batch.prompt_targets, num_prompt_logprobs)
        return out, prompt, accepted

    def time_device_calls(self) -> dict[str, list[float]]:
        """For benchmarks: from now on every device call (the step, the sampler, prompt scoring,
        page copies) waits for its results and appends its seconds to the returned dict's list
        under its name. That is each executable's own run time, but the engine's host work
        then no longer overlaps the device: measure wall-clock figures apart."""
        seconds: dict[str, list[float]] = {}

        def timed(name, call):
            def run(*args):
                t = time.perf_counter()
                out = jax.block_until_ready(call(*args))
                seconds.setdefault(name, []).append(time.perf_counter() - t)
                return out
            return run

        self._calls = {name: timed(name, call) for name, call in self._calls.items()}
        return seconds

    def run(self, batch: StepBatch, sampling, num_logprobs: int = 0, num_prompt_logprobs: int = 0):
        """Returns (SamplerOutput, PromptLogprobs) as numpy."""
        return jax.device_get(self.launch(batch, sampling, num_logprobs, num_prompt_logprobs)[:2])


def _sharded_zeros(x, sharding):
    """mesh.place_params' `place_fn` for an empty slab: zeros of x's shape, made split."""
    from paxpage import mesh as mesh_lib

    return mesh_lib.zeros(x.shape, x.dtype, sharding)


def _stack_abstract(xs):
    """layer_stack.stack_layers' `stack` on jax.ShapeDtypeStructs (abstract runners)."""
    return jax.ShapeDtypeStruct((len(xs), *xs[0].shape), xs[0].dtype)


def _score_prompt(logits, targets, num_top: int):  # positional, so the executable cache can wrap it
    return sampler_lib.score_prompt(logits, targets, num_top)


# ResolvedConfig / EngineConfig fields that do not change what the step, sampler or page copy
# compute (they change scheduling, pool sizing or options read elsewhere; the pool's shape is
# part of every executable's argument signature anyway). Any other field keys the cache.
_CONTEXT_SKIP = frozenset({
    "precompile", "async_scheduling", "enable_prefix_caching", "enable_chunked_prefill", "kv_allocation",
    "gpu_memory_utilization", "kv_cache_bytes", "num_pages", "kv_source", "executable_cache_dir", "mesh",
    "draft_model", "speculative_max_batch", "data_parallel_size", "ngram_min", "ngram_max"})


def _cache_context(model_cfg: ModelConfig, cfg: ResolvedConfig, draw_impl: str, lora_impl: str = "xla",
                   matmul_impl: str = "xla") -> str:
    """The executable cache's key material besides the arguments: the model config, the
    engine config fields that shape a step, the sampler's draw_impl, the step's lora_impl and matmul_impl,
    and whether its KV write is the native kernel (exec_cache.py)."""
    fields = {f.name: getattr(cfg.engine, f.name) for f in dataclasses.fields(cfg.engine)}
    # The resolved values win over the engine's (attention_impl None -> "native" or "xla", etc.).
    fields.update({f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "engine"})
    kept = sorted((k, repr(v)) for k, v in fields.items() if k not in _CONTEXT_SKIP)
    from pallas_kernels import native_kv_write  # a step built with it calls its custom-call target

    return (f"model={model_cfg!r}\nengine={kept!r}\ndraw_impl={draw_impl}\nlora_impl={lora_impl}"
            f"\nmatmul_impl={matmul_impl}\nnative_kv_write={native_kv_write.LIBRARY.loaded()}")
