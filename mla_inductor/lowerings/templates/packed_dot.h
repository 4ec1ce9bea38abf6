// NN tiles over a weight packed at compile time (freezing) into column blocks, each one sequential
// stream that the hardware prefetcher follows at full bandwidth (where NT tiles read four rows 14 KiB
// apart). Two layouts behind one interface (packed_tasks, packed_block_elems, packed_task);
// lowerings/segment_gemm.py packs for the target Inductor compiles for:
//
// AVX-512: VNNI pairs, block[kp][c][e] = W[n0 + c][2 * kp + e] (c < 32, e < 2). Each step reads two
//   64-byte lines of the block against 8 x rows.
//   - With AVX512-BF16 it broadcasts a pair of x values (one 32-bit load) and issues 2 * MR dpbf16.
//     At 8 x rows it streamed 32 GB/s where the NT tiles managed 17-19 (benchmarks/qkv_a.py,
//     docs/qkv_a.md).
//   - Without (Skylake / Cascade Lake / Ice Lake Xeons) a line widens in two ops, a shift for the even
//     k and a mask for the odd k (a bf16 is the high half of an fp32), against x widened to fp32 a chunk
//     at a time, once per row tile, and broadcast from L1: 4 MR FMAs per 4 widening ops, where the NT
//     tiles widen one x or weight vector per FMA over bf16 x (docs/linear.md).
// AVX2: block[k][c] = W[n0 + c][k] (c < 16). Each step widens 16 weights (two 16-bit shifts) and
//   broadcasts one fp32 x value per row against them, 2 * MR FMAs; x is widened to fp32 a chunk at a
//   time, once per row tile.
//
// Blocks are zero-padded in columns (and the VNNI layout in k to a whole pair).
#pragma once
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__FMA__))
#error "packed_dot.h needs AVX-512 or AVX2 with FMA: the lowering packs weights only for such targets"
#endif
#include <immintrin.h>

namespace mla_inductor {

// A row tile's x chunk in fp32, for the FMA tiles: x's rows [0, mr) over columns [k0, k1) at xf + m * ldf,
// zeros after them up to `width` (an odd K's pad, which pairs with a zero weight but must be finite).
inline void widen_chunk(const c10::BFloat16* x, int64_t ldx, int mr, int64_t k0, int64_t k1, int64_t width,
                        float* xf, int64_t ldf) {
  for (int m = 0; m < mr; ++m) {
    float* row = xf + m * ldf;
    widen_row(x + m * ldx + k0, k1 - k0, row);
    std::fill(row + (k1 - k0), row + width, 0.f);
  }
}

#if defined(__AVX512F__)

constexpr int64_t kPackedCols = 32;  // two fp32 vectors of outputs per x row
constexpr int kPackedRows = 8;       // x rows per register tile: 16 accumulators + 2 weight vectors
// k pairs per chunk when the rows need several tiles: 16 KiB of the block stays in L1 while every
// row tile passes over it.
constexpr int64_t kPackedChunk = 128;

// Software prefetch distance, in k pairs: 64 KiB ahead into L2. The hardware prefetcher alone leaves
// the stream short of bandwidth once the dpbf16 work per byte grows (8 rows: median 29 -> 40 GB/s
// in a standalone harness with huge pages), while a lone row streams faster without it (38 -> 29
// GB/s with it), so tiles of kPrefetchMinRows rows and more prefetch. Prefetches past the block's
// end touch the next block or nothing: a prefetch never faults.
constexpr int64_t kPrefetchPairs = 512;
constexpr int kPrefetchMinRows = 4;

constexpr int64_t packed_block_elems(int64_t K) { return (K + 1) / 2 * 2 * kPackedCols; }

// The lanes of a block's two 16-column halves that hold its first `cols` columns.
struct HalfMasks {
  __mmask16 lo, hi;
};
inline HalfMasks half_masks(int64_t cols) {
  return {cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1),
          cols >= 32 ? __mmask16(0xFFFF) : cols <= 16 ? __mmask16(0) : __mmask16((1u << (cols - 16)) - 1)};
}

