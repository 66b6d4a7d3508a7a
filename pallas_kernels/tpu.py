"""Ragged paged attention for TPU (Pallas / Mosaic TPU).

Same contract as :func:`pallas_kernels.reference.ragged_paged_attention` (the oracle):
q[T, N, H], kv_cache[P, S, 2K, H] (K and V interleaved on axis 2), kv_lens[R],
page_indices[R, Pmax], cu_q_lens[R+1], num_seqs -> o[T, N, H]; padded tokens get zeros.

Design (after JAX's ``ops/tpu/ragged_paged_attention``, byte-compatible cache layout):

- Grid: one program per block of ``bq`` query tokens of the flat (ragged) token axis.
  A block may hold the tail of one request, several whole requests and the head of
  another; the wrapper precomputes, with two ``searchsorted``, the range of requests
  each block overlaps (``seq_lo``/``seq_hi``), so a program never scans the batch.
- Metadata (kv_lens, flattened page table, cu_q_lens, num_seqs, per-block request
  ranges) is scalar-prefetched into SMEM; the cache stays in HBM (``memory_space=ANY``)
  and whole pages (K and V of all heads: one DMA per page) are copied into a VMEM
  double buffer. The program walks a flat list of (request, kv block) work items and
  starts the copy of item i+1 (possibly the next request's first block) before it
  waits for item i, so the DMA engine never idles between requests.
- Only the kv blocks a (query block, request) pair can see are visited: from the
  sliding-window start of its first token to the causal end of its last one (a prefill
  chunk does half the work of a full sweep), and inside a block only the pages that
  hold such keys are fetched. Pages never fetched, and keys past ``kv_len``, are zeroed
  before the matmuls, so NaN/garbage in unused pages cannot leak into the output.
  The page copies are issued by a loop (not an unrolled list of descriptors, which
  spills scalar registers past ~16 pages, as JAX's kernel notes).
- Online (flash) softmax in f32 per kv head with GQA by head grouping: the ``G`` query
  heads of a kv head and the ``bq`` tokens form the ``bq*G`` rows of one MXU matmul
  against the block's keys. Running max / sum live in VMEM scratch as lane-replicated
  ``[K, rows, 128]`` tiles and the ``[bq, N, H]`` f32 accumulator is kept normalised,
  so the final store is a plain cast. Only the rows of the request being processed
  are updated (a select): the block's other rows belong to other requests. Causal
  offset ``kv_len - q_len``, ``sliding_window`` and ``soft_cap`` follow the reference
  exactly (sm_scale is applied to the f32 scores).
- Decode / prefill specialisation: the query block size is chosen per call. When the
  token bucket is larger than the decode block, the wrapper compiles two variants and
  picks one at run time with ``lax.cond`` on ``max(q_len)``: a pure-decode step (one
  token per request, the steady state of serving) runs with ``bq = 8`` (8 requests per
  program, little wasted MXU work), anything else with a prefill-sized block
  (``bq*G ~ 128..256`` rows). The kv block targets 256 tokens (<= 16 pages) within a
  VMEM budget.

Interpreter vs hardware: everything above runs unchanged under ``interpret=True`` and
``interpret=pltpu.InterpretParams()`` except how K/V rows are read out of the VMEM
buffer. On TPU the buffer is viewed as ``[pages*S*2K, H]`` (ref ``.reshape``) and K/V
of a head are strided loads; for bf16 the packed pair (K, V) is read as one uint32 and
split with shifts (the trick of JAX's kernel, Mosaic has no strided loads of packed
rows at odd offsets). The interpreters support neither ref reshapes nor strided ref
loads nor ref bitcasts, so there the buffer is loaded as a value and sliced. That
helper (``_load_kv``) is the only hardware-only code; the TPU lowering test covers it.

Limits: kv dtypes f32/bf16 (no int8/fp8 scales); the flattened page table must fit in
SMEM (R * Pmax * 4 bytes: 256 requests x 512 pages is 512 KiB, near the limit; page
the table through VMEM if bigger tables are ever needed); for the hardware path the
tile constraints of Mosaic apply (head_dim a multiple of 128 is the fast path,
2K a multiple of 8 for f32 / 16 for bf16 keeps the page DMA and strided loads aligned).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.inputs import compute_dtype, layer_index, rows_per_kv_head, validate_inputs

# Tokens per kv block we aim for, and the cap on pages (= DMA descriptors) per block.
_KV_BLOCK_TOKENS = 256
_MAX_PAGES_PER_BLOCK = 16
# VMEM bytes we allow for the kv double buffer.
_KV_BUFFER_BUDGET = 8 * 1024 * 1024
# Query tokens per block for pure-decode steps.
_DECODE_BLOCK = 8
# Batch-invariant mode's one query block for every step (backend._attention_fn); the KV
# block already depends only on the page size and the engine's pages per sequence.
INVARIANT_QUERIES = _DECODE_BLOCK
_LANES = 128


def _next_multiple(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def prefill_block_size(num_tokens: int, groups: int) -> int:
    """Query tokens per block for steps with prefill: ~128-256 matmul rows (a multiple of 8)."""
    bq = _next_multiple(max(32, 128 // groups), 8)
    return min(bq, _next_multiple(num_tokens, 8))


def kv_pages_per_block(page_size: int, pages_per_seq: int, page_bytes: int) -> int:
    """Pages per kv block: ~256 tokens, <= 16 DMAs, double buffer within budget."""
    n = max(1, _KV_BLOCK_TOKENS // page_size)
    n = min(n, _MAX_PAGES_PER_BLOCK, pages_per_seq)
    n = min(n, max(1, _KV_BUFFER_BUDGET // (2 * page_bytes)))
    return max(1, n)


def _load_kv(kv_bufs, buf, kv_head, *, hardware: bool):
    """K and V rows of one kv head from VMEM buffer ``buf``: two [pages*S, H] values."""
    _, npb, page_size, two_k, head_dim = kv_bufs.shape
    rows = npb * page_size
    if not hardware:
        x = kv_bufs[buf]  # [npb, S, 2K, H]
        if two_k == 1:  # the latent layout: one row, the key and the value
            k = x[:, :, 0, :].reshape(rows, head_dim)
            return k, k
        k = x[:, :, 2 * kv_head, :].reshape(rows, head_dim)
        v = x[:, :, 2 * kv_head + 1, :].reshape(rows, head_dim)
        return k, v
    flat = kv_bufs.at[buf].reshape(rows * two_k, head_dim)
    if two_k == 1:  # contiguous rows, nothing to unpack
        k = flat[...]
        return k, k
    if jnp.dtype(kv_bufs.dtype).itemsize == 4:
        k = flat[2 * kv_head :: two_k, :]
        v = flat[2 * kv_head + 1 :: two_k, :]
        return k, v
    if kv_bufs.dtype != jnp.bfloat16:
        raise NotImplementedError(f"kv cache dtype {kv_bufs.dtype} on TPU hardware (f32 and bf16 only; fp8 runs "
                                  "interpreted and on GPU)")
    # bf16 packs rows (2h, 2h+1) = (K, V) of a head into one 32-bit word: K in the low
    # half, V in the high half; a bf16 is the top half of the f32 with the same value.
    packed = flat.bitcast(jnp.uint32)[kv_head :: two_k // 2, :]
    k = pltpu.bitcast(packed << 16, jnp.float32).astype(jnp.bfloat16)
    v = pltpu.bitcast(packed & jnp.uint32(0xFFFF0000), jnp.float32).astype(jnp.bfloat16)
    return k, v


def _rpa_kernel(
    # Scalar prefetch (SMEM).
    kv_lens_ref,  # [R]
    pages_ref,  # [R * Pmax] (page table, flattened)
    cu_q_lens_ref,  # [R + 1]
    num_seqs_ref,  # [1]
    seq_lo_ref,  # [num_q_blocks]: first request overlapping the block
    seq_hi_ref,  # [num_q_blocks]: one past the last
    layer_ref,  # [1]: layer of a stacked cache (unused otherwise)
    sinks_ref,  # [N] f32 attention sinks ([1] unused without them)
    blk_ahead_ref,  # [num_q_blocks]: the most keys_ahead of the block's tokens (0 without)
    # Inputs.
    q_ref,  # [bq, N, H] (VMEM block)
    kv_hbm,  # [P, S, 2K, H] or stacked [L, P, S, 2K, H] (HBM)
    *refs,  # with has_ahead: ahead_ref [bq*G, 1] int32, each row's keys_ahead (VMEM block);
    # then the output o_ref [bq, N, H] and the scratch: kv_bufs [2, npb, S, 2K, H], DMA
    # semaphores [2], m_ref and l_ref [K, bq*G, 128] f32 running max and sum
    # (lane-replicated), acc_ref [bq, N, H] f32 normalised accumulator.
    has_ahead: bool,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    pages_per_seq: int,
    hardware: bool,
    has_sinks: bool,
):
    ahead_ref, (o_ref, kv_bufs, sems, m_ref, l_ref, acc_ref) = (refs[0], refs[1:]) if has_ahead else (None, refs)
    bq, num_heads, head_dim = q_ref.shape
    _, npb, page_size, two_k, _ = kv_bufs.shape
    k_heads = two_k // rows_per_kv_head(kv_bufs)
    groups = num_heads // k_heads
    rows = bq * groups
    bkv = npb * page_size
    max_seqs = kv_lens_ref.shape[0]

    def page_src(phys):
        if len(kv_hbm.shape) == 5:
            return kv_hbm.at[layer_ref[0], phys]
        return kv_hbm.at[phys]

    q_blk = pl.program_id(0)
    blk_start = q_blk * bq
    blk_end = blk_start + bq
    seq_hi = jnp.minimum(seq_hi_ref[q_blk], num_seqs_ref[0])

    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def seq_info(seq):
        """Scalars of request ``seq`` restricted to this query block."""
        s = jnp.minimum(seq, max_seqs - 1)  # never read SMEM out of bounds
        q_start = cu_q_lens_ref[s]
        q_end = cu_q_lens_ref[s + 1]
        kv_len = kv_lens_ref[s]
        q_len = q_end - q_start
        t_lo = jnp.maximum(q_start, blk_start)
        t_hi = jnp.minimum(q_end, blk_end)
        # Keys visible to the block's tokens of this request: [kv_lo, kv_hi) (keys_ahead:
        # the block's furthest, for every request of the block; each row is masked to its own).
        kv_hi = jnp.minimum(kv_len - q_len + (t_hi - q_start) + blk_ahead_ref[q_blk], kv_len)
        kv_lo = jnp.int32(0)
        if sliding_window is not None:
            kv_lo = jnp.maximum(kv_len - q_len + (t_lo - q_start) - sliding_window + 1, 0)
        empty = (t_lo >= t_hi) | (kv_lo >= kv_hi) | (seq >= seq_hi)
        return dict(
            s=s, q_start=q_start, q_end=q_end, kv_len=kv_len, q_len=q_len,
            kv_lo=kv_lo, kv_hi=kv_hi, empty=empty,
            blk_lo=kv_lo // bkv, blk_hi=(kv_hi + bkv - 1) // bkv,
            page_lo=kv_lo // page_size,
            page_hi=jnp.minimum((kv_hi + page_size - 1) // page_size, pages_per_seq),
        )

    def first_nonempty(seq):
        return lax.while_loop(
            lambda sq: (sq < seq_hi) & seq_info(sq)["empty"], lambda sq: sq + 1, seq
        )

    def next_item(seq, blk):
        info = seq_info(seq)

        def other_seq():
            nxt = first_nonempty(seq + 1)
            return nxt, seq_info(nxt)["blk_lo"]

        return lax.cond(blk + 1 < info["blk_hi"], lambda: (seq, blk + 1), other_seq)

    def page_copies(seq, blk, buf, action):
        # Only pages holding keys the block can see are copied (and waited for). A loop,
        # not an unrolled list of descriptors: fewer scalar registers live at once.
        info = seq_info(seq)
        first = jnp.maximum(info["page_lo"] - blk * npb, 0)
        last = jnp.minimum(info["page_hi"] - blk * npb, npb)

        def one(i, carry):
            phys = pages_ref[info["s"] * pages_per_seq + blk * npb + i]
            copy = pltpu.make_async_copy(page_src(phys), kv_bufs.at[buf, i], sems.at[buf])
            getattr(copy, action)()
            return carry

        lax.fori_loop(first, last, one, 0)

    def compute(seq, blk, buf):
        info = seq_info(seq)
        kv_start = blk * bkv
        kpos = kv_start + lax.broadcasted_iota(jnp.int32, (1, bkv), 1)
        # Keys actually fetched and inside the sequence; everything else is zeroed.
        key_ok = (kpos >= info["page_lo"] * page_size) & (kpos < info["kv_hi"])
        kpos_col = kv_start + lax.broadcasted_iota(jnp.int32, (bkv, 1), 0)
        key_ok_col = (kpos_col >= info["page_lo"] * page_size) & (kpos_col < info["kv_hi"])
        tok = blk_start + lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // groups
        tok_pos = info["kv_len"] - info["q_len"] + (tok - info["q_start"])
        row_in_seq = (tok >= info["q_start"]) & (tok < info["q_end"])
        mask = key_ok & (kpos <= (tok_pos + ahead_ref[...] if has_ahead else tok_pos))
        if sliding_window is not None:
            mask &= kpos > tok_pos - sliding_window

        for h in range(k_heads):
            k, v = _load_kv(kv_bufs, buf, h, hardware=hardware)
            k, v = compute_dtype(k, jnp.float32), compute_dtype(v, jnp.float32)  # fp8 cache
            # Selects in f32: chips before v6 have no bf16 VPU.
            k = jnp.where(key_ok_col, k.astype(jnp.float32), 0.0).astype(k.dtype)
            v = jnp.where(key_ok_col, v.astype(jnp.float32), 0.0).astype(v.dtype)
            q = q_ref[:, h * groups : (h + 1) * groups, :]
            if jnp.dtype(q.dtype).itemsize < 4 and groups % (4 // jnp.dtype(q.dtype).itemsize):
                q = q.astype(jnp.float32)  # packed rows cannot be folded at odd offsets
            q = q.reshape(rows, head_dim)
            s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            s = s * sm_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = jnp.where(mask, s, -jnp.inf)
            m_cur = jnp.max(s, axis=1, keepdims=True)  # [rows, 1]
            m_prev = m_ref[h][:, :1]
            l_prev = l_ref[h][:, :1]
            m_next = jnp.maximum(m_prev, m_cur)
            m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
            p = jnp.where(mask, jnp.exp(s - m_safe), 0.0)
            alpha = jnp.exp(m_prev - m_safe)  # 0 while nothing was seen (m_prev = -inf)
            l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
            pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
            l_safe = jnp.where(l_next == 0.0, 1.0, l_next)
            acc_prev = acc_ref[:, h * groups : (h + 1) * groups, :].reshape(rows, head_dim)
            acc = (alpha * l_prev * acc_prev + pv) / l_safe
            acc = jnp.where(row_in_seq, acc, acc_prev)
            acc_ref[:, h * groups : (h + 1) * groups, :] = acc.reshape(bq, groups, head_dim)
            m_ref[h] = jnp.where(row_in_seq, jnp.broadcast_to(m_next, (rows, _LANES)), m_ref[h])
            l_ref[h] = jnp.where(row_in_seq, jnp.broadcast_to(l_next, (rows, _LANES)), l_ref[h])

    seq0 = first_nonempty(seq_lo_ref[q_blk])

    @pl.when(seq0 < seq_hi)
    def _():
        blk0 = seq_info(seq0)["blk_lo"]
        page_copies(seq0, blk0, 0, "start")

        def body(state):
            seq, blk, buf = state
            nseq, nblk = next_item(seq, blk)

            @pl.when(nseq < seq_hi)
            def _():
                page_copies(nseq, nblk, 1 - buf, "start")

            page_copies(seq, blk, buf, "wait")
            compute(seq, blk, buf)
            return nseq, nblk, 1 - buf

        lax.while_loop(lambda st: st[0] < seq_hi, body, (seq0, blk0, jnp.int32(0)))

    if has_sinks:
        # Each row's sink joins its softmax's denominator: acc / l becomes acc / (l +
        # exp(sink - m)) (reference.sink_factor). Row i * G + g is query head h * G + g.
        member = lax.broadcasted_iota(jnp.int32, (rows, 1), 0) % groups
        for h in range(k_heads):
            sink = jnp.zeros((rows, 1), jnp.float32)
            for g in range(groups):
                sink = jnp.where(member == g, sinks_ref[h * groups + g], sink)
            m, l = m_ref[h][:, :1], l_ref[h][:, :1]
            lse = jnp.where(l > 0.0, m + jnp.log(jnp.where(l > 0.0, l, 1.0)), -jnp.inf)
            factor = 1.0 / (1.0 + jnp.exp(sink - lse))
            acc = acc_ref[:, h * groups : (h + 1) * groups, :].reshape(rows, head_dim)
            acc_ref[:, h * groups : (h + 1) * groups, :] = (acc * factor).reshape(bq, groups, head_dim)
    o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _block_seq_ranges(cu_q_lens, num_seqs, num_q_blocks: int, bq: int):
    """Per query block [seq_lo, seq_hi): the requests whose tokens overlap it."""
    r = cu_q_lens.shape[0] - 1
    valid = jnp.arange(r) < num_seqs
    big = jnp.iinfo(jnp.int32).max
    starts = jnp.where(valid, cu_q_lens[:-1], big)
    ends = jnp.where(valid, cu_q_lens[1:], big)
    a = jnp.arange(num_q_blocks, dtype=jnp.int32) * bq
    seq_lo = jnp.searchsorted(ends, a, side="right").astype(jnp.int32)
    seq_hi = jnp.searchsorted(starts, a + bq, side="left").astype(jnp.int32)
    return seq_lo, seq_hi


def _attend(q, kv_cache, kv_lens, pages_flat, cu_q_lens, num_seqs, layer, sinks, keys_ahead, *, bq, npb,
            pages_per_seq, sm_scale, sliding_window, soft_cap, interpret, vmem_limit_bytes):
    t, n, h = q.shape
    _, page_size, two_k, _ = kv_cache.shape[-4:]
    k_heads = two_k // rows_per_kv_head(kv_cache)
    groups = n // k_heads
    t_pad = _next_multiple(t, bq)
    if t_pad != t:
        q = jnp.pad(q, ((0, t_pad - t), (0, 0), (0, 0)))
    num_q_blocks = t_pad // bq
    seq_lo, seq_hi = _block_seq_ranges(cu_q_lens, num_seqs[0], num_q_blocks, bq)
    rows = bq * groups

    kernel = functools.partial(
        _rpa_kernel,
        sm_scale=float(sm_scale),
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        pages_per_seq=pages_per_seq,
        hardware=interpret is False or interpret is None,
        has_sinks=sinks is not None,
        has_ahead=keys_ahead is not None,
    )
    if keys_ahead is None:
        blk_ahead, ahead_in, ahead_spec = jnp.zeros((num_q_blocks,), jnp.int32), (), []
    else:
        ahead = jnp.pad(keys_ahead.astype(jnp.int32), (0, t_pad - t))
        blk_ahead = jnp.max(ahead.reshape(num_q_blocks, bq), axis=1)
        # One entry per row of the kernel's products (token i, group member g: i * G + g).
        ahead_in = (jnp.repeat(ahead, groups).reshape(t_pad * groups, 1),)
        ahead_spec = [pl.BlockSpec((rows, 1), lambda i, *_: (i, 0))]
    sinks = jnp.zeros((1,), jnp.float32) if sinks is None else jnp.asarray(sinks, jnp.float32).reshape(n)
    q_spec = pl.BlockSpec((bq, n, h), lambda i, *_: (i, 0, 0))
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=9,
            grid=(num_q_blocks,),
            in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY)] + ahead_spec,
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((2, npb, page_size, two_k, h), kv_cache.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((k_heads, rows, _LANES), jnp.float32),
                pltpu.VMEM((k_heads, rows, _LANES), jnp.float32),
                pltpu.VMEM((bq, n, h), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((t_pad, n, h), q.dtype),
        compiler_params=pltpu.CompilerParams(
            # Programs share no state (each primes its own pipeline): megacore may split them.
            dimension_semantics=("parallel",),
            vmem_limit_bytes=vmem_limit_bytes,
        ),
        interpret=interpret,
        name=f"ragged_paged_attention_bq{bq}_p{npb}",
    )(kv_lens, pages_flat, cu_q_lens, num_seqs, seq_lo, seq_hi, layer, sinks, blk_ahead, q, kv_cache, *ahead_in)
    return out[:t]


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale", "sliding_window", "soft_cap", "interpret",
        "num_queries_per_block", "num_kv_pages_per_block", "vmem_limit_bytes",
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
    interpret=False,
    num_queries_per_block: int | None = None,
    num_kv_pages_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
    layer=None,
    sinks=None,
    keys_ahead=None,
):
    """Mosaic TPU ragged paged attention; same arguments and result as the reference.

    q: [T, N, H]; kv_cache: [P, S, 2K, H]; kv_lens: [R] int32; page_indices: [R, Pmax]
    int32; cu_q_lens: [R+1] int32; num_seqs: int32 scalar or [1]. Returns o: [T, N, H].
    ``interpret``: False (hardware), True (legacy interpreter) or
    ``pltpu.InterpretParams()``. ``num_queries_per_block`` forces one query block size
    (no decode/prefill dispatch); ``num_kv_pages_per_block`` overrides the kv block.
    ``layer`` (int32 scalar): ``kv_cache`` is the stacked [L, P, S, 2K, H] cache of a
    layer scan and pages are fetched from ``kv_cache[layer]`` in place (passing the
    slice ``kv_cache[layer]`` instead would copy the layer's whole cache every step).
    ``sinks`` [N] float32: attention sinks (SMEM scalars, applied at the end;
    reference.sink_factor). ``keys_ahead`` [T] int32: the reference's (Gemma 3's images).
    """
    validate_inputs(q, kv_cache, kv_lens, page_indices, cu_q_lens, sliding_window=sliding_window, soft_cap=soft_cap)
    layer = layer_index(kv_cache, layer)
    t, n, h = q.shape
    _, page_size, two_k, _ = kv_cache.shape[-4:]
    k_heads = two_k // rows_per_kv_head(kv_cache)
    groups = n // k_heads
    r, pages_per_seq = page_indices.shape
    num_seqs = jnp.clip(jnp.reshape(num_seqs, (-1,))[:1].astype(jnp.int32), 0, r)
    pages_flat = page_indices.reshape(-1)
    page_bytes = page_size * two_k * h * jnp.dtype(kv_cache.dtype).itemsize
    npb = num_kv_pages_per_block or kv_pages_per_block(page_size, pages_per_seq, page_bytes)
    npb = min(npb, pages_per_seq)

    def run(bq):
        if vmem_limit_bytes is None:
            rows = bq * groups
            need = (
                2 * npb * page_bytes  # kv double buffer
                + 4 * bq * n * h * jnp.dtype(q.dtype).itemsize  # q and o blocks, double-buffered
                + 4 * k_heads * rows * (2 * _LANES + h)  # m, l, acc
                + 8 * rows * npb * page_size * 4  # scores and probabilities
            )
            limit = min(max(32 * 2**20, 2 * need), 64 * 2**20)
        else:
            limit = vmem_limit_bytes
        return _attend(
            q, kv_cache, kv_lens, pages_flat, cu_q_lens, num_seqs, layer, sinks, keys_ahead, bq=bq, npb=npb,
            pages_per_seq=pages_per_seq, sm_scale=sm_scale, sliding_window=sliding_window,
            soft_cap=soft_cap, interpret=interpret, vmem_limit_bytes=limit,
        )

    if num_queries_per_block is not None:
        return run(num_queries_per_block)
    bq_prefill = prefill_block_size(t, groups)
    bq_decode = min(_DECODE_BLOCK, bq_prefill)
    if bq_decode == bq_prefill:
        return run(bq_prefill)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    max_q_len = jnp.max(jnp.where(jnp.arange(r) < num_seqs[0], q_lens, 0))
    return lax.cond(max_q_len <= 1, lambda: run(bq_decode), lambda: run(bq_prefill))
