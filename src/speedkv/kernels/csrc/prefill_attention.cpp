// Causal prefill attention in bfloat16 on CPUs with AVX512-BF16 (flash-style, one pass).
//
// torch's CPU kernel for bfloat16 attention reaches about a third of what this CPU's
// bfloat16 dot-product instruction (vdpbf16ps: 32 products a cycle, float32 sums) can do.
// Here both products of attention run on that instruction directly:
//   scores = Q K^T   with K packed so 16 keys' pairs of dimensions fill one register;
//   out   += P V     with V packed so 16 dimensions of a pair of keys fill one register.
// Each task is a block of kRows queries of every query head that shares one KV head; it walks
// the key blocks they may see, keeping a running max and sum per row (online softmax), so the
// score matrix is never held whole. Scores, softmax and the output sums are float32; the
// probabilities are rounded to bfloat16 for the second product, as GPU flash kernels do, so
// the softmax's exponential needs only float32 to about 1e-4 (a short polynomial). Tasks are
// handed out from a shared counter, longest first, because causal blocks differ in cost.
// On CPUs with AMX (Intel Xeon since Sapphire Rapids) both products run on its tile unit
// instead: the packed layouts above are already the ones its bfloat16 tile product takes
// (pairs of dimensions of 16 keys per row for Q K^T, pairs of keys of 16 dimensions per row for
// P V), so only the two product steps differ; softmax is the same code. One tile instruction
// computes a 16 x 16 x 32 product, 16 of the dot-product instruction's. The tile unit works
// apart from the vector unit, so its products for the neighbouring blocks are handed to it
// between the softmax's rows (walk_on_tiles): 7-15 % less time at 2K-8K tokens than one step
// after the other on an Intel Xeon (Sapphire Rapids class), with the same bits.
// Built with -march=native: the compiler's macros say whether this CPU has the instructions.
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512DQ__)
#define SPEEDKV_BF16_PREFILL
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define SPEEDKV_AMX_PREFILL
#endif
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#ifdef SPEEDKV_BF16_PREFILL
#include "bf16_pairs.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#ifdef SPEEDKV_AMX_PREFILL
#include "amx_tiles.h"
#endif

namespace {

using speedkv::bf16;
using speedkv::load_pairs;
using speedkv::pair_of;
using speedkv::store_rounded;
#ifdef SPEEDKV_AMX_PREFILL
using speedkv::amx_granted;
using speedkv::configure_tiles;
using speedkv::load_sums_2x2;
using speedkv::product_2x2;
using speedkv::store_sums_2x2;
using speedkv::zero_sums_2x2;
#endif
constexpr int64_t kRows = 32;  // queries per task
constexpr int64_t kKeys = 64;  // keys per block: four registers of 16 scores
// keys per block on the tile unit: longer blocks spread each row's reductions over more keys
constexpr int64_t kTileKeys = 128;
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

// A buffer on a 64-byte boundary, so that each tile row and each 16 floats the AVX512 code
// reads is one cache line, not two (malloc promises 16 bytes).
template <typename T>
class Aligned {
 public:
  explicit Aligned(int64_t n)
      : data_(static_cast<T*>(std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64))) {
    TORCH_CHECK(data_ != nullptr, "out of memory for attention buffers");
  }
  ~Aligned() { std::free(data_); }
  Aligned(const Aligned&) = delete;
  Aligned& operator=(const Aligned&) = delete;
  T* data() { return data_; }

 private:
  T* data_;
};

// K of one KV head as tiles of 16 keys: [tile][dim / 2][16 keys][2], zero past the last key.
void pack_keys(const bf16* k, int64_t row_stride, int64_t n, int64_t dim, int64_t padded,
               bf16* out) {
  const int64_t pairs = dim / 2;
  for (int64_t t = 0; t < padded / 16; ++t)
    for (int64_t p = 0; p < pairs; ++p)
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t key = t * 16 + j;
        bf16* dst = out + ((t * pairs + p) * 16 + j) * 2;
        if (key < n) {
          dst[0] = k[key * row_stride + 2 * p];
          dst[1] = k[key * row_stride + 2 * p + 1];
        } else {
          dst[0] = dst[1] = bf16(0.f);
        }
      }
}

