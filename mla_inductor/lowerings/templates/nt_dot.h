// NT dot-product tiles: out[m * ldo + n] = sum_k x[m * ldx + k] * w[n * ldw + k], accumulated in fp32
// (W8A8: in int32).
//
// Both operands are read along k, so the weight is consumed in nn.Linear's own [N, K] layout: every
// weight row is one sequential stream and nothing needs packing, with or without freezing. At decode
// (a handful of x rows) the weight stream is the whole cost, and MR x rows share each weight load.
#pragma once
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include <immintrin.h>

namespace mla_inductor {

// A register tile is up to 4 x rows by 4 w rows: 16 fp32 accumulators plus the 5 loaded vectors.
// A panel is up to 8 x rows against one tile of w rows; see dot_panel.
constexpr int kTileRows = 4;
constexpr int kMaxPanelRows = 8;
constexpr int kTileCols = 4;
// k-chunk over which the row blocks of a panel alternate: 4 w rows x 512 B stay in L1 for the
// second block while the first pulls them from memory, so the stream and the math overlap.
constexpr int64_t kPanelChunk = 256;

#if defined(__AVX512BF16__)
// One _mm512_dpbf16_ps consumes 32 bf16 of x and of w and adds 16 pairwise products to fp32 lanes.
template <int MR, int NR>
__attribute__((always_inline)) inline void dot_step_bf16(__m512 (&acc)[MR][NR], const c10::BFloat16* x, int64_t ldx,
                                                         const c10::BFloat16* w, int64_t ldw, __mmask32 mask) {
  __m512bh xv[MR];
  for (int m = 0; m < MR; ++m) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * ldx);
  for (int n = 0; n < NR; ++n) {
    const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + n * ldw);
    for (int m = 0; m < MR; ++m) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv[m], wv);
  }
}

// How a bf16 chunk asks for the weight stream's future (dot_chunk_bf16):
// - kInRow: with several row blocks per panel the core has enough math in flight that the hardware
//   prefetcher falls behind the weight stream; asking 1 KiB ahead in each row measured 15-20% faster at
//   8 rows (and slower for a lone block);
// - kNextTile: a lone block of a few rows reads NR rows of 4 KiB-page-sized stretches at once, each a new
//   stream for the hardware prefetcher to find; it asks for the same line of the next tile's rows (NR
//   rows further: the stream's future where rows are contiguous, as nn.Linear's and an expert's are).
enum class ChunkPrefetch { kNone, kInRow, kNextTile };

// acc (MR x NR, in memory) += x[:, k0:k1] . w[:, k0:k1]^T, with the accumulators in registers throughout.
template <int MR, int NR, ChunkPrefetch PREFETCH>
inline void dot_chunk_bf16(__m512* acc, const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w, int64_t ldw,
                           int64_t k0, int64_t k1) {
  __m512 a[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) a[m][n] = acc[m * kTileCols + n];
  int64_t k = k0;
  for (; k + 32 <= k1; k += 32) {
    __m512bh xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * ldx + k);
    for (int n = 0; n < NR; ++n) {
      if constexpr (PREFETCH == ChunkPrefetch::kInRow) {
        _mm_prefetch(reinterpret_cast<const char*>(w + n * ldw + k + 512), _MM_HINT_T0);
      } else if constexpr (PREFETCH == ChunkPrefetch::kNextTile) {
        _mm_prefetch(reinterpret_cast<const char*>(w + (n + NR) * ldw + k), _MM_HINT_T1);
      }
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + n * ldw + k);
      for (int m = 0; m < MR; ++m) a[m][n] = _mm512_dpbf16_ps(a[m][n], xv[m], wv);
    }
  }
  if (k < k1) dot_step_bf16<MR, NR>(a, x + k, ldx, w + k, ldw, (__mmask32(1) << (k1 - k)) - 1);  // zero lanes add 0
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m * kTileCols + n] = a[m][n];
}

