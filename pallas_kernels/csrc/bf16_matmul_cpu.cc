// y = bf16(x) @ w on a CPU with AVX512-BF16: an XLA FFI custom call (pallas_kernels/cpu_matmul.py).
//
// Why native code: XLA:CPU runs this product (x float32 rounded to bf16, w bf16, float32
// accumulation and result) at ~420 GFLOP/s on a 2-core Zen 4 VM at 2048 rows, but at
// 150-270 GFLOP/s at the 64 rows of a decode step: one core alone gives ~160, so its
// threading at small M is what is lost. Here each thread takes whole blocks of 64 output
// columns and every row, so both cores stream disjoint weights.
//
// Semantics: x [M, K] float32, w [K, N] bf16 (or its uint16 bit patterns), y [M, N]
// float32. x is rounded to bf16 (round to nearest even) once per call; each product of
// two bf16 is exact in float32 and VDPBF16PS adds them in pairs of k into float32
// accumulators, k in increasing order: a row's result depends on that row and w only,
// never on M or on the other rows.
//
// `transposed`: w is [N, K] (a tied embedding used as the lm_head), each output column
// a row of w, contiguous in k. Then each (row, column) is a dot product: 32 k at a time
// into 16 float32 lanes (VDPBF16PS), k in increasing order, the lanes summed at the end
// in one fixed order (_mm512_reduce_add_ps). Again nothing depends on M or the other rows.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kRows = 6;     // rows per micro-tile: 6 x 4 accumulators of 16 columns
constexpr int kCols = 64;    // output columns per work item (4 vectors of 16)

// x [M, K] float32 -> [M, K2] uint32: row m's bf16 pair (k = 2p, 2p + 1) in word p (low
// half k = 2p), zero past K. Round to nearest even (VCVTNEPS2BF16).
void pack_x(const float* x, int64_t m, int64_t k, int64_t k2, uint32_t* out) {
  for (int64_t r = 0; r < m; ++r) {
    const float* src = x + r * k;
    uint16_t* dst = reinterpret_cast<uint16_t*>(out + r * k2);
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
      const __m256bh b = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + i));
      std::memcpy(dst + i, &b, 32);
    }
    if (i < k) {
      const __mmask16 mask = __mmask16((1u << (k - i)) - 1);
      const __m256bh b = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, src + i));
      std::memcpy(dst + i, &b, 2 * (k - i));
    }
    for (int64_t j = k; j < 2 * k2; ++j) dst[j] = 0;
  }
}

struct Problem {
  const uint32_t* xa;  // [M, K2] packed pairs
  const uint16_t* w;   // [K, N], or [N, K] when transposed
  float* y;            // [M, N]
  int64_t m, k, n, k2;
  bool transposed;
};

// The weights of the 64 columns from c0 for VDPBF16PS: for each k pair q, four vectors
// of 16 columns whose 32-bit lanes hold (w[2q, c], w[2q + 1, c]). Interleaved by unpacklo
// / unpackhi within 128-bit lanes, so vector 0 holds columns {0-3, 8-11, 16-19, 24-27},
// vector 1 {4-7, 12-15, 20-23, 28-31}, vectors 2 and 3 the same of columns 32-63; the
// store undoes it. Packed once per work item and read by all its row tiles from L2.
void pack_w(const Problem& p, int64_t c0, __m512i* out) {
  const int64_t cols = std::min<int64_t>(kCols, p.n - c0);
  const __mmask32 m0 = cols >= 32 ? ~__mmask32(0) : __mmask32((uint64_t(1) << cols) - 1);
  const __mmask32 m1 = cols <= 32 ? 0 : cols >= 64 ? ~__mmask32(0) : __mmask32((uint64_t(1) << (cols - 32)) - 1);
  const uint16_t* wcol = p.w + c0;
  for (int64_t q = 0; q < p.k2; ++q) {
    const int64_t k0 = 2 * q;
    const uint16_t* row0 = wcol + k0 * p.n;
    const bool has1 = k0 + 1 < p.k;
    const __m512i a0 = _mm512_maskz_loadu_epi16(m0, row0);
    const __m512i b0 = _mm512_maskz_loadu_epi16(m1, row0 + 32);
    const __m512i a1 = has1 ? _mm512_maskz_loadu_epi16(m0, row0 + p.n) : _mm512_setzero_si512();
    const __m512i b1 = has1 ? _mm512_maskz_loadu_epi16(m1, row0 + p.n + 32) : _mm512_setzero_si512();
    out[4 * q] = _mm512_unpacklo_epi16(a0, a1);
    out[4 * q + 1] = _mm512_unpackhi_epi16(a0, a1);
    out[4 * q + 2] = _mm512_unpacklo_epi16(b0, b1);
    out[4 * q + 3] = _mm512_unpackhi_epi16(b0, b1);
  }
}

