// Paged decode attention (one query token per sequence) and KV-cache write for CPU.
//
// Cache layout: [num_blocks, block_size, num_kv_heads, head_dim]; query/out [B, H, D]; query head
// h = kvh * group + g reads kv head kvh. K/V rows are read in place from the cache (no gather copy).
//
// Work split: one task per (sequence, partition of its context), covering every kv head. A position's K (or V)
// row of all kv heads is one contiguous num_kv_heads * head_dim run and a block is one contiguous run of those,
// so a task streams whole blocks and uses every cache line it (pre)fetches; a task per (sequence, kv head)
// would read a strided third of each row (SmolLM2) and leave the rest of each line fetch to another task. Within
// a task, each tile of 16 positions sits in L1 while every query head of every group uses it, so each K/V row
// is loaded from memory once for its `group` queries, and (head dims of whole vectors) into registers once per
// chunk of up to four of those queries. Contexts are split into partitions only when there are
// too few sequences to keep every thread busy; partitions write unnormalized partial results that a cheap
// serial pass merges (log-sum-exp rescaling). Tasks go to torch's threads one at a time, longest first
// (parallel_passes.h).
//
// Softmax: two-pass within a task. Scores of the task's positions go to a thread-local buffer; then max,
// exp and sum over that buffer; then the probability-weighted V sum. All math is fp32.
//
// Options: a sliding window W starts a sequence's context at position len - W (the query at len - 1 sees
// len - W .. len - 1, transformers' mask), so blocks wholly before it are neither read nor checked (the engine
// may have freed them); logit soft-capping c turns each score s into c * tanh(s / c) before the softmax.
//
// Dtypes: queries/out and the cache may differ (queries float32, bfloat16 or float16; the cache one of those or
// fp8 e4m3fn / e5m2): a bf16 cache for an fp32 model halves the bytes a decode step reads, an fp8 cache quarters
// them, and rows widen to fp32 in registers as they load (load_row). The cache write converts rows where the
// model's dtype is not the cache's (fp8 saturates at its largest finite value).
//
// Vectorization: at::vec::Vectorized<float>; cpu_ext.py defines CPU_CAPABILITY to match torch's, so it is
// AVX-512 (16 floats) or AVX2 (8) where torch uses those, and the portable fallback elsewhere. Scores of a tile
// come out of one transposed reduction under AVX-512.

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "float_rows.h"
#include "parallel_passes.h"

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();

// Contexts shorter than this are never split: below it a partition's merge and task overhead outweigh the
// better balance.
constexpr int64_t kMinPartition = 256;
// Tasks per thread to aim for when splitting: enough that the uneven last partitions even out.
constexpr int64_t kTasksPerThread = 4;

struct Geometry {
  int64_t batch, heads, kv_heads, group, head_dim, block_size, max_blocks, num_blocks;
  int64_t row_stride() const { return kv_heads * head_dim; }        // between positions in a block
  int64_t block_stride() const { return block_size * row_stride(); }  // between blocks
};

struct Task {
  int64_t seq, begin, end;  // positions [begin, end) of the context (begin > 0 under a sliding window)
  int64_t partial;          // -1: the task covers the whole context; else its slot in the partials
};

inline Vec vec_add(const Vec& a, const Vec& b) { return a + b; }
inline Vec vec_max(const Vec& a, const Vec& b) { return at::vec::maximum(a, b); }

// Positions handled together: the scores of a tile come out of one transposed reduction (AVX-512), and its
// K/V rows stay in L1 while every query of the group uses them.
constexpr int64_t kTile = 16;

// kVec cache elements at p as fp32: float rows load as they are, bf16/fp16 rows widen in registers (a bf16 is
// the top half of a float), so a half-size cache costs a shift or a convert per vector and no scratch copy; fp8
// rows widen through fp16 (float_rows.h).
template <typename TC>
inline Vec load_row(const TC* p) {
  if constexpr (std::is_same_v<TC, float>) {
    return Vec::loadu(p);
  } else if constexpr (conveyor_cpu::is_fp8_v<TC>) {
    return conveyor_cpu::load_fp8(p);
  } else {
#if defined(CPU_CAPABILITY_AVX512)
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (std::is_same_v<TC, at::BFloat16>) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    } else {
      return _mm512_cvtph_ps(raw);
    }
#elif defined(CPU_CAPABILITY_AVX2)
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (std::is_same_v<TC, at::BFloat16>) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
    } else {
      return _mm256_cvtph_ps(raw);
    }
#else
    float tmp[kVec];
    for (int64_t i = 0; i < kVec; ++i) tmp[i] = static_cast<float>(p[i]);
    return Vec::loadu(tmp);
#endif
  }
}

// The first count (< kVec) elements at p as fp32, the other lanes zero.
template <typename TC>
inline Vec load_row(const TC* p, int64_t count) {
  if constexpr (std::is_same_v<TC, float>) {
    return Vec::loadu(p, count);
  } else {
    float tmp[kVec] = {};
    for (int64_t i = 0; i < count; ++i) tmp[i] = static_cast<float>(p[i]);
    return Vec::loadu(tmp);
  }
}

