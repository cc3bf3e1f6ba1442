// Paged decode attention and KV-cache write. See paged_attention.h for the contract.
//
// Decode kernel: one thread block per (sequence, kv head, group chunk, partition). All query heads of the GQA
// group chunk live in registers, so each K/V vector is read from memory once for the whole group. A token's
// head_dim row is split over LANES lanes with one 16-byte load each (coalesced: consecutive lanes read
// consecutive 16 bytes), so a warp covers 32 / LANES tokens per load; several tokens are loaded before any is
// used to keep memory requests in flight. Each lane keeps an fp32 online softmax (max, sum, accumulator) for its
// slice of head_dim; lanes, then warps, are merged at the end. With num_partitions > 1 each block writes a
// normalized partial result plus its (max, sum) and a reduce kernel combines the partitions (flash-decoding).
// A sliding window moves the context's start to its first visible position (partitions count from there), so
// blocks before it are never read; soft-capping maps each score s to soft_cap * tanh(s / soft_cap).
#include "paged_attention.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <math.h>

namespace {

constexpr int kNumWarps = 4;
constexpr int kUnroll = 4;  // tokens loaded per lane before the first is used

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// The first context position a decode over seq_len positions attends.
__device__ __forceinline__ int first_visible(int seq_len, int window) {
  return window > 0 ? max(0, seq_len - window) : 0;
}

// Merge online-softmax state (m2, l2, a2) into (m, l, a). m == -inf means "no tokens seen": its weight is 0,
// written out so that two empty states never compute exp(-inf - -inf) = NaN.
template <int N>
__device__ __forceinline__ void merge_state(float& m, float& l, float (&a)[N], float m2, float l2,
                                            const float (&a2)[N]) {
  const float m_new = fmaxf(m, m2);
  const float w1 = (m == -INFINITY) ? 0.f : expf(m - m_new);
  const float w2 = (m2 == -INFINITY) ? 0.f : expf(m2 - m_new);
  l = l * w1 + l2 * w2;
#pragma unroll
  for (int i = 0; i < N; ++i) a[i] = a[i] * w1 + a2[i] * w2;
  m = m_new;
}

template <typename T, int HEAD_DIM, int G_TILE>
__global__ void __launch_bounds__(kNumWarps * 32)
    paged_decode_kernel(const ConveyorDecodeParams p) {
  constexpr int VEC = 16 / sizeof(T);      // elements per 16-byte load
  constexpr int LANES = HEAD_DIM / VEC;    // lanes sharing one token's row
  constexpr int TOK_PER_WARP = 32 / LANES;
  static_assert(HEAD_DIM % VEC == 0 && LANES >= 1 && LANES <= 32 && 32 % LANES == 0, "bad head_dim");

  const int seq = blockIdx.x;
  const int group = p.num_heads / p.num_kv_heads;
  const int chunks = (group + G_TILE - 1) / G_TILE;
  const int kv_head = blockIdx.y / chunks;
  const int g_first = (blockIdx.y % chunks) * G_TILE;
  const int g_count = min(G_TILE, group - g_first);
  const int head0 = kv_head * group + g_first;  // query head h reads kv head h / group
  const int part = blockIdx.z;

  const int seq_len = p.seq_lens[seq];
  const int start = first_visible(seq_len, p.sliding_window) + part * p.partition_size;
  if (start >= seq_len) return;  // the reduce kernel reads only this sequence's real partitions
  const int end = min(seq_len, start + p.partition_size);

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int sub = lane / LANES;  // which token of the warp's TOK_PER_WARP
  const int dl = lane % LANES;   // which 16-byte slice of head_dim

  // Query slice for each head of the chunk, pre-scaled. Query may be a strided view: plain loads.
  float q[G_TILE][VEC];
  const T* query = static_cast<const T*>(p.query);
#pragma unroll
  for (int g = 0; g < G_TILE; ++g) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      q[g][i] = g < g_count
                    ? to_float(query[seq * p.q_stride_token + (head0 + g) * p.q_stride_head + dl * VEC + i]) *
                          p.scale
                    : 0.f;
    }
  }

  float m[G_TILE], l[G_TILE], acc[G_TILE][VEC];
