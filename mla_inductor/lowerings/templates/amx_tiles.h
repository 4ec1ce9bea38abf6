// AMX tiles (Sapphire Rapids and newer Xeons) for decode attention with many query heads per cache
// row: the building blocks that latent_attention.h's AMX path is made of (the byte -> bf16 tables and
// the tile configuration serve quantized_gemm.h's projection tiles too).
//
// Why: with 16 or more heads per row (MLA's latent attention), a decode step does ~40 FLOPs per cache
// byte, which two cores' AVX-512 tiles (dpbf16 or fp32 FMAs, ~150 GFLOP/s) cannot keep up with: the step
// is compute-bound at a sixth of what the memory could feed. `_tile_dpbf16ps` multiplies 16 x 32 bf16 by
// 32 x 16 bf16 in one instruction (16x a dpbf16 vector op), which makes the step bound by the cache read
// again, and lets an fp8 cache's halved bytes pay.
//
// MLA_INDUCTOR_AMX is defined where the C++ is compiled for such a CPU (-march=native on one, or
// cpp.march = sapphirerapids); every such CPU also has AVX512-VBMI, which the fp8 conversion uses. The
// conversion is built wherever VBMI is: AVX512-BF16 CPUs without AMX (Zen 4) convert an fp8 cache for
// their dpbf16 tiles with it (latent_attention.h, converts_fp8_to_bf16).
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512VBMI__)
namespace mla_inductor {

// Byte -> bf16 by table: the bf16 bits of 128 values, low and high bytes in two 128-byte tables that
// two vpermi2b look up 64 values at a time (vpermi2b reads an index's low 7 bits).
struct Bf16Table {
  __m512i lo[2], hi[2];
  template <typename Value>
  explicit Bf16Table(Value value_of) {
    alignas(64) uint8_t lo_bytes[128], hi_bytes[128];
    for (int i = 0; i < 128; ++i) {
      const uint16_t bits = c10::BFloat16(value_of(i)).x;
      lo_bytes[i] = bits & 0xff;
      hi_bytes[i] = bits >> 8;
    }
    for (int t = 0; t < 2; ++t) {
      lo[t] = _mm512_load_si512(lo_bytes + 64 * t);
      hi[t] = _mm512_load_si512(hi_bytes + 64 * t);
    }
  }
};

// fp8 -> bf16: the 128 magnitudes' bf16 bits (times kWidenedScale<C>, as load_floats widens them, so
// that the kernels' scale bookkeeping is the same on every path). Exact for every value: an fp8 has at
// most 3 mantissa bits and its exponents are within bf16's; NaN and infinity map to themselves. The
// fp16 route of the FMA kernels (unpack, vcvtph2ps, then vcvtne2ps2bf16) takes three times the ops.
template <typename C>
inline const Bf16Table& fp8_bf16_table() {
  static const Bf16Table table(
      [](int i) { return static_cast<float>(C(static_cast<uint8_t>(i), C::from_bits())) * kWidenedScale<C>; });
  return table;
}

// Two runs of 32 fp8 values, their qwords alternating (128-bit lane l holds the first run's values
// 8l..8l+7, then the second's), in bf16: `first` and `second` each a run in order (unpack{lo,hi}_epi8
// interleave bytes within 128-bit lanes). vpermi2b ignores an index's top bit, so the byte itself
// indexes the magnitude tables and the sign is or-ed in after.
__attribute__((always_inline)) inline void fp8_lanes_to_bf16(__m512i x, const Bf16Table& t, __m512i& first,
                                                             __m512i& second) {
  const __m512i lo = _mm512_permutex2var_epi8(t.lo[0], x, t.lo[1]);
  const __m512i magnitude = _mm512_permutex2var_epi8(t.hi[0], x, t.hi[1]);
  const __m512i hi = _mm512_ternarylogic_epi32(magnitude, x, _mm512_set1_epi8(char(0x80)), 0xF8);  // a | (b & c)
  first = _mm512_unpacklo_epi8(lo, hi);
  second = _mm512_unpackhi_epi8(lo, hi);
}

// src[0, count) in bf16, in order, count <= 64 (zeros past it): `first` values 0-31, `second` 32-63. The
// qword shuffle puts values 8l..8l+7 and 32+8l..32+8l+7 in lane l.
template <typename C>
__attribute__((always_inline)) inline void load_fp8x64_as_bf16(const C* src, const Bf16Table& t, __m512i& first,
                                                               __m512i& second, int count = 64) {
  const __m512i raw = count == 64 ? _mm512_loadu_si512(src) : _mm512_maskz_loadu_epi8((1ull << count) - 1, src);
  fp8_lanes_to_bf16(_mm512_permutexvar_epi64(_mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7), raw), t, first, second);
}

// The byte shuffle of fp8_pairs_to_bf16: byte 2c of the result is byte c of the first operand, byte 2c + 1
// byte c of the second (index 64 + c).
struct PairInterleave {
  alignas(64) uint8_t index[64];
  constexpr PairInterleave() : index() {
    for (int c = 0; c < 32; ++c) {
      index[2 * c] = static_cast<uint8_t>(c);
      index[2 * c + 1] = static_cast<uint8_t>(64 + c);
    }
  }
};
inline constexpr PairInterleave kPairInterleave{};

