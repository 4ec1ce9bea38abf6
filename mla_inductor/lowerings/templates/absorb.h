// Absorption of one query head into latent space for a block of tokens:
//   out[m, l] = sum_d q[m, d] * w_kc[d * ld + l]
// from fp32 q rows (a GEMM's scratch, never rounded), accumulated in fp32 and rounded once into out.
//
// The weight rows are streamed in order, kAbsorbRows at a time, and each loaded vector serves every
// token of the block: the head's W_kc is read from memory once, sequentially. (Register tiles over
// column slices, with d innermost, read it as 1 KiB-strided 128-byte pieces instead, which ran at a
// third of the bandwidth on an AVX2 EPYC.) The accumulators of kAbsorbTokens tokens stay in L1 and
// the head's W_kc in L2 for the next token block. The next row group is prefetched into L1: between
// heads the rows jump (W_kc is a view into kv_b_proj, whose W_vc rows sit between two heads'), which
// the hardware prefetcher does not follow.
#pragma once
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>

#include <immintrin.h>

namespace mla_inductor {

constexpr int64_t kAbsorbTokens = 8;
constexpr int kAbsorbRows = 4;

// Floats of scratch absorb_head needs for a latent width L.
constexpr int64_t absorb_scratch_floats(int64_t L) { return kAbsorbTokens * L; }

// acc[m, l0 : l0 + count] += q[m, d0 : d0 + rows] . w[d0 : d0 + rows, l0 : l0 + count] for `tokens` tokens.
template <typename W>
inline void absorb_columns(const float* q, int64_t ldq, int64_t tokens, const W* w, int64_t ld, int rows,
                           int64_t count, float* acc, int64_t lda) {
  using Vec = at::vec::Vectorized<float>;
  Vec wv[kAbsorbRows];
  for (int i = 0; i < rows; ++i) wv[i] = load_floats(w + i * ld, count);
  for (int64_t m = 0; m < tokens; ++m) {
    Vec a = Vec::loadu(acc + m * lda, count);
    for (int i = 0; i < rows; ++i) a = at::vec::fmadd(Vec(q[m * ldq + i]), wv[i], a);
    a.store(acc + m * lda, count);
  }
}

// out[m * ldo + l] for M tokens of one head; q[m * ldq + d]; scratch of absorb_scratch_floats(L).
template <typename W, typename T>
inline void absorb_head(const float* q, int64_t ldq, int64_t M, int64_t nope, const W* w_kc, int64_t ld, int64_t L,
                        T* out, int64_t ldo, float* scratch) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t V = Vec::size();
  for (int64_t m0 = 0; m0 < M; m0 += kAbsorbTokens) {
    const int64_t tokens = std::min(kAbsorbTokens, M - m0);
    std::fill(scratch, scratch + tokens * L, 0.f);
    for (int64_t d = 0; d < nope; d += kAbsorbRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kAbsorbRows, nope - d));
      const W* w = w_kc + d * ld;
      const float* qd = q + m0 * ldq + d;
      int64_t l = 0;
      for (; l + V <= L; l += V) {
        if (l % (64 / sizeof(W)) == 0) {  // once per cache line; past the tensor's end a prefetch is a no-op
          for (int i = 0; i < kAbsorbRows; ++i)
            _mm_prefetch(reinterpret_cast<const char*>(w + (kAbsorbRows + i) * ld + l), _MM_HINT_T0);
        }
        absorb_columns(qd, ldq, tokens, w + l, ld, rows, V, scratch + l, L);
      }
      if (l < L) absorb_columns(qd, ldq, tokens, w + l, ld, rows, L - l, scratch + l, L);
    }
    for (int64_t m = 0; m < tokens; ++m) store_row(scratch + m * L, L, out + (m0 + m) * ldo);
  }
}

}  // namespace mla_inductor