template <int NR>
inline void dot_panel_bf16(const c10::BFloat16* x, int64_t ldx, int mr, const c10::BFloat16* w, int64_t ldw,
                           int64_t K, float* out, int64_t ldo) {
  __m512 acc[kMaxPanelRows * kTileCols];
  for (auto& a : acc) a = _mm512_setzero_ps();
  if (mr <= kTileRows) {
    // One row block: no reason to split k (the accumulators would only round-trip through L1).
    switch (mr) {
      case 4: dot_chunk_bf16<4, NR, ChunkPrefetch::kNextTile>(acc, x, ldx, w, ldw, 0, K); break;
      case 3: dot_chunk_bf16<3, NR, ChunkPrefetch::kNextTile>(acc, x, ldx, w, ldw, 0, K); break;
      case 2: dot_chunk_bf16<2, NR, ChunkPrefetch::kNextTile>(acc, x, ldx, w, ldw, 0, K); break;
      default: dot_chunk_bf16<1, NR, ChunkPrefetch::kNextTile>(acc, x, ldx, w, ldw, 0, K);
    }
  } else {
    for (int64_t k0 = 0; k0 < K; k0 += kPanelChunk) {
      const int64_t k1 = std::min(K, k0 + kPanelChunk);
      dot_chunk_bf16<4, NR, ChunkPrefetch::kInRow>(acc, x, ldx, w, ldw, k0, k1);
      const c10::BFloat16* xb = x + kTileRows * ldx;
      __m512* a = acc + kTileRows * kTileCols;
      switch (mr - kTileRows) {
        case 4: dot_chunk_bf16<4, NR, ChunkPrefetch::kNone>(a, xb, ldx, w, ldw, k0, k1); break;  // w chunk is in L1 now
        case 3: dot_chunk_bf16<3, NR, ChunkPrefetch::kNone>(a, xb, ldx, w, ldw, k0, k1); break;
        case 2: dot_chunk_bf16<2, NR, ChunkPrefetch::kNone>(a, xb, ldx, w, ldw, k0, k1); break;
        default: dot_chunk_bf16<1, NR, ChunkPrefetch::kNone>(a, xb, ldx, w, ldw, k0, k1);
      }
    }
  }
  for (int m = 0; m < mr; ++m)
    for (int n = 0; n < NR; ++n) out[m * ldo + n] = _mm512_reduce_add_ps(acc[m * kTileCols + n]);
}
#endif

// Portable path (fp32, fp16 -- this CPU has no avx512_fp16 -- and bf16 without AVX512-BF16):
// widen to fp32 and FMA, Vec::size() lanes per step.
//
// Tiles of up to kStreamRows x rows are bound by the weight stream, and there the hardware prefetcher,
// following four rows at once, left a third of the bandwidth unused on an AVX2 EPYC (16 GB/s, where one
// sequential stream reached 20). They ask for the line kStreamPrefetchBytes ahead of each row into L2:
// the weight rows of consecutive tiles are contiguous, so that is the stream's own future, and for a
// strided weight a prefetch that misses its use costs a line of bandwidth, never a fault. Wider tiles
// are compute-bound and skip it.
constexpr int kStreamRows = 2;
constexpr int64_t kStreamPrefetchBytes = 16 << 10;

// Weight rows per pass of a compute-bound tile: 4 x rows by 2 weight rows (8 accumulators) fit AVX2's
// 16 vector registers, where 4 x 4 spills; AVX-512 has 32.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kFmaTileCols = 4;
#else
constexpr int kFmaTileCols = 2;
#endif

