// Shared by the templates: load up to one vector of T widened to fp32, and round fp32 back to T.
// T is a float type, fp8 (KV caches, weights) or int8 (weights).
#pragma once
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <new>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace mla_inductor {

// Scratch arrays aligned to a cache line. glibc's new[] puts a large array 16 bytes past one, so that
// every 64-byte vector or AMX tile row read from it straddles two lines (an AMX tile pass over such rows
// ran 2.8x slower in a harness, docs/mla_decode.md).
struct FreeLineAligned {
  void operator()(void* p) const { ::operator delete[](p, std::align_val_t(64)); }
};
template <typename T>
using LineAligned = std::unique_ptr<T[], FreeLineAligned>;
template <typename T>
LineAligned<T> line_aligned(int64_t n) {
  static_assert(std::is_trivially_destructible_v<T>);
  return LineAligned<T>(new (std::align_val_t(64)) T[n]);
}

#if defined(__AVX2__)
// Eight bf16 widened to fp32: a bf16 is the high half of an fp32.
__attribute__((always_inline)) inline __m256 widen_bf16x8(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
#endif

// FP8 caches are read through fp16 and F16C, which every AVX2 CPU has (no x86 CPU before AVX10.2
// converts fp8): an fp8 value's bits, placed in an fp16's, give the fp16 of the same value (e5m2) or of
// the value times 2^-8 (e4m3fn). Both convert subnormals, infinities and NaN exactly.
//
// Float8_e4m3fn_finite is e4m3fn's bytes where the lowering has proved there is no NaN (a frozen weight,
// lowerings/segment_gemm.py). Without a NaN to keep, they skip fp16 too: see e4m3fn_finite_as_fp32_bits.
struct Float8_e4m3fn_finite {
  uint8_t bits;
  operator float() const { return static_cast<float>(c10::Float8_e4m3fn(bits, c10::Float8_e4m3fn::from_bits())); }
};

// Float8_e4m3fn_nan_free is e4m3fn's bytes that a kernel has just checked for NaN (holds_e4m3fn_nan):
// a decode kernel's cache rows, which may hold subnormals. They take the fp16 route without the NaN fix.
struct Float8_e4m3fn_nan_free {
  uint8_t bits;
  operator float() const { return static_cast<float>(c10::Float8_e4m3fn(bits, c10::Float8_e4m3fn::from_bits())); }
};

template <typename T>
constexpr bool is_e4m3fn = std::is_same_v<T, c10::Float8_e4m3fn> || std::is_same_v<T, Float8_e4m3fn_finite> ||
                           std::is_same_v<T, Float8_e4m3fn_nan_free>;

template <typename T>
constexpr bool is_fp8 = is_e4m3fn<T> || std::is_same_v<T, c10::Float8_e5m2>;

// load_floats<T> returns T's values times kWidenedScale<T>: 1, except e4m3fn's 2^-8 (2^-120 for
// Float8_e4m3fn_finite), which its callers fold into a scale they apply anyway (the scores' scale, the
// output's normalisation, the weight's scales) rather than pay a multiply per vector (12% of an fp8
// grouped-query decode step on an AVX2 EPYC).
template <typename T>
constexpr float kWidenedScale = std::is_same_v<T, Float8_e4m3fn_finite> ? 0x1p-120f : is_e4m3fn<T> ? 0x1p-8f : 1.f;

#if defined(__AVX2__)
// e4m3fn's one NaN, S.1111.111, with its fields in an fp16's places (below): all ones, an fp16 NaN.
// Bytes of T = Float8_e4m3fn_nan_free were checked to hold none, and skip the fix.
template <typename T, typename V>
__attribute__((always_inline)) inline V e4m3fn_nan_kept(V half) {
  if constexpr (std::is_same_v<T, Float8_e4m3fn_nan_free>) {
    return half;
  } else {
    return half | ((half & 0x3f80) == 0x3f80);
  }
}

// e5m2 is the high byte of an fp16. c10::Float8_e4m3fn's exponent and mantissa fields move to fp16's
// places: the exponent biases differ by 8 (15 - 7), so the fp16 holds the value times 2^-8 (kWidenedScale);
// S.1111.111, e4m3fn's only NaN (it has no infinities), would land on a finite fp16 and is set to an
// fp16 NaN instead (a quarter of the conversion's cost, kept: a NaN in the cache must not read as a
// number). `high` holds the fp8 bytes as the high bytes of 16-bit lanes (x << 8): shifting it right
// by one, arithmetically, puts the magnitude at bits 7..13 and copies the sign into bit 14, which the
// mask clears. One body serves 8 lanes (__v8hi) and 16 (__v16hi): GCC's vector extensions compile the
// shift, masks and comparison (-1 where true) to the SSE or AVX2 instructions of the type.
template <typename T, typename V>
__attribute__((always_inline)) inline V fp8_as_fp16(V high) {
  if constexpr (std::is_same_v<T, c10::Float8_e5m2>) {
    return high;
  } else {
    return e4m3fn_nan_kept<T>((high >> 1) & int16_t(0xbfff));
  }
}

// The same for e4m3fn from its bytes sign-extended to 16 bits, which AVX-512 loads in one op
// (vpmovsxbw): shifting left by 7 puts the magnitude at bits 7..13 and the sign at 14 and 15, one shift
// fewer than from the high bytes. The grouped-query fp8 tiles widen every row: 41 -> 38 ns a row in L2
// on the AMX Xeon (docs/mla_decode.md).
template <typename T, typename V>
__attribute__((always_inline)) inline V e4m3fn_as_fp16(V sign_extended) {
  return e4m3fn_nan_kept<T>((sign_extended << 7) & int16_t(0xbfff));
}

// Eight fp8 values widened to fp32 (times kWidenedScale): the bytes unpacked into the high halves of
// 16-bit lanes (one op).
template <typename T>
__attribute__((always_inline)) inline __m256 widen_fp8x8(const T* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtph_ps(__m128i(fp8_as_fp16<T>(__v8hi(_mm_unpacklo_epi8(_mm_setzero_si128(), bytes)))));
}

// NaN-free e4m3fn straight into fp32's bits: the byte sign-extended to 32 bits and shifted left by 20
// puts exponent and mantissa at fp32's bits 20..26 and the sign at 27..31, of which the mask keeps 31.
// The biases differ by 120 (127 - 7), so that is the value times 2^-120 (kWidenedScale), subnormals
// (exponent 0) included, as fp32 subnormals, which Zen 3's FMAs take at full speed (measured) and Intel's
// through a microcode assist (90x slower on the AMX Xeon: the lowering takes this route there only for
// weights without subnormals, segment_gemm.widens_to_fp32_bits). Three integer ops per vector, against the fp16 route's
// three and a vcvtph2ps: one core's fp8 tiles over a weight in L2 went from 11 to 16 GB/s on an AVX2
// EPYC (Zen 3; docs/quantized_weights.md). One body serves 8 lanes (__v8si) and 16 (__v16si).
template <typename V>
__attribute__((always_inline)) inline V e4m3fn_finite_as_fp32_bits(V sign_extended) {
  return (sign_extended << 20) & int32_t(0x87ffffff);
}
#endif

// Whether any of the n bytes at p is e4m3fn's NaN (S.1111.111). Two ops per 64 bytes, where keeping a NaN
// while widening costs three per 16 values (e4m3fn_nan_kept): the decode kernels check each tile of cache
// rows and widen the rows of a tile without NaN as Float8_e4m3fn_nan_free (a grouped-query row 40.6 -> 37.3
// ns on one thread of the AMX Xeon, benchmarks/attend_split.py; docs/mla_decode.md).
inline bool holds_e4m3fn_nan(const void* data, int64_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i magnitude = _mm512_set1_epi8(0x7f);
  __mmask64 nan = 0;
  for (; i + 64 <= n; i += 64)
    nan |= _mm512_cmpeq_epi8_mask(_mm512_and_si512(_mm512_loadu_si512(p + i), magnitude), magnitude);
  if (i < n) {
    const __m512i tail = _mm512_maskz_loadu_epi8(~0ull >> (64 - (n - i)), p + i);
    nan |= _mm512_cmpeq_epi8_mask(_mm512_and_si512(tail, magnitude), magnitude);
  }
  return nan != 0;
#else
#if defined(CPU_CAPABILITY_AVX2)
  const __m256i magnitude = _mm256_set1_epi8(0x7f);
  __m256i nan = _mm256_setzero_si256();
  for (; i + 32 <= n; i += 32) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i));
    nan = _mm256_or_si256(nan, _mm256_cmpeq_epi8(_mm256_and_si256(bytes, magnitude), magnitude));
  }
  if (!_mm256_testz_si256(nan, nan)) return true;
