// Ragged paged attention for the CPU: an XLA FFI custom call (pallas_kernels/cpu.py).
//
// Why native code: decode attention is gathers and small batched products (a few query
// rows per KV head), which XLA:CPU runs at 10-20 GFLOP/s whatever the jnp formulation
// (reference.py). This kernel reads each request's live pages in place (an f32 row is
// used where it lies; narrower ones are widened once per tile into an L1-resident
// buffer) and spreads the work over XLA's intra-op thread pool.
//
// Semantics are reference.ragged_paged_attention's (the oracle, tests/pallas_kernels):
//   q [T, N, H] (f32 or bf16); kv_cache [P, S, 2K, H] or stacked [L, P, S, 2K, H] with
//   K and V interleaved on axis -2 (row 2h: K of kv head h, 2h+1: its V), stored as
//   f32, bf16 (or its uint16 bit patterns) or 8-bit floats (widened through `lut`);
//   kv_lens [R], page_indices [R, Pmax], cu_q_lens [R+1], num_seqs [1], layer [1].
//   Token i of request r sits at kv_lens[r] - q_len[r] + i and sees keys at positions
//   <= its own (and > its own - sliding_window). keys_ahead [T] (when has_ahead; Gemma
//   3's images): token t also sees the next keys_ahead[t] positions past its own, the
//   window still starting from its own. o [T, N, H] in q's dtype; padded tokens get zeros.
//
// Work items: (request, block of up to kMaxQueries consecutive tokens, KV heads): all
// heads, so that an item reads whole slots, or one head each when that leaves too few
// items for the threads. An item's rows are its tokens x the query heads of its KV heads.
// Keys go by tiles of kTile positions aligned to multiples of kTile, each with an
// online-softmax update per row, so a row's result depends only on its own query and
// keys: not on the batch it came in, nor on the item it shares (rows are independent).
// The scores are summed over the head dim in one of two orders, picked by the item's row
// count (see kTransposeRows); `fixed_order` (batch-invariant mode) always takes the
// per-key dot products, so that a query's result is also the same whether it is decoded
// alone (1 token), verified with speculated tokens (k + 1) or prefilled in a chunk.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kTile = 16;        // keys per tile
constexpr int kMaxQueries = 16;  // consecutive tokens of one request per work item
constexpr int kLanes = 16;       // floats per vector (one AVX-512 register)
// Head dims in vectors of 16 floats: every width up to 16 (head_dim <= 256) has its own
// instantiation, and a few wider ones serve latent rows (DeepSeek's MLA: 512 + 64 =
// 576); a head dim between two is zero-padded to the next.
constexpr int kDenseHeadVectors = 16;
constexpr int kWideHeadVectors[] = {20, 24, 32, 36};
constexpr int kMaxHeadVectors = 36;  // head_dim <= 576
// Items with at least this many rows (tokens x query heads per KV head) use the
// transposed-keys scores (one broadcast-FMA per row and head dim, 16 keys wide); fewer
// rows (decode with a small GQA group) take dot products straight from the key rows,
// which skips the transpose it could not amortise.
constexpr int kTransposeRows = 8;

enum CacheKind : int32_t { kCacheF32 = 0, kCacheBF16 = 1, kCacheByteLut = 2 };