// Lane-wise partial sums of q . row for any head_dim d (the generic path; whole-vector head dims take the joint
// tiles below).
template <typename TC>
inline Vec dot_lanes(const float* q, const TC* row, int64_t d) {
  Vec a0(0.f), a1(0.f);
  int64_t off = 0;
  for (; off + kVec <= d; off += kVec) a0 = at::vec::fmadd(Vec::loadu(q + off), load_row(row + off), a0);
  if (off < d) {  // the missing lanes load as zeros
    a1 = at::vec::fmadd(Vec::loadu(q + off, d - off), load_row(row + off, d - off), a1);
  }
  return a0 + a1;
}

#if defined(CPU_CAPABILITY_AVX512)
// out[i] = sum of v[slot(i)]'s lanes, where slot(i) = 4 * (i % 4) + i / 4 (the order the tree leaves them in):
// 15 adds and 30 shuffles for 16 sums, against 8 operations per sum reducing each vector alone.
inline __m512 transposed_sums(const __m512* v) {
  __m512 w[8], u[4], s[2];
  for (int i = 0; i < 8; ++i) {  // quarters [x0+x2, x1+x3, y0+y2, y1+y3]
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {  // quarter j: four lanes summing to v[4i + j]
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {  // quarter j: two lanes each for v[8i + j], v[8i + 4 + j]
    s[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
  }
  // lane 4j + k: v[4k + j]
  return _mm512_add_ps(_mm512_shuffle_ps(s[0], s[1], 0x88), _mm512_shuffle_ps(s[0], s[1], 0xDD));
}
#endif

// Generic path, one query head: out[t] = q . rows[t] for the count (<= kTile) rows of a tile.
template <typename TC>
inline void score_tile(const float* q, const TC* const* rows, int64_t count, int64_t d, float* out) {
  for (int64_t t = 0; t < count; ++t) out[t] = at::vec::vec_reduce_all<float>(vec_add, dot_lanes(q, rows[t], d));
}

// Generic path, one query head: acc[0, d) += sum_t p[t] * rows[t][0, d) over the count rows of a tile.
template <typename TC>
inline void weighted_tile(float* acc, const float* p, const TC* const* rows, int64_t count, int64_t d) {
  for (int64_t off = 0; off < d; off += kVec) {
    const int64_t m = std::min(kVec, d - off);
    Vec s = Vec::loadu(acc + off, m);
    for (int64_t t = 0; t < count; ++t) {
      s = at::vec::fmadd(Vec(p[t]), m == kVec ? load_row(rows[t] + off) : load_row(rows[t] + off, m), s);
    }
    s.store(acc + off, m);
  }
}

// One task's inputs: fp32 queries q [heads, d] (pre-scaled); position t's row of all kv heads starts at
// k + offset[t] (v + offset[t]), kv head h at + h * d, in the cache's own dtype TC.
template <typename TC>
struct TaskView {
  const float* q;
  const TC *k, *v;
  const int64_t* offset;
  int64_t n, kv_heads, group, d;
  float soft_cap;  // 0: none
};

// scores[0, n) = cap * tanh(scores / cap).
inline void soft_cap_row(float* scores, int64_t n, float cap) {
  const Vec vcap(cap), inv(1.f / cap);
  int64_t t = 0;
  for (; t + kVec <= n; t += kVec) ((Vec::loadu(scores + t) * inv).tanh() * vcap).store(scores + t);
  for (; t < n; ++t) scores[t] = cap * std::tanh(scores[t] / cap);
}

// Software prefetch of the tiles ahead: blocks sit at random places in the cache, so the hardware prefetcher
// loses the stream at every block boundary, and once K/V outgrow the L3 (a 30-layer model's cache always does)
// the kernel waited on DRAM for most of its time. Measured on a 2-core EPYC VM, batch 16 x context 2000 (49 MB
// of K/V), one thread: 6.4 ms without, 3.1 ms prefetching the next tile in one burst at its start, 2.7 ms with
// the requests spread over the tile's work and two tiles ahead. prefetcht2 (to L2): prefetcht0 requests hold L1
// miss buffers, and a tile's 192 lines of them stalled the arithmetic (5.4 ms).
constexpr int64_t kPrefetchTiles = 2;

inline void prefetch_l2(const char* p) {
#if defined(__x86_64__)
  // Not __builtin_prefetch: GCC -O3 deleted the loops below whenever it could see they did nothing but prefetch
  // (which inlining decided, so it came and went with unrelated edits). asm volatile always stays.
  asm volatile("prefetcht2 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 1);
#endif
}

// Prefetches rows [first, last) (clamped to n) of the task: every cache line of each row's kv heads.
template <typename TC>
inline void prefetch_rows(const TC* base, const int64_t* offset, int64_t first, int64_t last, int64_t n,
                          int64_t row_floats) {
  const int64_t row_bytes = row_floats * static_cast<int64_t>(sizeof(TC));
  for (int64_t t = first; t < std::min(n, last); ++t) {
    const char* row = reinterpret_cast<const char*>(base + offset[t]);
    for (int64_t byte = 0; byte < row_bytes; byte += 64) prefetch_l2(row + byte);
  }
}

// Slice `part` of the rows of the tile kPrefetchTiles ahead of t0. A tile's prefetches go out in slices, one
// before each query head's work on the tile at t0, so that they interleave with the arithmetic instead of
// arriving in one burst.
template <typename TC>
inline void prefetch_ahead(const TC* base, const int64_t* offset, int64_t t0, int64_t part, int64_t slice,
                           int64_t n, int64_t row_floats) {
  const int64_t first = t0 + kPrefetchTiles * kTile + part * slice;
  prefetch_rows(base, offset, first, first + slice, n, row_floats);
}

// Every cache line of one kv head's d elements at row.
template <typename TC>
inline void prefetch_head_row(const TC* row, int64_t d) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < d * static_cast<int64_t>(sizeof(TC)); b += 64) prefetch_l2(bytes + b);
}

// Query heads of one kv head handled together (NC > 0): their q vectors (pass 1) or accumulators (pass 3) stay in
// registers while each K/V row is loaded once for all of them. More heads than this are taken in chunks; fewer
// for long head dims, where the registers run out.
template <int NC>
constexpr int kJointHeads = NC <= 4 ? 4 : 2;

// Pass 1 for G query heads and a tile of count rows: scores[g * n_stride + t] = q_g . rows[t]. The lane-wise
// partial sums go through an L1 scratch of [G][kTile] vectors so one transposed reduction per head finishes 16
// scores (AVX-512).
// Each row's work also prefetches the same kv head's part of one row of the tile kPrefetchTiles ahead (ahead,
// count_ahead of them): the requests go out one or two lines at a time between the arithmetic, not in bursts.
template <int NC, int G, typename TC>
inline void score_tile_joint(const float* q, int64_t d, const TC* const* rows, int64_t count, float* scores,
                             int64_t n_stride, Vec* lanes, const TC* const* ahead, int64_t count_ahead) {
  Vec qv[G][NC];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < NC; ++c) qv[g][c] = Vec::loadu(q + g * d + c * kVec);
  }
  for (int64_t t = 0; t < count; ++t) {
    if (t < count_ahead) prefetch_head_row(ahead[t], d);
    Vec r[NC];
    for (int c = 0; c < NC; ++c) r[c] = load_row(rows[t] + c * kVec);
    const int64_t slot = 4 * (t % 4) + t / 4;  // where transposed_sums expects row t (an involution)
    for (int g = 0; g < G; ++g) {
      Vec a = r[0] * qv[g][0];
      if constexpr (NC >= 2) {
        Vec b = r[1] * qv[g][1];
        for (int c = 2; c + 1 < NC; c += 2) {
          a = at::vec::fmadd(r[c], qv[g][c], a);
          b = at::vec::fmadd(r[c + 1], qv[g][c + 1], b);
        }
        if constexpr (NC % 2 == 1 && NC > 2) a = at::vec::fmadd(r[NC - 1], qv[g][NC - 1], a);
        a = a + b;
      }
      lanes[g * kTile + slot] = a;
    }
  }
  for (int g = 0; g < G; ++g) {
#if defined(CPU_CAPABILITY_AVX512)
    // Slots of rows past count hold stale sums of earlier tiles; they only reach their own (unstored) lanes.
    __m512 v[kTile];
    for (int i = 0; i < kTile; ++i) v[i] = lanes[g * kTile + i];
    Vec(transposed_sums(v)).store(scores + g * n_stride, count);
#else
    for (int64_t t = 0; t < count; ++t) {
      scores[g * n_stride + t] = at::vec::vec_reduce_all<float>(vec_add, lanes[g * kTile + 4 * (t % 4) + t / 4]);
    }
#endif
  }
}