#if defined(__AVX512BF16__)

template <int MR>
__attribute__((always_inline)) inline void packed_step_bf16(__m512 (&a)[MR][2], const int32_t (&pairs)[MR],
                                                            const c10::BFloat16* w) {
  const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);                // columns 0..15, both k of the pair
  const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + kPackedCols);  // columns 16..31
  for (int m = 0; m < MR; ++m) {
    const __m512bh xb = (__m512bh)_mm512_set1_epi32(pairs[m]);
    a[m][0] = _mm512_dpbf16_ps(a[m][0], xb, w0);
    a[m][1] = _mm512_dpbf16_ps(a[m][1], xb, w1);
  }
}

// acc[MR x 2] (in memory) += x[:, pairs kp0..kp1) . block[kp0..kp1), accumulating in registers.
template <int MR, bool PREFETCH>
inline void packed_chunk_bf16(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* block, int64_t K,
                              int64_t kp0, int64_t kp1, __m512* acc) {
  __m512 a[MR][2];
  for (int m = 0; m < MR; ++m) a[m][0] = acc[2 * m], a[m][1] = acc[2 * m + 1];
  int32_t pairs[MR];
  const int64_t full_pairs = std::min(kp1, K / 2);
  for (int64_t kp = kp0; kp < full_pairs; ++kp) {
    if constexpr (PREFETCH && MR >= kPrefetchMinRows) {
      const char* ahead = reinterpret_cast<const char*>(block + (kp + kPrefetchPairs) * 2 * kPackedCols);
      _mm_prefetch(ahead, _MM_HINT_T1);
      _mm_prefetch(ahead + 64, _MM_HINT_T1);
    }
    for (int m = 0; m < MR; ++m) std::memcpy(&pairs[m], x + m * ldx + 2 * kp, 4);
    packed_step_bf16<MR>(a, pairs, block + kp * 2 * kPackedCols);
  }
  if (full_pairs < kp1) {  // odd K: the last pair is x[K - 1] and a zero (never read past the row)
    for (int m = 0; m < MR; ++m) {
      pairs[m] = 0;
      std::memcpy(&pairs[m], x + m * ldx + K - 1, 2);
    }
    packed_step_bf16<MR>(a, pairs, block + full_pairs * 2 * kPackedCols);
  }
  for (int m = 0; m < MR; ++m) acc[2 * m] = a[m][0], acc[2 * m + 1] = a[m][1];
}

template <int MR, bool PREFETCH>
inline void packed_tile_bf16(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* block, int64_t K,
                             int64_t kp0, int64_t kp1, float* out, int64_t ldo, __mmask16 lo, __mmask16 hi,
                             bool first) {
  __m512 acc[2 * MR];
  for (int m = 0; m < MR; ++m) {
    acc[2 * m] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(lo, out + m * ldo);
    acc[2 * m + 1] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(hi, out + m * ldo + 16);
  }
  packed_chunk_bf16<MR, PREFETCH>(x, ldx, block, K, kp0, kp1, acc);
  for (int m = 0; m < MR; ++m) {
    _mm512_mask_storeu_ps(out + m * ldo, lo, acc[2 * m]);
    _mm512_mask_storeu_ps(out + m * ldo + 16, hi, acc[2 * m + 1]);
  }
}

