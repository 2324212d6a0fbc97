// Linear layers for decode on CPUs with AVX512-BF16: y = x W^T + b for a few rows of x.
//
// A decode step reads every weight once for one row per sequence, so its products are bound
// by how fast weights stream from memory. The weight is packed once so that one 64-byte load
// holds a pair of input features for 16 outputs ([N / 16][K / 2][16][2]), which is exactly
// what the bfloat16 dot-product instruction (vdpbf16ps) takes: each load feeds one
// instruction per row, outputs accumulate in float32 lanes with no horizontal sums, and the
// tiles of 16 outputs are split between threads. Results are rounded once, to bfloat16.
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512DQ__)
#define SPEEDKV_BF16_LINEAR
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#ifdef SPEEDKV_BF16_LINEAR
#include <cstdint>

#include "bf16_pairs.h"

namespace {

using speedkv::bf16;
using speedkv::load_pairs;
using speedkv::pair_of;
using speedkv::store_rounded;
constexpr int64_t kOut = 16;  // outputs per tile: one register of float32 sums
constexpr int64_t kRowsPerPass = 4;  // rows of x sharing each weight load

// [N, K] -> [N / 16][K / 2][16][2]
at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 &&
                  weight.device().is_cpu(),
              "the weight must be a bfloat16 CPU [out, in] matrix");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kOut == 0 && k % 2 == 0, "outputs must be a multiple of 16, inputs even");
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = at::empty({n / kOut, k / 2, kOut, 2}, w.options());
  const bf16* src = w.data_ptr<bf16>();
  bf16* dst = packed.data_ptr<bf16>();
  at::parallel_for(0, n / kOut, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t)
      for (int64_t p = 0; p < k / 2; ++p)
        for (int64_t j = 0; j < kOut; ++j)
          for (int64_t e = 0; e < 2; ++e)
            dst[((t * (k / 2) + p) * kOut + j) * 2 + e] = src[(t * kOut + j) * k + 2 * p + e];
  });
  return packed;
}

// R rows of x against one tile of 16 outputs; two accumulators a row (even and odd pairs)
// so consecutive instructions do not wait on each other.
template <int R>
inline void tile_rows(const bf16* x, int64_t k, const bf16* w, const float* bias, bf16* y,
                      int64_t n) {
  __m512 even[R], odd[R];
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  const int64_t pairs = k / 2;
  int64_t p = 0;
  for (; p + 1 < pairs; p += 2) {
    const __m512bh w0 = load_pairs(w + p * 2 * kOut);
    const __m512bh w1 = load_pairs(w + (p + 1) * 2 * kOut);
    for (int r = 0; r < R; ++r) {
      even[r] = _mm512_dpbf16_ps(even[r], pair_of(x + r * k + 2 * p), w0);
      odd[r] = _mm512_dpbf16_ps(odd[r], pair_of(x + r * k + 2 * p + 2), w1);
    }
  }
  if (p < pairs) {
    const __m512bh w0 = load_pairs(w + p * 2 * kOut);
    for (int r = 0; r < R; ++r) even[r] = _mm512_dpbf16_ps(even[r], pair_of(x + r * k + 2 * p), w0);
  }
  const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r)
    store_rounded(y + r * n, _mm512_add_ps(_mm512_add_ps(even[r], odd[r]), b));
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed,
                         const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.device().is_cpu() && x.is_contiguous(),
              "x must be a contiguous bfloat16 CPU tensor");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kOut && packed.size(3) == 2 &&
                  packed.scalar_type() == at::kBFloat16,
              "the weight must come from pack_linear_weight");
  const int64_t k = x.size(-1), n = packed.size(0) * kOut;
  TORCH_CHECK(packed.size(1) * 2 == k, "x has ", k, " features, the weight takes ",
              packed.size(1) * 2);
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "the bias must have one entry per output");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor y = at::empty(shape, x.options());
  const int64_t rows = x.numel() / k, tiles = n / kOut;
  const bf16* xs = x.data_ptr<bf16>();
  const bf16* ws = packed.data_ptr<bf16>();
  const float* bs = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  bf16* ys = y.data_ptr<bf16>();
  at::parallel_for(0, tiles, 4, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const bf16* w = ws + t * k * kOut;
      const float* b = bs != nullptr ? bs + t * kOut : nullptr;
      int64_t r = 0;
      for (; r + kRowsPerPass <= rows; r += kRowsPerPass)
        tile_rows<kRowsPerPass>(xs + r * k, k, w, b, ys + r * n + t * kOut, n);
      for (; r < rows; ++r) tile_rows<1>(xs + r * k, k, w, b, ys + r * n + t * kOut, n);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(speedkv, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(speedkv, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("packed_linear", &packed_linear);
}

#endif  // AVX512-BF16: without it the ops are not registered and decode keeps oneDNN
