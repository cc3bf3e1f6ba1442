// y = x @ W^T with W from a GGUF block format (Q4_1 or Q8_0), x float32: the small-batch linear of CPU decode.
//
// Why: a decode step of a few rows does 2 FLOP per weight it reads, so fp32 weights make it memory-bound. The
// GGUF file holds each weight in 4 (Q4_1) or 8 (Q8_0) bits with a scale (and Q4_1 a minimum) per 32 weights.
// Each weight is expanded to float32 in registers (w = q * d + m, exactly the value the dequantized checkpoint
// holds, rounded once by the FMA) and multiplied with float32 activations, so the result differs from the
// dequantized fp32 GEMM only by summation order: no activation quantization (llama.cpp's Q8_1 trick).
//
// Layout: gguf_prepare re-lays GGUF's rows of blocks out once, at load time, in groups of kLanes output features:
//   q      uint8 [groups, K / 32 * quant rows, kLanes]: per block of 32 inputs, the block's quant bytes of every
//          feature of the group side by side (Q4_1: 16 bytes, inputs j and 16 + j in the low and high nibble of
//          byte j, as GGUF has them; Q8_0: 32 int8);
//   scales float16 [groups, K / 32, 2, kLanes]: per block, GGUF's d then m (Q8_0: m = 0).
// The bytes are GGUF's own, so a step reads as much as over the file's layout. A SIMD vector holds kLanes
// different output features: one load, a widening and two conversions expand the weights of two inputs, and
// every activation row uses them with one FMA each. Nothing is reduced across lanes, each broadcast activation
// feeds kGroups FMAs, and the expansion is shared by up to kRowTile rows. The row layout (gguf_rows_cpu.cpp)
// needed a horizontal sum per row and feature and an expansion per row tile: it runs SmolLM2's linears at ~200
// GFLOP/s from 8 rows up on Zen 5, this one at 300-400. It stays for 1-3 rows (conveyor/kernels/gguf.py), where it is
// ~15% faster.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "gguf_blocks.h"

