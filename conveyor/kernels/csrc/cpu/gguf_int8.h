// What the two int8-activation linears share (gguf_int8_cpu.cpp for AVX512-VNNI, gguf_int8_avx2_cpu.cpp for AVX2):
// the op's checks of kernels/gguf.py prepare_int8's layout, the activations' int8 copy, and the loop over passes of
// output features and tiles of rows. Each kernel brings its SIMD width, its activation quantizer and its register
// tile. cpu_ext.py folds the headers into the build flags, so an edit rebuilds both.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_blocks.h"
#include "parallel_passes.h"

namespace conveyor_int8 {

using conveyor_gguf::kBlock;
constexpr int kGroups = conveyor_gguf::kPassGroups;  // gguf_prepare's groups of SIMD-width features a pass
constexpr int kQuads = kBlock / 4;
// Rows per sweep over a thread's passes, so that their int8 activations stay in L1/L2 while each pass's quants are
// read again: 48 against all rows at once, SmolLM2's layer linears at 256-512 rows (Zen 4): 570-593 / 537-564 GOP/s.
constexpr int64_t kChunkRows = 48;
// The op's schema, one for both kernels (each file registers it where it is the one compiled).
constexpr const char* kSchema =
    "gguf_linear_int8(Tensor x, Tensor u, Tensor dm, int ggml_type, int out_features) -> Tensor";

// The activations rounded to int8 a block of 32 at a time: a [M, K], and per block its scale dx, the sum of its
// int8s ia, and sa = dx * ia.
struct Activations {
  const int8_t* a;
  const float* dx;
  const int32_t* ia;
  const float* sa;
  int64_t in_features, num_blocks;
};

// Passes [p_begin, p_end), every row tile over each, kChunkRows rows at a time. tile(rows, u, group_u, dm,
// group_dm, r0, out, out_stride) computes out[r0 .. r0 + rows, 0 .. Lanes * kGroups) for one pass. A pass past the
// last feature (the weight is padded with zero groups) is computed into scratch and only its real features copied.
template <int Lanes, int TileRows, class Tile>
void int8_passes(const uint8_t* u, const float* dm, const Activations& x, int64_t num_rows, float* out,
                 int64_t out_features, int64_t p_begin, int64_t p_end, Tile tile) {
  constexpr int64_t kPassFeatures = kGroups * Lanes;
  const int64_t group_u = x.num_blocks * kBlock * Lanes, group_dm = x.num_blocks * 2 * Lanes;
  float scratch[TileRows * kPassFeatures];
  for (int64_t c0 = 0; c0 < num_rows; c0 += kChunkRows) {
    const int64_t c1 = std::min(num_rows, c0 + kChunkRows);
    for (int64_t p = p_begin; p < p_end; ++p) {
      const int64_t n0 = p * kPassFeatures;
      const bool partial = n0 + kPassFeatures > out_features;
      for (int64_t r0 = c0; r0 < c1; r0 += TileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(TileRows, c1 - r0));
        float* dst = partial ? scratch : out + r0 * out_features + n0;
        tile(rows, u + p * kGroups * group_u, group_u, dm + p * kGroups * group_dm, group_dm, r0, dst,
             partial ? kPassFeatures : out_features);
        for (int r = 0; partial && r < rows; ++r)
          std::memcpy(out + (r0 + r) * out_features + n0, scratch + r * kPassFeatures,
                      (out_features - n0) * sizeof(float));
      }
    }
  }
}

// The op: checks x, u [groups, K / 32, 8, Lanes, 4] and dm [groups, K / 32, 2, Lanes] against each other, rounds
// x to int8 with quantize(x, rows, K, a, dx, ia, sa), then runs passes(acts, num_rows, out, begin, end) over the
// passes in parallel.
template <int Lanes, class Quantize, class Passes>
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& u, const at::Tensor& dm, int64_t out_features,
                       Quantize quantize, Passes passes) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "gguf_linear_int8: x must be float32 [M, K]");
  const int64_t in_features = x.size(1), num_blocks = in_features / kBlock;
  TORCH_CHECK(in_features % kBlock == 0, "gguf_linear_int8: K must be a multiple of 32, got ", in_features);
  const int64_t num_passes = (out_features + kGroups * Lanes - 1) / (kGroups * Lanes);
  TORCH_CHECK(u.scalar_type() == at::kByte && u.is_contiguous() && u.dim() == 5 &&
                  u.size(0) == num_passes * kGroups && u.size(1) == num_blocks && u.size(2) == kQuads &&
                  u.size(3) == Lanes && u.size(4) == 4,
              "gguf_linear_int8: u is ", u.sizes(), ", expected [", num_passes * kGroups, ", ", num_blocks, ", ",
              kQuads, ", ", Lanes, ", 4] from kernels.gguf.prepare_int8");
  TORCH_CHECK(dm.scalar_type() == at::kFloat && dm.is_contiguous() && dm.dim() == 4 &&
                  dm.size(0) == num_passes * kGroups && dm.size(1) == num_blocks && dm.size(2) == 2 &&
                  dm.size(3) == Lanes,
              "gguf_linear_int8: dm is ", dm.sizes(), ", expected from kernels.gguf.prepare_int8");
  const at::Tensor xc = x.contiguous();
  const int64_t num_rows = xc.size(0);
  at::Tensor out = at::empty({num_rows, out_features}, x.options());
  if (num_rows == 0) return out;
  std::vector<int8_t> a(num_rows * in_features);
  std::vector<float> dx(num_rows * num_blocks), sa(num_rows * num_blocks);
  std::vector<int32_t> ia(num_rows * num_blocks);
  at::parallel_for(0, num_rows, 16, [&](int64_t begin, int64_t end) {
    quantize(xc.data_ptr<float>() + begin * in_features, end - begin, in_features, a.data() + begin * in_features,
             dx.data() + begin * num_blocks, ia.data() + begin * num_blocks, sa.data() + begin * num_blocks);
  });
  const Activations acts{a.data(), dx.data(), ia.data(), sa.data(), in_features, num_blocks};
  float* op = out.data_ptr<float>();
  conveyor_cpu::parallel_passes(num_passes, [&](int64_t p) { passes(acts, num_rows, op, p, p + 1); });
  return out;
}

}  // namespace conveyor_int8