// out[m, c] = sum_k x[m, k] * W[n0 + c, k] in fp32 for m < M and c < cols (<= kPackedCols), W[n0:] being
// the packed `block` (with `accumulate`, added to out's sums). Up to kPackedRows rows run in registers over
// all of k; more rows take k in chunks. PREFETCH: the block is a stream from memory whose future the tiles
// ask for (kPrefetchPairs); not for a chunk packed into the stack (pack_chunk_from_rows), past which a
// prefetch would touch unmapped pages, a page walk each.
template <bool PREFETCH = true>
inline void packed_block_bf16(const c10::BFloat16* x, int64_t ldx, int64_t M, const c10::BFloat16* block,
                              int64_t K, int64_t cols, float* out, int64_t ldo, bool accumulate = false) {
  const auto [lo, hi] = half_masks(cols);
  const int64_t pairs = (K + 1) / 2;
  const int64_t chunk = M <= kPackedRows ? pairs : kPackedChunk;
  for (int64_t kp0 = 0; kp0 < pairs; kp0 += chunk) {
    const int64_t kp1 = std::min(pairs, kp0 + chunk);
    for (int64_t m0 = 0; m0 < M; m0 += kPackedRows) {
      const c10::BFloat16* xm = x + m0 * ldx;
      float* om = out + m0 * ldo;
      const bool first = kp0 == 0 && !accumulate;
      switch (std::min<int64_t>(kPackedRows, M - m0)) {
        case 8: packed_tile_bf16<8, PREFETCH>(xm, ldx, block, K, kp0, kp1, om, ldo, lo, hi, first); break;
        case 7: packed_tile_bf16<7, PREFETCH>(xm, ldx, block, K, kp0, kp1, om, ldo, lo, hi, first); break;
        case 6: packed_tile_bf16<6, PREFETCH>(xm, ldx, block, K, kp0, kp1, om, ldo, lo, hi, first); break;
        case 5: packed_tile_bf16<5, PREFETCH>(xm, ldx, block, K, kp0, kp1, om, ldo, lo, hi, first); break;
        case 4: packed_tile_bf16<4, PREFETCH>(xm, ldx, block, K, kp0, kp1, om, ldo, lo, hi, first); break;
        case 3: packed_tile_bf16<3, PREFETCH>(xm, ldx, block, K, kp0, kp1, om, ldo, lo, hi, first); break;
        case 2: packed_tile_bf16<2, PREFETCH>(xm, ldx, block, K, kp0, kp1, om, ldo, lo, hi, first); break;
        default: packed_tile_bf16<1, PREFETCH>(xm, ldx, block, K, kp0, kp1, om, ldo, lo, hi, first);
      }
    }
  }
}

#else  // AVX-512 without BF16

// acc[MR][2] (in memory: out rows, or zero when first) += xf[:, 0 : 2 (kp1 - kp0)) . block[kp0..kp1),
// xf holding the row tile's x chunk in fp32 (rows 2 kPackedChunk apart, an odd K's pad zeroed).
template <int MR, bool PREFETCH>
inline void packed_tile_fma(const float* xf, const c10::BFloat16* block, int64_t kp0, int64_t kp1, float* out,
                            int64_t ldo, __mmask16 lo, __mmask16 hi, bool first) {
  constexpr int64_t kLdx = 2 * kPackedChunk;
  __m512 a[MR][2];
  for (int m = 0; m < MR; ++m) {
    a[m][0] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(lo, out + m * ldo);
    a[m][1] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(hi, out + m * ldo + 16);
  }
  const __m512i odd = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t kp = kp0; kp < kp1; ++kp) {
    const c10::BFloat16* w = block + kp * 2 * kPackedCols;
    if constexpr (PREFETCH && MR >= kPrefetchMinRows) {
      const char* ahead = reinterpret_cast<const char*>(w + kPrefetchPairs * 2 * kPackedCols);
      _mm_prefetch(ahead, _MM_HINT_T1);
      _mm_prefetch(ahead + 64, _MM_HINT_T1);
    }
    const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + kPackedCols);
    const __m512 even0 = _mm512_castsi512_ps(_mm512_slli_epi32(w0, 16));  // W[c][2 kp], c < 16
    const __m512 odd0 = _mm512_castsi512_ps(_mm512_and_si512(w0, odd));   // W[c][2 kp + 1]
    const __m512 even1 = _mm512_castsi512_ps(_mm512_slli_epi32(w1, 16));  // columns 16..31
    const __m512 odd1 = _mm512_castsi512_ps(_mm512_and_si512(w1, odd));
    const float* xk = xf + 2 * (kp - kp0);
    for (int m = 0; m < MR; ++m) {
      const __m512 xe = _mm512_set1_ps(xk[m * kLdx]), xo = _mm512_set1_ps(xk[m * kLdx + 1]);
      a[m][0] = _mm512_fmadd_ps(xe, even0, a[m][0]);
      a[m][1] = _mm512_fmadd_ps(xe, even1, a[m][1]);
      a[m][0] = _mm512_fmadd_ps(xo, odd0, a[m][0]);
      a[m][1] = _mm512_fmadd_ps(xo, odd1, a[m][1]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm512_mask_storeu_ps(out + m * ldo, lo, a[m][0]);
    _mm512_mask_storeu_ps(out + m * ldo + 16, hi, a[m][1]);
  }
}