// Calls step(k) for each whole vector of V columns in [k0, k1), and returns where they end. Tiles of
// at most kStreamRows x rows also prefetch (see above), once per 64-byte line of each weight row: the
// loop runs a line of vectors per iteration, so no branch in it asks whether this vector starts a
// line. With that branch GCC kept the accumulators in memory, a store and a reload on every FMA
// chain each step, which held the one-row fp8 GEMV to half the copy bandwidth of an AVX2 EPYC (Zen 3).
template <int MR, int NR, int64_t V, typename TW, typename Step>
__attribute__((always_inline)) inline int64_t for_each_vector(const TW* w, int64_t ldw, int64_t k0, int64_t k1,
                                                              Step&& step) {
  constexpr int64_t kLine = 64 / sizeof(TW);
  static_assert(kLine % V == 0, "a cache line holds whole vectors");
  int64_t k = k0;
  if constexpr (MR <= kStreamRows) {
    for (; k + kLine <= k1; k += kLine) {
      for (int n = 0; n < NR; ++n)
        _mm_prefetch(reinterpret_cast<const char*>(w + n * ldw + k) + kStreamPrefetchBytes, _MM_HINT_T1);
      for (int64_t i = 0; i < kLine; i += V) step(k + i);
    }
  }
  for (; k + V <= k1; k += V) step(k);
  return k;
}

// Frozen e4m3fn weights widen to their values times 2^-120 (widen.h), which would put the products of
// small x and small weights in fp32's subnormal range, where the sums lose precision. x is multiplied
// by 2^64 instead (into the K block's scale where there is one; else one multiply per x vector, which
// the cheaper widening pays for), and nt_task_scaled undoes both.
template <typename TW>
constexpr float kXPrescale = std::is_same_v<TW, Float8_e4m3fn_finite> ? 0x1p64f : 1.f;

// The same tiles read quantized weights (int8, fp8: TW of one byte; x then of its own type TX) with
// their scales, see WeightScales below: with K_BLOCKED, x is multiplied by each K block's scale
// k_scales[k / block_k]; otherwise block_k is K and the caller scales the finished sums.
template <typename TX, typename TW, int MR, int NR, bool K_BLOCKED>
inline void dot_tile_fma(const TX* x, int64_t ldx, const TW* w, int64_t ldw, int64_t K, const float* k_scales,
                         int64_t block_k, float* out, int64_t ldo) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t V = Vec::size();
  Vec acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = Vec(0.f);
  // acc += (x[:, k : k + count] * s) . w[:, k : k + count]^T, one vector deep
  auto fmadd_step = [&](int64_t k, int64_t count, const Vec& s) __attribute__((always_inline)) {
    Vec xv[MR];
    for (int m = 0; m < MR; ++m) {
      xv[m] = count == V ? load_floats(x + m * ldx + k) : load_floats(x + m * ldx + k, count);
      if constexpr (K_BLOCKED || kXPrescale<TW> != 1.f) xv[m] = xv[m] * s;
    }
    for (int n = 0; n < NR; ++n) {
      const Vec wv = count == V ? load_floats(w + n * ldw + k) : load_floats(w + n * ldw + k, count);
      for (int m = 0; m < MR; ++m) acc[m][n] = at::vec::fmadd(xv[m], wv, acc[m][n]);
    }
  };
  for (int64_t k0 = 0; k0 < K; k0 += block_k) {
    const int64_t k1 = std::min(K, k0 + block_k);
    const Vec s((K_BLOCKED ? k_scales[k0 / block_k] : 1.f) * kXPrescale<TW>);
    const auto step = [&](int64_t k) __attribute__((always_inline)) { fmadd_step(k, V, s); };
    const int64_t k = for_each_vector<MR, NR, V>(w, ldw, k0, k1, step);
    if (k < k1) fmadd_step(k, k1 - k, s);  // K's last, partial vector (a K block holds whole vectors)
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n)
      out[m * ldo + n] = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc[m][n]);
}

