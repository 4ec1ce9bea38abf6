// Flash decoding over a paged cache: micro-kernels for mla::latent_decode_attention and
// mla::gqa_decode_attention.
//
// A decode step reads every cache row once and dots it with all heads' queries: MQA in latent space
// (K_j = c_kv_j | k_pe_j, V_j = c_kv_j, the same memory), or one key/value head of grouped-query
// attention with its group of query heads (V_j a row of its own cache). A task owns one request and
// one contiguous split of its rows, walks them in blocks of kKvBlock rows, and keeps per head a running
// max m, a running sum l and an unnormalised fp32 output o (online softmax). Splits are merged by
// their log-sum-exp afterwards.
//
// With AVX512-BF16 both products run on _mm512_dpbf16_ps:
//   scores = q . K_j^T  -- NT form, heads x rows register tiles, reduced across lanes per tile;
//   o     += p . V      -- p is rounded to bf16 and broadcast as (p_j, p_j+1) pairs, the V rows are
//                          interleaved pairwise on the fly; o's columns come out permuted within each
//                          32-column chunk (see paired_column) and are put back in order at the merge.
// An fp8 cache takes them too where the CPU has no AMX: converted by table in registers for heads that
// fit one score tile (reads_fp8_as_bf16, with VBMI), else a tile of rows at a time into a thread's
// scratch (converts_fp8_to_bf16).
// Otherwise (AVX2 CPUs, fp16, fp32) each row is widened to fp32 once, by the first head tile that reads
// it, which also stores the copy in a thread's scratch; the other head tiles and the P.V pass read that
// copy from L1/L2 (widening in every tile would redo the conversion once per head tile and per pass).
// Heads that fit one score tile (a grouped-query group) need no copy: both products widen straight from
// the cache (widens_from_cache).
// Both products are fp32 FMA register tiles sized to the vector register file (16 ymm on AVX2).
#pragma once
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace mla_inductor {

// Rows per online-softmax step: all heads' scores and probabilities for one block stay in L1 (22 heads:
// 11 + 6 KiB), and the block's rows (128 x 1152 B) are still in L2 when the P.V pass reads them a
// second time. 128 measured 2-3% faster than 64 (fewer rescales of o), 32 slower.
constexpr int kKvBlock = 128;
// Score tiles are up to kQkHeads heads x kQkRows rows: 24 accumulators + 4 row vectors + 1 query vector.
constexpr int kQkHeads = 6;
constexpr int kQkRows = 4;
// P.V tiles are up to kPvHeads heads x 32 columns (two accumulators per head) + 5 working registers.
constexpr int kPvHeads = 12;
// The score pass prefetches the rows kPrefetchTiles row tiles ahead into L2 (see qk_segment_bf16).
constexpr int kPrefetchTiles = 2;

// Calls f.template operator()<N>() for the runtime n in [1, MAX].
template <int MAX, typename F>
__attribute__((always_inline)) inline void dispatch_count(int n, F&& f) {
  if constexpr (MAX > 1) {
    if (n < MAX) return dispatch_count<MAX - 1>(n, f);
  }
  f.template operator()<MAX>();
}

// f(i, count, id, offset) for each run of rows j0 + i .. j0 + i + count - 1 (within j0 .. j0 + n - 1) of one
// request that lies in one block: row j lives at offset j % bs of the block whose id is table[j / bs].
// One division per call (a 64-bit division costs tens of cycles, the dot products of a grouped-query row
// a hundred or so) and one lookup per block; the callers step through a run by a stride. (A lookup and
// two multiplies per row, for the row pointers alone, were 9% of a grouped-query e5m2 row on one thread:
// 35.9 -> 32.8 ns, benchmarks/attend_split.py.)
template <typename IndexT, typename F>
__attribute__((always_inline)) inline void for_each_run(int64_t block_size, const IndexT* table, int64_t j0, int n,
                                                        F&& f) {
  if (n <= 0) return;  // j0 may be the end of the table
  int64_t block = j0 / block_size, offset = j0 % block_size;
  for (int i = 0; i < n; ++block, offset = 0) {
    const int count = static_cast<int>(std::min<int64_t>(block_size - offset, n - i));
    f(i, count, static_cast<int64_t>(table[block]), offset);
    i += count;
  }
}

// Row pointers for rows [j0, j0 + n) of one request in a cache of rows row_stride apart.
template <typename T, typename IndexT>
inline void gather_rows(const T* cache, int64_t block_size, int64_t row_stride, const IndexT* table, int64_t j0,
                        int n, const T** rows) {
  for_each_run(block_size, table, j0, n, [&](int i, int count, int64_t id, int64_t offset) {
    const T* row = cache + (id * block_size + offset) * row_stride;
    for (int r = 0; r < count; ++r, row += row_stride) rows[i + r] = row;
  });
}

// The rows of one score tile: key[n] holds K_n (or its first part, when the rope part lives in a
// cache of its own), rope[n] the rest; *_to_l2 rows kPrefetchTiles tiles ahead and *_to_l1 rows of the
// next tile, for the prefetches.
template <typename T>
struct KeyTile {
  const T* const* key;
  const T* const* rope;
  const T* const* key_to_l2;
  const T* const* rope_to_l2;
  const T* const* key_to_l1;
  const T* const* rope_to_l1;
};

#if defined(__AVX512F__)
// The four horizontal sums of a0..a3 as one 128-bit vector (cheaper than four full reductions).
__attribute__((always_inline)) inline __m128 reduce_add_4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 t01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 t23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t01, t23, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(t01, t23, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 v = _mm256_add_ps(_mm512_castps512_ps256(u),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
}
#endif

#if defined(__AVX2__)
// The same for AVX2's eight lanes: 11 instructions for four sums, where four separate reductions take
// 24 (a 4-head score tile of grouped-query decode reduces as many vectors per row as it multiplies).
__attribute__((always_inline)) inline __m128 reduce_add_4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 t01 = _mm256_add_ps(_mm256_unpacklo_ps(a0, a1), _mm256_unpackhi_ps(a0, a1));
  const __m256 t23 = _mm256_add_ps(_mm256_unpacklo_ps(a2, a3), _mm256_unpackhi_ps(a2, a3));
  const __m256 u = _mm256_add_ps(_mm256_shuffle_ps(t01, t23, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(t01, t23, _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}
#endif

inline float reduce_add(const at::vec::Vectorized<float>& v) {
  return at::vec::vec_reduce_all<float>([](auto& a, auto& b) { return a + b; }, v);
}
#if defined(__AVX512F__)
inline float reduce_add(__m512 v) { return _mm512_reduce_add_ps(v); }
#endif

// dst[0..N) = scale * the horizontal sums of acc[0..N) (V: Vectorized<float>, or __m512 with AVX-512).
template <int N, typename V>
__attribute__((always_inline)) inline void horizontal_sums(const V (&acc)[N], float* dst, float scale = 1.f) {
#if defined(__AVX512F__)
  if constexpr (N == 4 && sizeof(V) == sizeof(__m512)) {
    _mm_storeu_ps(dst, _mm_mul_ps(_mm_set1_ps(scale), reduce_add_4(acc[0], acc[1], acc[2], acc[3])));
    return;
  }
#endif
#if defined(__AVX2__)
  if constexpr (N >= 2 && N <= 4 && sizeof(V) == sizeof(__m256)) {  // missing vectors sum as zeros
    auto vector = [&](int n) -> __m256 { return n < N ? __m256(acc[n]) : _mm256_setzero_ps(); };
    const __m128 sums = _mm_mul_ps(_mm_set1_ps(scale), reduce_add_4(vector(0), vector(1), vector(2), vector(3)));
    if constexpr (N == 4) {
      _mm_storeu_ps(dst, sums);
    } else {
      _mm_storel_pi(reinterpret_cast<__m64*>(dst), sums);
      if constexpr (N == 3) _mm_store_ss(dst + 2, _mm_movehl_ps(sums, sums));
    }
    return;
  }
#endif
  for (int n = 0; n < N; ++n) dst[n] = scale * reduce_add(acc[n]);
}

#if defined(__AVX512BF16__)
// Column of o that lane i of a 32-column chunk holds: _mm512_unpack{lo,hi}_epi16 interleave two rows
// within 128-bit lanes, so the "lo" accumulator (i < 16) gets columns 8q..8q+3 and "hi" 8q+4..8q+7.
inline int paired_column(int i) {
  const int lane = i & 15;
  return 8 * (lane >> 2) + (i >= 16 ? 4 : 0) + (lane & 3);
}

// acc[h][n] += q[h, 0:D] . rows[n][0:D] for MH heads x NR rows, and two prefetches of PREFETCH rows
// each, one line per row per k-step: rows of a later tile into L2 (`to_l2`), rows of the next tile into
// L1 (`to_l1`). The cache rows are the one stream from memory and the hardware prefetcher does not run
// far enough ahead on a few short, scattered rows: without the prefetch the kernel runs 35% slower. The
// head tiles of a row tile share the rows between them (with 22 heads: one row each), so that the misses
// in flight stay few enough for the miss buffers; when the first head tile asked for all of them, it
// stalled on the prefetches (0-6% slower). From memory, the L2 hint measured faster than L1; moving the
// next tile to L1 as well is 1-4.5% faster (the first head tile of a row tile waited on its loads).
//
// Rows of an fp8 cache (reads_fp8_as_bf16) are converted in registers, 64 values (a line) a step, by the
// byte tables (amx_tiles.h); zero bytes past a row's end convert to zeros, and the query's loads there
// are masked.
template <int64_t D, int MH, int NR, int PREFETCH, typename C>
__attribute__((always_inline)) inline void qk_segment_bf16(__m512 (&acc)[MH][NR], const c10::BFloat16* q,
                                                           int64_t ldq, const C* const* rows, const C* const* to_l2,
                                                           const C* const* to_l1) {
  // (always_inline: a call that only prefetches has no effect GCC must keep, and it drops one it does not
  // inline; so for every helper that only prefetches)
  auto prefetch = [&](int64_t k) __attribute__((always_inline)) {
    if constexpr (PREFETCH > 0) {
      for (int n = 0; n < PREFETCH; ++n) _mm_prefetch(reinterpret_cast<const char*>(to_l2[n] + k), _MM_HINT_T1);
      for (int n = 0; n < PREFETCH; ++n) _mm_prefetch(reinterpret_cast<const char*>(to_l1[n] + k), _MM_HINT_T0);
    }
  };
  if constexpr (std::is_same_v<C, c10::BFloat16>) {
    auto step = [&](int64_t k, auto load) {
      __m512bh kv[NR];
      for (int n = 0; n < NR; ++n) kv[n] = load(rows[n] + k);
      prefetch(k);
      for (int h = 0; h < MH; ++h) {
        const __m512bh qv = load(q + h * ldq + k);
        for (int n = 0; n < NR; ++n) acc[h][n] = _mm512_dpbf16_ps(acc[h][n], qv, kv[n]);
      }
    };
    for (int64_t k = 0; k + 32 <= D; k += 32)
      step(k, [](const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); });
    if constexpr (D % 32 != 0) {
      constexpr __mmask32 mask = (__mmask32(1) << (D % 32)) - 1;  // zero lanes add 0
      step(D - D % 32, [](const c10::BFloat16* p) { return (__m512bh)_mm512_maskz_loadu_epi16(mask, p); });
    }
  } else {
#if defined(__AVX512VBMI__)
    const Bf16Table table = fp8_bf16_table<C>();
    // (masked query loads only in the tail step: with all-ones masks they measured slower, inductor_notes.md)
    auto step = [&](int64_t k, int count, auto load_query) {
      __m512i first[NR], second[NR];
      for (int n = 0; n < NR; ++n) load_fp8x64_as_bf16(rows[n] + k, table, first[n], second[n], count);
      prefetch(k);
      for (int h = 0; h < MH; ++h) {
        __m512bh q0, q1;
        load_query(q + h * ldq + k, q0, q1);
        for (int n = 0; n < NR; ++n) {
          acc[h][n] = _mm512_dpbf16_ps(acc[h][n], q0, (__m512bh)first[n]);
          acc[h][n] = _mm512_dpbf16_ps(acc[h][n], q1, (__m512bh)second[n]);
        }
      }
    };
    for (int64_t k = 0; k + 64 <= D; k += 64)
      step(k, 64, [](const c10::BFloat16* p, __m512bh& q0, __m512bh& q1) __attribute__((always_inline)) {
        q0 = (__m512bh)_mm512_loadu_si512(p);
        q1 = (__m512bh)_mm512_loadu_si512(p + 32);
      });
    if constexpr (D % 64 != 0) {
      constexpr int kTail = D % 64;
      static constexpr __mmask32 kFirst = kTail >= 32 ? ~__mmask32(0) : (__mmask32(1) << kTail) - 1;
      static constexpr __mmask32 kSecond = kTail <= 32 ? __mmask32(0) : (__mmask32(1) << (kTail - 32)) - 1;
      step(D - kTail, kTail, [](const c10::BFloat16* p, __m512bh& q0, __m512bh& q1) __attribute__((always_inline)) {
        q0 = (__m512bh)_mm512_maskz_loadu_epi16(kFirst, p);
        q1 = (__m512bh)_mm512_maskz_loadu_epi16(kSecond, p + 32);
      });
    }
#endif
  }
}

// s[h * lds + n] = scale * q[h] . K_n, K_n = key[n][0:D1] | rope[n][0:D2] (D2 = 0: one row holds all).
template <int64_t D1, int64_t D2, int MH, int NR, int PREFETCH, typename C>
inline void qk_tile_bf16(const c10::BFloat16* q, int64_t ldq, const KeyTile<C>& tile, float scale, float* s,
                         int64_t lds) {
  __m512 acc[MH][NR];
  for (int h = 0; h < MH; ++h)
    for (int n = 0; n < NR; ++n) acc[h][n] = _mm512_setzero_ps();
  qk_segment_bf16<D1, MH, NR, PREFETCH>(acc, q, ldq, tile.key, tile.key_to_l2, tile.key_to_l1);
  if constexpr (D2 > 0)
    qk_segment_bf16<D2, MH, NR, PREFETCH>(acc, q + D1, ldq, tile.rope, tile.rope_to_l2, tile.rope_to_l1);
  for (int h = 0; h < MH; ++h) horizontal_sums<NR>(acc[h], s + h * lds, scale);
}

// o[h, chunk c] = alpha[h] * o[h, chunk c] + sum_j p[h, j] V_j[c .. c + 32), MH heads, n_pairs row pairs;
// alpha = nullptr: o = sum_j ..., o is not read. p rows hold bf16 probabilities with an even count (a zero
// pads an odd block).
template <int MH, typename C>
inline void pv_tile_bf16(const c10::BFloat16* p, int64_t ldp, const C* const* rows, int n_pairs, int64_t c,
                         const float* alpha, float* o, int64_t ldo) {
  __m512 lo[MH], hi[MH];
  for (int h = 0; h < MH; ++h) {
    if (alpha == nullptr) {
      lo[h] = hi[h] = _mm512_setzero_ps();
      continue;
    }
    const __m512 a = _mm512_set1_ps(alpha[h]);
    lo[h] = _mm512_mul_ps(a, _mm512_loadu_ps(o + h * ldo + c));
    hi[h] = _mm512_mul_ps(a, _mm512_loadu_ps(o + h * ldo + c + 16));
  }
  // the value pairs of rows 2 pr and 2 pr + 1, columns c .. c + 32 (paired_column's order)
  auto value_pairs = [&]() {
    if constexpr (std::is_same_v<C, c10::BFloat16>) {
      return [&](int pr, __m512i& v_lo, __m512i& v_hi) __attribute__((always_inline)) {
        const __m512i r0 = _mm512_loadu_si512(rows[2 * pr] + c);
        const __m512i r1 = _mm512_loadu_si512(rows[2 * pr + 1] + c);
        v_lo = _mm512_unpacklo_epi16(r0, r1);
        v_hi = _mm512_unpackhi_epi16(r0, r1);
      };
    } else {
#if defined(__AVX512VBMI__)
      return [&, table = fp8_bf16_table<C>()](int pr, __m512i& v_lo, __m512i& v_hi) __attribute__((always_inline)) {
        fp8_pairs_to_bf16(rows[2 * pr] + c, rows[2 * pr + 1] + c, table, v_lo, v_hi);
      };
#endif
    }
  }();
  for (int pr = 0; pr < n_pairs; ++pr) {
    __m512i v_lo, v_hi;
    value_pairs(pr, v_lo, v_hi);
    for (int h = 0; h < MH; ++h) {
      int32_t pair;
      std::memcpy(&pair, p + h * ldp + 2 * pr, sizeof(pair));
      const __m512bh pp = (__m512bh)_mm512_set1_epi32(pair);
      lo[h] = _mm512_dpbf16_ps(lo[h], pp, (__m512bh)v_lo);
      hi[h] = _mm512_dpbf16_ps(hi[h], pp, (__m512bh)v_hi);
    }
  }
  for (int h = 0; h < MH; ++h) {
    _mm512_storeu_ps(o + h * ldo + c, lo[h]);
    _mm512_storeu_ps(o + h * ldo + c + 16, hi[h]);
  }
}
#endif

// Register tiles of the portable kernels. AVX2 has 16 vector registers: a 4 x 3 score tile keeps its 12
// accumulators, 3 key vectors and one query vector at a time in registers (7 loads feed 12 FMAs); a
// 6-head P.V tile keeps 6 x 2 accumulators, 2 value vectors and a broadcast probability (8 loads for 12
// FMAs). AVX-512 has 32.
constexpr int kQkHeadsFp32 = 4;
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kQkRowsFp32 = 4;
constexpr int kPvHeadsFp32 = 12;
#else
constexpr int kQkRowsFp32 = 3;
constexpr int kPvHeadsFp32 = 6;
#endif

constexpr int kPvVecsFp32 = 2;  // vectors of columns per P.V tile

// v, kept in a register. A score tile multiplies each query vector by every key vector of the step and
// each key vector by every query vector; GCC folds one of the two into every FMA as a memory operand,
// which loads it once per FMA: the 3 x 3 tile issued 12 vector loads for 9 FMAs, and Zen 3's L1 serves
// two a cycle. One core over a block of 22 heads x 128 rows (fp32, 576 columns): 45 GFLOP/s so, 75 with
// both kinds of vector pinned, 85 as a 4 x 3 tile; benchmarks/mla_decode.py 1.15-1.29x (docs/isa.md).
// (The grouped-query tiles, which widen their rows in registers, measured the same with it.)
__attribute__((always_inline)) inline at::vec::Vectorized<float> in_register(at::vec::Vectorized<float> v) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 r = v;
  asm("" : "+v"(r));
  return r;
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 r = v;
  asm("" : "+x"(r));
  return r;
#else
  return v;
#endif
}

// Up to kDirectHeads heads (a grouped-query group, a few MLA heads per rank) fit one score tile of
// kDirectRows rows (on AVX2 3 rows fit the registers too, but measured no faster). Then every row is read
// by one tile only, and both products widen it straight from the cache: the fp32 copy in scratch, which
// pays for itself by serving the other head tiles, would only cost a store and a reload (the block's
// copies overflow L1). benchmarks/gqa_decode.py on an AVX2 EPYC: 30.0 -> 22.4 ms, with the value rows
// prefetched by the score pass (which the copy into scratch used to do).
constexpr int kDirectHeads = 4;
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kDirectRows = 4;
#else
constexpr int kDirectRows = 2;
#endif
// Whether the portable kernels for H heads widen straight from the cache (no fp32 copies of the rows).
constexpr bool widens_from_cache(int H) { return H <= kDirectHeads; }

// Whether those kernels read a bf16 cache sixteen values at a time in pairs (widen_bf16x16_paired): on
// AVX2, where the in-order widening (a zero-extending load and a shift per eight values) ran on the
// pipes the FMAs need (that EPYC retired about one ymm FMA a cycle per core, and a grouped-query row of
// 4 heads takes 4 per 8 values).
template <typename C, int H>
constexpr bool pairs_columns() {
#if defined(CPU_CAPABILITY_AVX2)
  return std::is_same_v<C, c10::BFloat16> && widens_from_cache(H);
#else
  return false;
#endif
}

#if defined(CPU_CAPABILITY_AVX2)
// Sixteen bf16 widened to fp32 by one load and two in-lane unpacks with zeros: `lo` holds columns 0-3 and
// 8-11, `hi` 4-7 and 12-15. The score tiles multiply them by a query stored in the same order
// (pair_columns); the P.V tiles leave o's columns so, and restore_column_order puts them back.
__attribute__((always_inline)) inline void widen_bf16x16_paired(const c10::BFloat16* p, __m256& lo, __m256& hi) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), bits));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), bits));
}
#endif