// As packed_block_bf16 with AVX512-BF16 above; k in chunks that every row tile passes over while they are
// in L1.
template <bool PREFETCH = true>
inline void packed_block_bf16(const c10::BFloat16* x, int64_t ldx, int64_t M, const c10::BFloat16* block,
                              int64_t K, int64_t cols, float* out, int64_t ldo, bool accumulate = false) {
  const auto [lo, hi] = half_masks(cols);
  alignas(64) float xf[kPackedRows * 2 * kPackedChunk];
  const int64_t pairs = (K + 1) / 2;
  for (int64_t kp0 = 0; kp0 < pairs; kp0 += kPackedChunk) {
    const int64_t kp1 = std::min(pairs, kp0 + kPackedChunk);
    const int64_t k0 = 2 * kp0, k1 = std::min(K, 2 * kp1);
    for (int64_t m0 = 0; m0 < M; m0 += kPackedRows) {
      const int mr = static_cast<int>(std::min<int64_t>(kPackedRows, M - m0));
      widen_chunk(x + m0 * ldx, ldx, mr, k0, k1, 2 * (kp1 - kp0), xf, 2 * kPackedChunk);
      float* om = out + m0 * ldo;
      const bool first = kp0 == 0 && !accumulate;
      switch (mr) {
        case 8: packed_tile_fma<8, PREFETCH>(xf, block, kp0, kp1, om, ldo, lo, hi, first); break;
        case 7: packed_tile_fma<7, PREFETCH>(xf, block, kp0, kp1, om, ldo, lo, hi, first); break;
        case 6: packed_tile_fma<6, PREFETCH>(xf, block, kp0, kp1, om, ldo, lo, hi, first); break;
        case 5: packed_tile_fma<5, PREFETCH>(xf, block, kp0, kp1, om, ldo, lo, hi, first); break;
        case 4: packed_tile_fma<4, PREFETCH>(xf, block, kp0, kp1, om, ldo, lo, hi, first); break;
        case 3: packed_tile_fma<3, PREFETCH>(xf, block, kp0, kp1, om, ldo, lo, hi, first); break;
        case 2: packed_tile_fma<2, PREFETCH>(xf, block, kp0, kp1, om, ldo, lo, hi, first); break;
        default: packed_tile_fma<1, PREFETCH>(xf, block, kp0, kp1, om, ldo, lo, hi, first);
      }
    }
  }
}

#endif

// Unfrozen weights, packed as the tiles go: nn.Linear's [N, K] rows read where they lie, one chunk of a
// column block at a time (kPackedChunk pairs: 16 KiB on the stack, in L1) for the packed tiles above. The
// NT tiles (nt_dot.h) read such a weight as it is, but widen an x or weight vector per FMA, where a packed
// line, widened once, serves every x row of a row tile: from kRowsPackedOnTheFly rows the packing pays
// for itself. Cascade Lake Xeon, mla::linear 4096 -> 14336 from memory, 2 threads, in-process A/B against
// the NT tiles (docs/linear.md): 12 rows 1.11x, 16 rows 1.19x, 64 rows 1.48x; 8 rows 1.00-1.02x, 4 rows
// 0.80x and one row 0.77x (there the weight stream is the cost, and the packing holds it up).
constexpr int64_t kRowsPackedOnTheFly = 12;

