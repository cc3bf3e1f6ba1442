// y = x @ W^T over GGUF's own rows of blocks (Q4_1 or Q8_0), x float32: the linear of the smallest steps (1-2
// rows; see gguf_linear_cpu.cpp for more, and conveyor/kernels/gguf.py for where the two split).
//
// Why: at batch 1 a decode step reads every weight once and does 2 FLOP with it, so its time is the bytes read.
// A Q4_1 weight is 5 bits instead of fp32's 32: the step reads ~5x fewer bytes. Each 32-weight block is expanded
// to float32 in registers (w = q * d + m, exactly the dequantized value the fp32 checkpoint holds, rounded once
// by the FMA) and multiplied with float32 activations, so the result differs from the dequantized fp32 GEMM only
// by summation order: no activation quantization (llama.cpp's Q8_1 trick) and nothing lost against the file.
//
// Layouts are GGUF's own, rows of blocks: Q4_1 = {fp16 d, fp16 m, 16 bytes: element j in the low nibble of
// byte j, element 16 + j in its high nibble}; Q8_0 = {fp16 d, 32 int8}. W [N, K] is uint8 [N, K / 32 * bytes].

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "gguf_blocks.h"

namespace {

using namespace conveyor_gguf;
// Activation rows handled together: each weight block is expanded once and used for this many rows (AVX-512
// has the registers for 8: one accumulator per row, 16 floats wide).
#ifdef CONVEYOR_GGUF_AVX512
constexpr int kRowTile = 8;
#else
constexpr int kRowTile = 4;
#endif
// Output features whose weight rows stay in cache while every row tile uses them (SmolLM2: 16 x 360-960 bytes).
constexpr int64_t kFeatureChunk = 16;
// Output features per parallel task: a few KB of weights, enough to outweigh a thread's wake-up.
constexpr int64_t kGrainFeatures = 32;

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
#ifdef CONVEYOR_GGUF_AVX2
  return _cvtsh_ss(bits);
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

#ifdef CONVEYOR_GGUF_AVX512
// The SIMD level dot_rows is written against: 16 floats a vector here.
struct Simd {
  using V = __m512;
  static constexpr int kLanes = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  // Accumulators per row: few rows leave too few independent FMA chains to hide their latency.
  static constexpr int accumulators(int rows) { return rows <= 2 ? 2 : 1; }
};

// The 32 weights of one block as two vectors of 16 floats: elements 0-15 (low nibbles), 16-31 (high nibbles).
inline void expand_q4_1(const uint8_t* block, __m512 w[2]) {
  const __m512 d = _mm512_set1_ps(half_to_float(block));
  const __m512 m = _mm512_set1_ps(half_to_float(block + 2));
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
  const __m128i mask = _mm_set1_epi8(0x0F);
  w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, mask))), d, m);
  w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), mask))), d,
                         m);
}

inline void expand_q8_0(const uint8_t* block, __m512 w[2]) {
  const __m512 d = _mm512_set1_ps(half_to_float(block));
  for (int i = 0; i < 2; ++i) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2 + 16 * i));
    w[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw)), d);
  }
}
#elif defined(CONVEYOR_GGUF_AVX2)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

struct Simd {
  using V = __m256;
  static constexpr int kLanes = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static float sum(V v) { return hsum(v); }
  // One accumulator per 8-weight group when a single row leaves registers to spare, two per row otherwise.
  static constexpr int accumulators(int rows) { return rows == 1 ? 4 : 2; }
};

// The 32 weights of one block as four vectors of 8 floats.
inline void expand_q4_1(const uint8_t* block, __m256 w[4]) {
  const __m256 d = _mm256_set1_ps(half_to_float(block));
  const __m256 m = _mm256_set1_ps(half_to_float(block + 2));
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(raw, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
  w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), d, m);
  w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), d, m);
  w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), d, m);
  w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), d, m);
}

inline void expand_q8_0(const uint8_t* block, __m256 w[4]) {
  const __m256 d = _mm256_set1_ps(half_to_float(block));
  for (int i = 0; i < 4; ++i) {
    const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + 8 * i));
    w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), d);
  }
}
#endif

#ifdef CONVEYOR_GGUF_AVX2
// out[r, n] for the rows of one tile: each block is expanded once and multiplied with every row's activations.
template <int64_t Type, int Rows>
void dot_rows(const uint8_t* weight_row, int64_t num_blocks, const float* x, int64_t x_stride, float* out,
              int64_t out_stride) {
  constexpr int64_t bytes = Type == kTypeQ4_1 ? kQ4_1Bytes : kQ8_0Bytes;
  constexpr int kVecs = kBlock / Simd::kLanes;
  constexpr int kAcc = Simd::accumulators(Rows);
  typename Simd::V acc[Rows][kAcc];
  for (int r = 0; r < Rows; ++r)
    for (int a = 0; a < kAcc; ++a) acc[r][a] = Simd::zero();
  typename Simd::V w[kVecs];
  for (int64_t b = 0; b < num_blocks; ++b) {
    if constexpr (Type == kTypeQ4_1) {
      expand_q4_1(weight_row + b * bytes, w);
    } else {
      expand_q8_0(weight_row + b * bytes, w);
    }
    for (int r = 0; r < Rows; ++r) {
      const float* xb = x + r * x_stride + b * kBlock;
      for (int i = 0; i < kVecs; ++i) {
        acc[r][i % kAcc] = Simd::fmadd(w[i], Simd::load(xb + i * Simd::kLanes), acc[r][i % kAcc]);
      }
    }
  }
  for (int r = 0; r < Rows; ++r) {
    typename Simd::V total = acc[r][0];
    for (int a = 1; a < kAcc; ++a) total = Simd::add(total, acc[r][a]);
    out[r * out_stride] = Simd::sum(total);
  }
}
#else
inline void expand_block(int64_t type, const uint8_t* block, float w[kBlock]) {
  const float d = half_to_float(block);
  if (type == kTypeQ4_1) {
    const float m = half_to_float(block + 2);
    for (int j = 0; j < 16; ++j) {
      w[j] = static_cast<float>(block[4 + j] & 0x0F) * d + m;
      w[16 + j] = static_cast<float>(block[4 + j] >> 4) * d + m;
    }
  } else {
    for (int j = 0; j < kBlock; ++j) w[j] = static_cast<float>(static_cast<int8_t>(block[2 + j])) * d;
  }
}

