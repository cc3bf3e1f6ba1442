// Thin torch binding over the C launchers in paged_attention.cu: checks, workspace allocation, current stream.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "paged_attention.h"

namespace {

int dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return CONVEYOR_FP32;
    case at::kHalf:
      return CONVEYOR_FP16;
    case at::kBFloat16:
      return CONVEYOR_BF16;
    default:
      TORCH_CHECK(false, "conveyor cuda: unsupported dtype ", t.scalar_type());
  }
}

void check_status(int status) { TORCH_CHECK(status == 0, conveyor_status_string(status)); }

}  // namespace

// out [S, H, D] (written), query [S, H, D]: one decode token per sequence.
void paged_decode(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                  double scale, int64_t partition_size, int64_t num_partitions, int64_t sliding_window,
                  double soft_cap) {
  TORCH_CHECK(query.is_cuda() && key_cache.is_cuda() && value_cache.is_cuda(), "tensors must be on CUDA");
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [S, H, D], caches [N, B, KVH, D]");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && key_cache.scalar_type() ==
              value_cache.scalar_type() && out.scalar_type() == query.scalar_type(), "dtype mismatch");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(block_tables.stride(1) == 1 && seq_lens.is_contiguous(), "index tensors must be contiguous");
  TORCH_CHECK(block_tables.size(0) == query.size(0) && seq_lens.size(0) == query.size(0),
              "one query token per sequence");
  const c10::cuda::CUDAGuard guard(query.device());
  ConveyorDecodeParams p{};
  p.out = out.data_ptr();
  p.query = query.data_ptr();
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.num_seqs = static_cast<int>(query.size(0));
  p.num_heads = static_cast<int>(query.size(1));
  p.head_dim = static_cast<int>(query.size(2));
  p.block_size = static_cast<int>(key_cache.size(1));
  p.num_kv_heads = static_cast<int>(key_cache.size(2));
  p.max_blocks_per_seq = static_cast<int>(block_tables.stride(0));
  p.q_stride_token = query.stride(0);
  p.q_stride_head = query.stride(1);
  p.out_stride_token = out.stride(0);
  p.out_stride_head = out.stride(1);
  p.partition_size = static_cast<int>(partition_size);
  p.num_partitions = static_cast<int>(num_partitions);
  p.scale = static_cast<float>(scale);
  p.dtype = dtype_code(query);
  p.sliding_window = static_cast<int>(sliding_window);
  p.soft_cap = static_cast<float>(soft_cap);
  at::Tensor tmp_out, tmp_max, tmp_sum;
  if (num_partitions > 1) {
    const auto opts = query.options().dtype(at::kFloat);
    tmp_out = at::empty({p.num_seqs, p.num_heads, num_partitions, p.head_dim}, opts);
    tmp_max = at::empty({p.num_seqs, p.num_heads, num_partitions}, opts);
    tmp_sum = at::empty({p.num_seqs, p.num_heads, num_partitions}, opts);
    p.tmp_out = tmp_out.data_ptr<float>();
    p.tmp_max = tmp_max.data_ptr<float>();
    p.tmp_sum = tmp_sum.data_ptr<float>();
  }
  check_status(conveyor_paged_decode(&p, at::cuda::getCurrentCUDAStream()));
}

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
                    const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.is_cuda() && key_cache.is_cuda(), "tensors must be on CUDA");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == value_cache.scalar_type() &&
              key.scalar_type() == value.scalar_type(), "dtype mismatch");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slot_mapping: int64");
  const c10::cuda::CUDAGuard guard(key.device());
  check_status(conveyor_write_kv_cache(
      key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
      slot_mapping.data_ptr<int64_t>(), static_cast<int>(key.size(0)), static_cast<int>(key.size(1)),
      static_cast<int>(key.size(2)), static_cast<int>(key_cache.size(1)), key.stride(0), key.stride(1),
      value.stride(0), value.stride(1), dtype_code(key), at::cuda::getCurrentCUDAStream()));
}

bool decode_supports(const std::string& dtype, int64_t head_dim) {
  const int code = dtype == "float32" ? CONVEYOR_FP32 : dtype == "float16" ? CONVEYOR_FP16 : CONVEYOR_BF16;
  return conveyor_decode_supports(code, static_cast<int>(head_dim)) != 0;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (split-K when num_partitions > 1)");
  m.def("write_kv_cache", &write_kv_cache, "scatter key/value rows into the paged caches");
  m.def("decode_supports", &decode_supports, "whether a dtype/head_dim has a decode kernel");
}
