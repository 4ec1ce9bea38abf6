// The GEMM of the projection templates over quantized weights (int8, fp8; nt_dot.h's WeightScales):
// QuantizedGemm prepares x's rows once, then runs tasks of weight rows, on AMX tiles where the C++ is
// compiled for an AMX CPU and the weights fit them (amx_serves), else on nt_dot.h's FMA and integer tiles.
//
// Why AMX even for a GEMV: the FMA tiles widen every weight to fp32 (widen.h: about four vector ops per
// 16 fp8 weights before their FMA), which held one row of fp8 A-projections to 68-87% of an AMX Xeon's
// copy bandwidth and eight rows to 22-54% (compute-bound; fp8 the least, W8A8 the most). On the tiles, W8A8's
// int8 weight rows are multiplied as they lie in memory (tdpbssd: no conversion at all), and weight-only
// int8 / fp8 weights are converted to bf16 by table, 64 at a time in five ops, after which one
// tdpbf16ps multiplies 16 weight rows by 32 columns of up to 16 x rows.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <type_traits>

namespace mla_inductor {

#if defined(MLA_INDUCTOR_AMX) && defined(__AMX_INT8__)
// A task's tiles: C = 16 weight rows x up to 16 x rows (fp32 or int32 sums), A = 16 weight rows x 64
// bytes (32 bf16 or 64 int8 columns), B = x's rows packed as 16 dwords deep (k pairs of bf16, or k
// quads of int8) x up to 16 rows. Two A and two B tiles, and two C tiles (W8A8) or four (bf16), so
// that consecutive products never wait on each other.
constexpr int kAmxWeightRows = 16;
constexpr int kAmxRows = 16;     // x rows per task
constexpr int64_t kAmxChunk = 64;  // columns per step: one A tile of int8, two of bf16
// The converting tiles ask for each weight row's line this far ahead: one row of fp8 past the L3 ran at
// 79-84% of the copy bandwidth with the hardware prefetcher alone (16 rows at once), 90-97% with it.
constexpr int64_t kAmxPrefetchBytes = 512;

// kAmxWeightRows rows each; tmm0-1 and 6-7 (C) and tmm4-5 (B) one dword per x row wide, tmm2-3 (A) whole.
inline void configure_projection_tiles(int rows) {
  constexpr uint8_t w = kAmxWeightRows;
  const uint16_t x = static_cast<uint16_t>(4 * rows);
  configure_tiles({w, w, w, w, w, w, w, w}, {x, x, 64, 64, x, x, x, x});
}

// The exact bf16 of a weight byte's magnitude (an int8 or an fp8 value; kWidenedScale does not apply:
// the tiles flush bf16 subnormals, which a scaled fp8 value could become).
template <typename TW>
inline const Bf16Table& weight_bf16_table() {
  static const Bf16Table table([](int i) {
    if constexpr (std::is_same_v<TW, int8_t>) {
      return static_cast<float>(i);
    } else if constexpr (is_e4m3fn<TW>) {
      return static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
    } else {
      return static_cast<float>(TW(static_cast<uint8_t>(i), TW::from_bits()));
    }
  });
  return table;
}

// Where column p of 64 weights converted by weights_to_bf16x64 comes from: unpack{lo,hi}_epi8 work
// within 128-bit lanes, so the first 32 hold columns 0-7, 16-23, 32-39, 48-55 and the last 32 the
// others. x's rows are packed in the same order (pack_row_bf16_pairs), which spares the conversion the
// shuffle that would put the weights back in order. Pairs of columns stay together.
constexpr int64_t converted_column(int64_t p) { return 16 * ((p % 32) / 8) + 8 * (p / 32) + p % 8; }

// 64 int8 or fp8 weights as bf16, exactly, in converted_column order. The tables hold magnitudes and
// the sign is or-ed in after: fp8 is sign-magnitude, so its byte indexes the table as it is (vpermi2b
// reads 7 bits); int8 indexes it with its absolute value, whose one value past the table, 128 (from
// -128, abs_epi8's 0x80), reads entry 0 and has its bf16's high byte (0x43) set in.
template <typename TW>
__attribute__((always_inline)) inline void weights_to_bf16x64(const TW* src, c10::BFloat16* dst, const Bf16Table& t) {
  const __m512i raw = _mm512_loadu_si512(src);
  const __m512i index = std::is_same_v<TW, int8_t> ? _mm512_abs_epi8(raw) : raw;
  const __m512i lo = _mm512_permutex2var_epi8(t.lo[0], index, t.lo[1]);
  __m512i hi = _mm512_permutex2var_epi8(t.hi[0], index, t.hi[1]);
  if constexpr (std::is_same_v<TW, int8_t>)
    hi = _mm512_mask_mov_epi8(hi, _mm512_movepi8_mask(index), _mm512_set1_epi8(0x43));
  hi = _mm512_ternarylogic_epi32(hi, raw, _mm512_set1_epi8(char(0x80)), 0xF8);  // a | (b & c)
  _mm512_storeu_si512(dst, _mm512_unpacklo_epi8(lo, hi));
  _mm512_storeu_si512(dst + 32, _mm512_unpackhi_epi8(lo, hi));
}

// x's rows as B operands, packed once per call: per block of kAmxRows rows (`rows` of them, the last
// block fewer), dword j of row r at [j * rows + r]. bf16 rows (from x itself, or fp8 levels held in fp32):
// per 64 columns, dword j is the pair of columns converted_column(2j), + 1; int8 rows: columns 4j..4j+3.
template <typename T>
inline void pack_row_bf16_pairs(const T* q, int64_t K, int r, int rows, uint32_t* block) {
  for (int64_t c = 0; c < K / kAmxChunk; ++c, block += 32 * rows) {
    const T* chunk = q + c * kAmxChunk;
    for (int j = 0; j < 32; ++j) {
      const int64_t k = converted_column(2 * j);
      const uint32_t first = c10::BFloat16(chunk[k]).x, second = c10::BFloat16(chunk[k + 1]).x;
      block[j * rows + r] = first | second << 16;
    }
  }
}

inline void pack_row_int8_quads(const QuantizedInt8* q, int64_t K, int r, int rows, uint32_t* block) {
  for (int64_t j = 0; j < K / 4; ++j) {
    uint32_t quad = 0;
    for (int i = 0; i < 4; ++i) quad |= uint32_t(uint8_t(int8_t(q[4 * j + i]))) << (8 * i);
    block[j * rows + r] = quad;
  }
}

// sums[n * rows + r] = the products of weight rows [0, nr) (int8 or fp8 in nn.Linear's [N, K]) with
// x's block, on bf16 tiles. With k_scales, each block_k columns' products are scaled by its scale
// (the weight rows share their scale blocks: amx_serves); else by 1.
//
// The sums of a K block are read out of the tiles to be scaled, and reading a C tile waits for every
// product before it: so four consecutive K blocks accumulate in four C tiles (0, 1, 6, 7), read out
// together (eight rows of 128-column blocks: 73% of the copy bandwidth read out every block, 87% every
// four). Without K blocks, consecutive chunks go to the four tiles in turn, read out once. The scaled
// read-out is vectorized by hand: GCC left it scalar, which cost eight rows a third of their speed.
template <typename TW>
inline void amx_tile_bf16(const TW* w, int64_t ldw, int nr, int64_t K, const uint32_t* xp, int rows,
                          const float* k_scales, int64_t block_k, float* sums) {
  alignas(64) c10::BFloat16 a[kAmxWeightRows * kAmxChunk];  // 16 rows x 64 converted columns: A tiles 2, 3
  alignas(64) float c[4][kAmxWeightRows * kAmxRows];
  if (nr < kAmxWeightRows) std::memset(a, 0, sizeof(a));  // rows past the weight's end stay zero
  const Bf16Table& table = weight_bf16_table<TW>();
  // a group of columns is read out of the tiles at once: four K blocks, or all of K without them
  const int64_t span = k_scales ? block_k : kAmxChunk;  // the columns that go into one C tile in turn
  const int64_t group = k_scales ? 4 * block_k : K;
  std::fill(sums, sums + kAmxWeightRows * rows, 0.f);
  for (int64_t g0 = 0; g0 < K; g0 += group) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t k = g0; k < std::min(K, g0 + group); k += kAmxChunk) {
      for (int n = 0; n < nr; ++n) {
        _mm_prefetch(reinterpret_cast<const char*>(w + n * ldw + k) + kAmxPrefetchBytes, _MM_HINT_T0);
        weights_to_bf16x64(w + n * ldw + k, a + n * kAmxChunk, table);
      }
      const uint32_t* b = xp + k / kAmxChunk * 32 * rows;
      _tile_loadd(2, a, 2 * kAmxChunk);
      _tile_loadd(3, a + 32, 2 * kAmxChunk);
      _tile_loadd(4, b, 4 * rows);
      _tile_loadd(5, b + 16 * rows, 4 * rows);
      switch ((k - g0) / span % 4) {  // (tile numbers are literals in the intrinsics)
        case 0: _tile_dpbf16ps(0, 2, 4); _tile_dpbf16ps(0, 3, 5); break;
        case 1: _tile_dpbf16ps(1, 2, 4); _tile_dpbf16ps(1, 3, 5); break;
        case 2: _tile_dpbf16ps(6, 2, 4); _tile_dpbf16ps(6, 3, 5); break;
        default: _tile_dpbf16ps(7, 2, 4); _tile_dpbf16ps(7, 3, 5);
      }
    }
    _tile_stored(0, c[0], 4 * rows);
    _tile_stored(1, c[1], 4 * rows);
    _tile_stored(6, c[2], 4 * rows);
    _tile_stored(7, c[3], 4 * rows);
    const int count = k_scales ? static_cast<int>(std::min<int64_t>(4, (K - g0 + block_k - 1) / block_k)) : 4;
    for (int j = 0; j < count; ++j) {
      const __m512 s = _mm512_set1_ps(k_scales ? k_scales[g0 / block_k + j] : 1.f);
      for (int i = 0; i < kAmxWeightRows * rows; i += 16) {
        const __m512 v = _mm512_fmadd_ps(s, _mm512_load_ps(c[j] + i), _mm512_load_ps(sums + i));
        _mm512_store_ps(sums + i, v);
      }
    }
  }
}