// Rows [r0, r0 + R) x the 64 columns from c0 (fewer at the right edge), from the packed
// weights.
template <int R>
void tile(const Problem& p, const __m512i* wp, int64_t r0, int64_t c0) {
  const int64_t cols = std::min<int64_t>(kCols, p.n - c0);
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  const uint32_t* xr = p.xa + r0 * p.k2;
  for (int64_t q = 0; q < p.k2; ++q) {
    const __m512bh w0 = (__m512bh)_mm512_load_si512(wp + 4 * q);
    const __m512bh w1 = (__m512bh)_mm512_load_si512(wp + 4 * q + 1);
    const __m512bh w2 = (__m512bh)_mm512_load_si512(wp + 4 * q + 2);
    const __m512bh w3 = (__m512bh)_mm512_load_si512(wp + 4 * q + 3);
    for (int r = 0; r < R; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(int32_t(xr[r * p.k2 + q]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], x, w2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], x, w3);
    }
  }
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int r = 0; r < R; ++r) {
    float* out = p.y + (r0 + r) * p.n + c0;
    const __m512 v[4] = {_mm512_permutex2var_ps(acc[r][0], first, acc[r][1]),
                         _mm512_permutex2var_ps(acc[r][0], second, acc[r][1]),
                         _mm512_permutex2var_ps(acc[r][2], first, acc[r][3]),
                         _mm512_permutex2var_ps(acc[r][2], second, acc[r][3])};
    for (int j = 0; j < 4; ++j) {
      const int64_t left = cols - 16 * j;
      if (left <= 0) break;
      const __mmask16 mask = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
      _mm512_mask_storeu_ps(out + 16 * j, mask, v[j]);
    }
  }
}

// Transposed weights: rows [r0, r0 + R) x columns [c0, c0 + C), each a dot product over
// k of x's packed pairs and w's row (both bf16 pairs, 16 per vector), the tail masked.
template <int R, int C>
void tile_t(const Problem& p, int64_t r0, int64_t c0) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t full = p.k / 32;  // vectors of 32 k with no tail
  for (int64_t s = 0; s < full; ++s) {
    __m512bh wv[C];
    for (int c = 0; c < C; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(p.w + (c0 + c) * p.k + 32 * s);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(p.xa + (r0 + r) * p.k2 + 16 * s);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
    }
  }
  const int64_t tail = p.k - 32 * full;  // k left, < 32: zeros past K on both sides
  if (tail > 0) {
    const __mmask32 wm = __mmask32((uint64_t(1) << tail) - 1);
    const __mmask16 xm = __mmask16((1u << ((tail + 1) / 2)) - 1);
    __m512bh wv[C];
    for (int c = 0; c < C; ++c) wv[c] = (__m512bh)_mm512_maskz_loadu_epi16(wm, p.w + (c0 + c) * p.k + 32 * full);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi32(xm, p.xa + (r0 + r) * p.k2 + 16 * full);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) p.y[(r0 + r) * p.n + c0 + c] = _mm512_reduce_add_ps(acc[r][c]);
}

constexpr int kTRows = 6, kTCols = 4;  // 24 accumulators + 4 weight vectors + 1 x vector

