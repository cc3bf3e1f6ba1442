// Conveyor CUDA kernels: paged decode attention (split-K / flash-decoding for long contexts) and KV-cache write.
// Plain CUDA with a C ABI so the .cu compiles with `nvcc -c` and no torch headers; binding.cpp wraps it for torch.
//
// Cache layout per layer: [num_blocks, block_size, num_kv_heads, head_dim], contiguous, for K and for V.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum ConveyorDtype { CONVEYOR_FP32 = 0, CONVEYOR_FP16 = 1, CONVEYOR_BF16 = 2 };

// Return codes: 0 success; > 0 a cudaError_t; < 0 one of these.
enum ConveyorStatus {
  CONVEYOR_OK = 0,
  CONVEYOR_ERR_UNSUPPORTED = -1,  // dtype / head_dim combination without a compiled kernel
  CONVEYOR_ERR_ALIGNMENT = -2,    // cache pointers must be 16-byte aligned (vector loads)
  CONVEYOR_ERR_ARGUMENT = -3,     // inconsistent sizes
};

typedef struct {
  void* out;                  // [num_seqs, num_heads, head_dim], strides below
  const void* query;          // [num_seqs, num_heads, head_dim], one token per sequence
  const void* key_cache;      // contiguous [num_blocks, block_size, num_kv_heads, head_dim]
  const void* value_cache;
  const int32_t* block_tables;  // [num_seqs, max_blocks_per_seq]
  const int32_t* seq_lens;      // [num_seqs], context length including this step's token
  // Split-K workspace, used when num_partitions > 1: [num_seqs, num_heads, num_partitions] (x head_dim for out).
  float* tmp_out;
  float* tmp_max;
  float* tmp_sum;
  int num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks_per_seq;
  int64_t q_stride_token, q_stride_head, out_stride_token, out_stride_head;
  // Context positions per partition; num_partitions == 1 means one pass with no reduce kernel.
  int partition_size, num_partitions;
  float scale;
  int dtype;  // ConveyorDtype
  // Sliding window (0: none): the token at seq_len - 1 attends positions [seq_len - sliding_window, seq_len), and
  // partitions start at the first of them, so blocks before the window are never read.
  int sliding_window;
  float soft_cap;  // logit soft-capping (0: none): scores become soft_cap * tanh(scores / soft_cap)
} ConveyorDecodeParams;

// Decode attention for one query token per sequence. Asynchronous on `stream`.
// Partition i of a sequence covers positions [first + i * partition_size, + partition_size) of its context, where
// first = max(0, seq_len - sliding_window) with a window and 0 without.
int conveyor_paged_decode(const ConveyorDecodeParams* params, cudaStream_t stream);

// cache[slot // block_size, slot % block_size] = key[t] for every t with slot_mapping[t] >= 0 (same for value).
int conveyor_write_kv_cache(const void* key, const void* value, void* key_cache, void* value_cache,
                            const int64_t* slot_mapping, int num_tokens, int num_kv_heads, int head_dim,
                            int block_size, int64_t key_stride_token, int64_t key_stride_head,
                            int64_t value_stride_token, int64_t value_stride_head, int dtype,
                            cudaStream_t stream);

// Head dims with a compiled decode kernel for a dtype (16-byte vectors, at most one warp per token).
int conveyor_decode_supports(int dtype, int head_dim);

const char* conveyor_status_string(int status);

#ifdef __cplusplus
}
#endif
