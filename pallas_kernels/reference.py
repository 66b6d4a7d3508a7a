"""Plain-jnp ragged paged attention: the CPU default and the oracle for every kernel.

Shapes (DESIGN §4): T tokens, N query heads, K kv heads, H head dim, R requests,
P pages, S page size, Pmax pages per request.

KV cache layout, per layer: ``kv_cache[P, S, 2K, H]`` with K and V interleaved on
axis 2 (row 2h is K of kv head h, row 2h+1 its V). Page 0 is the null page: padded
tokens write there and nothing valid reads it.

The loop over pages has a *dynamic* trip count (the longest kv_len in the step), so
the cost follows the real context length while the compiled shape stays fixed: a
decode step over short sequences does not pay for ``max_model_len``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.inputs import to_cache_dtype

# Pages gathered per loop iteration, at most: enough work per iteration to hide the
# loop overhead on CPU, small enough that a short context does not waste much.
_PAGES_PER_CHUNK = 8
# ...and, for decode batches, fewer when the whole batch's gathered pages would outgrow
# the CPU caches. On
# the 2-core CI VM (SmolLM2 heads, decode of 64 requests, 192-token context) one layer
# took 7.4 ms with 8 pages per iteration (12.6 MB gathered), 3.4 ms with 2 (3.1 MB),
# 5.6 ms with 1; a single request was fastest with 8.
_CHUNK_BYTES = 4 << 20


def pages_per_chunk(num_blocks: int, page_size: int, two_k: int, head_dim: int, pmax: int) -> int:
    """Largest power of two <= _PAGES_PER_CHUNK (and pmax) whose gather, for all
    ``num_blocks`` query blocks at once, stays within _CHUNK_BYTES (at least 1)."""
    per_page = num_blocks * page_size * two_k * head_dim * 4  # gathered as f32
    chunk = 1
    while chunk * 2 <= min(_PAGES_PER_CHUNK, pmax) and chunk * 2 * per_page <= _CHUNK_BYTES:
        chunk *= 2
    return chunk
# Queries per block in batches with more tokens than requests (see ragged_paged_attention).
_Q_BLOCK = 16


def write_kv_cache(kv_cache, k, v, slot_mapping, *, layer=None):
    """Write new tokens' K/V into the paged cache (one scatter).

    kv_cache: [P, S, 2K, H], or [L, P, S, 2K, H] with ``layer`` (a scalar index) for
    caches stacked over layers (written in place inside a layer scan, no slice copy);
    k, v: [T, K, H]; slot_mapping: [T] int32 (slot = page * S + offset; padded tokens
    point into the null page 0). Returns the updated cache (in place when donated).
    """
    page_size, two_k, head_dim = kv_cache.shape[-3:]
    t = k.shape[0]
    new = to_cache_dtype(jnp.stack([k, v], axis=2).reshape(t, two_k, head_dim), kv_cache.dtype)
    pages = slot_mapping // page_size
    offsets = slot_mapping % page_size
    if layer is not None:
        return kv_cache.at[layer, pages, offsets].set(new, mode="drop")
    return kv_cache.at[pages, offsets].set(new, mode="drop")


def token_request_index(cu_q_lens, num_seqs, num_tokens):
    """Request index of every token: [T] int32 (padded tokens get num_seqs)."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    r = cu_q_lens.shape[0] - 1
    # Rows past num_seqs are masked to "infinitely far" so padded tokens map past them.
    ends = jnp.where(jnp.arange(r) < num_seqs, cu_q_lens[1:], jnp.iinfo(jnp.int32).max)
    idx = jnp.searchsorted(ends, t, side="right").astype(jnp.int32)
    valid = t < cu_q_lens[num_seqs]
    return jnp.where(valid, idx, num_seqs)


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
    layer=None,
):
    """Causal attention of a ragged batch of queries against a paged KV cache.

    q: [T, N, H]; kv_cache: [P, S, 2K, H]; kv_lens: [R] int32 (tokens in the
    cache for each request, including this step's); page_indices: [R, Pmax] int32;
    cu_q_lens: [R+1] int32 (query offsets into T); num_seqs: int32 scalar (valid
    rows of kv_lens / page_indices). Token i of request r sits at position
    ``kv_lens[r] - q_len[r] + i`` and sees keys at positions <= its own.
    With ``layer`` given, kv_cache is [L, P, S, 2K, H] and layer ``layer`` is read
    (pages are gathered straight from the stacked cache, no per-layer slice copy).
    Returns o: [T, N, H] in q's dtype; padded tokens get zeros.
    """
    t, n, h = q.shape
    page_size, two_k, _ = kv_cache.shape[-3:]
    k_heads = two_k // 2
    groups = n // k_heads
    r, pmax = page_indices.shape

    req = token_request_index(cu_q_lens, num_seqs, t)  # [T]
    valid_tok = req < num_seqs
    req_c = jnp.minimum(req, r - 1)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    offset = jnp.arange(t) - cu_q_lens[req_c]  # index of the token within its request
    tok_pos = jnp.where(valid_tok, kv_lens[req_c] - q_lens[req_c] + offset, -1).astype(jnp.int32)

    # Query blocks: consecutive tokens of one request share one gather of that
    # request's pages. Decode-sized batches use blocks of 1 (one token per request
    # anyway); larger ones blocks of _Q_BLOCK, so a prefill does not gather its
    # context once per token. At most one partial block per request: nb is static.
    bq = 1 if t <= r else _Q_BLOCK
    nb = t if bq == 1 else t // bq + r
    if bq == 1:
        tok_idx = jnp.arange(t)[:, None]  # [NB, 1]
        blk_req = req_c
    else:
        row_valid = jnp.arange(r) < num_seqs
        nblk = jnp.where(row_valid, (q_lens + bq - 1) // bq, 0)
        blk_start = jnp.cumsum(nblk) - nblk
        bid = jnp.where(valid_tok, blk_start[req_c] + offset // bq, nb)  # nb: dropped
        tok_idx = jnp.full((nb, bq), t, jnp.int32).at[bid, offset % bq].set(jnp.arange(t, dtype=jnp.int32),
                                                                           mode="drop")
        blk_req = jnp.zeros((nb,), jnp.int32).at[bid].set(req_c, mode="drop")
    pos_b = jnp.concatenate([tok_pos, jnp.full((1,), -1, jnp.int32)])[tok_idx]  # [NB, Bq]; -1 = no query
    blk_kv_len = jnp.where(pos_b[:, 0] >= 0, kv_lens[blk_req], 0)

    # Decode-shaped batches only: with query blocks of 16 each iteration also rewrites a
    # 16x larger running output, and small chunks made a 2048-token prefill ~2x slower.
    chunk = pages_per_chunk(nb, page_size, two_k, h, pmax) if bq == 1 else min(_PAGES_PER_CHUNK, pmax)
    pad = (-pmax) % chunk
    blk_pages = jnp.pad(page_indices, ((0, 0), (0, pad)))[blk_req]  # [NB, Pmax']
    chunk_tokens = chunk * page_size

    q_pad = jnp.concatenate([q.astype(jnp.float32) * sm_scale, jnp.zeros((1, n, h), jnp.float32)])
    qb = q_pad[tok_idx].reshape(nb, bq, k_heads, groups, h)
    max_len = jnp.max(jnp.where(jnp.arange(r) < num_seqs, kv_lens, 0))
    num_chunks = (max_len + chunk_tokens - 1) // chunk_tokens

    def body(c, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(blk_pages, c * chunk, chunk, axis=1)  # [NB, C]
        kv = (kv_cache[pages] if layer is None else kv_cache[layer, pages]).astype(jnp.float32)  # [NB, C, S, 2K, H]
        kv = kv.reshape(nb, chunk_tokens, k_heads, 2, h)
        keys, values = kv[..., 0, :], kv[..., 1, :]  # [NB, L, K, H]
        kpos = c * chunk_tokens + jnp.arange(chunk_tokens)  # [L]
        in_ctx = kpos[None, :] < blk_kv_len[:, None]  # [NB, L]
        if sliding_window is not None:
            # Pages behind every query's window may already belong to another request
            # (the scheduler gives them back): never let their contents into a product.
            in_ctx &= kpos[None, :] > pos_b[:, :1] - sliding_window
        # Unused page slots may hold anything (NaN included): zero them before any product.
        keys = jnp.where(in_ctx[:, :, None, None], keys, 0.0)
        values = jnp.where(in_ctx[:, :, None, None], values, 0.0)
        s = jnp.einsum("bqkgh,blkh->bkgql", qb, keys)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask = in_ctx[:, None, :] & (kpos[None, None, :] <= pos_b[:, :, None])  # [NB, Bq, L]
        if sliding_window is not None:
            mask &= kpos[None, None, :] > pos_b[:, :, None] - sliding_window
        mask = mask[:, None, None, :, :]  # [NB, 1, 1, Bq, L]
        s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
        alpha = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
        l_new = alpha * l + jnp.sum(p, axis=-1)
        acc_new = alpha[..., None] * acc + jnp.einsum("bkgql,blkh->bkgqh", p, values)
        return m_new, l_new, acc_new

    init = (
        jnp.full((nb, k_heads, groups, bq), -jnp.inf, jnp.float32),
        jnp.zeros((nb, k_heads, groups, bq), jnp.float32),
        jnp.zeros((nb, k_heads, groups, bq, h), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, num_chunks, body, init)
    out_b = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)  # [NB, K, G, Bq, H]
    out_b = out_b.transpose(0, 3, 1, 2, 4).reshape(nb * bq, n, h)
    out = jnp.zeros((t + 1, n, h), jnp.float32).at[tok_idx.reshape(-1)].set(out_b, mode="drop")[:t]
    return out.reshape(t, n, h).astype(q.dtype)