// V of one KV head as pairs of keys: [key / 2][dim][2], zero past the last key.
void pack_values(const bf16* v, int64_t row_stride, int64_t n, int64_t dim, int64_t padded,
                 bf16* out) {
  for (int64_t j2 = 0; j2 < padded / 2; ++j2)
    for (int64_t e = 0; e < 2; ++e) {
      const int64_t key = 2 * j2 + e;
      for (int64_t d = 0; d < dim; ++d)
        out[(j2 * dim + d) * 2 + e] = key < n ? v[key * row_stride + d] : bf16(0.f);
    }
}

// scores[r][j] = q_r . k_j (scaled in soften_block) for kRows queries and the kKeys keys of one
// block, four queries at a time against the block's four tiles of 16 keys (16 accumulators).
template <int C>
void score_block(const bf16* q, const bf16* keys, float* scores) {
  constexpr int64_t pairs = C * 8;  // dim / 2
  constexpr int64_t dim = C * 16;
  for (int64_t r = 0; r < kRows; r += 4) {
    __m512 acc[4][4];
    for (auto& row : acc)
      for (auto& a : row) a = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      __m512bh k[4];
      for (int t = 0; t < 4; ++t) k[t] = load_pairs(keys + ((t * pairs + p) * 16) * 2);
      for (int i = 0; i < 4; ++i) {
        const __m512bh qi = pair_of(q + (r + i) * dim + 2 * p);
        for (int t = 0; t < 4; ++t) acc[i][t] = _mm512_dpbf16_ps(acc[i][t], qi, k[t]);
      }
    }
    for (int i = 0; i < 4; ++i)
      for (int t = 0; t < 4; ++t)
        _mm512_storeu_ps(scores + (r + i) * kKeys + t * 16, acc[i][t]);
  }
}

// out[r] += sum_j probs[r][j] * v_j over one block of keys; R rows at a time, C registers of
// 16 output dimensions each, held in registers across the block.
template <int C>
void add_values(const bf16* probs, const bf16* values, float* out) {
  constexpr int R = C >= 8 ? 2 : (C >= 4 ? 4 : 8);
  constexpr int64_t dim = C * 16;
  for (int64_t r = 0; r < kRows; r += R) {
    __m512 acc[R][C];
    for (int i = 0; i < R; ++i)
      for (int c = 0; c < C; ++c) acc[i][c] = _mm512_loadu_ps(out + (r + i) * dim + c * 16);
    for (int64_t j2 = 0; j2 < kKeys / 2; ++j2) {
      __m512bh v[C];
      for (int c = 0; c < C; ++c) v[c] = load_pairs(values + (j2 * dim + c * 16) * 2);
      for (int i = 0; i < R; ++i) {
        const __m512bh p = pair_of(probs + (r + i) * kKeys + 2 * j2);
        for (int c = 0; c < C; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], p, v[c]);
      }
    }
    for (int i = 0; i < R; ++i)
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + (r + i) * dim + c * 16, acc[i][c]);
  }
}

#ifdef SPEEDKV_AMX_PREFILL
// score_block on the tile unit, a quarter at a time: the kRows (32) queries against 32 keys (two
// tiles of 16), fed 32 dimensions per step.
template <int C>
void score_quarter_amx(const bf16* q, const bf16* keys, float* scores, int64_t quarter) {
  static_assert(kRows == 32, "the tile blocking covers 32 query rows");
  constexpr int64_t pairs = C * 8, dim = C * 16;
  constexpr int64_t q_stride = dim * sizeof(bf16), key_tile = pairs * 16 * 2 * sizeof(bf16);
  const int64_t first = quarter * 32;
  zero_sums_2x2();
  const bf16* tiles = keys + first * dim;  // its two tiles of 16 keys
  for (int64_t chunk = 0; chunk < dim / 32; ++chunk)
    product_2x2(q + chunk * 32, q_stride, 16 * q_stride, tiles + chunk * 16 * 32, 64,
                key_tile);
  store_sums_2x2(scores + first, kTileKeys * sizeof(float));
}

