// RoPE of one head: the first rotary_dim values rotated by (cos, sin) in fp32 and rounded once, the
// rest of the head copied. cos and sin are rotary_dim / 2 values each (one row of a cos ‖ sin cache).
#pragma once
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>

namespace mla_inductor {

// NeoX / rotate_half: pairs (x[i], x[i + half]). x may be a wider type than out (an fp32 scratch row).
template <typename X, typename T, typename C>
inline void rope_neox(const X* x, T* out, const C* cos, const C* sin, int64_t half) {
  using Vec = at::vec::Vectorized<float>;
  for (int64_t i = 0; i < half; i += Vec::size()) {
    const int64_t n = std::min<int64_t>(Vec::size(), half - i);
    const Vec c = load_floats(cos + i, n), s = load_floats(sin + i, n);
    const Vec a = load_floats(x + i, n), b = load_floats(x + half + i, n);
    store_floats(out + i, a * c - b * s, n);
    store_floats(out + half + i, b * c + a * s, n);
  }
}

// GPT-J / DeepSeek interleaved: pairs (x[2 i], x[2 i + 1]). Two vectors of x hold Vec::size() pairs:
// de-interleave them into evens and odds, rotate, interleave back.
template <typename X, typename T, typename C>
inline void rope_interleaved(const X* x, T* out, const C* cos, const C* sin, int64_t half) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t V = Vec::size();
  int64_t i = 0;
  for (; i + V <= half; i += V) {
    const auto [a, b] = at::vec::deinterleave2(load_floats(x + 2 * i), load_floats(x + 2 * i + V));
    const Vec c = load_floats(cos + i), s = load_floats(sin + i);
    const auto [lo, hi] = at::vec::interleave2(a * c - b * s, b * c + a * s);
    store_floats(out + 2 * i, lo);
    store_floats(out + 2 * i + V, hi);
  }
  for (; i < half; ++i) {
    const float a = static_cast<float>(x[2 * i]), b = static_cast<float>(x[2 * i + 1]);
    const float c = static_cast<float>(cos[i]), s = static_cast<float>(sin[i]);
    out[2 * i] = static_cast<T>(a * c - b * s);
    out[2 * i + 1] = static_cast<T>(b * c + a * s);
  }
}

// transformers' DeepseekV3 layout: interleaved pairs in, the rotated evens then the rotated odds out.
template <typename X, typename T, typename C>
inline void rope_interleaved_to_halves(const X* x, T* out, const C* cos, const C* sin, int64_t half) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t V = Vec::size();
  int64_t i = 0;
  for (; i + V <= half; i += V) {
    const auto [a, b] = at::vec::deinterleave2(load_floats(x + 2 * i), load_floats(x + 2 * i + V));
    const Vec c = load_floats(cos + i), s = load_floats(sin + i);
    store_floats(out + i, a * c - b * s);
    store_floats(out + half + i, b * c + a * s);
  }
  for (; i < half; ++i) {
    const float a = static_cast<float>(x[2 * i]), b = static_cast<float>(x[2 * i + 1]);
    const float c = static_cast<float>(cos[i]), s = static_cast<float>(sin[i]);
    out[i] = static_cast<T>(a * c - b * s);
    out[half + i] = static_cast<T>(b * c + a * s);
  }
}

// transformers' `x cos + rotate_half(x) sin` with full-width cos/sin [2 half]: exact also where the
// two halves of cos/sin differ (mla::gqa_qkv takes them as the model computes them).
template <typename X, typename T, typename C>
inline void rope_neox_full(const X* x, T* out, const C* cos, const C* sin, int64_t half) {
  using Vec = at::vec::Vectorized<float>;
  for (int64_t i = 0; i < half; i += Vec::size()) {
    const int64_t n = std::min<int64_t>(Vec::size(), half - i);
    const Vec a = load_floats(x + i, n), b = load_floats(x + half + i, n);
    store_floats(out + i, a * load_floats(cos + i, n) - b * load_floats(sin + i, n), n);
    store_floats(out + half + i, b * load_floats(cos + half + i, n) + a * load_floats(sin + half + i, n), n);
  }
}

// The styles of mla::apply_rope (ops/rope.py).
enum class RopeStyle { kNeox, kInterleaved, kInterleavedToHalves };

template <RopeStyle S, typename X, typename T, typename C>
inline void rope(const X* x, T* out, const C* cos, const C* sin, int64_t half) {
  if constexpr (S == RopeStyle::kNeox) {
    rope_neox(x, out, cos, sin, half);
  } else if constexpr (S == RopeStyle::kInterleaved) {
    rope_interleaved(x, out, cos, sin, half);
  } else {
    rope_interleaved_to_halves(x, out, cos, sin, half);
  }
}

// One head: its first rotary_dim values rotated, the rest copied.
template <RopeStyle S, typename T, typename C>
inline void rope_head(const T* x, T* out, const C* cos, const C* sin, int64_t rotary_dim, int64_t head_size) {
  rope<S>(x, out, cos, sin, rotary_dim / 2);
  for (int64_t i = rotary_dim; i < head_size; ++i) out[i] = x[i];
}

}  // namespace mla_inductor