// Whether the portable tiles that read rows of W straight from the cache widen them two vectors at a time
// (widen_two_vectors): bf16 on AVX2, in pairs (the order pairs_columns puts the query in: score and P.V
// tiles); fp8 on AVX-512, 32 values in order (widen_fp8x32: the score tiles only).
template <typename W>
constexpr bool widens_two_vectors() {
#if defined(CPU_CAPABILITY_AVX512)
  return is_fp8<W> && !std::is_same_v<W, Float8_e4m3fn_finite>;
#elif defined(CPU_CAPABILITY_AVX2)
  return std::is_same_v<W, c10::BFloat16>;
#else
  return false;
#endif
}

template <typename W>
__attribute__((always_inline)) inline void widen_two_vectors(const W* p, at::vec::Vectorized<float>& lo,
                                                             at::vec::Vectorized<float>& hi) {
  static_assert(widens_two_vectors<W>());
#if defined(CPU_CAPABILITY_AVX512)
  __m512 a, b;
  widen_fp8x32(p, a, b);
  lo = a, hi = b;
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 a, b;
  widen_bf16x16_paired(p, a, b);
  lo = a, hi = b;
#endif
}

// Swaps columns 4-7 and 8-11 of every whole run of sixteen in row[0, n): the order of
// widen_bf16x16_paired to natural order and back.
inline void pair_columns(float* row, int64_t n) {
  for (int64_t i = 0; i + 16 <= n; i += 16) std::swap_ranges(row + i + 4, row + i + 8, row + i + 8);
}

// Value rows for the P.V tiles: fp32 rows `ld` apart; a block's cache rows (`const T* const*`) serve as is.
struct StridedRows {
  const float* v;
  int64_t ld;
  const float* operator[](int j) const { return v + j * ld; }
};

// s[h * lds + n] = scale * q[h] . k[n] for MH heads x NR rows of D fp32 columns (q rows and k rows D apart).
template <int64_t D, int MH, int NR>
inline void qk_tile_fp32(const float* q, const float* k, float scale, float* s, int64_t lds) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t W = Vec::size();
  Vec acc[MH][NR];
  for (int h = 0; h < MH; ++h)
    for (int n = 0; n < NR; ++n) acc[h][n] = Vec(0.f);
  auto step = [&](int64_t i, int64_t count) __attribute__((always_inline)) {
    Vec kv[NR];
    for (int n = 0; n < NR; ++n)
      kv[n] = in_register(count == W ? Vec::loadu(k + n * D + i) : Vec::loadu(k + n * D + i, count));
    for (int h = 0; h < MH; ++h) {
      const Vec qv = in_register(count == W ? Vec::loadu(q + h * D + i) : Vec::loadu(q + h * D + i, count));
      for (int n = 0; n < NR; ++n) acc[h][n] = at::vec::fmadd(qv, kv[n], acc[h][n]);
    }
  };
  for (int64_t i = 0; i + W <= D; i += W) step(i, W);
  if constexpr (D % W != 0) step(D - D % W, D % W);  // partial loads zero-fill
  for (int h = 0; h < MH; ++h) horizontal_sums<NR>(acc[h], s + h * lds, scale);
}

// Rows ahead whose chunk the P.V tiles prefetch into L1 when they read the block's fp32 copies
// (StridedRows): those rows lie a key row apart (2304 bytes for MLA's 576 columns), a stride the
// hardware prefetchers did not follow, and each row's loads waited on L2. One core of the Cascade Lake
// Xeon, a latent task of 22 heads (benchmarks/attend_split.py): 582 -> 551 ns a bf16 row in L3, 638 ->
// 604 from memory; 536 and 553 with the score pass's prefetches spread too (block_scores_fp32): 1.09-1.17x
// a bf16 row, 1.04-1.21x an fp8 one, 1.03x on AVX2. 2, 4 or 8 rows ahead alike.
constexpr int kPvPrefetchRows = 4;

// o[h, c .. c + C * W) = alpha[h] * o + sum_j p[h, j] v[j][c ..] for MH heads over n value rows (widened
// on load; alpha = nullptr: o is not read). Kept free of lambdas and of partial-vector branches: with
// either, GCC kept the accumulators on the stack and stored all of them every row (1.5x slower).
template <int MH, int C, typename Rows>
inline void pv_tile_fp32(const float* p, int64_t ldp, Rows v, int n, int64_t c, const float* alpha, float* o,
                         int64_t ldo) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int W = Vec::size();
  Vec acc[MH][C];
  for (int h = 0; h < MH; ++h)
    for (int i = 0; i < C; ++i) acc[h][i] = alpha ? Vec(alpha[h]) * Vec::loadu(o + h * ldo + c + i * W) : Vec(0.f);
  for (int j = 0; j < n; ++j) {
    if constexpr (std::is_same_v<Rows, StridedRows>) {
      const char* ahead = reinterpret_cast<const char*>(v[std::min(j + kPvPrefetchRows, n - 1)] + c);
      for (int64_t byte = 0; byte < C * W * int64_t(sizeof(float)); byte += 64) _mm_prefetch(ahead + byte, _MM_HINT_T0);
    }
    Vec vv[C];
    using Row = std::remove_cv_t<std::remove_pointer_t<std::remove_cvref_t<decltype(v[j])>>>;
    // bf16 rows on AVX2 in pairs, the order the score tiles pair the query in (pairs_columns); fp8 rows
    // sixteen values at a time (widen_fp8x32 here measured 6-8% slower a grouped-query row)
    if constexpr (C == 2 && std::is_same_v<Row, c10::BFloat16> && widens_two_vectors<Row>()) {
      widen_two_vectors(v[j] + c, vv[0], vv[1]);
    } else {
      for (int i = 0; i < C; ++i) vv[i] = load_floats(v[j] + c + i * W);
    }
    for (int h = 0; h < MH; ++h) {
      const Vec pj(p[h * ldp + j]);
      for (int i = 0; i < C; ++i) acc[h][i] = at::vec::fmadd(pj, vv[i], acc[h][i]);
    }
  }
  for (int h = 0; h < MH; ++h)
    for (int i = 0; i < C; ++i) acc[h][i].store(o + h * ldo + c + i * W);
}

