// Register loops that time the instructions the decode kernels' choices rest on, in ns each: which
// product a CPU should run (fp32 FMAs, AVX512-BF16 dot products, AMX tiles), and what an AMX tile product
// costs against its shape and its operands' loads. Built and run by benchmarks/instruction_rates.py
// (gcc -O2 for --march, with the templates' widen.h and amx_tiles.h, whose tile configuration and AMX
// permission the AMX probes use); probes the target lacks are not built. Prints one line a probe:
//   name  median ns an instruction (or a step)  min  multiply-adds an instruction (or a step)
// Every probe runs once a round, in turn, for `rounds` rounds (argv[1]): a machine whose speed drifts
// shifts all of them alike. The loops keep their accumulators in registers (an empty asm ties each one to
// a register every iteration: without it GCC may keep them on the stack, and the loop times the stores).
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace {

struct Probe {
  std::string name;
  double multiply_adds;       // per instruction (or per step)
  int instructions;           // per call of run
  std::function<void()> run;  // one call: `instructions` instructions (or steps)
  std::vector<double> ns;
};

constexpr int kIterations = 20000;

// The second of two calls back to back: on the AMX Xeon, tile products timed straight after the vector
// probes' loops took 16.5 ns each, against 7.0 in a second call.
double ns_per_instruction(const Probe& p) {
  p.run();
  const auto start = std::chrono::steady_clock::now();
  p.run();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return seconds * 1e9 / p.instructions;
}

// Twelve independent chains of one vector op: enough to cover a 4-cycle latency on two pipes.
#define TWELVE_CHAINS(TYPE, ZERO, STEP)                                                             \
  [] {                                                                                              \
    TYPE a0 = ZERO, a1 = ZERO, a2 = ZERO, a3 = ZERO, a4 = ZERO, a5 = ZERO, a6 = ZERO, a7 = ZERO,    \
         a8 = ZERO, a9 = ZERO, a10 = ZERO, a11 = ZERO;                                              \
    for (int i = 0; i < kIterations; ++i) {                                                         \
      a0 = STEP(a0), a1 = STEP(a1), a2 = STEP(a2), a3 = STEP(a3), a4 = STEP(a4), a5 = STEP(a5);     \
      a6 = STEP(a6), a7 = STEP(a7), a8 = STEP(a8), a9 = STEP(a9), a10 = STEP(a10), a11 = STEP(a11); \
      asm volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6),      \
                   "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));                             \
    }                                                                                               \
  }

#if defined(__AVX2__) && defined(__FMA__)
__m256 fma_ymm(__m256 a) { return _mm256_fmadd_ps(a, _mm256_set1_ps(0.999f), _mm256_set1_ps(1e-3f)); }
#endif
#if defined(__AVX512F__)
__m512 fma_zmm(__m512 a) { return _mm512_fmadd_ps(a, _mm512_set1_ps(0.999f), _mm512_set1_ps(1e-3f)); }
#endif
#if defined(__AVX512BF16__)
__m512 dpbf16_zmm(__m512 a) {
  return _mm512_dpbf16_ps(a, (__m512bh)_mm512_set1_epi16(0x3f80), (__m512bh)_mm512_set1_epi16(0x3a83));
}
#endif

#if defined(MLA_INDUCTOR_AMX)  // amx_tiles.h, included by instruction_rates.py
// Tiles 0-3 accumulators (rows x 4 * n bytes, zeroed), 4 and 7 A operands (rows x 64), 5 and 6 B
// operands (16 x 4 * n), which each probe loads: the shapes a decode kernel configures for `rows` cache
// rows (or heads) and n heads (or columns). Through the kernels' own configure_tiles.
void configure(int rows, int n) {
  const uint8_t r = static_cast<uint8_t>(rows);
  const uint16_t acc = static_cast<uint16_t>(4 * n);
  mla_inductor::configure_tiles({r, r, r, r, r, 16, 16, r}, {acc, acc, acc, acc, 64, acc, acc, 64});
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// 8 tiles of 16 x 64 bytes, L1-resident: bf16 values in [-0.5, 0.5), as a cache's. (A product of zero
// tiles takes a fifth less time than one of such values on the AMX Xeon.)
alignas(64) uint16_t operands[8 * 16 * 32];

void fill_operands() {
  uint64_t x = 0x9e3779b97f4a7c15ull;
  for (uint16_t& v : operands) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    const float f = static_cast<float>(x >> 40) / float(1 << 24) - 0.5f;
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    v = static_cast<uint16_t>(bits >> 16);
  }
}

// Four independent accumulators on resident operands: the product's throughput.
void tile_products(int rows, int n) {
  configure(rows, n);
  const char* t = reinterpret_cast<const char*>(operands);
  _tile_loadd(4, t, 64);
  _tile_loadd(5, t + 1024, 4 * n);
  _tile_loadd(6, t + 2048, 4 * n);
  _tile_loadd(7, t + 3072, 64);
  for (int i = 0; i < kIterations / 4; ++i) {
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    _tile_dpbf16ps(2, 7, 5);
    _tile_dpbf16ps(3, 7, 6);
  }
}
#endif

std::vector<Probe> probes() {
  std::vector<Probe> p;
#if defined(__AVX2__) && defined(__FMA__)
  p.push_back({"fma ymm (fp32)", 8, 12 * kIterations, TWELVE_CHAINS(__m256, _mm256_setzero_ps(), fma_ymm), {}});
#endif
#if defined(__AVX512F__)
  p.push_back({"fma zmm (fp32)", 16, 12 * kIterations, TWELVE_CHAINS(__m512, _mm512_setzero_ps(), fma_zmm), {}});
#endif
#if defined(__AVX512BF16__)
  p.push_back({"vdpbf16ps zmm", 32, 12 * kIterations, TWELVE_CHAINS(__m512, _mm512_setzero_ps(), dpbf16_zmm), {}});
#endif
#if defined(MLA_INDUCTOR_AMX)
  fill_operands();
  for (int rows : {16, 11, 4})
    p.push_back({"tdpbf16ps " + std::to_string(rows) + " x 16", 32.0 * rows * 16, kIterations,
                 [rows] { tile_products(rows, 16); }, {}});
  p.push_back({"tdpbf16ps 16 x 4", 32.0 * 16 * 4, kIterations, [] { tile_products(16, 4); }, {}});
  p.push_back({"tileloadd 16 x 64 B (L1)", 0, 3 * kIterations, [] {
                 configure(16, 16);
                 const char* t = reinterpret_cast<const char*>(operands);
                 for (int i = 0; i < kIterations; ++i) {
                   _tile_loadd(4, t, 64);
                   _tile_loadd(5, t + 1024, 64);
                   _tile_loadd(6, t + 2048, 64);
                 }
               }, {}});
  // the latent score step: an A tile of rows and two B tiles of the query loaded, two products
  p.push_back({"score step: 3 loads, 2 tdpbf16ps", 2 * 32.0 * 16 * 16, kIterations, [] {
                 configure(16, 16);
                 const char* t = reinterpret_cast<const char*>(operands);
                 for (int i = 0; i < kIterations; ++i) {
                   _tile_loadd(4, t, 64);
                   _tile_loadd(5, t + 1024, 64);
                   _tile_dpbf16ps(0, 4, 5);
                   _tile_loadd(6, t + 2048, 64);
                   _tile_dpbf16ps(1, 4, 6);
                 }
               }, {}});
#endif
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 31;
#if defined(MLA_INDUCTOR_AMX)
  mla_inductor::require_amx_permission();
#endif
  std::vector<Probe> all = probes();
  for (int r = 0; r < rounds; ++r)
    for (Probe& p : all) p.ns.push_back(ns_per_instruction(p));
#if defined(MLA_INDUCTOR_AMX)
  _tile_release();
#endif
  for (Probe& p : all) {
    std::sort(p.ns.begin(), p.ns.end());
    std::printf("%s\t%.4f\t%.4f\t%.0f\n", p.name.c_str(), p.ns[p.ns.size() / 2], p.ns.front(), p.multiply_adds);
  }
}