// The same for W8A8: the int8 weight rows are A tiles loaded from where they lie (a copy only for a
// last task of fewer than 16 rows), multiplied with x's int8 quads in int32.
inline void amx_tile_int8(const int8_t* w, int64_t ldw, int nr, int64_t K, const uint32_t* xp, int rows,
                          float* sums) {
  alignas(64) int8_t tail[2][kAmxWeightRows * kAmxChunk];
  alignas(64) int32_t c[2][kAmxWeightRows * kAmxRows];
  if (nr < kAmxWeightRows) std::memset(tail, 0, sizeof(tail));  // rows past the weight's end stay zero
  // the A operand of columns [k, k + 64): the weight rows in place, or their copy into tail[t]
  const auto weight_rows = [&](int64_t k, int t) __attribute__((always_inline)) {
    if (nr == kAmxWeightRows) return w + k;
    for (int n = 0; n < nr; ++n) std::memcpy(tail[t] + n * kAmxChunk, w + n * ldw + k, kAmxChunk);
    return static_cast<const int8_t*>(tail[t]);
  };
  const int64_t lda = nr == kAmxWeightRows ? ldw : kAmxChunk;
  const auto x_quads = [&](int64_t k) { return xp + k / kAmxChunk * 16 * rows; };
  _tile_zero(0);
  _tile_zero(1);
  int64_t k = 0;
  for (; k + 2 * kAmxChunk <= K; k += 2 * kAmxChunk) {  // (tile numbers are literals in the intrinsics)
    _tile_loadd(2, weight_rows(k, 0), lda);
    _tile_loadd(4, x_quads(k), 4 * rows);
    _tile_loadd(3, weight_rows(k + kAmxChunk, 1), lda);
    _tile_loadd(5, x_quads(k + kAmxChunk), 4 * rows);
    _tile_dpbssd(0, 2, 4);
    _tile_dpbssd(1, 3, 5);
  }
  if (k < K) {
    _tile_loadd(2, weight_rows(k, 0), lda);
    _tile_loadd(4, x_quads(k), 4 * rows);
    _tile_dpbssd(0, 2, 4);
  }
  _tile_stored(0, c[0], 4 * rows);
  _tile_stored(1, c[1], 4 * rows);
  for (int i = 0; i < kAmxWeightRows * rows; ++i) sums[i] = static_cast<float>(c[0][i] + c[1][i]);
}
#endif

