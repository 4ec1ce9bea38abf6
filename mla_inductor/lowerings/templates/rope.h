// RoPE of one head: the first rotary_dim values rotated by (cos, sin) in fp32 and rounded once, the
// rest of the head copied. cos and sin are rotary_dim / 2 values each (one row of a cos ‖ sin cache).
#pragma once
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>

namespace mla_inductor {

// rotate_half pairs (x[i], x[i + half]), the first half rotated by (cos_lo, sin_lo) and the second by
// (cos_hi, sin_hi): the same rows for a NeoX rotation, the two halves of transformers' full-width
// cos/sin for `x cos + rotate_half(x) sin` (exact also where those halves differ). x may be a wider
// type than out (an fp32 scratch row).
template <typename X, typename T, typename C>
inline void rope_halves(const X* x, T* out, const C* cos_lo, const C* sin_lo, const C* cos_hi, const C* sin_hi,
                        int64_t half) {
  using Vec = at::vec::Vectorized<float>;
  for (int64_t i = 0; i < half; i += Vec::size()) {
    const int64_t n = std::min<int64_t>(Vec::size(), half - i);
    const Vec a = load_floats(x + i, n), b = load_floats(x + half + i, n);
    store_floats(out + i, a * load_floats(cos_lo + i, n) - b * load_floats(sin_lo + i, n), n);
    store_floats(out + half + i, b * load_floats(cos_hi + i, n) + a * load_floats(sin_hi + i, n), n);
  }
}

// NeoX: cos and sin are half values each.
template <typename X, typename T, typename C>
inline void rope_neox(const X* x, T* out, const C* cos, const C* sin, int64_t half) {
  rope_halves(x, out, cos, sin, cos, sin, half);
}

// transformers' rotate_half with full-width cos and sin (2 half values each).
template <typename X, typename T, typename C>
inline void rope_neox_full(const X* x, T* out, const C* cos, const C* sin, int64_t half) {
  rope_halves(x, out, cos, sin, cos + half, sin + half, half);
}

// GPT-J / DeepSeek interleaved pairs (x[2 i], x[2 i + 1]). Two vectors of x hold Vec::size() pairs:
// de-interleave them into evens and odds and rotate; then interleave back (TO_HALVES false), or store
// the rotated evens then the rotated odds (TO_HALVES: transformers' DeepseekV3 layout).
template <bool TO_HALVES, typename X, typename T, typename C>
inline void rope_interleaved(const X* x, T* out, const C* cos, const C* sin, int64_t half) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t V = Vec::size();
  // where the rotated pair i goes
  const int64_t first = TO_HALVES ? 1 : 2, second = TO_HALVES ? half : 1;
  int64_t i = 0;
  for (; i + V <= half; i += V) {
    const auto [a, b] = at::vec::deinterleave2(load_floats(x + 2 * i), load_floats(x + 2 * i + V));
    const Vec c = load_floats(cos + i), s = load_floats(sin + i);
    const Vec even = a * c - b * s, odd = b * c + a * s;
    if constexpr (TO_HALVES) {
      store_floats(out + i, even);
      store_floats(out + half + i, odd);
    } else {
      const auto [lo, hi] = at::vec::interleave2(even, odd);
      store_floats(out + 2 * i, lo);
      store_floats(out + 2 * i + V, hi);
    }
  }
  for (; i < half; ++i) {
    const float a = static_cast<float>(x[2 * i]), b = static_cast<float>(x[2 * i + 1]);
    const float c = static_cast<float>(cos[i]), s = static_cast<float>(sin[i]);
    out[first * i] = static_cast<T>(a * c - b * s);
    out[first * i + second] = static_cast<T>(b * c + a * s);
  }
}

// The styles of mla::apply_rope (ops/rope.py).
enum class RopeStyle { kNeox, kInterleaved, kInterleavedToHalves };

template <RopeStyle S, typename X, typename T, typename C>
inline void rope(const X* x, T* out, const C* cos, const C* sin, int64_t half) {
  if constexpr (S == RopeStyle::kNeox) {
    rope_neox(x, out, cos, sin, half);
  } else {
    rope_interleaved<S == RopeStyle::kInterleavedToHalves>(x, out, cos, sin, half);
  }
}

// One head: its first rotary_dim values rotated, the rest copied.
template <RopeStyle S, typename T, typename C>
inline void rope_head(const T* x, T* out, const C* cos, const C* sin, int64_t rotary_dim, int64_t head_size) {
  rope<S>(x, out, cos, sin, rotary_dim / 2);
  for (int64_t i = rotary_dim; i < head_size; ++i) out[i] = x[i];
}

}  // namespace mla_inductor
