"""Sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral, DeepSeek-V2 / V3): top-k routing and grouped
expert matmuls.

Routing: `route` (a softmax over all experts, then the top k) or `route_grouped` (DeepSeek:
softmax or sigmoid scores, experts chosen within the best groups, by scores plus a correction
bias for DeepSeek-V3).

Each token's router picks `top_k` of E experts; only those experts' SwiGLU MLPs run on it. The
T * top_k (token, expert) rows are grouped by expert (a row's place follows from its rank among
its expert's rows; no sort) so that every expert sees one contiguous group of rows, and each
expert's weights multiply only its own group (a grouped matmul), so the work grows with the
number of routed tokens, not with E. Shapes stay static: the routed rows are always
M = T * top_k; only the group sizes are data.

Grouped-matmul implementations (`impl`):
    "ragged_dot"  jax.lax.ragged_dot: XLA's native grouped matmul on TPU. On CPU jax lowers it
                  to a masked product over every expert for every row (E times the work), and
                  XLA:GPU's default rewrite (no cuDNN / Triton grouped GEMM unless flags opt in)
                  also expands it to a dense dot, so it is the default on TPU only.
    "tiled"       pure jnp: each expert's group is padded to whole tiles of `tile_rows` rows, so
                  every tile belongs to one expert, and a loop over the tiles in use multiplies
                  each by its expert's weights. Work is at most M + min(E, M) * (tile - 1) rows.
                  Lowered for a GPU the loop runs over that many tiles always: a fixed trip
                  count, so no step waits on the host for the count of tiles in use.
    "dense"       every expert on every token, combined with the routing weights (zero for the
                  experts a token did not pick): the baseline the benchmark compares against.
    "stable"      "tiled" with tiles of invariant_ops.MIN_ROWS rows whatever the step, and each
                  token's k expert outputs added in order: a token's result does not depend on
                  the other tokens of its step (EngineConfig.batch_invariant, which also routes
                  with `route(..., batch_invariant=True)`).
    "auto"        "ragged_dot" on TPU, "tiled" elsewhere.

Expert weights may be held quantised (models/quant.QuantizedWeight: int8 values with scales per
group of inputs, e.g. gpt-oss's MXFP4 experts held exactly, or `quantization="int8"`): "tiled"
and "stable" expand only the expert of each tile as they multiply it (compiled for a TPU, XLA
fuses that into the matmul: ~1 MiB of temporaries at gpt-oss-20b's expert shapes and 64
tokens); "ragged_dot" takes the int8 values as its operand and scales the product when there is
one scale per output channel, and runs as "tiled" when scales come per group of inputs (MXFP4):
expanded for ragged_dot, every expert's weights would be written out again each step (1 GiB of
bf16, 3 GiB of temporaries at those shapes, from the TPU compiler; scripts/tpu_moe_check.py);
"dense" expands them all (it multiplies every expert anyway).

Axis legend: T tokens, H hidden, E experts, k experts per token, M = T * k routed rows,
F expert MLP width, G tiles, R rows in one tile.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from models import quant
from models.invariant_ops import MIN_ROWS, pairwise_sum, stable_rows
from models.quant import QuantizedWeight

IMPLS = ("auto", "ragged_dot", "tiled", "dense", "stable")
# routed_experts(x, weights, experts, gate_up, down, *, impl, gate_up_bias, down_bias, activation)
# -> [T, H]: routed_experts itself, or paxpage/sharded_experts.py's split over a mesh.
ExpertsFn = Callable[..., jax.Array]


def resolve_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"moe_impl {impl!r} is not one of {IMPLS}")
    if impl == "auto":
        return "ragged_dot" if jax.default_backend() == "tpu" else "tiled"
    return impl


def _row_sum(x, batch_invariant: bool):  # [..., n] -> [..., 1]
    return pairwise_sum(x)[..., None] if batch_invariant else jnp.sum(x, axis=-1, keepdims=True)


def _softmax(logits, batch_invariant: bool):  # over the last axis; its sum in a fixed order if asked
    if not batch_invariant:
        return jax.nn.softmax(logits, axis=-1)
    exp = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    return exp / _row_sum(exp, True)


def route(x, router, top_k: int, renormalize: bool, bias=None, batch_invariant: bool = False):
    """Router softmax over all experts (in f32), then the top k.

    x [T, H], router [H, E], bias [E] or None (gpt-oss) -> (weights f32[T, k], experts i32[T, k]).
    `renormalize` rescales the k chosen probabilities to sum to 1 (Mixtral always; Qwen3-MoE when
    `norm_topk_prob`; gpt-oss's softmax over the top k logits is the same).
    batch_invariant: the router's matmul row-stable and the sums in a fixed order
    (models/invariant_ops.py), so a token's routing does not depend on its step's other tokens.
    """
    if batch_invariant:
        logits = stable_rows(lambda rows: rows @ router, x)
    else:
        logits = jnp.einsum("TH,HE->TE", x, router)
    if bias is not None:
        logits = logits + bias.astype(logits.dtype)
    probs = _softmax(logits.astype(jnp.float32), batch_invariant)
    weights, experts = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / _row_sum(weights, batch_invariant)
    return weights, experts.astype(jnp.int32)


def route_grouped(x, router, correction_bias, top_k: int, *, num_groups: int, topk_groups: int,
                  renormalize: bool, scaling: float, scoring: str = "sigmoid", method: str = "noaux_tc",
                  batch_invariant: bool = False):
    """DeepSeek's routers (HF DeepseekV2TopkRouter, DeepseekV3TopkRouter). The scores s are
    sigmoid(x @ router) or its softmax over the E experts (`scoring`), in f32; `method` (HF's
    topk_method) picks the top k from them:
        "greedy"                the top k of all E (DeepSeek-V2-Lite);
        "group_limited_greedy"  the E experts form `num_groups` groups, each ranked by its best
                                score, and the top k come from the `topk_groups` best groups (DeepSeek-V2);
        "noaux_tc"              as above on s + correction_bias, each group ranked by the sum of
                                its two best biased scores (DeepSeek-V3).
    The chosen experts' weights are the unbiased s, rescaled to sum to 1 when `renormalize`, then
    times `scaling` (routed_scaling_factor). batch_invariant: as `route`'s.

    x [T, H], router [H, E], correction_bias f32[E] ("noaux_tc") or None
    -> (weights f32[T, k], experts i32[T, k])."""
    router32 = router.astype(jnp.float32)
    project = lambda rows: jnp.einsum("TH,HE->TE", rows, router32, precision=jax.lax.Precision.HIGHEST)
    x32 = x.astype(jnp.float32)
    logits = stable_rows(project, x32) if batch_invariant else project(x32)
    scores = jax.nn.sigmoid(logits) if scoring == "sigmoid" else _softmax(logits, batch_invariant)
    choice = scores
    if method == "noaux_tc":
        choice = scores + correction_bias.astype(jnp.float32)[None, :]
    num_tokens, num_experts = choice.shape
    if method != "greedy" and num_groups > 1:
        per_group = choice.reshape(num_tokens, num_groups, num_experts // num_groups)
        if method == "noaux_tc":
            group_scores = jnp.sum(jax.lax.top_k(per_group, 2)[0], axis=-1)  # [T, G]
        else:
            group_scores = jnp.max(per_group, axis=-1)  # [T, G]
        _, best_groups = jax.lax.top_k(group_scores, topk_groups)  # [T, topk_groups]
        in_best = jnp.any(best_groups[:, :, None] == jnp.arange(num_groups)[None, None, :], axis=1)  # [T, G]
        in_best = jnp.repeat(in_best, num_experts // num_groups, axis=1)  # [T, E]
        choice = jnp.where(in_best, choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if renormalize:
        weights = weights / (_row_sum(weights, batch_invariant) + 1e-20)
    return weights * scaling, experts.astype(jnp.int32)


def tile_rows(num_rows: int, num_experts: int) -> int:
    """Tile height for the "tiled" grouped matmul: about the mean group size, a power of two
    clamped to 8..128. Small tiles waste little padding but make many small matmuls; on CPU
    this rule came within ~25% of the best fixed tile for 8-32 experts and 32-2048 tokens."""
    target = max(1, num_rows // num_experts)
    return min(128, max(8, 1 << (target.bit_length() - 1)))


def swiglu(h):  # [..., 2F] (gate then up) -> [..., F]
    gate, up = jnp.split(h, 2, axis=-1)
    return nn.silu(gate) * up


def clamped_swiglu(limit: float, alpha: float):
    """gpt-oss's expert activation (HF GptOssExperts): the gate g clamped to <= limit, up to
    [-limit, limit], then (up + 1) * g * sigmoid(alpha * g). [..., 2F] (gate then up) -> [..., F]."""
    def activation(h):
        gate, up = jnp.split(h, 2, axis=-1)
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        return (up + 1) * (gate * jax.nn.sigmoid(alpha * gate))

    return activation


def _group_layout(flat_experts, num_experts: int):
    """Where each routed row goes when rows are grouped by expert, without a sort.

    flat_experts i32[M] -> (group_sizes i32[E], rank i32[M]): rank is the row's index among
    the rows of its expert (in row order), so start[e] + rank is its grouped position."""
    one_hot = (flat_experts[:, None] == jnp.arange(num_experts)).astype(jnp.int32)  # [M, E]
    group_sizes = jnp.sum(one_hot, axis=0)
    rank = jnp.take_along_axis(jnp.cumsum(one_hot, axis=0), flat_experts[:, None], axis=1)[:, 0] - 1
    return group_sizes, rank


def _scatter_index(dest, size: int, fill: int):
    """The inverse of dest (i32[M], distinct slots): i32[size], slot -> row, `fill` where no row goes.
    Rows then move by gathers: XLA's CPU scatter of whole rows is slow, of indices cheap."""
    return jnp.full((size,), fill, jnp.int32).at[dest].set(jnp.arange(dest.shape[0], dtype=jnp.int32))


def _expert(w, e):
    """Expert e's kernel [I, O] of the expert weights [E, I, O] (float or quantised)."""
    return jax.tree.map(lambda a: a[e], w)


def _ragged_matmul(x, w, group_sizes, row_experts):
    """jax.lax.ragged_dot of the grouped rows x [M, I] with expert weights w [E, I, O] (float or
    quantised; row_experts i32[M]: each row's expert, for a per-channel scale) -> [M, O]."""
    if not isinstance(w, QuantizedWeight):
        return jax.lax.ragged_dot(x, w, group_sizes)
    assert w.per_channel, "grouped scales take the tiled loop (expert_sums)"
    # The int8 values are the operand as held (a TPU's grouped matmul reads them as they are: a
    # converted copy would be every expert's weights again, each step); the product is scaled.
    y = jax.lax.ragged_dot(x, w.q, group_sizes, preferred_element_type=x.dtype)
    return (y.astype(jnp.float32) * w.scale[row_experts, 0]).astype(x.dtype)


def _experts_ragged(x, flat_experts, top_k, gate_up, down, gate_up_bias=None, activation=swiglu,
                    dropped: bool = False):
    """x [T, H], flat_experts i32[M] (row j is token j // top_k) -> [M, H] in row order (before
    the down projection's bias). dropped: rows of expert E (one past the last) are grouped last
    and not multiplied (their outputs are junk for the caller to discard)."""
    num_experts = gate_up.shape[0]
    group_sizes, rank = _group_layout(flat_experts, num_experts + dropped)
    start = jnp.cumsum(group_sizes) - group_sizes
    dest = start[flat_experts] + rank  # [M] grouped position of each row
    rows = _scatter_index(dest, dest.shape[0], 0)  # grouped position -> row
    x_sorted = x[rows // top_k]  # [M, H]
    group_sizes = group_sizes[:num_experts]  # rows past their sum: not computed
    row_experts = flat_experts[rows]  # [M] the expert of each grouped row
    h = _ragged_matmul(x_sorted, gate_up, group_sizes, row_experts)  # [M, 2F]
    if gate_up_bias is not None:
        h = h + gate_up_bias[row_experts].astype(h.dtype)
    y_sorted = _ragged_matmul(activation(h), down, group_sizes, row_experts)  # [M, H]
    return y_sorted[dest]


def _experts_tiled(x, flat_experts, top_k, gate_up, down, gate_up_bias=None, activation=swiglu,
                   fixed_trip_count: bool | None = None, tile: int | None = None, dropped: bool = False):
    """The same as `_experts_ragged` in plain jnp (see the module docstring).
    fixed_trip_count: loop over every tile (True) or the tiles in use (False); None: fixed
    where the step lowers for a GPU. tile: rows per tile (None: `tile_rows` of the step's rows).
    dropped: as `_experts_ragged`'s; the loop over the tiles in use stops before those rows
    (a fixed trip count covers them: any row may be a local expert's).

    A loop over the tiles in use, each sliced from the padded rows and multiplied by its
    expert's weights (indexed in place: a batched matmul over weights gathered per tile copied
    every tile's weights and measured several times slower on CPU)."""
    num_tokens, hidden = x.shape
    num_rows, num_experts = flat_experts.shape[0], gate_up.shape[0]
    tile = tile or tile_rows(num_rows, num_experts)
    # Each non-empty group pads up to < tile rows; at most min(E, M) groups are non-empty.
    num_tiles = (num_rows + min(num_experts + dropped, num_rows) * (tile - 1)) // tile
    group_sizes, rank = _group_layout(flat_experts, num_experts + dropped)
    padded = (group_sizes + tile - 1) // tile * tile  # [E] (+ 1 when dropped)
    padded_end = jnp.cumsum(padded)
    dest = (padded_end - padded)[flat_experts] + rank  # [M] slot of each row in the padded rows
    # Each slot's token; num_tokens (a zero row) for padding.
    src = _scatter_index(dest, num_tiles * tile, num_rows) // top_k
    x_padded = jnp.concatenate([x, jnp.zeros((1, hidden), x.dtype)])[src]  # [G * R, H]
    # Tile g starts at padded row g * tile: its expert is the one whose padded range holds that row.
    tile_expert = jnp.sum(padded_end[None, :] <= (jnp.arange(num_tiles) * tile)[:, None], axis=1)  # [G]

    def one_tile(g, y):
        e = tile_expert[g]
        x_tile = jax.lax.dynamic_slice_in_dim(x_padded, g * tile, tile)  # [R, H]
        h = quant.matmul(x_tile, _expert(gate_up, e))  # [R, 2F]
        if gate_up_bias is not None:
            h = h + gate_up_bias[e].astype(h.dtype)
        out = quant.matmul(activation(h), _expert(down, e))  # [R, H]
        return jax.lax.dynamic_update_slice_in_dim(y, out.astype(y.dtype), g * tile, 0)

    y = jnp.zeros((num_tiles * tile, hidden), x.dtype)

    def until_used(y):  # the loop stops at the last tile in use: unused tiles cost nothing
        return jax.lax.fori_loop(0, padded_end[num_experts - 1] // tile, one_tile, y)

    def every_tile(y):
        # XLA:GPU copies a data-dependent trip count to the host every iteration; a fixed one
        # runs on the device alone. Unused tiles multiply zero rows that no token gathers.
        return jax.lax.fori_loop(0, num_tiles, one_tile, y)

    if fixed_trip_count is not None:
        return (every_tile if fixed_trip_count else until_used)(y)[dest]
    y = jax.lax.platform_dependent(y, cuda=every_tile, rocm=every_tile, default=until_used)
    return y[dest]  # [M, H]


def _experts_dense(x, weights, experts, gate_up, down, gate_up_bias=None, activation=swiglu):
    """Every expert on every token. x [T, H] -> f32[T, H] (before the down projection's bias)."""
    num_experts = gate_up.shape[0]
    gate_up, down = (quant.expand(w, x.dtype) if isinstance(w, QuantizedWeight) else w for w in (gate_up, down))
    h = jnp.einsum("TH,EHF->ETF", x, gate_up)
    if gate_up_bias is not None:
        h = h + gate_up_bias[:, None, :].astype(h.dtype)
    y = jnp.einsum("ETF,EFH->ETH", activation(h), down)
    # [T, E] routing weights, zero for the experts a token did not pick.
    combine = jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=jnp.float32) * weights[..., None], axis=1)
    return jnp.einsum("TE,ETH->TH", combine, y.astype(jnp.float32))


def moe_mlp(x, router, gate_up, down, *, top_k: int, renormalize: bool, impl: str = "auto", router_bias=None,
            gate_up_bias=None, down_bias=None, activation=swiglu):
    """The sparse MoE MLP.

    x [T, H]; router [H, E]; gate_up [E, H, 2F] (gate columns, then up); down [E, F, H], each
    float or a quant.QuantizedWeight.
    Returns [T, H] in x's dtype: sum over the token's k experts of weight * down(silu(gate) * up).
    impl "stable" routes in its fixed-order form too (route(..., batch_invariant=True)).
    gpt-oss: router_bias [E], gate_up_bias [E, 2F], down_bias [E, H] and its `activation`
    (route, routed_experts).
    """
    x, router = jnp.asarray(x), jnp.asarray(router)
    weights, experts = route(x, router, top_k, renormalize, router_bias, impl == "stable")  # [T, k]
    return routed_experts(x, weights, experts, gate_up, down, impl=impl, gate_up_bias=gate_up_bias,
                          down_bias=down_bias, activation=activation)


def routed_experts(x, weights, experts, gate_up, down, *, impl: str = "auto", gate_up_bias=None,
                   down_bias=None, activation=swiglu):
    """Each token through its routed experts: x [T, H], weights f32[T, k], experts i32[T, k],
    gate_up [E, H, 2F], down [E, F, H] -> [T, H] in x's dtype (sum of weight * expert MLP).
    gpt-oss: biases gate_up_bias [E, 2F] / down_bias [E, H] after each projection, and
    `activation` ([..., 2F] gate then up -> [..., F]; default silu(gate) * up).
    paxpage/sharded_experts.py runs the same function split over F on a mesh."""
    y = expert_sums(x, weights, experts, gate_up, down, impl=impl, gate_up_bias=gate_up_bias,
                    activation=activation)
    if down_bias is not None:
        y = y + down_bias_sums(weights, experts, down_bias, in_order=impl == "stable")
    return y.astype(x.dtype)


def expert_sums(x, weights, experts, gate_up, down, *, impl: str = "auto", gate_up_bias=None,
                activation=swiglu, expert_offset=None):
    """routed_experts without the down projection's bias, in f32[T, H]. Each expert's output is a
    sum over its F columns, so over a split of F (gate_up and its bias on their last axis, each
    part holding its own gate then up columns; down on its F axis) the parts' results add up to
    the whole's: what tensor parallelism sums across devices.

    expert_offset (expert parallelism): gate_up / down (and the bias) hold only experts
    offset .. offset + E_local - 1 (E_local = their leading axis); a row routed elsewhere adds
    nothing and costs no expert matmul (its rows are grouped after the local experts', past the
    rows the grouped matmul computes). Over a split of E the parts add up to the whole."""
    impl = resolve_impl(impl)
    x, gate_up, down = (jax.tree.map(jnp.asarray, a) for a in (x, gate_up, down))
    gate_up_bias = None if gate_up_bias is None else jnp.asarray(gate_up_bias)
    local = None
    if expert_offset is not None:
        num_local = gate_up.shape[0]
        experts = experts - expert_offset
        local = (experts >= 0) & (experts < num_local)
        experts = jnp.where(local, experts, num_local)  # a group past the local experts'
    if impl == "dense":  # one_hot of the id past the local experts is all zeros
        return _experts_dense(x, weights, experts, gate_up, down, gate_up_bias, activation)
    num_tokens, hidden = x.shape
    top_k = experts.shape[1]
    flat_experts = experts.reshape(-1)  # [M]; row j is token j // k
    dropped = local is not None
    grouped = any(isinstance(w, QuantizedWeight) and not w.per_channel for w in (gate_up, down))
    if impl == "ragged_dot" and not grouped:
        y = _experts_ragged(x, flat_experts, top_k, gate_up, down, gate_up_bias, activation, dropped)  # [M, H]
    else:
        y = _experts_tiled(x, flat_experts, top_k, gate_up, down, gate_up_bias, activation,
                           tile=MIN_ROWS if impl == "stable" else None, dropped=dropped)
    y = y.reshape(num_tokens, top_k, hidden).astype(jnp.float32)
    if local is not None:  # rows of other devices' experts: never computed here (or junk), zero
        y = jnp.where(local[..., None], y, 0.0)
    return _weighted(weights, y, in_order=impl == "stable")


def _weighted(weights, y, in_order: bool):
    """sum_k weights[T, k] * y[T, k, H] -> f32[T, H]; in_order: k adds in turn (a fixed order)."""
    if not in_order:
        return jnp.einsum("Tk,TkH->TH", weights, y)
    total = weights[:, 0, None] * y[:, 0]
    for j in range(1, y.shape[1]):
        total = total + weights[:, j, None] * y[:, j]
    return total


def down_bias_sums(weights, experts, down_bias, in_order: bool = False):
    """The down projection's bias of each token's experts, weighted: weights f32[T, k], experts
    i32[T, k], down_bias [E, H] -> f32[T, H]. in_order: as expert_sums' "stable" impl adds."""
    bias = jnp.asarray(down_bias)[experts].astype(jnp.float32)  # [T, k, H]
    return _weighted(weights, bias, in_order)


def expert_params(module: nn.Module, num_experts: int, hidden: int, width: int, dtype):
    """A MoE module's expert weights (gate_up_proj [E, H, 2F], down_proj [E, F, H]): float params,
    or quant.QuantizedWeights where the params tree holds them quantised (`<name>_q` ...)."""
    init = nn.initializers.lecun_normal()
    weights = []
    for name, shape in (("gate_up_proj", (num_experts, hidden, 2 * width)), ("down_proj", (num_experts, width, hidden))):
        held = quant.module_weight(module, name)
        weights.append(held if held is not None else module.param(name, init, shape, dtype))
    return weights


class SparseMoe(nn.Module):
    """Parameters: router [H, E], gate_up_proj [E, H, 2F], down_proj [E, F, H] (float or
    quantised, `expert_params`); with `bias` (gpt-oss) also router_bias [E], gate_up_bias [E, 2F],
    down_bias [E, H] (models/param_layout.py)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # F, one expert's width
    renormalize: bool
    impl: str = "auto"
    dtype: Any = jnp.float32
    bias: bool = False
    swiglu_limit: float | None = None  # set: clamped_swiglu(swiglu_limit, swiglu_alpha)
    swiglu_alpha: float = 1.0
    experts_fn: ExpertsFn = routed_experts
    batch_invariant: bool = False  # routing and experts in the "stable" forms, whatever `impl`

    @nn.compact
    def __call__(self, x):  # [T, H]
        E, F, H = self.num_experts, self.intermediate_size, x.shape[-1]
        init = nn.initializers.lecun_normal()
        router = self.param("router", init, (H, E), self.dtype)
        gate_up, down = expert_params(self, E, H, F, self.dtype)
        biases = {name: self.param(name, nn.initializers.zeros, shape, self.dtype) if self.bias else None
                  for name, shape in (("router_bias", (E,)), ("gate_up_bias", (E, 2 * F)), ("down_bias", (E, H)))}
        activation = swiglu if self.swiglu_limit is None else clamped_swiglu(self.swiglu_limit, self.swiglu_alpha)
        weights, experts = route(x, router, self.top_k, self.renormalize, biases.pop("router_bias"),
                                 self.batch_invariant)  # [T, k]
        impl = "stable" if self.batch_invariant else self.impl
        return self.experts_fn(x, weights, experts, gate_up, down, impl=impl, activation=activation, **biases)
