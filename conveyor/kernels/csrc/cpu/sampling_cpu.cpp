// Sampling one token per row of float32 logits on CPU: temperature, min_p, top-k, then top-p (on the top-k
// renormalized distribution; a top_p of 0 keeps the top token), drawn by inverse CDF from one uniform per row that
// the caller supplies, so a seeded request's stream stays its own generator's. A temperature that underflows
// float32 is the argmax. The distribution is conveyor/serving/sampler.py's torch path's; the order the draw walks is:
// top-k rows in descending probability (as torch), unfiltered and top-p-only rows in vocabulary order.
//
// Why a kernel: over a 49k vocabulary torch needs a top-k of 256 candidates (4.4 ms for 64 rows on 2 cores), a
// logsumexp and, for flat rows, a full sort; a 64-row step spent 7-10 ms sampling, flat rows 150 ms. Here:
// - unfiltered: a vectorized exp-sum, then an inverse-CDF walk a vector at a time;
// - top-k (k <= 4096): one pass through a min-heap of k that skips vectors which cannot enter it;
// - top-p alone: candidates above a threshold below the row's max, gathered with the exp-sum. Every token below
//   the threshold has a smaller logit than every candidate, so once the candidates hold the top-p mass the rest
//   cannot matter (else the threshold drops and the row is gathered again). A quickselect by mass then finds the
//   nucleus among them without a sort.

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();

// First candidate threshold, in scaled-logit units below the row's max (exp(-8) ~ 3e-4 of the top token); it
// doubles up to kLastGap, past which every kept token is a candidate.
constexpr float kFirstGap = 8.f;
constexpr float kLastGap = 64.f;
// A row whose maximum is not finite (a NaN anywhere, every logit -inf, or a +inf) has no distribution to draw
// from: it gets kNoToken, and the caller ends its request, rather than an id read from an empty candidate list.
constexpr int64_t kNoToken = -1;

// Tokens further below the max than this have probability 0 in float32 (exp(-87) is float's smallest normal):
// they are never kept, which also keeps -inf logits (a grammar's masked tokens) out of every exp.
constexpr float kUnderflowGap = 87.f;

