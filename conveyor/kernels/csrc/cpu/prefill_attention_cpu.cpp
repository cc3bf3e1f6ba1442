// Paged causal attention of prefill chunks on CPU (flash-style: online softmax, no score matrix in memory).
//
// Why our own: torch's CPU SDPA runs its tiles through cpublas/MKL, which takes a slow path on AMD CPUs (~80
// GFLOP/s effective on SmolLM2's shapes, with an explicit causal mask it cannot skip), and it needs the context
// gathered out of the paged cache first. Here K/V rows are read from the cache blocks in place, fully masked
// tiles are never computed, and the tile products are register-blocked FMAs.
//
// Layout: query/out [T, H, D], packed chunks; chunk i is rows [query_starts[i], + query_lens[i]) and its last
// query row is position seq_lens[i] - 1 of its sequence (the chunk continues a context of seq_lens - query_lens
// cached tokens). Cache [num_blocks, block_size, KVH, D]; query head h = kvh * group + g reads kv head kvh.
//
// Options: with a sliding window W, row position p attends keys (p - W, p]: a task's key tiles start at its first
// row's first visible key, so blocks wholly before the chunk's window are neither read nor checked (the engine may
// have freed them). Logit soft-capping c turns each score s into c * tanh(s / c) before the softmax.
//
// Work split: one task per (chunk, kv head, tile of up to kMaxQueries query positions). A task's rows are its
// positions x the group's query heads, so each K/V tile it packs (converted to fp32, K transposed) serves all of
// those rows. Tasks go to threads dynamically, costliest first (the last tiles of a chunk see the longest context).
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "float_rows.h"

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();
// Query positions per task: 64 where there are enough tasks to keep every thread busy (fewer K/V tile packs
// per query), halved down to 16 for short chunks.
constexpr int64_t kMaxQueries = 64;
constexpr int64_t kMinQueries = 16;
constexpr int64_t kTasksPerThread = 4;
constexpr int64_t kKeys = 64;     // key positions per tile
constexpr int64_t kKeyVecs = kKeys / kVec;
// Register blocking of both tile products: kRowBlock rows x kColVecs vectors (of keys for the scores, of head dims
// for the outputs) of accumulators, plus kColVecs loaded vectors and one broadcast: 24 + 5 of AVX-512's 32
// registers, 12 + 3 of AVX2's 16. With one row per block (AVX2's first version) every loaded vector fed one FMA,
// so the loads, not the FMAs, set the pace: ~35 GFLOP/s a core on a Zen 3.
constexpr int64_t kRowBlock = 6;
constexpr int kColVecs = kVec == 16 ? 4 : 2;
static_assert(kKeyVecs % kColVecs == 0, "a key tile must be whole column blocks");

struct Chunk {
  int64_t start, q_len, seq_len, table_row;
};

// The attention options (0: none).
struct Options {
  int64_t window;
  float soft_cap;
  // The first key position a query at position p attends.
  int64_t first_key(int64_t p) const { return window > 0 ? std::max<int64_t>(0, p - window + 1) : 0; }
};

struct Task {
  int64_t chunk, kv_head, first, count;  // query positions [first, first + count) of the chunk
  int64_t cost;
};

using conveyor_cpu::to_float;