// Pass 3 for G query heads: acc[g * d, + d) += sum_t p[g * n_stride + t] * rows[t] over the tile's rows.
template <int NC, int G, typename TC>
inline void weighted_tile_joint(float* acc, int64_t d, const float* p, int64_t n_stride, const TC* const* rows,
                                int64_t count, const TC* const* ahead, int64_t count_ahead) {
  Vec s[G][NC];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < NC; ++c) s[g][c] = Vec::loadu(acc + g * d + c * kVec);
  }
  for (int64_t t = 0; t < count; ++t) {
    if (t < count_ahead) prefetch_head_row(ahead[t], d);
    Vec r[NC];
    for (int c = 0; c < NC; ++c) r[c] = load_row(rows[t] + c * kVec);
    for (int g = 0; g < G; ++g) {
      const Vec w(p[g * n_stride + t]);
      for (int c = 0; c < NC; ++c) s[g][c] = at::vec::fmadd(w, r[c], s[g][c]);
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < NC; ++c) s[g][c].store(acc + g * d + c * kVec);
  }
}

// Runtime head count (1..kJointHeads<NC>) to the template that keeps that many heads in registers.
template <int NC, typename F>
inline void with_joint_heads(int64_t heads, F&& f) {
  switch (heads) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: if constexpr (kJointHeads<NC> >= 3) return f(std::integral_constant<int, 3>{}); break;
    case 4: if constexpr (kJointHeads<NC> >= 4) return f(std::integral_constant<int, 4>{}); break;
  }
}