template <ActivationQuant scheme>
constexpr bool is_int8_scheme = scheme == ActivationQuant::kSglang || scheme == ActivationQuant::kTorchao;

// x [M, K] (TX) against quantized weights of type TW, for a template's one or more weights.
template <ActivationQuant scheme, typename TX, typename TW>
class QuantizedGemm {
 public:
  using Row = QuantizedRow<scheme>;

  // `weights`: the scales of every weight the tasks will read (amx_serves).
  QuantizedGemm(int64_t M, int64_t K, std::initializer_list<WeightScales> weights)
      : M_(M), K_(K), amx_(amx_serves(K, weights)), row_scales_(line_aligned<float>(M)) {
    // quantized rows, and widened ones for the FMA tiles (the AMX tiles pack weight-only x as it is)
    if (!amx_ || scheme != ActivationQuant::kNone) rows_ = line_aligned<Row>(M * K);
#if defined(MLA_INDUCTOR_AMX) && defined(__AMX_INT8__)
    if (amx_) {
      packed_ = line_aligned<uint32_t>(M * dwords_per_row());
      require_amx_permission();  // before the parallel region: an error must not be raised inside it
    }
#endif
  }

  // Quantizes (or widens) x's row m, and packs it for the tiles; once per row, from any thread.
  void prepare_row(int64_t m, const TX* x, float static_scale) {
#if defined(MLA_INDUCTOR_AMX) && defined(__AMX_INT8__)
    if (amx_) {
      const int64_t m0 = m / kAmxRows * kAmxRows;
      const int rows = static_cast<int>(std::min<int64_t>(kAmxRows, M_ - m0));
      uint32_t* block = packed_.get() + m0 * dwords_per_row();
      if constexpr (scheme == ActivationQuant::kNone) {  // bf16 x as it is (kAmxTypes)
        row_scales_[m] = 1.f;
        pack_row_bf16_pairs(x, K_, m - m0, rows, block);
      } else {
        Row* row = rows_.get() + m * K_;
        row_scales_[m] = quantize_row<scheme>(x, K_, row, static_scale);
        if constexpr (is_int8_scheme<scheme>) pack_row_int8_quads(row, K_, m - m0, rows, block);
        else pack_row_bf16_pairs(row, K_, m - m0, rows, block);
      }
      return;
    }
#endif
    row_scales_[m] = quantize_row<scheme>(x, K_, rows_.get() + m * K_, static_scale);
  }

