// Every decoder layer of a decode step in one call: the CPU counterpart of a captured CUDA graph.
//
// Why: at batch 1-4 a decode step of SmolLM2 runs ~300 kernel calls (10 per layer, 30 layers), each a few tens
// of microseconds, and the Python between them (nn.Module calls, views, splits, the dispatcher's Python entry)
// cost about as much as the kernels that do not read weights: ~9 of a 25 ms batch-1 step on a 2-core Zen 3.
// Here the same kernels run in the same order on the same tensors, called through the dispatcher from C++, so
// the hidden states are bit-identical to the module path (conveyor/serving/models/llama.py) and only the glue is gone.
//
// Scope (the caller checks it, conveyor/serving/models/decode_stack.py): float32, every row a decode (one token per
// sequence, rows in sequence order), every projection in GGUF blocks without a bias, rope rotate-half.
// Per layer, in `weights` (14 tensors): input norm, post-attention norm, then for qkv, o, gate_up, down each the
// GGUF rows of blocks and the interleaved (q, scales) of gguf_prepare, or with int8_activations the int8 kernel's
// (u, dm) of kernels/gguf.py prepare_int8. `ggml_types`: 4 per layer.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace {

constexpr int64_t kTensorsPerLayer = 14;
constexpr int64_t kLinearsPerLayer = 4;

template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// The registered kernels' signatures, exactly as each .cpp registers them.
using LinearRowsFn = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t);
using LinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t);
using RmsNormFn = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using AddRmsNormFn = void(at::Tensor, at::Tensor, const at::Tensor&, double);
using RopeFn = void(at::Tensor, const at::Tensor&, const at::Tensor&, int64_t, int64_t);
using SiluAndMulFn = at::Tensor(const at::Tensor&);
using WriteKvFn = void(const at::Tensor&, const at::Tensor&, at::Tensor, at::Tensor, const at::Tensor&);
using DecodeFn = void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      const at::Tensor&, double, int64_t, double);

// The registered kernels, looked up once.
struct Kernels {
  c10::TypedOperatorHandle<LinearRowsFn> linear_rows = op<LinearRowsFn>("conveyor_cpu::gguf_linear_rows");
  c10::TypedOperatorHandle<LinearFn> linear = op<LinearFn>("conveyor_cpu::gguf_linear");
  c10::TypedOperatorHandle<RmsNormFn> rms_norm = op<RmsNormFn>("conveyor_cpu::rms_norm");
  c10::TypedOperatorHandle<AddRmsNormFn> add_rms_norm = op<AddRmsNormFn>("conveyor_cpu::fused_add_rms_norm");
  c10::TypedOperatorHandle<RopeFn> rope = op<RopeFn>("conveyor_cpu::rotary_embedding_neox");
  c10::TypedOperatorHandle<SiluAndMulFn> silu_and_mul = op<SiluAndMulFn>("conveyor_cpu::silu_and_mul");
  c10::TypedOperatorHandle<WriteKvFn> write_kv = op<WriteKvFn>("conveyor_cpu::write_kv_cache");
  c10::TypedOperatorHandle<DecodeFn> decode = op<DecodeFn>("conveyor_cpu::paged_decode");
};

const Kernels& kernels() {
  static const Kernels k;
  return k;
}

// The bf16-product kernel, registered only where AVX512-BF16 is (gguf_bf16_cpu.cpp): looked up on first use.
const c10::TypedOperatorHandle<LinearFn>& linear_bf16() {
  static const auto handle = op<LinearFn>("conveyor_cpu::gguf_linear_bf16");
  return handle;
}

// The int8-activation kernel, registered where AVX512-VNNI or AVX2 is (gguf_int8_cpu.cpp, gguf_int8_avx2_cpu.cpp):
// looked up on first use.
const c10::TypedOperatorHandle<LinearFn>& linear_int8() {
  static const auto handle = op<LinearFn>("conveyor_cpu::gguf_linear_int8");
  return handle;
}

