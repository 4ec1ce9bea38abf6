// RMSNorm of one attention head in the projection's fp32 epilogue (gqa_qkv.cpp.j2: Qwen3's q_norm and
// k_norm), rounded where the model rounds, so that the fused output equals eager's.
#pragma once
#include <cmath>
#include <cstdint>

namespace mla_inductor {

// x[0, n) = weight * rms_norm(x) as transformers' RMSNorm computes it on the projection's output: x
// rounded to T (the Linear's output), normalised in fp32, rounded to T, times the weight, rounded to T.
// The results go back into x as floats (each a T value) for the RoPE and the store that follow. A
// head is a few hundred values a token: the scalar loops cost nothing next to the GEMM's weight stream.
template <typename T>
inline void rms_norm_head(float* x, const T* weight, int64_t n, float eps) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = static_cast<float>(static_cast<T>(x[i]));
    sum += x[i] * x[i];
  }
  const float inverse_rms = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    const float normed = static_cast<float>(static_cast<T>(x[i] * inverse_rms));
    x[i] = static_cast<float>(static_cast<T>(static_cast<float>(weight[i]) * normed));
  }
}

}  // namespace mla_inductor