#endif
  for (; i < n; ++i)
    if ((p[i] & 0x7f) == 0x7f) return true;
  return false;
#endif
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512VBMI__)
// The vpermb index that puts byte i in the high byte of 16-bit lane i (the low bytes are masked to zero):
// e5m2 bytes become fp16s in one op where a zero-extend and a shift take two, on the same two pipes
// as the FMAs that consume them. A grouped-query e5m2 step 1.08x (benchmarks/template_ab.py, AMX Xeon).
template <typename V>
__attribute__((always_inline)) inline V e5m2_high_bytes_index() {
  if constexpr (std::is_same_v<V, __m512i>) {
    return _mm512_set_epi8(31, 0, 30, 0, 29, 0, 28, 0, 27, 0, 26, 0, 25, 0, 24, 0, 23, 0, 22, 0, 21, 0, 20, 0,
                           19, 0, 18, 0, 17, 0, 16, 0, 15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0, 7, 0,
                           6, 0, 5, 0, 4, 0, 3, 0, 2, 0, 1, 0, 0, 0);
  } else {
    return _mm256_set_epi8(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0, 7, 0, 6, 0, 5, 0, 4, 0, 3, 0,
                           2, 0, 1, 0, 0, 0);
  }
}
#endif

// One whole vector of T widened to fp32 (times kWidenedScale<T>). bf16 is the high half of an fp32
// (zero-extend, shift by 16), fp16 goes through F16C. ATen's Vectorized<BFloat16> holds twice the
// lanes of a Vectorized<float>, so converting one of those would load a half vector through a zeroed
// stack buffer (a store and a reload per vector, which bound the AVX2 dot products at one store a
// cycle); these are one load and one op.
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
  } else if constexpr (std::is_same_v<T, Float8_e4m3fn_finite>) {
    const __m512i bytes = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_castsi512_ps(__m512i(e4m3fn_finite_as_fp32_bits(__v16si(bytes))));
  } else if constexpr (is_e4m3fn<T>) {
    const __m256i bytes = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_cvtph_ps(__m256i(e4m3fn_as_fp16<T>(__v16hi(bytes))));
  } else if constexpr (std::is_same_v<T, c10::Float8_e5m2>) {
#if defined(__AVX512VBMI__)
    const __m256i bytes = _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_cvtph_ps(_mm256_maskz_permutexvar_epi8(0xAAAAAAAAu, e5m2_high_bytes_index<__m256i>(), bytes));
#else
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_cvtph_ps(_mm256_slli_epi16(bytes, 8));
#endif
  } else if constexpr (std::is_same_v<T, int8_t>) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(CPU_CAPABILITY_AVX2)
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return widen_bf16x8(p);
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else if constexpr (std::is_same_v<T, Float8_e4m3fn_finite>) {
    const __m256i bytes = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(__m256i(e4m3fn_finite_as_fp32_bits(__v8si(bytes))));
  } else if constexpr (is_fp8<T>) {
    return widen_fp8x8(p);
  } else if constexpr (std::is_same_v<T, int8_t>) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#endif
  } else if constexpr (sizeof(T) == 1) {  // fp8 without F16C, int8 without AVX2
    alignas(64) float values[Vec::size()];
    for (int i = 0; i < Vec::size(); ++i) values[i] = static_cast<float>(p[i]) * kWidenedScale<T>;
    return Vec::loadu(values);
  } else {
    return at::vec::convert<float>(at::vec::Vectorized<T>::loadu(p, Vec::size()));
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// Thirty-two fp8 values widened to fp32 (times kWidenedScale<T>) as two vectors, lo the first sixteen: the
// integer steps run once over 32 lanes of 16 bits and the fp16 halves go through two vcvtph2ps, 4 ops per
// sixteen values where load_floats takes 5 (e4m3fn without NaN). The grouped-query score tiles use it (a
// row 37.3 -> 36.5 ns in L2, 40.5 -> 38.8 in L1, one thread of the AMX Xeon); their P.V tiles, holding
// eight accumulators, ran 6-8% slower with it.
template <typename T>
__attribute__((always_inline)) inline void widen_fp8x32(const T* p, __m512& lo, __m512& hi) {
  static_assert(is_fp8<T> && !std::is_same_v<T, Float8_e4m3fn_finite>);
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  __m512i half;
  if constexpr (std::is_same_v<T, c10::Float8_e5m2>) {
#if defined(__AVX512VBMI__)
    half = _mm512_maskz_permutexvar_epi8(0xAAAAAAAAAAAAAAAAull, e5m2_high_bytes_index<__m512i>(),
                                         _mm512_castsi256_si512(bytes));
#else
    half = _mm512_slli_epi16(_mm512_cvtepu8_epi16(bytes), 8);
#endif
  } else {
    half = __m512i(e4m3fn_as_fp16<T>(__v32hi(_mm512_cvtepi8_epi16(bytes))));
  }
  lo = _mm512_cvtph_ps(_mm512_castsi512_si256(half));
  hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(half, 1));
}
#endif

