"""Mixture-of-experts feed-forward: router top-k, then the experts as grouped matmuls
over the token copies sorted by expert (``jax.lax.ragged_dot``: the megablox grouped
GEMM on TPU, a Triton grouped GEMM on GPU; on CPU a loop over row tiles of one expert
each, ``tiled_expert_mlp``), never a dense pass of every token through every expert. No capacity limit: every token reaches its k experts (serving must be
exact).

Shapes: T tokens, D model dim, E experts (E_l on one device), F expert mlp dim
(F_l on one device), k experts per token, A = T k token copies.

Two layouts over the mesh's 'model' axis (tp devices):
- **tensor parallel** (default): every device holds all E experts, each split by its
  mlp columns (F_l = F / tp); each device runs all its tokens' copies, and the partial
  down-projections are summed over 'model' (as a dense MLP's are).
- **expert parallel** (``--enable-expert-parallel``): each device holds E / tp whole
  experts. Two exchanges are implemented (``EP_STRATEGIES``):
  * ``allgather``: the tokens are already on every 'model' device (attention leaves them
    replicated), so each device runs the copies routed to its own experts and the
    results are summed over 'model' (one all-reduce of [T, D], as tensor parallel).
  * ``alltoall``: each device takes T / tp tokens, sends each copy to the device owning
    its expert (an all-to-all of [tp, C, D], C = T k / tp copies: the no-drop worst
    case, since XLA:CPU has no ragged all-to-all), runs the copies it received, sends
    them back, combines, and all-gathers the tokens.
  ``benchmarks/bench_moe.py`` measures both; ``allgather`` is the default (see there).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from models.base import MODEL, Weight
from models.llama import LAYER
from models.quantization import GIDX, SCALE, ZERO, dequantize_groups

EP_STRATEGIES = ("allgather", "alltoall")
# Set while tracing a differentiated forward (jaxserve/runner/dense_forward.py): the CPU
# path's dynamic tile loop has no reverse-mode derivative, ragged_dot has.
_DIFFERENTIABLE = contextvars.ContextVar("moe_differentiable", default=False)


@contextlib.contextmanager
def differentiable_experts():
    """While tracing inside, the experts run as ``ragged_dot`` on every backend (on CPU a
    dense product with every expert: E times the FLOPs, but ``jax.grad`` goes through it)."""
    token = _DIFFERENTIABLE.set(True)
    try:
        yield
    finally:
        _DIFFERENTIABLE.reset(token)


def route(router_logits, top_k: int, normalize: bool):
    """router_logits [T, E] -> (weights [T, k] float32, experts [T, k] int32): softmax over
    all experts, the k largest, renormalised to sum to 1 when ``normalize`` (Mixtral;
    Qwen's norm_topk_prob). Ties go to the lower expert id, as torch.topk."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class GroupedRouting:
    """DeepSeek's router (V2's group-limited greedy, V3's noaux_tc): expert scores by
    ``scoring`` ("softmax" over the experts, or each expert's "sigmoid"); the experts come
    in ``n_group`` groups and only the ``topk_group`` best groups compete, a group scored
    by its best expert ("max", V2) or its best two ("top2", V3), the experts outside them
    masked to ``mask_value`` (V2: 0, V3: -inf); the choice may add a per-expert
    correction bias (V3) that the weights never see; the k chosen scores are renormalised
    (``normalize``) and scaled by ``scale`` (routed_scaling_factor)."""

    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "max"
    mask_value: float = 0.0
    normalize: bool = False
    scale: float = 1.0


def route_grouped(router_logits, top_k: int, routing: GroupedRouting, score_bias=None):
    """router_logits [T, E] -> (weights [T, k] float32, experts [T, k] int32) by ``routing``;
    ``score_bias`` [E]: V3's e_score_correction_bias, added for the choice only."""
    logits = router_logits.astype(jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1) if routing.scoring == "softmax" else jax.nn.sigmoid(logits)
    choice = scores if score_bias is None else scores + score_bias.astype(jnp.float32)
    t, e = choice.shape
    if routing.n_group > 1:
        grouped = choice.reshape(t, routing.n_group, e // routing.n_group)
        if routing.group_score == "max":
            group_scores = jnp.max(grouped, axis=-1)
        else:
            group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
        _, best = jax.lax.top_k(group_scores, routing.topk_group)  # [T, topk_group]
        keep = jnp.any(best[..., None] == jnp.arange(routing.n_group), axis=-2)  # [T, n_group]
        choice = jnp.where(jnp.repeat(keep, e // routing.n_group, axis=-1), choice, routing.mask_value)
    _, experts = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if routing.normalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * routing.scale, experts.astype(jnp.int32)


def _route(router_logits, top_k, normalize, routing, score_bias):
    """route, or route_grouped when the model has a GroupedRouting."""
    if routing is None:
        return route(router_logits, top_k, normalize)
    return route_grouped(router_logits, top_k, routing, score_bias)


def _scaled(y, scale):
    """An int8 weight's product, dequantized by its per-column scale (rows: [.., F])."""
    return y if scale is None else (y * scale).astype(y.dtype)


def glu(gate, up, swiglu: tuple[float, float] | None = None):
    """The experts' gated activation: SiLU(gate) * up, or with ``swiglu`` = (alpha, limit)
    GPT-OSS's clamped form: gate clamped above at limit, up to [-limit, limit], then
    gate * sigmoid(alpha * gate) * (up + 1)."""
    if swiglu is None:
        return jax.nn.silu(gate) * up
    alpha, limit = swiglu
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return gate * jax.nn.sigmoid(gate * alpha) * (up + 1)


def _biased(y, bias, rows):
    """y [A, F] plus each row's expert bias (bias [E_l, F], rows [A] local ids); None: y."""
    return y if bias is None else y + bias[rows].astype(y.dtype)


def expert_mlp(x, experts, weights, scales, first_expert, expected_rows: int | None = None, biases=None,
               swiglu=None):
    """The gated expert MLPs of token copies. x: [A, D], experts: [A] int32 (global
    ids); weights = (gate [E_l, D, F_l], up [E_l, D, F_l], down [E_l, F_l, D]) hold
    experts ``first_expert .. first_expert + E_l - 1``; scales: None, or their int8
    scales (gate / up [E_l, F_l], down [E_l, D]); biases: None, or (gate [E_l, F_l], up
    [E_l, F_l], down [E_l, D]) added to each product (GPT-OSS); ``swiglu``: the
    activation (``glu``). Returns [A, D]: each copy through its
    expert, zeros for copies whose expert is held elsewhere (they cost no expert FLOPs:
    they sort after every group). ``expected_rows``: about how many copies are this
    device's (sizes the CPU path's tiles; default A)."""
    num_local = weights[0].shape[0]
    local = experts - first_expert
    mine = (local >= 0) & (local < num_local)
    key = jnp.where(mine, local, num_local)  # elsewhere: a last bucket no group covers
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)
    xs = x[order]
    if jax.default_backend() == "cpu" and not _DIFFERENTIABLE.get():
        tile = tile_rows(expected_rows or x.shape[0], num_local)
        out = tiled_expert_mlp(xs, group_sizes, weights, scales, tile, biases=biases, swiglu=swiglu)
    else:  # TPU: megablox grouped GEMM; GPU: grouped GEMM
        row_group = jnp.minimum(key[order], num_local - 1)
        sg, su, sd = (None,) * 3 if scales is None else (s[row_group] for s in scales)
        bg, bu, bd = (None,) * 3 if biases is None else biases
        wg, wu, wd = (w.astype(x.dtype) for w in weights)  # int8: the convert fuses into the operand
        gate = _biased(_scaled(jax.lax.ragged_dot(xs, wg, group_sizes), sg), bg, row_group)
        up = _biased(_scaled(jax.lax.ragged_dot(xs, wu, group_sizes), su), bu, row_group)
        out = _scaled(jax.lax.ragged_dot(glu(gate, up, swiglu).astype(x.dtype), wd, group_sizes), sd)
        out = _biased(out, bd, row_group)
    # Rows past the last group are not defined by every ragged_dot lowering: zero them.
    out = jnp.where(mine[order][:, None], out, 0)
    return jnp.zeros_like(out).at[order].set(out)  # back to the copies' order


def tile_rows(num_rows: int, num_groups: int) -> int:
    """Rows per tile of ``tiled_expert_mlp``: about the mean group size, in [8, 128]."""
    tile = 8
    while tile < 128 and tile * num_groups < num_rows:
        tile *= 2
    return tile


def tiled_expert_mlp(xs, group_sizes, weights, scales=None, tile: int | None = None, biases=None, swiglu=None):
    """The grouped expert MLP as a loop over row tiles (the CPU path: XLA:CPU lowers
    ``ragged_dot`` to a dense product with every group, E_l times the work).

    xs: [A, D] rows sorted by group; group_sizes: [E_l] int32 (rows past their sum are
    left zero); weights, scales, biases, swiglu: as ``expert_mlp``. Each tile is ``tile`` rows of one
    group through that group's weights, so the work is the real rows rounded up per
    group, and the loop runs only as many tiles as the groups need (a dynamic trip
    count; at most cdiv(A, tile) + E_l)."""
    a, d = xs.shape
    w_gate, w_up, w_down = (jnp.asarray(w) for w in weights)
    s_gate, s_up, s_down = (None,) * 3 if scales is None else scales
    num_groups = w_gate.shape[0]
    tile = tile or tile_rows(a, num_groups)
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    tile_ends = jnp.cumsum((group_sizes + tile - 1) // tile)
    tile_starts = jnp.concatenate([jnp.zeros((1,), tile_ends.dtype), tile_ends[:-1]])
    # A tile may start near the end: the padding keeps every slice in bounds (a clamped
    # dynamic_slice would shift it onto other rows).
    xp = jnp.concatenate([xs, jnp.zeros((tile, d), xs.dtype)])

    b_gate, b_up, b_down = (None,) * 3 if biases is None else biases

    def mm(x, w, s, b, g):
        y = _scaled(x @ w[g].astype(x.dtype), None if s is None else s[g])
        return y if b is None else y + b[g].astype(y.dtype)

    def body(j, out):
        g = jnp.minimum(jnp.searchsorted(tile_ends, j, side="right"), num_groups - 1)
        row0 = starts[g] + (j - tile_starts[g]) * tile
        rows = jax.lax.dynamic_slice_in_dim(xp, row0, tile)
        h = glu(mm(rows, w_gate, s_gate, b_gate, g), mm(rows, w_up, s_up, b_up, g), swiglu)
        y = mm(h.astype(xs.dtype), w_down, s_down, b_down, g).astype(out.dtype)
        valid = (row0 + jnp.arange(tile)) < ends[g]
        old = jax.lax.dynamic_slice_in_dim(out, row0, tile)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(valid[:, None], y, old), row0, 0)

    out = jax.lax.fori_loop(0, tile_ends[-1], body, jnp.zeros((a + tile, w_down.shape[-1]), xs.dtype))
    return out[:a]


def _router_logits(x, router, router_bias):
    """x [T, D] @ router [D, E] (+ router_bias [E], GPT-OSS) -> [T, E]."""
    logits = x @ router
    return logits if router_bias is None else logits + router_bias.astype(logits.dtype)


def _moe_local(x, router, weights, scales, router_bias, biases, score_bias, *, top_k, normalize, first_expert, swiglu,
               routing):
    """One device's part: x [T, D] -> [T, D] partial sum of its experts (or mlp columns)."""
    t = x.shape[0]
    gates, experts = _route(_router_logits(x, router, router_bias), top_k, normalize, routing, score_bias)
    mine = t * top_k * weights[0].shape[0] // router.shape[1]  # copies routed here, on average
    out = expert_mlp(jnp.repeat(x, top_k, axis=0), experts.reshape(-1), weights, scales, first_expert, mine,
                     biases=biases, swiglu=swiglu)
    return _combine(out, gates).astype(x.dtype)


def _combine(copies, gates):
    """copies [T k, D] (token-major) weighted by gates [T, k] and summed per token -> [T, D] float32."""
    t, k = gates.shape
    return jnp.sum(copies.reshape(t, k, -1).astype(jnp.float32) * gates[..., None], axis=1)


def _moe_alltoall(x, router, weights, scales, router_bias, biases, score_bias, *, top_k, normalize, axis, ep, swiglu,
                  routing):
    """Expert parallel by token exchange (see the module docstring); x [T, D] replicated
    over ``axis``, T a multiple of ``ep``."""
    t, d = x.shape
    me = jax.lax.axis_index(axis)
    num_local = weights[0].shape[0]
    mine = jax.lax.dynamic_slice_in_dim(x, me * (t // ep), t // ep)  # [Ts, D]
    gates, experts = _route(_router_logits(mine, router, router_bias), top_k, normalize, routing, score_bias)
    c = mine.shape[0] * top_k  # copies per device: the most one destination can get
    copies = jnp.repeat(mine, top_k, axis=0)  # [C, D]
    flat = experts.reshape(-1)
    dest = flat // num_local
    # Send buffer [ep, C, D]: copy j goes to row j of its destination's slab.
    onehot = dest[None, :] == jnp.arange(ep)[:, None]  # [ep, C]
    send = jnp.where(onehot[..., None], copies[None], 0).astype(x.dtype)
    send_expert = jnp.where(onehot, flat[None], -1)
    recv = jax.lax.all_to_all(send, axis, 0, 0, tiled=False)  # [ep, C, D]: from each source
    recv_expert = jax.lax.all_to_all(send_expert, axis, 0, 0, tiled=False)
    out = expert_mlp(recv.reshape(ep * c, d), recv_expert.reshape(-1), weights, scales, me * num_local, c,
                     biases=biases, swiglu=swiglu)
    back = jax.lax.all_to_all(out.reshape(ep, c, d), axis, 0, 0, tiled=False)  # [ep, C, D]: per owner
    done = jnp.sum(jnp.where(onehot[..., None], back, 0), axis=0)  # [C, D]
    return jax.lax.all_gather(_combine(done, gates).astype(x.dtype), axis, axis=0, tiled=True)


def moe_block(x, router, weights, scales=None, *, top_k: int, normalize: bool, mesh: Mesh | None,
              expert_parallel: bool, strategy: str = "allgather", router_bias=None, biases=None, swiglu=None,
              routing: GroupedRouting | None = None, score_bias=None):
    """The MoE feed-forward of one layer. x: [T, D] (split over 'data' with data
    parallelism); router: [D, E]; weights = (gate [E, D, F], up [E, D, F], down
    [E, F, D]), laid out over 'model' by experts (``expert_parallel``) or by F; scales:
    None, or their int8 scales ([E, F], [E, F], [E, D]). GPT-OSS adds ``router_bias``
    [E], ``biases`` = (gate [E, F], up [E, F], down [E, D]) laid out as the weights'
    output axes, and its clamped activation ``swiglu`` = (alpha, limit) (``glu``).
    DeepSeek's ``routing`` (GroupedRouting) replaces softmax-top-k, with its
    ``score_bias`` [E] (None: none). Returns [T, D]."""
    kw = dict(top_k=top_k, normalize=normalize, swiglu=swiglu, routing=routing)
    weights = tuple(weights)
    scales = tuple(scales) if scales is not None else None
    biases = tuple(biases) if biases is not None else None
    if mesh is None or mesh.size == 1:
        return _moe_local(x, router, weights, scales, router_bias, biases, score_bias, first_expert=0, **kw)
    tp = mesh.shape["model"]
    tokens = P("data", None)
    if expert_parallel:
        w_specs, s_specs = (P("model", None, None),) * 3, (P("model", None),) * 3
    else:
        w_specs = (P(None, None, "model"), P(None, None, "model"), P(None, "model", None))
        s_specs = (P(None, "model"), P(None, "model"), P(None, None))
    in_specs = (tokens, P(), w_specs, s_specs if scales is not None else None,
                None if router_bias is None else P(), s_specs if biases is not None else None,
                None if score_bias is None else P())
    if expert_parallel and strategy == "alltoall" and tp > 1:
        if (x.shape[0] // mesh.shape["data"]) % tp:  # each device takes an equal share
            raise ValueError(f"the all-to-all exchange needs each rank's tokens to be a multiple of {tp}")
        local = functools.partial(_moe_alltoall, axis="model", ep=tp, **kw)
    else:
        def local(x, router, weights, scales, router_bias, biases, score_bias):
            first = jax.lax.axis_index("model") * weights[0].shape[0] if expert_parallel else 0
            if biases is not None and not expert_parallel:
                # Split by F, every device adds a partial down product: the down bias
                # belongs to one of them only (the psum adds the rest).
                first_rank = jax.lax.axis_index("model") == 0
                biases = (biases[0], biases[1], jnp.where(first_rank, biases[2], jnp.zeros_like(biases[2])))
            part = _moe_local(x, router, weights, scales, router_bias, biases, score_bias, first_expert=first, **kw)
            return jax.lax.psum(part, "model")

    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=tokens,
                         check_vma=False)(x, router, weights, scales, router_bias, biases, score_bias)


# Axis sizes of the expert params, as ModelArchConfig fields.
_L, _D, _E, _FE = "num_hidden_layers", "hidden_size", "num_experts", "moe_intermediate_size"
_DENSE_MLP = ("gate_proj", "up_proj", "down_proj", "gate_bias", "up_bias", "down_bias")


def moe_arch_fields(cfg: dict, *, num_experts: int, moe_intermediate_size: int, norm_topk_prob: bool) -> dict:
    """The MoE ModelArchConfig fields, checked (ValueError naming the config field)."""
    top_k = cfg.get("num_experts_per_tok")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"{cfg['architectures'][0]}: num_experts must be a positive integer, got {num_experts!r}")
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"{cfg['architectures'][0]}: num_experts_per_tok must be in [1, {num_experts}], got {top_k!r}")
    # Qwen-MoE's dense layers (mlp_only_layers, decoder_sparse_step > 1) would need a
    # second stacked layer kind under the scan.
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise ValueError(f"{cfg['architectures'][0]} with dense layers (mlp_only_layers / decoder_sparse_step > 1) "
                         "is not supported")
    return dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_intermediate_size,
                norm_topk_prob=norm_topk_prob)


def expert_stacks(lw: dict, names: tuple[str, str, str], dtype):
    """(weights, scales) of a layer's experts for ``moe_block``: as stored, with their
    int8 scales if any, or, for experts kept as a packed checkpoint stores them (int4,
    fp8 or e2m1 codes with their group scales; models/quantization.py), their values in
    ``dtype``, dequantized inside the step one layer at a time (the stored weights stay
    packed)."""
    scale = lw.get(names[0] + SCALE)
    if scale is not None and scale.ndim == lw[names[0]].ndim:  # [E, G, out] group scales
        def values(n):
            zero, gidx = lw.get(n + ZERO), lw.get(n + GIDX)
            return jax.vmap(functools.partial(dequantize_groups, dtype=dtype),
                            in_axes=(0, 0, None if zero is None else 0, None if gidx is None else 0)
                            )(lw[n], lw[n + SCALE], zero, gidx)
        return tuple(values(n) for n in names), None
    scales = tuple(lw[n + SCALE] for n in names) if scale is not None else None
    return tuple(lw[n] for n in names), scales


class SparseMoeMLP:
    """Mixin for a decoder class whose every layer's MLP is a sparse MoE block: put it
    before the dense class (``class X(SparseMoeMLP, Qwen3ForCausalLM)``) and name the
    checkpoint tensors: ``router_name`` (the [E, D] gate) and ``expert_names`` (gate, up,
    down projections of expert ``{e}``), relative to the layer prefix."""

    router_name = "mlp.gate.weight"
    expert_names = ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                    "mlp.experts.{e}.down_proj.weight")

    @classmethod
    def weight_map(cls, c):
        m = {n: w for n, w in super().weight_map(c).items() if n not in _DENSE_MLP}
        if c.expert_parallel:  # whole experts per device
            cols = rows = (None, MODEL, None, None)
        else:  # every expert split by its mlp dim, as a dense MLP
            cols, rows = (None, None, None, MODEL), (None, None, MODEL, None)
        gate, up, down = cls.expert_names
        return m | {
            "router": Weight(LAYER + cls.router_name, (_L, _D, _E), transpose=True),
            "experts_gate": Weight(LAYER + gate, (_L, _E, _D, _FE), cols, transpose=True),
            "experts_up": Weight(LAYER + up, (_L, _E, _D, _FE), cols, transpose=True),
            "experts_down": Weight(LAYER + down, (_L, _E, _FE, _D), rows, transpose=True),
        }

    def mlp(self, x, lw):
        c = self.config
        weights, scales = expert_stacks(lw, ("experts_gate", "experts_up", "experts_down"), x.dtype)
        return moe_block(x, lw["router"], weights, scales, top_k=c.num_experts_per_tok,
                         normalize=c.norm_topk_prob, mesh=self.mesh, expert_parallel=c.expert_parallel)