// Columns [0, 32) of fp8 rows a and b in bf16, interleaved in pairs as store_interleaved leaves them: lo
// holds (a[c], b[c]) for c = 8l..8l+3 in 128-bit lane l, hi for c = 8l+4..8l+7 (paired_column). The rows
// are interleaved as bytes first (a[c], b[c] at bytes 2c, 2c + 1), so that the tables convert both at
// once and the unpacks that join each value's two bytes leave the pairs: no 16-bit interleave after.
__attribute__((always_inline)) inline void fp8_pairs_to_bf16(const void* a, const void* b, const Bf16Table& t,
                                                             __m512i& lo, __m512i& hi) {
  const __m512i rows = _mm512_permutex2var_epi8(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)a)),
                                                _mm512_load_si512(kPairInterleave.index),
                                                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)b)));
  const __m512i low_bytes = _mm512_permutex2var_epi8(t.lo[0], rows, t.lo[1]);
  const __m512i magnitude = _mm512_permutex2var_epi8(t.hi[0], rows, t.hi[1]);
  const __m512i high_bytes = _mm512_ternarylogic_epi32(magnitude, rows, _mm512_set1_epi8(char(0x80)), 0xF8);
  lo = _mm512_unpacklo_epi8(low_bytes, high_bytes);
  hi = _mm512_unpackhi_epi8(low_bytes, high_bytes);
}

// dst[0, count) = src[0, count) in bf16, in order, count <= 64.
template <typename C>
__attribute__((always_inline)) inline void fp8_to_bf16x64(const C* src, c10::BFloat16* dst, const Bf16Table& t,
                                                          int count = 64) {
  __m512i first, second;
  load_fp8x64_as_bf16(src, t, first, second, count);
  if (count == 64) {
    _mm512_storeu_si512(dst, first);
    _mm512_storeu_si512(dst + 32, second);
    return;
  }
  const auto first_lanes = [](int k) { return __mmask32(k >= 32 ? ~0u : (1u << k) - 1); };
  _mm512_mask_storeu_epi16(dst, first_lanes(count), first);
  if (count > 32) _mm512_mask_storeu_epi16(dst + 32, first_lanes(count - 32), second);
}

// dst[0, n) = src[0, n) in bf16: a copy, or fp8 converted.
template <typename C>
__attribute__((always_inline)) inline void row_to_bf16(const C* src, int64_t n, c10::BFloat16* dst) {
  if constexpr (std::is_same_v<C, c10::BFloat16>) {
    std::memcpy(dst, src, n * sizeof(C));
  } else {
    const Bf16Table& table = fp8_bf16_table<C>();
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) fp8_to_bf16x64(src + i, dst + i, table);
    if (i < n) fp8_to_bf16x64(src + i, dst + i, table, static_cast<int>(n - i));
  }
}

}  // namespace mla_inductor
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define MLA_INDUCTOR_AMX 1
namespace mla_inductor {

// Linux grants a process AMX's tile data state on request only (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA, Linux 5.16+); a tile instruction before that faults. Asked once per process.
inline void require_amx_permission() {
  static const bool granted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  TORCH_CHECK(granted, "mla_inductor: Linux refused this process the AMX tile state (arch_prctl "
              "ARCH_REQ_XCOMP_PERM), which this kernel was compiled for; compile for a target without AMX "
              "(torch._inductor.config.cpp.march, e.g. \"cooperlake\").");
}

// The palette-1 tile configuration: tile t holds rows[t] rows of colsb[t] bytes (at most 16 x 64).
// Each kernel shapes its tiles to its operands (a GEMM's row count, a group of heads). A thread's
// configuration is its own and other kernels (oneDNN's) change it: load it at the start of every task.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// ldtilecfg with the whole configuration as its operand. GCC's _tile_loadconfig tells the compiler it
// reads a pointer's worth of bytes (its asm operand is `*(const void**)config`), so the stores of the
// shapes past byte 8 may be dropped or sunk below it: a register-loop benchmark built that way raised
// SIGILL at the first product after its fourth configuration (benchmarks/instruction_rates.cpp).
inline void load_tile_config(const TileConfig& config) { asm volatile("ldtilecfg %0" : : "m"(config)); }

// Tiles 0-7 of rows[t] rows of bytes[t] bytes.
inline void configure_tiles(const uint8_t (&rows)[8], const uint16_t (&bytes)[8]) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = bytes[t];
    config.rows[t] = rows[t];
  }
  load_tile_config(config);
}

// dst[0, 64) = 32 bf16 columns of rows a and b interleaved in pairs, the layout of a B operand over
// rows: dst[2c + e] = (e ? b : a)[c'] with c' = paired_column's permutation of the 32 columns
// (unpack{lo,hi}_epi16 work within 128-bit lanes; the P.V output is put back in order when the splits
// are merged, restore_column_order).
__attribute__((always_inline)) inline void store_interleaved(__m512i a, __m512i b, c10::BFloat16* dst) {
  _mm512_storeu_si512(dst, _mm512_unpacklo_epi16(a, b));
  _mm512_storeu_si512(dst + 32, _mm512_unpackhi_epi16(a, b));
}

// dst[0, 2n) = rows a and b (n bf16 columns each, n a multiple of 32) so interleaved, 32 columns at a time.
inline void interleave_rows(const c10::BFloat16* a, const c10::BFloat16* b, int64_t n, c10::BFloat16* dst) {
  for (int64_t c = 0; c < n; c += 32)
    store_interleaved(_mm512_loadu_si512(a + c), _mm512_loadu_si512(b + c), dst + 2 * c);
}

}  // namespace mla_inductor
#endif