// pv_tile_fp32 for the last `count` (< C * W) columns of a width that is no multiple of the chunk, one
// vector of columns at a time.
template <int MH, typename Rows>
inline void pv_tail_fp32(const float* p, int64_t ldp, Rows v, int n, int64_t c, int count, const float* alpha,
                         float* o, int64_t ldo) {
  using Vec = at::vec::Vectorized<float>;
  for (int c0 = 0; c0 < count; c0 += Vec::size()) {
    const int lanes = std::min<int>(Vec::size(), count - c0);
    float* oc = o + c + c0;
    Vec acc[MH];
    for (int h = 0; h < MH; ++h) acc[h] = alpha ? Vec(alpha[h]) * Vec::loadu(oc + h * ldo, lanes) : Vec(0.f);
    for (int j = 0; j < n; ++j) {
      const Vec vv = load_floats(v[j] + c + c0, lanes);
      for (int h = 0; h < MH; ++h) acc[h] = at::vec::fmadd(Vec(p[h * ldp + j]), vv, acc[h]);
    }
    for (int h = 0; h < MH; ++h) acc[h].store(oc + h * ldo, lanes);
  }
}

// max(a, b), or NaN if either is: a NaN score (a NaN in a row the query reads) must reach the output, as in
// SDPA. (std::max(-inf, NaN) is -inf: the first block's NaN would have read as a block of -inf scores and
// been skipped, its other rows with it.)
inline float max_keeping_nan(float a, float b) { return std::isnan(a) || b < a ? a : b; }

// Online-softmax state of one task: per head the running max and sum, and the unnormalised output.
struct SoftmaxState {
  float* m;  // [H]
  float* l;  // [H]
  float* o;  // [H, L], written by the first block; not written if the task has no rows (l = 0: the merge skips it)
};

// Splits per request: enough tasks to keep every thread busy, but no split shorter than two blocks
// (the merge and the per-task scratch are not free), unless threads would idle: with fewer requests
// than threads, a request splits into blocks down to one each, as long as its last split holds half a
// block or more. (B=1 on two threads of the AMX Xeon, latent decode, 22 heads: 256 rows 62.5 -> 42.4 µs
// a layer, 200 rows 52.2 -> 39.7; at 160 rows a split of 32 rows measured no gain.)
inline int64_t kv_splits(int64_t requests, int64_t max_len, int threads) {
  constexpr int64_t kMinSplitRows = 2 * kKvBlock;
  const int64_t balanced =
      std::min<int64_t>((4 * threads + requests - 1) / requests, (max_len + kMinSplitRows - 1) / kMinSplitRows);
  const int64_t filling =
      std::min<int64_t>((threads + requests - 1) / requests, (max_len + kKvBlock / 2) / kKvBlock);
  return std::max<int64_t>({1, balanced, filling});
}

// Rows [j0, j1) of split `split` of a request's rows [begin, end): whole blocks, the last split takes
// the rest.
inline std::pair<int64_t, int64_t> split_rows(int64_t begin, int64_t end, int64_t splits, int64_t split) {
  const int64_t per_split = (end - begin + splits - 1) / splits;
  const int64_t chunk = (per_split + kKvBlock - 1) / kKvBlock * kKvBlock;
  const int64_t j0 = std::min(end, begin + split * chunk);
  return {j0, std::min(end, j0 + chunk)};
}

// The first row a sliding window of `window` rows (0: none) admits when the query's row is end - 1,
// rounded down to a multiple of `granule` (1: exactly the window; a paged kernel's block size: whole
// blocks, as vLLM's CPU decode keeps them).
inline int64_t window_begin(int64_t end, int64_t window, int64_t granule) {
  if (window <= 0 || end <= window) return 0;
  return (end - window) / granule * granule;
}

// The online-softmax state of a task over its scratch (m [H], l [H], o [H, L]), before any row.
template <int H>
inline SoftmaxState start_task(float* state) {
  SoftmaxState st{state, state + H, state + 2 * H};
  std::fill(st.m, st.m + H, -std::numeric_limits<float>::infinity());
  std::fill(st.l, st.l + H, 0.f);
  return st;
}

// Whether the dpbf16 kernels serve this query type T, cache type C and latent width (P.V works in
// 32-column chunks). An fp8 cache takes the portable kernels, which widen it in registers, unless
// converts_fp8_to_bf16.
template <typename T, typename C>
constexpr bool use_bf16_kernels(int64_t L) {
#if defined(__AVX512BF16__)
  return std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, T> && L % 32 == 0;
#else
  return false;
#endif
}

// Whether an fp8 cache is converted to bf16 a tile of rows at a time for the dpbf16 kernels (convert_rows):
// with AVX512-BF16 and without AMX tiles (Zen 4, Zen 5), for more heads than one direct tile. Those heads'
// portable kernels copy each row once too (widened to fp32) before their FMA tiles, and Zen 4's and Zen
// 5's vdpbf16ps do twice the multiply-adds of their fp32 FMA (benchmarks/instruction_rates.py). On Zen 5
// a latent row of 22 heads took 133-148 ns so against 247-275 on the FMA tiles (attend_split.py, L2).
// The AMX Xeon's does half, and there this route lost at 4-12 heads (docs/mla_decode.md), so its AMX
// build keeps the FMA tiles below 16 heads. Converting each head tile's rows in registers instead of once
// (reads_fp8_as_bf16's route) measured 1.3-2.2x slower at 22 heads on Zen 5.
template <typename T, typename C, int H, int64_t L>
constexpr bool converts_fp8_to_bf16() {
#if defined(__AVX512BF16__) && !defined(MLA_INDUCTOR_AMX)
  return std::is_same_v<T, c10::BFloat16> && is_fp8<C> && !widens_from_cache(H) && L % 32 == 0;
#else
  return false;
#endif
}

// Whether the dpbf16 kernels read an fp8 cache's rows where they lie, converting them in registers by the
// byte tables (VBMI): where converts_fp8_to_bf16 would hold but for heads that fit one score tile (a
// grouped-query group), whose rows are read by that tile alone, so a converted copy would serve no other.
// On Zen 5, where the FMA tiles widened them before, a grouped-query fp8 row (4 heads of 128) took 11.5
// ns in L2 against 15-20, and benchmarks/fp8_cache.py's step 1.41x less time (docs/mla_decode.md, "Zen 5").
template <typename T, typename C, int H, int64_t L>
constexpr bool reads_fp8_as_bf16() {
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__) && !defined(MLA_INDUCTOR_AMX)
  return std::is_same_v<T, c10::BFloat16> && is_fp8<C> && widens_from_cache(H) && L % 32 == 0;
#else
  return false;
#endif
}

// Whether attend_split runs the dpbf16 kernels: over a bf16 cache, or over an fp8 one converted to bf16
// (into a thread's scratch, or in registers).
template <typename T, typename C, int H, int64_t L>
constexpr bool runs_bf16_kernels() {
  return use_bf16_kernels<T, C>(L) || converts_fp8_to_bf16<T, C, H, L>() || reads_fp8_as_bf16<T, C, H, L>();
}

// v rounded to P and stored at dst[0, count); returns the rounded values, widened back.
template <typename P>
__attribute__((always_inline)) inline at::vec::Vectorized<float> store_rounded(at::vec::Vectorized<float> v, P* dst,
                                                                               int count) {
  if constexpr (std::is_same_v<P, float>) {
    v.store(dst, count);
    return v;
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
  } else if constexpr (std::is_same_v<P, c10::BFloat16>) {
    // One vcvtneps2bf16, where at::vec rounds in integer ops. It also flushes fp32 subnormals, which
    // the bf16 products that read p (dpbf16, AMX) would flush, so l sums what o weighs. (A target
    // with AVX512-BF16 can still hold 8-lane vectors: Inductor builds for cpp.march's ISA with the
    // host's Vectorized width, AVX2's on an AVX2 CPU; v is not a __m512 there.)
    const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(v);
    _mm256_mask_storeu_epi16(dst, static_cast<__mmask16>((1u << count) - 1), rounded);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16));
#endif
  } else {
    const at::vec::Vectorized<P> rounded = at::vec::convert<P>(v);
    rounded.store(dst, count);
    return at::vec::convert<float>(rounded);
  }
}

// exp(x - max) for n scores, rounded to P (the type the P.V kernel multiplies in); returns the sum of
// the rounded values, so that numerator and denominator agree. With an fp8 cache's value scales
// (value_scale: the n rows', else nullptr) the probabilities weigh the scaled rows: exp times the scale,
// rounded once, and the sum is of the unscaled values (the scales belong to the rows, not to the
// weights). (Multiplied in a pass of their own after a first rounding, the scales cost the latent step
// at 22 heads on AMX tiles 7-12%; taken here, e4m3 with per-token scales ran 1.10x, docs/mla_decode.md.)
template <typename P>
inline float exp_and_round(const float* row, int n, float max, const float* value_scale, P* prob) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int W = Vec::size();
  Vec sum(0.f);
  for (int j = 0; j < n; j += W) {
    const int count = std::min(W, n - j);
    Vec e = (Vec::loadu(row + j, count) - Vec(max)).exp_u20();
    if (value_scale == nullptr) {
      e = store_rounded(e, prob + j, count);
    } else {
      store_rounded(e * Vec::loadu(value_scale + j, count), prob + j, count);
    }
    sum += Vec::set(Vec(0.f), e, count);  // lanes past count hold exp(-max) garbage
  }
  return reduce_add(sum);
}

// One step of the online softmax over a block of n rows: s (scaled scores, [H, kKvBlock]) becomes the
// probabilities p, and alpha[h] the factor that rescales the earlier o and l. An fp8 cache's per-row
// scales (nullptr: none): key_scale on the scores, before the softcap (which caps true scores),
// value_scale on p (exp_and_round). bias (nullptr: none) adds a mask's per-row bias to every head's
// scores, after the softcap.
template <typename P>
inline void softmax_step(float* s, int H, int n, const float* key_scale, float softcap, const float* bias,
                         const float* value_scale, SoftmaxState& st, float* alpha, P* p) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int W = Vec::size();
  for (int h = 0; h < H; ++h) {
    float* row = s + h * kKvBlock;
    Vec block_max(-std::numeric_limits<float>::infinity());
    for (int j = 0; j < n; j += W) {
      const int count = std::min(W, n - j);
      Vec x = Vec::loadu(row + j, count);
      if (key_scale != nullptr) x = x * Vec::loadu(key_scale + j, count);
      if (softcap > 0.f) x = Vec(softcap) * (x / Vec(softcap)).tanh();
      if (bias != nullptr) x = x + Vec::loadu(bias + j, count);
      if (key_scale != nullptr || softcap > 0.f || bias != nullptr) x.store(row + j, count);
      block_max = at::vec::maximum(block_max, Vec::set(Vec(-std::numeric_limits<float>::infinity()), x, count));
    }
    // (at::vec::maximum keeps NaN)
    const float m_new = max_keeping_nan(
        st.m[h], at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, block_max));
    P* prob = p + h * kKvBlock;
    if (m_new == -std::numeric_limits<float>::infinity()) {  // only -inf scores so far: nothing to weigh
      alpha[h] = 1.f;
      std::fill(prob, prob + n + (n & 1), P(0.f));
      continue;
    }
    alpha[h] = std::exp(st.m[h] - m_new);
    const float sum = exp_and_round(row, n, m_new, value_scale, prob);
    if (n & 1) prob[n] = P(0.f);  // pads an odd block to whole pairs
    st.l[h] = st.l[h] * alpha[h] + sum;
    st.m[h] = m_new;
  }
}

// Row pointers of one block (and of the next, gathered early for the prefetch) in one cache.
template <typename T, typename IndexT>
struct BlockRows {
  const T* cache;
  int64_t row_stride;
  const T* rows[kKvBlock + 1];  // this block's rows, then the pad
  const T* next[kKvBlock];