// W8A8 in integers (AVX2 and AVX-512): x's rows quantized per token to int8 values held as int16
// (quantize_row_int8), the int8 weights sign-extended to int16 in registers, and vpmaddwd multiplying
// lane pairs and adding each pair into an int32 lane, exactly: against widening each weight to fp32
// for an FMA (sign-extend, cvtdq2ps, FMA per 8 weights), that is one sign-extend, one madd and one add
// per 16 weights, half the work per weight byte, which is what held the one-row GEMV below the memory
// bandwidth on an AVX2 EPYC. A lane gains at most 2 * 128 * 128 = 2^15 a step, so its int32 holds
// K < 2^20 (segment_gemm.MAX_INT8_K: the lowerings decline larger K).
#if defined(CPU_CAPABILITY_AVX512)
constexpr bool kIntegerDot = true;
using IntVec = __m512i;
constexpr int64_t kInt16Lanes = 32;
__attribute__((always_inline)) inline IntVec load_int16s(const int16_t* p) { return _mm512_loadu_si512(p); }
__attribute__((always_inline)) inline IntVec widen_int8s(const int8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
__attribute__((always_inline)) inline IntVec madd_int16s(IntVec acc, IntVec x, IntVec w) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, x, w);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(x, w));
#endif
}
inline int32_t reduce_add_int32s(IntVec v) { return _mm512_reduce_add_epi32(v); }
#elif defined(CPU_CAPABILITY_AVX2)
constexpr bool kIntegerDot = true;
using IntVec = __m256i;
constexpr int64_t kInt16Lanes = 16;
__attribute__((always_inline)) inline IntVec load_int16s(const int16_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
__attribute__((always_inline)) inline IntVec widen_int8s(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
__attribute__((always_inline)) inline IntVec madd_int16s(IntVec acc, IntVec x, IntVec w) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(x, w));
}
inline int32_t reduce_add_int32s(IntVec v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}
#else
constexpr bool kIntegerDot = false;
#endif

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// out = float(x[:MR] . w[:NR]^T) over the whole of K, summed in int32.
template <int MR, int NR>
inline void dot_tile_int16(const int16_t* x, int64_t ldx, const int8_t* w, int64_t ldw, int64_t K, float* out,
                           int64_t ldo) {
  constexpr int64_t V = kInt16Lanes;
  IntVec acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = IntVec{};
  const int64_t k = for_each_vector<MR, NR, V>(w, ldw, 0, K, [&](int64_t k) __attribute__((always_inline)) {
    IntVec xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = load_int16s(x + m * ldx + k);
    for (int n = 0; n < NR; ++n) {
      const IntVec wv = widen_int8s(w + n * ldw + k);
      for (int m = 0; m < MR; ++m) acc[m][n] = madd_int16s(acc[m][n], xv[m], wv);
    }
  });
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) {
      int32_t sum = reduce_add_int32s(acc[m][n]);
      for (int64_t j = k; j < K; ++j) sum += int32_t(x[m * ldx + j]) * int32_t(w[n * ldw + j]);  // K's last, partial vector
      out[m * ldo + n] = static_cast<float>(sum);
    }
}

#endif

// Portable panel: row blocks one after the other (the fp32 path is compute-bound well before the
// weight stream matters), each a tile of dot_tile_fma, or of dot_tile_int16 for W8A8's int16 rows.
//
// With more than kStreamRows rows (compute-bound), rows read as they are held (fp32, or int16) pass
// over the weight rows kFmaTileCols at a time, so that the accumulators stay in registers. Rows of
// another type would be widened again for every pass, which costs what the spills do.
template <typename TX, typename TW, int NR, bool K_BLOCKED>
inline void dot_panel_tiles(const TX* x, int64_t ldx, int mr, const TW* w, int64_t ldw, int64_t K,
                            const float* k_scales, int64_t block_k, float* out, int64_t ldo) {
  constexpr bool kIntegerRows = std::is_same_v<TX, int16_t>;
  if constexpr ((std::is_same_v<TX, float> || kIntegerRows) && NR > kFmaTileCols) {
    if (mr > kStreamRows) {
      dot_panel_tiles<TX, TW, kFmaTileCols, K_BLOCKED>(x, ldx, mr, w, ldw, K, k_scales, block_k, out, ldo);
      dot_panel_tiles<TX, TW, NR - kFmaTileCols, K_BLOCKED>(x, ldx, mr, w + kFmaTileCols * ldw, ldw, K, k_scales,
                                                            block_k, out + kFmaTileCols, ldo);
      return;
    }
  }
  auto tile = [&]<int MR>(const TX* xb, float* ob) {
    if constexpr (kIntegerRows) {
      static_assert(std::is_same_v<TW, int8_t> && !K_BLOCKED, "integer tiles are W8A8's: per-channel int8 weights");
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
      dot_tile_int16<MR, NR>(xb, ldx, w, ldw, K, ob, ldo);
#endif
    } else {
      dot_tile_fma<TX, TW, MR, NR, K_BLOCKED>(xb, ldx, w, ldw, K, k_scales, block_k, ob, ldo);
    }
  };
  for (int m0 = 0; m0 < mr; m0 += kTileRows) {
    const TX* xb = x + m0 * ldx;
    float* ob = out + m0 * ldo;
    switch (std::min(kTileRows, mr - m0)) {
      case 4: tile.template operator()<4>(xb, ob); break;
      case 3: tile.template operator()<3>(xb, ob); break;
      case 2: tile.template operator()<2>(xb, ob); break;
      default: tile.template operator()<1>(xb, ob);
    }
  }
}

