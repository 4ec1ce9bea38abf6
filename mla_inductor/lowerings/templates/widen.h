// Shared by the templates: load up to one vector of T widened to fp32, and round fp32 back to T.
#pragma once
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace mla_inductor {

#if defined(__AVX2__)
// Eight bf16 widened to fp32: a bf16 is the high half of an fp32.
__attribute__((always_inline)) inline __m256 widen_bf16x8(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
#endif

// One whole vector of T widened to fp32. bf16 is the high half of an fp32 (zero-extend, shift by 16),
// fp16 goes through F16C. ATen's Vectorized<BFloat16> holds twice the lanes of a Vectorized<float>, so
// converting one of those would load a half vector through a zeroed stack buffer (a store and a reload
// per vector, which bound the AVX2 dot products at one store a cycle); these are one load and one op.
template <typename T>
inline at::vec::Vectorized<float> load_floats(const T* p) {
  using Vec = at::vec::Vectorized<float>;
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
#if defined(CPU_CAPABILITY_AVX512)
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(CPU_CAPABILITY_AVX2)
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return widen_bf16x8(p);
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
  } else {
    return at::vec::convert<float>(at::vec::Vectorized<T>::loadu(p, Vec::size()));
  }
}

// `count` (<= Vec::size()) values of T widened to fp32; the lanes past count are zero.
template <typename T>
inline at::vec::Vectorized<float> load_floats(const T* p, int64_t count) {
  using Vec = at::vec::Vectorized<float>;
  if (count == Vec::size()) return load_floats(p);
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p, count);
  } else {
    return at::vec::convert<float>(at::vec::Vectorized<T>::loadu(p, count));
  }
}

// dst[0..n) = src[0..n) widened to fp32.
template <typename T>
inline void widen_row(const T* src, int64_t n, float* dst) {
  using Vec = at::vec::Vectorized<float>;
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) load_floats(src + i).store(dst + i);
  if (i < n) load_floats(src + i, n - i).store(dst + i, n - i);
}

// Round `count` fp32 lanes of v to T and store them.
template <typename T>
inline void store_floats(T* p, const at::vec::Vectorized<float>& v,
                         int64_t count = at::vec::Vectorized<float>::size()) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(p, count);
  } else {
    at::vec::convert<T>(v).store(p, count);
  }
}

// Round the n fp32 values of row to T and store them at out.
template <typename T>
inline void store_row(const float* row, int64_t n, T* out) {
  using Vec = at::vec::Vectorized<float>;
  for (int64_t i = 0; i < n; i += Vec::size()) {
    const int64_t count = std::min<int64_t>(Vec::size(), n - i);
    store_floats(out + i, Vec::loadu(row + i, count), count);
  }
}

}  // namespace mla_inductor