  void gather(int64_t block_size, const IndexT* table, int64_t j, int n) {
    gather_rows(cache, block_size, row_stride, table, j, n, next);
  }
  void advance(int n, const T* pad) {
    std::copy(next, next + n, rows);
    rows[n] = pad;
  }
  // The rows of the tile `tiles` after tile n0, for the prefetches (the last real row repeats past the
  // task's end).
  void ahead(int n0, int n, int n_next, int tiles, const T** out) const {
    static_assert(kPrefetchTiles * kQkRows <= kKvBlock);
    for (int i = 0; i < kQkRows; ++i) {
      const int a = n0 + tiles * kQkRows + i;
      out[i] = a < n ? rows[a] : a - n < n_next ? next[a - n] : rows[n - 1];
    }
  }
};

// Dequantization scales of an fp8 cache's rows: the scale of the row at offset o of block b is
// data[b * block_stride + o * row_stride] (both strides 0: one scale for the cache). data = nullptr:
// the rows need none.
struct RowScales {
  const float* data = nullptr;
  int64_t block_stride = 0;
  int64_t row_stride = 0;
  bool same_as(const RowScales& other) const {
    return data == other.data && block_stride == other.block_stride && row_stride == other.row_stride;
  }
};

// Where one request's rows live: row j is at offset j % block_size of block table[j / block_size] in
// each cache. Its key is the key row (D1 columns, rows key_stride apart) followed, when D2 > 0, by the
// rope row (D2 columns, rows D2 apart); its value is the value row (L columns), or, without a value
// cache, the first L columns of the key row (MLA's latent rows). A row's key and value are its cache
// values times the row's key_scale and value_scale.
template <typename T, typename IndexT>
struct RequestRows {
  const T* key;
  int64_t key_stride;
  const T* rope;
  const T* value;
  int64_t value_stride;
  int64_t block_size;
  const IndexT* table;
  RowScales key_scale = {};
  RowScales value_scale = {};
};

// out[i] = the scale of row j0 + i of a request, for i < n.
template <typename IndexT>
inline void gather_scales(const RowScales& scales, int64_t block_size, const IndexT* table, int64_t j0, int n,
                          float* out) {
  for_each_run(block_size, table, j0, n, [&](int i, int count, int64_t id, int64_t offset) {
    const float* scale = scales.data + id * scales.block_stride + offset * scales.row_stride;
    for (int r = 0; r < count; ++r, scale += scales.row_stride) out[i + r] = *scale;
  });
}

// A per-row mask shared by the heads: a bool admits row j where true, a number adds to its scores.
template <typename MaskT>
inline float mask_bias(MaskT m) {
  if constexpr (std::is_same_v<MaskT, bool>) {
    return m ? 0.f : -std::numeric_limits<float>::infinity();
  } else {
    return static_cast<float>(m);
  }
}

// Prefetches rows [0, n) of `rows` (`bytes` each) into L2, every line of them.
template <typename T>
__attribute__((always_inline)) inline void prefetch_rows_to_l2(const T* const* rows, int n, int64_t bytes) {
  for (int i = 0; i < n; ++i) {
    const char* row = reinterpret_cast<const char*>(rows[i]);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, 2);  // 2: _MM_HINT_T1
  }
}

// attend_split's mask argument for attention without one.
inline constexpr const bool* kNoMask = nullptr;

// One past the last of rows [0, len) that the mask does not exclude (0: it excludes them all).
template <typename MaskT>
inline int64_t admitted_end(const MaskT* mask, int64_t len) {
  while (len > 0 && mask_bias(mask[len - 1]) == -std::numeric_limits<float>::infinity()) --len;
  return len;
}

// Whether every bias of rows [0, n) is -inf: such a block is skipped without reading its rows (a
// StaticCache's unfilled tail). A finite bias only weighs a row down, so only -inf excludes it.
inline bool excludes_all(const float* bias, int n) {
  for (int i = 0; i < n; ++i)
    if (bias[i] != -std::numeric_limits<float>::infinity()) return false;
  return true;
}

// Row pointers of one block and the next in each cache of a request (see attend_split).
template <typename T, typename IndexT, int64_t D2>
struct RequestBlocks {
  BlockRows<T, IndexT> key, rope, value;
  bool own_values;
};

#if defined(__AVX512BF16__)
// What the score pass over a block of cache rows prefetches besides its tiles' rows, per tile of `tile` rows
// from n0. Grouped-query attention (a value cache of its own): few heads per row, so the kernel is bound
// by reading the rows, and the tile prefetches (a few rows ahead) leave the stream idle between tiles.
// Asking, per tile, for the value rows that the P.V pass reads next and for the key rows of the next block
// keeps it busy: 6.7 -> 12.3 GB/s on one core (benchmarks/gqa_decode.py).
template <int64_t D1, int64_t L, typename T, typename IndexT, int64_t D2>
__attribute__((always_inline)) inline void prefetch_values_and_next_keys(const RequestBlocks<T, IndexT, D2>& b, int n0,
                                                                         int tile, int n_next) {
  if (!b.own_values) return;
  prefetch_rows_to_l2(b.value.rows + n0, tile, L * int64_t(sizeof(T)));
  prefetch_rows_to_l2(b.key.next + n0, std::clamp(n_next - n0, 0, tile), D1 * int64_t(sizeof(T)));
}

// Scores s [H, kKvBlock] of the block's n rows (dpbf16 tiles, with the cache-row prefetches), over a
// bf16 cache or an fp8 one read as bf16 (reads_fp8_as_bf16); prefetch_tile(n0, tile) asks for what the
// rows' own prefetches do not (prefetch_values_and_next_keys).
template <int H, int64_t D1, int64_t D2, int64_t L, typename T, typename IndexT, typename PrefetchTile>
inline void block_scores_bf16(const c10::BFloat16* q, int64_t ldq, const RequestBlocks<T, IndexT, D2>& b, int n,
                              int n_next, float scale, float* s, PrefetchTile&& prefetch_tile) {
  const auto& [key, rope, value, own_values] = b;
  // A tile of rows is loaded once and stays in L1 while every head tile dots with it.
  for (int n0 = 0; n0 < n; n0 += kQkRows) {
    prefetch_tile(n0, std::min(kQkRows, n - n0));
    const T* key_to_l2[kQkRows];
    const T* rope_to_l2[kQkRows];
    const T* key_to_l1[kQkRows];
    const T* rope_to_l1[kQkRows];
    key.ahead(n0, n, n_next, kPrefetchTiles, key_to_l2);
    key.ahead(n0, n, n_next, 1, key_to_l1);
    if constexpr (D2 > 0) {
      rope.ahead(n0, n, n_next, kPrefetchTiles, rope_to_l2);
      rope.ahead(n0, n, n_next, 1, rope_to_l1);
    }
    // Head tile t prefetches rows [t * kAheadRows, (t + 1) * kAheadRows) of the tiles ahead, if any.
    constexpr int kQkHeadTiles = (H + kQkHeads - 1) / kQkHeads;
    constexpr int kAheadRows = (kQkRows + kQkHeadTiles - 1) / kQkHeadTiles;
    for (int h0 = 0; h0 < H; h0 += kQkHeads) {
      const int first_ahead = h0 / kQkHeads * kAheadRows;
      const bool prefetches = first_ahead < kQkRows;
      const int shift = prefetches ? first_ahead : 0;
      const KeyTile<T> tile{key.rows + n0, rope.rows + n0, key_to_l2 + shift, rope_to_l2 + shift,
                            key_to_l1 + shift, rope_to_l1 + shift};
      dispatch_count<kQkHeads>(std::min(kQkHeads, H - h0), [&]<int MH>() {
        dispatch_count<kQkRows>(std::min(kQkRows, n - n0), [&]<int NR>() {
          float* out = s + h0 * kKvBlock + n0;
          if (prefetches) {
            qk_tile_bf16<D1, D2, MH, NR, kAheadRows>(q + h0 * ldq, ldq, tile, scale, out, kKvBlock);
          } else {
            qk_tile_bf16<D1, D2, MH, NR, 0>(q + h0 * ldq, ldq, tile, scale, out, kKvBlock);
          }
        });
      });
    }
  }
}

// o = alpha * o + p . V (alpha = nullptr: o = p . V) over the block's n rows, p in bf16 pairs, heads in
// balanced tiles of at most kPvHeads.
template <int H, int64_t L, typename T, typename IndexT, int64_t D2>
inline void block_pv_bf16(const c10::BFloat16* p, const RequestBlocks<T, IndexT, D2>& b, int n, const float* alpha,
                          SoftmaxState& st) {
  const T* const* value_rows = b.own_values ? b.value.rows : b.key.rows;
  constexpr int kHeadTiles = (H + kPvHeads - 1) / kPvHeads;
  constexpr int kTileHeads = (H + kHeadTiles - 1) / kHeadTiles;
  for (int h0 = 0; h0 < H; h0 += kTileHeads) {
    const float* tile_alpha = alpha == nullptr ? nullptr : alpha + h0;
    dispatch_count<kTileHeads>(std::min(kTileHeads, H - h0), [&]<int MH>() {
      for (int64_t c = 0; c < L; c += 32)
        pv_tile_bf16<MH>(p + h0 * kKvBlock, kKvBlock, value_rows, (n + 1) / 2, c, tile_alpha, st.o + h0 * L, L);
    });
  }
}

// dst[0, n) = an fp8 row's values in bf16, times kWidenedScale<C> as the widening gives them: exact (an fp8
// value has at most 4 significant bits), NaN kept. By the byte tables where there is VBMI (two vpermi2b
// per 64 values, as the AMX path converts), else widened (load_floats) and rounded back.
template <typename C>
inline void fp8_row_to_bf16(const C* src, int64_t n, c10::BFloat16* dst) {
#if defined(__AVX512VBMI__)
  row_to_bf16(src, n, dst);
#else
  using Vec = at::vec::Vectorized<float>;
  for (int64_t i = 0; i < n; i += Vec::size()) {
    const int64_t count = std::min<int64_t>(Vec::size(), n - i);
    store_floats(dst + i, load_floats(src + i, count), count);
  }
#endif
}

// How many rows ahead of the rows it converts the score pass prefetches the cache (on into the next block).
constexpr int kConvertAhead = 8;

// Rows [i0, i0 + count) of the block's n fp8 rows in bf16 (converts_fp8_to_bf16), and the dpbf16 kernels'
// view of them: key row i (its rope columns after its first D1) at keys + i * (D1 + D2), an own value row
// at values + i * L; past the last row, rows kKvBlock of both, which hold zeros (an odd block's pad). The
// score pass converts each tile of rows before its products (block_scores_bf16's prefetch_tile), so the
// cache rows' reads overlap the products, as they do over a bf16 cache. (Converted a block at a time
// before the score pass, the reads came in a burst and waited on the memory: on Zen 5 a latent fp8 row
// took 165-172 ns from memory on one thread against 133 in L2, tasks of 512 rows; so, 141-143.)
// The view has no next block: the cache rows are prefetched here.
template <int64_t D1, int64_t D2, int64_t L, typename C, typename IndexT>
inline void convert_rows(const RequestBlocks<C, IndexT, D2>& b, int i0, int count, int n, int n_next,
                         c10::BFloat16* keys, c10::BFloat16* values, RequestBlocks<c10::BFloat16, IndexT, D2>& view) {
  constexpr int64_t D = D1 + D2;
  if (i0 == 0) {  // every row's place, before the score tiles' prefetches read those of the rows ahead
    view.own_values = b.own_values;
    for (int i = 0; i < n; ++i) {
      view.key.rows[i] = keys + i * D;
      if constexpr (D2 > 0) view.rope.rows[i] = keys + i * D + D1;
      view.value.rows[i] = values + i * L;
    }
    view.key.rows[n] = keys + kKvBlock * D;
    view.value.rows[n] = values + kKvBlock * L;
  }
  for (int i = i0; i < i0 + count; ++i) {
    prefetch_block_rows(b.key, i + kConvertAhead, 1, n, n_next, D1 * int64_t(sizeof(C)));
    if constexpr (D2 > 0) prefetch_block_rows(b.rope, i + kConvertAhead, 1, n, n_next, D2 * int64_t(sizeof(C)));
    if (b.own_values) prefetch_block_rows(b.value, i + kConvertAhead, 1, n, n_next, L * int64_t(sizeof(C)));
    fp8_row_to_bf16(b.key.rows[i], D1, keys + i * D);
    if constexpr (D2 > 0) fp8_row_to_bf16(b.rope.rows[i], D2, keys + i * D + D1);
    if (b.own_values) fp8_row_to_bf16(b.value.rows[i], L, values + i * L);
  }
}
#endif

// A thread's scratch, kept across its tasks (a fresh allocation per task would fault its pages in every
// time), aligned to a cache line (line_aligned: a std::vector's buffer, which this was, lay 16 or 48 bytes
// past one, and every row of an AMX tile from it straddled two lines; in attend_split.py's harness the
// AMX P.V pass ran 2.8x slower, 157 -> 55 TSC cycles a latent row, though the op measured the same
// either way, docs/mla_decode.md).
inline float* thread_scratch(int64_t floats) {
  thread_local LineAligned<float> buffer;
  thread_local int64_t size = 0;
  if (size < floats) {
    buffer = line_aligned<float>(floats);
    std::fill_n(buffer.get(), floats, 0.f);  // (as the vector's were)
    size = floats;
  }
  return buffer.get();
}