template <int R>
void tile_t_cols(const Problem& p, int64_t r0, int64_t c0, int64_t c1) {
  int64_t c = c0;
  for (; c + kTCols <= c1; c += kTCols) tile_t<R, kTCols>(p, r0, c);
  switch (c1 - c) {
    case 3: tile_t<R, 3>(p, r0, c); break;
    case 2: tile_t<R, 2>(p, r0, c); break;
    case 1: tile_t<R, 1>(p, r0, c); break;
    default: break;
  }
}

// One work item with transposed weights: every row, the 64 columns from c0 (their w
// rows stay in L2 while the row tiles go by).
void column_block_t(const Problem& p, int64_t c0) {
  const int64_t c1 = std::min<int64_t>(c0 + kCols, p.n);
  int64_t r = 0;
  for (; r + kTRows <= p.m; r += kTRows) tile_t_cols<kTRows>(p, r, c0, c1);
  switch (p.m - r) {
    case 5: tile_t_cols<5>(p, r, c0, c1); break;
    case 4: tile_t_cols<4>(p, r, c0, c1); break;
    case 3: tile_t_cols<3>(p, r, c0, c1); break;
    case 2: tile_t_cols<2>(p, r, c0, c1); break;
    case 1: tile_t_cols<1>(p, r, c0, c1); break;
    default: break;
  }
}

// One work item: every row, the 64 columns from c0.
void column_block(const Problem& p, int64_t c0) {
  if (p.transposed) return column_block_t(p, c0);
  thread_local std::vector<__m512i> packed;
  if (int64_t(packed.size()) < 4 * p.k2) packed.resize(4 * p.k2);
  pack_w(p, c0, packed.data());
  const __m512i* wp = packed.data();
  int64_t r = 0;
  for (; r + kRows <= p.m; r += kRows) tile<kRows>(p, wp, r, c0);
  switch (p.m - r) {
    case 5: tile<5>(p, wp, r, c0); break;
    case 4: tile<4>(p, wp, r, c0); break;
    case 3: tile<3>(p, wp, r, c0); break;
    case 2: tile<2>(p, wp, r, c0); break;
    case 1: tile<1>(p, wp, r, c0); break;
    default: break;
  }
}

struct Shared {
  explicit Shared(int64_t n) : size(n) {}
  const int64_t size;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

void work(const Problem& p, Shared& sh) {
  for (int64_t i = sh.next.fetch_add(1); i < sh.size; i = sh.next.fetch_add(1)) {
    column_block(p, i * kCols);
    sh.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error Matmul(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Result<ffi::Buffer<ffi::F32>> y,
                  ffi::ThreadPool pool, int32_t transposed) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[transposed ? 1 : 0])
    return ffi::Error::InvalidArgument("x must be [M, K] and w [K, N] (transposed: [N, K])");
  if (w.element_type() != ffi::BF16 && w.element_type() != ffi::U16)
    return ffi::Error::InvalidArgument("w must be bfloat16 (or its uint16 bit patterns)");
  Problem p;
  p.m = xd[0];
  p.k = xd[1];
  p.transposed = transposed != 0;
  p.n = wd[p.transposed ? 0 : 1];
  p.k2 = (p.k + 1) / 2;
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  std::vector<uint32_t> xa(p.m * p.k2);
  pack_x(x.typed_data(), p.m, p.k, p.k2, xa.data());
  p.xa = xa.data();
  p.w = static_cast<const uint16_t*>(w.untyped_data());
  p.y = y->typed_data();
  const int64_t blocks = (p.n + kCols - 1) / kCols;
  auto shared = std::make_shared<Shared>(blocks);
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1) - 1, blocks - 1);
  // The helpers copy the problem; the packed x outlives them: this call waits below
  // until every block is done, and a helper that starts later finds none left.
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([shared, p]() {
      if (shared->next.load() < shared->size) work(p, *shared);
    });
  }
  work(p, *shared);
  while (shared->done.load(std::memory_order_acquire) < blocks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveBf16MatmulCpu, Matmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()         // w [K, N] bf16 / uint16
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Ctx<ffi::ThreadPool>()
                                  .Attr<int32_t>("transposed"));
