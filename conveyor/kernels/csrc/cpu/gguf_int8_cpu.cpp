// y = x @ W^T with int8 activations over the GGUF quants (AVX512-VNNI): the linear of cpu_prefill_dtype=int8.
//
// Why: prefill is most of a CPU server's work and its linears run at the bf16 GEMM's peak (~390 GFLOP/s on a 2-core
// Zen 4); one vpdpbusd does 64 multiply-adds where a vdpbf16ps does 32. The numbers are llama.cpp's for a Q4_1 or
// Q8_0 weight: each activation block of 32 is rounded to int8 with its own scale (dx = max|x| / 127, round to
// nearest even), and the products of those int8s with the weight's own quants are summed exactly in int32, then
// scaled: y = sum over blocks of d * dx * sum(u * a) + m * dx * sum(a), with the weight w = d * u + m (Q8_0:
// u = q + 128, m = -128 d). So the result is the dequantized weight times the int8-rounded activations, up to
// summation order (reference: kernels/gguf.py int8_linear_reference).
//
// Layout (kernels/gguf.py prepare_int8): u uint8 [groups, K / 32, 8, 16, 4], per block eight quads of four
// consecutive inputs, each feature lane's four bytes together (vpdpbusd's lane), and dm float32
// [groups, K / 32, 2, 16] (d, m). Each pass of kGroups x 16 features runs a register-blocked micro-kernel (6 rows x
// 2 groups of int32 and float accumulators) over every row tile.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <utility>

#include "gguf_int8.h"

#if defined(CONVEYOR_GGUF_AVX512) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
namespace {

using conveyor_int8::Activations;
using conveyor_int8::kBlock;
using conveyor_int8::kGroups;
using conveyor_int8::kQuads;

constexpr int kLanes = 16;
constexpr int64_t kBlockBytes = kBlock * kLanes;  // one group's quants of one block
constexpr int kTileRows = 6;  // 6 x kGroups int32 and float accumulators, kGroups weight vectors: 26 registers

// x float32 [M, K] -> a int8 [M, K]; per block dx (its scale), ia (sum of a) and sa = dx * ia.
void quantize_rows(const float* x, int64_t num_rows, int64_t in_features, int8_t* a, float* dx, int32_t* ia,
                   float* sa) {
  const int64_t num_blocks = in_features / kBlock;
  for (int64_t r = 0; r < num_rows; ++r) {
    for (int64_t b = 0; b < num_blocks; ++b) {
      const float* xb = x + r * in_features + b * kBlock;
      const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + kLanes);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const float scale = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
      const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inverse)));
      const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inverse)));
      int8_t* ab = a + r * in_features + b * kBlock;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(ab), _mm512_cvtsepi32_epi8(i0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(ab + kLanes), _mm512_cvtsepi32_epi8(i1));
      const int64_t s = r * num_blocks + b;
      dx[s] = scale;
      ia[s] = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
      sa[s] = scale * static_cast<float>(ia[s]);
    }
  }
}

// out[r, 0:kGroups * kLanes] for `Rows` rows starting at row r0, over one pass's quants u and scales dm.
template <int Rows>
void int8_rows(const uint8_t* u, int64_t group_u, const float* dm, int64_t group_dm, const Activations& x,
               int64_t r0, float* out, int64_t out_stride) {
  __m512 acc[Rows][kGroups];
  for (int r = 0; r < Rows; ++r)
    for (int g = 0; g < kGroups; ++g) acc[r][g] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.num_blocks; ++b) {
    __m512i isum[Rows][kGroups];
    for (int r = 0; r < Rows; ++r)
      for (int g = 0; g < kGroups; ++g) isum[r][g] = _mm512_setzero_si512();
    const uint8_t* ub = u + b * kBlockBytes;
    const int8_t* ab = x.a + r0 * x.in_features + b * kBlock;
    for (int t = 0; t < kQuads; ++t) {
      __m512i wv[kGroups];
      for (int g = 0; g < kGroups; ++g) wv[g] = _mm512_loadu_si512(ub + g * group_u + t * 4 * kLanes);
      for (int r = 0; r < Rows; ++r) {
        int32_t quad;
        std::memcpy(&quad, ab + r * x.in_features + t * 4, sizeof(quad));
        const __m512i xv = _mm512_set1_epi32(quad);
        for (int g = 0; g < kGroups; ++g) isum[r][g] = _mm512_dpbusd_epi32(isum[r][g], wv[g], xv);
      }
    }
    for (int g = 0; g < kGroups; ++g) {
      const float* dmb = dm + g * group_dm + b * 2 * kLanes;
      const __m512 d = _mm512_loadu_ps(dmb), m = _mm512_loadu_ps(dmb + kLanes);
      for (int r = 0; r < Rows; ++r) {
        const int64_t s = (r0 + r) * x.num_blocks + b;
        const __m512 scaled = _mm512_mul_ps(d, _mm512_set1_ps(x.dx[s]));
        acc[r][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][g]), scaled, acc[r][g]);
        acc[r][g] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.sa[s]), acc[r][g]);
      }
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int g = 0; g < kGroups; ++g) _mm512_storeu_ps(out + r * out_stride + g * kLanes, acc[r][g]);
}

template <int... Rows>
void int8_tile(int rows, const uint8_t* u, int64_t group_u, const float* dm, int64_t group_dm, const Activations& x,
               int64_t r0, float* out, int64_t out_stride, std::integer_sequence<int, Rows...>) {
  ((rows == Rows + 1 ? int8_rows<Rows + 1>(u, group_u, dm, group_dm, x, r0, out, out_stride) : void()), ...);
}

// The weight's type matters only to the AVX2 kernel (gguf_int8_avx2_cpu.cpp): vpdpbusd's sums are int32 from the
// first product, and the layout's d and m already carry each type's arithmetic.
at::Tensor gguf_linear_int8(const at::Tensor& x, const at::Tensor& u, const at::Tensor& dm, int64_t /*ggml_type*/,
                            int64_t out_features) {
  auto passes = [&](const Activations& acts, int64_t num_rows, float* out, int64_t begin, int64_t end) {
    auto tile = [&](int rows, const uint8_t* pu, int64_t group_u, const float* pdm, int64_t group_dm, int64_t r0,
                    float* dst, int64_t stride) {
      int8_tile(rows, pu, group_u, pdm, group_dm, acts, r0, dst, stride, std::make_integer_sequence<int, kTileRows>{});
    };
    conveyor_int8::int8_passes<kLanes, kTileRows>(u.data_ptr<uint8_t>(), dm.data_ptr<float>(), acts, num_rows, out,
                                                  out_features, begin, end, tile);
  };
  return conveyor_int8::int8_linear<kLanes>(x, u, dm, out_features, quantize_rows, passes);
}

}  // namespace

// Registered only where it is compiled (AVX512-VNNI); gguf_int8_avx2_cpu.cpp registers the op on AVX2 CPUs without it.
TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def(conveyor_int8::kSchema);
}

TORCH_LIBRARY_IMPL(conveyor_cpu, CPU, m) {
  m.impl("gguf_linear_int8", &gguf_linear_int8);
}
#endif