template <int64_t Type, int Rows>
void dot_rows(const uint8_t* weight_row, int64_t num_blocks, const float* x, int64_t x_stride, float* out,
              int64_t out_stride) {
  constexpr int64_t bytes = Type == kTypeQ4_1 ? kQ4_1Bytes : kQ8_0Bytes;
  float acc[Rows] = {};
  float w[kBlock];
  for (int64_t b = 0; b < num_blocks; ++b) {
    expand_block(Type, weight_row + b * bytes, w);
    for (int r = 0; r < Rows; ++r) {
      const float* xb = x + r * x_stride + b * kBlock;
      for (int j = 0; j < kBlock; ++j) acc[r] += w[j] * xb[j];
    }
  }
  for (int r = 0; r < Rows; ++r) out[r * out_stride] = acc[r];
}
#endif

template <int64_t Type, int... Rows>
void dot_tile(int rows, const uint8_t* wr, int64_t num_blocks, const float* x, int64_t x_stride, float* out,
              int64_t out_stride, std::integer_sequence<int, Rows...>) {
  // rows in [1, kRowTile]: the instantiation for exactly that many rows.
  ((rows == Rows + 1 ? dot_rows<Type, Rows + 1>(wr, num_blocks, x, x_stride, out, out_stride) : void()), ...);
}

// A chunk of features at a time, every row tile over it: the chunk's weight rows (a few KB) are read from memory
// once and stay in cache for all the row tiles, and each row tile's activations stay in cache for the chunk.
template <int64_t Type>
void linear_rows(const uint8_t* weight, int64_t row_bytes, int64_t num_blocks, const float* x, int64_t num_rows,
                 int64_t in_features, float* out, int64_t out_features, int64_t n_begin, int64_t n_end) {
  for (int64_t c0 = n_begin; c0 < n_end; c0 += kFeatureChunk) {
    const int64_t c1 = std::min(n_end, c0 + kFeatureChunk);
    for (int64_t r0 = 0; r0 < num_rows; r0 += kRowTile) {
      const int rows = static_cast<int>(std::min<int64_t>(kRowTile, num_rows - r0));
      for (int64_t n = c0; n < c1; ++n) {
        dot_tile<Type>(rows, weight + n * row_bytes, num_blocks, x + r0 * in_features, in_features,
                       out + r0 * out_features + n, out_features, std::make_integer_sequence<int, kRowTile>{});
      }
    }
  }
}

at::Tensor gguf_linear_rows(const at::Tensor& x, const at::Tensor& weight, int64_t ggml_type, int64_t out_features) {
  TORCH_CHECK(ggml_type == kTypeQ4_1 || ggml_type == kTypeQ8_0, "gguf_linear_rows: unsupported ggml type ", ggml_type,
              " (Q4_1 = 3, Q8_0 = 8)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "gguf_linear_rows: x must be float32 [M, K]");
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.is_contiguous(),
              "gguf_linear_rows: weight must be contiguous uint8 [N, K / 32 * block bytes]");
  const int64_t in_features = x.size(1);
  TORCH_CHECK(in_features % kBlock == 0, "gguf_linear_rows: K must be a multiple of 32, got ", in_features);
  const int64_t num_blocks = in_features / kBlock;
  const int64_t row_bytes = num_blocks * (ggml_type == kTypeQ4_1 ? kQ4_1Bytes : kQ8_0Bytes);
  TORCH_CHECK(weight.size(0) == out_features && weight.size(1) == row_bytes, "gguf_linear_rows: weight is ",
              weight.sizes(), ", expected [", out_features, ", ", row_bytes, "] for K = ", in_features);
  const at::Tensor xc = x.contiguous();
  const int64_t num_rows = xc.size(0);
  at::Tensor out = at::empty({num_rows, out_features}, x.options());
  if (num_rows == 0) return out;
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, out_features, kGrainFeatures, [&](int64_t begin, int64_t end) {
    if (ggml_type == kTypeQ4_1) {
      linear_rows<kTypeQ4_1>(w, row_bytes, num_blocks, xp, num_rows, in_features, op, out_features, begin, end);
    } else {
      linear_rows<kTypeQ8_0>(w, row_bytes, num_blocks, xp, num_rows, in_features, op, out_features, begin, end);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("gguf_linear_rows(Tensor x, Tensor weight, int ggml_type, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(conveyor_cpu, CPU, m) {
  m.impl("gguf_linear_rows", &gguf_linear_rows);
}
