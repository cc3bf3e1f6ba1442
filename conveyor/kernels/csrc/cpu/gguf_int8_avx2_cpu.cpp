// The int8-activation linear of gguf_int8_cpu.cpp (same op, same layout, same arithmetic) for CPUs with AVX2 but
// without AVX512-VNNI (Zen 3, Haswell to Skylake client).
//
// Why: on such a CPU oneDNN's fp32 GEMM is the prefill's limit (16 multiply-adds a cycle a core at best), while
// vpmaddubsw multiplies 32 unsigned weight quants by 32 int8 activations a cycle in pairs. Its int16 pair sums
// saturate past 32767, so the kernel has two paths, picked by the weight's largest quant (gguf_blocks.h
// max_int8_quant of its type):
// - 4-bit quants (Q4_1, at most 15 <= 16): a pair sum is at most 2 * 16 * 127, so the int16 sums of a block's eight
//   quads add up in int16 without overflow (8 * 4064 < 32767) and are widened to int32 once a block (vpmaddwd);
// - 8-bit quants (Q8_0: u = q + 128 <= 255): llama.cpp's sign trick on q = u - 128, |q| times a with q's sign
//   (pairs <= 2 * 128 * 127), widened every quad; sum(u * a) = sum(q * a) + 128 * sum(a), in int32, exact.
// Both give the int32 sum(u * a) of each block exactly, so the result is the VNNI kernel's bit for bit.
//
// Layout (kernels/gguf.py prepare_int8 over gguf_prepare's AVX2 layout): u uint8 [groups, K / 32, 8, 8, 4], dm
// float32 [groups, K / 32, 2, 8]; a pass is 2 groups of 8 features (one ymm each). Register tile: 3 rows x 2 groups
// of int accumulators, float accumulators in a small array that stays in L1. Why 3 rows and a 4-quad unroll: with
// 4 rows GCC 12 runs out of the 16 ymm registers and spills an accumulator every quad (fully unrolled, every
// product went through the stack): a standalone copy of the tile on Zen 3, one core, SmolLM2's 576 -> 1536 and
// 1536 -> 576 Q4_1 linears, 240 rows: 57 -> 81-83 and 38 -> 88 GMAC/s (Q8_0's path: 44-46 -> 46-47).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <utility>

#include "gguf_int8.h"

#if defined(CONVEYOR_GGUF_AVX2) && !(defined(CONVEYOR_GGUF_AVX512) && defined(__AVX512VNNI__) && \
                                      defined(__AVX512BW__))
namespace {

using conveyor_int8::Activations;
using conveyor_int8::kBlock;
using conveyor_int8::kGroups;
using conveyor_int8::kQuads;

constexpr int kLanes = 8;
constexpr int64_t kBlockBytes = kBlock * kLanes;
constexpr int kTileRows = 3;
constexpr int64_t kMaxNarrowQuant = 16;

float reduce_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

int32_t reduce_add(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// x float32 [M, K] -> a int8 [M, K]; per block dx (its scale), ia (sum of a) and sa = dx * ia.
void quantize_rows(const float* x, int64_t num_rows, int64_t in_features, int8_t* a, float* dx, int32_t* ia,
                   float* sa) {
  const int64_t num_blocks = in_features / kBlock;
  const __m256 sign_mask = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes packs' per-128-bit interleave
  for (int64_t r = 0; r < num_rows; ++r) {
    for (int64_t b = 0; b < num_blocks; ++b) {
      const float* xb = x + r * in_features + b * kBlock;
      __m256 v[4];
      __m256 vmax = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xb + i * kLanes);
        vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign_mask, v[i]));
      }
      const float amax = reduce_max(vmax);
      const float scale = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inverse)));
      const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + r * in_features + b * kBlock),
                          _mm256_permutevar8x32_epi32(packed, order));
      const int64_t s = r * num_blocks + b;
      dx[s] = scale;
      ia[s] = reduce_add(sum);
      sa[s] = scale * static_cast<float>(ia[s]);
    }
  }
}

// One quad of inputs for a broadcast quad xv: Narrow, int16 pair sums of u * a (w = u), widened by the caller once
// a block; else int32 sums of q * a (w = q = u - 128, abs_q = |q|).
template <bool Narrow>
inline __m256i quad_products(__m256i w, __m256i abs_q, __m256i xv) {
  if constexpr (Narrow) {
    return _mm256_maddubs_epi16(w, xv);
  } else {
    const __m256i pairs = _mm256_maddubs_epi16(abs_q, _mm256_sign_epi8(xv, w));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
  }
}