namespace {

using namespace conveyor_gguf;

// The SIMD level the kernel is written against: a vector V of kLanes floats, and what expands kLanes quants into
// one: widen kLanes bytes to 32-bit lanes (I), take their nibbles, convert to float.
#ifdef CONVEYOR_GGUF_AVX512
struct Simd {
  using V = __m512;
  using I = __m512i;
  static constexpr int kLanes = 16;
  static constexpr int kRowTile = 12;  // 12 x kGroups accumulators + weights, d, m of 32 registers
  static constexpr int kAccumulators = 24;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load_half(const c10::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static V set1(float v) { return _mm512_set1_ps(v); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static I widen(const uint8_t* p, bool is_signed) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return is_signed ? _mm512_cvtepi8_epi32(raw) : _mm512_cvtepu8_epi32(raw);
  }
  static V low_nibbles(I v) { return _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0F))); }
  static V high_nibbles(I v) { return _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)); }
  static V to_float(I v) { return _mm512_cvtepi32_ps(v); }
};
#elif defined(CONVEYOR_GGUF_AVX2)
struct Simd {
  using V = __m256;
  using I = __m256i;
  static constexpr int kLanes = 8;
  static constexpr int kRowTile = 5;  // 5 x kGroups accumulators + weights, d, m of 16 registers
  static constexpr int kAccumulators = 10;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load_half(const c10::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static V set1(float v) { return _mm256_set1_ps(v); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static I widen(const uint8_t* p, bool is_signed) {
    const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return is_signed ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw);
  }
  static V low_nibbles(I v) { return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0x0F))); }
  static V high_nibbles(I v) { return _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)); }
  static V to_float(I v) { return _mm256_cvtepi32_ps(v); }
};
#else
struct Simd {  // portable: the same loops over plain arrays, for builds without AVX2
  static constexpr int kLanes = 8;
  static constexpr int kRowTile = 8;
  static constexpr int kAccumulators = 16;
  struct V {
    float v[kLanes];
  };
  struct I {
    int32_t v[kLanes];
  };
  static V zero() { return V{}; }
  static V load(const float* p) {
    V r;
    std::memcpy(r.v, p, sizeof r.v);
    return r;
  }
  static V load_half(const c10::Half* p) {
    V r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = static_cast<float>(p[i]);
    return r;
  }
  static V set1(float x) {
    V r;
    std::fill(r.v, r.v + kLanes, x);
    return r;
  }
  static V fmadd(V a, V b, V c) {
    for (int i = 0; i < kLanes; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
    return c;
  }
  static V mul(V a, V b) {
    for (int i = 0; i < kLanes; ++i) a.v[i] *= b.v[i];
    return a;
  }
  static V add(V a, V b) {
    for (int i = 0; i < kLanes; ++i) a.v[i] += b.v[i];
    return a;
  }
  static void store(float* p, V v) { std::memcpy(p, v.v, sizeof v.v); }
  static I widen(const uint8_t* p, bool is_signed) {
    I r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = is_signed ? static_cast<int8_t>(p[i]) : p[i];
    return r;
  }
  static V low_nibbles(I v) {
    V r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = static_cast<float>(v.v[i] & 0x0F);
    return r;
  }
  static V high_nibbles(I v) {
    V r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = static_cast<float>(v.v[i] >> 4);
    return r;
  }
  static V to_float(I v) {
    V r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = static_cast<float>(v.v[i]);
    return r;
  }
};
#endif

constexpr int kLanes = Simd::kLanes;
// Feature groups one pass computes: each activation, broadcast once, feeds kGroups FMAs (one broadcast per FMA
// ran at half the FMA rate on Zen 5).
constexpr int kGroups = kPassGroups;
// Independent FMA chains per row and group: few rows need several to hide the FMA latency (a Q4_1 byte feeds
// two dependent FMAs per chain). As many as the accumulator registers allow, of 4, 2 or 1.
constexpr int chains(int rows) {
  return rows * kGroups * 4 <= Simd::kAccumulators ? 4 : rows * kGroups * 2 <= Simd::kAccumulators ? 2 : 1;
}

using V = Simd::V;

// acc[r][g][*] += w[g] * x[r, k] for every row r and group g of the pass.
template <int Rows, int Chains>
inline void accumulate(V (&acc)[Rows][kGroups][Chains], const V (&w)[kGroups], const float* x, int64_t x_stride,
                       int chain) {
  for (int r = 0; r < Rows; ++r) {
    const V xv = Simd::set1(x[r * x_stride]);
    for (int g = 0; g < kGroups; ++g) acc[r][g][chain] = Simd::fmadd(w[g], xv, acc[r][g][chain]);
  }
}

// Block b's scales d and minimums m (Q8_0: m = 0) of every group of the pass.
inline void load_block_scales(const c10::Half* scales, int64_t group_scales, int64_t b, V (&d)[kGroups],
                              V (&m)[kGroups]) {
  for (int g = 0; g < kGroups; ++g) {
    d[g] = Simd::load_half(scales + g * group_scales + b * 2 * kLanes);
    m[g] = Simd::load_half(scales + g * group_scales + (b * 2 + 1) * kLanes);
  }
}

// out[r, 0:kGroups * kLanes] for `Rows` rows and kGroups consecutive feature groups, over all K inputs.
template <int64_t Type, int Rows>
void group_rows(const uint8_t* q, const c10::Half* scales, int64_t group_q, int64_t group_scales,
                int64_t num_blocks, const float* x, int64_t x_stride, float* out, int64_t out_stride) {
  constexpr int kChains = chains(Rows);
  constexpr int64_t kQuantRows = quant_rows_per_block(Type);
  V acc[Rows][kGroups][kChains];
  for (int r = 0; r < Rows; ++r)
    for (int g = 0; g < kGroups; ++g)
      for (int c = 0; c < kChains; ++c) acc[r][g][c] = Simd::zero();
  for (int64_t b = 0; b < num_blocks; ++b) {
    V d[kGroups], m[kGroups];
    load_block_scales(scales, group_scales, b, d, m);
    const uint8_t* qb = q + b * kQuantRows * kLanes;
    const float* xb = x + b * kBlock;
    for (int64_t j = 0; j < kQuantRows; j += kChains) {
      for (int c = 0; c < kChains; ++c) {
        const uint8_t* qj = qb + (j + c) * kLanes;
        if constexpr (Type == kTypeQ4_1) {
          V lo[kGroups], hi[kGroups];
          for (int g = 0; g < kGroups; ++g) {
            const typename Simd::I v = Simd::widen(qj + g * group_q, false);
            lo[g] = Simd::fmadd(Simd::low_nibbles(v), d[g], m[g]);
            hi[g] = Simd::fmadd(Simd::high_nibbles(v), d[g], m[g]);
          }
          accumulate<Rows, kChains>(acc, lo, xb + j + c, x_stride, c);
          accumulate<Rows, kChains>(acc, hi, xb + 16 + j + c, x_stride, c);
        } else {
          V w[kGroups];
          for (int g = 0; g < kGroups; ++g) w[g] = Simd::mul(Simd::to_float(Simd::widen(qj + g * group_q, true)), d[g]);
          accumulate<Rows, kChains>(acc, w, xb + j + c, x_stride, c);
        }
      }
    }
  }
  for (int r = 0; r < Rows; ++r) {
    for (int g = 0; g < kGroups; ++g) {
      V total = acc[r][g][0];
      for (int c = 1; c < kChains; ++c) total = Simd::add(total, acc[r][g][c]);
      Simd::store(out + r * out_stride + g * kLanes, total);
    }
  }
}

template <int64_t Type, int... Rows>
void group_tile(int rows, const uint8_t* q, const c10::Half* scales, int64_t group_q, int64_t group_scales,
                int64_t num_blocks, const float* x, int64_t x_stride, float* out, int64_t out_stride,
                std::integer_sequence<int, Rows...>) {
  // rows in [1, kRowTile]: the instantiation for exactly that many rows.
  ((rows == Rows + 1 ? group_rows<Type, Rows + 1>(q, scales, group_q, group_scales, num_blocks, x, x_stride, out,
                                                 out_stride)
                     : void()),
   ...);
}

// From more rows than one tile of group_rows, a pass's weights are expanded to float32 once, into a per-thread
// scratch w[k][kPassFeatures] (36 KB for SmolLM2's K = 576), and a register-blocked micro-kernel multiplies every
// row tile with it: group_rows re-expands the quants for every tile of kRowTile rows, which at 64 rows cost more
// than the FMAs (AVX2: 72 against 82 GFLOP/s at 32 rows on SmolLM2's linears). The weights are the same floats
// (one FMA of q, d and m, or q * d), summed over k in order.
constexpr int64_t kPassFeatures = kGroups * kLanes;
// Rows per micro-kernel call: kExpandedRows x kGroups accumulators, kGroups weight vectors and a broadcast fit the
// register file (AVX2 16, AVX-512 32).
#ifdef CONVEYOR_GGUF_AVX512
constexpr int kExpandedRows = 12;
#else
constexpr int kExpandedRows = 6;
#endif

// Where the expanded path takes over. Measured only on AVX2 (2-core Zen 3, SmolLM2's 120 layer linears, cold
// weights): equal to group_rows at 16 rows, 1.2x faster at 32 and 1.1-1.2x at 64, slower at 8. AVX-512's
// group_rows keeps 12 rows' accumulators in registers and was not measured against it: it stays there.
#if defined(CONVEYOR_GGUF_AVX2) && !defined(CONVEYOR_GGUF_AVX512)
constexpr int64_t kDefaultExpandMinRows = 16;
#else
constexpr int64_t kDefaultExpandMinRows = std::numeric_limits<int64_t>::max();
#endif

template <int64_t Type>
void expand_pass(const uint8_t* q, const c10::Half* scales, int64_t group_q, int64_t group_scales,
                 int64_t num_blocks, float* w) {
  constexpr int64_t kQuantRows = quant_rows_per_block(Type);
  for (int64_t b = 0; b < num_blocks; ++b) {
    V d[kGroups], m[kGroups];
    load_block_scales(scales, group_scales, b, d, m);
    const uint8_t* qb = q + b * kQuantRows * kLanes;
    float* wb = w + b * kBlock * kPassFeatures;
    for (int64_t j = 0; j < kQuantRows; ++j) {
      for (int g = 0; g < kGroups; ++g) {
        const typename Simd::I v = Simd::widen(qb + j * kLanes + g * group_q, Type == kTypeQ8_0);
        if constexpr (Type == kTypeQ4_1) {
          Simd::store(wb + j * kPassFeatures + g * kLanes, Simd::fmadd(Simd::low_nibbles(v), d[g], m[g]));
          Simd::store(wb + (16 + j) * kPassFeatures + g * kLanes, Simd::fmadd(Simd::high_nibbles(v), d[g], m[g]));
        } else {
          Simd::store(wb + j * kPassFeatures + g * kLanes, Simd::mul(Simd::to_float(v), d[g]));
        }
      }
    }
  }
}

// out[r, 0:kPassFeatures] = x[r, :] . w[:, 0:kPassFeatures] for `Rows` rows.
template <int Rows>
void expanded_rows(const float* w, int64_t in_features, const float* x, int64_t x_stride, float* out,
                   int64_t out_stride) {
  V acc[Rows][kGroups];
  for (int r = 0; r < Rows; ++r)
    for (int g = 0; g < kGroups; ++g) acc[r][g] = Simd::zero();
  for (int64_t k = 0; k < in_features; ++k) {
    V wv[kGroups];
    for (int g = 0; g < kGroups; ++g) wv[g] = Simd::load(w + k * kPassFeatures + g * kLanes);
    for (int r = 0; r < Rows; ++r) {
      const V xv = Simd::set1(x[r * x_stride + k]);
      for (int g = 0; g < kGroups; ++g) acc[r][g] = Simd::fmadd(wv[g], xv, acc[r][g]);
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int g = 0; g < kGroups; ++g) Simd::store(out + r * out_stride + g * kLanes, acc[r][g]);
}

template <int... Rows>
void expanded_tile(int rows, const float* w, int64_t in_features, const float* x, int64_t x_stride, float* out,
                   int64_t out_stride, std::integer_sequence<int, Rows...>) {
  ((rows == Rows + 1 ? expanded_rows<Rows + 1>(w, in_features, x, x_stride, out, out_stride) : void()), ...);
}

// Every row tile of pass p: compute(rows, r0, dst, dst_stride) writes `rows` rows of kPassFeatures outputs. A pass
// that reaches past the last feature (the weight is padded with zero groups) is computed into scratch, and only
// its real features are copied out.
template <int kTileRows, typename Compute>
void for_each_row_tile(int64_t p, int64_t num_rows, float* out, int64_t out_features, Compute&& compute) {
  float scratch[kTileRows * kPassFeatures];
  const int64_t n0 = p * kPassFeatures;
  const bool partial = n0 + kPassFeatures > out_features;
  for (int64_t r0 = 0; r0 < num_rows; r0 += kTileRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kTileRows, num_rows - r0));
    compute(rows, r0, partial ? scratch : out + r0 * out_features + n0, partial ? kPassFeatures : out_features);
    if (partial) {
      for (int r = 0; r < rows; ++r)
        std::memcpy(out + (r0 + r) * out_features + n0, scratch + r * kPassFeatures,
                    (out_features - n0) * sizeof(float));
    }
  }
}