// Row i of a block's rows, past its end the next block's, past those nullptr.
template <typename T, typename IndexT>
inline const T* row_or_next(const BlockRows<T, IndexT>& rows, int i, int n, int n_next) {
  return i < n ? rows.rows[i] : i - n < n_next ? rows.next[i - n] : nullptr;
}

// Prefetches rows [i0, i0 + count) of the block (continuing into the next) into L2, `bytes` each.
template <typename T, typename IndexT>
__attribute__((always_inline)) inline void prefetch_block_rows(const BlockRows<T, IndexT>& rows, int i0, int count,
                                                               int n, int n_next, int64_t bytes) {
  for (int i = i0; i < i0 + count; ++i)
    if (const T* row = row_or_next(rows, i, n, n_next)) prefetch_rows_to_l2(&row, 1, bytes);
}

// Whether attend_split runs on AMX tiles (amx_tiles.h): a bf16 query over a bf16 or fp8 cache, at least
// kAmxMinHeads heads, and values of whole 32-column chunks (P.V's column tiles). With fewer heads a
// row's products are too few to fill the tiles' 16 rows: benchmarks/gqa_decode.py on an AMX Xeon,
// B=8, 4096 rows, groups of 16 heads 1.6x the dpbf16 tiles, groups of 8 0.95x.
constexpr int kAmxMinHeads = 16;
template <typename T, typename C, int H, int64_t L>
constexpr bool use_amx_kernels() {
#if defined(MLA_INDUCTOR_AMX)
  return std::is_same_v<T, c10::BFloat16> &&
         (std::is_same_v<C, T> || std::is_same_v<C, c10::Float8_e4m3fn> || std::is_same_v<C, c10::Float8_e5m2>) &&
         H >= kAmxMinHeads && L % 32 == 0;
#else
  return false;
#endif
}

// What a template calls once, before its parallel region: the AMX path asks Linux for the tile state
// (an error must not be raised inside the region).
template <typename T, typename C, int H, int64_t L>
inline void prepare_attention() {
#if defined(MLA_INDUCTOR_AMX)
  if constexpr (use_amx_kernels<T, C, H, L>()) require_amx_permission();
#endif
}

#if defined(MLA_INDUCTOR_AMX)
// One task's operands on AMX tiles, in its thread's scratch. Heads are split into kGroups groups of
// kGroupHeads (22: two of 11), key columns padded to whole 32-column steps (kColumns); the padding is
// zeros. A group's tiles are configured to its heads: columns of the scores' B and C tiles, rows of
// P.V's A and C tiles (the two passes configure their tiles each).
//   scores: S^T = K . Q^T per row tile of 16 rows: A = the rows converted to bf16, B = the query in
//           VNNI pairs, packed once per task; C = 16 rows x a group's heads, two groups at a time.
//   P.V:    O += P . V, two head groups at a time: A = p (a group's heads x 32 rows; the first group's
//           four tiles for a block of 128 rows resident while the column tiles pass, the second
//           group's loaded per step), B = value rows interleaved in pairs (each tile loaded once for both
//           groups), C = a group's heads x 16 columns of o, loaded and stored per block.
// Tiles: scores 0-1 (C), 2 (A), 3-4 (B); P.V 0, 7 (C), 2-5, 6 (A), 1 (B). (Two row tiles at a time in
// the scores, and two column tiles in P.V, measured the same or slower.)
template <int H, int64_t D, int64_t L>
struct AmxTask {
  static_assert(kKvBlock == 128, "P.V keeps a block's four 32-row steps of p in tiles 2-5");
  static constexpr int kGroups = (H + 15) / 16;
  // Fewer heads than 16 in a group leave the tiles narrower: 22 heads padded to 32 loaded and stored
  // 45% more bytes of the query, the scores, p and o than two groups of 11 (204 -> 180 ns a row).
  static constexpr int kGroupHeads = (H + kGroups - 1) / kGroups;
  static constexpr int kHeads = kGroups * kGroupHeads;
  static constexpr int64_t kQueryTile = 32 * kGroupHeads;  // bf16 elements: one group's query for one step
  static constexpr int64_t kScoresStride = kHeads + 16;    // floats: transposing the last group reads 16
  static constexpr int kSteps = (D + 31) / 32;
  static constexpr int64_t kColumns = 32 * kSteps;
  // Row strides of the P.V operands, padded by 64 bytes: unpadded they are 2 KiB at 512 latent columns,
  // which puts a tile's 16 rows in two of the L1's 64 sets (3-4% of a latent row, docs/mla_decode.md).
  static constexpr int64_t kPairStride = 2 * L + 32;  // bf16 elements from one pair of value rows to the next
  static constexpr int64_t kOStride = L + 16;         // floats from one head's o to the next
  c10::BFloat16* q;       // [kGroups][kSteps][16 pairs][kGroupHeads][2]
  c10::BFloat16* keys;    // [16][kColumns]: one row tile, bf16 (or two 16 x 32 steps of one: stage_fp8_step)
  c10::BFloat16* values;  // [kKvBlock / 2][kPairStride]: the block's value rows, pairs interleaved
  c10::BFloat16* pair;    // [2][L]: two value rows of a value cache of their own, bf16
  float* scores;          // [16][kScoresStride]: one row tile's scores
  c10::BFloat16* p;       // [kHeads][kKvBlock]
  float* o;               // [kHeads][kOStride], columns as interleave_rows leaves them

  AmxTask(const c10::BFloat16* query, int64_t ldq) {
    constexpr int64_t q_elems = kGroups * kSteps * kQueryTile, keys_elems = 16 * kColumns;
    constexpr int64_t values_elems = kKvBlock / 2 * kPairStride;
    constexpr int64_t bf16_elems = q_elems + keys_elems + values_elems + 2 * L + kHeads * kKvBlock;
    float* scratch = thread_scratch((bf16_elems + 1) / 2 + 16 * kScoresStride + kHeads * kOStride);
    o = scratch;
    scores = o + kHeads * kOStride;
    q = reinterpret_cast<c10::BFloat16*>(scores + 16 * kScoresStride);
    keys = q + q_elems;
    values = keys + keys_elems;
    pair = values + values_elems;
    p = pair + 2 * L;
    // A head's 32 columns of a step are 16 pairs, one 32-bit element each, that go down a column of the
    // step's tile: one scatter. (Element by element, the packing cost a task of 512 rows, the op's at
    // B=1 and 4096 rows, a sixth of its time: 218 -> 180 ns a row.)
    std::memset(q, 0, q_elems * sizeof(c10::BFloat16));
    const __m512i pair_offsets = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(kGroupHeads));
    for (int h = 0; h < H; ++h) {
      c10::BFloat16* head = q + (h / kGroupHeads) * kSteps * kQueryTile + (h % kGroupHeads) * 2;
      for (int ks = 0; ks < kSteps; ++ks) {
        const int64_t count = std::min<int64_t>(32, D - 32 * ks);
        const __m512i pairs =
            _mm512_maskz_loadu_epi16(count == 32 ? ~0u : (1u << count) - 1, query + h * ldq + 32 * ks);
        _mm512_i32scatter_epi32(head + ks * kQueryTile, pair_offsets, pairs, 4);
      }
    }
    std::memset(p, 0, kHeads * kKvBlock * sizeof(c10::BFloat16));
  }
  // scores: C 0, 1 and B 3, 4 a group's heads wide, A 2 whole; P.V: C 0, 7 and A 2-6 a group's heads
  // high, B 1 whole.
  static void configure_scores() {
    constexpr uint16_t kWide = 4 * kGroupHeads;
    configure_tiles({16, 16, 16, 16, 16, 16, 16, 16}, {kWide, kWide, 64, kWide, kWide, 64, 64, 64});
  }
  static void configure_pv() {
    constexpr uint8_t kHigh = kGroupHeads;
    configure_tiles({kHigh, 16, kHigh, kHigh, kHigh, kHigh, kHigh, kHigh}, {64, 64, 64, 64, 64, 64, 64, 64});
  }
};

// Row i of the block, or zeros at or past its n rows (a zero row times a zero probability adds nothing;
// a stale row might hold NaN, and NaN times zero is NaN).
template <typename C>
inline const C* row_or_zeros(const C* const* rows, int i, int n, const C* zeros) {
  return i < n ? rows[i] : zeros;
}

// A row tile's keys as the scores' A operand: rows `stride` bytes apart.
struct TileRows {
  const c10::BFloat16* data;
  int64_t stride;
};

// Rows [n0, n0 + 16) of the block in bf16: the values as pairs interleaved for the P.V of the block
// (latent rows: the keys' first L columns), and the keys, which it returns.
template <int H, int64_t D1, int64_t D2, int64_t L, typename C, typename IndexT>
inline TileRows pack_row_tile_amx(AmxTask<H, D1 + D2, L>& t, const RequestBlocks<C, IndexT, D2>& b, int n0, int n,
                              const C* zeros) {
  constexpr int64_t D = D1 + D2, kColumns = AmxTask<H, D, L>::kColumns;
  // A bf16 latent row tile that lies at one stride in the cache (one page of a paged cache, or a dense
  // one) is not copied: the value pairs are interleaved from the cache's rows, which brings their first
  // L columns into L1 (the rest is prefetched there), and the score tiles load the keys in place.
  // 227 -> 211 ns a row in L3, 384 -> 357 from memory (benchmarks/attend_split.py's harness). (Tile
  // loads from rows in L2, not touched first, measured 1.6x slower than the copy: a tile load from L2
  // waits on every line.)
  if constexpr (std::is_same_v<C, c10::BFloat16> && D2 == 0 && D == kColumns) {
    const C* const* rows = b.key.rows + n0;
    bool one_stride = !b.own_values && n0 + 16 <= n;  // (rows[n] is the pad row, in no cache)
    const int64_t stride = one_stride ? rows[1] - rows[0] : 0;
    one_stride = one_stride && stride >= D;
    for (int i = 2; one_stride && i < 16; ++i) one_stride = rows[i] == rows[0] + i * stride;
    if (one_stride) {
      for (int i = 0; i < 16; i += 2) {
        for (int64_t c = L; c < D; c += 32) {
          _mm_prefetch(reinterpret_cast<const char*>(rows[i] + c), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(rows[i + 1] + c), _MM_HINT_T0);
        }
        interleave_rows(rows[i], rows[i + 1], L, t.values + (n0 + i) / 2 * AmxTask<H, D, L>::kPairStride);
      }
      return {rows[0], stride * int64_t(sizeof(C))};
    }
  }
  for (int i = 0; i < 16; ++i) {
    c10::BFloat16* key = t.keys + i * kColumns;
    row_to_bf16(row_or_zeros(b.key.rows, n0 + i, n, zeros), D1, key);
    if constexpr (D2 > 0) row_to_bf16(row_or_zeros(b.rope.rows, n0 + i, n, zeros), D2, key + D1);
    std::fill(key + D, key + kColumns, c10::BFloat16(0.f));
  }
  for (int i = 0; i < 16; i += 2) {
    const c10::BFloat16* first = t.keys + i * kColumns;
    const c10::BFloat16* second = first + kColumns;
    if (b.own_values) {
      row_to_bf16(row_or_zeros(b.value.rows, n0 + i, n, zeros), L, t.pair);
      row_to_bf16(row_or_zeros(b.value.rows, n0 + i + 1, n, zeros), L, t.pair + L);
      first = t.pair;
      second = t.pair + L;
    }
    interleave_rows(first, second, L, t.values + (n0 + i) / 2 * AmxTask<H, D, L>::kPairStride);
  }
  return {t.keys, kColumns * int64_t(sizeof(c10::BFloat16))};
}

// Whether block_scores_amx converts a row tile's fp8 rows a 32-column step at a time (stage_fp8_step)
// rather than whole (pack_row_tile_amx): latent rows (the values are the keys' first L columns; the rope
// columns in the same rows or in a cache of their own) whose heads take one pass of the score tiles (two
// groups of 16 at most).
template <typename C, int H, int64_t D1, int64_t D2, int64_t L>
constexpr bool stages_fp8_steps() {
  return is_fp8<C> && D1 % 32 == 0 && D2 % 32 == 0 && L % 32 == 0 && L <= D1 && H <= 32;
}

