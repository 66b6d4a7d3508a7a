"""Plain-jnp ragged paged attention: the CPU default and the oracle for every kernel.

Shapes (docs/design.md §4): T tokens, N query heads, K kv heads, H head dim, R requests,
P pages, S page size, Pmax pages per request.

KV cache layout, per layer: ``kv_cache[P, S, 2K, H]`` with K and V interleaved on
axis 2 (row 2h is K of kv head h, row 2h+1 its V). Multi-head Latent Attention
(DeepSeek) keeps one row per token, ``[P, S, 1, H]``: the key and the value are that
row (inputs.rows_per_kv_head). Page 0 is the null page: padded tokens write there and
nothing valid reads it.

In steps of at least _SPLIT_TOKENS tokens (prefill-sized), each query's keys fall in
two parts, attended separately and merged by their log-sum-exp (vLLM's
``merge_attn_states``, as in its cascade attention):

- **this step's tokens** (positions >= kv_len - q_len of the request): the step's T
  tokens are cut into tiles of consecutive tokens, and tile i attends to tiles i, i-1,
  ... back to the tile where its first token's request starts. One gather of T cache
  rows serves every query; no page is gathered once per query block. A fresh prefill
  is only this part.
- **the cached prefix** (positions < kv_len - q_len): queries in blocks of one
  request's consecutive tokens, each block gathering its request's pages chunk by
  chunk. Blocks without a prefix (fresh prefills) are sorted last and skipped, so the
  cost follows the blocks that have one: decode rows, continued chunks, prefix hits.

Smaller steps make one pass of the second kind over every key up to each query's own
position: it compiles in a quarter of the time, and there the split gains little.
Decode-sized steps (no more tokens than rows) walk a flat list of (token, page) pairs
instead: each iteration gathers a fixed number of pairs whoever they belong to, so no
page slot is padded out to a group's longest request (see _attend_pairs).

Every loop has a *dynamic* trip count (the longest run of tiles, the longest prefix in a
group of blocks), so the cost follows the real lengths while the compiled shape stays
fixed: a decode step over short sequences does not pay for ``max_model_len``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.inputs import new_cache_rows, rows_per_kv_head, to_cache_dtype
from pallas_kernels.storage import from_bf16_bits

# Prefix part: pages gathered per loop iteration, at most: enough work per iteration to
# hide the loop overhead on CPU, small enough that a short context does not waste much.
_PAGES_PER_CHUNK = 8
# ...and fewer when a group's gathered pages would outgrow the CPU caches. On the 2-core
# CI VM (SmolLM2 heads, decode of 64 requests, 192-token context) one layer took 7.4 ms
# with 8 pages per iteration (12.6 MB gathered), 3.4 ms with 2 (3.1 MB), 5.6 ms with 1;
# a single request was fastest with 8.
_CHUNK_BYTES = 4 << 20
# Prefix part: queries per block in batches with more tokens than requests (decode-sized
# batches use blocks of one token), and blocks per group.
_Q_BLOCK = 16
_GROUP_BLOCKS = 8
# Decode-sized steps: (token, page) pairs gathered per loop iteration, at most, and
# fewer when their pages would outgrow _PAIR_BYTES. SmolLM2 heads on the CI VM (30
# layers, 64 requests of 40-320 tokens): 157-160 ms with 64 pairs, 172-183 with 16-32,
# 175-206 with 128, against 203-206 ms for blocks of one token (_attend_paged); 8
# requests: 28-30 ms with 32 pairs, 41-45 with 64, against 39.
_PAIRS_PER_CHUNK = 64
_PAIR_BYTES = 2 << 20
# Steps of at least this many tokens, and more tokens than rows, attend in two parts.
_SPLIT_TOKENS = 512
# This step's tokens: tokens per tile, and tiles per group.
_TILE = 32
_GROUP_TILES = 16


def pairs_per_chunk(num_tokens: int, page_size: int, two_k: int, head_dim: int) -> int:
    """(token, page) pairs per iteration of the decode-sized path: the largest power of
    two <= _PAIRS_PER_CHUNK and <= 4 pairs per token whose pages, gathered as f32,
    stay within _PAIR_BYTES (at least 1)."""
    return _pow2_within(min(_PAIRS_PER_CHUNK, 4 * num_tokens), page_size * two_k * head_dim * 4, _PAIR_BYTES)


def _pow2_within(cap: int, item_bytes: int, budget: int) -> int:
    """The largest power of two <= cap whose items (``item_bytes`` each) fit ``budget``; at least 1."""
    chunk = 1
    while chunk * 2 <= cap and chunk * 2 * item_bytes <= budget:
        chunk *= 2
    return chunk


def pages_per_chunk(num_blocks: int, page_size: int, two_k: int, head_dim: int, pmax: int) -> int:
    """Largest power of two <= _PAGES_PER_CHUNK (and pmax) whose gather, for all
    ``num_blocks`` query blocks at once, stays within _CHUNK_BYTES (at least 1)."""
    per_page = num_blocks * page_size * two_k * head_dim * 4  # gathered as f32
    return _pow2_within(min(_PAGES_PER_CHUNK, pmax), per_page, _CHUNK_BYTES)


def write_kv_cache(kv_cache, k, v, slot_mapping, *, layer=None):
    """Write new tokens' K/V into the paged cache (one scatter).

    kv_cache: [P, S, 2K, H], or [L, P, S, 2K, H] with ``layer`` (a scalar index) for
    caches stacked over layers (written in place inside a layer scan, no slice copy);
    k, v: [T, K, H] (the latent layout [.., S, 1, H]: k [T, 1, H] and v None,
    inputs.rows_per_kv_head); slot_mapping: [T] int32 (slot = page * S + offset; padded
    tokens point into the null page 0). Returns the updated cache (in place when donated).
    """
    page_size = kv_cache.shape[-3]
    new = to_cache_dtype(new_cache_rows(k, v), kv_cache.dtype)
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
    sinks=None,
    keys_ahead=None,
):
    """Causal attention of a ragged batch of queries against a paged KV cache.

    q: [T, N, H]; kv_cache: [P, S, 2K, H]; kv_lens: [R] int32 (tokens in the
    cache for each request, including this step's); page_indices: [R, Pmax] int32;
    cu_q_lens: [R+1] int32 (query offsets into T); num_seqs: int32 scalar (valid
    rows of kv_lens / page_indices). Token i of request r sits at position
    ``kv_lens[r] - q_len[r] + i`` and sees keys at positions <= its own.
    With ``layer`` given, kv_cache is [L, P, S, 2K, H] and layer ``layer`` is read
    (pages are gathered straight from the stacked cache, no per-layer slice copy).
    ``sinks`` [N] float32 (GPT-OSS's attention sinks): one learned logit per query head
    that joins every softmax's denominator and attends to nothing (``sink_factor``).
    ``keys_ahead`` [T] int32 (Gemma 3's images): token t also sees the next
    keys_ahead[t] positions of its request, which this step writes; a sliding window
    still starts from the token's own position.
    Returns o: [T, N, H] in q's dtype; padded tokens get zeros.
    """
    t, n, h = q.shape
    k_heads = kv_cache.shape[-2] // rows_per_kv_head(kv_cache)
    r = page_indices.shape[0]

    req = token_request_index(cu_q_lens, num_seqs, t)  # [T]
    valid_tok = req < num_seqs
    req_c = jnp.minimum(req, r - 1)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    prefix_lens = jnp.where(jnp.arange(r) < num_seqs, kv_lens - q_lens, 0)  # keys cached before this step
    offset = jnp.arange(t) - cu_q_lens[req_c]  # index of the token within its request
    tok_pos = jnp.where(valid_tok, prefix_lens[req_c] + offset, -1).astype(jnp.int32)
    # The last key each token sees (its own position unless keys_ahead).
    tok_hi = None if keys_ahead is None else jnp.where(valid_tok, tok_pos + keys_ahead, -1).astype(jnp.int32)
    qs = (q.astype(jnp.float32) * sm_scale).reshape(t, k_heads, n // k_heads, h)

    kw = dict(sliding_window=sliding_window, soft_cap=soft_cap, layer=layer)
    sinks = None if sinks is None else jnp.asarray(sinks, jnp.float32).reshape(k_heads, n // k_heads)
    if t <= r:
        # Decode-sized steps: every query against its pages, one (token, page) pair at a time.
        m, l, acc = _attend_pairs(qs, kv_cache, page_indices, req_c, valid_tok, tok_pos, tok_hi=tok_hi, **kw)
        return _finish(m, l, acc, sinks).reshape(t, n, h).astype(q.dtype)
    if t < _SPLIT_TOKENS:
        # Smaller steps: one pass over the pages, every query up to its own position, in
        # blocks of _Q_BLOCK. Splitting off this step's tokens pays for prefill-sized
        # steps; one pass compiles in about a quarter of the time (1.0-1.4 against 4.2 s
        # per program on the CI VM).
        m, l, acc = _attend_paged(qs, kv_cache, page_indices, cu_q_lens, num_seqs, prefix_lens, req_c, valid_tok,
                                  tok_pos, bq=_Q_BLOCK, through_own=True, tok_hi=tok_hi, **kw)
        return _finish(m, l, acc, sinks).reshape(t, n, h).astype(q.dtype)

    m1, l1, acc1 = _attend_step_tokens(qs, kv_cache, page_indices, cu_q_lens, req, req_c, valid_tok, tok_pos,
                                       tok_hi=tok_hi, **kw)
    # The prefix part in two passes: requests with a few queries (decode rows) in blocks
    # of one token, longer ones (continued chunks, prefix hits) in blocks of _Q_BLOCK so
    # that their pages are not gathered once per token. Every token is in one pass.
    short = q_lens[req_c] < _Q_BLOCK
    m2, l2, acc2 = _attend_paged(qs, kv_cache, page_indices, cu_q_lens, num_seqs, prefix_lens, req_c,
                                 valid_tok & short, tok_pos, bq=1, **kw)
    long = _attend_paged(qs, kv_cache, page_indices, cu_q_lens, num_seqs, prefix_lens, req_c, valid_tok & ~short,
                         tok_pos, bq=_Q_BLOCK, **kw)
    m2, l2, acc2 = (jnp.where(jnp.reshape(short, (t,) + (1,) * (a.ndim - 1)), a, b) for a, b in zip((m2, l2, acc2), long))
    # Merge the two parts by their running maxima (vLLM's merge_attn_states).
    m = jnp.maximum(m1, m2)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    a1 = jnp.where(jnp.isfinite(m1), jnp.exp(m1 - m_safe), 0.0)
    a2 = jnp.where(jnp.isfinite(m2), jnp.exp(m2 - m_safe), 0.0)
    acc = _finish(m_safe, a1 * l1 + a2 * l2, a1[..., None] * acc1 + a2[..., None] * acc2, sinks)
    return acc.reshape(t, n, h).astype(q.dtype)


def sink_factor(m, l, sinks):
    """What attention sinks [K, G] (or [N]: broadcast as m's last axes) do to a softmax's
    normalised output: with running max m and sum l ([..., K, G]), the sink adds
    exp(sink - m) to l, so o = acc / l scales by l / (l + exp(sink - m)) =
    1 / (1 + exp(sink - lse)), lse = m + log l; 0 where nothing was attended (l = 0)."""
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    return 1.0 / (1.0 + jnp.exp(sinks - lse))


def _finish(m, l, acc, sinks):
    """The output [..., K, G, H] of a softmax state: acc / l, scaled by the sinks if any."""
    o = _normalize(l, acc)
    return o if sinks is None else o * sink_factor(m, l, sinks)[..., None]


def _normalize(l, acc):
    """Softmax-weighted sums acc [..., H] / their weights l [...]; 0 where nothing was attended."""
    return jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)


def _read_kv(kv_cache, layer, pages, offsets=None, keep_bf16=False):
    """Cache rows as f32 (``keep_bf16``: a bf16 cache's as bf16), straight from the
    (stacked) cache: whole pages [..., S, 2K, H], or single slots [..., 2K, H] with ``offsets``."""
    idx = (pages,) if offsets is None else (pages, offsets)
    rows = kv_cache[idx] if layer is None else kv_cache[(layer, *idx)]
    rows = from_bf16_bits(rows)  # a bf16 cache kept as bit patterns (storage.py)
    return rows if keep_bf16 and rows.dtype == jnp.bfloat16 else rows.astype(jnp.float32)


def _softmax_init(shape, head_dim):
    """Online-softmax state with nothing attended yet: (m = -inf, l = 0) of ``shape``, acc = 0
    of ``shape + (head_dim,)``."""
    return (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape + (head_dim,), jnp.float32))


def _softmax_update(carry, s, mask, attend_values):
    """One online-softmax step. carry (m, l, acc): [..., Q], [..., Q], [..., Q, H];
    s: scores [..., Q, L] (ignored where ~mask); attend_values(p) -> [..., Q, H]."""
    m, l, acc = carry
    s = jnp.where(mask, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
    alpha = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
    return m_new, alpha * l + jnp.sum(p, axis=-1), alpha[..., None] * acc + attend_values(p)


def _per_token(x, num_tokens):
    """[B, K, G, Q, ...] (blocks of Q consecutive tokens) -> [B*Q, K, G, ...][:num_tokens]."""
    x = jnp.moveaxis(x, 3, 1)
    return x.reshape((-1,) + x.shape[2:])[:num_tokens]


def _attend_step_tokens(qs, kv_cache, page_indices, cu_q_lens, req, req_c, valid_tok, tok_pos, *, sliding_window,
                        soft_cap, layer, tok_hi=None):
    """Attention of every query to the keys its request wrote in this step, up to its
    own position (``tok_hi``: up to that position, which may lie ahead: then the tiles
    after its own are read too). qs: [T, K, G, H] (scaled). Returns per token (m, l, acc):
    [T, K, G], [T, K, G], [T, K, G, H]."""
    t, k_heads, groups, h = qs.shape
    page_size = kv_cache.shape[-3]
    # Every token's own K/V, read back from the cache (so an 8-bit cache rounds them as
    # the prefix part sees them): one gather of T rows.
    pos0 = jnp.maximum(tok_pos, 0)
    pages = jnp.where(valid_tok, page_indices[req_c, pos0 // page_size], 0)
    pair = rows_per_kv_head(kv_cache)
    kv = _read_kv(kv_cache, layer, pages, pos0 % page_size).reshape(t, k_heads, pair, h)
    kv = jnp.where(valid_tok[:, None, None, None], kv, 0.0)  # padded tokens' slots may hold NaN

    bt = min(_TILE, t)
    nt = -(-t // bt)

    def tiles(x, fill):
        x = jnp.pad(x, ((0, nt * bt - t),) + ((0, 0),) * (x.ndim - 1), constant_values=fill)
        return x.reshape((nt, bt) + x.shape[1:])

    # Tiles first: [NT, K, G*Bt, H] queries, [NT, K, Bt, H] keys, [NT, K, H, Bt] values;
    # one more tile of padding (index nt) that matches no query and no key.
    q_t = jnp.moveaxis(tiles(qs, 0.0), 1, 3).reshape(nt, k_heads, groups * bt, h)
    k_t = jnp.moveaxis(tiles(kv[:, :, 0], 0.0), 1, 2)
    v_t = jnp.moveaxis(tiles(kv[:, :, pair - 1], 0.0), 1, 3)
    k_t, v_t = (jnp.concatenate([x, jnp.zeros_like(x[:1])]) for x in (k_t, v_t))
    pos_t = tiles(tok_pos, -1)  # [NT, Bt]
    hi_t = pos_t if tok_hi is None else tiles(tok_hi, -1)
    qreq_t = tiles(jnp.where(valid_tok, req, -1), -1)
    kreq_t = jnp.concatenate([tiles(jnp.where(valid_tok, req, -2), -2), jnp.full((1, bt), -2, jnp.int32)])
    # Tile i reaches back to the tile where its first token's request starts (and no
    # further than a sliding window looks).
    tile_ids = jnp.arange(nt)
    reach = tile_ids - cu_q_lens[req_c[tile_ids * bt]] // bt + 1
    if sliding_window is not None:
        reach = jnp.minimum(reach, (sliding_window + bt - 2) // bt + 1)
    reach = jnp.where(qreq_t[:, 0] >= 0, reach, 0)
    # ...and forward to the tile of the last key one of its tokens sees (keys_ahead): tile
    # i reads tiles i + ahead, ..., i - reach + 1, each once.
    if tok_hi is None:
        ahead = jnp.zeros_like(reach)
    else:
        last_key = jnp.where(valid_tok, jnp.arange(t) + tok_hi - tok_pos, -1)  # its token index
        ahead = jnp.clip(jnp.max(tiles(last_key, -1), axis=1) // bt - tile_ids, 0, nt - 1 - tile_ids)
        reach = jnp.where(reach > 0, reach + ahead, 0)

    # Tiles by reach, longest first, in groups of gt: each group loops to its own reach,
    # and the group loop ends with the last group that has a query.
    gt = min(nt, _GROUP_TILES)
    ng = -(-nt // gt)
    order = jnp.pad(jnp.argsort(-reach, stable=True), (0, ng * gt - nt), constant_values=nt)
    reach = jnp.concatenate([reach, jnp.zeros((1,), reach.dtype)])
    ahead = jnp.concatenate([ahead, jnp.zeros((1,), ahead.dtype)])
    num_groups = (jnp.sum(reach > 0) + gt - 1) // gt

    def group(g, out):
        tid = jax.lax.dynamic_slice_in_dim(order, g * gt, gt)  # [Gt]
        q_pos = pos_t.at[tid].get(mode="fill", fill_value=-1)  # [Gt, Bt]
        q_hi = hi_t.at[tid].get(mode="fill", fill_value=-1)
        q_req = qreq_t.at[tid].get(mode="fill", fill_value=-1)
        qg = q_t.at[tid].get(mode="fill", fill_value=0.0)
        g_ahead = ahead[tid]

        def body(j, carry):
            src = tid + g_ahead - j
            src = jnp.where(src >= 0, src, nt)  # the key tile each query tile reads
            kpos = pos_t.at[src].get(mode="fill", fill_value=-1)[:, None, :]
            mask = (q_req[:, :, None] == kreq_t[src][:, None, :]) & (kpos <= q_hi[:, :, None])
            if sliding_window is not None:
                mask &= kpos > q_pos[:, :, None] - sliding_window
            s = jnp.einsum("ikqh,iklh->ikql", qg, k_t[src])  # [Gt, K, G*Bt, Bt]
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            values = v_t[src]  # [Gt, K, H, Bt]
            mask = jnp.broadcast_to(mask[:, None, None], (gt, 1, groups, bt, bt)).reshape(gt, 1, groups * bt, bt)
            return _softmax_update(carry, s, mask, lambda p: jnp.einsum("ikql,ikhl->ikqh", p, values))

        res = jax.lax.fori_loop(0, jnp.max(reach[tid]), body, _softmax_init((gt, k_heads, groups * bt), h))
        return tuple(o.at[tid].set(x, mode="drop") for o, x in zip(out, res))

    m, l, acc = jax.lax.fori_loop(0, num_groups, group, _softmax_init((nt, k_heads, groups * bt), h))
    unfold = lambda x: x.reshape((nt, k_heads, groups, bt) + x.shape[3:])
    return _per_token(unfold(m), t), _per_token(unfold(l), t), _per_token(unfold(acc), t)


def _attend_paged(qs, kv_cache, page_indices, cu_q_lens, num_seqs, prefix_lens, req_c, selected, tok_pos, *, bq,
                  sliding_window, soft_cap, layer, through_own=False, tok_hi=None):
    """Attention of the ``selected`` queries to their requests' keys cached before this
    step (``through_own``: up to each query's own position, this step's keys included),
    page by page, in blocks of ``bq`` consecutive tokens of one request (every token of a
    selected request must be selected; ``tok_hi`` with through_own: up to that position).
    Returns per token (m, l, acc) as
    _attend_step_tokens (m = -inf and l = 0 for a query with nothing to attend or not
    selected)."""
    t, k_heads, groups, h = qs.shape
    page_size = kv_cache.shape[-3]
    r, pmax = page_indices.shape
    offset = jnp.arange(t) - cu_q_lens[req_c]

    # Query blocks: consecutive tokens of one request share one gather of that request's
    # pages. At most one partial block per request: nb is static.
    nb = t if bq == 1 else t // bq + r
    if bq == 1:
        tok_idx = jnp.arange(t)[:, None]  # [NB, 1]
        blk_req = req_c
    else:
        q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
        nblk = jnp.where(jnp.arange(r) < num_seqs, (q_lens + bq - 1) // bq, 0)
        blk_start = jnp.cumsum(nblk) - nblk
        bid = jnp.where(selected, blk_start[req_c] + offset // bq, nb)  # nb: dropped
        tok_idx = jnp.full((nb, bq), t, jnp.int32).at[bid, offset % bq].set(jnp.arange(t, dtype=jnp.int32),
                                                                           mode="drop")
        blk_req = jnp.zeros((nb,), jnp.int32).at[bid].set(req_c, mode="drop")
    tok_pos = jnp.where(selected, tok_pos, -1)
    pos_b = jnp.concatenate([tok_pos, jnp.full((1,), -1, jnp.int32)])[tok_idx]  # [NB, Bq]; -1 = no query
    hi_b = pos_b if tok_hi is None else jnp.concatenate([jnp.where(selected, tok_hi, -1),
                                                         jnp.full((1,), -1, jnp.int32)])[tok_idx]
    # Keys each block reads: positions < its bound.
    bound = jnp.max(hi_b, axis=1) + 1 if through_own else prefix_lens[blk_req]
    blk_bound = jnp.where(pos_b[:, 0] >= 0, bound, 0)

    # Blocks by bound, longest first, in groups of gb: each group's page loop
    # stops at its own longest (not the batch's), and the group loop ends with the
    # last group that reads a key at all. Padding blocks read none and have no tokens
    # (token index t: dropped).
    gb = min(nb, _GROUP_BLOCKS)
    ng = -(-nb // gb)
    order = jnp.argsort(-blk_bound, stable=True)
    pad = lambda x, fill: jnp.pad(x[order], ((0, ng * gb - nb),) + ((0, 0),) * (x.ndim - 1), constant_values=fill)
    tok_idx, pos_b, hi_b = pad(tok_idx, t), pad(pos_b, -1), pad(hi_b, -1)
    blk_bound, blk_req = pad(blk_bound, 0), pad(blk_req, 0)
    num_groups = (jnp.sum(blk_bound > 0) + gb - 1) // gb

    chunk = pages_per_chunk(gb, page_size, kv_cache.shape[-2], h, pmax)
    pair = rows_per_kv_head(kv_cache)
    page_tab = jnp.pad(page_indices, ((0, 0), (0, (-pmax) % chunk)))
    chunk_tokens = chunk * page_size
    q_pad = jnp.concatenate([qs, jnp.zeros((1, k_heads, groups, h), jnp.float32)])

    def group(g, out):
        take = lambda x: jax.lax.dynamic_slice_in_dim(x, g * gb, gb, axis=0)
        g_tok, g_pos, g_hi, g_bound = take(tok_idx), take(pos_b), take(hi_b), take(blk_bound)
        g_pages = page_tab[take(blk_req)]  # [Gb, Pmax']
        qb = q_pad[g_tok]  # [Gb, Bq, K, G, H]

        def body(c, carry):
            pages = jax.lax.dynamic_slice_in_dim(g_pages, c * chunk, chunk, axis=1)  # [Gb, C]
            kv = _read_kv(kv_cache, layer, pages).reshape(gb, chunk_tokens, k_heads, pair, h)
            kpos = c * chunk_tokens + jnp.arange(chunk_tokens)  # [L]
            in_ctx = kpos[None, :] < g_bound[:, None]  # [Gb, L]
            if sliding_window is not None:
                # Pages behind every query's window may already belong to another request
                # (the scheduler gives them back): never let their contents into a product.
                in_ctx &= kpos[None, :] > g_pos[:, :1] - sliding_window
            # Unused page slots may hold anything (NaN included): zero them before any product.
            kv = jnp.where(in_ctx[:, :, None, None, None], kv, 0.0)
            keys, values = kv[..., 0, :], kv[..., pair - 1, :]  # [Gb, L, K, H] (one row when latent)
            s = jnp.einsum("bqkgh,blkh->bkgql", qb, keys)
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            if through_own:
                mask = in_ctx[:, None, :] & (kpos[None, None, :] <= g_hi[:, :, None])
            else:  # every prefix key precedes every query
                mask = jnp.broadcast_to(in_ctx[:, None, :], g_pos.shape + in_ctx.shape[-1:])
            if sliding_window is not None:
                mask = mask & (kpos[None, None, :] > g_pos[:, :, None] - sliding_window)
            return _softmax_update(carry, s, mask[:, None, None],
                                   lambda p: jnp.einsum("bkgql,blkh->bkgqh", p, values))

        num_chunks = (jnp.max(g_bound) + chunk_tokens - 1) // chunk_tokens
        res = jax.lax.fori_loop(0, num_chunks, body, _softmax_init((gb, k_heads, groups, bq), h))
        idx = g_tok.reshape(-1)
        return tuple(o.at[idx].set(_per_token(x, gb * bq), mode="drop") for o, x in zip(out, res))

    return jax.lax.fori_loop(0, num_groups, group, _softmax_init((t, k_heads, groups), h))


def _attend_pairs(qs, kv_cache, page_indices, req_c, valid_tok, tok_pos, *, sliding_window, soft_cap, layer,
                  tok_hi=None):
    """Attention of every query to its request's keys up to its own position, over a flat
    list of (token, page) pairs: token i reads the pages from its window's first to the
    one holding its own position. Each loop iteration gathers the next ``chunk`` pairs,
    computes each pair's softmax over its page, and merges those into the tokens' running
    (m, l, acc) with scatter-max / scatter-add (a token's pairs may span iterations). The
    trip count is the live pairs over ``chunk``: the gathered pages are the live ones, to
    within the last iteration (``tok_hi``: to the page holding that position). Returns per
    token (m, l, acc) as _attend_step_tokens."""
    t, k_heads, groups, h = qs.shape
    page_size = kv_cache.shape[-3]
    r, pmax = page_indices.shape
    chunk = pairs_per_chunk(t, page_size, kv_cache.shape[-2], h)
    pair = rows_per_kv_head(kv_cache)

    hi = tok_pos if tok_hi is None else tok_hi
    last = jnp.maximum(hi, 0) // page_size
    first = jnp.zeros_like(last) if sliding_window is None else jnp.maximum(tok_pos - sliding_window + 1, 0) // page_size
    num_pairs = jnp.where(valid_tok, last - first + 1, 0)  # [T]
    ends = jnp.cumsum(num_pairs)
    total = ends[-1]
    # Pair i belongs to the token whose run of pairs covers i; [T*Pmax + chunk] is static and
    # holds every pair plus one iteration's overrun. Pairs past the total get token t (dropped).
    i = jnp.arange(t * pmax + chunk, dtype=jnp.int32)
    pair_tok = jnp.minimum(jnp.searchsorted(ends, i, side="right"), t - 1).astype(jnp.int32)
    pair_page_no = first[pair_tok] + i - (ends - num_pairs)[pair_tok]  # page number within the request
    live = i < total
    pair_page = jnp.where(live, page_indices[req_c[pair_tok], jnp.clip(pair_page_no, 0, pmax - 1)], 0)
    pair_tok = jnp.where(live, pair_tok, t)
    q_pad = jnp.concatenate([qs, jnp.zeros((1, k_heads, groups, h), jnp.float32)])
    pos_pad = jnp.concatenate([tok_pos, jnp.full((1,), -1, jnp.int32)])
    hi_pad = jnp.concatenate([hi, jnp.full((1,), -1, jnp.int32)])

    def body(c, carry):
        m, l, acc = carry
        take = lambda x: jax.lax.dynamic_slice_in_dim(x, c * chunk, chunk)
        tok, page, page_no = take(pair_tok), take(pair_page), take(pair_page_no)
        # A bf16 cache multiplies in bf16 (q and the probabilities rounded to it, float32
        # accumulation): 5.7 against 6.2 ms per layer widened to f32 (64 decode rows).
        kv = _read_kv(kv_cache, layer, page, keep_bf16=True).reshape(chunk, page_size, k_heads, pair, h)
        kpos = page_no[:, None] * page_size + jnp.arange(page_size)  # [C, S]
        qpos = pos_pad[tok][:, None]
        mask = kpos <= hi_pad[tok][:, None]
        if sliding_window is not None:
            mask &= kpos > qpos - sliding_window
        # Slots past a token's position (or outside its window) may hold anything, NaN
        # included: zero them before any product.
        kv = jnp.where(mask[:, :, None, None, None], kv, jnp.zeros((), kv.dtype))
        s = jnp.einsum("ckgh,cskh->ckgs", q_pad[tok].astype(kv.dtype), kv[..., 0, :],
                       preferred_element_type=jnp.float32)  # [C, K, G, S]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
        # Each pair's softmax over its page...
        m_pair = jnp.max(s, axis=-1)  # [C, K, G]
        m_pair_safe = jnp.where(jnp.isfinite(m_pair), m_pair, 0.0)
        p = jnp.exp(s - m_pair_safe[..., None])
        l_pair = jnp.sum(p, axis=-1)
        acc_pair = jnp.einsum("ckgs,cskh->ckgh", p.astype(kv.dtype), kv[..., pair - 1, :],
                              preferred_element_type=jnp.float32)
        # ...merged into its token's running state.
        m_new = m.at[tok].max(m_pair, mode="drop")
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
        w = jnp.where(jnp.isfinite(m_pair), jnp.exp(m_pair - m_safe.at[tok].get(mode="fill", fill_value=0.0)), 0.0)
        l = (alpha * l).at[tok].add(w * l_pair, mode="drop")
        acc = (alpha[..., None] * acc).at[tok].add(w[..., None] * acc_pair, mode="drop")
        return m_new, l, acc

    return jax.lax.fori_loop(0, (total + chunk - 1) // chunk, body, _softmax_init((t, k_heads, groups), h))