// Softmax numerators in place over each query head's scores row, with their max and sum.
inline void softmax_rows(float* scores, int64_t heads, int64_t n, float* maxes, float* sums) {
  for (int64_t h = 0; h < heads; ++h) {
    float* row = scores + h * n;
    const float m = at::vec::reduce_all<float>(vec_max, row, n);
    Vec total(0.f);
    int64_t t = 0;
    for (; t + kVec <= n; t += kVec) {
      const Vec e = (Vec::loadu(row + t) - Vec(m)).exp_u20();
      e.store(row + t);
      total = total + e;
    }
    float sum = at::vec::vec_reduce_all<float>(vec_add, total);
    for (; t < n; ++t) {
      row[t] = std::exp(row[t] - m);
      sum += row[t];
    }
    maxes[h] = m;
    sums[h] = sum;
  }
}

// One pass over the task's tiles of base (its K or its V rows). For each tile and kv head, rows[] holds the
// tile's rows of that head; then joint(h, heads, rows, count, t0, ahead, count_ahead) runs for each chunk of the
// head's query heads (NC > 0; only the first chunk prefetches the tile kPrefetchTiles ahead), or single(h, rows,
// count, t0) for each query head after its slice of the prefetch (the generic path). The caller prefetches the
// first kPrefetchTiles tiles (prefetch_first), so that they can load during work before the walk.
template <int NC, typename TC, typename Joint, typename Single>
void walk_tiles(const TaskView<TC>& x, const TC* base, Joint&& joint, Single&& single) {
  constexpr int64_t chunk = NC > 0 ? kJointHeads<NC> : 1;
  const int64_t heads = x.kv_heads * x.group, row_floats = x.kv_heads * x.d;
  const int64_t slice = (kTile + heads - 1) / heads;  // the generic path's prefetch: a slice per query head
  const TC* rows[kTile];
  const TC* ahead[kTile];
  for (int64_t t0 = 0; t0 < x.n; t0 += kTile) {
    const int64_t count = std::min(kTile, x.n - t0);
    const int64_t first_ahead = t0 + kPrefetchTiles * kTile;
    for (int64_t kvh = 0; kvh < x.kv_heads; ++kvh) {
      for (int64_t t = 0; t < count; ++t) rows[t] = base + x.offset[t0 + t] + kvh * x.d;
      const int64_t end = (kvh + 1) * x.group;
      if constexpr (NC > 0) {
        int64_t count_ahead = std::clamp<int64_t>(x.n - first_ahead, 0, kTile);
        for (int64_t t = 0; t < count_ahead; ++t) ahead[t] = base + x.offset[first_ahead + t] + kvh * x.d;
        for (int64_t h = kvh * x.group; h < end; h += chunk, count_ahead = 0) {
          with_joint_heads<NC>(std::min(chunk, end - h), [&](auto g) {
            joint(h, g, rows, count, t0, ahead, count_ahead);
          });
        }
      } else {
        for (int64_t h = kvh * x.group; h < end; ++h) {
          prefetch_ahead(base, x.offset, t0, h, slice, x.n, row_floats);
          single(h, rows, count, t0);
        }
      }
    }
  }
}