// Columns [column, column + 32) of a row tile's 16 fp8 rows (K_i = key[i] | rope[i], D1 columns of key)
// in bf16: at `keys` (rows 64 bytes apart, the step's A tile) and, below L (`pairs` not nullptr: the
// tile's first pair of value rows), interleaved in pairs into the block's value pairs from the same
// registers. block_scores_amx stages step ks + 1 into the other of two such buffers before the products
// of step ks, so that the conversion's vector work runs beside the tile products, and a row tile's keys
// never pass through a buffer of their own: the latent step over an fp8 cache 1.09x (e5m2) and 1.19x
// (e4m3 with per-token scales) against whole rows converted first (benchmarks/template_ab.py, AMX Xeon).
template <typename C>
__attribute__((always_inline)) inline void stage_fp8_step(const C* const* key, const C* const* rope, int64_t D1,
                                                         int64_t column, const Bf16Table& table,
                                                         c10::BFloat16* keys, c10::BFloat16* pairs,
                                                         int64_t pair_stride) {
  const __m512i alternate = _mm512_setr_epi64(0, 8, 1, 9, 2, 10, 3, 11);  // the two rows' qwords in turn
  const C* const* rows = column < D1 ? key : rope;
  const int64_t offset = column < D1 ? column : column - D1;
  for (int i = 0; i < 16; i += 2) {
    const auto run = [&](int r) {
      return _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[r] + offset)));
    };
    __m512i first, second;
    fp8_lanes_to_bf16(_mm512_permutex2var_epi64(run(i), alternate, run(i + 1)), table, first, second);
    _mm512_storeu_si512(keys + i * 32, first);
    _mm512_storeu_si512(keys + (i + 1) * 32, second);
    if (pairs != nullptr) store_interleaved(first, second, pairs + i / 2 * pair_stride + 2 * column);
  }
}

// The rows of a row tile ahead, prefetched into L2 a few lines at a time over the steps of the score
// tiles (the cache is the one stream from memory; asking for all of a tile's lines at once stalled on
// the miss buffers: 2x slower).
struct TilePrefetch {
  const char* rows[16];
  int count = 0;
  int64_t lines = 0;

  template <typename C, typename IndexT>
  TilePrefetch(const BlockRows<C, IndexT>& block, int i0, int n, int n_next, int64_t bytes) : lines((bytes + 63) / 64) {
    for (; count < 16; ++count) {
      const C* row = row_or_next(block, i0 + count, n, n_next);
      if (row == nullptr) break;
      rows[count] = reinterpret_cast<const char*>(row);
    }
  }
  __attribute__((always_inline)) void step(int step, int steps) const {
    const int64_t first = step * lines / steps, last = (step + 1) * lines / steps;
    for (int i = 0; i < count; ++i)
      for (int64_t line = first; line < last; ++line) _mm_prefetch(rows[i] + 64 * line, _MM_HINT_T1);
  }
};

// dst[j * ldd + i] = scale * src[i * lds + j] for rows i < 16 and columns j < columns: a score tile
// (16 rows x 16 heads) turned into the softmax's layout (heads x rows) in registers. Element by element
// it took 8% of a latent row (35 of 417 ns). Rows past a block's end come out too; the softmax does not
// read them.
inline void transpose_scaled_16x16(const float* src, int64_t lds, int columns, float scale, float* dst,
                                   int64_t ldd) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * lds);
  // t[i], t[i + 1] hold rows i and i + 1 interleaved within each 128-bit lane l: columns 4l, 4l + 1
  // and 4l + 2, 4l + 3
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  // r[i + c], i = 0, 4, 8, 12: lane l holds column 4l + c of rows i .. i + 3
  const auto pd = [](__m512 x) { return _mm512_castps_pd(x); };
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[i]), pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[i]), pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[i + 1]), pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[i + 1]), pd(t[i + 3])));
  }
  // column 4l + c gathers lane l of r[c], r[4 + c], r[8 + c], r[12 + c]
  const __m512 scales = _mm512_set1_ps(scale);
  for (int c = 0; c < 4; ++c) {
    // lanes 0, 1 of rows 0-7 and of rows 8-15, then lanes 2, 3
    const __m512 low01 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x44);
    const __m512 low23 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x44);
    const __m512 high01 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xee);
    const __m512 high23 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xee);
    const __m512 columns_of[4] = {
        _mm512_shuffle_f32x4(low01, low23, 0x88), _mm512_shuffle_f32x4(low01, low23, 0xdd),
        _mm512_shuffle_f32x4(high01, high23, 0x88), _mm512_shuffle_f32x4(high01, high23, 0xdd)};
    for (int l = 0; l < 4; ++l)
      if (4 * l + c < columns) _mm512_storeu_ps(dst + (4 * l + c) * ldd, _mm512_mul_ps(scales, columns_of[l]));
  }
}

// The rows of a block of n that block_pv_amx multiplies: whole 32-row steps (a block's last ones are
// skipped where it holds fewer rows: a short request or a split's last block).
constexpr int pv_rows(int n) { return (n + 31) / 32 * 32; }

// Scores s [H, kKvBlock] of the block's n rows; also packs the block's value rows for block_pv_amx.
template <int H, int64_t D1, int64_t D2, int64_t L, typename C, typename IndexT>
inline void block_scores_amx(AmxTask<H, D1 + D2, L>& t, const RequestBlocks<C, IndexT, D2>& b, int n, int n_next,
                             float scale, const C* zeros, float* s) {
  using Task = AmxTask<H, D1 + D2, L>;
  constexpr int G = Task::kGroupHeads;
  constexpr bool kStageable = stages_fp8_steps<C, H, D1, D2, L>();
  constexpr int64_t kStepTile = 16 * 32;  // bf16 elements of one staged step: 16 rows of 32 columns
  const bool staged = kStageable && !b.own_values;
  Task::configure_scores();
  for (int n0 = 0; n0 < n; n0 += 16) {
    const C* key_rows[16];
    const C* rope_rows[16];
    // (the table looked up at every step: held in a pointer across the loop, the fp8 latent step ran
    // 4-7% slower, benchmarks/template_ab.py)
    const auto stage = [&](int ks) __attribute__((always_inline)) {
      if constexpr (kStageable) {
        stage_fp8_step(key_rows, rope_rows, D1, 32 * ks, fp8_bf16_table<C>(), t.keys + (ks & 1) * kStepTile,
                       32 * ks < L ? t.values + n0 / 2 * Task::kPairStride : nullptr, Task::kPairStride);
      }
    };
    TileRows keys{t.keys, 32 * sizeof(c10::BFloat16)};
    if (staged) {
      for (int i = 0; i < 16; ++i) {
        key_rows[i] = row_or_zeros(b.key.rows, n0 + i, n, zeros);
        if constexpr (D2 > 0) rope_rows[i] = row_or_zeros(b.rope.rows, n0 + i, n, zeros);
      }
      stage(0);
    } else {
      keys = pack_row_tile_amx<H, D1, D2, L>(t, b, n0, n, zeros);
    }
    const TilePrefetch keys_ahead(b.key, n0 + 32, n, n_next, D1 * int64_t(sizeof(C)));
    const TilePrefetch rope_ahead(b.rope, n0 + 32, D2 > 0 ? n : 0, D2 > 0 ? n_next : 0, D2 * int64_t(sizeof(C)));
    const TilePrefetch values_ahead(b.value, n0 + 32, b.own_values ? n : 0, b.own_values ? n_next : 0,
                                    L * int64_t(sizeof(C)));
    for (int g = 0; g < Task::kGroups; g += 2) {
      const bool two = g + 1 < Task::kGroups;
      const c10::BFloat16* qg = t.q + g * Task::kSteps * Task::kQueryTile;
      _tile_zero(0);
      if (two) _tile_zero(1);
      for (int ks = 0; ks < Task::kSteps; ++ks) {
        if (g == 0) {  // the rows two tiles ahead
          keys_ahead.step(ks, Task::kSteps);
          rope_ahead.step(ks, Task::kSteps);
          values_ahead.step(ks, Task::kSteps);
        }
        if (staged && ks + 1 < Task::kSteps) stage(ks + 1);
        _tile_loadd(2, staged ? keys.data + (ks & 1) * kStepTile : keys.data + ks * 32, keys.stride);
        _tile_loadd(3, qg + ks * Task::kQueryTile, 4 * G);
        _tile_dpbf16ps(0, 2, 3);
        if (two) {
          _tile_loadd(4, qg + (Task::kSteps + ks) * Task::kQueryTile, 4 * G);
          _tile_dpbf16ps(1, 2, 4);
        }
      }
      _tile_stored(0, t.scores + g * G, Task::kScoresStride * 4);
      if (two) _tile_stored(1, t.scores + (g + 1) * G, Task::kScoresStride * 4);
    }
    for (int g = 0; g < Task::kGroups; ++g)
      transpose_scaled_16x16(t.scores + g * G, Task::kScoresStride, std::min(G, H - G * g), scale,
                             s + g * G * kKvBlock + n0, kKvBlock);
  }
  // past the last row tile, up to the end of the last 32-row step that P.V multiplies, the block's value
  // pairs are zeros (p is zero there too; 0 x NaN is not)
  const int packed = (n + 15) / 16 * 16;
  std::memset(t.values + packed / 2 * Task::kPairStride, 0,
              (pv_rows(n) - packed) / 2 * Task::kPairStride * sizeof(c10::BFloat16));
}

// p's columns past the block's n rows (softmax_step wrote them up to an even count) are zeros.
template <int H, int64_t D, int64_t L>
inline void pad_probabilities_amx(AmxTask<H, D, L>& t, int n) {
  for (int h = 0; h < H; ++h) std::fill(t.p + h * kKvBlock + n, t.p + (h + 1) * kKvBlock, c10::BFloat16(0.f));
}

// o = alpha * o + p . V (alpha = nullptr: o = p . V) over the block's n rows, in whole 32-row steps.
template <int H, int64_t D, int64_t L>
inline void block_pv_amx(AmxTask<H, D, L>& t, int n, const float* alpha) {
  using Task = AmxTask<H, D, L>;
  using Vec = at::vec::Vectorized<float>;
  if (alpha != nullptr) {
    for (int h = 0; h < H; ++h) {
      if (alpha[h] == 1.f) continue;  // the common case once the running max has settled
      float* row = t.o + h * Task::kOStride;
      for (int64_t c = 0; c < L; c += Vec::size()) (Vec::loadu(row + c) * Vec(alpha[h])).store(row + c);
    }
  }
  constexpr int64_t kPairRowBytes = 2 * Task::kPairStride;
  constexpr int G = Task::kGroupHeads;
  // Steps past the block's rows would multiply zeros (a short request's one block, a split's last):
  // skipping them took B=1 latent decode at 22 heads from 28.9 to 25.4 µs a layer at 16 rows, 31.9 to
  // 29.9 at 64 (two threads, AMX Xeon).
  const int steps = pv_rows(n) / 32;
  Task::configure_pv();
  // Head groups in pairs: the first group's probabilities stay in tiles 2-5, the second's are loaded
  // per step (tile 6, from L1), so that each value tile (tile 1, from L2) is loaded once for both.
  for (int g = 0; g < Task::kGroups; g += 2) {
    const bool two = g + 1 < Task::kGroups;
    const c10::BFloat16* pg = t.p + g * G * kKvBlock;
    _tile_loadd(2, pg, kKvBlock * 2);
    if (steps > 1) _tile_loadd(3, pg + 32, kKvBlock * 2);
    if (steps > 2) _tile_loadd(4, pg + 64, kKvBlock * 2);
    if (steps > 3) _tile_loadd(5, pg + 96, kKvBlock * 2);
    for (int64_t ct = 0; ct < L / 16; ++ct) {
      float* o = t.o + g * G * Task::kOStride + ct * 16;
      const char* v = reinterpret_cast<const char*>(t.values + ct * 32);
      if (alpha == nullptr) {
        _tile_zero(0);
        if (two) _tile_zero(7);
      } else {
        _tile_loadd(0, o, Task::kOStride * 4);
        if (two) _tile_loadd(7, o + G * Task::kOStride, Task::kOStride * 4);
      }
      // 32 rows of the block: the value tile, the first group's product (its probabilities in tile
      // 2 + ks, passed as a lambda: GCC's _tile_* macros paste the tile numbers into the asm text, which
      // takes literals, not even template parameters), the second group's probabilities and product
      const auto step = [&](int ks, auto first_group_product) __attribute__((always_inline)) {
        _tile_loadd(1, v + 16 * ks * kPairRowBytes, kPairRowBytes);
        first_group_product();
        if (two) {
          _tile_loadd(6, pg + G * kKvBlock + 32 * ks, kKvBlock * 2);
          _tile_dpbf16ps(7, 6, 1);
        }
      };
      step(0, [] { _tile_dpbf16ps(0, 2, 1); });
      if (steps > 1) step(1, [] { _tile_dpbf16ps(0, 3, 1); });
      if (steps > 2) step(2, [] { _tile_dpbf16ps(0, 4, 1); });
      if (steps > 3) step(3, [] { _tile_dpbf16ps(0, 5, 1); });
      _tile_stored(0, o, Task::kOStride * 4);
      if (two) _tile_stored(7, o + G * Task::kOStride, Task::kOStride * 4);
    }
  }
}
#endif

