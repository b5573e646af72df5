"""Pieces every model family shares: RMSNorm, dense layers, and paged attention over the step's rows.

Axis legend: T flat tokens in the step, N query heads, K kv heads, D head dim, H hidden.
The step's tokens are Bd decode rows of one token followed by Bp prefill rows of Tq tokens
(see paxpage.batch.StepBatch).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models import layer_stack, panel_layout, quant
from models.lora_ops import lora_delta
from models.invariant_ops import norm_mean_square, stable_rows

# How a dense layer's f32 matmul runs where its kernel is held in column panels
# (models/panel_layout.py): "native", the CPU kernel (pallas_kernels/native_linear.py; a row's
# result never depends on the other rows, so the batch-invariant mode needs no row padding there),
# or "xla", XLA's dot. Chosen once per runner (paxpage/held_form.py).
MATMUL_IMPLS = ("xla", "native")


class RMSNorm(nn.Module):
    eps: float
    dtype: Any = jnp.float32
    # Gemma stores w and scales by (1 + w) (its weights start at 0); Llama stores the scale itself.
    unit_offset: bool = False
    batch_invariant: bool = False  # a fixed-order sum per row (models/invariant_ops.py)

    @nn.compact
    def __call__(self, x):  # [..., H]
        init = nn.initializers.zeros if self.unit_offset else nn.initializers.ones
        scale = self.param("scale", init, (x.shape[-1],), self.dtype).astype(jnp.float32)
        if self.unit_offset:
            scale = 1.0 + scale
        x32 = x.astype(jnp.float32)
        mean_sq = norm_mean_square(x32) if self.batch_invariant else jnp.mean(x32 * x32, axis=-1, keepdims=True)
        x32 = x32 * jax.lax.rsqrt(mean_sq + self.eps)
        return (x32 * scale).astype(self.dtype)


def sow_pooled(module: nn.Module, norm: nn.Module, x, batch) -> None:
    """Embedding steps (batch.pool_rows set): sows the sums f32[R, H] of the final-normed hidden
    states x [T, H] per pooled row into the "intermediates" collection (read back when the
    caller applies the model with mutable=["intermediates"]). Row R (out of range) is dropped."""
    if batch.pool_rows is None:
        return
    h = norm(x).astype(jnp.float32)  # the norm is per token: norm(x)[rows] == norm(x[rows])
    num_rows = batch.logits_indices.shape[0]
    module.sow("intermediates", "pooled", jax.ops.segment_sum(h, batch.pool_rows, num_segments=num_rows))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MatmulStep:
    """What a dense layer takes from the step beside its operands: the native matmul reads both
    fields, the LoRA delta the group."""

    live: jax.Array  # bool[T]: the step's real tokens (StepBatch.live_tokens); the native matmul skips the rest
    group: jax.Array | None = None  # i32[]: in a scanned stack, the group whose stacked panels and LoRA slabs it reads

    @classmethod
    def of(cls, batch) -> "MatmulStep":
        """The step's, for the layer that `batch` (a StepBatch) runs."""
        return cls(batch.live_tokens(), batch.scan_group)


class Linear(nn.Module):
    """x @ kernel (+ bias), kernel [I, O] float or quantised (kernel_q / kernel_scale /
    kernel_offset). Float params are named as flax's nn.Dense names them. With LoRA slabs in
    its params (lora_a [S, I, R], lora_b [S, R, O]; paxpage/lora_slab.py) and the step's row
    slots, each row also gets its adapter's delta (models/lora_ops.py)."""
    features: int
    use_bias: bool = False
    dtype: Any = jnp.float32
    batch_invariant: bool = False  # row-stable matmuls (models/invariant_ops.py)
    matmul_impl: str = "xla"  # MATMUL_IMPLS: how a kernel held in panels is multiplied

    @nn.compact
    def __call__(self, x, lora_slots=None, step: MatmulStep | None = None):
        """x [..., I] -> [..., O]. lora_slots: models/lora_ops.row_slots. step: None, or for x
        [T, I] the step's MatmulStep: the native matmul computes its live rows only (the others
        come back 0: padding, never read)."""
        if self.matmul_impl not in MATMUL_IMPLS:
            raise ValueError(f"matmul_impl is {self.matmul_impl!r}; expected one of {MATMUL_IMPLS}")
        x = jnp.asarray(x, self.dtype)
        qparams = quant.module_weight(self, "kernel")
        native = False
        if qparams is not None:
            matmul = lambda rows: quant.quantized_matmul(rows, *qparams)
        elif (held := _held_panels(self, step)) is not None:
            panels, group, scale, offset = held
            if scale is None:  # float panels run in the model's dtype
                panels = panels.astype(self.dtype)
            native = self.matmul_impl == "native" and jnp.dtype(self.dtype) in panel_layout.DTYPES
            matmul = functools.partial(_panels_matmul, panels=panels, native=native, scale=scale, offset=offset,
                                       live=step.live if native and step is not None else None, group=group)
        else:
            kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features), self.dtype)
            matmul = lambda rows: jnp.dot(rows, kernel.astype(self.dtype))
        # The native kernel's rows are row-stable as they are: no padding to stable row counts.
        y = stable_rows(matmul, x) if self.batch_invariant and not native else matmul(x)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.dtype).astype(self.dtype)
        if lora_slots is not None and (slab := _lora_slab(self, step, lora_slots)) is not None:
            y = y + lora_delta(x, *slab)
        return y