// acc[h] = sum_t exp(s_ht - max_h) v_t with s_ht = q_h . k_t, and max_h, sum_h = sum_t exp(s_ht - max_h), for
// every query head h (kv head h / group). Head dims of whole vectors (NC > 0): the group's heads go through
// each tile together, so a K/V row is loaded (and, from a bf16/fp16 cache, widened) once per chunk of up to
// kJointHeads heads instead of once per head.
template <int NC, typename TC>
void attend(const TaskView<TC>& x, float* scores, float* acc, float* maxes, float* sums) {
  const int64_t heads = x.kv_heads * x.group;
  alignas(64) Vec lanes[(NC > 0 ? kJointHeads<NC> : 1) * kTile];
  const auto prefetch_first = [&](const TC* base) {
    prefetch_rows(base, x.offset, 0, kPrefetchTiles * kTile, x.n, x.kv_heads * x.d);
  };
  // Pass 1: scores [heads, n].
  prefetch_first(x.k);
  walk_tiles<NC>(
      x, x.k,
      [&](int64_t h, auto g, const TC* const* rows, int64_t count, int64_t t0, const TC* const* ahead,
          int64_t count_ahead) {
        score_tile_joint<NC, decltype(g)::value, TC>(x.q + h * x.d, x.d, rows, count, scores + h * x.n + t0, x.n,
                                                     lanes, ahead, count_ahead);
      },
      [&](int64_t h, const TC* const* rows, int64_t count, int64_t t0) {
        score_tile(x.q + h * x.d, rows, count, x.d, scores + h * x.n + t0);
      });
  // Pass 2: softmax numerators; V's first tiles load meanwhile.
  prefetch_first(x.v);
  if (x.soft_cap > 0.f) soft_cap_row(scores, heads * x.n, x.soft_cap);  // rows are [heads, n], contiguous
  softmax_rows(scores, heads, x.n, maxes, sums);
  // Pass 3: probability-weighted V rows.
  std::fill(acc, acc + heads * x.d, 0.f);
  walk_tiles<NC>(
      x, x.v,
      [&](int64_t h, auto g, const TC* const* rows, int64_t count, int64_t t0, const TC* const* ahead,
          int64_t count_ahead) {
        weighted_tile_joint<NC, decltype(g)::value, TC>(acc + h * x.d, x.d, scores + h * x.n + t0, x.n, rows, count,
                                                        ahead, count_ahead);
      },
      [&](int64_t h, const TC* const* rows, int64_t count, int64_t t0) {
        weighted_tile(acc + h * x.d, scores + h * x.n + t0, rows, count, x.d);
      });
}

template <typename TC>
void attend_any(const TaskView<TC>& x, float* scores, float* acc, float* maxes, float* sums) {
  // Unrolled variants for head dims of whole vectors (32/64/128 with AVX-512, 32/64 with AVX2), else generic.
  switch (x.d % kVec == 0 ? x.d / kVec : 0) {
    case 1: return attend<1, TC>(x, scores, acc, maxes, sums);
    case 2: return attend<2, TC>(x, scores, acc, maxes, sums);
    case 3: return attend<3, TC>(x, scores, acc, maxes, sums);
    case 4: return attend<4, TC>(x, scores, acc, maxes, sums);
    case 6: return attend<6, TC>(x, scores, acc, maxes, sums);
    case 8: return attend<8, TC>(x, scores, acc, maxes, sums);
    default: return attend<0, TC>(x, scores, acc, maxes, sums);
  }
}

using conveyor_cpu::to_float;

// Per-thread scratch, grown on demand and reused across tasks and calls (the pool's threads persist).
struct Scratch {
  std::vector<float> q, scores, acc, maxes, sums;
  std::vector<int64_t> offset;
  void fit(const Geometry& g, int64_t n) {
    q.resize(g.heads * g.head_dim);
    acc.resize(g.heads * g.head_dim);
    maxes.resize(g.heads);
    sums.resize(g.heads);
    if (static_cast<int64_t>(scores.size()) < g.heads * n) scores.resize(g.heads * n);
    if (static_cast<int64_t>(offset.size()) < n) offset.resize(n);
  }
};

// Computes one task into s.acc (unnormalized), s.maxes and s.sums. The queries (TQ) convert to fp32 once; the
// cache (TC) is read in place, each row widened in registers (load_row).
template <typename TQ, typename TC>
void run_task(const Task& task, const TQ* query, const TC* key_cache, const TC* value_cache, const int32_t* tables,
              float scale, float soft_cap, const Geometry& g, Scratch& s) {
  const int64_t n = task.end - task.begin;
  s.fit(g, n);
  // Folding the scale into q spares a multiply per score.
  to_float(query + task.seq * g.heads * g.head_dim, s.q.data(), g.heads * g.head_dim, scale);
  // Element offset of each position's row; only the table entries of blocks the task covers are read.
  const int32_t* table = tables + task.seq * g.max_blocks;
  const int64_t block_size = g.block_size, row_stride = g.row_stride(), block_stride = g.block_stride();
  int64_t* offset = s.offset.data();
  for (int64_t pos = task.begin; pos < task.end;) {
    const int64_t block = pos / block_size, end = std::min(task.end, (block + 1) * block_size);
    int64_t at = table[block] * block_stride + (pos - block * block_size) * row_stride;
    for (; pos < end; ++pos, at += row_stride) offset[pos - task.begin] = at;
  }
  const TaskView<TC> view{s.q.data(), key_cache, value_cache, offset, n, g.kv_heads, g.group, g.head_dim, soft_cap};
  attend_any(view, s.scores.data(), s.acc.data(), s.maxes.data(), s.sums.data());
}

template <typename T>
void store_row(T* dst, const float* src, float factor, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i] * factor);
}

// The first position a decode over a context of len positions attends: len - window with a window (> 0).
inline int64_t first_visible(int64_t len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, len - window) : 0;
}