// qk_tile_fp32 for the first head tile of a row tile: it reads the rows from the cache (K_n = key[n] |
// rope[n]), widens them in registers and, if STORE, also stores them, widened, at k[n] (rows D1 + D2
// apart), where the other head tiles and the P.V pass read them. Each row is converted once per step;
// the stores ride along with this tile's FMAs. Without STORE (the rows straight from the cache), whole
// runs of two vectors are widened at a time where widens_two_vectors<W>() (bf16 in pairs on AVX2, against
// a query paired the same way: pairs_columns). The rows' bytes are widened as W: T, or NanChecked<T>
// where the tile's rows hold no NaN.
template <typename T, int64_t D1, int64_t D2, int MH, int NR, bool STORE = true, typename W = T>
inline void qk_tile_widening(const float* q, const T* const* key, const T* const* rope, float* k, float scale,
                             float* s, int64_t lds) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t kLanes = Vec::size();
  constexpr int64_t D = D1 + D2;
  Vec acc[MH][NR];
  for (int h = 0; h < MH; ++h)
    for (int n = 0; n < NR; ++n) acc[h][n] = Vec(0.f);
  auto step = [&](const T* const* rows, int64_t i, int64_t col, int64_t count) __attribute__((always_inline)) {
    Vec kv[NR];
    for (int n = 0; n < NR; ++n) {
      const auto* row = reinterpret_cast<const W*>(rows[n] + i);
      kv[n] = count == kLanes ? load_floats(row) : load_floats(row, count);
      if constexpr (STORE) {
        if (count == kLanes) {
          kv[n].store(k + n * D + col);
        } else {
          kv[n].store(k + n * D + col, count);
        }
      }
    }
    for (int h = 0; h < MH; ++h) {
      const Vec qv = in_register(count == kLanes ? Vec::loadu(q + h * D + col) : Vec::loadu(q + h * D + col, count));
      for (int n = 0; n < NR; ++n) acc[h][n] = at::vec::fmadd(qv, kv[n], acc[h][n]);
    }
  };
  // columns [0, width) of rows, which are columns [col, col + width) of K_n and of q
  auto segment = [&](const T* const* rows, int64_t width, int64_t col) __attribute__((always_inline)) {
    int64_t i = 0;
    if constexpr (widens_two_vectors<W>() && !STORE) {
      for (; i + 2 * kLanes <= width; i += 2 * kLanes) {
        Vec lo[NR], hi[NR];
        for (int n = 0; n < NR; ++n) widen_two_vectors(reinterpret_cast<const W*>(rows[n] + i), lo[n], hi[n]);
        for (int h = 0; h < MH; ++h) {
          const Vec q_lo = Vec::loadu(q + h * D + col + i), q_hi = Vec::loadu(q + h * D + col + i + kLanes);
          for (int n = 0; n < NR; ++n) acc[h][n] = at::vec::fmadd(q_hi, hi[n], at::vec::fmadd(q_lo, lo[n], acc[h][n]));
        }
      }
    }
    for (; i + kLanes <= width; i += kLanes) step(rows, i, col + i, kLanes);
    if (i < width) step(rows, i, col + i, width - i);
  };
  segment(key, D1, 0);
  if constexpr (D2 > 0) segment(rope, D2, D1);
  for (int h = 0; h < MH; ++h) horizontal_sums<NR>(acc[h], s + h * lds, scale);
}

// Row tiles ahead whose rows the score pass prefetches into L2 (the pass is the first to read them).
constexpr int kPrefetchTilesFp32 = 2;

// What rows of C that hold no NaN are widened as: e4m3fn rows skip the NaN fix (holds_e4m3fn_nan).
template <typename C>
using NanChecked = std::conditional_t<std::is_same_v<C, c10::Float8_e4m3fn>, Float8_e4m3fn_nan_free, C>;

// Whether `count` rows of C (`width` values each) can be widened as NanChecked<C>: they hold no NaN, or C
// has no NaN fix to skip. The rows are read again straight after, from L1.
template <typename C>
inline bool nan_free(const C* const* rows, int count, int64_t width) {
  if constexpr (std::is_same_v<NanChecked<C>, C>) {
    return false;
  } else {
    bool nan = false;
    for (int i = 0; i < count; ++i) nan |= holds_e4m3fn_nan(rows[i], width);
    return !nan;
  }
}

// f.template operator()<W>() with W = NanChecked<C> where `checked` (the rows hold no NaN), else C.
template <typename C, typename F>
__attribute__((always_inline)) inline void widened_as(bool checked, F&& f) {
  if constexpr (!std::is_same_v<NanChecked<C>, C>) {
    if (checked) {
      f.template operator()<NanChecked<C>>();
      return;
    }
  }
  f.template operator()<C>();
}

// Value rows for the P.V tiles: a block's cache rows of C, widened as W (the same bytes).
template <typename W, typename C>
struct RowsAs {
  const C* const* rows;
  const W* operator[](int j) const { return reinterpret_cast<const W*>(rows[j]); }
};

// Scores s [H, kKvBlock] of the block's n rows from qf (the query in fp32, rows D apart). Beyond
// kDirectHeads heads it leaves the rows widened in keys [n, D1 + D2]: the first head tile of each row
// tile widens them, the others and the P.V pass read the fp32 copy from L1 / L2. Returns whether the
// P.V pass may widen a value cache of its own as NanChecked<T> (kDirectHeads heads or fewer: the rows
// are checked here, with their keys).
template <int H, int64_t D1, int64_t D2, int64_t L, typename T, typename IndexT>
inline bool block_scores_fp32(const float* qf, const RequestBlocks<T, IndexT, D2>& b, int n, int n_next,
                              float scale, float* s, float* keys) {
  constexpr int64_t D = D1 + D2;
  // a tile's rows without NaN (e4m3fn) are widened without the NaN fix, its scores otherwise the same
  const auto checked = [&](int n0, int count) {
    return nan_free(b.key.rows + n0, count, D1) && (D2 == 0 || nan_free(b.rope.rows + n0, count, D2));
  };
  if constexpr (widens_from_cache(H)) {
    bool values_checked = true;  // (without a value cache of their own, the values are the keys' columns)
    for (int n0 = 0; n0 < n; n0 += kDirectRows) {
      const int ahead = n0 + kPrefetchTilesFp32 * kDirectRows;
      prefetch_block_rows(b.key, ahead, kDirectRows, n, n_next, D1 * int64_t(sizeof(T)));
      if constexpr (D2 > 0) prefetch_block_rows(b.rope, ahead, kDirectRows, n, n_next, D2 * int64_t(sizeof(T)));
      // the P.V pass reads a value cache of its own straight after: its rows come in with the keys
      if (b.own_values) prefetch_block_rows(b.value, ahead, kDirectRows, n, n_next, L * int64_t(sizeof(T)));
      const int count = std::min(kDirectRows, n - n0);
      const bool keys_checked = checked(n0, count);
      if (values_checked) values_checked = b.own_values ? nan_free(b.value.rows + n0, count, L) : keys_checked;
      widened_as<T>(keys_checked, [&]<typename W>() {
        dispatch_count<kDirectRows>(count, [&]<int NR>() {
          qk_tile_widening<T, D1, D2, H, NR, false, W>(qf, b.key.rows + n0, b.rope.rows + n0, nullptr, scale,
                                                       s + n0, kKvBlock);
        });
      });
    }
    return values_checked;
  }
  constexpr int kHeadTiles = (H + kQkHeadsFp32 - 1) / kQkHeadsFp32;
  for (int n0 = 0; n0 < n; n0 += kQkRowsFp32) {
    const int ahead = n0 + kPrefetchTilesFp32 * kQkRowsFp32;
    const int count = std::min(kQkRowsFp32, n - n0);
    const bool keys_checked = checked(n0, count);
    dispatch_count<kQkRowsFp32>(count, [&]<int NR>() {
      float* k = keys + n0 * D;
      for (int h0 = 0; h0 < H; h0 += kQkHeadsFp32) {
        // the rows ahead, one per head tile: all of them before the head tiles (72 lines at MLA's shape)
        // stalled on the miss buffers (figures at kPvPrefetchRows)
        for (int i = h0 / kQkHeadsFp32; i < kQkRowsFp32; i += kHeadTiles) {
          prefetch_block_rows(b.key, ahead + i, 1, n, n_next, D1 * int64_t(sizeof(T)));
          if constexpr (D2 > 0) prefetch_block_rows(b.rope, ahead + i, 1, n, n_next, D2 * int64_t(sizeof(T)));
        }
        dispatch_count<kQkHeadsFp32>(std::min(kQkHeadsFp32, H - h0), [&]<int MH>() {
          float* out = s + h0 * kKvBlock + n0;
          if (h0 != 0) {
            qk_tile_fp32<D, MH, NR>(qf + h0 * D, k, scale, out, kKvBlock);
          } else {
            widened_as<T>(keys_checked, [&]<typename W>() {
              qk_tile_widening<T, D1, D2, MH, NR, true, W>(qf, b.key.rows + n0, b.rope.rows + n0, k, scale, out,
                                                           kKvBlock);
            });
          }
        });
      }
    });
  }
  return false;
}

// values[i] = V_i in fp32 for the block's n rows, for a value cache of its own (grouped-query attention),
// prefetching rows kPrefetchTilesFp32 row tiles ahead.
template <int64_t L, typename T, typename IndexT>
inline void widen_values(const BlockRows<T, IndexT>& value, int n, int n_next, float* values) {
  for (int i = 0; i < n; ++i) {
    if (i % kQkRowsFp32 == 0)
      prefetch_block_rows(value, i + kPrefetchTilesFp32 * kQkRowsFp32, kQkRowsFp32, n, n_next, L * int64_t(sizeof(T)));
    widened_as<T>(nan_free(value.rows + i, 1, L), [&]<typename W>() {
      widen_row(reinterpret_cast<const W*>(value.rows[i]), L, values + i * L);
    });
  }
}

// o = alpha * o + p . values (alpha = nullptr: o = p . values) over n value rows. Column chunks
// outside, head tiles inside: a chunk of every row (8 KiB for 128 rows) stays in L1 while all head tiles
// pass over it; the other order read the whole block from L2 once per head tile, which bound the pass
// by L2 bandwidth (1.6x slower on an AVX2 EPYC).
template <int H, int64_t L, typename Rows>
inline void block_pv_fp32(const float* p, Rows values, int n, const float* alpha, SoftmaxState& st) {
  constexpr int kHeadTiles = (H + kPvHeadsFp32 - 1) / kPvHeadsFp32;
  constexpr int kTileHeads = (H + kHeadTiles - 1) / kHeadTiles;
  constexpr int64_t kChunk = kPvVecsFp32 * at::vec::Vectorized<float>::size();
  for (int64_t c = 0; c < L; c += kChunk) {
    const int count = static_cast<int>(std::min(kChunk, L - c));
    for (int h0 = 0; h0 < H; h0 += kTileHeads) {
      const float* tile_alpha = alpha == nullptr ? nullptr : alpha + h0;
      dispatch_count<kTileHeads>(std::min(kTileHeads, H - h0), [&]<int MH>() {
        if (count == kChunk) {
          pv_tile_fp32<MH, kPvVecsFp32>(p + h0 * kKvBlock, kKvBlock, values, n, c, tile_alpha, st.o + h0 * L, L);
        } else {
          pv_tail_fp32<MH>(p + h0 * kKvBlock, kKvBlock, values, n, c, count, tile_alpha, st.o + h0 * L, L);
        }
      });
    }
  }
}

