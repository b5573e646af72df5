"""The forms a model's params take in its runners, made once and shared by them.

A runner needs the params cast to its dtype and, when its layers run under a scan, stacked
(models/layer_stack.py: `layers_{i}` -> one `layers` subtree with a leading layer axis).
`ParamForms` makes each form, keyed by (scan period, dtype, table layout), once and hands the same
arrays to every runner that asks, so a model's engines (a Model keeps up to `max_engines`) never
hold a copy each (SmolLM2 in f32: 425 MB of layers a copy).

A form lives as long as a runner holds it (the cache holds it weakly): closing a model's engines
frees their copy. The model's own params may be per-layer or stacked (`paxpage.load` holds them in
the form the backend's default engine runs: paxpage/held_form.py); a form in the params' own
form and dtype is those very arrays (restacking to the same period and casting to the same dtype
copy nothing), so that engine holds no copy at all.

Quantised params (models/quant.py) take the same path: `cast_params` keeps their int8 values and
f32 scales, and stacking maps over whatever leaves a layer has.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any

import jax
import jax.numpy as jnp

from models import layer_stack, panel_layout, table_layout
from models.quant import bytes_by_dtype, cast_params


@dataclasses.dataclass(eq=False)
class RunnerParams:
    """One form of a model's params, as the jitted step takes them. Runners keep this object (the
    cache refers to it weakly) and pass `tree` to the step."""

    tree: Any  # nested dict of arrays: per-layer `layers_{i}` (period 0) or the stacked `layers`
    period: int  # layers per scanned group, 0: unstacked
    dtype: str  # the float leaves' dtype (quantisation scales stay f32, int8 values int8)


class ParamForms:
    """A model's per-layer params and the runner forms derived from them (see the module doc).
    Safe to call from several threads (engines may be built concurrently)."""

    def __init__(self, params: dict, num_layers: int):
        self.params = params  # the model's own per-layer tree; never modified
        self.num_layers = num_layers
        self._forms: weakref.WeakValueDictionary[tuple[int, str, bool, bool], RunnerParams] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    def get(self, period: int, dtype, row_major_table: bool = False, panels: bool = True) -> RunnerParams:
        """The params cast to `dtype` and, with period > 0, stacked in groups of `period` layers,
        their embedding table placed row-major if asked (models/table_layout.py), their kernels in
        the plain [I, O] form unless `panels` (models/panel_layout.py). The same object (the same
        arrays) for as long as any runner holds it."""
        panels = panels or not panel_layout.holds_panels(self.params)  # nothing to unpack: one key
        key = (period, jnp.dtype(dtype).name, row_major_table, panels)
        with self._lock:
            form = self._forms.get(key)
            if form is None:
                form = RunnerParams(make_form(self.params, self.num_layers, period, key[1], row_major_table,
                                              panels), period, key[1])
                self._forms[key] = form
            return form

    def held(self) -> list[RunnerParams]:
        """The forms some runner holds now."""
        with self._lock:
            return list(self._forms.values())

    def copies(self) -> list[tuple[RunnerParams, int]]:
        """(form, bytes) of each live form that holds arrays beyond the model's own (a form in the
        params' own dtype reuses their unstacked leaves: only the rest counts)."""
        own = {id(x) for x in jax.tree.leaves(self.params)}
        out = []
        for form in self.held():
            extra = [x for x in jax.tree.leaves(form.tree) if id(x) not in own]
            num_bytes = sum(bytes_by_dtype(extra).values())
            if num_bytes:
                out.append((form, num_bytes))
        return out


def make_form(params: dict, num_layers: int, period: int, dtype, row_major_table: bool = False,
              panels: bool = True) -> dict:
    """What ModelRunner used to build for itself: stacked (period > 0), cast, with
    row_major_table its embedding table placed row-major (models/table_layout.py; arrays only:
    an abstract form gets its layout from table_layout.row_major_tables after jax.eval_shape),
    and unless `panels` every kernel held in panels back in the plain form (models/panel_layout.py)."""
    if not panels:
        params = panel_layout.unpack(params)  # the other leaves stay the same arrays
    params = layer_stack.restack(params, num_layers, period)  # the same tree when in that form
    params = cast_params(params, dtype)  # quantised weights keep int8 values, f32 scales
    return table_layout.row_major_tables(params) if row_major_table else params


def runner_params(params, num_layers: int, period: int, dtype, row_major_table: bool = False,
                  panels: bool = True) -> RunnerParams:
    """`params`: a ParamForms (shared forms) or a plain tree, per-layer or stacked (a form of its own)."""
    if isinstance(params, ParamForms):
        assert params.num_layers == num_layers, (params.num_layers, num_layers)
        return params.get(period, dtype, row_major_table, panels)
    name = jnp.dtype(dtype).name
    return RunnerParams(make_form(params, num_layers, period, name, row_major_table, panels), period, name)


def own_tree(params) -> dict:
    """The model's own tree (per-layer or stacked) of a ParamForms, or a plain tree as it is."""
    return params.params if isinstance(params, ParamForms) else params
