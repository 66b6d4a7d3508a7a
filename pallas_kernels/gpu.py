"""Ragged paged attention for GPU (Pallas, Triton-style: ``jax.experimental.pallas.triton``).

Same contract as :func:`pallas_kernels.reference.ragged_paged_attention` (the oracle).

Why Triton-style Pallas and not Mosaic GPU or tokamax:

- tokamax (0.0.12, the maintained JAX GPU kernel library) has dense attention only:
  its Triton and Mosaic GPU attention kernels raise ``NotImplementedError`` for paged
  KV caches, and it would add ~10 runtime dependencies (qwix, tensorboardx, ...).
- Mosaic GPU (``plgpu`` in ``jax.experimental.pallas.mosaic_gpu``) is the maintained
  path but targets Hopper/Blackwell (TMA, wgmma) and has no CPU interpreter, so it
  could neither run on Ampere nor be tested in CI here. A paged cache is a gather of
  scattered pages (per-token pointer arithmetic), which Triton does natively; TMA
  needs a descriptor per page and a warp-specialised pipeline: future work.
- The Pallas Triton backend runs under ``interpret=True`` on CPU (the tests) and lowers
  for CUDA without a GPU (the lowering test). It is deprecated since JAX 0.11 (a
  DeprecationWarning at lowering) and still works in 0.12; this module is the one
  place to replace when it goes.

Design (vLLM's Triton "unified attention" on JAX's ``ops/gpu/paged_attention``):

- The wrapper cuts every request into query blocks of ``bq`` tokens that belong to that
  request only (a work list of static length ``cdiv(T, bq) + R``, built with a cumsum
  and a ``searchsorted``); the grid is (work item, kv head, kv split). No program ever
  mixes requests, so masks are simple and no rows are wasted on neighbours.
- Rows of one program are ``bq`` tokens x ``Gp`` query heads of one kv head (GQA by
  head grouping; ``Gp`` = G rounded up to a power of two, Triton's block constraint,
  with the extra rows masked), so one tensor-core matmul per kv block serves all the
  heads that share the keys. Head dims that are not a power of two are padded by mask.
- Keys and values are gathered token by token from the page table (``kv[page, slot,
  2h (+1), :]``, the interleaved layout of the reference) with masked loads: keys past
  the causal / sliding-window range or past ``kv_len`` are never read, so garbage in
  unused pages is harmless. Only the kv blocks the query block can see are visited.
- Decode / prefill specialisation at run time (``lax.cond`` on ``max(q_len)``): decode
  steps use ``bq*Gp = 16`` rows (Triton's minimum matmul size) and split the context
  into ``kv_splits`` partitions (split-K / flash-decoding) when the batch is too small
  to fill the GPU; partial results (normalised output, max, sum) are merged by a
  log-sum-exp in plain jnp. Prefill steps use 64-row blocks and no split.
- f32 inputs use IEEE matmuls (``precision=HIGHEST``) so tests can compare tightly; bf16
  inputs use bf16 tensor cores with f32 accumulation.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.inputs import compute_dtype, layer_index, rows_per_kv_head, validate_inputs
from pallas_kernels.reference import sink_factor

_KV_BLOCK = 64  # keys per inner-loop iteration
_MIN_DOT = 16  # Triton's minimum matmul dimension
_PREFILL_ROWS = 64
# Batch-invariant mode's one row block for every step (backend._attention_fn), with no split-K.
INVARIANT_ROWS = _PREFILL_ROWS
_TARGET_PROGRAMS = 1024  # enough programs to fill ~132 SMs several times over


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _kernel(
    items_ref,  # [B, 5] int32: seq, first token, rows, position of first token, kv_len
    pages_ref,  # [R, Pmax] int32
    layer_ref,  # [1] int32: layer of a stacked cache (unused otherwise)
    q_ref,  # [T_pad, N, H]
    kv_ref,  # [P, S, 2K, H] or stacked [L, P, S, 2K, H]
    *refs,  # with has_ahead: ahead_ref [T_pad] int32 (keys_ahead); then o_ref, m_ref, l_ref:
    # [splits, T_pad, N, H] (normalised per split), [splits, T_pad, N] f32, the same
    has_ahead: bool,
    bq: int,
    groups: int,
    gp: int,
    head_dim_pad: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    ahead_ref, (o_ref, m_ref, l_ref) = (refs[0], refs[1:]) if has_ahead else (None, refs)
    item, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_splits = pl.num_programs(2)
    _, page_size, two_k, head_dim = kv_ref.shape[-4:]
    pair = rows_per_kv_head(kv_ref)  # 1: one latent row (MLA), the key and the value

    def kv_at(page, slot, row, col):
        if len(kv_ref.shape) == 5:
            return kv_ref.at[layer_ref[0], page, slot, row, col]
        return kv_ref.at[page, slot, row, col]
    pages_per_seq = pages_ref.shape[1]
    rows = bq * gp

    seq = items_ref[item, 0]
    q0 = items_ref[item, 1]
    nrows = items_ref[item, 2]
    pos0 = items_ref[item, 3]
    kv_len = items_ref[item, 4]

    r = jnp.arange(rows, dtype=jnp.int32)
    tok_off = r // gp
    g = r % gp
    tok = q0 + tok_off  # [rows]
    head = kv_head * groups + jnp.minimum(g, groups - 1)
    row_ok = (tok_off < nrows) & (g < groups)
    pos = pos0 + tok_off
    hd = jnp.arange(head_dim_pad, dtype=jnp.int32)
    hd_ok = hd < head_dim
    hd_c = jnp.minimum(hd, head_dim - 1)

    q = plgpu.load(
        q_ref.at[tok[:, None], head[:, None], hd_c[None, :]],
        mask=row_ok[:, None] & hd_ok[None, :],
        other=0.0,
    )

    # Keys this item can see, [kv_lo, kv_hi), cut into blocks and split across programs.
    # keys_ahead: each row also sees that many keys past its own position.
    hi = pos
    if has_ahead:
        hi = pos + plgpu.load(ahead_ref.at[tok], mask=row_ok, other=0)
    kv_hi = jnp.minimum(pos0 + nrows, kv_len)
    if has_ahead:
        kv_hi = jnp.minimum(jnp.maximum(kv_hi, jnp.max(jnp.where(row_ok, hi, 0)) + 1), kv_len)
    kv_lo = jnp.int32(0)
    if sliding_window is not None:
        kv_lo = jnp.maximum(pos0 - sliding_window + 1, 0)
    blk_lo = kv_lo // _KV_BLOCK
    blk_hi = jnp.where(nrows > 0, (kv_hi + _KV_BLOCK - 1) // _KV_BLOCK, blk_lo)
    per_split = (jnp.maximum(blk_hi - blk_lo, 0) + num_splits - 1) // num_splits
    my_lo = blk_lo + split * per_split
    my_hi = jnp.minimum(blk_hi, my_lo + per_split)

    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

    def body(blk, carry):
        m_prev, l_prev, acc = carry
        kpos = blk * _KV_BLOCK + jnp.arange(_KV_BLOCK, dtype=jnp.int32)
        key_ok = (kpos >= kv_lo) & (kpos < kv_hi)
        page = plgpu.load(
            pages_ref.at[seq, jnp.minimum(kpos // page_size, pages_per_seq - 1)], mask=key_ok, other=0
        )
        slot = kpos % page_size
        kv_mask = key_ok[:, None] & hd_ok[None, :]
        k = plgpu.load(kv_at(page[:, None], slot[:, None], pair * kv_head, hd_c[None, :]), mask=kv_mask, other=0.0)
        v = k if pair == 1 else plgpu.load(kv_at(page[:, None], slot[:, None], 2 * kv_head + 1, hd_c[None, :]),
                                           mask=kv_mask, other=0.0)
        k, v = compute_dtype(k, q.dtype), compute_dtype(v, q.dtype)  # fp8 cache: widened in registers
        s = lax.dot_general(
            q, k.astype(q.dtype), (((1,), (1,)), ((), ())),
            precision=precision, preferred_element_type=jnp.float32,
        )
        s = s * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask = key_ok[None, :] & (kpos[None, :] <= hi[:, None])
        if sliding_window is not None:
            mask = mask & (kpos[None, :] > pos[:, None] - sliding_window)
        s = jnp.where(mask, s, -jnp.inf)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
        p = jnp.where(mask, jnp.exp(s - m_safe[:, None]), 0.0)
        alpha = jnp.exp(m_prev - m_safe)
        l_next = alpha * l_prev + jnp.sum(p, axis=1)
        pv = lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
            precision=precision, preferred_element_type=jnp.float32,
        )
        return m_next, l_next, alpha[:, None] * acc + pv

    init = (
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, head_dim_pad), jnp.float32),
    )
    m, l, acc = lax.fori_loop(my_lo, my_hi, body, init)
    out = acc / jnp.where(l == 0.0, 1.0, l)[:, None]
    out_mask = row_ok[:, None] & hd_ok[None, :]
    # Masked lanes are sent to the spare last row: the interpreters implement a masked
    # store as a scatter of (new or old) values, where a masked lane aliasing a live
    # one (padded heads / head_dim columns are clamped duplicates) could win.
    spare = o_ref.shape[1] - 1
    tok_o = jnp.where(out_mask, tok[:, None], spare)
    plgpu.store(o_ref.at[split, tok_o, head[:, None], hd_c[None, :]], out.astype(o_ref.dtype), mask=out_mask)
    tok_r = jnp.where(row_ok, tok, spare)
    plgpu.store(m_ref.at[split, tok_r, head], m, mask=row_ok)
    plgpu.store(l_ref.at[split, tok_r, head], l, mask=row_ok)


def _work_items(cu_q_lens, kv_lens, num_seqs, num_items: int, bq: int):
    """Static-length work list [num_items, 5]: (seq, q0, rows, pos0, kv_len); empty items have rows 0."""
    r = kv_lens.shape[0]
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    valid = jnp.arange(r) < num_seqs
    nblk = jnp.where(valid, (jnp.maximum(q_lens, 0) + bq - 1) // bq, 0)
    cum = jnp.cumsum(nblk)
    p = jnp.arange(num_items, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(cum, p, side="right"), r - 1).astype(jnp.int32)
    j = p - (cum[seq] - nblk[seq])
    q0 = cu_q_lens[seq] + j * bq
    rows = jnp.where(p < cum[-1], jnp.clip(cu_q_lens[seq + 1] - q0, 0, bq), 0)
    pos0 = kv_lens[seq] - q_lens[seq] + j * bq
    return jnp.stack([seq, q0, rows, pos0, kv_lens[seq]], axis=1).astype(jnp.int32)


def _attend(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, layer, sinks, keys_ahead, *, rows, kv_splits,
            sm_scale, sliding_window, soft_cap, interpret, num_warps, num_stages):
    t, n, h = q.shape
    k_heads = kv_cache.shape[-2] // rows_per_kv_head(kv_cache)
    groups = n // k_heads
    gp = _next_pow2(groups)
    bq = max(1, rows // gp)
    num_items = (t + bq - 1) // bq + page_indices.shape[0]
    items = _work_items(cu_q_lens, kv_lens, num_seqs, num_items, bq)
    # bq spare rows: a block that starts near the end never indexes past the array.
    t_pad = t + bq
    q = jnp.pad(q, ((0, bq), (0, 0), (0, 0)))
    out_dtype = q.dtype if kv_splits == 1 else jnp.float32
    ahead = () if keys_ahead is None else (jnp.pad(keys_ahead.astype(jnp.int32), (0, bq)),)
    kernel = functools.partial(
        _kernel, has_ahead=bool(ahead), bq=bq, groups=groups, gp=gp, head_dim_pad=max(_MIN_DOT, _next_pow2(h)),
        sm_scale=float(sm_scale), sliding_window=sliding_window, soft_cap=soft_cap,
    )
    o, m, l = pl.pallas_call(
        kernel,
        grid=(num_items, k_heads, kv_splits),
        out_shape=(
            jax.ShapeDtypeStruct((kv_splits, t_pad, n, h), out_dtype),
            jax.ShapeDtypeStruct((kv_splits, t_pad, n), jnp.float32),
            jax.ShapeDtypeStruct((kv_splits, t_pad, n), jnp.float32),
        ),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"ragged_paged_attention_gpu_bq{bq}_s{kv_splits}",
    )(items, page_indices, layer, q, kv_cache, *ahead)
    o, m, l = o[:, :t], m[:, :t], l[:, :t]
    if kv_splits == 1:
        o, m, l = o[0], m[0], l[0]
        if sinks is None:
            return o
    else:
        # Merge the splits (log-sum-exp); splits that saw no key have m = -inf, l = 0.
        m_all = jnp.max(m, axis=0)
        m_safe = jnp.where(m_all == -jnp.inf, 0.0, m_all)
        w = jnp.where(m == -jnp.inf, 0.0, jnp.exp(m - m_safe[None])) * l
        l_all = jnp.sum(w, axis=0)
        o = jnp.sum(w[..., None] * o, axis=0) / jnp.where(l_all == 0.0, 1.0, l_all)[..., None]
        m, l = m_safe, l_all
    if sinks is not None:
        o = o.astype(jnp.float32) * sink_factor(m, l, jnp.asarray(sinks, jnp.float32))[..., None]
    return o.astype(q.dtype)


def default_kv_splits(num_seqs_max: int, k_heads: int, max_kv_blocks: int) -> int:
    """Split-K factor for decode: enough programs to fill the GPU, at most 16."""
    programs = max(1, num_seqs_max * k_heads)
    splits = _next_pow2(max(1, pl.cdiv(_TARGET_PROGRAMS, programs)))
    return max(1, min(splits, 16, _next_pow2(max_kv_blocks)))


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale", "sliding_window", "soft_cap", "interpret", "kv_splits", "rows_per_block", "num_warps", "num_stages",
    ),
)
def ragged_paged_attention(
    q,
    kv_cache,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: bool = False,
    kv_splits: int | None = None,
    rows_per_block: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    layer=None,
    sinks=None,
    keys_ahead=None,
):
    """Triton-style Pallas ragged paged attention; same arguments and result as the reference.

    q: [T, N, H]; kv_cache: [P, S, 2K, H]; kv_lens: [R] int32; page_indices: [R, Pmax]
    int32; cu_q_lens: [R+1] int32; num_seqs: int32 scalar or [1]. Returns o: [T, N, H].
    ``kv_splits`` forces the decode split-K factor (default: from R, K and Pmax).
    ``rows_per_block`` (tokens x padded query heads, a power of two >= 16) forces one
    configuration for every step (no decode / prefill dispatch; ``kv_splits`` or 1).
    ``layer`` (int32 scalar): ``kv_cache`` is the stacked [L, P, S, 2K, H] cache of a
    layer scan, read in place (a ``kv_cache[layer]`` slice would be a full copy).
    ``sinks`` [N] float32: attention sinks, applied to the merged softmax outside the
    kernel (its m and l are outputs anyway; reference.sink_factor). ``keys_ahead`` [T]
    int32: the reference's (Gemma 3's images).
    """
    validate_inputs(q, kv_cache, kv_lens, page_indices, cu_q_lens, sliding_window=sliding_window, soft_cap=soft_cap)
    layer = layer_index(kv_cache, layer)
    t, n, h = q.shape
    _, page_size, two_k, _ = kv_cache.shape[-4:]
    r, pages_per_seq = page_indices.shape
    num_seqs = jnp.clip(jnp.reshape(num_seqs, (-1,))[0].astype(jnp.int32), 0, r)
    max_kv_blocks = pl.cdiv(pages_per_seq * page_size, _KV_BLOCK)
    splits = kv_splits or default_kv_splits(r, two_k // rows_per_kv_head(kv_cache), max_kv_blocks)
    common = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, interpret=interpret,
                  num_warps=num_warps, num_stages=num_stages)

    def decode():
        return _attend(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, layer, sinks, keys_ahead, rows=_MIN_DOT, kv_splits=splits, **common)

    def prefill():
        return _attend(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, layer, sinks, keys_ahead, rows=_PREFILL_ROWS, kv_splits=1, **common)

    if rows_per_block is not None:
        o = _attend(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, layer, sinks, keys_ahead, rows=rows_per_block,
                    kv_splits=kv_splits or 1, **common)
    else:
        q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
        max_q_len = jnp.max(jnp.where(jnp.arange(r) < num_seqs, q_lens, 0))
        o = lax.cond(max_q_len <= 1, decode, prefill)
    # Tokens no work item covers (padding) were never written.
    tok = jnp.arange(t)
    valid_tok = tok < cu_q_lens[num_seqs]
    return jnp.where(valid_tok[:, None, None], o, jnp.zeros_like(o))
