// y = x @ W^T over gguf_prepare's layout (gguf_linear_cpu.cpp) with bf16 dot products (AVX512-BF16): the linear of
// cpu_prefill_dtype=bfloat16 for decode steps of a few to a few dozen rows.
//
// Why: from ~8 rows the fp32 kernel is bound by its FMAs, not by the weights it reads (SmolLM2's linears at ~146
// GFLOP/s on a 2-core Zen 4), and oneDNN's packed bf16 GEMM is bound by its weights (2 bytes each against Q4_1's
// 0.625: 18 ms at 16 rows). One vdpbf16ps does 32 multiply-adds where an fp32 FMA does 16, over the same quants.
// The numbers are the bf16 mode's: each weight is expanded exactly as in the fp32 kernel (w = q * d + m) and then
// rounded to bf16 (nearest even), each activation rounded to bf16, products summed in fp32 - what the packed bf16
// GEMM of the larger steps computes from the same dequantized weights, up to summation order.
//
// Layout: an input pair is (32b + j, 32b + 16 + j) for block b and j < 16, the two inputs one Q4_1 byte holds.
// Per pass of kPassGroups x 16 features, the weights are expanded once into a per-thread scratch of such pairs
// (uint32: the first input's bf16 in the low half), the activations once per call; then each row tile runs a
// register-blocked micro-kernel over the scratch (12 rows x 2 groups of accumulators).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "gguf_blocks.h"
#include "parallel_passes.h"

#if defined(CONVEYOR_GGUF_AVX512) && defined(__AVX512BF16__)
namespace {

using namespace conveyor_gguf;

constexpr int kLanes = 16;
constexpr int kGroups = kPassGroups;
constexpr int64_t kPassFeatures = kGroups * kLanes;
constexpr int64_t kPairsPerBlock = kBlock / 2;
constexpr int kTileRows = 12;  // 12 x kGroups accumulators, kGroups weight vectors and a broadcast of 32 registers

// Lane f of the result: (bf16(lo[f]), bf16(hi[f])) as one uint32, lo in the low half, both rounded to nearest even.
inline __m512i pair_bf16(__m512 lo, __m512 hi) {
  const __m512i l = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(lo)));
  const __m512i h = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(hi)));
  return _mm512_or_si512(l, _mm512_slli_epi32(h, 16));
}

// x float32 [M, K] -> pairs uint32 [M, K / 2], pair b * 16 + j = (x[32b + j], x[32b + 16 + j]).
void pair_activations(const float* x, int64_t num_rows, int64_t in_features, uint32_t* pairs) {
  const int64_t num_blocks = in_features / kBlock;
  for (int64_t r = 0; r < num_rows; ++r) {
    for (int64_t b = 0; b < num_blocks; ++b) {
      const float* xb = x + r * in_features + b * kBlock;
      _mm512_storeu_si512(pairs + r * (in_features / 2) + b * kPairsPerBlock,
                          pair_bf16(_mm512_loadu_ps(xb), _mm512_loadu_ps(xb + kPairsPerBlock)));
    }
  }
}

// One pass's weights -> scratch w uint32 [K / 2][kPassFeatures] of bf16 pairs.
template <int64_t Type>
void expand_pass(const uint8_t* q, const c10::Half* scales, int64_t group_q, int64_t group_scales,
                 int64_t num_blocks, uint32_t* w) {
  constexpr int64_t kQuantRows = quant_rows_per_block(Type);
  for (int64_t b = 0; b < num_blocks; ++b) {
    for (int g = 0; g < kGroups; ++g) {
      const c10::Half* s = scales + g * group_scales + b * 2 * kLanes;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + kLanes)));
      const uint8_t* qb = q + g * group_q + b * kQuantRows * kLanes;
      for (int64_t j = 0; j < kPairsPerBlock; ++j) {
        __m512 lo, hi;
        if constexpr (Type == kTypeQ4_1) {
          const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + j * kLanes)));
          lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0F))), d, m);
          hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), d, m);
        } else {
          const auto widen = [&](int64_t row) {
            return _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + row * kLanes))));
          };
          lo = _mm512_mul_ps(widen(j), d);
          hi = _mm512_mul_ps(widen(kPairsPerBlock + j), d);
        }
        _mm512_storeu_si512(w + (b * kPairsPerBlock + j) * kPassFeatures + g * kLanes, pair_bf16(lo, hi));
      }
    }
  }
}

// out[r, 0:kPassFeatures] = x[r, :] . w[:, 0:kPassFeatures] for `Rows` rows of activation pairs.
template <int Rows>
void pair_rows(const uint32_t* w, int64_t num_pairs, const uint32_t* x, int64_t x_stride, float* out,
               int64_t out_stride) {
  __m512 acc[Rows][kGroups];
  for (int r = 0; r < Rows; ++r)
    for (int g = 0; g < kGroups; ++g) acc[r][g] = _mm512_setzero_ps();
  for (int64_t p = 0; p < num_pairs; ++p) {
    __m512bh wv[kGroups];
    for (int g = 0; g < kGroups; ++g)
      wv[g] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + p * kPassFeatures + g * kLanes));
    for (int r = 0; r < Rows; ++r) {
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x[r * x_stride + p])));
      for (int g = 0; g < kGroups; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], wv[g], xv);
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int g = 0; g < kGroups; ++g) _mm512_storeu_ps(out + r * out_stride + g * kLanes, acc[r][g]);
}