template <int C>
void score_block_amx(const bf16* q, const bf16* keys, float* scores) {
  for (int64_t quarter = 0; quarter < kTileKeys / 32; ++quarter)
    score_quarter_amx<C>(q, keys, scores, quarter);
}

// add_values on the tile unit, a chunk at a time: 32 output dimensions of the kRows rows, loaded
// from `out` into four sums tiles, fed 32 keys per step, stored back.
template <int C>
void add_values_chunk_amx(const bf16* probs, const bf16* values, float* out, int64_t chunk) {
  constexpr int64_t dim = C * 16;
  constexpr int64_t out_stride = dim * sizeof(float), probs_stride = kTileKeys * sizeof(bf16);
  constexpr int64_t value_stride = dim * 2 * sizeof(bf16);  // one pair of keys
  const int64_t d0 = chunk * 32;
  load_sums_2x2(out + d0, out_stride);
  for (int64_t k0 = 0; k0 < kTileKeys; k0 += 32)
    product_2x2(probs + k0, probs_stride, 16 * probs_stride,
                values + ((k0 / 2) * dim + d0) * 2, value_stride, 16 * 2 * sizeof(bf16));
  store_sums_2x2(out + d0, out_stride);
}

template <int C>
void add_values_amx(const bf16* probs, const bf16* values, float* out) {
  for (int64_t chunk = 0; chunk < C / 2; ++chunk)
    add_values_chunk_amx<C>(probs, values, out, chunk);
}
#endif  // SPEEDKV_AMX_PREFILL

// 2^t for float32 lanes, to about 1e-4 relative (the probabilities are then rounded to
// bfloat16, 4e-3): 2^(t - floor t) by a cubic, scaled by 2^floor(t) in one instruction (which
// takes t = -inf, a masked key, to exactly 0, when the cubic's argument stays finite: kMasked
// clamps it, for the blocks that have masked keys). ATen's exp spends about twice the
// instructions on accuracy this kernel rounds away.
template <bool kMasked>
inline __m512 exp2_lanes(__m512 t) {
  const __m512 x = kMasked ? _mm512_max_ps(t, _mm512_set1_ps(-127.f)) : t;
  const __m512 whole = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, whole);
  __m512 p = _mm512_set1_ps(0.0790857012f);  // least squares on [0, 1) at Chebyshev nodes
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.224516344f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.696390547f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.999896691f));
  return _mm512_scalef_ps(p, t);
}

// One row of probabilities 2^(t - max) from its scores (t = c * score), rounded to bfloat16;
// returns their float32 sums, 16 lanes.
template <bool kMasked, int64_t K>
inline __m512 exponentiate_row(const float* s, __m512 factor, __m512 shift, bf16* p) {
  __m512 total = _mm512_setzero_ps();
  for (int64_t t = 0; t < K; t += 16) {
    const __m512 e = exp2_lanes<kMasked>(_mm512_fmadd_ps(_mm512_loadu_ps(s + t), factor, shift));
    total = _mm512_add_ps(total, e);
    store_rounded(p + t, e);
  }
  return total;
}

// How far (in powers of 2) a row's scores may rise above its running max before the max is
// moved. Below it the max stays, so most blocks skip the row's horizontal max, the rescaling
// of its output sums and its scalar exponential; probabilities stay below 2^kSlack, far inside
// float32 and bfloat16's range.
constexpr float kSlack = 8.f;

// Rows of the block's dot products become bfloat16 2^(c * dot - running max), c the scale
// times log2(e), so the softmax's exponential is one 2^t; the running max (in those units),
// the running sums (16 lanes a row, added up at the end) and the output rows so far follow
// it when it moves. `between(i)` runs before every fourth row (i = 0..7): the tile unit's
// work for other blocks, handed in there so that it runs beside this vector work.
struct Nothing {
  void operator()(int64_t) const {}
};