// Candidate order: higher scaled logit first, ties in vocabulary order (a stable descending sort's order, which
// the torch path and the tests use).
inline bool higher(const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

struct RowParams {
  float inv_temperature, top_p, log_min_p;  // log_min_p: -inf when min_p is 0
  int64_t top_k;                            // >= vocab: no top-k
  float u;                                  // uniform in [0, 1)
};

inline Vec vec_max(const Vec& a, const Vec& b) { return at::vec::maximum(a, b); }
inline Vec vec_add(const Vec& a, const Vec& b) { return a + b; }
inline float lane_max(const Vec& v) { return at::vec::vec_reduce_all<float>(vec_max, v); }
inline float lane_sum(const Vec& v) { return at::vec::vec_reduce_all<float>(vec_add, v); }

float row_max(const float* x, int64_t n) { return at::vec::reduce_all<float>(vec_max, x, n); }

// Vectors summed in float before their sum joins the double total: 49k float additions in a row would move a
// quantile by more than a token's width in a flat row.
constexpr int64_t kBlockVecs = 32;

// Sum of exp(x * inv_t - m) over tokens at or above floor_s (scaled), and, when gather, (scaled, id) of every
// token at or above gap_s into out.
double exp_sum(const float* x, int64_t n, float inv_t, float m, float floor_s, float gap_s, bool gather,
               std::vector<std::pair<float, int64_t>>& out) {
  Vec total(0.f);
  double sum = 0.0;
  int64_t i = 0;
  for (int64_t v = 1; i + kVec <= n; i += kVec, ++v) {
    if (v % kBlockVecs == 0) {
      sum += lane_sum(total);
      total = Vec(0.f);
    }
    const Vec s = Vec::loadu(x + i) * Vec(inv_t);
    const Vec kept = s >= Vec(floor_s);  // all-ones lanes where kept
    total = total + (Vec::blendv(Vec(0.f), (s - Vec(m)).exp(), kept));
    if (gather) {
      alignas(64) float lanes[kVec];
      s.store(lanes);
      // Most vectors hold no candidate: one compare of the lane maximum skips them.
      if (lane_max(s) >= gap_s) {
        for (int64_t j = 0; j < kVec; ++j) {
          if (lanes[j] >= gap_s && lanes[j] >= floor_s) out.emplace_back(lanes[j], i + j);
        }
      }
    }
  }
  sum += lane_sum(total);
  for (; i < n; ++i) {
    const float s = x[i] * inv_t;
    if (s < floor_s) continue;
    sum += std::exp(s - m);
    if (gather && s >= gap_s) out.emplace_back(s, i);
  }
  return sum;
}

// The last token whose scaled logit is at least s (the row's max always is): where an inverse-CDF walk ends when
// rounding leaves its target past the kept mass.
int64_t last_at_or_above(const float* x, int64_t n, float inv_t, float s) {
  int64_t j = n - 1;
  while (j > 0 && x[j] * inv_t < s) --j;
  return j;
}

// No top-k or top-p: the inverse CDF over the kept tokens in vocabulary order.
int64_t sample_unfiltered(const float* x, int64_t n, const RowParams& p, float m, float floor_s,
                          std::vector<std::pair<float, int64_t>>& scratch) {
  const double z = exp_sum(x, n, p.inv_temperature, m, floor_s, 0.f, false, scratch);
  const double target = p.u * z * (1.0 - 1e-9);
  double acc = 0.0;
  int64_t i = 0;
  // A vector at a time (the same exp as exp_sum's), into its lanes only where the target falls inside it.
  for (; i + kVec <= n; i += kVec) {
    const Vec s = Vec::loadu(x + i) * Vec(p.inv_temperature);
    const Vec e = Vec::blendv(Vec(0.f), (s - Vec(m)).exp(), s >= Vec(floor_s));
    const float block = lane_sum(e);
    if (block == 0.f) continue;
    if (acc + block <= target) {
      acc += block;
      continue;
    }
    alignas(64) float lanes[kVec];
    e.store(lanes);
    for (int64_t j = 0; j < kVec; ++j) {
      acc += lanes[j];
      if (lanes[j] > 0.f && acc > target) return i + j;
    }
  }
  for (; i < n; ++i) {
    const float s = x[i] * p.inv_temperature;
    if (s < floor_s) continue;
    acc += std::exp(s - m);
    if (acc > target) return i;
  }
  return last_at_or_above(x, n, p.inv_temperature, floor_s);  // rounding left the target past the end
}

// The k highest scaled logits at or above floor_s into out, unsorted: a min-heap of k, and a vector whose
// largest lane does not beat the heap's smallest entry is skipped with one compare (nearly all of them).
void top_k_candidates(const float* x, int64_t n, float inv_t, float floor_s, int64_t k,
                      std::vector<std::pair<float, int64_t>>& out) {
  const auto heap_order = higher;  // the lowest candidate at the front
  out.clear();
  const auto offer = [&](float s, int64_t id) {
    if (s < floor_s) return;
    if (static_cast<int64_t>(out.size()) < k) {
      out.emplace_back(s, id);
      std::push_heap(out.begin(), out.end(), heap_order);
    } else if (s > out.front().first) {  // a tie with the front comes later in the vocabulary: it stays out
      std::pop_heap(out.begin(), out.end(), heap_order);
      out.back() = {s, id};
      std::push_heap(out.begin(), out.end(), heap_order);
    }
  };
  int64_t i = 0;
  for (; i + kVec <= n; i += kVec) {
    const Vec s = Vec::loadu(x + i) * Vec(inv_t);
    if (static_cast<int64_t>(out.size()) == k && lane_max(s) <= out.front().first) {
      continue;
    }
    alignas(64) float lanes[kVec];
    s.store(lanes);
    for (int64_t j = 0; j < kVec; ++j) offer(lanes[j], i + j);
  }
  for (; i < n; ++i) offer(x[i] * inv_t, i);
}

// A row's top-k candidates (exactly the top k, any order), then top-p within them: sorted, and drawn by inverse
// CDF in descending order. The top-k renormalized distribution needs no row-wide sum.
int64_t draw_top_k(const RowParams& p, float m, std::vector<std::pair<float, int64_t>>& cand) {
  if (cand.empty()) return kNoToken;  // cannot happen for a finite row (its max is a candidate): never read cand[0]
  std::sort(cand.begin(), cand.end(), higher);
  const int64_t count = static_cast<int64_t>(cand.size());
  std::vector<double> probs(count);
  double mass = 0.0;
  for (int64_t i = 0; i < count; ++i) mass += (probs[i] = std::exp(static_cast<double>(cand[i].first - m)));
  int64_t keep = count;
  if (p.top_p < 1.f) {  // on the top-k renormalized distribution; the first token always stays
    double before = 0.0;
    for (keep = 0; keep < count; ++keep) {
      if (keep > 0 && before >= p.top_p * mass) break;
      before += probs[keep];
    }
    mass = before;
  }
  const double target = p.u * mass * (1.0 - 1e-9);
  double acc = 0.0;
  for (int64_t i = 0; i < keep; ++i) {
    acc += probs[i];
    if (acc > target) return cand[i].second;
  }
  return cand[std::max<int64_t>(keep - 1, 0)].second;
}

// Top-p without a top-k. The nucleus is the smallest set of highest tokens (ties in vocabulary order) whose mass
// reaches top_p of the row's (the first token always stays). It is found by a three-way quickselect by mass over
// the candidates, with no sort: the tokens above a cut value, plus the first `ties` tokens at it. The inverse
// CDF then walks the row in vocabulary order. A flat row's nucleus of ~40k tokens cost a 1.7 ms sort per row.
int64_t sample_nucleus(const float* x, int64_t n, const RowParams& p, float m, double z,
                       std::vector<std::pair<float, int64_t>>& cand) {
  const double target = p.top_p * z;
  // Everything before lo is in the nucleus, above all of [lo, hi), with mass acc < target.
  int64_t lo = 0, hi = static_cast<int64_t>(cand.size());
  double acc = 0.0;
  float cut = 0.f;
  int64_t ties = 0;
  while (true) {
    const float a = cand[lo].first, b = cand[lo + (hi - lo) / 2].first, c = cand[hi - 1].first;
    const float v = std::max(std::min(a, b), std::min(std::max(a, b), c));  // median of three
    int64_t gt = lo, i = lo, lt = hi;  // -> [lo, gt) > v, [gt, lt) == v, [lt, hi) < v
    while (i < lt) {
      if (cand[i].first > v) {
        std::swap(cand[i++], cand[gt++]);
      } else if (cand[i].first < v) {
        std::swap(cand[i], cand[--lt]);
      } else {
        ++i;
      }
    }
    double mass_gt = 0.0;
    for (int64_t j = lo; j < gt; ++j) mass_gt += std::exp(static_cast<double>(cand[j].first - m));
    if (gt > lo && acc + mass_gt >= target) {  // the cut is above v
      hi = gt;
      continue;
    }
    acc += mass_gt;
    const double each = std::exp(static_cast<double>(v - m));
    const int64_t equal = lt - gt;
    if (acc + equal * each >= target || lt == hi) {  // the cut is at v (or rounding ran out of candidates)
      const double needed = std::ceil((target - acc) / each);
      ties = std::clamp<int64_t>(needed > 0 ? static_cast<int64_t>(needed) : 1, 1, equal);
      cut = v;
      break;
    }
    acc += equal * each;
    lo = lt;
  }
  const double mass = acc + ties * std::exp(static_cast<double>(cut - m));
  const double goal = p.u * mass * (1.0 - 1e-9);
  double walked = 0.0;
  int64_t seen_ties = 0;
  int64_t i = 0;
  for (; i + kVec <= n; i += kVec) {
    const Vec s = Vec::loadu(x + i) * Vec(p.inv_temperature);
    const float top = lane_max(s);
    if (top < cut) continue;
    if (top > cut) {  // no tie in this vector unless some lane equals cut: checked below, lane by lane
      const Vec e = Vec::blendv(Vec(0.f), (s - Vec(m)).exp(), s > Vec(cut));
      const float block = lane_sum(e);
      const bool has_tie = lane_sum(Vec::blendv(Vec(0.f), Vec(1.f), s == Vec(cut))) > 0.f;
      if (!has_tie && walked + block <= goal) {
        walked += block;
        continue;
      }
    }
    alignas(64) float lanes[kVec];
    s.store(lanes);
    for (int64_t j = 0; j < kVec; ++j) {
      if (lanes[j] > cut) {
        walked += std::exp(lanes[j] - m);
      } else if (lanes[j] == cut && seen_ties < ties) {
        ++seen_ties;
        walked += std::exp(lanes[j] - m);
      } else {
        continue;
      }
      if (walked > goal) return i + j;
    }
  }
  for (; i < n; ++i) {
    const float sv = x[i] * p.inv_temperature;
    if (sv > cut || (sv == cut && seen_ties++ < ties)) {
      walked += std::exp(sv - m);
      if (walked > goal) return i;
    }
  }
  return last_at_or_above(x, n, p.inv_temperature, cut);  // rounding left the goal past the end
}

// Top-k rows with a k up to this take the heap; larger ones the threshold search.
constexpr int64_t kMaxHeapK = 4096;

int64_t argmax_or_none(const float* x, int64_t n) {
  const float m = row_max(x, n);
  if (!std::isfinite(m)) return kNoToken;
  return std::find(x, x + n, m) - x;
}

int64_t sample_row(const float* x, int64_t n, const RowParams& p, std::vector<std::pair<float, int64_t>>& cand) {
  const float raw_max = row_max(x, n);
  if (!std::isfinite(raw_max)) return kNoToken;
  const float m = raw_max * p.inv_temperature;
  if (!std::isfinite(m)) return argmax_or_none(x, n);  // logits / temperature overflow: the greedy limit
  const float floor_s = std::max(m - kUnderflowGap, m + p.log_min_p);  // log_min_p is -inf without min_p
  const bool has_k = p.top_k < n, has_p = p.top_p < 1.f;
  cand.clear();
  if (!has_k && !has_p) return sample_unfiltered(x, n, p, m, floor_s, cand);
  if (has_k && p.top_k <= kMaxHeapK) {
    top_k_candidates(x, n, p.inv_temperature, floor_s, p.top_k, cand);
    return draw_top_k(p, m, cand);
  }
  double z = 0.0;
  for (float gap = kFirstGap;; gap *= 2.f) {
    cand.clear();
    const bool last = gap > kLastGap;
    const float gap_s = last ? floor_s : m - gap;
    z = exp_sum(x, n, p.inv_temperature, m, floor_s, gap_s, true, cand);
    if (last) break;
    if (has_k) {
      if (static_cast<int64_t>(cand.size()) >= p.top_k) break;
    } else {
      double mass = 0.0;
      for (const auto& c : cand) mass += std::exp(c.first - m);
      if (mass >= p.top_p * z) break;
    }
  }
  if (!has_k) return sample_nucleus(x, n, p, m, z, cand);
  if (static_cast<int64_t>(cand.size()) > p.top_k) {  // a top-k among many candidates: select the k first
    std::nth_element(cand.begin(), cand.begin() + p.top_k, cand.end(), higher);
    cand.resize(p.top_k);
  }
  return draw_top_k(p, m, cand);
}

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                       const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& uniforms) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat &&
                  logits.stride(1) == 1,
              "logits must be a float32 CPU [rows, vocab] tensor with contiguous rows");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0, "logits need a vocabulary");
  for (const at::Tensor* t : {&temperature, &top_p, &min_p, &uniforms}) {
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 1 && t->size(0) == rows && t->scalar_type() == at::kFloat &&
                    t->is_contiguous(),
                "temperature, top_p, min_p and uniforms must be contiguous float32 [rows] CPU tensors");
  }
  TORCH_CHECK(top_k.device().is_cpu() && top_k.dim() == 1 && top_k.size(0) == rows &&
                  top_k.scalar_type() == at::kLong && top_k.is_contiguous(),
              "top_k must be a contiguous int64 [rows] CPU tensor");
  const float* temps = temperature.data_ptr<float>();
  const float* ps = top_p.data_ptr<float>();
  const float* min_ps = min_p.data_ptr<float>();
  const float* us = uniforms.data_ptr<float>();
  const int64_t* ks = top_k.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(temps[r] >= 0.f, "row ", r, ": temperature must be >= 0");
    TORCH_CHECK(ps[r] >= 0.f && ps[r] <= 1.f && min_ps[r] >= 0.f && min_ps[r] <= 1.f && ks[r] >= 1,
                "row ", r, ": top_p and min_p in [0, 1] and top_k >= 1 (vocab for none)");
  }
  at::Tensor tokens = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* out = tokens.data_ptr<int64_t>();
  const float* base = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<std::pair<float, int64_t>> cand;
    for (int64_t r = begin; r < end; ++r) {
      const float inv_t = 1.f / temps[r];
      if (!std::isfinite(inv_t)) {  // a temperature that underflows float32 is the greedy limit: the argmax
        out[r] = argmax_or_none(base + r * stride, vocab);
        continue;
      }
      const RowParams p{inv_t, ps[r],
                        min_ps[r] > 0.f ? std::log(min_ps[r]) : -std::numeric_limits<float>::infinity(),
                        std::min(ks[r], vocab), us[r]};
      out[r] = sample_row(base + r * stride, vocab, p, cand);
    }
  });
  return tokens;
}

// The first index of each row's maximum, as torch.argmax (kNoToken where the maximum is not finite); two
// vectorized passes (the max, then where it is) where torch's reduction took ~1.1 ms for 64 rows of a 49k
// vocabulary on 2 cores, the largest host cost of a greedy step.
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat &&
                  logits.stride(1) == 1 && logits.size(1) > 0,
              "logits must be a float32 CPU [rows, vocab] tensor with contiguous rows");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  at::Tensor tokens = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* out = tokens.data_ptr<int64_t>();
  const float* base = logits.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = base + r * stride;
      const float m = row_max(x, vocab);
      int64_t i = 0;
      for (; i + kVec <= vocab; i += kVec) {
        if (lane_max(Vec::loadu(x + i)) == m) break;
      }
      while (i < vocab && !(x[i] == m)) ++i;
      out[r] = std::isfinite(m) && i < vocab ? i : kNoToken;  // NaN, all -inf or +inf: no token (sample_row)
    }
  });
  return tokens;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("sample_rows(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, "
        "Tensor uniforms) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(conveyor_cpu, CPU, m) {
  m.impl("sample_rows", &sample_rows);
  m.impl("argmax_rows", &argmax_rows);
}
