// Decode attention for a batch of sequences in one call, on a CPU.
//
// Each sequence brings its own cache (a [kv_heads, n, head_dim] view, rows contiguous), so no
// shared or paged layout is needed. Every (sequence, KV head, block of cached tokens) is one
// task for torch's thread pool: a single sequence with 3 KV heads still keeps every core busy,
// and a batch is one call instead of a loop of small ones. The query heads that share a KV
// head are scored together, so each key and value row is read once. Blocks are merged by
// log-sum-exp. Scores, softmax and sums are float32 whatever the cache's dtype.
// ATen's vector types pick their instruction set from these macros; the library is compiled
// with -march=native, so the compiler's own macros say what this CPU has.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
constexpr int64_t kBlock = 256;  // cached tokens per task

inline Vec load_floats(const float* p) { return Vec::loadu(p); }
template <typename T>
inline Vec load_floats(const T* p) {
  Vec out;
  at::vec::load_to_float<T>(p, out);
  return out;
}

struct Task {
  int64_t seq, head, start, end, partial;
};

inline float add_lanes(const Vec& x) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, x);
}

// Asks the memory for a row of C vectors that is read soon. A decode step reads its cache from
// memory, not from the core's caches, and one stream of rows at a time leaves most of the
// memory bandwidth unused: the kernel keeps a second one in flight.
template <typename T, int C>
inline void prefetch_row(const T* row) {
  constexpr int64_t kLine = 64 / sizeof(T);  // elements of a cache line
  for (int64_t e = 0; e < C * kLanes; e += kLine) __builtin_prefetch(row + e, 0, 1);
}

// Scores of `count` keys for a tile of G query heads (C vectors a row, held in registers):
// each key row is read and widened once for the whole tile; the value rows, read next, are
// asked for meanwhile.
template <typename T, int C, int G>
void score_tile(const Vec* q, const T* k, const T* v, int64_t row_stride, int64_t count,
                float* scores, int64_t scores_stride) {
  for (int64_t t = 0; t < count; ++t) {
    const T* key = k + t * row_stride;
    prefetch_row<T, C>(v + t * row_stride);
    Vec row[C];
    for (int c = 0; c < C; ++c) row[c] = load_floats(key + c * kLanes);
    for (int g = 0; g < G; ++g) {
      Vec sum = q[g * C] * row[0];
      for (int c = 1; c < C; ++c) sum = at::vec::fmadd(q[g * C + c], row[c], sum);
      scores[g * scores_stride + t] = add_lanes(sum);
    }
  }
}