template <int C, int64_t K, typename Between = Nothing>
void soften_block(float* scores, const int64_t* last_key, int64_t first_key, float c,
                  float* m, __m512* l, float* out, bf16* probs,
                  const Between& between = Between()) {
  static_assert(kRows == 32, "eight slots for other work, one every four rows");
  constexpr int64_t dim = C * 16;
  const __m512 factor = _mm512_set1_ps(c);
  for (int64_t r = 0; r < kRows; ++r) {
    if (r % 4 == 0) between(r / 4);
    float* s = scores + r * K;
    const int64_t visible = last_key[r] - first_key + 1;  // keys of this block the row sees
    for (int64_t j = std::max<int64_t>(visible, 0); j < K; ++j) s[j] = kMinusInf;
    __m512 top = _mm512_loadu_ps(s);
    for (int64_t t = 16; t < K; t += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + t));
    top = _mm512_mul_ps(top, factor);  // c > 0: the max of the scaled scores
    if (_mm512_cmp_ps_mask(top, _mm512_set1_ps(m[r] + kSlack), _CMP_GT_OQ) != 0) {
      const float peak = _mm512_reduce_max_ps(top);
      const float alpha = std::exp2(m[r] - peak);  // 0 on a row's first visible block
      l[r] = _mm512_mul_ps(l[r], _mm512_set1_ps(alpha));
      const __m512 by = _mm512_set1_ps(alpha);
      float* o = out + r * dim;
      for (int i = 0; i < C; ++i)
        _mm512_storeu_ps(o + i * 16, _mm512_mul_ps(by, _mm512_loadu_ps(o + i * 16)));
      m[r] = peak;
    }
    bf16* p = probs + r * K;
    if (m[r] == kMinusInf) {  // nothing visible yet (a padding row): contributes nothing
      std::fill(p, p + K, bf16(0.f));
      continue;
    }
    const __m512 shift = _mm512_set1_ps(-m[r]);
    l[r] = _mm512_add_ps(l[r], visible < K ? exponentiate_row<true, K>(s, factor, shift, p)
                                           : exponentiate_row<false, K>(s, factor, shift, p));
  }
}

// One task's state as it walks its key blocks: the rows of each query head of the group, the
// KV head's packed keys and values, and per head the output sums, running max and sum.
struct Walk {
  const bf16* q_rows;  // [group][kRows][dim]
  const bf16* keys;    // the KV head's packed keys and values, from its first block
  const bf16* values;
  float* acc;  // [group][kRows][dim]
  float* m;    // [group][kRows]
  __m512* l;   // [group][kRows]
  const int64_t* last_key;
  int64_t key_blocks, group;
  float factor;
};

// On the vector unit: per block, and per query head of the group, scores, softmax and values in
// turn.
template <int C>
void walk_on_vectors(const Walk& w, float* scores, bf16* probs) {
  constexpr int64_t dim = C * 16;
  for (int64_t kb = 0; kb < w.key_blocks; ++kb)
    for (int64_t g = 0; g < w.group; ++g) {
      float* g_acc = w.acc + g * kRows * dim;
      score_block<C>(w.q_rows + g * kRows * dim, w.keys + kb * kKeys * dim, scores);
      soften_block<C, kKeys>(scores, w.last_key, kb * kKeys, w.factor, w.m + g * kRows,
                             w.l + g * kRows, g_acc, probs);
      add_values<C>(probs, w.values + kb * kKeys * dim, g_acc);
    }
}

