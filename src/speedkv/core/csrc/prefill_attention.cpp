// Causal prefill attention in bfloat16 on CPUs with AVX512-BF16 (flash-style, one pass).
//
// torch's CPU kernel for bfloat16 attention reaches about a third of what this CPU's
// bfloat16 dot-product instruction (vdpbf16ps: 32 products a cycle, float32 sums) can do.
// Here both products of attention run on that instruction directly:
//   scores = Q K^T   with K packed so 16 keys' pairs of dimensions fill one register;
//   out   += P V     with V packed so 16 dimensions of a pair of keys fill one register.
// Each task is one query head and a block of kRows queries; it walks the key blocks it may
// see, keeping a running max and sum per row (online softmax), so the score matrix is never
// held whole. Scores, softmax and the output sums are float32; the probabilities are rounded
// to bfloat16 for the second product, as GPU flash kernels do. Tasks are handed out from a
// shared counter, longest first, because causal blocks differ in cost.
// Built with -march=native: the compiler's macros say whether this CPU has the instruction.
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512DQ__)
#define SPEEDKV_BF16_PREFILL
#define CPU_CAPABILITY_AVX512  // ATen's vector types use AVX512
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#ifdef SPEEDKV_BF16_PREFILL
#include <ATen/cpu/vec/vec.h>

#include "bf16_pairs.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
using speedkv::bf16;
using speedkv::load_pairs;
using speedkv::pair_of;
using speedkv::store_rounded;
constexpr int64_t kRows = 32;  // queries per task
constexpr int64_t kKeys = 64;  // keys per block: four registers of 16 scores
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

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

// scores[r][j] = scale * q_r . k_j for kRows queries and the kKeys keys of one block, four
// queries at a time against the block's four tiles of 16 keys (16 accumulators).
template <int C>
void score_block(const bf16* q, const bf16* keys, float scale, float* scores) {
  constexpr int64_t pairs = C * 8;  // dim / 2
  constexpr int64_t dim = C * 16;
  const __m512 factor = _mm512_set1_ps(scale);
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
        _mm512_storeu_ps(scores + (r + i) * kKeys + t * 16, _mm512_mul_ps(acc[i][t], factor));
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

inline float max_of(const float* x) {
  __m512 m = _mm512_loadu_ps(x);
  for (int64_t t = 16; t < kKeys; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + t));
  return _mm512_reduce_max_ps(m);
}

// Rows of the block's scores become bfloat16 exp(score - running max); the running max,
// running sum and the output rows so far are updated to the new max.
template <int C>
void soften_block(float* scores, const int64_t* last_key, int64_t first_key, float* m, float* l,
                  float* out, bf16* probs) {
  constexpr int64_t dim = C * 16;
  for (int64_t r = 0; r < kRows; ++r) {
    float* s = scores + r * kKeys;
    const int64_t visible = last_key[r] - first_key + 1;  // keys of this block the row sees
    for (int64_t j = std::max<int64_t>(visible, 0); j < kKeys; ++j) s[j] = kMinusInf;
    const float peak = std::max(m[r], max_of(s));
    bf16* p = probs + r * kKeys;
    if (peak == kMinusInf) {  // nothing visible yet (a padding row): contributes nothing
      std::fill(p, p + kKeys, bf16(0.f));
      continue;
    }
    const float alpha = std::exp(m[r] - peak);  // 0 on the first block (m = -inf)
    Vec total(0.f);
    for (int64_t t = 0; t < kKeys; t += 16) {
      const Vec e = (Vec::loadu(s + t) - Vec(peak)).exp_u20();
      total = total + e;
      store_rounded(p + t, static_cast<__m512>(e));
    }
    l[r] = l[r] * alpha + _mm512_reduce_add_ps(static_cast<__m512>(total));
    if (alpha != 1.f) {
      float* o = out + r * dim;
      const __m512 a = _mm512_set1_ps(alpha);
      for (int c = 0; c < C; ++c)
        _mm512_storeu_ps(o + c * 16, _mm512_mul_ps(a, _mm512_loadu_ps(o + c * 16)));
    }
    m[r] = peak;
  }
}

template <int C>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
         at::Tensor& out) {
  constexpr int64_t dim = C * 16;
  const int64_t q_heads = q.size(0), n_q = q.size(1);
  const int64_t kv_heads = k.size(0), n_k = k.size(1), group = q_heads / kv_heads;
  const int64_t offset = n_k - n_q;  // query i sits at key position offset + i
  const int64_t padded = (n_k + kKeys - 1) / kKeys * kKeys;

  std::vector<bf16> keys(kv_heads * padded * dim), values(kv_heads * padded * dim);
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

  // longest tasks first: later query blocks see more keys
  const int64_t blocks = (n_q + kRows - 1) / kRows;
  std::vector<int64_t> order;
  order.reserve(blocks * q_heads);
  for (int64_t b = blocks - 1; b >= 0; --b)
    for (int64_t h = 0; h < q_heads; ++h) order.push_back(b * q_heads + h);
  std::atomic<int64_t> next{0};
  const bf16* q_data = q.data_ptr<bf16>();
  bf16* out_data = out.data_ptr<bf16>();
  const float factor = static_cast<float>(scale);

  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<bf16> q_rows(kRows * dim), probs(kRows * kKeys);
    std::vector<float> scores(kRows * kKeys), acc(kRows * dim), m(kRows), l(kRows);
    std::vector<int64_t> last_key(kRows);
    for (int64_t i = next++; i < static_cast<int64_t>(order.size()); i = next++) {
      const int64_t block = order[i] / q_heads, head = order[i] % q_heads;
      const int64_t kv = head / group, first = block * kRows;
      const int64_t rows = std::min(kRows, n_q - first);
      for (int64_t r = 0; r < kRows; ++r) {
        bf16* dst = q_rows.data() + r * dim;
        if (r < rows)
          std::memcpy(dst, q_data + head * q.stride(0) + (first + r) * q.stride(1),
                      dim * sizeof(bf16));
        else
          std::fill(dst, dst + dim, bf16(0.f));
        last_key[r] = r < rows ? offset + first + r : -1;  // padding rows see nothing
      }
      std::fill(m.begin(), m.end(), kMinusInf);
      std::fill(l.begin(), l.end(), 0.f);
      std::fill(acc.begin(), acc.end(), 0.f);
      const int64_t key_blocks = (offset + first + rows - 1) / kKeys + 1;
      for (int64_t kb = 0; kb < key_blocks; ++kb) {
        score_block<C>(q_rows.data(), keys.data() + (kv * padded + kb * kKeys) * dim, factor,
                       scores.data());
        soften_block<C>(scores.data(), last_key.data(), kb * kKeys, m.data(), l.data(),
                        acc.data(), probs.data());
        add_values<C>(probs.data(), values.data() + (kv * padded + kb * kKeys) * dim,
                      acc.data());
      }
      for (int64_t r = 0; r < rows; ++r) {
        bf16* o = out_data + (head * n_q + first + r) * dim;
        const float inv = 1.f / l[r];
        for (int64_t d = 0; d < dim; ++d) o[d] = bf16(acc[r * dim + d] * inv);
      }
    }
  });
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
    case 32: run<2>(q, k, v, scale, out); break;
    case 64: run<4>(q, k, v, scale, out); break;
    case 128: run<8>(q, k, v, scale, out); break;
    default: TORCH_CHECK(false, "head_dim must be 32, 64 or 128");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(speedkv, m) {
  m.def("causal_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(speedkv, CPU, m) { m.impl("causal_attention", &causal_attention); }

#endif  // AVX512-BF16: without it the op is not registered and prefill keeps torch's kernel
