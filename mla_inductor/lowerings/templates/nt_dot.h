// NT dot-product tiles: out[m * ldo + n] = sum_k x[m * ldx + k] * w[n * ldw + k], accumulated in fp32.
//
// Both operands are read along k, so the weight is consumed in nn.Linear's own [N, K] layout: every
// weight row is one sequential stream and nothing needs packing, with or without freezing. At decode
// (a handful of x rows) the weight stream is the whole cost, and MR x rows share each weight load.
#pragma once
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace mla_inductor {

constexpr int kMaxTileRows = 4;  // MR: x rows per tile
constexpr int kMaxTileCols = 4;  // NR: weight rows per tile; MR x NR accumulators stay in registers

#if defined(__AVX512BF16__)
// One _mm512_dpbf16_ps consumes 32 bf16 of x and of w and adds 16 pairwise products to fp32 lanes.
template <int MR, int NR>
inline void dot_tile_bf16(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w, int64_t ldw, int64_t K,
                          float* out, int64_t ldo) {
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_setzero_ps();
  auto step = [&](int64_t k, __mmask32 mask) {
    __m512bh xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * ldx + k);
    for (int n = 0; n < NR; ++n) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + n * ldw + k);
      for (int m = 0; m < MR; ++m) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv[m], wv);
    }
  };
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) step(k, ~__mmask32(0));
  if (k < K) step(k, (__mmask32(1) << (K - k)) - 1);  // zero-filled tail lanes add nothing
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) out[m * ldo + n] = _mm512_reduce_add_ps(acc[m][n]);
}
#endif

template <typename T>
inline at::vec::Vectorized<float> load_as_float(const T* p) {
  using Vec = at::vec::Vectorized<float>;
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    return at::vec::convert<float>(at::vec::Vectorized<T>::loadu(p, static_cast<int64_t>(Vec::size())));
  }
}

// Portable path (fp32, fp16 -- this CPU has no avx512_fp16 -- and bf16 without AVX512-BF16):
// widen to fp32 and FMA, Vec::size() lanes per step.
template <typename T, int MR, int NR>
inline void dot_tile_fma(const T* x, int64_t ldx, const T* w, int64_t ldw, int64_t K, float* out, int64_t ldo) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t V = Vec::size();
  Vec acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = Vec(0.f);
  int64_t k = 0;
  for (; k + V <= K; k += V) {
    Vec xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = load_as_float(x + m * ldx + k);
    for (int n = 0; n < NR; ++n) {
      const Vec wv = load_as_float(w + n * ldw + k);
      for (int m = 0; m < MR; ++m) acc[m][n] = at::vec::fmadd(xv[m], wv, acc[m][n]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int n = 0; n < NR; ++n) {
      float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc[m][n]);
      for (int64_t kk = k; kk < K; ++kk) sum += float(x[m * ldx + kk]) * float(w[n * ldw + kk]);
      out[m * ldo + n] = sum;
    }
  }
}

template <typename T, int MR, int NR>
inline void dot_tile(const T* x, int64_t ldx, const T* w, int64_t ldw, int64_t K, float* out, int64_t ldo) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    dot_tile_bf16<MR, NR>(x, ldx, w, ldw, K, out, ldo);
    return;
  }
#endif
  dot_tile_fma<T, MR, NR>(x, ldx, w, ldw, K, out, ldo);
}

// Runtime tile shape (the edges of M and N) to the compile-time instantiation.
template <typename T, int MR>
inline void dot_tile_rows(const T* x, int64_t ldx, const T* w, int64_t ldw, int nr, int64_t K, float* out,
                          int64_t ldo) {
  switch (nr) {
    case 4: return dot_tile<T, MR, 4>(x, ldx, w, ldw, K, out, ldo);
    case 3: return dot_tile<T, MR, 3>(x, ldx, w, ldw, K, out, ldo);
    case 2: return dot_tile<T, MR, 2>(x, ldx, w, ldw, K, out, ldo);
    default: return dot_tile<T, MR, 1>(x, ldx, w, ldw, K, out, ldo);
  }
}

template <typename T>
inline void dot_tile_any(const T* x, int64_t ldx, int mr, const T* w, int64_t ldw, int nr, int64_t K, float* out,
                         int64_t ldo) {
  switch (mr) {
    case 4: return dot_tile_rows<T, 4>(x, ldx, w, ldw, nr, K, out, ldo);
    case 3: return dot_tile_rows<T, 3>(x, ldx, w, ldw, nr, K, out, ldo);
    case 2: return dot_tile_rows<T, 2>(x, ldx, w, ldw, nr, K, out, ldo);
    default: return dot_tile_rows<T, 1>(x, ldx, w, ldw, nr, K, out, ldo);
  }
}

// RMSNorm of one fp32 row into the output dtype, rounding once: y = x * rsqrt(mean(x^2) + eps) * weight.
template <typename T>
inline void rms_norm_row(const float* row, int64_t n, const T* weight, float eps, T* out) {
  float sum_sq = 0.f;
  for (int64_t i = 0; i < n; ++i) sum_sq += row[i] * row[i];
  const float scale = 1.f / std::sqrt(sum_sq / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(row[i] * scale * static_cast<float>(weight[i]));
}

template <typename T>
inline void store_row(const float* row, int64_t n, T* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(row[i]);
}

}  // namespace mla_inductor