// What W8A8's quantized rows are held in: int16 for the integer tiles, else fp32 (exact integers,
// which the fp32 tiles multiply by the int8 weights exactly).
using QuantizedInt8 = std::conditional_t<kIntegerDot, int16_t, float>;

template <typename T, int NR>
inline void dot_panel_nr(const T* x, int64_t ldx, int mr, const T* w, int64_t ldw, int64_t K, float* out, int64_t ldo) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    dot_panel_bf16<NR>(x, ldx, mr, w, ldw, K, out, ldo);
    return;
  }
#endif
  dot_panel_tiles<T, T, NR, false>(x, ldx, mr, w, ldw, K, nullptr, K, out, ldo);
}

// out[m, n] for mr (<= 8) x rows against nr (<= 4) w rows, over the whole of k.
template <typename T>
inline void dot_panel(const T* x, int64_t ldx, int mr, const T* w, int64_t ldw, int nr, int64_t K, float* out,
                      int64_t ldo) {
  switch (nr) {
    case 4: return dot_panel_nr<T, 4>(x, ldx, mr, w, ldw, K, out, ldo);
    case 3: return dot_panel_nr<T, 3>(x, ldx, mr, w, ldw, K, out, ldo);
    case 2: return dot_panel_nr<T, 2>(x, ldx, mr, w, ldw, K, out, ldo);
    default: return dot_panel_nr<T, 1>(x, ldx, mr, w, ldw, K, out, ldo);
  }
}

// A GEMM out[M, N] = x[M, K] . w[N, K]^T as parallel tasks: tiles of kTileCols weight rows, each against
// blocks of kMaxPanelRows x rows, tile-major so that a thread reads a weight tile from memory once.
inline int64_t nt_tasks(int64_t M, int64_t N) {
  return (N + kTileCols - 1) / kTileCols * ((M + kMaxPanelRows - 1) / kMaxPanelRows);
}

// Task `task`'s panel: x rows [m0, m0 + mr) against weight rows [n0, n0 + nr).
struct NtPanel {
  int64_t m0, n0;
  int mr, nr;
};

inline NtPanel nt_panel(int64_t task, int64_t M, int64_t N) {
  const int64_t m_blocks = (M + kMaxPanelRows - 1) / kMaxPanelRows;
  const int64_t n0 = task / m_blocks * kTileCols, m0 = task % m_blocks * kMaxPanelRows;
  return {m0, n0, static_cast<int>(std::min<int64_t>(kMaxPanelRows, M - m0)),
          static_cast<int>(std::min<int64_t>(kTileCols, N - n0))};
}

template <typename T>
inline void nt_task(int64_t task, const T* x, int64_t ldx, int64_t M, const T* w, int64_t ldw, int64_t N, int64_t K,
                    float* out, int64_t ldo) {
  const auto [m0, n0, mr, nr] = nt_panel(task, M, N);
  dot_panel<T>(x + m0 * ldx, ldx, mr, w + n0 * ldw, ldw, nr, K, out + m0 * ldo + n0, ldo);
}

