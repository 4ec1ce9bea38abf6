// Shared by the templates: load up to one vector of T widened to fp32, and round fp32 back to T.
#pragma once
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace mla_inductor {

// `count` (< Vec::size()) loads a partial vector; the remaining lanes are zero.
template <typename T>
inline at::vec::Vectorized<float> load_floats(const T* p, int64_t count = at::vec::Vectorized<float>::size()) {
  using Vec = at::vec::Vectorized<float>;
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p, count);
  } else {
    return at::vec::convert<float>(at::vec::Vectorized<T>::loadu(p, count));
  }
}

// Round `count` fp32 lanes of v to T and store them.
template <typename T>
inline void store_floats(T* p, const at::vec::Vectorized<float>& v,
                         int64_t count = at::vec::Vectorized<float>::size()) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(p, count);
  } else {
    at::vec::convert<T>(v).store(p, count);
  }
}

// Round the n fp32 values of row to T and store them at out.
template <typename T>
inline void store_row(const float* row, int64_t n, T* out) {
  using Vec = at::vec::Vectorized<float>;
  for (int64_t i = 0; i < n; i += Vec::size()) {
    const int64_t count = std::min<int64_t>(Vec::size(), n - i);
    store_floats(out + i, Vec::loadu(row + i, count), count);
  }
}

}  // namespace mla_inductor