// Attention of H query heads (q rows ldq apart, D1 + D2 columns) over rows [j0, j1) of one request,
// whose cache holds C (T, or fp8 with row scales), into st (m and l initialised by the caller; o not
// written if no row is admitted). mask (nullptr: none) holds the request's per-row mask, indexed by
// row. `zero_row` pads an odd block, so that no row at or past the request's length is ever read.
template <typename T, typename C, typename IndexT, int H, int64_t D1, int64_t D2, int64_t L, typename MaskT = bool>
inline void attend_split(const T* q, int64_t ldq, const RequestRows<C, IndexT>& request, int64_t j0, int64_t j1,
                         float scale, float softcap, const MaskT* mask, const C* zero_row, SoftmaxState& st) {
  constexpr bool kAmx = use_amx_kernels<T, C, H, L>();
  constexpr bool kConvert = !kAmx && converts_fp8_to_bf16<T, C, H, L>();
  constexpr bool kBf16 = !kAmx && runs_bf16_kernels<T, C, H, L>();
  constexpr bool kVector = !kAmx && !kBf16;  // the portable fp32 kernels
  constexpr bool kDirect = kVector && widens_from_cache(H);
  using ProbT = std::conditional_t<kVector, float, c10::BFloat16>;
  constexpr int64_t D = D1 + D2;
  alignas(64) float s[H * kKvBlock];
  alignas(64) ProbT p_block[kAmx ? 1 : H * kKvBlock];
  ProbT* p = p_block;
  alignas(64) float key_row_scale[kKvBlock];
  alignas(64) float value_row_scale[kKvBlock];
  float alpha[H];
  RequestBlocks<C, IndexT, D2> b{{request.key, request.key_stride}, {request.rope, D2},
                                 {request.value, request.value_stride}, request.value != nullptr};
  auto gather = [&](int64_t j, int n) {
    b.key.gather(request.block_size, request.table, j, n);
    if constexpr (D2 > 0) b.rope.gather(request.block_size, request.table, j, n);
    if (b.own_values) b.value.gather(request.block_size, request.table, j, n);
  };
  // The portable path's fp32 copies: the query, then (unless kDirect) a block's keys and (own) values.
  float* qf = nullptr;
  float* keys = nullptr;
  float* values = nullptr;
  if constexpr (kVector) {
    qf = thread_scratch(H * D + (kDirect ? 0 : kKvBlock * D + (b.own_values ? kKvBlock * L : 0)));
    keys = qf + H * D;
    values = keys + kKvBlock * D;
    for (int h = 0; h < H; ++h) {
      widen_row(q + h * ldq, D, qf + h * D);
      if constexpr (pairs_columns<C, H>()) {  // in the order the score tiles widen the rows
        pair_columns(qf + h * D, D1);
        pair_columns(qf + h * D + D1, D2);
      }
    }
  }
  // kConvert: a block's rows in bf16, keys [kKvBlock + 1, D] then own values [kKvBlock + 1, L] (the last
  // row of each zeros, for an odd block's pad), and the dpbf16 kernels' view of them (convert_rows)
  c10::BFloat16* converted_keys = nullptr;
  c10::BFloat16* converted_values = nullptr;
  [[maybe_unused]] std::conditional_t<kConvert, RequestBlocks<c10::BFloat16, IndexT, D2>, bool> converted;
  if constexpr (kConvert) {
    const int64_t key_values = (kKvBlock + 1) * D;
    const int64_t values_values = b.own_values ? (kKvBlock + 1) * L : 0;
    converted_keys = reinterpret_cast<c10::BFloat16*>(thread_scratch((key_values + values_values + 1) / 2));
    converted_values = converted_keys + key_values;
    std::fill_n(converted_keys + kKvBlock * D, D, c10::BFloat16(0.f));
    if (b.own_values) std::fill_n(converted_values + kKvBlock * L, L, c10::BFloat16(0.f));
  }
#if defined(MLA_INDUCTOR_AMX)
  std::optional<AmxTask<H, D, L>> amx;
  if constexpr (kAmx) {
    amx.emplace(q, ldq);  // (each pass configures the tiles it uses)
    p = amx->p;
  }
#endif
  bool first = true;  // o is written, not rescaled, by the first block that is not skipped
  bool values_checked = false;  // the portable P.V widens the block's value rows as NanChecked<C>
  gather(j0, static_cast<int>(std::min<int64_t>(kKvBlock, j1 - j0)));
  for (int64_t jb = j0; jb < j1; jb += kKvBlock) {
    const int n = static_cast<int>(std::min<int64_t>(kKvBlock, j1 - jb));
    b.key.advance(n, zero_row);
    if constexpr (D2 > 0) b.rope.advance(n, zero_row);
    if (b.own_values) b.value.advance(n, zero_row);
    const int n_next = static_cast<int>(std::clamp<int64_t>(j1 - jb - n, 0, kKvBlock));
    gather(jb + n, n_next);
    alignas(64) float bias[kKvBlock];
    if (mask != nullptr) {
      for (int i = 0; i < n; ++i) bias[i] = mask_bias(mask[jb + i]);
      if (excludes_all(bias, n)) continue;
    }

    // the keys of an fp8 cache come widened times kWidenedScale<C>; merge_splits undoes it on the values
    if constexpr (kAmx) {
#if defined(MLA_INDUCTOR_AMX)
      block_scores_amx<H, D1, D2, L>(*amx, b, n, n_next, scale / kWidenedScale<C>, zero_row, s);
#endif
    } else if constexpr (kConvert) {
#if defined(__AVX512BF16__)
      block_scores_bf16<H, D1, D2, L>(q, ldq, converted, n, 0, scale / kWidenedScale<C>, s, [&](int n0, int tile) {
        convert_rows<D1, D2, L>(b, n0, tile, n, n_next, converted_keys, converted_values, converted);
      });
#endif
    } else if constexpr (kBf16) {
#if defined(__AVX512BF16__)
      block_scores_bf16<H, D1, D2, L>(q, ldq, b, n, n_next, scale / kWidenedScale<C>, s,
                                       [&](int n0, int tile) __attribute__((always_inline)) {
        prefetch_values_and_next_keys<D1, L>(b, n0, tile, n_next);
      });
#endif
    } else {
      values_checked = block_scores_fp32<H, D1, D2, L>(qf, b, n, n_next, scale / kWidenedScale<C>, s, keys);
      if (b.own_values && !kDirect) widen_values<L>(b.value, n, n_next, values);
    }
    // An fp8 cache's scales, per row. A latent cache's rows are their keys and values both: one gather.
    const RowScales& key_scale = request.key_scale;
    const RowScales& value_scale = request.value_scale;
    const bool shared_scales = value_scale.same_as(key_scale);
    if (key_scale.data != nullptr) gather_scales(key_scale, request.block_size, request.table, jb, n, key_row_scale);
    if (value_scale.data != nullptr && !shared_scales)
      gather_scales(value_scale, request.block_size, request.table, jb, n, value_row_scale);
    softmax_step<ProbT>(s, H, n, key_scale.data != nullptr ? key_row_scale : nullptr, softcap,
                        mask != nullptr ? bias : nullptr,
                        value_scale.data == nullptr ? nullptr : shared_scales ? key_row_scale : value_row_scale, st,
                        alpha, p);

    // o = alpha * o + p . V (o = p . V on the first block).
    if constexpr (kAmx) {
#if defined(MLA_INDUCTOR_AMX)
      pad_probabilities_amx(*amx, n);
      block_pv_amx(*amx, n, first ? nullptr : alpha);
#endif
    } else if constexpr (kConvert) {
#if defined(__AVX512BF16__)
      block_pv_bf16<H, L>(p, converted, n, first ? nullptr : alpha, st);
#endif
    } else if constexpr (kBf16) {
#if defined(__AVX512BF16__)
      block_pv_bf16<H, L>(p, b, n, first ? nullptr : alpha, st);
#endif
    } else {
      const float* rescale = first ? nullptr : alpha;
      if constexpr (kDirect) {
        const C* const* rows = b.own_values ? b.value.rows : b.key.rows;
        widened_as<C>(values_checked,
                      [&]<typename W>() { block_pv_fp32<H, L>(p, RowsAs<W, C>{rows}, n, rescale, st); });
      } else {
        block_pv_fp32<H, L>(p, StridedRows{b.own_values ? values : keys, b.own_values ? L : D}, n, rescale, st);
      }
    }
    first = false;
  }
#if defined(MLA_INDUCTOR_AMX)
  if constexpr (kAmx) {
    _tile_release();
    if (!first)
      for (int h = 0; h < H; ++h) std::copy_n(amx->o + h * AmxTask<H, D, L>::kOStride, L, st.o + h * L);
  }
#endif
}

// latent = stored with its columns in natural order: the bf16 and AMX P.V kernels store them permuted in
// runs of four (paired_column), which move as one 16-byte copy (a scalar loop over the columns cost 1.5% of a
// 4096-row step and most of a short one); the portable one, reading bf16 rows in pairs, swaps two runs
// of four in every sixteen (pair_columns).
template <typename T, typename C, int H, int64_t L>
inline void restore_column_order(const float* stored, float* latent) {
#if defined(__AVX512BF16__)
  if constexpr (runs_bf16_kernels<T, C, H, L>() || use_amx_kernels<T, C, H, L>()) {
    for (int64_t i = 0; i < L; i += 4) {
      const int64_t column = (i & ~int64_t(31)) + paired_column(static_cast<int>(i & 31));
      std::memcpy(latent + column, stored + i, 4 * sizeof(float));
    }
    return;
  }
#endif
  std::copy(stored, stored + L, latent);
  if constexpr (pairs_columns<C, H>()) pair_columns(latent, L);
}

// Per-task scratch of the template: m [H], l [H], then o [H, L] (columns as restore_column_order takes them).
template <int H, int64_t L>
constexpr int64_t kTaskFloats = H * (L + 2);

// The normalised latent output of head h, in natural column order: the splits' partial results are
// weighed by exp(m_s - max_s m_s), i.e. merged by their log-sum-exp. A request without rows gets zeros.
// T and C: the query and cache types the tasks ran attend_split with.
template <typename T, typename C, int H, int64_t L>
inline void merge_splits(const float* tasks, int64_t splits, int h, float* latent) {
  constexpr int64_t kTask = kTaskFloats<H, L>;
  float m_max = -std::numeric_limits<float>::infinity();
  for (int64_t sp = 0; sp < splits; ++sp) m_max = max_keeping_nan(m_max, tasks[sp * kTask + h]);
  if (m_max == -std::numeric_limits<float>::infinity()) {
    std::fill(latent, latent + L, 0.f);
    return;
  }
  float denominator = 0.f;
  for (int64_t sp = 0; sp < splits; ++sp)
    denominator += std::exp(tasks[sp * kTask + h] - m_max) * tasks[sp * kTask + H + h];
  using Vec = at::vec::Vectorized<float>;
  alignas(64) float merged[L] = {};
  for (int64_t sp = 0; sp < splits; ++sp) {
    const float* task = tasks + sp * kTask;
    if (task[H + h] == 0.f) continue;
    const Vec weight(std::exp(task[h] - m_max) / denominator / kWidenedScale<C>);  // o holds widened values
    const float* o = task + 2 * H + h * L;
    for (int64_t i = 0; i < L; i += Vec::size()) {
      const int64_t count = std::min<int64_t>(Vec::size(), L - i);
      at::vec::fmadd(weight, Vec::loadu(o + i, count), Vec::loadu(merged + i, count)).store(merged + i, count);
    }
  }
  restore_column_order<T, C, H, L>(merged, latent);
}

// out[k * ld_out + r] = latents[k] . w[r] for NB requests x NR rows of w, rounded once. The tile's
// sizes are compile-time constants so that its NB x NR accumulators stay in registers (GCC keeps them
// on the stack if a branch in the loop or a rolled loop after it touches the array); each w row is
// widened once per tile. The next tile's rows (`rows_ahead` of them) are prefetched: W_vc comes from
// memory once per head.
template <typename T, int64_t L, int NB, int NR>
inline void deabsorb_tile(const float* latents, const T* w, int64_t ldw, int rows_ahead, T* out, int64_t ld_out) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t W = Vec::size();
  const T* ahead[NR];  // past the last row: the last row again
  for (int r = 0; r < NR; ++r) ahead[r] = w + std::min(NR + r, NR - 1 + rows_ahead) * ldw;
  Vec acc[NB][NR];
  for (auto& row : acc)
    for (auto& a : row) a = Vec(0.f);
  auto step = [&](int64_t i, int64_t count) __attribute__((always_inline)) {
    Vec wv[NR];
    for (int r = 0; r < NR; ++r) {
      __builtin_prefetch(ahead[r] + i);
      wv[r] = load_floats(w + r * ldw + i, count);
    }
    for (int k = 0; k < NB; ++k) {
      const Vec x = Vec::loadu(latents + k * L + i, count);
      for (int r = 0; r < NR; ++r) acc[k][r] = at::vec::fmadd(x, wv[r], acc[k][r]);
    }
  };
  for (int64_t i = 0; i + W <= L; i += W) step(i, W);
  if constexpr (L % W != 0) step(L - L % W, L % W);  // partial loads zero-fill
#pragma GCC unroll 8
  for (int k = 0; k < NB; ++k) {
    float sums[NR];
    horizontal_sums<NR>(acc[k], sums);
    for (int r = 0; r < NR; ++r) out[k * ld_out + r] = static_cast<T>(sums[r]);
  }
}

// out[b * ld_out + n] = latents[b] . w[n] for the requests of one head (the W_vc de-absorption), in
// tiles of up to 4 requests x 4 rows of w.
template <typename T, int64_t L>
inline void deabsorb_head(const float* latents, int64_t batch, const T* w, int64_t ldw, int64_t n_out, T* out,
                          int64_t ld_out) {
  constexpr int kRequests = 4, kRows = 4;
  for (int64_t b0 = 0; b0 < batch; b0 += kRequests) {
    dispatch_count<kRequests>(static_cast<int>(std::min<int64_t>(kRequests, batch - b0)), [&]<int NB>() {
      for (int64_t n0 = 0; n0 < n_out; n0 += kRows) {
        const int rows_ahead = static_cast<int>(std::clamp<int64_t>(n_out - n0 - kRows, 0, kRows));
        dispatch_count<kRows>(static_cast<int>(std::min<int64_t>(kRows, n_out - n0)), [&]<int NR>() {
          deabsorb_tile<T, L, NB, NR>(latents + b0 * L, w + n0 * ldw, ldw, rows_ahead, out + b0 * ld_out + n0,
                                      ld_out);
        });
      }
    });
  }
}

}  // namespace mla_inductor