#pragma unroll
  for (int g = 0; g < G_TILE; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[g][i] = 0.f;
  }

  const T* key_cache = static_cast<const T*>(p.key_cache);
  const T* value_cache = static_cast<const T*>(p.value_cache);
  const int32_t* table = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks_per_seq;
  const int64_t token_stride = static_cast<int64_t>(p.num_kv_heads) * HEAD_DIM;
  const int64_t lane_offset = static_cast<int64_t>(kv_head) * HEAD_DIM + dl * VEC;
  constexpr int kStep = kNumWarps * TOK_PER_WARP;

  // t0 is uniform across the warp, so every lane reaches the shuffles below.
  for (int t0 = start + warp * TOK_PER_WARP; t0 < end; t0 += kStep * kUnroll) {
    uint4 kraw[kUnroll], vraw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int t = t0 + u * kStep + sub;
      if (t < end) {  // positions >= end are never read: stale slots and table columns may hold anything
        const int64_t row = static_cast<int64_t>(table[t / p.block_size]) * p.block_size + t % p.block_size;
        kraw[u] = *reinterpret_cast<const uint4*>(key_cache + row * token_stride + lane_offset);
        vraw[u] = *reinterpret_cast<const uint4*>(value_cache + row * token_stride + lane_offset);
      } else {
        kraw[u] = make_uint4(0, 0, 0, 0);
        vraw[u] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const bool valid = t0 + u * kStep + sub < end;
      const T* kv = reinterpret_cast<const T*>(&kraw[u]);
      const T* vv = reinterpret_cast<const T*>(&vraw[u]);
      float s[G_TILE];
#pragma unroll
      for (int g = 0; g < G_TILE; ++g) {
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < VEC; ++i) dot += q[g][i] * to_float(kv[i]);
        s[g] = dot;
      }
      // Sum the partial dot products over the LANES lanes of this token.
#pragma unroll
      for (int off = LANES / 2; off >= 1; off /= 2) {
#pragma unroll
        for (int g = 0; g < G_TILE; ++g) s[g] += __shfl_xor_sync(0xffffffffu, s[g], off);
      }
      if (p.soft_cap > 0.f) {
#pragma unroll
        for (int g = 0; g < G_TILE; ++g) s[g] = p.soft_cap * tanhf(s[g] / p.soft_cap);
      }
      if (valid) {
#pragma unroll
        for (int g = 0; g < G_TILE; ++g) {
          const float m_new = fmaxf(m[g], s[g]);
          const float alpha = expf(m[g] - m_new);  // m = -inf first: exp(-inf) = 0, m_new is finite
          const float pexp = expf(s[g] - m_new);
          l[g] = l[g] * alpha + pexp;
#pragma unroll
          for (int i = 0; i < VEC; ++i) acc[g][i] = acc[g][i] * alpha + pexp * to_float(vv[i]);
          m[g] = m_new;
        }
      }
    }
  }

  // Merge the TOK_PER_WARP token lanes that hold the same head_dim slice.