#ifdef SPEEDKV_AMX_PREFILL
// On the tile unit, the same steps (a step: one block for one query head) in a pipeline. The
// tile unit computes apart from the vector unit, so while the vector unit turns step s's scores
// into probabilities, the tile unit is handed the scores of step s + 1 and the values of step
// s - 1, a quarter or a chunk at a time between its rows (scores and probabilities are double
// buffered). Bit for bit the sums of the plain order: each step's own arithmetic is unchanged.
// With one query head per KV head, consecutive steps add to the same output rows, which step
// s's softmax may rescale, so there the values wait for it.
template <int C>
void walk_on_tiles(const Walk& w, float* scores, bf16* probs) {
  constexpr int64_t dim = C * 16, block = kRows * kTileKeys;
  const int64_t steps = w.key_blocks * w.group;
  const bool values_beside = w.group > 1;
  auto rows_of = [&](int64_t s) { return w.q_rows + (s % w.group) * kRows * dim; };
  auto keys_of = [&](int64_t s) { return w.keys + (s / w.group) * kTileKeys * dim; };
  auto values_of = [&](int64_t s) { return w.values + (s / w.group) * kTileKeys * dim; };
  auto acc_of = [&](int64_t s) { return w.acc + (s % w.group) * kRows * dim; };
  score_block_amx<C>(rows_of(0), keys_of(0), scores);
  for (int64_t s = 0; s < steps; ++s) {
    float* step_scores = scores + (s % 2) * block;
    bf16* step_probs = probs + (s % 2) * block;
    auto between = [&](int64_t i) {
      if (i % 2 == 0 && s + 1 < steps)
        score_quarter_amx<C>(rows_of(s + 1), keys_of(s + 1), scores + ((s + 1) % 2) * block,
                             i / 2);
      else if (i % 2 == 1 && values_beside && s > 0 && i / 2 < C / 2)
        add_values_chunk_amx<C>(probs + ((s - 1) % 2) * block, values_of(s - 1), acc_of(s - 1),
                                i / 2);
    };
    const int64_t g = s % w.group;
    soften_block<C, kTileKeys>(step_scores, w.last_key, (s / w.group) * kTileKeys, w.factor,
                               w.m + g * kRows, w.l + g * kRows, acc_of(s), step_probs, between);
    if (!values_beside) add_values_amx<C>(step_probs, values_of(s), acc_of(s));
  }
  if (values_beside)
    add_values_amx<C>(probs + ((steps - 1) % 2) * block, values_of(steps - 1),
                      acc_of(steps - 1));
}
#endif  // SPEEDKV_AMX_PREFILL

template <int C, bool kTiles>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
         at::Tensor& out) {
  constexpr int64_t dim = C * 16;
  constexpr int64_t kBlock = kTiles ? kTileKeys : kKeys;  // keys per block
  const int64_t q_heads = q.size(0), n_q = q.size(1);
  const int64_t kv_heads = k.size(0), n_k = k.size(1), group = q_heads / kv_heads;
  const int64_t offset = n_k - n_q;  // query i sits at key position offset + i
  const int64_t padded = (n_k + kBlock - 1) / kBlock * kBlock;

  Aligned<bf16> keys(kv_heads * padded * dim), values(kv_heads * padded * dim);
  const bf16* k_data = k.data_ptr<bf16>();
  const bf16* v_data = v.data_ptr<bf16>();
  at::parallel_for(0, 2 * kv_heads, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t h = i / 2;
      if (i % 2 == 0)
        pack_keys(k_data + h * k.stride(0), k.stride(1), n_k, dim, padded,
                  keys.data() + h * padded * dim);
      else
        pack_values(v_data + h * v.stride(0), v.stride(1), n_k, dim, padded,
                    values.data() + h * padded * dim);
    }
  });

  // A task is a block of queries of every query head that shares one KV head, so each block
  // of keys and values is read once for the whole group while it is in the core's cache (at
  // 8K tokens a KV head's packed keys and values outgrow it). Longest tasks first: later query
  // blocks see more keys.
  const int64_t blocks = (n_q + kRows - 1) / kRows;
  std::vector<int64_t> order;
  order.reserve(blocks * kv_heads);
  for (int64_t b = blocks - 1; b >= 0; --b)
    for (int64_t h = 0; h < kv_heads; ++h) order.push_back(b * kv_heads + h);
  std::atomic<int64_t> next{0};
  const bf16* q_data = q.data_ptr<bf16>();
  bf16* out_data = out.data_ptr<bf16>();
  const float factor = static_cast<float>(scale * 1.4426950408889634);  // times log2(e)

  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    // per query head of the group: its rows, output sums, running max and sum; scores and
    // probabilities twice over on the tile unit (its pipeline holds two steps at once)
    constexpr int64_t kSteps = kTiles ? 2 : 1;
    Aligned<bf16> q_rows(group * kRows * dim), probs(kSteps * kRows * kBlock);
    Aligned<float> scores(kSteps * kRows * kBlock), acc(group * kRows * dim);
    std::vector<float> m(group * kRows);
    std::vector<__m512> l(group * kRows);
    std::vector<int64_t> last_key(kRows);
#ifdef SPEEDKV_AMX_PREFILL
    if constexpr (kTiles) configure_tiles();  // per thread: tile state is a thread's own