// `count` (<= Vec::size()) values of T widened to fp32; the lanes past count are zero.
template <typename T>
inline at::vec::Vectorized<float> load_floats(const T* p, int64_t count) {
  using Vec = at::vec::Vectorized<float>;
  if (count == Vec::size()) return load_floats(p);
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p, count);
  } else if constexpr (sizeof(T) == 1) {  // fp8, int8: a whole vector's load from a zeroed copy, never past count
    alignas(64) T values[Vec::size()] = {};
    std::copy(p, p + count, values);
    return load_floats(values);
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

// row[0..n) += values[0..n) widened to fp32 (a bias on a GEMM's fp32 row).
template <typename T>
inline void add_widened(float* row, const T* values, int64_t n) {
  using Vec = at::vec::Vectorized<float>;
  for (int64_t i = 0; i < n; i += Vec::size()) {
    const int64_t count = std::min<int64_t>(Vec::size(), n - i);
    (Vec::loadu(row + i, count) + load_floats(values + i, count)).store(row + i, count);
  }
}

// y[m, :cols] = round(tile[m, :cols] + bias[:cols]) for m < rows (ld and ldy the row strides); bias may
// be null. A GEMM task's sums stored without an M x N scratch.
template <typename T>
inline void store_rows_rounded(float* tile, int64_t ld, int64_t rows, int64_t cols, const T* bias, T* y,
                               int64_t ldy) {
  for (int64_t m = 0; m < rows; ++m) {
    if (bias != nullptr) add_widened(tile + m * ld, bias, cols);
    store_row(tile + m * ld, cols, y + m * ldy);
  }
}

}  // namespace mla_inductor