#pragma unroll
  for (int off = LANES; off < 32; off *= 2) {
#pragma unroll
    for (int g = 0; g < G_TILE; ++g) {
      float a2[VEC];
#pragma unroll
      for (int i = 0; i < VEC; ++i) a2[i] = __shfl_xor_sync(0xffffffffu, acc[g][i], off);
      const float m2 = __shfl_xor_sync(0xffffffffu, m[g], off);
      const float l2 = __shfl_xor_sync(0xffffffffu, l[g], off);
      merge_state(m[g], l[g], acc[g], m2, l2, a2);
    }
  }

  // Merge warps through shared memory.
  __shared__ float sm_m[kNumWarps][G_TILE];
  __shared__ float sm_l[kNumWarps][G_TILE];
  __shared__ float sm_acc[kNumWarps][G_TILE][HEAD_DIM];
  if (sub == 0) {
#pragma unroll
    for (int g = 0; g < G_TILE; ++g) {
      if (dl == 0) {
        sm_m[warp][g] = m[g];
        sm_l[warp][g] = l[g];
      }
#pragma unroll
      for (int i = 0; i < VEC; ++i) sm_acc[warp][g][dl * VEC + i] = acc[g][i];
    }
  }
  __syncthreads();

  for (int idx = threadIdx.x; idx < g_count * HEAD_DIM; idx += blockDim.x) {
    const int g = idx / HEAD_DIM;
    const int d = idx % HEAD_DIM;
    float mm = -INFINITY;
#pragma unroll
    for (int w = 0; w < kNumWarps; ++w) mm = fmaxf(mm, sm_m[w][g]);
    float ll = 0.f, aa = 0.f;
#pragma unroll
    for (int w = 0; w < kNumWarps; ++w) {
      const float wm = sm_m[w][g];
      const float weight = (wm == -INFINITY) ? 0.f : expf(wm - mm);
      ll += sm_l[w][g] * weight;
      aa += sm_acc[w][g][d] * weight;
    }
    const int head = head0 + g;
    if (p.num_partitions == 1) {
      T* out = static_cast<T*>(p.out);
      out[seq * p.out_stride_token + head * p.out_stride_head + d] = from_float<T>(aa / ll);
    } else {
      const int64_t slot = (static_cast<int64_t>(seq) * p.num_heads + head) * p.num_partitions + part;
      p.tmp_out[slot * HEAD_DIM + d] = ll > 0.f ? aa / ll : 0.f;
      if (d == 0) {
        p.tmp_max[slot] = mm;
        p.tmp_sum[slot] = ll;
      }
    }
  }
}

// One block per (sequence, query head): combine the partitions written by paged_decode_kernel.
// Dynamic shared memory: one float weight per partition.
template <typename T, int HEAD_DIM>
__global__ void paged_decode_reduce_kernel(const ConveyorDecodeParams p) {
  extern __shared__ float weights[];
  __shared__ float total;
  const int seq = blockIdx.x;
  const int head = blockIdx.y;
  const int seq_len = p.seq_lens[seq];
  const int span = seq_len - first_visible(seq_len, p.sliding_window);
  const int parts = (span + p.partition_size - 1) / p.partition_size;  // only partitions that ran
  const int64_t base = (static_cast<int64_t>(seq) * p.num_heads + head) * p.num_partitions;
  if (threadIdx.x == 0) {
    float mm = -INFINITY;
    for (int i = 0; i < parts; ++i) mm = fmaxf(mm, p.tmp_max[base + i]);
    float sum = 0.f;
    for (int i = 0; i < parts; ++i) {
      const float w = p.tmp_sum[base + i] * expf(p.tmp_max[base + i] - mm);
      weights[i] = w;
      sum += w;
    }
    total = sum;
  }
  __syncthreads();
  T* out = static_cast<T*>(p.out);
  for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
    float a = 0.f;
    for (int i = 0; i < parts; ++i) a += weights[i] * p.tmp_out[(base + i) * HEAD_DIM + d];
    out[seq * p.out_stride_token + head * p.out_stride_head + d] = from_float<T>(a / total);
  }
}