// nt_task with its sums rounded into y (row stride ldy), the bias (or null) added first: the panel's
// sums stay in a tile on the stack, so a GEMM needs no M x N scratch (mla::linear's: a prefill's lm_head
// would need gigabytes of it).
template <typename T>
inline void nt_task_rounded(int64_t task, const T* x, int64_t ldx, int64_t M, const T* w, int64_t ldw, int64_t N,
                            int64_t K, const T* bias, T* y, int64_t ldy) {
  const auto [m0, n0, mr, nr] = nt_panel(task, M, N);
  alignas(64) float tile[kMaxPanelRows * kTileCols];
  dot_panel<T>(x + m0 * ldx, ldx, mr, w + n0 * ldw, ldw, nr, K, tile, kTileCols);
  store_rows_rounded(tile, kTileCols, mr, nr, bias ? bias + n0 : nullptr, y + m0 * ldy + n0, ldy);
}

// Quantized weights: int8 or fp8 e4m3fn (one byte an element) in nn.Linear's [N, K], with fp32 scales
// per block of block_n weight rows by block_k columns: scale[(n / block_n) * ld + k / block_k].
// Per-channel scales are blocks of 1 x K. At decode the weight stream is the cost, and these are
// half a bf16 weight's bytes; each element is widened to fp32 in registers, never materialised.
struct WeightScales {
  const float* scale;
  int64_t block_n, block_k, ld;
};

// With several K blocks (block_k < K) a weight row has a scale per K block. A tile's kTileCols rows lie
// in one block of rows (block_n % kTileCols == 0, which the lowering requires), so their scale is one
// number per K block, and it multiplies the x vectors (MR multiplies per MR x NR FMAs) rather than
// partial sums that would need a second set of accumulators (dot_tile_fma's K_BLOCKED). With one K
// block, the scale multiplies the finished sums (per column, as per-channel scales need).
template <typename TX, typename TW, bool K_BLOCKED>
inline void dot_panel_scaled(const TX* x, int64_t ldx, int mr, const TW* w, int64_t ldw, int nr, int64_t K,
                             const float* k_scales, int64_t block_k, float* out, int64_t ldo) {
  static_assert(sizeof(TW) == 1, "quantized weights are int8 or fp8");
  switch (nr) {
    case 4: return dot_panel_tiles<TX, TW, 4, K_BLOCKED>(x, ldx, mr, w, ldw, K, k_scales, block_k, out, ldo);
    case 3: return dot_panel_tiles<TX, TW, 3, K_BLOCKED>(x, ldx, mr, w, ldw, K, k_scales, block_k, out, ldo);
    case 2: return dot_panel_tiles<TX, TW, 2, K_BLOCKED>(x, ldx, mr, w, ldw, K, k_scales, block_k, out, ldo);
    default: return dot_panel_tiles<TX, TW, 1, K_BLOCKED>(x, ldx, mr, w, ldw, K, k_scales, block_k, out, ldo);
  }
}

// nt_task over a quantized weight: the same tasks (nt_tasks), each tile's sums scaled into out. x is
// the activations, or their per-token quantized values (quantize_row: int8 values in QuantizedInt8,
// FP8 values in fp32), whose scales `row_scales` then multiply each output row.
template <typename TX, typename TW>
inline void nt_task_scaled(int64_t task, const TX* x, int64_t ldx, const float* row_scales, int64_t M, const TW* w,
                           int64_t ldw, int64_t N, int64_t K, const WeightScales& scales, float* out, int64_t ldo) {
  const auto [m0, n0, mr, nr] = nt_panel(task, M, N);
  const TX* xt = x + m0 * ldx;
  const TW* wt = w + n0 * ldw;
  float* ot = out + m0 * ldo + n0;
  // W8A8's int16 rows come with per-channel weight scales only (ops/weight_quant.py)
  constexpr bool kPerChannelOnly = std::is_same_v<TX, int16_t>;
  const bool k_blocked = !kPerChannelOnly && scales.block_k < K;
  if constexpr (!kPerChannelOnly) {
    if (k_blocked) {
      const float* k_scales = scales.scale + n0 / scales.block_n * scales.ld;
      dot_panel_scaled<TX, TW, true>(xt, ldx, mr, wt, ldw, nr, K, k_scales, scales.block_k, ot, ldo);
    }
  }
  if (!k_blocked) {
    dot_panel_scaled<TX, TW, false>(xt, ldx, mr, wt, ldw, nr, K, nullptr, K, ot, ldo);
  }
  for (int m = 0; m < mr; ++m) {
    // undo the widening's factor and x's
    const float row = (row_scales ? row_scales[m0 + m] : 1.f) / (kWidenedScale<TW> * kXPrescale<TW>);
    for (int n = 0; n < nr; ++n) {
      const float column = k_blocked ? 1.f : scales.scale[(n0 + n) / scales.block_n * scales.ld];
      ot[m * ldo + n] *= row * column;
    }
  }
}

