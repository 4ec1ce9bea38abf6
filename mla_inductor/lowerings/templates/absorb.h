// Absorption of a query head into latent space: q_lat[l] = sum_d q[d] * w_kc[d * ld + l], from an fp32 q
// (a GEMM's scratch row, never rounded) in fp32, rounded once into out. kAbsorbVecs accumulators hold
// a slice of the output row while every w_kc row streams past; a head's w_kc (nope x L) stays in L2
// for the next token.
#pragma once
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>

namespace mla_inductor {

constexpr int kAbsorbVecs = 8;

template <typename W, typename T>
inline void absorb_row(const float* q, int64_t nope, const W* w_kc, int64_t ld, int64_t L, T* out) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t V = Vec::size();
  for (int64_t l0 = 0; l0 < L; l0 += kAbsorbVecs * V) {
    const int64_t vecs = std::min<int64_t>(kAbsorbVecs, (L - l0 + V - 1) / V);
    const int64_t last = L - l0 - (vecs - 1) * V;  // lanes of the last vector
    Vec acc[kAbsorbVecs];
    for (auto& a : acc) a = Vec(0.f);
    for (int64_t d = 0; d < nope; ++d) {
      const Vec qd(q[d]);
      const W* row = w_kc + d * ld + l0;
      for (int64_t v = 0; v < vecs; ++v) {
        acc[v] = at::vec::fmadd(qd, load_floats(row + v * V, v + 1 < vecs ? V : last), acc[v]);
      }
    }
    for (int64_t v = 0; v < vecs; ++v) store_floats(out + l0 + v * V, acc[v], v + 1 < vecs ? V : last);
  }
}

}  // namespace mla_inductor