// out[r, 0:kGroups * kLanes] for `Rows` rows from r0, over one pass's quants u and scales dm.
template <int Rows, bool Narrow>
void int8_rows(const uint8_t* u, int64_t group_u, const float* dm, int64_t group_dm, const Activations& x,
               int64_t r0, float* out, int64_t out_stride) {
  alignas(32) float acc[Rows][kGroups][kLanes] = {};
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(-128);
  for (int64_t b = 0; b < x.num_blocks; ++b) {
    __m256i isum[Rows][kGroups];
    for (int r = 0; r < Rows; ++r)
      for (int g = 0; g < kGroups; ++g) isum[r][g] = _mm256_setzero_si256();
    const uint8_t* ub = u + b * kBlockBytes;
    const int8_t* ab = x.a + r0 * x.in_features + b * kBlock;
#pragma GCC unroll 4
    for (int t = 0; t < kQuads; ++t) {
      __m256i wv[kGroups], abs_q[kGroups];
      for (int g = 0; g < kGroups; ++g) {
        wv[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ub + g * group_u + t * 4 * kLanes));
        if constexpr (!Narrow) {
          wv[g] = _mm256_xor_si256(wv[g], flip);
          abs_q[g] = _mm256_abs_epi8(wv[g]);
        }
      }
      for (int r = 0; r < Rows; ++r) {
        int32_t quad;
        std::memcpy(&quad, ab + r * x.in_features + t * 4, sizeof(quad));
        const __m256i xv = _mm256_set1_epi32(quad);
        for (int g = 0; g < kGroups; ++g) {
          const __m256i p = quad_products<Narrow>(wv[g], abs_q[g], xv);
          isum[r][g] = Narrow ? _mm256_add_epi16(isum[r][g], p) : _mm256_add_epi32(isum[r][g], p);
        }
      }
    }
    for (int g = 0; g < kGroups; ++g) {
      const float* dmb = dm + g * group_dm + b * 2 * kLanes;
      const __m256 d = _mm256_loadu_ps(dmb), m = _mm256_loadu_ps(dmb + kLanes);
      for (int r = 0; r < Rows; ++r) {
        const int64_t s = (r0 + r) * x.num_blocks + b;
        const __m256i exact = Narrow ? _mm256_madd_epi16(isum[r][g], ones)
                                     : _mm256_add_epi32(isum[r][g], _mm256_set1_epi32(128 * x.ia[s]));
        const __m256 scaled = _mm256_mul_ps(d, _mm256_set1_ps(x.dx[s]));
        __m256 sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), scaled, _mm256_load_ps(acc[r][g]));
        _mm256_store_ps(acc[r][g], _mm256_fmadd_ps(m, _mm256_set1_ps(x.sa[s]), sum));
      }
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int g = 0; g < kGroups; ++g) std::memcpy(out + r * out_stride + g * kLanes, acc[r][g], sizeof(acc[r][g]));
}

template <bool Narrow, int... Rows>
void int8_tile(int rows, const uint8_t* u, int64_t group_u, const float* dm, int64_t group_dm, const Activations& x,
               int64_t r0, float* out, int64_t out_stride, std::integer_sequence<int, Rows...>) {
  ((rows == Rows + 1 ? int8_rows<Rows + 1, Narrow>(u, group_u, dm, group_dm, x, r0, out, out_stride) : void()), ...);
}

template <bool Narrow>
void int8_passes(const at::Tensor& u, const at::Tensor& dm, const Activations& acts, int64_t num_rows, float* out,
                 int64_t out_features, int64_t begin, int64_t end) {
  auto tile = [&](int rows, const uint8_t* pu, int64_t group_u, const float* pdm, int64_t group_dm, int64_t r0,
                  float* dst, int64_t stride) {
    int8_tile<Narrow>(rows, pu, group_u, pdm, group_dm, acts, r0, dst, stride,
                      std::make_integer_sequence<int, kTileRows>{});
  };
  conveyor_int8::int8_passes<kLanes, kTileRows>(u.data_ptr<uint8_t>(), dm.data_ptr<float>(), acts, num_rows, out,
                                                out_features, begin, end, tile);
}

at::Tensor gguf_linear_int8(const at::Tensor& x, const at::Tensor& u, const at::Tensor& dm, int64_t ggml_type,
                            int64_t out_features) {
  TORCH_CHECK(ggml_type == conveyor_gguf::kTypeQ4_1 || ggml_type == conveyor_gguf::kTypeQ8_0,
              "gguf_linear_int8: unsupported ggml type ", ggml_type);
  const bool narrow = conveyor_gguf::max_int8_quant(ggml_type) <= kMaxNarrowQuant;
  auto passes = [&](const Activations& acts, int64_t num_rows, float* out, int64_t begin, int64_t end) {
    if (narrow)
      int8_passes<true>(u, dm, acts, num_rows, out, out_features, begin, end);
    else
      int8_passes<false>(u, dm, acts, num_rows, out, out_features, begin, end);
  };
  return conveyor_int8::int8_linear<kLanes>(x, u, dm, out_features, quantize_rows, passes);
}

}  // namespace

// Registered only where it is compiled, and only where gguf_int8_cpu.cpp's VNNI kernel is not.
TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def(conveyor_int8::kSchema);
}

TORCH_LIBRARY_IMPL(conveyor_cpu, CPU, m) {
  m.impl("gguf_linear_int8", &gguf_linear_int8);
}
#endif
