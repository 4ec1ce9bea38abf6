// RMSNorm of one attention head in the projection's fp32 epilogue (gqa_qkv.cpp.j2: Qwen3's and Gemma-3's
// q_norm and k_norm), rounded where the model rounds, so that the fused output equals eager's.
#pragma once
#include <cmath>
#include <cstdint>

namespace mla_inductor {

// x[0, n) = the head's RMSNorm as transformers computes it on the projection's output: x rounded to T
// (the Linear's output), normalised in fp32, then either rounded to T, times the weight, rounded to T
// (Llama's and Qwen3's RMSNorm), or, GEMMA, times 1 + weight in fp32 and rounded once (Gemma's). The
// results go back into x as floats (each a T value) for the RoPE and the store that follow. A head is a
// few hundred values a token: the scalar loops cost nothing next to the GEMM's weight stream.
template <bool GEMMA, typename T>
inline void rms_norm_head(float* x, const T* weight, int64_t n, float eps) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = static_cast<float>(static_cast<T>(x[i]));
    sum += x[i] * x[i];
  }
  const float inverse_rms = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    const float w = static_cast<float>(weight[i]);
    if constexpr (GEMMA) {
      x[i] = static_cast<float>(static_cast<T>(x[i] * inverse_rms * (1.f + w)));
    } else {
      x[i] = static_cast<float>(static_cast<T>(w * static_cast<float>(static_cast<T>(x[i] * inverse_rms))));
    }
  }
}

}  // namespace mla_inductor