// Passes [p_begin, p_end) of kGroups feature groups each, every row tile over each: a pass's weights (a few tens
// of KB) stay in L1/L2 while all the row tiles use them. `expanded`: each pass is expanded to float32 once and
// the micro-kernel runs over it; else group_rows expands it per row tile.
template <int64_t Type>
void linear_passes(bool expanded, const uint8_t* q, const c10::Half* scales, int64_t in_features, const float* x,
                   int64_t num_rows, float* out, int64_t out_features, int64_t p_begin, int64_t p_end) {
  const int64_t num_blocks = in_features / kBlock;
  const int64_t group_q = num_blocks * quant_rows_per_block(Type) * kLanes, group_scales = num_blocks * 2 * kLanes;
  thread_local std::vector<float> w;
  if (expanded) w.resize(in_features * kPassFeatures);
  for (int64_t p = p_begin; p < p_end; ++p) {
    const uint8_t* pass_q = q + p * kGroups * group_q;
    const c10::Half* pass_scales = scales + p * kGroups * group_scales;
    if (expanded) {
      expand_pass<Type>(pass_q, pass_scales, group_q, group_scales, num_blocks, w.data());
      for_each_row_tile<kExpandedRows>(p, num_rows, out, out_features, [&](int rows, int64_t r0, float* dst,
                                                                           int64_t dst_stride) {
        expanded_tile(rows, w.data(), in_features, x + r0 * in_features, in_features, dst, dst_stride,
                      std::make_integer_sequence<int, kExpandedRows>{});
      });
    } else {
      for_each_row_tile<Simd::kRowTile>(p, num_rows, out, out_features, [&](int rows, int64_t r0, float* dst,
                                                                            int64_t dst_stride) {
        group_tile<Type>(rows, pass_q, pass_scales, group_q, group_scales, num_blocks, x + r0 * in_features,
                         in_features, dst, dst_stride, std::make_integer_sequence<int, Simd::kRowTile>{});
      });
    }
  }
}

