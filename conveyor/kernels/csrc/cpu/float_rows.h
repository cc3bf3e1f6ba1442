// Helpers the CPU attention kernels share (paged_attention_cpu.cpp, prefill_attention_cpu.cpp). cpu_ext.py folds
// this header's contents into the build flags, so an edit here rebuilds the extension like a source edit does.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <algorithm>

#include <cstdint>
#include <type_traits>
#include <utility>

namespace conveyor_cpu {

// An fp8 KV cache (kv_cache_dtype fp8_e4m3 / fp8_e5m2) holds bytes that widen to fp32 in registers.
template <typename T>
inline constexpr bool is_fp8_v = std::is_same_v<T, c10::Float8_e4m3fn> || std::is_same_v<T, c10::Float8_e5m2>;

// The largest finite value of an fp8 type: cache writes saturate there (c10's e5m2 conversion would give inf).
template <typename T>
inline constexpr float kFp8Max = std::is_same_v<T, c10::Float8_e4m3fn> ? 448.f : 57344.f;

// fp8 bytes widen through fp16's bit pattern, which F16C converts. An e5m2 byte is the top byte of an fp16. An
// e4m3 byte's exponent and mantissa bits land in an fp16's as they are; with the exponent bias 7 against 15 that
// fp16 is 2^-8 times the fp8's value, subnormals included, so the result is scaled by 256. An e4m3 NaN byte would
// read as 480: the cache never holds one, because writes saturate.
//
// Vec::size() fp8 elements at p as fp32 (the portable build converts one at a time).
template <typename T>
inline at::vec::Vectorized<float> load_fp8(const T* p) {
  [[maybe_unused]] constexpr bool e5m2 = std::is_same_v<T, c10::Float8_e5m2>;
#if defined(CPU_CAPABILITY_AVX512)
  __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  if constexpr (e5m2) return _mm512_cvtph_ps(_mm256_slli_epi16(h, 8));
  h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x80)), 8),
                      _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7F)), 7));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
#elif defined(CPU_CAPABILITY_AVX2)
  __m128i h = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  if constexpr (e5m2) return _mm256_cvtph_ps(_mm_slli_epi16(h, 8));
  h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x80)), 8),
                   _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7F)), 7));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
#else
  float tmp[at::vec::Vectorized<float>::size()];
  for (int64_t i = 0; i < at::vec::Vectorized<float>::size(); ++i) tmp[i] = static_cast<float>(p[i]);
  return at::vec::Vectorized<float>::loadu(tmp);
#endif
}

// A cache element from fp32: round to nearest even, and fp8 saturates at its largest finite value.
template <typename TC>
inline TC to_cache(float x) {
  if constexpr (is_fp8_v<TC>) {
    return static_cast<TC>(std::clamp(x, -kFp8Max<TC>, kFp8Max<TC>));
  } else {
    return static_cast<TC>(x);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// 16 floats as fp8 bytes, as to_cache rounds them (to nearest even, saturating), with integer arithmetic on the
// float bits: a normal result keeps the top mantissa bits after adding half a unit (plus one where the kept
// lowest bit is odd, which makes ties go to even) and rebiases the exponent; a subnormal one is the value in
// units of the smallest subnormal, which the conversion to int rounds to nearest even (MXCSR's default).
template <typename TC>
inline __m128i fp8x16_from_floats(__m512 x) {
  constexpr bool e4m3 = std::is_same_v<TC, c10::Float8_e4m3fn>;
  constexpr int kDropped = e4m3 ? 20 : 21;                  // fp32 mantissa bits that fp8 drops
  constexpr int kRebias = e4m3 ? (120 << 3) : (112 << 2);   // (127 - bias) << mantissa bits
  const __m512 min_normal = _mm512_set1_ps(e4m3 ? 0x1p-6f : 0x1p-14f);
  const __m512 per_subnormal = _mm512_set1_ps(e4m3 ? 0x1p9f : 0x1p16f);
  const __m512i bits = _mm512_castps_si512(x);
  const __m512 a = _mm512_min_ps(_mm512_abs_ps(x), _mm512_set1_ps(kFp8Max<TC>));
  const __m512i abits = _mm512_castps_si512(a);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(abits, kDropped), _mm512_set1_epi32(1));
  const __m512i half = _mm512_add_epi32(_mm512_set1_epi32((1 << (kDropped - 1)) - 1), odd);
  const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_add_epi32(abits, half), kDropped),
                                          _mm512_set1_epi32(kRebias));
  const __m512i subnormal = _mm512_cvtps_epi32(_mm512_mul_ps(a, per_subnormal));
  __m512i r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(a, min_normal, _CMP_LT_OQ), normal, subnormal);
  r = _mm512_or_si512(r, _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80)));
  return _mm512_cvtepi32_epi8(r);
}
#endif

// dst[0, n) = to_cache<TC>(src[0, n)): fp32 rows into an fp8 cache go 16 at a time under AVX-512.
template <typename TS, typename TC>
inline void convert_row(const TS* src, TC* dst, int64_t n) {
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (is_fp8_v<TC> && std::is_same_v<TS, float>) {
    for (; i + 16 <= n; i += 16) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), fp8x16_from_floats<TC>(_mm512_loadu_ps(src + i)));
    }
  }
#endif
  for (; i < n; ++i) dst[i] = to_cache<TC>(static_cast<float>(src[i]));
}

// dst[0, n) = float(src[0, n)) * scale; bf16/fp16/fp8 rows convert a vector at a time.
template <typename T>
inline void to_float(const T* src, float* dst, int64_t n, float scale = 1.f) {
  using Vec = at::vec::Vectorized<float>;
  if constexpr (is_fp8_v<T>) {
    int64_t i = 0;
    for (; i + Vec::size() <= n; i += Vec::size()) (load_fp8(src + i) * Vec(scale)).store(dst + i);
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]) * scale;
  } else if constexpr (std::is_same_v<T, float>) {
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

inline bool is_cache_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf || t == at::kFloat8_e4m3fn ||
         t == at::kFloat8_e5m2;
}

// f(Tag<T>{}) for a KV cache dtype t: an attention dtype, or fp8 (e4m3fn, e5m2); the kernels check t beforehand.
template <typename F>
inline void with_cache_dtype(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat8_e4m3fn: return f(Tag<c10::Float8_e4m3fn>{});
    case at::kFloat8_e5m2: return f(Tag<c10::Float8_e5m2>{});
    default: return with_attention_dtype(t, std::forward<F>(f));
  }
}

}  // namespace conveyor_cpu
