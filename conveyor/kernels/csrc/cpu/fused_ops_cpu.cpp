// Fused per-token ops of a Llama layer for CPU: RMSNorm (with the residual add folded in), rotary embedding and
// the MLP's silu-and-mul.
//
// Why: in a decode step these ops touch a few KB per token, so their cost is dispatch, not arithmetic. The
// torch versions take ~7 (norm) and ~10 (rope) aten calls each, ~1 000 calls per SmolLM2 step; one call per
// op here. Math is fp32 whatever the storage dtype, as transformers does for the norm.
//
// Registered as torch ops (torch.ops.conveyor_cpu.*) rather than pybind functions, so this file shares the
// extension with paged_attention_cpu.cpp without touching its module definition.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace {

// Elements per parallel task: below this a thread's wake-up costs more than the work (a decode batch of 16
// SmolLM2 rows runs faster on one thread than split).
constexpr int64_t kGrainElements = 1 << 15;

int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements));
}

template <typename T>
float to_float(T v) {
  return static_cast<float>(v);
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D [tokens, features], got ", t.sizes());
  TORCH_CHECK(t.stride(1) == 1, name, " must have contiguous rows");
}

// Sum of squares with kLanes independent partial sums: a single accumulator is a serial chain of dependent
// adds that the compiler may not reorder (no -ffast-math), ~10x slower than this vectorizable form.
constexpr int64_t kLanes = 16;

template <typename T>
float sum_of_squares(const T* v, int64_t n) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) {
      const float f = to_float(v[i + j]);
      lanes[j] += f * f;
    }
  }
  float total = 0.f;
  for (; i < n; ++i) total += to_float(v[i]) * to_float(v[i]);
  for (int64_t j = 0; j < kLanes; ++j) total += lanes[j];
  return total;
}

// out = weight * (h / rms(h)), h = x (+ residual, stored back to residual when given).
template <typename T>
void norm_row(T* x, T* residual, const T* weight, T* out, int64_t n, float eps) {
  if (residual != nullptr) {
    // Round the sum to the storage dtype, as `x + residual` in torch would.
    for (int64_t i = 0; i < n; ++i) residual[i] = static_cast<T>(to_float(x[i]) + to_float(residual[i]));
  }
  const T* src = residual != nullptr ? residual : x;
  const float inv_rms = 1.f / std::sqrt(sum_of_squares(src, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    // transformers: weight * (h * inv_rms).to(dtype): two roundings for bf16/fp16, none for fp32.
    T normed = static_cast<T>(to_float(src[i]) * inv_rms);
    out[i] = static_cast<T>(to_float(weight[i]) * to_float(normed));
  }
}

template <typename T>
void norm_rows(at::Tensor& x, T* residual, int64_t residual_stride, const at::Tensor& weight, at::Tensor& out,
               double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  T* x_ptr = x.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  const T* w_ptr = weight.data_ptr<T>();
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* res = residual != nullptr ? residual + r * residual_stride : nullptr;
      norm_row<T>(x_ptr + r * x_stride, res, w_ptr, out_ptr + r * out_stride, n, static_cast<float>(eps));
    }
  });
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu(), "x must be on the CPU");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), "weight must be [", x.size(1), "], got ",
              weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight dtype ", weight.scalar_type(),
              " != x dtype ", x.scalar_type());
  TORCH_CHECK(weight.is_contiguous(), "weight must be contiguous");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_norm_args(x, weight);
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor input = x;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    norm_rows<scalar_t>(input, nullptr, 0, weight, out, eps);
  });
  return out;
}

// residual <- x + residual; x <- rms_norm(residual) * weight. Both in place, as vLLM's fused_add_rms_norm.
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  check_norm_args(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes(), "residual ", residual.sizes(), " != x ", x.sizes());
  TORCH_CHECK(residual.scalar_type() == x.scalar_type(), "residual dtype must match x");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_add_rms_norm", [&] {
    norm_rows<scalar_t>(x, residual.data_ptr<scalar_t>(), residual.stride(0), weight, x, eps);
  });
}

