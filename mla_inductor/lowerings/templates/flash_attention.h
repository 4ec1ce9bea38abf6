// Flash attention for prefill: micro-kernels for mla::prefill_attention.
//
// A task owns one (request, query head) and a tile of query rows (prefill_rows). It walks the key rows the
// tile's rows admit in blocks of kKvBlock, with latent_attention.h's online softmax (a running max and sum
// per query row, an unnormalised fp32 output), so memory stays O(tile) whatever the length. Both products
// are packed_dot.h's GEMM tiles (dpbf16 with AVX512-BF16, AMX CPUs included: AMX tiles are not used
// here yet; widened FMAs without):
//   scores = q . K^T  -- K's rows packed as the "weight" of an NN GEMM (kPackedCols key rows a block);
//   o     += p . V    -- p rounded to bf16, V's columns packed over all its rows (kPackedCols a block).
// K and V are packed once per (request, key/value head) before the tasks, in parallel: every query tile
// and every query head of the group reads the packed copy (the same bytes as k and v).
//
// Masks: each query row's admitted key rows are a range [begin, end) (the causal order and the mask's
// first and last admitted rows) and, where the mask admits every row of it with a zero bias ("plain",
// a causal or padding mask), nothing else; otherwise the mask is read inside the range. Key blocks past
// every row's range (above a causal diagonal) are never computed.
#pragma once
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