#endif
    for (int64_t i = next++; i < static_cast<int64_t>(order.size()); i = next++) {
      const int64_t block = order[i] / kv_heads, kv = order[i] % kv_heads;
      const int64_t first = block * kRows, rows = std::min(kRows, n_q - first);
      for (int64_t r = 0; r < kRows; ++r)
        last_key[r] = r < rows ? offset + first + r : -1;  // padding rows see nothing
      for (int64_t g = 0; g < group; ++g)
        for (int64_t r = 0; r < kRows; ++r) {
          bf16* dst = q_rows.data() + (g * kRows + r) * dim;
          const int64_t head = kv * group + g;
          if (r < rows)
            std::memcpy(dst, q_data + head * q.stride(0) + (first + r) * q.stride(1),
                        dim * sizeof(bf16));
          else
            std::fill(dst, dst + dim, bf16(0.f));
        }
      std::fill(m.begin(), m.end(), kMinusInf);
      std::fill(l.begin(), l.end(), _mm512_setzero_ps());
      std::fill(acc.data(), acc.data() + group * kRows * dim, 0.f);
      const Walk walk{q_rows.data(), keys.data() + kv * padded * dim,
                      values.data() + kv * padded * dim, acc.data(), m.data(), l.data(),
                      last_key.data(), (offset + first + rows - 1) / kBlock + 1, group, factor};
#ifdef SPEEDKV_AMX_PREFILL
      if constexpr (kTiles)
        walk_on_tiles<C>(walk, scores.data(), probs.data());
      else
#endif
        walk_on_vectors<C>(walk, scores.data(), probs.data());
      for (int64_t g = 0; g < group; ++g)
        for (int64_t r = 0; r < rows; ++r) {
          bf16* o = out_data + ((kv * group + g) * n_q + first + r) * dim;
          const float* sums = acc.data() + (g * kRows + r) * dim;
          const float inv = 1.f / _mm512_reduce_add_ps(l[g * kRows + r]);
          for (int64_t d = 0; d < dim; ++d) o[d] = bf16(sums[d] * inv);
        }
    }
#ifdef SPEEDKV_AMX_PREFILL
    if constexpr (kTiles) _tile_release();
#endif
  });
}

// Whether the products run on AMX tiles here: built for them, and the tile state granted.
bool on_tiles() {
#ifdef SPEEDKV_AMX_PREFILL
  return amx_granted();
#else
  return false;
#endif
}

template <int C>
void run_on_best_unit(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      double scale, at::Tensor& out) {
  if (on_tiles())
    run<C, true>(q, k, v, scale, out);
  else
    run<C, false>(q, k, v, scale, out);
}

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3,
              "q, k and v must be [heads, tokens, dim]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16,
              "bfloat16 only");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "CPU tensors only");
  TORCH_CHECK(k.sizes() == v.sizes(), "keys and values must have one shape");
  TORCH_CHECK(q.size(2) == k.size(2), "q and k must share head_dim");
  TORCH_CHECK(k.size(0) > 0 && q.size(0) % k.size(0) == 0,
              "query heads must be a multiple of KV heads");
  TORCH_CHECK(k.size(1) >= q.size(1), "queries are the last keys: need n_k >= n_q");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "rows must be contiguous");
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  if (q.size(1) == 0) return out;
  switch (q.size(2)) {
    case 32: run_on_best_unit<2>(q, k, v, scale, out); break;
    case 64: run_on_best_unit<4>(q, k, v, scale, out); break;
    case 128: run_on_best_unit<8>(q, k, v, scale, out); break;
    default: TORCH_CHECK(false, "head_dim must be 32, 64 or 128");
  }
  return out;
}

// Which unit runs the products here, for `speedkv doctor`.
std::string prefill_attention_unit() { return on_tiles() ? "AMX tiles" : "AVX512-BF16"; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(speedkv, m) {
  m.def("causal_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
  m.def("prefill_attention_unit() -> str", &prefill_attention_unit);
}

TORCH_LIBRARY_IMPL(speedkv, CPU, m) { m.impl("causal_attention", &causal_attention); }

#endif  // AVX512-BF16: without it the op is not registered and prefill keeps torch's kernel