// What conveyor/serving/models/gguf_weights.py's GGUFLinear does: GGUF's rows of blocks for the smallest steps, the
// int8 kernel for the rest where int8 (w[1], w[2] are then its layout), else the interleaved layout, in bf16 from
// bf16_min_rows (0: never); the same crossovers, passed in.
at::Tensor linear(const Kernels& k, const at::Tensor& x, const at::Tensor* w, int64_t type, int64_t max_rows_kernel,
                  int64_t bf16_min_rows, bool int8) {
  const int64_t out_features = w[0].size(0);
  if (x.size(0) <= max_rows_kernel) return k.linear_rows.call(x, w[0], type, out_features);
  if (int8) return linear_int8().call(x, w[1], w[2], type, out_features);
  if (bf16_min_rows > 0 && x.size(0) >= bf16_min_rows) return linear_bf16().call(x, w[1], w[2], type, out_features);
  return k.linear.call(x, w[1], w[2], type, out_features);
}

at::Tensor decode_layers(at::Tensor x, at::TensorList weights, at::IntArrayRef ggml_types, at::TensorList key_caches,
                         at::TensorList value_caches, const at::Tensor& final_norm, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         double eps, double scale, int64_t rows_max_q4_1, int64_t rows_max_q8_0,
                         int64_t bf16_min_rows, bool int8_activations) {
  const int64_t num_layers = static_cast<int64_t>(key_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == num_layers * kTensorsPerLayer &&
                  static_cast<int64_t>(ggml_types.size()) == num_layers * kLinearsPerLayer &&
                  static_cast<int64_t>(value_caches.size()) == num_layers,
              "decode_layers: ", num_layers, " layers need ", kTensorsPerLayer, " weights, ", kLinearsPerLayer,
              " types and a value cache each; got ", weights.size(), ", ", ggml_types.size(), ", ",
              value_caches.size());
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "decode_layers: x must be contiguous float32 [T, hidden]");
  const int64_t tokens = x.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  TORCH_CHECK(seq_lens.size(0) == tokens, "decode_layers: every row must be a decode (", tokens, " rows, ",
              seq_lens.size(0), " sequences)");
  const Kernels& k = kernels();
  auto max_rows = [&](int64_t type) { return type == 3 ? rows_max_q4_1 : rows_max_q8_0; };
  at::Tensor residual;
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const at::Tensor* w = weights.data() + layer * kTensorsPerLayer;
    const int64_t* types = ggml_types.data() + layer * kLinearsPerLayer;
    if (layer == 0) {
      residual = x;
      x = k.rms_norm.call(x, w[0], eps);
    } else {
      k.add_rms_norm.call(x, residual, w[0], eps);
    }
    const at::Tensor qkv = linear(k, x, w + 2, types[0], max_rows(types[0]), bf16_min_rows, int8_activations);
    k.rope.call(qkv, cos, sin, num_heads + num_kv_heads, head_dim);
    const at::Tensor key = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim});
    const at::Tensor value = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
    k.write_kv.call(key, value, key_caches[layer], value_caches[layer], slot_mapping);
    const at::Tensor query = qkv.narrow(1, 0, q_size).reshape({tokens, num_heads, head_dim}).contiguous();
    at::Tensor attn = at::empty_like(query);
    k.decode.call(attn, query, key_caches[layer], value_caches[layer], block_tables, seq_lens, scale, 0, 0.0);
    x = linear(k, attn.view({tokens, q_size}), w + 5, types[1], max_rows(types[1]), bf16_min_rows,
               int8_activations);
    k.add_rms_norm.call(x, residual, w[1], eps);
    const at::Tensor act =
        k.silu_and_mul.call(linear(k, x, w + 8, types[2], max_rows(types[2]), bf16_min_rows, int8_activations));
    x = linear(k, act, w + 11, types[3], max_rows(types[3]), bf16_min_rows, int8_activations);
  }
  k.add_rms_norm.call(x, residual, final_norm, eps);
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("decode_layers(Tensor x, Tensor[] weights, int[] ggml_types, Tensor[] key_caches, Tensor[] value_caches, "
        "Tensor final_norm, Tensor cos, Tensor sin, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
        "int num_heads, int num_kv_heads, int head_dim, float eps, float scale, int rows_max_q4_1, "
        "int rows_max_q8_0, int bf16_min_rows, bool int8_activations) -> Tensor");
}

TORCH_LIBRARY_IMPL(conveyor_cpu, CPU, m) {
  m.impl("decode_layers", &decode_layers);
}