  int64_t tasks(int64_t N) const {
    if (!amx_) return nt_tasks(M_, N);
    return (N + kWeightRowsPerTask - 1) / kWeightRowsPerTask * ((M_ + kAmxRowsPerTask - 1) / kAmxRowsPerTask);
  }

  // out[m * ldo + n] for task `task` of tasks(N) over the [N, K] weight w (ldw) and its scales.
  void run(int64_t task, const TW* w, int64_t ldw, int64_t N, const WeightScales& scales, float* out,
           int64_t ldo) const {
#if defined(MLA_INDUCTOR_AMX) && defined(__AMX_INT8__)
    if (amx_) return run_amx(task, w, ldw, N, scales, out, ldo);
#endif
    nt_task_scaled(task, rows_.get(), K_, row_scales_.get(), M_, w, ldw, N, K_, scales, out, ldo);
  }

 private:
#if defined(MLA_INDUCTOR_AMX) && defined(__AMX_INT8__)
  static constexpr int kWeightRowsPerTask = kAmxWeightRows, kAmxRowsPerTask = kAmxRows;
  // weight-only x rows must be bf16 to multiply on bf16 tiles exactly (fp8 activations are exact in bf16)
  static constexpr bool kAmxTypes =
      is_int8_scheme<scheme> ? std::is_same_v<TW, int8_t>
                             : (scheme != ActivationQuant::kNone || std::is_same_v<TX, c10::BFloat16>) &&
                                   (std::is_same_v<TW, int8_t> || is_fp8<TW>);
#else
  static constexpr int kWeightRowsPerTask = 1, kAmxRowsPerTask = 1;
  static constexpr bool kAmxTypes = false;
#endif

