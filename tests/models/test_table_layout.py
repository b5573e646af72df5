"""The embedding table placed row-major (models/table_layout.py), as a TPU runner holds it.

On the CPU the default layout is row-major already, so these check the placement itself: the
table's 2-D leaves come back with a row-major Format (arrays equal to the input, committed to
their device; ShapeDtypeStructs carrying the layout for ahead-of-time compilation), every other
leaf untouched. tests/kernels/test_tpu_compile.py checks what it is for: no compiled TPU step
copies a weight."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models import param_forms, table_layout


def _params():
    rng = np.random.default_rng(0)
    return {"embed_tokens": {"embedding_q": jnp.asarray(rng.integers(-127, 128, (96, 40)), jnp.int8),
                             "embedding_scale": jnp.asarray(rng.random((96, 1)), jnp.float32)},
            "norm": {"scale": jnp.ones(40, jnp.float32)},
            "lm_head": {"kernel": jnp.asarray(rng.random((40, 96)), jnp.float32)}}


def _major_to_minor(leaf):
    layout = getattr(leaf.format, "layout", leaf.format)  # an array's Format; a ShapeDtypeStruct's Layout
    return tuple(layout.major_to_minor)


def test_the_table_leaves_are_placed_row_major_and_nothing_else_moves():
    params = _params()
    placed = table_layout.row_major_tables(params)
    for name, leaf in placed["embed_tokens"].items():
        assert _major_to_minor(leaf) == (0, 1) and leaf.committed, name
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(params["embed_tokens"][name]))
    assert placed["norm"] is params["norm"] and placed["lm_head"] is params["lm_head"]


def test_abstract_tables_carry_the_layout_on_the_default_device():
    abstract = jax.eval_shape(lambda p: p, _params())
    placed = table_layout.row_major_tables(abstract)
    table = placed["embed_tokens"]["embedding_q"]
    assert isinstance(table, jax.ShapeDtypeStruct) and table.shape == (96, 40) and table.dtype == jnp.int8
    assert _major_to_minor(table) == (0, 1)
    assert table.sharding.device_set == {jax.devices()[0]}
    assert placed["lm_head"]["kernel"].sharding is None


def test_only_the_tpu_places_it_itself():
    assert table_layout.holds_row_major("tpu")
    assert not table_layout.holds_row_major("cpu") and not table_layout.holds_row_major("gpu")


def test_a_row_major_form_is_its_own_shared_form():
    forms = param_forms.ParamForms({**_params(), "layers_0": {}}, num_layers=1)
    plain, row_major = forms.get(0, "float32"), forms.get(0, "float32", row_major_table=True)
    assert row_major is not plain and forms.get(0, "float32", row_major_table=True) is row_major
    assert _major_to_minor(row_major.tree["embed_tokens"]["embedding_q"]) == (0, 1)


def test_a_table_placed_at_load_is_not_placed_again():
    """paxpage.load places the table row-major on TPU; the runner's form then takes those arrays."""
    placed = table_layout.row_major_tables(_params())
    again = table_layout.row_major_tables(placed)
    assert all(again["embed_tokens"][k] is leaf for k, leaf in placed["embed_tokens"].items())
