// Structured outputs: logits[rows[i], t] = -inf for every token t whose bit is clear in bitmask[i].
//
// bitmask is int32 [num_rows, num_words], bit j of word w standing for token 32 * w + j (the layout llguidance
// and xgrammar fill). A grammar mask is mostly all-ones words (free text) or all-zero words (JSON structure), so
// whole words are skipped or filled, and only mixed words go bit by bit: one pass over the rows' logits, no
// unpacked [rows, vocab] tensor (unpacking in torch cost ~150 us a row at SmolLM2's 49152 tokens).
// Logits past 32 * num_words (a padded vocabulary) are no tokens: they are set to -inf too.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>

namespace {

void mask_row(float* logits, const int32_t* words, int64_t num_words, int64_t vocab) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t covered = std::min<int64_t>(num_words * 32, vocab);
  for (int64_t w = 0; w * 32 < covered; ++w) {
    const uint32_t bits = static_cast<uint32_t>(words[w]);
    if (bits == 0xFFFFFFFFu) continue;
    const int64_t start = w * 32;
    const int64_t end = std::min<int64_t>(start + 32, covered);
    if (bits == 0) {
      for (int64_t t = start; t < end; ++t) logits[t] = kNegInf;
      continue;
    }
    for (int64_t t = start; t < end; ++t) {
      if (!((bits >> (t - start)) & 1u)) logits[t] = kNegInf;
    }
  }
  for (int64_t t = covered; t < vocab; ++t) logits[t] = kNegInf;
}

void apply_token_bitmask(at::Tensor logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "logits must be float32 [N, vocab]");
  TORCH_CHECK(logits.stride(1) == 1, "logits rows must be contiguous");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "bitmask must be contiguous int32 [rows, words]");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(), "rows must be int64 [R]");
  TORCH_CHECK(rows.size(0) == bitmask.size(0), "one bitmask row per masked logits row");
  const int64_t num_rows = rows.size(0), num_words = bitmask.size(1), vocab = logits.size(1);
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_rows; ++i) {
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < logits.size(0), "row index out of range");
  }
  float* base = logits.data_ptr<float>();
  const int32_t* words = bitmask.data_ptr<int32_t>();
  const int64_t row_stride = logits.stride(0);
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      mask_row(base + row_ids[i] * row_stride, words + i * num_words, num_words, vocab);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
}

TORCH_LIBRARY_IMPL(conveyor_cpu, CPU, m) {
  m.impl("apply_token_bitmask", &apply_token_bitmask);
}