namespace mla_inductor {

// Query rows per task, at most: a tile's scores and probabilities (rows x 128, fp32 and bf16) and its
// output (rows x DV fp32, twice) stay in L2 with the packed key block the score tiles read.
constexpr int64_t kPrefillRows = 64;

// Query rows per task for `key_rows` key rows: every task reads the packed keys and values up to its rows'
// last, so long prompts take more rows per task, which halves those reads (V2-Lite's heads at 8192
// tokens, Zen 4: 58% -> 65% of oneDNN's bf16 GEMM rate), and short ones fewer, which keeps the tasks
// many enough to balance (2048 tokens: 64 rows measured 0.96x of 32).
inline int64_t prefill_rows(int64_t key_rows) { return key_rows >= 4096 ? 64 : 32; }

// The key rows one query row admits: [begin, end), and whether the mask admits each of them with a
// zero bias (then the mask need not be read inside the range).
struct AdmittedRange {
  int64_t begin, end;
  bool plain;
};

// The range of a mask row of n keys (`stride` apart): a bool admits where true, a number adds to the
// scores (-inf excludes).
template <typename MaskT>
inline AdmittedRange admitted_range(const MaskT* row, int64_t stride, int64_t n) {
  constexpr float kExcluded = -std::numeric_limits<float>::infinity();
  int64_t begin = 0, end = n;
  while (begin < end && mask_bias(row[begin * stride]) == kExcluded) ++begin;
  while (end > begin && mask_bias(row[(end - 1) * stride]) == kExcluded) --end;
  bool plain = true;
  for (int64_t j = begin; j < end && plain; ++j) plain = mask_bias(row[j * stride]) == 0.f;
  return {begin, end, plain};
}

// Elements of one packed block of K (kPackedCols key rows over D columns) and of V (kPackedCols of its
// columns over `rows` key rows, an odd count padded with a zero row).
inline int64_t key_block_elems(int64_t D) { return packed_block_elems(D); }
inline int64_t value_block_elems(int64_t rows) { return packed_block_elems(rows + (rows & 1)); }

// Key rows [0, cols) (cols <= kPackedCols, ldk apart, D columns) as packed_dot.h's weight block.
inline void pack_key_block(const c10::BFloat16* k, int64_t ldk, int64_t cols, int64_t D, c10::BFloat16* block) {
#if defined(__AVX512F__)
  pack_chunk_from_rows(k, ldk, cols, D, 0, (D + 1) / 2, block);
#else  // AVX2 layout: block[d][c] = K[c][d]
  for (int64_t d = 0; d < D; ++d)
    for (int64_t c = 0; c < kPackedCols; ++c) block[d * kPackedCols + c] = c < cols ? k[c * ldk + d] : c10::BFloat16(0.f);
#endif
}

// V's columns [0, cols) (cols <= kPackedCols) over key rows [0, rows) (ldv apart) as packed_dot.h's
// weight block of the product p . V, whose "k" is the key rows.
inline void pack_value_block(const c10::BFloat16* v, int64_t ldv, int64_t rows, int64_t cols, c10::BFloat16* block) {
#if defined(__AVX512F__)
  // VNNI pairs: block[jp][c][e] = V[2 jp + e][c], one 16-bit interleave of two rows per pair
  alignas(64) static const int16_t kFirstHalf[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                     8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i first = _mm512_load_si512(kFirstHalf);
  const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
  const __mmask32 in_cols = cols >= 32 ? ~__mmask32(0) : (__mmask32(1) << cols) - 1;
  for (int64_t j = 0; j < rows; j += 2) {
    const __m512i a = _mm512_maskz_loadu_epi16(in_cols, v + j * ldv);
    const __m512i b = j + 1 < rows ? _mm512_maskz_loadu_epi16(in_cols, v + (j + 1) * ldv) : _mm512_setzero_si512();
    _mm512_store_si512(block + j * kPackedCols, _mm512_permutex2var_epi16(a, first, b));
    _mm512_store_si512(block + j * kPackedCols + 32, _mm512_permutex2var_epi16(a, second, b));
  }
#else  // AVX2 layout: block[j][c] = V[j][c]
  for (int64_t j = 0; j < rows; ++j) {
    std::memcpy(block + j * kPackedCols, v + j * ldv, cols * sizeof(c10::BFloat16));
    std::fill(block + j * kPackedCols + cols, block + (j + 1) * kPackedCols, c10::BFloat16(0.f));
  }
#endif
}

// out[m, c] = x[m, :K] . block's column c, for the m < M rows of a query tile: packed_dot.h's tile, without
// its software prefetch (which asks for the stream 64 KiB ahead: here the blocks are in cache).
inline void packed_product(const c10::BFloat16* x, int64_t ldx, int64_t M, const c10::BFloat16* block, int64_t K,
                           int64_t cols, float* out, int64_t ldo) {
#if defined(__AVX512F__)
  packed_block_bf16<false>(x, ldx, M, block, K, cols, out, ldo);
#else
  packed_block_bf16(x, ldx, M, block, K, cols, out, ldo);
#endif
}

// A query tile's scratch: scores and probabilities of one key block, the block's p . V and the running output.
struct PrefillScratch {
  float* s;           // [kPrefillRows, kKvBlock]
  c10::BFloat16* p;   // [kPrefillRows, kKvBlock]
  float* pv;          // [kPrefillRows, DV]
  float* o;           // [kPrefillRows, DV]
  float* m;           // [kPrefillRows]
  float* l;           // [kPrefillRows]
  float* alpha;       // [kPrefillRows]
};

inline int64_t prefill_scratch_floats(int64_t DV) {
  return kPrefillRows * kKvBlock + kPrefillRows * kKvBlock / 2 + 2 * kPrefillRows * DV + 3 * kPrefillRows;
}

inline PrefillScratch prefill_scratch(float* base, int64_t DV) {
  PrefillScratch s;
  s.s = base;
  s.p = reinterpret_cast<c10::BFloat16*>(base + kPrefillRows * kKvBlock);
  s.pv = base + kPrefillRows * kKvBlock + kPrefillRows * kKvBlock / 2;
  s.o = s.pv + kPrefillRows * DV;
  s.m = s.o + kPrefillRows * DV;
  s.l = s.m + kPrefillRows;
  s.alpha = s.l + kPrefillRows;
  return s;
}

// Scores of row `row` (key rows [j0, j0 + n)) scaled, softcapped and masked: -inf outside the row's range,
// the mask's values inside it unless the range is plain.
template <typename MaskT>
inline void mask_scores(float* row, int64_t j0, int n, float scale, float softcap, const AdmittedRange& range,
                        const MaskT* mask, int64_t mask_stride) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int W = Vec::size();
  for (int j = 0; j < n; j += W) {
    const int count = std::min(W, n - j);
    Vec x = Vec::loadu(row + j, count) * Vec(scale);
    if (softcap > 0.f) x = Vec(softcap) * (x / Vec(softcap)).tanh();
    x.store(row + j, count);
  }
  const int64_t begin = std::clamp<int64_t>(range.begin - j0, 0, n), end = std::clamp<int64_t>(range.end - j0, begin, n);
  std::fill(row, row + begin, -std::numeric_limits<float>::infinity());
  std::fill(row + end, row + n, -std::numeric_limits<float>::infinity());
  if (!range.plain)
    for (int64_t j = begin; j < end; ++j) row[j] += mask_bias(mask[(j0 + j) * mask_stride]);
}

// Attention of query rows q[0, M) (ldq apart; M <= kPrefillRows) over the packed keys and values of their
// key/value head, each row over its admitted range (ranges[m]; mask[m * mask_stride_i + j * mask_stride_j]
// read where a range is not plain), into out (ldo apart), rounded once.
template <typename T, typename MaskT>
inline void prefill_tile(const T* q, int64_t ldq, int64_t M, const c10::BFloat16* packed_k,
                         const c10::BFloat16* packed_v, int64_t key_rows, int64_t D, int64_t DV,
                         const AdmittedRange* ranges, const MaskT* mask, int64_t mask_stride_i, int64_t mask_stride_j,
                         float scale, float softcap, const PrefillScratch& scratch, T* out, int64_t ldo) {
  int64_t lo = key_rows, hi = 0;
  for (int64_t m = 0; m < M; ++m) {
    if (ranges[m].begin >= ranges[m].end) continue;
    lo = std::min(lo, ranges[m].begin);
    hi = std::max(hi, ranges[m].end);
  }
  SoftmaxState st{scratch.m, scratch.l, scratch.o};
  std::fill(st.m, st.m + M, -std::numeric_limits<float>::infinity());
  std::fill(st.l, st.l + M, 0.f);
  std::fill(scratch.o, scratch.o + M * DV, 0.f);
  const int64_t key_block = key_block_elems(D), value_block = value_block_elems(key_rows);
  using Vec = at::vec::Vectorized<float>;
  for (int64_t j0 = lo / kKvBlock * kKvBlock; j0 < hi; j0 += kKvBlock) {
    const int n = static_cast<int>(std::min<int64_t>(kKvBlock, hi - j0));
    for (int c0 = 0; c0 < n; c0 += kPackedCols)  // j0 is a multiple of kPackedCols: whole blocks
      packed_product(q, ldq, M, packed_k + (j0 + c0) / kPackedCols * key_block, D,
                     std::min<int64_t>(kPackedCols, n - c0), scratch.s + c0, kKvBlock);
    for (int64_t m = 0; m < M; ++m)
      mask_scores(scratch.s + m * kKvBlock, j0, n, scale, softcap, ranges[m],
                  mask == nullptr ? mask : mask + m * mask_stride_i, mask_stride_j);
    softmax_step(scratch.s, static_cast<int>(M), n, nullptr, 0.f, nullptr, nullptr, st, scratch.alpha, scratch.p);
    for (int64_t c0 = 0; c0 < DV; c0 += kPackedCols)  // key row j0's pair starts at j0 * kPackedCols in both layouts
      packed_product(scratch.p, kKvBlock, M, packed_v + c0 / kPackedCols * value_block + j0 * kPackedCols, n,
                     std::min<int64_t>(kPackedCols, DV - c0), scratch.pv + c0, DV);
    for (int64_t m = 0; m < M; ++m) {
      float* o = scratch.o + m * DV;
      const float* pv = scratch.pv + m * DV;
      const Vec alpha(scratch.alpha[m]);
      for (int64_t c = 0; c < DV; c += Vec::size()) {
        const int count = static_cast<int>(std::min<int64_t>(Vec::size(), DV - c));
        (Vec::loadu(o + c, count) * alpha + Vec::loadu(pv + c, count)).store(o + c, count);
      }
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    float* o = scratch.o + m * DV;
    const float inv = st.l[m] == 0.f ? 0.f : 1.f / st.l[m];  // a row nothing admits gets zeros
    for (int64_t c = 0; c < DV; ++c) o[c] *= inv;
    store_row(o, DV, out + m * ldo);
  }
}

}  // namespace mla_inductor
