// Mixture-of-Experts building blocks (moe.cpp.j2): the routing of (token, slot) pairs to experts, and the
// per-expert column blocks of the gated MLP over the GEMV / GEMM tiles of nt_dot.h (weights as the model
// holds them) or packed_dot.h (weights packed at compile time under freezing).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace mla_inductor {

// The (token, slot) pairs of a call grouped by expert: pairs[offsets[e] .. offsets[e + 1]) are expert e's,
// in token order; `active` lists the experts with at least one pair. A slot whose id is outside [0, E)
// (an expert-parallel plan's sentinel) is in no expert's range and adds nothing.
struct ExpertRouting {
  std::vector<int64_t> offsets, pairs, active;
  // where each pair landed in the grouped order, -1 for a sentinel: row_of[m * topk + j]
  std::vector<int64_t> row_of;
};

template <typename TI>
inline ExpertRouting route_to_experts(const TI* ids, int64_t M, int64_t topk, int64_t E) {
  ExpertRouting r;
  r.offsets.assign(E + 1, 0);
  r.row_of.assign(M * topk, -1);
  for (int64_t p = 0; p < M * topk; ++p) {
    const int64_t e = static_cast<int64_t>(ids[p]);
    if (e >= 0 && e < E) ++r.offsets[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) {
    if (r.offsets[e + 1] > 0) r.active.push_back(e);
    r.offsets[e + 1] += r.offsets[e];
  }
  r.pairs.resize(r.offsets[E]);
  std::vector<int64_t> next(r.offsets.begin(), r.offsets.end() - 1);
  for (int64_t p = 0; p < M * topk; ++p) {
    const int64_t e = static_cast<int64_t>(ids[p]);
    if (e < 0 || e >= E) continue;
    r.row_of[p] = next[e];
    r.pairs[next[e]++] = p;
  }
  return r;
}

// Rows of a column block that one pass holds in fp32 on the stack (two tiles: gate and up).
constexpr int64_t kExpertRows = 64;

// out[m, c] = x[m] . W[n0 + c] in fp32 for m < rows, c < cols, W being nn.Linear's [N, K] rows (ldw apart):
// nt_dot.h's panels of up to kMaxPanelRows rows by kTileCols weight rows.
template <typename T>
inline void column_sums_nt(const T* x, int64_t ldx, int64_t rows, const T* w, int64_t ldw, int64_t cols, int64_t K,
                           float* out, int64_t ldo) {
  for (int64_t n = 0; n < cols; n += kTileCols) {
    const int nr = static_cast<int>(std::min<int64_t>(kTileCols, cols - n));
    for (int64_t m0 = 0; m0 < rows; m0 += kMaxPanelRows) {
      const int mr = static_cast<int>(std::min<int64_t>(kMaxPanelRows, rows - m0));
      dot_panel<T>(x + m0 * ldx, ldx, mr, w + n * ldw, ldw, nr, K, out + m0 * ldo + n, ldo);
    }
  }
}

// silu(gate) * up of one row of a column block into h, gate and up rounded to T first (as the GEMM that
// makes them would store them), the product computed in fp32 and rounded once.
template <typename T>
inline void gated_row(const float* gate, const float* up, int64_t cols, T* h) {
  for (int64_t c = 0; c < cols; ++c) {
    const float g = static_cast<float>(static_cast<T>(gate[c]));
    const float u = static_cast<float>(static_cast<T>(up[c]));
    h[c] = static_cast<T>(g / (1.f + std::exp(-g)) * u);
  }
}

// y[m] = sum over m's slots of z[row_of[m * topk + j]] (fp32 rows of width K), rounded once.
template <typename T>
inline void sum_slots_rounded(const float* z, const int64_t* row_of, int64_t m, int64_t topk, int64_t K, T* y) {
  using Vec = at::vec::Vectorized<float>;
  int64_t k = 0;
  for (; k < K; k += Vec::size()) {
    const int64_t count = std::min<int64_t>(Vec::size(), K - k);
    Vec sum(0.f);
    for (int64_t j = 0; j < topk; ++j) {
      const int64_t row = row_of[m * topk + j];
      if (row >= 0) sum = sum + Vec::loadu(z + row * K + k, count);
    }
    store_floats(y + m * K + k, sum, count);
  }
}

}  // namespace mla_inductor