inline float bf16_bits_to_f32(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16_bits(float f) {  // round to nearest even, NaN kept NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

struct Problem {
  const void* q;
  void* o;
  bool bf16_q;
  const uint8_t* cache;  // the layer's [P, S, 2K, H]
  int32_t cache_kind;
  int64_t elem_bytes;
  const float* lut;  // [256] for kCacheByteLut
  const float* sinks;  // [N] attention sinks (GPT-OSS), or nullptr: none
  const int32_t* ahead;  // [T] keys past its own position each token sees, or nullptr: none
  // pair: rows per KV head in a slot, 2 (K then V) or 1 (MLA's latent row, both K and V).
  int64_t num_pages, page_size, two_k, pair, n_heads, groups, head_dim, pmax;
  const int32_t* page_indices;
  float sm_scale, soft_cap;  // soft_cap 0: none
  int64_t window;            // 0: none
  bool fixed_order;          // one score order whatever the item's rows (batch-invariant mode)
};

struct Item {
  int32_t req, t0, nq, kh0, kh1;  // KV heads [kh0, kh1)
  int64_t pos0, lo, hi;  // the first token's position; the keys the item reads: [lo, hi]
  int64_t cost;
};

// GCC / Clang vector extensions: 16 floats, one AVX-512 register or two AVX2 ones
// (the compiler splits them), so the same source serves both kinds of CPU.
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

inline v16 load16(const float* x) {
  v16 v;
  std::memcpy(&v, x, sizeof(v));
  return v;
}
inline void store16(float* x, v16 v) { std::memcpy(x, &v, sizeof(v)); }
inline v16 splat(float x) { return v16{} + x; }

inline float hsum(v16 x) {
  const v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// Sixteen vectors' horizontal sums as one vector: lane j = the sum of p[j]'s lanes. A
// tree of two-source shuffles (15 steps of two shuffles and an add, against 16 separate
// horizontal sums of ~7 operations each); the lanes come out in order.
inline v16 hsum16(const v16* p) {
  v16 a[8], b[4], c[2];
  for (int k = 0; k < 8; ++k)  // lanes 0-7: p[2k]'s halves summed, 8-15: p[2k+1]'s
    a[k] = __builtin_shufflevector(p[2 * k], p[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(p[2 * k], p[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                   31);
  for (int k = 0; k < 4; ++k)  // four lanes each of p[4k .. 4k+3]
    b[k] = __builtin_shufflevector(a[2 * k], a[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * k], a[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int k = 0; k < 2; ++k)  // two lanes each of p[8k .. 8k+7]
    c[k] = __builtin_shufflevector(b[2 * k], b[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(b[2 * k], b[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

inline float hmax(v16 x) {
  float m = x[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, x[i]);
  return m;
}

// exp(x) for x <= 0 (every use here: a score minus a running maximum), 16 at a time; 0
// below -87 and for -inf. Range reduction to [-ln2/2, ln2/2] and a degree-6 polynomial:
// relative error ~2e-7, branch-free.
inline v16 exp16(v16 x) {
  const v16 t = x * 1.4426950408889634f;
  const v16i n = __builtin_convertvector(t - 0.5f, v16i);
  const v16 nf = __builtin_convertvector(n, v16);
  const v16 r = (x - nf * 0.693145751953125f) - nf * 1.428606765330187e-06f;
  v16 p = splat(1.0f / 720.0f);
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  v16i e = n + 127;
  e = e < 1 ? 1 : e;
  v16 scale;
  const v16i bits = e << 23;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? v16{} : p * scale;
}

// One K or V row widened to f32, in kHV vectors of 16 (zero-padded past head_dim).
// Returns a pointer to the row: the cache itself for f32 rows that need no padding,
// else `buf`. A null row (a key the item does not read) reads as zeros.
template <int kHV>
inline const float* load_row(const Problem& p, const uint8_t* row, float* buf) {
  const int64_t h = p.head_dim;
  if (row == nullptr) {
    for (int i = 0; i < kHV; ++i) store16(buf + 16 * i, v16{});
    return buf;
  }
  if (p.cache_kind == kCacheF32) {
    if (h == 16 * kHV) return reinterpret_cast<const float*>(row);
    std::memcpy(buf, row, h * 4);
  } else if (p.cache_kind == kCacheBF16) {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(row);
    if (h == 16 * kHV) {
      for (int i = 0; i < kHV; ++i) {
        v16h x;
        std::memcpy(&x, src + 16 * i, sizeof(x));
        const v16u u = __builtin_convertvector(x, v16u) << 16;
        std::memcpy(buf + 16 * i, &u, sizeof(u));
      }
      return buf;
    }
    for (int64_t i = 0; i < h; ++i) buf[i] = bf16_bits_to_f32(src[i]);
  } else {
    for (int64_t i = 0; i < h; ++i) buf[i] = p.lut[row[i]];
  }
  std::fill(buf + h, buf + 16 * kHV, 0.0f);
  return buf;
}

// Per-thread scratch, sized for the largest item.
struct Scratch {
  std::vector<float> q, acc, m, l, keys, keys_t, values, scores;
  std::vector<v16> partials;
  void reserve(int64_t rows, int64_t hp) {
    partials.resize(rows * kTile);  // per-key sums: every row of a KV head (fixed_order) or fewer than kTransposeRows
    q.resize(rows * hp);
    acc.resize(rows * hp);
    m.resize(rows);
    l.resize(rows);
    keys.resize(kTile * hp);
    keys_t.resize(hp * kTile);
    values.resize(kTile * hp);
    scores.resize(rows * kTile);
  }
};

template <int kHV>
void run_item(const Problem& p, const Item& it, Scratch& sc) {
  constexpr int64_t hp = 16 * kHV;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t g = p.groups, h = p.head_dim;
  const int64_t head_rows = int64_t(it.nq) * g;  // rows per KV head
  const int64_t heads = it.kh1 - it.kh0;
  const bool transposed = !p.fixed_order && head_rows >= kTransposeRows;
  float* q = sc.q.data();
  float* acc = sc.acc.data();
  float* m = sc.m.data();
  float* l = sc.l.data();
  // Row (KV head kh, token i, group member gg) at (kh - kh0) * head_rows + i * G + gg:
  // query head kh * G + gg of token t0 + i.
  auto q_offset = [&](int64_t row) {
    const int64_t kh = it.kh0 + row / head_rows, i = row % head_rows / g, gg = row % g;
    return ((int64_t(it.t0) + i) * p.n_heads + kh * g + gg) * h;
  };
  for (int64_t row = 0; row < heads * head_rows; ++row) {
    const int64_t off = q_offset(row);
    float* dst = q + row * hp;
    if (p.bf16_q) {
      const uint16_t* s = static_cast<const uint16_t*>(p.q) + off;
      for (int64_t d = 0; d < h; ++d) dst[d] = bf16_bits_to_f32(s[d]) * p.sm_scale;
    } else {
      const float* s = static_cast<const float*>(p.q) + off;
      for (int64_t d = 0; d < h; ++d) dst[d] = s[d] * p.sm_scale;
    }
    std::fill(dst + h, dst + hp, 0.0f);
    std::fill(acc + row * hp, acc + (row + 1) * hp, 0.0f);
    m[row] = kNegInf;
    l[row] = 0.0f;
  }

  const int64_t row_bytes = h * p.elem_bytes;
  const int64_t slot_stride = p.two_k * row_bytes;
  const int32_t* pages = p.page_indices + int64_t(it.req) * p.pmax;
  float* keys = sc.keys.data();
  float* keys_t = sc.keys_t.data();
  float* values = sc.values.data();
  float* scores = sc.scores.data();
  v16* partials = sc.partials.data();
  v16i lane;
  for (int j = 0; j < kTile; ++j) lane[j] = j;
  // The slot of the key at `pos` (K of head kh at + 2 kh row_bytes, its V after it), or
  // null for a key the item does not read: outside [lo, hi], or behind a page-table
  // entry out of range.
  auto slot = [&](int64_t pos) -> const uint8_t* {
    if (pos < it.lo || pos > it.hi || pos / p.page_size >= p.pmax) return nullptr;
    const int64_t page = pages[pos / p.page_size];
    if (page < 0 || page >= p.num_pages) return nullptr;
    return p.cache + (page * p.page_size + pos % p.page_size) * slot_stride;
  };
  // An item reads its heads' rows of each slot: one contiguous run (all of the slot when
  // it has every head), which the hardware prefetcher follows within a page. Pages are
  // scattered, so the next tiles' runs are asked for ahead.
  const int64_t run_begin = p.pair * it.kh0 * row_bytes, run_bytes = p.pair * heads * row_bytes;
  constexpr int kPrefetchTiles = 2;
  auto prefetch_tile = [&](int64_t k0) {
    for (int j = 0; j < kTile; ++j)
      if (const uint8_t* next = slot(k0 + j))
        for (int64_t b = 0; b < run_bytes; b += 64) __builtin_prefetch(next + run_begin + b);
  };
  const uint8_t* slots[kTile];
  const float* vrow[kTile];
  for (int64_t k0 = it.lo / kTile * kTile; k0 <= it.hi; k0 += kTile) {
    prefetch_tile(k0 + kPrefetchTiles * kTile);
    for (int j = 0; j < kTile; ++j) slots[j] = slot(k0 + j);
    const v16i kpos = lane + int32_t(k0 - it.pos0);  // key positions relative to the item's first token
    for (int64_t kh = it.kh0; kh < it.kh1; ++kh) {
      const int64_t r0 = (kh - it.kh0) * head_rows;
      float* hq = q + r0 * hp;
      // This head's K and V rows of the tile (absent keys read as zeros, so that a NaN
      // in an unused slot never reaches a product), and the scores [head_rows, kTile].
      for (int j = 0; j < kTile; ++j) {
        const uint8_t* k_row = slots[j] ? slots[j] + p.pair * kh * row_bytes : nullptr;
        const float* kr = load_row<kHV>(p, k_row, keys + j * hp);
        vrow[j] = p.pair == 1 ? kr : load_row<kHV>(p, k_row ? k_row + row_bytes : nullptr, values + j * hp);
        if (transposed) {
          for (int64_t d = 0; d < hp; ++d) keys_t[d * kTile + j] = kr[d];
        } else {
          // Every row against this key: 16 partial sums each, reduced after the tile.
          v16 kv[kHV];
          for (int i = 0; i < kHV; ++i) kv[i] = load16(kr + 16 * i);
          for (int64_t row = 0; row < head_rows; ++row) {
            const float* qr = hq + row * hp;
            v16 part = load16(qr) * kv[0];
            for (int i = 1; i < kHV; ++i) part += load16(qr + 16 * i) * kv[i];
            partials[row * kTile + j] = part;
          }
        }
      }
      if (!transposed)
        for (int64_t row = 0; row < head_rows; ++row) store16(scores + row * kTile, hsum16(partials + row * kTile));
      if (transposed) {
        // The tile's keys side by side: a broadcast-FMA per head dim, four rows at a time.
        int64_t row = 0;
        for (; row + 4 <= head_rows; row += 4) {
          v16 s0{}, s1{}, s2{}, s3{};
          const float* q0 = hq + row * hp;
          for (int64_t d = 0; d < hp; ++d) {
            const v16 kt = load16(keys_t + d * kTile);
            s0 += q0[d] * kt;
            s1 += q0[hp + d] * kt;
            s2 += q0[2 * hp + d] * kt;
            s3 += q0[3 * hp + d] * kt;
          }
          store16(scores + row * kTile, s0);
          store16(scores + (row + 1) * kTile, s1);
          store16(scores + (row + 2) * kTile, s2);
          store16(scores + (row + 3) * kTile, s3);
        }
        for (; row < head_rows; ++row) {
          v16 s0{};
          for (int64_t d = 0; d < hp; ++d) s0 += hq[row * hp + d] * load16(keys_t + d * kTile);
          store16(scores + row * kTile, s0);
        }
      }
      // Online softmax per row over the tile's keys it may see.
      for (int64_t row = 0; row < head_rows; ++row) {
        const int64_t r = r0 + row;
        const int32_t rel = int32_t(row / g);  // the row's position relative to the first token
        v16 s = load16(scores + row * kTile);
        if (p.soft_cap != 0.0f)
          for (int j = 0; j < kTile; ++j) s[j] = p.soft_cap * std::tanh(s[j] / p.soft_cap);
        v16i ok = kpos <= rel + (p.ahead ? p.ahead[it.t0 + rel] : 0);
        if (p.window > 0) ok &= kpos > rel - int32_t(p.window);
        s = ok ? s : splat(kNegInf);
        const float tile_max = hmax(s);
        if (tile_max == kNegInf) continue;
        const float m_new = std::max(m[r], tile_max);
        const float alpha = m[r] == kNegInf ? 0.0f : exp16(splat(m[r] - m_new))[0];
        const v16 e = ok ? exp16(s - m_new) : v16{};
        l[r] = alpha * l[r] + hsum(e);
        m[r] = m_new;
        float* a = acc + r * hp;
        v16 ar[kHV];
        for (int i = 0; i < kHV; ++i) ar[i] = load16(a + 16 * i) * alpha;
        for (int j = 0; j < kTile; ++j) {
          const float w = e[j];
          if (w == 0.0f) continue;
          const float* v = vrow[j];
          for (int i = 0; i < kHV; ++i) ar[i] += w * load16(v + 16 * i);
        }
        for (int i = 0; i < kHV; ++i) store16(a + 16 * i, ar[i]);
      }
    }
  }
  // Normalise and store.
  for (int64_t row = 0; row < heads * head_rows; ++row) {
    const int64_t off = q_offset(row);
    // A sink adds exp(sink - m) to the denominator (l is relative to the row's max m).
    float denom = l[row];
    if (p.sinks != nullptr && denom > 0.0f) {
      const int64_t head = (it.kh0 + row / head_rows) * g + row % g;
      denom += std::exp(p.sinks[head] - m[row]);
    }
    const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
    const float* a = acc + row * hp;
    if (p.bf16_q) {
      uint16_t* d = static_cast<uint16_t*>(p.o) + off;
      for (int64_t x = 0; x < h; ++x) d[x] = f32_to_bf16_bits(a[x] * inv);
    } else {
      float* d = static_cast<float*>(p.o) + off;
      for (int64_t x = 0; x < h; ++x) d[x] = a[x] * inv;
    }
  }
}

using ItemFn = void (*)(const Problem&, const Item&, Scratch&);

template <int... kHVs>
ItemFn pick(int64_t hv, std::integer_sequence<int, kHVs...>) {
  ItemFn fns[] = {run_item<kHVs + 1>...};
  return fns[hv - 1];
}

// The instantiated width for a head dim of `hv` vectors (see kWideHeadVectors).
int64_t padded_vectors(int64_t hv) {
  if (hv <= kDenseHeadVectors) return hv;
  for (int w : kWideHeadVectors)
    if (hv <= w) return w;
  return kMaxHeadVectors;
}

ItemFn pick_item(int64_t hv) {
  switch (hv) {
    case 20: return run_item<20>;
    case 24: return run_item<24>;
    case 32: return run_item<32>;
    case 36: return run_item<36>;
    default: return pick(hv, std::make_integer_sequence<int, kDenseHeadVectors>{});
  }
}

// Items shared by the calling thread and the pool's tasks. Tasks may start after the
// call has returned (every item already taken): they then touch only this state, which
// each holds a reference to.
struct Shared {
  explicit Shared(int64_t n) : size(n) {}
  const int64_t size;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// Takes items until none is left. `items` is dereferenced only for a taken item, which
// keeps the call (and the items) alive until it is done.
void work(const Problem& p, const Item* items, Shared& sh) {
  thread_local Scratch sc;
  const int64_t hv = padded_vectors((p.head_dim + kLanes - 1) / kLanes);
  sc.reserve(int64_t(kMaxQueries) * p.n_heads, kLanes * hv);
  const ItemFn run = pick_item(hv);
  const int64_t n = sh.size;
  for (int64_t i = sh.next.fetch_add(1); i < n; i = sh.next.fetch_add(1)) {
    run(p, items[i], sc);
    sh.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error Attention(ffi::AnyBuffer q, ffi::AnyBuffer kv_cache, ffi::Buffer<ffi::S32> kv_lens,
                     ffi::Buffer<ffi::S32> page_indices, ffi::Buffer<ffi::S32> cu_q_lens,
                     ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::F32> lut,
                     ffi::Buffer<ffi::F32> sinks, ffi::Buffer<ffi::S32> keys_ahead, ffi::Result<ffi::AnyBuffer> out,
                     ffi::ThreadPool pool, float sm_scale, int64_t sliding_window, float soft_cap, int32_t cache_kind,
                     int32_t fixed_order, int32_t has_sinks, int32_t has_ahead) {
  const auto qd = q.dimensions();
  const auto cd = kv_cache.dimensions();
  if (qd.size() == 3 && qd[2] > kLanes * kMaxHeadVectors)
    return ffi::Error::InvalidArgument("head_dim must be at most 576");
  if (qd.size() != 3 || (cd.size() != 4 && cd.size() != 5))
    return ffi::Error::InvalidArgument("q must be [T, N, H], kv_cache [P, S, 2K, H] or [L, P, S, 2K, H]");
  const bool stacked = cd.size() == 5;
  const int64_t t = qd[0], n = qd[1], h = qd[2];
  const int64_t num_layers = stacked ? cd[0] : 1;
  const int64_t num_pages = cd[cd.size() - 4], page_size = cd[cd.size() - 3], two_k = cd[cd.size() - 2];
  const int64_t r = page_indices.dimensions()[0], pmax = page_indices.dimensions()[1];

  Problem p;
  p.q = q.untyped_data();
  p.o = out->untyped_data();
  p.bf16_q = q.element_type() == ffi::BF16;
  p.cache_kind = cache_kind;
  p.elem_bytes = cache_kind == kCacheF32 ? 4 : cache_kind == kCacheBF16 ? 2 : 1;
  p.lut = lut.typed_data();
  if (has_sinks && int64_t(sinks.element_count()) != n)
    return ffi::Error::InvalidArgument("sinks must have one entry per query head");
  p.sinks = has_sinks ? sinks.typed_data() : nullptr;
  if (has_ahead && int64_t(keys_ahead.element_count()) != t)
    return ffi::Error::InvalidArgument("keys_ahead must have one entry per token");
  p.ahead = has_ahead ? keys_ahead.typed_data() : nullptr;
  p.num_pages = num_pages;
  p.page_size = page_size;
  p.two_k = two_k;
  p.pair = two_k == 1 ? 1 : 2;  // one row per slot: the latent layout
  p.n_heads = n;
  p.groups = n / (two_k / p.pair);
  p.head_dim = h;
  p.pmax = pmax;
  p.page_indices = page_indices.typed_data();
  p.sm_scale = sm_scale;
  p.soft_cap = soft_cap;
  p.window = sliding_window;
  p.fixed_order = fixed_order != 0;
  const int64_t lay = std::clamp<int64_t>(stacked ? layer.typed_data()[0] : 0, 0, num_layers - 1);
  p.cache = static_cast<const uint8_t*>(kv_cache.untyped_data()) +
            lay * num_pages * page_size * two_k * h * p.elem_bytes;

  const int32_t* lens = kv_lens.typed_data();
  const int32_t* cu = cu_q_lens.typed_data();
  const int64_t seqs = std::clamp<int64_t>(num_seqs.typed_data()[0], 0, r);
  const int64_t k_heads = two_k / p.pair;
  // Items of every KV head, contiguous reads of whole slots; split per head when there
  // are too few items to keep the threads busy (a long single-request decode).
  std::vector<Item> items;
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  for (int pass = 0; pass < 2; ++pass) {
    const int64_t per_item = pass == 0 ? k_heads : 1;
    items.clear();
    for (int64_t s = 0; s < seqs; ++s) {
      const int64_t start = std::clamp<int64_t>(cu[s], 0, t), end = std::clamp<int64_t>(cu[s + 1], start, t);
      const int64_t prefix = int64_t(lens[s]) - (end - start);
      for (int64_t t0 = start; t0 < end; t0 += kMaxQueries) {
        const int64_t nq = std::min<int64_t>(kMaxQueries, end - t0);
        const int64_t pos0 = prefix + (t0 - start);
        if (pos0 < 0) continue;  // malformed row (more queries than keys): left as zeros
        const int64_t lo = sliding_window > 0 ? std::max<int64_t>(pos0 - sliding_window + 1, 0) : 0;
        int64_t hi = pos0 + nq - 1;
        if (p.ahead) {  // the furthest key one of its tokens sees, within the request's keys
          for (int64_t i = 0; i < nq; ++i) hi = std::max<int64_t>(hi, pos0 + i + std::max(p.ahead[t0 + i], 0));
          hi = std::min<int64_t>(hi, int64_t(lens[s]) - 1);
        }
        for (int64_t kh = 0; kh < k_heads; kh += per_item)
          items.push_back(Item{int32_t(s), int32_t(t0), int32_t(nq), int32_t(kh), int32_t(kh + per_item), pos0, lo,
                               hi, nq * p.groups * per_item * (hi - lo + 1)});
      }
    }
    if (int64_t(items.size()) >= 4 * threads || k_heads == 1) break;
  }
  // Zero every output row first: padded tokens, and rows an item skipped.
  std::memset(out->untyped_data(), 0, out->size_bytes());
  // Longest first, so the pool's last items are short ones.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });

  const int64_t n_items = int64_t(items.size());
  auto shared = std::make_shared<Shared>(n_items);
  const int64_t helpers = std::min<int64_t>(threads - 1, n_items - 1);
  const Item* list = items.data();
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([shared, p, list]() {
      if (shared->next.load() < shared->size) work(p, list, *shared);
    });
  }
  work(p, list, *shared);
  while (shared->done.load(std::memory_order_acquire) < n_items) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRaggedPagedAttentionCpu, Attention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // q
                                  .Arg<ffi::AnyBuffer>()         // kv_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_indices
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::F32>>()  // lut
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks ([N], or [1] unused)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // keys_ahead ([T], or [1] unused)
                                  .Ret<ffi::AnyBuffer>()         // o
                                  .Ctx<ffi::ThreadPool>()
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("cache_kind")
                                  .Attr<int32_t>("fixed_order")
                                  .Attr<int32_t>("has_sinks")
                                  .Attr<int32_t>("has_ahead"));