def _held(module: nn.Module, name: str, step: MatmulStep | None):
    """(value, group) of the module's variable `name`: its own and no group, or in a scanned stack
    every group's (left whole by the scan, models/layer_stack.variables) and the step's group;
    None where it has neither."""
    if module.has_variable("params", name):
        return module.get_variable("params", name), None
    if module.has_variable(layer_stack.WHOLE, name):
        assert step is not None and step.group is not None, f"stacked {name} is read inside a scan, by group"
        return module.get_variable(layer_stack.WHOLE, name), step.group
    return None


def _held_panels(module: nn.Module, step: MatmulStep | None):
    """(panels, group, scale, offset) of the module's kernel held in column panels
    (models/panel_layout.py): float panels with scale and offset None, or quantised ones (int8,
    their scales, their offsets or None); None where the kernel is not in panels."""
    held = _held(module, panel_layout.PANELS_Q, step)
    if held is None:
        held = _held(module, panel_layout.PANELS, step)
        return None if held is None else (*held, None, None)
    scale, offset = (_held(module, name, step) for name in (panel_layout.PANELS_SCALE, panel_layout.PANELS_OFFSET))
    return (*held, scale[0], None if offset is None else offset[0])


def _lora_slab(module: nn.Module, step: MatmulStep | None, lora_slots):
    """(a [S, I, R], b [S, R, O], lora_slots) of the module's LoRA slab, or None without one. A
    scanned stack's slab, every group's [G, S, ...], is seen as G * S slots (a free reshape), each
    row's slot moved to its group's."""
    held = _held(module, "lora_a", step)
    if held is None:
        return None
    (a, group), (b, _) = held, _held(module, "lora_b", step)
    if group is None:
        return a, b, lora_slots
    num_slots = a.shape[1]
    shift = lambda slots: jnp.where(slots >= 0, slots + group * num_slots, slots)  # noqa: E731
    rows = lora_slots._replace(dec=shift(lora_slots.dec), pre=shift(lora_slots.pre))
    return a.reshape(-1, *a.shape[2:]), b.reshape(-1, *b.shape[2:]), rows


def _panels_matmul(x, panels, native: bool, live=None, group=None, scale=None, offset=None):
    """x [..., I] @ the kernel held as panels [P, I, 64] (or [G, P, I, 64] and the group) ->
    [..., 64 P]; live: None or bool[T] for x [T, I], the rows to compute (the others 0); int8
    panels with their scale (and offset) panels (models/panel_layout.py)."""
    from pallas_kernels.native_linear import linear_native, linear_ref

    rows = x.reshape(-1, x.shape[-1])
    if native:  # f32 sums, rounded once to the model's dtype
        y = linear_native(rows, panels, live, group, scale, offset).astype(x.dtype)
    else:
        y = linear_ref(rows, panels, live, group, scale, offset).astype(x.dtype)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def resolve_matmul_impl(native_allowed: bool) -> str:
    """"native" when native kernels are allowed here (CPU, the runner's attention resolved to its
    native kernel, one device) and the matmul kernel builds and loads, else "xla"."""
    if not native_allowed:
        return "xla"
    from models.cache import native_dir
    from pallas_kernels import native_linear

    return "native" if native_linear.load(native_dir()) else "xla"