// The 16 x 16 matrix of 32-bit lanes in r transposed: r[i] lane j <- r[j] lane i.
__attribute__((always_inline)) inline void transpose_16x16_epi32(__m512i (&r)[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {  // lane 4q + j of t[2i + h]: rows 2i, 2i+1 of columns 4q + 2h + j / 2
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lane q of u[4i + c]: rows 4i..4i+3 of column 4q + c
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // column 4q + c: 128-bit lane q of u[c], u[4 + c], u[8 + c], u[12 + c]
    const __m512i a = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), b = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
    const __m512i e = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
    const __m512i f = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
    r[c] = _mm512_shuffle_i32x4(a, e, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(b, f, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(a, e, 0xDD);
    r[12 + c] = _mm512_shuffle_i32x4(b, f, 0xDD);
  }
}

// chunk[kp - kp0][c][e] = W[c][2 kp + e] for kp in [kp0, kp1) and c < kPackedCols, zero at c >= cols and
// 2 kp + e >= K (the layout pack_vnni_blocks gives a frozen weight). A k pair is a 32-bit lane, so 16 rows
// of 16 pairs are one 16 x 16 transpose: 64 shuffles for 16 lines. Each row's load asks for its line
// kPackAheadPairs ahead into L2: without, the 32 rows' misses came a few at a time and the packing waited
// on each (16 rows: 0.96-0.99x the NT tiles; with it 1.19x; 64 rows 1.25x -> 1.48x; one or two lines ahead
// measured alike, a chunk or two ahead 2-5% slower). A prefetch past a row's end reads the next row's
// start, or nothing: it never faults.
constexpr int64_t kPackAheadPairs = 32;
inline void pack_chunk_from_rows(const c10::BFloat16* w, int64_t ldw, int64_t cols, int64_t K, int64_t kp0,
                                 int64_t kp1, c10::BFloat16* chunk) {
  for (int64_t kp = kp0; kp < kp1; kp += 16) {
    const int64_t k = 2 * kp;
    const __mmask32 in_k = K - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (K - k)) - 1;
    const int lines = static_cast<int>(std::min<int64_t>(16, kp1 - kp));
    for (int64_t c0 = 0; c0 < kPackedCols; c0 += 16) {
      __m512i r[16];
      for (int c = 0; c < 16; ++c) {
        if (c0 + c >= cols) {
          r[c] = _mm512_setzero_si512();
          continue;
        }
        const c10::BFloat16* row = w + (c0 + c) * ldw;
        _mm_prefetch(reinterpret_cast<const char*>(row + k + 2 * kPackAheadPairs), _MM_HINT_T1);
        r[c] = _mm512_maskz_loadu_epi16(in_k, row + k);
      }
      transpose_16x16_epi32(r);
      for (int i = 0; i < lines; ++i) _mm512_store_si512(chunk + (kp - kp0 + i) * 2 * kPackedCols + 2 * c0, r[i]);
    }
  }
}

// packed_block_bf16 over W's rows [0, cols) where they lie (ldw apart), kPackedChunk pairs packed at a time.
inline void packed_block_from_rows(const c10::BFloat16* x, int64_t ldx, int64_t M, const c10::BFloat16* w,
                                   int64_t ldw, int64_t K, int64_t cols, float* out, int64_t ldo) {
  alignas(64) c10::BFloat16 chunk[kPackedChunk * 2 * kPackedCols];
  const int64_t pairs = (K + 1) / 2;
  for (int64_t kp0 = 0; kp0 < pairs; kp0 += kPackedChunk) {
    const int64_t kp1 = std::min(pairs, kp0 + kPackedChunk);
    pack_chunk_from_rows(w, ldw, cols, K, kp0, kp1, chunk);
    packed_block_bf16<false>(x + 2 * kp0, ldx, M, chunk, std::min(K, 2 * kp1) - 2 * kp0, cols, out, ldo, kp0 > 0);
  }
}
#else  // AVX2

constexpr int64_t kPackedCols = 16;  // two 8-lane fp32 vectors of outputs per x row
constexpr int kPackedRows = 6;       // 12 accumulators + 2 weight vectors + 1 broadcast of 16 registers
// k per chunk: a row tile's x chunk in fp32 (6 KiB) and the block's chunk (8 KiB) stay in L1 while
// every row tile passes over it.
constexpr int64_t kPackedChunk = 256;

constexpr int64_t packed_block_elems(int64_t K) { return K * kPackedCols; }

// acc[MR][2] (in memory: out rows, or zero when first) += xf[:, 0:k1-k0) . block[k0..k1), xf holding the
// row tile's x chunk in fp32 (rows kPackedChunk apart).
template <int MR>
inline void packed_tile_avx2(const float* xf, const c10::BFloat16* block, int64_t k0, int64_t k1, float* out,
                             int64_t ldo, int cols, bool first) {
  __m256 a[MR][2];
  for (int m = 0; m < MR; ++m) {
    if (first) {
      a[m][0] = a[m][1] = _mm256_setzero_ps();
    } else {
      alignas(32) float row[kPackedCols] = {};
      std::memcpy(row, out + m * ldo, cols * sizeof(float));
      a[m][0] = _mm256_load_ps(row);
      a[m][1] = _mm256_load_ps(row + 8);
    }
  }
  for (int64_t k = k0; k < k1; ++k) {
    const c10::BFloat16* w = block + k * kPackedCols;
    const __m256 w0 = widen_bf16x8(w), w1 = widen_bf16x8(w + 8);
    for (int m = 0; m < MR; ++m) {
      const __m256 xb = _mm256_broadcast_ss(xf + m * kPackedChunk + (k - k0));
      a[m][0] = _mm256_fmadd_ps(xb, w0, a[m][0]);
      a[m][1] = _mm256_fmadd_ps(xb, w1, a[m][1]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    if (cols == kPackedCols) {
      _mm256_storeu_ps(out + m * ldo, a[m][0]);
      _mm256_storeu_ps(out + m * ldo + 8, a[m][1]);
    } else {
      alignas(32) float row[kPackedCols];
      _mm256_store_ps(row, a[m][0]);
      _mm256_store_ps(row + 8, a[m][1]);
      std::memcpy(out + m * ldo, row, cols * sizeof(float));
    }
  }
}

// out[m, c] = sum_k x[m, k] * W[n0 + c, k] in fp32 for m < M and c < cols (<= kPackedCols), W[n0:] being
// the packed `block`.
inline void packed_block_bf16(const c10::BFloat16* x, int64_t ldx, int64_t M, const c10::BFloat16* block,
                              int64_t K, int64_t cols, float* out, int64_t ldo) {
  alignas(32) float xf[kPackedRows * kPackedChunk];
  for (int64_t k0 = 0; k0 < K; k0 += kPackedChunk) {
    const int64_t k1 = std::min(K, k0 + kPackedChunk);
    for (int64_t m0 = 0; m0 < M; m0 += kPackedRows) {
      const int mr = static_cast<int>(std::min<int64_t>(kPackedRows, M - m0));
      widen_chunk(x + m0 * ldx, ldx, mr, k0, k1, k1 - k0, xf, kPackedChunk);
      float* om = out + m0 * ldo;
      const int c = static_cast<int>(cols);
      switch (mr) {
        case 6: packed_tile_avx2<6>(xf, block, k0, k1, om, ldo, c, k0 == 0); break;
        case 5: packed_tile_avx2<5>(xf, block, k0, k1, om, ldo, c, k0 == 0); break;
        case 4: packed_tile_avx2<4>(xf, block, k0, k1, om, ldo, c, k0 == 0); break;
        case 3: packed_tile_avx2<3>(xf, block, k0, k1, om, ldo, c, k0 == 0); break;
        case 2: packed_tile_avx2<2>(xf, block, k0, k1, om, ldo, c, k0 == 0); break;
        default: packed_tile_avx2<1>(xf, block, k0, k1, om, ldo, c, k0 == 0);
      }
    }
  }
}

#endif

// A GEMM out[M, N] = x[M, K] . W[N, K]^T over W packed into blocks (all of N's blocks in a row of
// `packed`) as parallel tasks: one block each, every row of x passing over it while it is in cache.
constexpr int64_t packed_tasks(int64_t N) { return (N + kPackedCols - 1) / kPackedCols; }

inline void packed_task(int64_t block, const c10::BFloat16* x, int64_t ldx, int64_t M, const c10::BFloat16* packed,
                        int64_t N, int64_t K, float* out, int64_t ldo) {
  const int64_t n0 = block * kPackedCols;
  packed_block_bf16(x, ldx, M, packed + block * packed_block_elems(K), K, std::min(kPackedCols, N - n0),
                    out + n0, ldo);
}

// Column block `block`'s sums rounded into y (row stride ldy), the bias (or null) added first, as
// nt_task_rounded: every x row passes over the block kRoundedRows at a time, their sums on the stack.
// block_sums(m0, rows, n0, cols, tile) writes rows [m0, m0 + rows) of the block's columns [n0, n0 + cols)
// into tile (rows kPackedCols apart).
constexpr int64_t kRoundedRows = 64;
template <typename BlockSums>
inline void rounded_block(int64_t block, int64_t M, int64_t N, const c10::BFloat16* bias, c10::BFloat16* y,
                          int64_t ldy, BlockSums&& block_sums) {
  const int64_t n0 = block * kPackedCols, cols = std::min(kPackedCols, N - n0);
  alignas(64) float tile[kRoundedRows * kPackedCols];
  for (int64_t m0 = 0; m0 < M; m0 += kRoundedRows) {
    const int64_t rows = std::min(kRoundedRows, M - m0);
    block_sums(m0, rows, n0, cols, tile);
    store_rows_rounded(tile, kPackedCols, rows, cols, bias ? bias + n0 : nullptr, y + m0 * ldy + n0, ldy);
  }
}

// packed_task with its sums rounded into y (rounded_block).
inline void packed_task_rounded(int64_t block, const c10::BFloat16* x, int64_t ldx, int64_t M,
                                const c10::BFloat16* packed, int64_t N, int64_t K, const c10::BFloat16* bias,
                                c10::BFloat16* y, int64_t ldy) {
  const c10::BFloat16* weights = packed + block * packed_block_elems(K);
  rounded_block(block, M, N, bias, y, ldy, [&](int64_t m0, int64_t rows, int64_t, int64_t cols, float* tile) {
    packed_block_bf16(x + m0 * ldx, ldx, rows, weights, K, cols, tile, kPackedCols);
  });
}

#if defined(__AVX512F__)
// packed_task and packed_task_rounded over nn.Linear's [N, K] weight where it lies (ldw apart), packed as
// the tiles go (packed_block_from_rows): the same tasks, packed_tasks(N) column blocks, for M >=
// kRowsPackedOnTheFly.
inline void packed_task_from_rows(int64_t block, const c10::BFloat16* x, int64_t ldx, int64_t M,
                                  const c10::BFloat16* w, int64_t ldw, int64_t N, int64_t K, float* out,
                                  int64_t ldo) {
  const int64_t n0 = block * kPackedCols;
  packed_block_from_rows(x, ldx, M, w + n0 * ldw, ldw, K, std::min(kPackedCols, N - n0), out + n0, ldo);
}

inline void packed_task_rounded_from_rows(int64_t block, const c10::BFloat16* x, int64_t ldx, int64_t M,
                                          const c10::BFloat16* w, int64_t ldw, int64_t N, int64_t K,
                                          const c10::BFloat16* bias, c10::BFloat16* y, int64_t ldy) {
  rounded_block(block, M, N, bias, y, ldy, [&](int64_t m0, int64_t rows, int64_t n0, int64_t cols, float* tile) {
    packed_block_from_rows(x + m0 * ldx, ldx, rows, w + n0 * ldw, ldw, K, cols, tile, kPackedCols);
  });
}
#endif

}  // namespace mla_inductor