// GPT-NeoX (rotate-half) layout: each head's first and second halves are the pair (x1, x2).
template <typename T>
void rope_rows(at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
               int64_t head_dim) {
  const int64_t rows = qk.size(0), half = head_dim / 2, stride = qk.stride(0);
  T* base = qk.data_ptr<T>();
  const float* cos_ptr = cos.data_ptr<float>();
  const float* sin_ptr = sin.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(num_heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cos_ptr + r * half;
      const float* s = sin_ptr + r * half;
      for (int64_t h = 0; h < num_heads; ++h) {
        T* x1 = base + r * stride + h * head_dim;
        T* x2 = x1 + half;
        for (int64_t i = 0; i < half; ++i) {
          const float a = to_float(x1[i]), b = to_float(x2[i]);
          x1[i] = static_cast<T>(a * c[i] - b * s[i]);
          x2[i] = static_cast<T>(b * c[i] + a * s[i]);
        }
      }
    }
  });
}

// Rotates the first num_heads heads of every row of qk [T, >= num_heads * head_dim] in place; cos/sin are
// the rows' float32 tables [T, head_dim / 2] (already indexed by position).
void rotary_embedding_neox(at::Tensor qk, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                           int64_t head_dim) {
  check_rows(qk, "qk");
  TORCH_CHECK(qk.device().is_cpu(), "qk must be on the CPU");
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0, "head_dim must be even, got ", head_dim);
  TORCH_CHECK(num_heads >= 0 && num_heads * head_dim <= qk.size(1), num_heads, " heads of ", head_dim,
              " do not fit rows of ", qk.size(1));
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "cos/sin must be contiguous float32");
    TORCH_CHECK(t->dim() == 2 && t->size(0) == qk.size(0) && t->size(1) == head_dim / 2, "cos/sin must be [",
                qk.size(0), ", ", head_dim / 2, "], got ", t->sizes());
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qk.scalar_type(), "rotary_embedding_neox", [&] {
    rope_rows<scalar_t>(qk, cos, sin, num_heads, head_dim);
  });
}

// out[t] = silu(x[t, :n]) * x[t, n:] for x [T, 2n]: the MLP's activation, one pass where torch's silu and mul
// make two and write the [T, n] silu in between (a 256-token SmolLM2 prefill: ~6 ms of 30 layers).
// silu(g) = g / (1 + exp(-g)) with ATen's vectorized exp, as torch's own CPU silu computes it.
template <typename T>
void silu_and_mul_rows(const at::Tensor& x, at::Tensor& out, int64_t n) {
  using Vec = at::vec::Vectorized<float>;
  const int64_t rows = x.size(0), in_stride = x.stride(0);
  const T* in = x.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(3 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = in + r * in_stride;
      const T* up = gate + n;
      T* o = dst + r * n;
      int64_t i = 0;
      if constexpr (std::is_same_v<T, float>) {
        for (; i + Vec::size() <= n; i += Vec::size()) {
          const Vec g = Vec::loadu(gate + i);
          (g / (Vec(1.f) + g.neg().exp()) * Vec::loadu(up + i)).store(o + i);
        }
      }
      for (; i < n; ++i) {
        const float g = to_float(gate[i]);
        o[i] = static_cast<T>(g / (1.f + std::exp(-g)) * to_float(up[i]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.device().is_cpu(), "x must be on the CPU");
  TORCH_CHECK(x.size(1) % 2 == 0, "x must be [tokens, 2 * n], got ", x.sizes());
  const int64_t n = x.size(1) / 2;
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_rows<scalar_t>(x, out, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(conveyor_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding_neox(Tensor(a!) qk, Tensor cos, Tensor sin, int num_heads, int head_dim) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(conveyor_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotary_embedding_neox", &rotary_embedding_neox);
  m.impl("silu_and_mul", &silu_and_mul);
}