template <int... Rows>
void pair_tile(int rows, const uint32_t* w, int64_t num_pairs, const uint32_t* x, int64_t x_stride, float* out,
               int64_t out_stride, std::integer_sequence<int, Rows...>) {
  ((rows == Rows + 1 ? pair_rows<Rows + 1>(w, num_pairs, x, x_stride, out, out_stride) : void()), ...);
}

// Passes [p_begin, p_end): each expanded once, then every row tile over it. A pass past the last feature (the
// weight is padded with zero groups) is computed into scratch and only its real features copied out.
template <int64_t Type>
void linear_passes(const uint8_t* q, const c10::Half* scales, int64_t in_features, const uint32_t* x,
                   int64_t num_rows, float* out, int64_t out_features, int64_t p_begin, int64_t p_end) {
  const int64_t num_blocks = in_features / kBlock, num_pairs = in_features / 2;
  const int64_t group_q = num_blocks * quant_rows_per_block(Type) * kLanes;
  const int64_t group_scales = num_blocks * 2 * kLanes;
  thread_local std::vector<uint32_t> w;
  w.resize(num_pairs * kPassFeatures);
  float scratch[kTileRows * kPassFeatures];
  for (int64_t p = p_begin; p < p_end; ++p) {
    expand_pass<Type>(q + p * kGroups * group_q, scales + p * kGroups * group_scales, group_q, group_scales,
                      num_blocks, w.data());
    const int64_t n0 = p * kPassFeatures;
    const bool partial = n0 + kPassFeatures > out_features;
    for (int64_t r0 = 0; r0 < num_rows; r0 += kTileRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kTileRows, num_rows - r0));
      float* dst = partial ? scratch : out + r0 * out_features + n0;
      pair_tile(rows, w.data(), num_pairs, x + r0 * num_pairs, num_pairs, dst, partial ? kPassFeatures : out_features,
                std::make_integer_sequence<int, kTileRows>{});
      for (int r = 0; partial && r < rows; ++r)
        std::memcpy(out + (r0 + r) * out_features + n0, scratch + r * kPassFeatures,
                    (out_features - n0) * sizeof(float));
    }
  }
}

at::Tensor gguf_linear_bf16(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t ggml_type,
                            int64_t out_features) {
  TORCH_CHECK(ggml_type == kTypeQ4_1 || ggml_type == kTypeQ8_0, "gguf_linear_bf16: unsupported ggml type ",
              ggml_type, " (Q4_1 = 3, Q8_0 = 8)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "gguf_linear_bf16: x must be float32 [M, K]");
  const int64_t in_features = x.size(1), num_blocks = in_features / kBlock;
  TORCH_CHECK(in_features % kBlock == 0, "gguf_linear_bf16: K must be a multiple of 32, got ", in_features);
  const int64_t num_passes = (out_features + kPassFeatures - 1) / kPassFeatures;
  const int64_t quant_rows = num_blocks * quant_rows_per_block(ggml_type);
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() && q.dim() == 3 &&
                  q.size(0) == num_passes * kGroups && q.size(1) == quant_rows && q.size(2) == kLanes,
              "gguf_linear_bf16: q is ", q.sizes(), ", expected [", num_passes * kGroups, ", ", quant_rows, ", ",
              kLanes, "] from gguf_prepare");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 4 &&
                  scales.size(0) == num_passes * kGroups && scales.size(1) == num_blocks && scales.size(3) == kLanes,
              "gguf_linear_bf16: scales is ", scales.sizes(), ", expected from gguf_prepare");
  const at::Tensor xc = x.contiguous();
  const int64_t num_rows = xc.size(0);
  at::Tensor out = at::empty({num_rows, out_features}, x.options());
  if (num_rows == 0) return out;
  std::vector<uint32_t> pairs(num_rows * in_features / 2);
  pair_activations(xc.data_ptr<float>(), num_rows, in_features, pairs.data());
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const c10::Half* sp = scales.data_ptr<at::Half>();
  float* op = out.data_ptr<float>();
  conveyor_cpu::parallel_passes(num_passes, [&](int64_t p) {
    if (ggml_type == kTypeQ4_1) {
      linear_passes<kTypeQ4_1>(qp, sp, in_features, pairs.data(), num_rows, op, out_features, p, p + 1);
    } else {
      linear_passes<kTypeQ8_0>(qp, sp, in_features, pairs.data(), num_rows, op, out_features, p, p + 1);
    }
  });
  return out;
}

}  // namespace

// Registered only where it is compiled: torch.ops.conveyor_cpu.gguf_linear_bf16 exists iff the CPU has AVX512-BF16.
TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("gguf_linear_bf16(Tensor x, Tensor q, Tensor scales, int ggml_type, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(conveyor_cpu, CPU, m) {
  m.impl("gguf_linear_bf16", &gguf_linear_bf16);
}
#endif