class Embedding(nn.Module):
    """Token embedding [V, H], float ("embedding", as flax's nn.Embed names it), quantised
    (embedding_q / _scale / _offset: a lookup dequantises just the gathered rows) or, for a tied
    LM head run by the native matmul, in column panels of its transpose ("embedding_panels"
    [V / 64, H, 64], or embedding_panels_q / _scale / _offset quantised; models/panel_layout.py:
    a lookup gathers each row across its panel); `attend` is the tied LM head over the same table."""
    num_embeddings: int
    features: int
    dtype: Any = jnp.float32
    batch_invariant: bool = False  # the LM head's matmul row-stable (models/invariant_ops.py)
    matmul_impl: str = "xla"  # MATMUL_IMPLS: how the LM head over a table in panels is multiplied

    def setup(self):
        self.qtable = quant.module_weight(self, "embedding")
        self.panels = (self.get_variable("params", panel_layout.TABLE_PANELS)
                       if self.has_variable("params", panel_layout.TABLE_PANELS) else None)
        # a quantised table in panels: (q, scale, offset | None), each [V / 64, ., 64]
        self.qpanels = quant.module_weight(self, panel_layout.TABLE_PANELS)
        if self.qtable is None and self.panels is None and self.qpanels is None:
            init = nn.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)
            self.embedding = self.param("embedding", init, (self.num_embeddings, self.features), self.dtype)

    def __call__(self, ids):  # i32[T] -> [T, H]
        if self.qtable is not None:
            q, scale, offset = self.qtable
            return quant.dequantize_rows(q[ids], scale[ids], None if offset is None else offset[ids], self.dtype)
        if self.panels is not None:
            return self.panels[ids // panel_layout.PANEL, :, ids % panel_layout.PANEL].astype(self.dtype)
        if self.qpanels is not None:
            q, scale, offset = (None if a is None else a[ids // panel_layout.PANEL, :, ids % panel_layout.PANEL]
                                for a in self.qpanels)
            return quant.dequantize_rows(q, scale, offset, self.dtype)
        return jnp.take(self.embedding, ids, axis=0).astype(self.dtype)

    def attend(self, x):  # [R, H] -> [R, V]
        x = jnp.asarray(x, self.dtype)
        native = False
        if self.qtable is not None:
            head = lambda rows: quant.quantized_attend(rows, *self.qtable)
        elif self.panels is not None or self.qpanels is not None:
            native = self.matmul_impl == "native" and jnp.dtype(self.dtype) in panel_layout.DTYPES
            panels, scale, offset = self.qpanels or (self.panels.astype(self.dtype), None, None)
            head = functools.partial(_panels_matmul, panels=panels, native=native, scale=scale, offset=offset)
        else:
            head = lambda rows: jnp.dot(rows, self.embedding.astype(self.dtype).T)
        # The native kernel's rows are row-stable as they are: no padding to stable row counts.
        return stable_rows(head, x) if self.batch_invariant and not native else head(x)


def dense(features: int, name: str, dtype, use_bias: bool = False, batch_invariant: bool = False,
          matmul_impl: str = "xla") -> Linear:
    return Linear(features, use_bias=use_bias, dtype=dtype, batch_invariant=batch_invariant,
                  matmul_impl=matmul_impl, name=name)


def qkv_heads(cfg, h, dtype, batch_invariant: bool = False, lora_slots=None, matmul_impl: str = "xla",
              step: MatmulStep | None = None):
    """The attention's input projections of h [T, H] (q_proj, k_proj, v_proj; `cfg` a
    ModelConfig): q [T, N, D], k and v [T, K, D]. Call inside a module's compact method.
    lora_slots: the step's adapter per row (models/lora_ops.row_slots), or None; step: Linear's."""
    num_tokens = h.shape[0]
    q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    q, k, v = (dense(width, name, dtype, cfg.qkv_bias, batch_invariant, matmul_impl)(h, lora_slots, step)
               for name, width in (("q_proj", q_width), ("k_proj", kv_width), ("v_proj", kv_width)))
    return (q.reshape(num_tokens, cfg.num_heads, cfg.head_dim),
            k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim),
            v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim))


def gated_mlp(cfg, h, activation, dtype, batch_invariant: bool = False, lora_slots=None,
              matmul_impl: str = "xla", step: MatmulStep | None = None):
    """down_proj(activation(gate_proj(h)) * up_proj(h)): h [T, H] -> [T, H] through width
    F = cfg.intermediate_size (Llama: silu; Gemma: gelu-tanh). Call inside a compact method.
    step: Linear's (the rows the native matmul computes, the stacked group it reads)."""
    mm = dict(batch_invariant=batch_invariant, matmul_impl=matmul_impl)
    gate = dense(cfg.intermediate_size, "gate_proj", dtype, **mm)(h, lora_slots, step)
    up = dense(cfg.intermediate_size, "up_proj", dtype, **mm)(h, lora_slots, step)
    return dense(cfg.hidden_size, "down_proj", dtype, **mm)(activation(gate) * up, lora_slots, step)


def paged_attention_rows(attention, q, kv_pages, batch, sm_scale, *, sliding_window=None, soft_cap=None,
                         sinks=None):
    """Splits the flat tokens q [T, N, D] into the decode and prefill row groups and attends each:
    [T, N, Dout] back, Dout the attention's output width (D; latent attention: its value width).
    sinks: f32[N] (gpt-oss), one logit per query head in the softmax's denominator.

    The window, cap and sinks reach the attention function only when set, so a plain causal layer
    traces exactly the attention it always did."""
    masking = {}
    if sliding_window is not None:
        masking["sliding_window"] = sliding_window
    if soft_cap is not None:
        masking["soft_cap"] = soft_cap
    if sinks is not None:
        masking["sinks"] = sinks
    num_decode = batch.num_decode_rows
    num_prefill = batch.num_prefill_rows
    outs = []
    if num_decode:
        q_dec = q[:num_decode][:, None]  # [Bd, 1, N, D]
        dec_q_lens = (batch.dec_kv_lens > 0).astype(jnp.int32)
        out = attention(q_dec, kv_pages, batch.dec_page_indices, batch.dec_kv_lens, dec_q_lens,
                        sm_scale=sm_scale, **masking)
        outs.append(out.reshape(num_decode, *out.shape[2:]))
    if num_prefill:
        q_pre = q[num_decode:].reshape(num_prefill, -1, *q.shape[1:])  # [Bp, Tq, N, D]
        out = attention(q_pre, kv_pages, batch.pre_page_indices, batch.pre_kv_lens,
                        batch.pre_q_lens, sm_scale=sm_scale, **masking)
        outs.append(out.reshape(-1, *out.shape[2:]))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