// s[r][c0 * kVec, + CV * kVec) = q[r] . kt[:, j] over those keys, for RB rows; kt is [d][kKeys] (K transposed).
template <int RB, int CV>
inline void score_block(const float* q, int64_t d, const float* kt, int64_t c0, float* s) {
  Vec acc[RB][CV];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < CV; ++c) acc[r][c] = Vec(0.f);
  const float* cols = kt + c0 * kVec;
  for (int64_t k = 0; k < d; ++k) {
    Vec col[CV];
    for (int c = 0; c < CV; ++c) col[c] = Vec::loadu(cols + k * kKeys + c * kVec);
    for (int r = 0; r < RB; ++r) {
      const Vec a(q[r * d + k]);
      for (int c = 0; c < CV; ++c) acc[r][c] = at::vec::fmadd(a, col[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < CV; ++c) acc[r][c].store(s + r * kKeys + (c0 + c) * kVec);
}

// Scores of RB rows against the tile's first `keys` keys (rounded up to whole column blocks): the causal mask
// leaves the rest of a diagonal tile unread (softmax_row reads s[r] only below its row's valid count).
template <int RB>
inline void score_rows(const float* q, int64_t d, const float* kt, int64_t keys, float* s) {
  for (int64_t c0 = 0; c0 * kVec < keys; c0 += kColVecs) score_block<RB, kColVecs>(q, d, kt, c0, s);
}

// o[r][off, off + NV*kVec) += sum_j p[r][j] * v[j][off, ...) over j < n, for RB rows.
template <int RB, int NV>
inline void weighted_block(const float* p, const float* v, int64_t n, int64_t d, int64_t off, float* o) {
  Vec acc[RB][NV];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = Vec::loadu(o + r * d + off + c * kVec);
  for (int64_t j = 0; j < n; ++j) {
    Vec row[NV];
    for (int c = 0; c < NV; ++c) row[c] = Vec::loadu(v + j * d + off + c * kVec);
    for (int r = 0; r < RB; ++r) {
      const Vec a(p[r * kKeys + j]);
      for (int c = 0; c < NV; ++c) acc[r][c] = at::vec::fmadd(a, row[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c].store(o + r * d + off + c * kVec);
}

template <int RB>
inline void weighted_rows(const float* p, const float* v, int64_t n, int64_t d, float* o) {
  int64_t off = 0;
  for (; off + kColVecs * kVec <= d; off += kColVecs * kVec) weighted_block<RB, kColVecs>(p, v, n, d, off, o);
  switch ((d - off) / kVec) {  // fewer than kColVecs whole vectors left
    case 3: if constexpr (kColVecs > 3) weighted_block<RB, 3>(p, v, n, d, off, o); break;
    case 2: if constexpr (kColVecs > 2) weighted_block<RB, 2>(p, v, n, d, off, o); break;
    case 1: weighted_block<RB, 1>(p, v, n, d, off, o); break;
    default: break;
  }
  for (int64_t k = d / kVec * kVec; k < d; ++k) {  // a head_dim that is not whole vectors
    for (int r = 0; r < RB; ++r) {
      float acc = o[r * d + k];
      for (int64_t j = 0; j < n; ++j) acc += p[r * kKeys + j] * v[j * d + k];
      o[r * d + k] = acc;
    }
  }
}

struct Scratch {
  std::vector<float> q, kt, v, s, o, maxes, sums;
  std::vector<int64_t> pos;
  void fit(int64_t rows, int64_t d) {
    q.resize(rows * d);
    o.resize(rows * d);
    s.resize(rows * kKeys);
    kt.resize(d * kKeys);
    v.resize(kKeys * d);
    maxes.resize(rows);
    sums.resize(rows);
    pos.resize(rows);
  }
};

struct Geometry {
  int64_t heads, kv_heads, group, head_dim, block_size, max_blocks;
  int64_t row_stride() const { return kv_heads * head_dim; }
};

// Online-softmax update of row r with its scores s[lo, valid) (soft-capped first when soft_cap > 0): rescales
// o[r] and turns s into probabilities (zero outside [lo, valid), so the weighted sum can run over the whole tile).
inline void softmax_row(float* s, int64_t lo, int64_t valid, int64_t n, float soft_cap, float& max_so_far,
                        float& sum, float* o, int64_t d) {
  if (valid <= lo) {
    std::fill(s, s + n, 0.f);
    return;
  }
  std::fill(s, s + lo, 0.f);
  if (soft_cap > 0.f) {
    const Vec vcap(soft_cap), inv(1.f / soft_cap);
    int64_t t = lo;
    for (; t + kVec <= valid; t += kVec) ((Vec::loadu(s + t) * inv).tanh() * vcap).store(s + t);
    for (; t < valid; ++t) s[t] = soft_cap * std::tanh(s[t] / soft_cap);
  }
  int64_t j = lo;
  Vec vmax(max_so_far);
  for (; j + kVec <= valid; j += kVec) vmax = at::vec::maximum(vmax, Vec::loadu(s + j));
  float m = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmax);
  for (; j < valid; ++j) m = std::max(m, s[j]);
  const float rescale = std::exp(max_so_far - m);  // 0 on the first tile (max_so_far = -inf)
  if (rescale != 1.f) {
    int64_t k = 0;
    for (; k + kVec <= d; k += kVec) (Vec::loadu(o + k) * Vec(rescale)).store(o + k);
    for (; k < d; ++k) o[k] *= rescale;
  }
  Vec vsum(0.f);
  for (j = lo; j + kVec <= valid; j += kVec) {
    const Vec e = (Vec::loadu(s + j) - Vec(m)).exp_u20();
    e.store(s + j);
    vsum = vsum + e;
  }
  float total = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, vsum);
  for (; j < valid; ++j) {
    s[j] = std::exp(s[j] - m);
    total += s[j];
  }
  std::fill(s + valid, s + n, 0.f);
  sum = sum * rescale + total;
  max_so_far = m;
}

template <typename T, typename TC>
void run_task(const Task& task, const Chunk& c, const T* query, const TC* key_cache, const TC* value_cache,
              const int32_t* tables, T* out, float scale, const Options& opt, const Geometry& g, Scratch& sc) {
  const int64_t d = g.head_dim;
  const int64_t count = task.count;
  const int64_t rows = count * g.group;
  const int64_t context = c.seq_len - c.q_len;
  const int32_t* table = tables + c.table_row * g.max_blocks;
  // Row r = i * group + gi: position `first + i` of the chunk, query head kv_head * group + gi.
  for (int64_t i = 0; i < count; ++i) {
    const T* src = query + (c.start + task.first + i) * g.heads * d + task.kv_head * g.group * d;
    to_float(src, sc.q.data() + i * g.group * d, g.group * d, scale);
    for (int64_t gi = 0; gi < g.group; ++gi) sc.pos[i * g.group + gi] = context + task.first + i;
  }
  std::fill(sc.o.begin(), sc.o.begin() + rows * d, 0.f);
  std::fill(sc.maxes.begin(), sc.maxes.begin() + rows, -std::numeric_limits<float>::infinity());
  std::fill(sc.sums.begin(), sc.sums.begin() + rows, 0.f);
  const int64_t num_keys = context + task.first + count;  // causal: the last row sees keys [0, num_keys)
  // The first row sees keys from first_key on (0 without a window): earlier tiles are never packed.
  for (int64_t j0 = opt.first_key(context + task.first); j0 < num_keys; j0 += kKeys) {
    const int64_t n = std::min(kKeys, num_keys - j0);
    // Pack the tile: K transposed (zero past n), V as rows, both fp32.
    for (int64_t j = 0; j < kKeys; ++j) {
      if (j >= n) {
        for (int64_t k = 0; k < d; ++k) sc.kt[k * kKeys + j] = 0.f;
        continue;
      }
      const int64_t p = j0 + j;
      const int64_t row = (static_cast<int64_t>(table[p / g.block_size]) * g.block_size + p % g.block_size) *
                              g.row_stride() + task.kv_head * d;
      const TC* krow = key_cache + row;
      if constexpr (conveyor_cpu::is_fp8_v<TC>) {  // widen a vector at a time (in V's slot), then transpose
        float* widened = sc.v.data() + j * d;
        to_float(krow, widened, d);
        for (int64_t k = 0; k < d; ++k) sc.kt[k * kKeys + j] = widened[k];
      } else {
        for (int64_t k = 0; k < d; ++k) sc.kt[k * kKeys + j] = static_cast<float>(krow[k]);
      }
      to_float(value_cache + row, sc.v.data() + j * d, d);
    }
    // Rows are in position order, so a block's last row sees the most keys of the tile: the block needs
    // none past that row's count (keys after it are masked for every row of the block).
    const auto keys_of = [&](int64_t last_row) { return std::clamp<int64_t>(sc.pos[last_row] - j0 + 1, 0, n); };
    int64_t r = 0;
    for (; r + kRowBlock <= rows; r += kRowBlock) {
      score_rows<kRowBlock>(sc.q.data() + r * d, d, sc.kt.data(), keys_of(r + kRowBlock - 1), sc.s.data() + r * kKeys);
    }
    for (; r < rows; ++r) score_rows<1>(sc.q.data() + r * d, d, sc.kt.data(), keys_of(r), sc.s.data() + r * kKeys);
    for (r = 0; r < rows; ++r) {
      const int64_t valid = std::min(n, sc.pos[r] - j0 + 1);
      const int64_t lo = std::clamp<int64_t>(opt.first_key(sc.pos[r]) - j0, 0, n);
      softmax_row(sc.s.data() + r * kKeys, lo, valid, n, opt.soft_cap, sc.maxes[r], sc.sums[r], sc.o.data() + r * d,
                  d);
    }
    // Probabilities are zero past each row's count (softmax_row), so a block sums over its last row's keys.
    for (r = 0; r + kRowBlock <= rows; r += kRowBlock) {
      weighted_rows<kRowBlock>(sc.s.data() + r * kKeys, sc.v.data(), keys_of(r + kRowBlock - 1), d,
                               sc.o.data() + r * d);
    }
    for (; r < rows; ++r) weighted_rows<1>(sc.s.data() + r * kKeys, sc.v.data(), keys_of(r), d, sc.o.data() + r * d);
  }
  for (int64_t i = 0; i < count; ++i) {
    T* dst = out + (c.start + task.first + i) * g.heads * d + task.kv_head * g.group * d;
    for (int64_t gi = 0; gi < g.group; ++gi) {
      const int64_t rr = i * g.group + gi;
      const float inv = 1.f / sc.sums[rr];
      const float* src = sc.o.data() + rr * d;
      for (int64_t k = 0; k < d; ++k) dst[gi * d + k] = static_cast<T>(src[k] * inv);
    }
  }
}

template <typename T, typename TC>
void prefill_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_tables, const std::vector<Chunk>& chunks,
                  double scale, const Options& opt, const Geometry& g) {
  const int64_t threads = at::get_num_threads();
  int64_t per_task = kMaxQueries;
  for (; per_task > kMinQueries; per_task /= 2) {
    int64_t num_tasks = 0;
    for (const Chunk& c : chunks) num_tasks += (c.q_len + per_task - 1) / per_task * g.kv_heads;
    if (num_tasks >= kTasksPerThread * threads) break;
  }
  std::vector<Task> tasks;
  for (int64_t ci = 0; ci < static_cast<int64_t>(chunks.size()); ++ci) {
    const Chunk& c = chunks[ci];
    for (int64_t first = 0; first < c.q_len; first += per_task) {
      const int64_t count = std::min(per_task, c.q_len - first);
      const int64_t last = c.seq_len - c.q_len + first + count;  // keys the task's last row sees, windowed or not
      const int64_t cost = count * (last - opt.first_key(c.seq_len - c.q_len + first));
      for (int64_t h = 0; h < g.kv_heads; ++h) tasks.push_back({ci, h, first, count, cost});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  const auto* q = query.data_ptr<T>();
  const auto* kc = key_cache.data_ptr<TC>();
  const auto* vc = value_cache.data_ptr<TC>();
  const auto* tables = block_tables.data_ptr<int32_t>();
  auto* o = out.data_ptr<T>();
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(threads, num_tasks);
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    Scratch sc;
    sc.fit(per_task * g.group, g.head_dim);
    for (int64_t w = begin; w < end; ++w) {
      for (int64_t k = next.fetch_add(1); k < num_tasks; k = next.fetch_add(1)) {
        run_task<T, TC>(tasks[k], chunks[tasks[k].chunk], q, kc, vc, tables, o, static_cast<float>(scale), opt, g,
                        sc);
      }
    }
  });
}

void paged_prefill(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                   const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                   const at::Tensor& query_starts, const at::Tensor& query_lens, double scale, int64_t sliding_window,
                   double soft_cap) {
  TORCH_CHECK(query.device().is_cpu() && out.device().is_cpu(), "query and out must be CPU tensors");
  TORCH_CHECK(sliding_window >= 0 && soft_cap >= 0, "sliding_window and soft_cap must be >= 0 (0: none)");
  const Options opt{sliding_window, static_cast<float>(soft_cap)};
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous() && out.is_contiguous() && out.sizes() == query.sizes(),
              "query and out must be contiguous [tokens, num_heads, head_dim] tensors of one shape");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes(),
              "caches must be contiguous [num_blocks, block_size, num_kv_heads, head_dim] tensors of one shape");
  const at::ScalarType t = query.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf,
              "dtype must be float32, bfloat16 or float16, got ", t);
  TORCH_CHECK(out.scalar_type() == t, "out must have query's dtype ", t);
  const at::ScalarType tc = key_cache.scalar_type();
  TORCH_CHECK(conveyor_cpu::is_cache_dtype(tc) && value_cache.scalar_type() == tc,
              "key_cache and value_cache must share one dtype of float32, bfloat16, float16, float8_e4m3fn or "
              "float8_e5m2");
  for (const at::Tensor* x : {&block_tables, &seq_lens, &query_starts, &query_lens}) {
    TORCH_CHECK(x->device().is_cpu() && x->scalar_type() == at::kInt && x->is_contiguous(),
                "block_tables, seq_lens, query_starts and query_lens must be contiguous int32 CPU tensors");
  }
  Geometry g{query.size(1), key_cache.size(2), 0, query.size(2), key_cache.size(1), block_tables.size(1)};
  TORCH_CHECK(key_cache.size(3) == g.head_dim, "cache head_dim differs from the query's");
  TORCH_CHECK(g.kv_heads > 0 && g.heads % g.kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  g.group = g.heads / g.kv_heads;
  const int64_t n = seq_lens.size(0);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == n && query_starts.size(0) == n &&
                  query_lens.size(0) == n, "block_tables, seq_lens, query_starts and query_lens need one row each");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_starts.data_ptr<int32_t>();
  const int32_t* qlens = query_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  std::vector<Chunk> chunks;
  for (int64_t i = 0; i < n; ++i) {
    if (qlens[i] == 0) continue;
    TORCH_CHECK(qlens[i] > 0 && lens[i] >= qlens[i] && starts[i] >= 0 && starts[i] + qlens[i] <= query.size(0),
                "chunk ", i, ": query rows [", starts[i], ", +", qlens[i], ") with seq_len ", lens[i],
                " do not fit the query");
    const int64_t blocks = (lens[i] + g.block_size - 1) / g.block_size;
    TORCH_CHECK(blocks <= g.max_blocks, "chunk ", i, ": seq_len ", lens[i], " needs more blocks than its table has");
    for (int64_t b = opt.first_key(lens[i] - qlens[i]) / g.block_size; b < blocks; ++b) {
      const int32_t block = tables[i * g.max_blocks + b];
      TORCH_CHECK(block >= 0 && block < key_cache.size(0), "block_tables[", i, ", ", b, "] = ", block,
                  " is not a block of the cache");
    }
    chunks.push_back({starts[i], qlens[i], lens[i], i});
  }
  if (chunks.empty()) return;
  // The cache may be narrower than the queries (a bf16 cache for an fp32 model); tiles are packed as fp32 anyway.
  conveyor_cpu::with_attention_dtype(t, [&](auto q_tag) {
    conveyor_cpu::with_cache_dtype(tc, [&](auto c_tag) {
      prefill_impl<typename decltype(q_tag)::type, typename decltype(c_tag)::type>(
          out, query, key_cache, value_cache, block_tables, chunks, scale, opt, g);
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("paged_prefill(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_starts, Tensor query_lens, float scale, int sliding_window=0, "
        "float soft_cap=0.0) -> ()");
}

TORCH_LIBRARY_IMPL(conveyor_cpu, CPU, m) {
  m.impl("paged_prefill", &paged_prefill);
}
