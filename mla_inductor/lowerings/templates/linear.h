// mla::linear's tasks: the projection templates' GEMM tiles (nt_dot.h; packed_dot.h under freezing),
// each task's fp32 sums kept in a tile of its own and rounded once into y, the bias added first. No
// scratch of M x N floats: a prefill's lm_head would need gigabytes of it.
namespace mla_inductor {

// y[m, :cols] = round(tile[m, :cols] + bias[:cols]) for m < rows; bias may be null.
template <typename T>
inline void store_biased_rows(float* tile, int64_t ld, int64_t rows, int64_t cols, const T* bias, T* y,
                              int64_t ldy) {
  for (int64_t m = 0; m < rows; ++m) {
    float* row = tile + m * ld;
    if (bias != nullptr)
      for (int64_t n = 0; n < cols; ++n) row[n] += static_cast<float>(bias[n]);
    store_row(row, cols, y + m * ldy);
  }
}

// Task `task` of nt_tasks(M, N): a panel of at most kMaxPanelRows x rows by kTileCols weight rows.
template <typename T>
inline void linear_nt_task(int64_t task, const T* x, int64_t ldx, int64_t M, const T* w, int64_t ldw, int64_t N,
                           int64_t K, const T* bias, T* y, int64_t ldy) {
  const auto [m0, n0, mr, nr] = nt_panel(task, M, N);
  alignas(64) float tile[kMaxPanelRows * kTileCols];
  dot_panel<T>(x + m0 * ldx, ldx, mr, w + n0 * ldw, ldw, nr, K, tile, kTileCols);
  store_biased_rows(tile, kTileCols, mr, nr, bias ? bias + n0 : nullptr, y + m0 * ldy + n0, ldy);
}

#if defined(MLA_INDUCTOR_PACKED_DOT)
// Task `block` of packed_tasks(N): one packed column block, every x row passing over it while it is in
// L2, kLinearPackedRows rows at a time (one tile's worth of sums on the stack).
constexpr int64_t kLinearPackedRows = 64;

inline void linear_packed_task(int64_t block, const c10::BFloat16* x, int64_t ldx, int64_t M,
                               const c10::BFloat16* packed, int64_t N, int64_t K, const c10::BFloat16* bias,
                               c10::BFloat16* y, int64_t ldy) {
  const int64_t n0 = block * kPackedCols, cols = std::min(kPackedCols, N - n0);
  const c10::BFloat16* weights = packed + block * packed_block_elems(K);
  alignas(64) float tile[kLinearPackedRows * kPackedCols];
  for (int64_t m0 = 0; m0 < M; m0 += kLinearPackedRows) {
    const int64_t rows = std::min(kLinearPackedRows, M - m0);
    packed_block_bf16(x + m0 * ldx, ldx, rows, weights, K, cols, tile, kPackedCols);
    store_biased_rows(tile, kPackedCols, rows, cols, bias ? bias + n0 : nullptr, y + m0 * ldy + n0, ldy);
  }
}
#endif

}  // namespace mla_inductor