  // Whether the tiles serve every weight: whole 64-column chunks, a weight's K-block scales shared by
  // a task's 16 rows (block_n % 16) and whole chunks to a K block; int32 sums of K / 4 quads of at most
  // 4 * 2^14 stay exact up to K = 2^16.
  static bool amx_serves(int64_t K, std::initializer_list<WeightScales> weights) {
    if (!kAmxTypes || K % 64 != 0 || K > (int64_t(1) << 16)) return false;
    return std::all_of(weights.begin(), weights.end(), [&](const WeightScales& s) {
      return s.block_k >= K || (s.block_k % 64 == 0 && s.block_n % 16 == 0);
    });
  }

#if defined(MLA_INDUCTOR_AMX) && defined(__AMX_INT8__)
  int64_t dwords_per_row() const { return is_int8_scheme<scheme> ? K_ / 4 : K_ / 2; }

  void run_amx(int64_t task, const TW* w, int64_t ldw, int64_t N, const WeightScales& scales, float* out,
               int64_t ldo) const {
    const int64_t m_blocks = (M_ + kAmxRows - 1) / kAmxRows;
    const int64_t n0 = task / m_blocks * kAmxWeightRows, m0 = task % m_blocks * kAmxRows;
    const int nr = static_cast<int>(std::min<int64_t>(kAmxWeightRows, N - n0));
    const int rows = static_cast<int>(std::min<int64_t>(kAmxRows, M_ - m0));
    const uint32_t* xp = packed_.get() + m0 * dwords_per_row();
    const TW* wt = w + n0 * ldw;
    const bool k_blocked = scales.block_k < K_;
    alignas(64) float sums[kAmxWeightRows * kAmxRows];
    configure_projection_tiles(rows);  // per task: other kernels (oneDNN's) configure the tiles too
    if constexpr (is_int8_scheme<scheme>) {
      amx_tile_int8(wt, ldw, nr, K_, xp, rows, sums);
    } else {
      const float* k_scales = k_blocked ? scales.scale + n0 / scales.block_n * scales.ld : nullptr;
      amx_tile_bf16(wt, ldw, nr, K_, xp, rows, k_scales, k_blocked ? scales.block_k : K_, sums);
    }
    _tile_release();
    for (int n = 0; n < nr; ++n) {
      const float column = k_blocked ? 1.f : scales.scale[(n0 + n) / scales.block_n * scales.ld];
      for (int r = 0; r < rows; ++r) out[(m0 + r) * ldo + n0 + n] = sums[n * rows + r] * column * row_scales_[m0 + r];
    }
  }
#endif

  int64_t M_, K_;
  bool amx_;
  LineAligned<Row> rows_;
  LineAligned<float> row_scales_;
  LineAligned<uint32_t> packed_;
};

}  // namespace mla_inductor
