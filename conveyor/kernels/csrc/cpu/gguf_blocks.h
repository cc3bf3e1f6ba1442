// What the GGUF-block linears share (gguf_rows_cpu.cpp, gguf_linear_cpu.cpp, gguf_bf16_cpu.cpp): GGUF's block
// constants, gguf_prepare's layout constants and the SIMD level they compile for. cpu_ext.py folds this header
// into the build flags, so an edit rebuilds them.
#pragma once

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define CONVEYOR_GGUF_AVX2 1
#if defined(__AVX512F__)
#define CONVEYOR_GGUF_AVX512 1
#endif
#endif

namespace conveyor_gguf {

constexpr int64_t kBlock = 32;
constexpr int64_t kQ4_1Bytes = 20;
constexpr int64_t kQ8_0Bytes = 34;
// ggml's type ids, so the Python side can pass what the GGUF file says.
constexpr int64_t kTypeQ4_1 = 3;
constexpr int64_t kTypeQ8_0 = 8;
// gguf_prepare's layout computes this many groups of SIMD-width output features per pass (a pass's features).
constexpr int kPassGroups = 2;
// Quant bytes per input and feature lane in gguf_prepare's layout: Q4_1 keeps GGUF's nibble pairs (inputs j and
// 16 + j of a block in one byte), Q8_0 one int8.
constexpr int64_t quant_rows_per_block(int64_t type) { return type == kTypeQ4_1 ? kBlock / 2 : kBlock; }
// The largest unsigned quant of kernels/gguf.py prepare_int8's layout (Q8_0 as q + 128): what the AVX2 int8 kernel's
// int16 sums must hold.
constexpr int64_t max_int8_quant(int64_t type) { return type == kTypeQ4_1 ? 15 : 255; }

}  // namespace conveyor_gguf