// Tasks for every sequence: the attended part of a context, [first_visible, len), is split into near-equal
// partitions when longer than the partition length; every partition but the first starts on a block boundary.
// Tasks of one sequence are adjacent, in context order.
std::vector<Task> plan(const std::vector<int64_t>& lens, int64_t window, const Geometry& g, int64_t* num_partials) {
  int64_t total = 0;
  for (int64_t len : lens) total += len - first_visible(len, window);
  const int64_t target = kTasksPerThread * at::get_num_threads();
  const int64_t limit = std::max(kMinPartition, (total + target - 1) / target);
  std::vector<Task> tasks;
  *num_partials = 0;
  for (int64_t i = 0; i < g.batch; ++i) {
    const int64_t len = lens[i];
    if (len == 0) continue;
    const int64_t first = first_visible(len, window);
    const int64_t aligned = first / g.block_size * g.block_size;
    const int64_t parts = (len - first + limit - 1) / limit;
    const int64_t blocks = (len - aligned + g.block_size - 1) / g.block_size;
    const int64_t part = (blocks + parts - 1) / parts * g.block_size;
    for (int64_t begin = first; begin < len; begin = (begin - aligned) / part * part + part + aligned) {
      const int64_t end = std::min(len, (begin - aligned) / part * part + part + aligned);
      tasks.push_back({i, begin, end, parts > 1 ? (*num_partials)++ : -1});
    }
  }
  return tasks;
}

template <typename T, typename TC>
void paged_decode_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& block_tables,
                       const std::vector<int64_t>& lens, float scale, int64_t window, float soft_cap,
                       const Geometry& g) {
  int64_t num_partials = 0;
  const std::vector<Task> tasks = plan(lens, window, g, &num_partials);
  const int64_t hd = g.heads * g.head_dim;
  // Partial results: [num_partials, heads] max and sum, [num_partials, heads, head_dim] accumulators.
  std::vector<float> part_max(num_partials * g.heads), part_sum(num_partials * g.heads);
  std::vector<float> part_acc(num_partials * hd);
  T* out_ptr = out.data_ptr<T>();
  const T* q_ptr = query.data_ptr<T>();
  const TC* k_ptr = key_cache.data_ptr<TC>();
  const TC* v_ptr = value_cache.data_ptr<TC>();
  const int32_t* table_ptr = block_tables.data_ptr<int32_t>();

  // Longest first, one at a time: contexts differ in length, and behind a server a thread may be preempted mid-step
  // (parallel_passes.h), so the last tasks handed out are the shortest ones.
  std::vector<int64_t> order(tasks.size());
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return tasks[a].end - tasks[a].begin > tasks[b].end - tasks[b].begin;
  });
  conveyor_cpu::parallel_passes(static_cast<int64_t>(order.size()), [&](int64_t p) {
    thread_local Scratch s;
    const Task& task = tasks[order[p]];
    run_task(task, q_ptr, k_ptr, v_ptr, table_ptr, scale, soft_cap, g, s);
    if (task.partial < 0) {
      for (int64_t h = 0; h < g.heads; ++h) {
        store_row(out_ptr + task.seq * hd + h * g.head_dim, s.acc.data() + h * g.head_dim, 1.f / s.sums[h],
                  g.head_dim);
      }
    } else {
      std::copy_n(s.maxes.begin(), g.heads, part_max.begin() + task.partial * g.heads);
      std::copy_n(s.sums.begin(), g.heads, part_sum.begin() + task.partial * g.heads);
      std::copy_n(s.acc.begin(), hd, part_acc.begin() + task.partial * hd);
    }
  });

  // Merge split contexts: the partials of one sequence are rescaled to their common max.
  std::vector<float> merged(g.head_dim);
  for (size_t i = 0; i < tasks.size();) {
    size_t j = i + 1;
    while (j < tasks.size() && tasks[j].seq == tasks[i].seq) ++j;
    if (tasks[i].partial >= 0) {
      for (int64_t h = 0; h < g.heads; ++h) {
        float m = -std::numeric_limits<float>::infinity();
        for (size_t p = i; p < j; ++p) m = std::max(m, part_max[tasks[p].partial * g.heads + h]);
        float sum = 0.f;
        std::fill(merged.begin(), merged.end(), 0.f);
        for (size_t p = i; p < j; ++p) {
          const int64_t slot = tasks[p].partial * g.heads + h;
          const float w = std::exp(part_max[slot] - m);
          sum += w * part_sum[slot];
          const float* acc = part_acc.data() + slot * g.head_dim;
          for (int64_t d = 0; d < g.head_dim; ++d) merged[d] += w * acc[d];
        }
        store_row(out_ptr + tasks[i].seq * hd + h * g.head_dim, merged.data(), 1.f / sum, g.head_dim);
      }
    }
    i = j;
  }

  // A sequence with an empty context has nothing to attend to: zeros rather than 0/0.
  for (int64_t i = 0; i < g.batch; ++i) {
    if (lens[i] == 0) std::fill_n(out_ptr + i * hd, hd, static_cast<T>(0));
  }
}

