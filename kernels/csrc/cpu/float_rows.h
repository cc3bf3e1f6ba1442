// Helpers the CPU attention kernels share (paged_attention_cpu.cpp, prefill_attention_cpu.cpp). cpu_ext.py folds
// this header's contents into the build flags, so an edit here rebuilds the extension like a source edit does.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <type_traits>

namespace conveyor_cpu {

// dst[0, n) = float(src[0, n)) * scale; bf16/fp16 rows convert a vector at a time.
template <typename T>
inline void to_float(const T* src, float* dst, int64_t n, float scale = 1.f) {
  using Vec = at::vec::Vectorized<float>;
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * scale;
  } else {
    using TVec = at::vec::Vectorized<T>;
    int64_t i = 0;
    for (; i + TVec::size() <= n; i += TVec::size()) {
      auto [lo, hi] = at::vec::convert_to_float<T>(TVec::loadu(src + i));
      (lo * Vec(scale)).store(dst + i);
      (hi * Vec(scale)).store(dst + i + Vec::size());
    }
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]) * scale;
  }
}

template <typename T>
struct Tag {
  using type = T;
};

// f(Tag<T>{}) for the attention dtype t (float32, bfloat16 or float16); the kernels check t beforehand.
template <typename F>
inline void with_attention_dtype(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: return f(Tag<float>{});
    case at::kBFloat16: return f(Tag<at::BFloat16>{});
    case at::kHalf: return f(Tag<at::Half>{});
    default: TORCH_CHECK(false, "unsupported attention dtype ", t);
  }
}

}  // namespace conveyor_cpu