int64_t num_passes(int64_t out_features) {
  return (out_features + kGroups * kLanes - 1) / (kGroups * kLanes);
}

void check_type(int64_t ggml_type) {
  TORCH_CHECK(ggml_type == kTypeQ4_1 || ggml_type == kTypeQ8_0, "gguf: unsupported ggml type ", ggml_type,
              " (Q4_1 = 3, Q8_0 = 8)");
}

// GGUF rows of blocks uint8 [N, K / 32 * block bytes] -> (q, scales) in the kernel's layout (see the top).
std::tuple<at::Tensor, at::Tensor> gguf_prepare(const at::Tensor& weight, int64_t ggml_type, int64_t in_features) {
  check_type(ggml_type);
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2, "gguf_prepare: weight must be uint8 [N, bytes]");
  TORCH_CHECK(in_features > 0 && in_features % kBlock == 0, "gguf_prepare: K must be a multiple of 32, got ",
              in_features);
  const int64_t num_blocks = in_features / kBlock;
  const bool q4 = ggml_type == kTypeQ4_1;
  const int64_t block_bytes = q4 ? kQ4_1Bytes : kQ8_0Bytes, quant_rows = quant_rows_per_block(ggml_type);
  TORCH_CHECK(weight.size(1) == num_blocks * block_bytes, "gguf_prepare: weight rows hold ", weight.size(1),
              " bytes, expected ", num_blocks * block_bytes, " for K = ", in_features);
  const at::Tensor w = weight.contiguous();
  const int64_t out_features = w.size(0);
  const int64_t groups = num_passes(out_features) * kGroups;
  at::Tensor q = at::zeros({groups, num_blocks * quant_rows, kLanes}, w.options());
  at::Tensor scales = at::zeros({groups, num_blocks, 2, kLanes}, w.options().dtype(at::kHalf));
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* qp = q.data_ptr<uint8_t>();
  auto* sp = reinterpret_cast<uint16_t*>(scales.data_ptr<at::Half>());
  at::parallel_for(0, out_features, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t g = n / kLanes, lane = n % kLanes;
      for (int64_t b = 0; b < num_blocks; ++b) {
        const uint8_t* block = src + (n * num_blocks + b) * block_bytes;
        uint16_t* s = sp + ((g * num_blocks + b) * 2) * kLanes + lane;
        std::memcpy(s, block, 2);  // d, as GGUF's fp16
        if (q4) std::memcpy(s + kLanes, block + 2, 2);  // m
        const uint8_t* quants = block + (q4 ? 4 : 2);
        uint8_t* qb = qp + (g * num_blocks + b) * quant_rows * kLanes + lane;
        for (int64_t j = 0; j < quant_rows; ++j) qb[j * kLanes] = quants[j];
      }
    }
  });
  return {q, scales};
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t ggml_type,
                       int64_t out_features) {
  check_type(ggml_type);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "gguf_linear: x must be float32 [M, K]");
  const int64_t in_features = x.size(1);
  TORCH_CHECK(in_features % kBlock == 0, "gguf_linear: K must be a multiple of 32, got ", in_features);
  const int64_t groups = num_passes(out_features) * kGroups, num_blocks = in_features / kBlock;
  const int64_t quant_rows = num_blocks * quant_rows_per_block(ggml_type);
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() && q.dim() == 3 && q.size(0) == groups &&
                  q.size(1) == quant_rows && q.size(2) == kLanes,
              "gguf_linear: q is ", q.sizes(), ", expected [", groups, ", ", quant_rows, ", ", kLanes,
              "] from gguf_prepare for K = ", in_features, " and ", out_features, " features");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 4 &&
                  scales.size(0) == groups && scales.size(1) == num_blocks && scales.size(3) == kLanes,
              "gguf_linear: scales is ", scales.sizes(), ", expected [", groups, ", ", num_blocks, ", 2, ", kLanes,
              "] float16");
  const at::Tensor xc = x.contiguous();
  const int64_t num_rows = xc.size(0);
  at::Tensor out = at::empty({num_rows, out_features}, x.options());
  if (num_rows == 0) return out;
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const c10::Half* sp = scales.data_ptr<at::Half>();
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // CONVEYOR_GGUF_EXPAND_MIN_ROWS overrides it, for A/B runs (benchmarks/RESULTS.md has the crossover).
  static const int64_t expand_min_rows = [] {
    const char* env = std::getenv("CONVEYOR_GGUF_EXPAND_MIN_ROWS");
    return env ? std::atoll(env) : kDefaultExpandMinRows;
  }();
  const bool expanded = num_rows >= expand_min_rows;
  at::parallel_for(0, groups / kGroups, 1, [&](int64_t begin, int64_t end) {
    if (ggml_type == kTypeQ4_1) {
      linear_passes<kTypeQ4_1>(expanded, qp, sp, in_features, xp, num_rows, op, out_features, begin, end);
    } else {
      linear_passes<kTypeQ8_0>(expanded, qp, sp, in_features, xp, num_rows, op, out_features, begin, end);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("gguf_prepare(Tensor weight, int ggml_type, int in_features) -> (Tensor, Tensor)");
  m.def("gguf_linear(Tensor x, Tensor q, Tensor scales, int ggml_type, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(conveyor_cpu, CPU, m) {
  m.impl("gguf_prepare", &gguf_prepare);
  m.impl("gguf_linear", &gguf_linear);
}