bool is_attention_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

void check_cache(const at::Tensor& cache, const char* name) {
  TORCH_CHECK(cache.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(cache.dim() == 4, name, " must be [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(cache.is_contiguous(), name, " must be contiguous");
}

// Host copies of seq_lens, checked against the table width; every table entry a sequence uses must name a
// real block (entries past its last block, or before its window's first, may hold anything and are never read).
std::vector<int64_t> checked_lens(const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t window,
                                  const Geometry& g) {
  const int32_t* lens_ptr = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  std::vector<int64_t> lens(g.batch);
  for (int64_t i = 0; i < g.batch; ++i) {
    lens[i] = lens_ptr[i];
    TORCH_CHECK(lens[i] >= 0 && lens[i] <= g.max_blocks * g.block_size, "seq_lens[", i, "] = ", lens[i],
                " is outside [0, max_blocks * block_size = ", g.max_blocks * g.block_size, "]");
    const int64_t used = (lens[i] + g.block_size - 1) / g.block_size;
    for (int64_t b = first_visible(lens[i], window) / g.block_size; b < used; ++b) {
      const int64_t block = tables[i * g.max_blocks + b];
      TORCH_CHECK(block >= 0 && block < g.num_blocks, "block_tables[", i, ", ", b, "] = ", block,
                  " is not a block of the cache (", g.num_blocks, " blocks)");
    }
  }
  return lens;
}

void paged_decode(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                  double scale, int64_t sliding_window, double soft_cap) {
  TORCH_CHECK(query.device().is_cpu() && out.device().is_cpu(), "query and out must be CPU tensors");
  TORCH_CHECK(sliding_window >= 0 && soft_cap >= 0, "sliding_window and soft_cap must be >= 0 (0: none)");
  TORCH_CHECK(query.dim() == 3, "query must be [batch, num_heads, head_dim], got ", query.sizes());
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous(), "query and out must be contiguous");
  TORCH_CHECK(out.sizes() == query.sizes(), "out ", out.sizes(), " must match query ", query.sizes());
  TORCH_CHECK(is_attention_dtype(query.scalar_type()), "query dtype must be float32, bfloat16 or float16, got ",
              query.scalar_type());
  check_cache(key_cache, "key_cache");
  check_cache(value_cache, "value_cache");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "key_cache ", key_cache.sizes(),
              " and value_cache ", value_cache.sizes(), " differ in shape");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "out must have query's dtype ", query.scalar_type(),
              ", got ", out.scalar_type());
  TORCH_CHECK(conveyor_cpu::is_cache_dtype(key_cache.scalar_type()) &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "key_cache and value_cache must share one dtype of float32, bfloat16, float16, float8_e4m3fn or "
              "float8_e5m2, got ", key_cache.scalar_type(), " and ", value_cache.scalar_type());
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(),
              "block_tables must be a contiguous int32 [batch, max_blocks] tensor");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(),
              "seq_lens must be a contiguous int32 [batch] tensor");
  TORCH_CHECK(block_tables.device().is_cpu() && seq_lens.device().is_cpu(),
              "block_tables and seq_lens must be CPU tensors");
  Geometry g{};
  g.batch = query.size(0);
  g.heads = query.size(1);
  g.head_dim = query.size(2);
  g.num_blocks = key_cache.size(0);
  g.block_size = key_cache.size(1);
  g.kv_heads = key_cache.size(2);
  g.max_blocks = block_tables.size(1);
  TORCH_CHECK(key_cache.size(3) == g.head_dim, "cache head_dim ", key_cache.size(3), " != query head_dim ",
              g.head_dim);
  TORCH_CHECK(g.kv_heads > 0 && g.heads % g.kv_heads == 0, "num_heads ", g.heads,
              " must be a multiple of num_kv_heads ", g.kv_heads);
  TORCH_CHECK(g.block_size > 0, "block_size must be positive");
  TORCH_CHECK(block_tables.size(0) == g.batch && seq_lens.size(0) == g.batch, "block_tables and seq_lens need ",
              g.batch, " rows (one per query)");
  g.group = g.heads / g.kv_heads;
  if (g.batch == 0) return;
  const std::vector<int64_t> lens = checked_lens(block_tables, seq_lens, sliding_window, g);
  // The cache may be narrower than the queries (a bf16 or fp8 cache for an fp32 model): any pair.
  conveyor_cpu::with_attention_dtype(query.scalar_type(), [&](auto q_tag) {
    conveyor_cpu::with_cache_dtype(key_cache.scalar_type(), [&](auto c_tag) {
      paged_decode_impl<typename decltype(q_tag)::type, typename decltype(c_tag)::type>(
          out, query, key_cache, value_cache, block_tables, lens, scale, sliding_window,
          static_cast<float>(soft_cap), g);
    });
  });
}

