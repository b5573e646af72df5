"""The form a model's weights are held in, and which dense matmul runs on them.

`paxpage.load` holds the weights once, in the form the backend's default engine runs
(`held_form`): the layers stacked when they run under a scan (models/layer_stack.py), the f32
kernels in column panels where the dense matmuls run as the native CPU kernel
(models/panel_layout.py, pallas_kernels/native_linear.py), the embedding table row-major where
the runner wants it so (models/table_layout.py). An engine that runs another form makes a copy
of its own (models/param_forms.py).

`native_kernels` and `runs_native_matmul` are the one place that decides where the native CPU
kernels run: both `held_form` and the runner (paxpage/runner.py) ask them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models import panel_layout
from models.config import ModelConfig
from paxpage import attention_impl
from paxpage.config import EngineConfig


def native_kernels(cfg) -> bool:
    """Whether an engine of resolved config `cfg` runs the native CPU kernels (attention, and
    with it the dense matmul, the LoRA delta and the proposal draw): its attention resolved to the
    native kernel (a CPU backend), each model copy on one device (tensor_parallel_size 1; a
    data-parallel replica is one device too)."""
    return cfg.tensor_parallel_size == 1 and attention_impl.resolve(cfg.attention_impl) == "native"


def runs_native_matmul(model_cfg: ModelConfig, cfg) -> bool:
    """Whether that engine multiplies its dense kernels with the native CPU matmul, and so takes
    them in column panels: native kernels, f32 or bf16 weights, a model whose layers take it
    (latent attention keeps XLA's dot), and the kernel builds and loads here."""
    from models.layers import resolve_matmul_impl

    allowed = native_kernels(cfg) and jnp.dtype(cfg.dtype) in panel_layout.DTYPES and not model_cfg.is_mla
    return resolve_matmul_impl(allowed) == "native"


def held_form(config: ModelConfig, params: dict, engine_config: EngineConfig | None = None) -> dict:
    """`params` (per-layer, as loaded) in the form `engine_config` (None: this backend's default
    engine) runs, so that the weights are held once. `params` is consumed: its per-layer subtrees
    are let go as they are stacked, its plain kernels as they are packed."""
    from models import layer_stack, table_layout

    resolved = (engine_config or EngineConfig()).resolve(config)
    period = resolved.scan_period
    if period and not layer_stack.period_of(params):
        params = layer_stack.stack_consuming(params, config.num_layers, period)
    if runs_native_matmul(config, resolved):
        params = panel_layout.pack(params, tied_table=config.tie_word_embeddings)
    if table_layout.holds_row_major(jax.default_backend()):
        params = table_layout.row_major_tables(params)
    return params
