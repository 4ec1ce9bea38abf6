// One task of the decode-attention kernel (latent_attention.h's attend_split) timed on its own, in ns
// per cache row, for the decisions that an op-level benchmark is too noisy or too coarse to make
// (which product, which widening, which tile). Built and run by benchmarks/attend_split.py, which
// passes the template headers with -include and the shape and types with -D:
//   QUERY_T, CACHE_T   the query's and the cache's element types;
//   HEADS              query heads per cached row (a grouped-query group, or MLA's latent heads);
//   KEY_DIM, VALUE_DIM the key width and the value width;
//   OWN_VALUES         1: values in a cache of their own (grouped-query); 0: the first VALUE_DIM
//                      columns of each key row (MLA's latent rows).
// Arguments: rows, caches (distinct caches taken in turn: 1 keeps one in L2 / L3, enough of them come
// from memory), calls, threads (1: one task per call; 2: eight tasks over two OpenMP threads, as the op
// runs eight key/value heads). Prints the median over the calls.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace mi = mla_inductor;
using T = QUERY_T;
using C = CACHE_T;
constexpr int H = HEADS;
constexpr int64_t D = KEY_DIM, L = VALUE_DIM;
constexpr bool kOwnValues = OWN_VALUES;

// Values in [-0.5, 0.5), from a xorshift: enough for timing, and fast enough to fill a gigabyte. The
// buffers are line-aligned (mi::line_aligned), as PyTorch aligns a tensor's storage: rows that AMX tiles
// load straddling two cache lines would time another kernel than the op runs.
template <typename V>
mi::LineAligned<V> filled(int64_t n, uint64_t seed) {
  mi::LineAligned<V> values = mi::line_aligned<V>(n);
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  for (int64_t i = 0; i < n; ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    values[i] = V(static_cast<float>(x >> 40) / float(1 << 24) - 0.5f);
  }
  return values;
}

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s rows caches calls threads\n", argv[0]);
    return 2;
  }
  const int64_t rows = std::atol(argv[1]), caches = std::atol(argv[2]);
  const int calls = std::atoi(argv[3]), threads = std::atoi(argv[4]);
  const int tasks = threads == 1 ? 1 : 8;
  mi::prepare_attention<T, C, H, L>();
  std::vector<mi::LineAligned<C>> keys, values;
  for (int64_t c = 0; c < caches; ++c) {
    keys.push_back(filled<C>(rows * D, 2 * c));
    if constexpr (kOwnValues) values.push_back(filled<C>(rows * L, 2 * c + 1));
  }
  const mi::LineAligned<T> q = filled<T>(H * D, 12345);
  const std::vector<C> zero_row(std::max(D, L), C(0.f));
  const int64_t one_block = 0;  // a dense cache: each request's rows are one block
  std::vector<float> m(tasks * H), l(tasks * H), o(tasks * H * L);
  std::vector<double> ns_per_row;
  for (int call = 0; call < calls; ++call) {
    const auto start = std::chrono::steady_clock::now();
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int task = 0; task < tasks; ++task) {
      const int64_t c = (int64_t(call) * tasks + task) % caches;
      const mi::RequestRows<C, int64_t> request{keys[c].get(), D, nullptr,
                                                kOwnValues ? values[c].get() : nullptr, L, rows, &one_block};
      std::fill_n(m.data() + task * H, H, -INFINITY);
      std::fill_n(l.data() + task * H, H, 0.f);
      mi::SoftmaxState st{m.data() + task * H, l.data() + task * H, o.data() + task * H * L};
      mi::attend_split<T, C, int64_t, H, D, 0, L>(q.get(), D, request, 0, rows, 0.1f, 0.f,
                                                  static_cast<const bool*>(nullptr), zero_row.data(), st);
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ns_per_row.push_back(seconds * 1e9 * threads / (double(rows) * tasks));
  }
  std::nth_element(ns_per_row.begin(), ns_per_row.begin() + calls / 2, ns_per_row.end());
  std::printf("%.2f\n", ns_per_row[calls / 2]);
}