// write_kv_cache's rows from TS into a TC cache, element by element (c10's conversions round to nearest even;
// fp8 saturates, conveyor_cpu::to_cache).
template <typename TS, typename TC>
void write_converted(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                     const int64_t* slot_ptr, int64_t tokens, int64_t row) {
  const TS* k_src = key.data_ptr<TS>();
  const TS* v_src = value.data_ptr<TS>();
  TC* k_dst = key_cache.data_ptr<TC>();
  TC* v_dst = value_cache.data_ptr<TC>();
  const int64_t k_stride = key.stride(0), v_stride = value.stride(0);
  at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slot_ptr[t] < 0) continue;
      conveyor_cpu::convert_row(k_src + t * k_stride, k_dst + slot_ptr[t] * row, row);
      conveyor_cpu::convert_row(v_src + t * v_stride, v_dst + slot_ptr[t] * row, row);
    }
  });
}

// cache[slot // block_size, slot % block_size] = key/value rows; slot < 0 skips the token. Rows of key/value may
// be strided (views of a fused qkv projection) as long as each row's [num_kv_heads, head_dim] is contiguous.
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
                    const at::Tensor& slot_mapping) {
  check_cache(key_cache, "key_cache");
  check_cache(value_cache, "value_cache");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "key_cache and value_cache differ in shape");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous()
              && slot_mapping.device().is_cpu(), "slot_mapping must be a contiguous int64 [num_tokens] CPU tensor");
  const int64_t tokens = slot_mapping.size(0);
  const int64_t row = key_cache.size(2) * key_cache.size(3);
  const int64_t slots = key_cache.size(0) * key_cache.size(1);
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 3 && t->size(0) == tokens && t->size(1) == key_cache.size(2)
                && t->size(2) == key_cache.size(3), "key/value must be [num_tokens, num_kv_heads, head_dim] "
                "matching the cache, got ", t->sizes());
    TORCH_CHECK(t->stride(2) == 1 && (t->stride(1) == key_cache.size(3) || t->size(1) == 1),
                "each token's [num_kv_heads, head_dim] of key/value must be contiguous");
    TORCH_CHECK(is_attention_dtype(t->scalar_type()), "key/value dtype must be float32, bfloat16 or float16, got ",
                t->scalar_type());
  }
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "key and value must share a dtype");
  TORCH_CHECK(conveyor_cpu::is_cache_dtype(key_cache.scalar_type()) &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "key_cache and value_cache must share one dtype of float32, bfloat16, float16, float8_e4m3fn or "
              "float8_e5m2");
  const int64_t* slot_ptr = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot_ptr[t] < slots, "slot_mapping[", t, "] = ", slot_ptr[t], " is past the cache (", slots,
                " slots)");
  }
  if (key.scalar_type() != key_cache.scalar_type()) {
    // A cache narrower (or wider) than the model: each row converts on the way in (round to nearest even).
    return conveyor_cpu::with_attention_dtype(key.scalar_type(), [&](auto src_tag) {
      conveyor_cpu::with_cache_dtype(key_cache.scalar_type(), [&](auto dst_tag) {
        write_converted<typename decltype(src_tag)::type, typename decltype(dst_tag)::type>(
            key, value, key_cache, value_cache, slot_ptr, tokens, row);
      });
    });
  }
  const int64_t bytes = row * key_cache.element_size();
  const auto* k_src = static_cast<const char*>(key.data_ptr());
  const auto* v_src = static_cast<const char*>(value.data_ptr());
  auto* k_dst = static_cast<char*>(key_cache.data_ptr());
  auto* v_dst = static_cast<char*>(value_cache.data_ptr());
  const int64_t k_stride = key.stride(0) * key.element_size(), v_stride = value.stride(0) * value.element_size();
  // A decode step writes a handful of rows: a plain loop beats a parallel region's fork; a prefill's thousands
  // of rows are worth spreading.
  at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slot_ptr[t] < 0) continue;
      std::memcpy(k_dst + slot_ptr[t] * bytes, k_src + t * k_stride, bytes);
      std::memcpy(v_dst + slot_ptr[t] * bytes, v_src + t * v_stride, bytes);
    }
  });
}

}  // namespace

// Also as torch ops, so C++ callers (decode_stack_cpu.cpp) reach them through the dispatcher.
TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("paged_decode(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, int sliding_window=0, float soft_cap=0.0) -> ()");
  m.def("write_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(conveyor_cpu, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("write_kv_cache", &write_kv_cache);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "Paged decode attention (one query token per sequence)", py::arg("out"),
        py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("sliding_window") = 0, py::arg("soft_cap") = 0.0);
  m.def("write_kv_cache", &write_kv_cache, "Scatter key/value rows into the paged caches (slot < 0 skips)",
        py::arg("key"), py::arg("value"), py::arg("key_cache"), py::arg("value_cache"), py::arg("slot_mapping"));
}