// The weighted sum of `count` value rows for a tile of G query heads, accumulated in registers.
// `next_keys`: the `next_count` rows the thread is likely to score next (the following
// block's keys), asked for meanwhile.
template <typename T, int C, int G>
void value_tile(const float* weights, int64_t weights_stride, const T* v, int64_t row_stride,
                int64_t count, float* acc, const T* next_keys, int64_t next_count) {
  Vec sums[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) sums[g][c] = Vec(0.f);
  for (int64_t t = 0; t < count; ++t) {
    const T* value = v + t * row_stride;
    if (t < next_count) prefetch_row<T, C>(next_keys + t * row_stride);
    Vec row[C];
    for (int c = 0; c < C; ++c) row[c] = load_floats(value + c * kLanes);
    for (int g = 0; g < G; ++g) {
      const Vec p(weights[g * weights_stride + t]);
      for (int c = 0; c < C; ++c) sums[g][c] = at::vec::fmadd(p, row[c], sums[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) sums[g][c].store(acc + (g * C + c) * kLanes);
}

// Turns scores into exp(score - max) in place; returns the max and the sum of the exps.
inline std::pair<float, float> soften(float* scores, int64_t count) {
  // the max in vectors: a scalar scan waits on each compare, about 3 cycles a score
  Vec peaks(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + kLanes <= count; t += kLanes)
    peaks = at::vec::maximum(peaks, Vec::loadu(scores + t));
  float peak = at::vec::vec_reduce_all<float>(
      [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, peaks);
  for (; t < count; ++t) peak = std::max(peak, scores[t]);
  Vec total(0.f);
  t = 0;
  for (; t + kLanes <= count; t += kLanes) {
    const Vec e = (Vec::loadu(scores + t) - Vec(peak)).exp_u20();
    e.store(scores + t);
    total = total + e;
  }
  float sum = add_lanes(total);
  for (; t < count; ++t) {
    scores[t] = std::exp(scores[t] - peak);
    sum += scores[t];
  }
  return {peak, sum};
}

// Query heads per register tile: C vectors of accumulators per head, 16 vectors in all.
template <int C>
constexpr int kTile = C >= 16 ? 1 : (16 / C > 4 ? 4 : 16 / C);

// One block of cached tokens for every query head of a group: m = the largest score,
// l = the sum of exp(score - m), acc = the sum of exp(score - m) * value. `q` holds the
// group's rows as C float vectors each, already scaled.
template <typename T, int C>
void attend_block(const Vec* q, const T* k, const T* v, int64_t row_stride, int64_t count,
                  int64_t next_count, int64_t group, float* scores, float* m, float* l,
                  float* acc) {
  for (int64_t g0 = 0; g0 < group; g0 += kTile<C>) {
    const int64_t tile = std::min<int64_t>(kTile<C>, group - g0);
    const Vec* qt = q + g0 * C;
    float* st = scores + g0 * count;
    float* at = acc + g0 * C * kLanes;
    // the tile's size is a template argument so its accumulators stay in registers
    switch (tile) {
#define SPEEDKV_TILE(G)                                                   \
  case G:                                                                 \
    if constexpr (G <= kTile<C>) {                                        \
      score_tile<T, C, G>(qt, k, v, row_stride, count, st, count);        \
      for (int g = 0; g < G; ++g)                                         \
        std::tie(m[g0 + g], l[g0 + g]) = soften(st + g * count, count);   \
      value_tile<T, C, G>(st, count, v, row_stride, count, at,           \
                          k + count * row_stride, next_count);            \
    }                                                                     \
    break;
      SPEEDKV_TILE(1)
      SPEEDKV_TILE(2)
      SPEEDKV_TILE(3)
      SPEEDKV_TILE(4)
#undef SPEEDKV_TILE
      default:
        TORCH_CHECK(false, "unreachable tile size");
    }
  }
}

template <typename T, int C>
void run(const at::Tensor& q, at::TensorList keys, at::TensorList values, double scale,
         at::Tensor& out) {
  const int64_t batch = q.size(0), q_heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = keys[0].size(0), group = q_heads / kv_heads;

  std::vector<Task> tasks;
  std::vector<int64_t> first(batch + 1, 0);  // partials of sequence b: [first[b], first[b+1])
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = keys[b].size(1);
    const int64_t blocks = std::max<int64_t>(1, (n + kBlock - 1) / kBlock);
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t j = 0; j < blocks; ++j)
        tasks.push_back({b, h, std::min(j * kBlock, n), std::min((j + 1) * kBlock, n),
                         first[b] + h * blocks + j});
    first[b + 1] = first[b] + kv_heads * blocks;
  }
  const int64_t partials = first[batch];
  constexpr int64_t chunks = C;
  std::vector<Vec> qv(batch * q_heads * chunks);
  std::vector<float> acc(partials * group * dim);
  std::vector<float> m(partials * group), l(partials * group);
  const T* q_data = q.data_ptr<T>();
  for (int64_t i = 0; i < batch * q_heads * chunks; ++i)
    qv[i] = load_floats(q_data + i * kLanes) * Vec(static_cast<float>(scale));

  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> scores(group * kBlock);
    for (int64_t i = lo; i < hi; ++i) {
      const Task& task = tasks[i];
      const at::Tensor& k = keys[task.seq];
      const at::Tensor& v = values[task.seq];
      const int64_t count = task.end - task.start;
      float* pm = m.data() + task.partial * group;
      float* pl = l.data() + task.partial * group;
      float* pacc = acc.data() + task.partial * group * dim;
      if (count == 0) {
        std::fill(pm, pm + group, -std::numeric_limits<float>::infinity());
        std::fill(pl, pl + group, 0.f);
        std::fill(pacc, pacc + group * dim, 0.f);
        continue;
      }
      const int64_t offset = task.head * k.stride(0) + task.start * k.stride(1);
      // the rows after this block in the same head, which the thread's next task reads
      const int64_t next_count = std::min(count, k.size(1) - task.end);
      attend_block<T, C>(qv.data() + (task.seq * q_heads + task.head * group) * chunks,
                   k.data_ptr<T>() + offset,
                   v.data_ptr<T>() + task.head * v.stride(0) + task.start * v.stride(1),
                   k.stride(1), count, next_count, group, scores.data(), pm, pl, pacc);
    }
  });

  T* out_data = out.data_ptr<T>();
  at::parallel_for(0, batch * q_heads, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> sum(dim);
    for (int64_t row = lo; row < hi; ++row) {
      const int64_t b = row / q_heads, qh = row % q_heads, h = qh / group, g = qh % group;
      const int64_t blocks = (first[b + 1] - first[b]) / kv_heads;
      const int64_t base = first[b] + h * blocks;
      float peak = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < blocks; ++j) peak = std::max(peak, m[(base + j) * group + g]);
      float total = 0.f;
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t j = 0; j < blocks; ++j) {
        const int64_t p = (base + j) * group + g;
        if (l[p] == 0.f) continue;
        const float w = std::exp(m[p] - peak);
        total += w * l[p];
        const float* a = acc.data() + p * dim;
        for (int64_t d = 0; d < dim; ++d) sum[d] += w * a[d];
      }
      T* o = out_data + row * dim;
      for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(total > 0.f ? sum[d] / total : 0.f);
    }
  });
}