template <typename T, int HEAD_DIM, int G_TILE>
int launch_decode(const ConveyorDecodeParams& p, cudaStream_t stream) {
  const int group = p.num_heads / p.num_kv_heads;
  const int chunks = (group + G_TILE - 1) / G_TILE;
  const dim3 grid(p.num_seqs, p.num_kv_heads * chunks, p.num_partitions);
  paged_decode_kernel<T, HEAD_DIM, G_TILE><<<grid, kNumWarps * 32, 0, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return static_cast<int>(err);
  if (p.num_partitions > 1) {
    const dim3 rgrid(p.num_seqs, p.num_heads);
    const int threads = HEAD_DIM < 128 ? HEAD_DIM : 128;
    paged_decode_reduce_kernel<T, HEAD_DIM>
        <<<rgrid, threads, p.num_partitions * sizeof(float), stream>>>(p);
    err = cudaGetLastError();
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  return CONVEYOR_OK;
}

// Smallest compiled group tile that holds the whole group (groups over 8 run in chunks of 8).
template <typename T, int HEAD_DIM>
int dispatch_group(const ConveyorDecodeParams& p, cudaStream_t stream) {
  const int group = p.num_heads / p.num_kv_heads;
  if (group <= 1) return launch_decode<T, HEAD_DIM, 1>(p, stream);
  if (group <= 2) return launch_decode<T, HEAD_DIM, 2>(p, stream);
  if (group <= 4) return launch_decode<T, HEAD_DIM, 4>(p, stream);
  return launch_decode<T, HEAD_DIM, 8>(p, stream);
}

// head_dim values with 16-byte vectors and at most 32 lanes per token for element type T.
template <typename T>
constexpr bool head_dim_ok(int head_dim) {
  return head_dim % (16 / sizeof(T)) == 0 && head_dim / (16 / sizeof(T)) <= 32;
}

template <typename T>
int dispatch_head_dim(const ConveyorDecodeParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 32:
      return dispatch_group<T, 32>(p, stream);
    case 64:
      return dispatch_group<T, 64>(p, stream);
    case 128:
      return dispatch_group<T, 128>(p, stream);
    case 256:
      if constexpr (head_dim_ok<T>(256)) return dispatch_group<T, 256>(p, stream);
      return CONVEYOR_ERR_UNSUPPORTED;
    default:
      return CONVEYOR_ERR_UNSUPPORTED;
  }
}

template <typename T>
__global__ void write_kv_cache_kernel(const T* __restrict__ key, const T* __restrict__ value,
                                      T* __restrict__ key_cache, T* __restrict__ value_cache,
                                      const int64_t* __restrict__ slot_mapping, int num_kv_heads, int head_dim,
                                      int64_t key_stride_token, int64_t key_stride_head,
                                      int64_t value_stride_token, int64_t value_stride_head) {
  const int t = blockIdx.x;
  const int64_t slot = slot_mapping[t];
  if (slot < 0) return;  // padding token
  const int n = num_kv_heads * head_dim;
  // Contiguous cache: slot s starts at s * KVH * D whatever the block size.
  T* kc = key_cache + slot * n;
  T* vc = value_cache + slot * n;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int h = i / head_dim;
    const int d = i % head_dim;
    kc[i] = key[t * key_stride_token + h * key_stride_head + d];
    vc[i] = value[t * value_stride_token + h * value_stride_head + d];
  }
}