// Per-token symmetric int8 quantization of a row (W8A8), q kept as integers in QuantizedInt8: int16
// for the integer tiles; fp32 elsewhere, which the fp32 tiles multiply by the int8 weights exactly,
// each lane summing K / lanes products of at most 128 x 128, exactly while there are at most 1024 of
// them (K <= 8192 without AVX2): then only the reduction across lanes rounds, as the fp32 epilogue of
// an int32 GEMM does. The schemes (ops/weight_quant.py), each rounding half to even:
// - kSglang: q = round(x * (127 / absmax)) with absmax = max(|x|, 1e-7); scale absmax / 127;
// - kTorchao: scale = absmax / 127.5 rounded to T, at least FLT_EPSILON (and rounded to T again),
//   q = round(x * (1 / scale)) in [-128, 127].
// Returns the row's scale. kNone is weight-only quantization: see quantize_row.
enum class ActivationQuant { kNone, kSglang, kTorchao, kFp8Row, kFp8Static };

template <ActivationQuant scheme, typename T>
inline float quantize_row_int8(const T* x, int64_t K, QuantizedInt8* q) {
  using Vec = at::vec::Vectorized<float>;
  float absmax = 0.f;
  for (int64_t k = 0; k < K; ++k) absmax = std::max(absmax, std::abs(static_cast<float>(x[k])));
  float scale, inverse, lowest;
  if constexpr (scheme == ActivationQuant::kSglang) {
    absmax = std::max(absmax, 1e-7f);
    scale = absmax / 127.f, inverse = 127.f / absmax, lowest = -127.f;
  } else {
    scale = static_cast<float>(static_cast<T>(absmax / 127.5f));
    scale = static_cast<float>(static_cast<T>(std::max(scale, std::numeric_limits<float>::epsilon())));
    inverse = 1.f / scale, lowest = -128.f;
  }
  const Vec multiplier(inverse), low(lowest), high(127.f);
  for (int64_t k = 0; k < K; k += Vec::size()) {
    const int64_t count = std::min<int64_t>(Vec::size(), K - k);
    const Vec v = at::vec::clamp((load_floats(x + k, count) * multiplier).round(), low, high);
    if constexpr (std::is_same_v<QuantizedInt8, float>) {
      v.store(q + k, count);
    } else {
      alignas(64) float values[Vec::size()];
      v.store(values);
      for (int64_t i = 0; i < count; ++i) q[k + i] = static_cast<QuantizedInt8>(values[i]);
    }
  }
  return scale;
}