// head_dim / kLanes as a template argument, for the register tiles.
template <typename T>
void run_dim(const at::Tensor& q, at::TensorList keys, at::TensorList values, double scale,
             at::Tensor& out) {
  switch (q.size(2) / kLanes) {
    case 2: run<T, 2>(q, keys, values, scale, out); break;
    case 4: run<T, 4>(q, keys, values, scale, out); break;
    case 8: run<T, 8>(q, keys, values, scale, out); break;
    case 16: run<T, 16>(q, keys, values, scale, out); break;
    default: TORCH_CHECK(false, "head_dim must be 2, 4, 8 or 16 times ", kLanes);
  }
}

at::Tensor decode_attention(const at::Tensor& q, at::TensorList keys, at::TensorList values,
                            double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [batch, heads, dim]");
  TORCH_CHECK(!keys.empty(), "at least one sequence");
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == q.size(0) &&
                  static_cast<int64_t>(values.size()) == q.size(0),
              "one key and one value tensor per sequence");
  const int64_t kv_heads = keys[0].size(0);
  TORCH_CHECK(q.size(1) % kv_heads == 0, "query heads must be a multiple of KV heads");
  for (size_t b = 0; b < keys.size(); ++b) {
    const at::Tensor& k = keys[b];
    const at::Tensor& v = values[b];
    TORCH_CHECK(k.dim() == 3 && k.size(0) == kv_heads && k.size(2) == q.size(2),
                "keys must be [kv_heads, n, dim]");
    TORCH_CHECK(v.sizes() == k.sizes() && v.strides() == k.strides(),
                "values must match keys in shape and layout");
    TORCH_CHECK(k.stride(2) == 1, "cache rows must be contiguous");
    TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                "q, keys and values must share a dtype");
    TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu(), "CPU tensors only");
  }
  at::Tensor out = at::empty_like(q);
  switch (q.scalar_type()) {
    case at::kFloat: run_dim<float>(q, keys, values, scale, out); break;
    case at::kBFloat16: run_dim<at::BFloat16>(q, keys, values, scale, out); break;
    case at::kHalf: run_dim<at::Half>(q, keys, values, scale, out); break;
    default: TORCH_CHECK(false, "float32, bfloat16 or float16 only");
  }
  return out;
}

}  // namespace

// The float lanes of this build's vectors: head_dim must be 2, 4, 8 or 16 times it (16 with
// AVX512, 8 with AVX2, 4 with NEON), which the engine checks before calling.
int64_t decode_attention_lanes() { return kLanes; }

// a fragment: every kernel is a library of its own, loaded or not on its own (core/native.py)
TORCH_LIBRARY_FRAGMENT(speedkv, m) {
  m.def("decode_attention(Tensor q, Tensor[] keys, Tensor[] values, float scale) -> Tensor");
  m.def("decode_attention_lanes() -> int", &decode_attention_lanes);
}

TORCH_LIBRARY_IMPL(speedkv, CPU, m) { m.impl("decode_attention", &decode_attention); }