template <typename T>
int launch_write(const void* key, const void* value, void* key_cache, void* value_cache,
                 const int64_t* slot_mapping, int num_tokens, int num_kv_heads, int head_dim,
                 int64_t kst, int64_t ksh, int64_t vst, int64_t vsh, cudaStream_t stream) {
  const int n = num_kv_heads * head_dim;
  const int threads = n < 256 ? ((n + 31) / 32) * 32 : 256;
  write_kv_cache_kernel<T><<<num_tokens, threads, 0, stream>>>(
      static_cast<const T*>(key), static_cast<const T*>(value), static_cast<T*>(key_cache),
      static_cast<T*>(value_cache), slot_mapping, num_kv_heads, head_dim, kst, ksh, vst, vsh);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

extern "C" int conveyor_decode_supports(int dtype, int head_dim) {
  if (head_dim != 32 && head_dim != 64 && head_dim != 128 && head_dim != 256) return 0;
  switch (dtype) {
    case CONVEYOR_FP32:
      return head_dim_ok<float>(head_dim);
    case CONVEYOR_FP16:
      return head_dim_ok<__half>(head_dim);
    case CONVEYOR_BF16:
      return head_dim_ok<__nv_bfloat16>(head_dim);
    default:
      return 0;
  }
}

extern "C" int conveyor_paged_decode(const ConveyorDecodeParams* params, cudaStream_t stream) {
  const ConveyorDecodeParams& p = *params;
  if (p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads != 0 || p.block_size <= 0 ||
      p.partition_size <= 0 || p.num_partitions <= 0 || p.sliding_window < 0 || p.soft_cap < 0.f) {
    return CONVEYOR_ERR_ARGUMENT;
  }
  if (p.num_partitions > 1 && (p.tmp_out == nullptr || p.tmp_max == nullptr || p.tmp_sum == nullptr)) {
    return CONVEYOR_ERR_ARGUMENT;
  }
  if (!conveyor_decode_supports(p.dtype, p.head_dim)) return CONVEYOR_ERR_UNSUPPORTED;
  if (reinterpret_cast<uintptr_t>(p.key_cache) % 16 != 0 || reinterpret_cast<uintptr_t>(p.value_cache) % 16 != 0) {
    return CONVEYOR_ERR_ALIGNMENT;
  }
  if (p.num_seqs == 0) return CONVEYOR_OK;
  switch (p.dtype) {
    case CONVEYOR_FP32:
      return dispatch_head_dim<float>(p, stream);
    case CONVEYOR_FP16:
      return dispatch_head_dim<__half>(p, stream);
    case CONVEYOR_BF16:
      return dispatch_head_dim<__nv_bfloat16>(p, stream);
    default:
      return CONVEYOR_ERR_UNSUPPORTED;
  }
}

extern "C" int conveyor_write_kv_cache(const void* key, const void* value, void* key_cache, void* value_cache,
                                       const int64_t* slot_mapping, int num_tokens, int num_kv_heads,
                                       int head_dim, int block_size, int64_t key_stride_token,
                                       int64_t key_stride_head, int64_t value_stride_token,
                                       int64_t value_stride_head, int dtype, cudaStream_t stream) {
  (void)block_size;  // contiguous cache: the slot index alone locates the row
  if (num_tokens == 0) return CONVEYOR_OK;
  if (num_kv_heads <= 0 || head_dim <= 0) return CONVEYOR_ERR_ARGUMENT;
  switch (dtype) {
    case CONVEYOR_FP32:
      return launch_write<float>(key, value, key_cache, value_cache, slot_mapping, num_tokens, num_kv_heads,
                                 head_dim, key_stride_token, key_stride_head, value_stride_token,
                                 value_stride_head, stream);
    case CONVEYOR_FP16:
      return launch_write<__half>(key, value, key_cache, value_cache, slot_mapping, num_tokens, num_kv_heads,
                                  head_dim, key_stride_token, key_stride_head, value_stride_token,
                                  value_stride_head, stream);
    case CONVEYOR_BF16:
      return launch_write<__nv_bfloat16>(key, value, key_cache, value_cache, slot_mapping, num_tokens,
                                         num_kv_heads, head_dim, key_stride_token, key_stride_head,
                                         value_stride_token, value_stride_head, stream);
    default:
      return CONVEYOR_ERR_UNSUPPORTED;
  }
}

extern "C" const char* conveyor_status_string(int status) {
  switch (status) {
    case CONVEYOR_OK:
      return "ok";
    case CONVEYOR_ERR_UNSUPPORTED:
      return "conveyor cuda: unsupported dtype/head_dim (decode needs head_dim in {32,64,128,256}, "
             "16-byte rows, at most 32 lanes per token)";
    case CONVEYOR_ERR_ALIGNMENT:
      return "conveyor cuda: KV cache pointers must be 16-byte aligned";
    case CONVEYOR_ERR_ARGUMENT:
      return "conveyor cuda: inconsistent arguments";
    default:
      return status > 0 ? cudaGetErrorString(static_cast<cudaError_t>(status)) : "conveyor cuda: unknown error";
  }
}