// The Neuron qkv kernel's FP8 quantization of a row (ops/weight_quant.py): q = e4m3fn(clamp(x * (1 /
// scale), +-448)) kept in fp32 (exactly: every e4m3fn value is an fp32), scale = max(|x|, 1e-12) / 448
// (kFp8Row) or the given `static_scale` (kFp8Static). Returns the scale.
template <ActivationQuant scheme, typename T>
inline float quantize_row_fp8(const T* x, int64_t K, float* q, float static_scale) {
  constexpr float kMax = 448.f;
  float scale = static_scale;
  if constexpr (scheme == ActivationQuant::kFp8Row) {
    float absmax = 0.f;
    for (int64_t k = 0; k < K; ++k) absmax = std::max(absmax, std::abs(static_cast<float>(x[k])));
    scale = std::max(absmax, 1e-12f) / kMax;
  }
  const float inverse = 1.f / scale;
  for (int64_t k = 0; k < K; ++k) {
    const float v = std::clamp(static_cast<float>(x[k]) * inverse, -kMax, kMax);
    q[k] = static_cast<float>(c10::Float8_e4m3fn(v));
  }
  return scale;
}

constexpr bool is_fp8_scheme(ActivationQuant scheme) {
  return scheme == ActivationQuant::kFp8Row || scheme == ActivationQuant::kFp8Static;
}

// What a row quantized by `scheme` is held in: int8 values in QuantizedInt8, the others in fp32.
template <ActivationQuant scheme>
using QuantizedRow = std::conditional_t<scheme == ActivationQuant::kSglang || scheme == ActivationQuant::kTorchao,
                                        QuantizedInt8, float>;

// A row as the quantized tiles read it: quantized by `scheme` (static_scale: kFp8Static's), returning
// its scale; or with kNone (weight-only: activations stay as they are) widened to fp32, scale 1. Once
// per row, not once per tile: with more than kStreamRows rows the fp32 tiles then neither widen x
// again for every weight tile nor spill (dot_panel_tiles); weight-only int8 at 8 rows ran 1.36x faster
// so on an AVX2 EPYC.
template <ActivationQuant scheme, typename T>
inline float quantize_row(const T* x, int64_t K, QuantizedRow<scheme>* q, float static_scale) {
  if constexpr (scheme == ActivationQuant::kNone) {
    widen_row(x, K, q);
    return 1.f;
  } else if constexpr (is_fp8_scheme(scheme)) {
    return quantize_row_fp8<scheme>(x, K, q, static_scale);
  } else {
    return quantize_row_int8<scheme>(x, K, q);
  }
}

// 1 / sqrt(mean(x^2) + eps) of an fp32 row.
inline float inverse_rms(const float* row, int64_t n, float eps) {
  float sum_sq = 0.f;
  for (int64_t i = 0; i < n; ++i) sum_sq += row[i] * row[i];
  return 1.f / std::sqrt(sum_sq / static_cast<float>(n) + eps);
}

// RMSNorm of one fp32 row into the output dtype, rounding once: y = x * rsqrt(mean(x^2) + eps) * weight.
template <typename T>
inline void rms_norm_row(const float* row, int64_t n, const T* weight, float eps, T* out) {
  const float scale = inverse_rms(row, n, eps);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(row[i] * scale * static_cast<float>(weight[i]));
}

// The same for one attention head in the projection's fp32 epilogue (gqa_qkv.cpp.j2: Qwen3's and
// Gemma-3's q_norm and k_norm), rounded where transformers rounds, so that the fused output equals
// eager's: x rounded to T (the Linear's output), normalised in fp32, then either rounded to T, times the
// weight, rounded to T (Llama's and Qwen3's RMSNorm), or, GEMMA, times 1 + weight in fp32 and rounded
// once (Gemma's). The results go back into x as floats (each a T value) for the RoPE and the store that
// follow. A head is a few hundred values a token: the scalar loops cost nothing next to the GEMM's
// weight stream.
template <bool GEMMA, typename T>
inline void rms_norm_head(float* x, const T* weight, int64_t n, float eps) {
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(static_cast<T>(x[i]));
  const float scale = inverse_rms(x, n, eps);
  for (int64_t i = 0; i < n; ++i) {
    const float w = static_cast<float>(weight[i]);
    if constexpr (GEMMA) {
      x[i] = static_cast<float>(static_cast<T>(x[i] * scale * (1.f + w)));
    } else {
      x[i] = static_cast<float>(static_cast<T>(w * static_cast<float>(static_cast<T>(x[i] * scale))));
    }
  }
}

}  // namespace mla_inductor
