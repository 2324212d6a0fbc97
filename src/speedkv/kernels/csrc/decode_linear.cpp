// Linear layers for decode: y = x W^T + b for a few rows of x.
//
// A decode step reads every weight once for one row per sequence, so its products are bound
// by how fast weights stream from memory. The weight is packed once so that one load holds a
// pair of input features for 16 outputs ([N / 16][K / 2][16][2]), which is what the
// bfloat16 dot-product instruction (vdpbf16ps) takes: each load feeds one instruction per
// row, outputs accumulate in float32 lanes with no horizontal sums, and the tiles of 16
// outputs are split between threads. Results are rounded once, to bfloat16.
//
// int8 weights (one scale per output row, `--weights int8`) use the same layout at one byte a
// value: each load is widened to bfloat16 in registers (every int8 value is exact there),
// and the scale is applied to the float32 sums. Half the bytes for a few more instructions.
//
// CPUs with AVX2 and FMA but no AVX512-BF16 (AMD before Zen 4, most Intel client parts) read
// the same layout: a pair's two values are widened to float32 with a shift and a mask (a
// bfloat16 is the top half of a float32), and two fused multiply-adds take them. oneDNN takes
// no bfloat16 weights there, and torch's own bfloat16 product is a plain loop: a decode step's
// products took it 1.4x this kernel's time at one row and 4.3x at 8 (docs/engine.md).
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512DQ__)
#define SPEEDKV_BF16_LINEAR
#elif defined(__AVX2__) && defined(__FMA__)
#define SPEEDKV_AVX2_LINEAR
#endif
#if defined(SPEEDKV_BF16_LINEAR) || defined(SPEEDKV_AVX2_LINEAR)
#define SPEEDKV_PACKED_LINEAR
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#ifdef SPEEDKV_PACKED_LINEAR
#include <immintrin.h>

#include <cstdint>
#include <vector>

#ifdef SPEEDKV_BF16_LINEAR
#include "bf16_pairs.h"
#endif

namespace {

using bf16 = at::BFloat16;
constexpr int64_t kOut = 16;  // outputs per tile: one register of float32 sums
constexpr int64_t kRowsPerPass = 4;  // rows of x sharing each weight load
// How far ahead of its loads a thread asks for its weights (into L2). A layer's weights are a
// few MB, a stream too short for the hardware prefetcher to reach full speed: asking 16 KB
// ahead took 30 layers' products from 13.3-14.0 to 8.2-8.9 ms on an Intel Xeon with AMX
// (4 KB ahead: 9.6-9.9 ms; 32 KB: 9.3-10.6 ms).
constexpr int64_t kAheadBytes = 16384;

// [N, K] -> [N / 16][K / 2][16][2], any element type
at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu() &&
                  (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kChar),
              "the weight must be a bfloat16 or int8 CPU [out, in] matrix");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kOut == 0 && k % 2 == 0, "outputs must be a multiple of 16, inputs even");
  const at::Tensor w = weight.contiguous();
  return w.view({n / kOut, kOut, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

#ifdef SPEEDKV_BF16_LINEAR
using speedkv::load_pairs;
using speedkv::pair_of;
using speedkv::store_rounded;
using Input = bf16;  // x as the dot-product instruction takes it

// 16 pairs of weights as bfloat16 pairs.
inline __m512bh weight_pairs(const bf16* w) { return load_pairs(w); }
inline __m512bh weight_pairs(const int8_t* w) {
  const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
      reinterpret_cast<const __m128i*>(w))));
  const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
      reinterpret_cast<const __m128i*>(w + 16))));
  return _mm512_cvtne2ps_pbh(high, low);  // low's 16 values first
}

// R rows of x against one tile of 16 outputs; two accumulators a row (even and odd pairs)
// so consecutive instructions do not wait on each other. Sums times `scale` (int8 weights)
// plus `bias`, rounded once.
template <int R, typename W>
inline void tile_rows(const bf16* x, int64_t k, const W* w, const float* scale,
                      const float* bias, bf16* y, int64_t n) {
  __m512 even[R], odd[R];
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  const int64_t pairs = k / 2;
  int64_t p = 0;
  for (; p + 1 < pairs; p += 2) {
    // this step's bytes, kAheadBytes on (past the tile: the thread's next tile, or nothing)
    const char* ahead = reinterpret_cast<const char*>(w + p * 2 * kOut) + kAheadBytes;
    _mm_prefetch(ahead, _MM_HINT_T1);
    if constexpr (sizeof(W) == 2) _mm_prefetch(ahead + 64, _MM_HINT_T1);
    const __m512bh w0 = weight_pairs(w + p * 2 * kOut);
    const __m512bh w1 = weight_pairs(w + (p + 1) * 2 * kOut);
    for (int r = 0; r < R; ++r) {
      even[r] = _mm512_dpbf16_ps(even[r], pair_of(x + r * k + 2 * p), w0);
      odd[r] = _mm512_dpbf16_ps(odd[r], pair_of(x + r * k + 2 * p + 2), w1);
    }
  }
  if (p < pairs) {
    const __m512bh w0 = weight_pairs(w + p * 2 * kOut);
    for (int r = 0; r < R; ++r)
      even[r] = _mm512_dpbf16_ps(even[r], pair_of(x + r * k + 2 * p), w0);
  }
  const __m512 s = scale != nullptr ? _mm512_loadu_ps(scale) : _mm512_set1_ps(1.f);
  const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r)
    store_rounded(y + r * n, _mm512_fmadd_ps(_mm512_add_ps(even[r], odd[r]), s, b));
}
#else  // SPEEDKV_AVX2_LINEAR
using Input = float;  // x widened once per call: each value is broadcast to 8 lanes many times

// Pair p of 8 outputs as float32: the pairs' first values and their second values.
inline void widen(const bf16* w, __m256& first, __m256& second) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  first = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  second = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(~0xFFFF)));
}
inline void widen(const int8_t* w, __m256& first, __m256& second) {
  const __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  first = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 16));
  second = _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 16));
}

// R rows of x (float32) against one tile of 16 outputs (two registers of 8). With one or two
// rows the first and second values of each pair sum apart, so that enough independent
// multiply-adds are in flight to hide their latency. Rounded once, as torch rounds.
template <int R, typename W>
inline void tile_rows(const float* x, int64_t k, const W* w, const float* scale,
                      const float* bias, bf16* y, int64_t n) {
  constexpr int kSplit = R <= 2 ? 2 : 1;
  __m256 sums[R][2][kSplit];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h)
      for (int a = 0; a < kSplit; ++a) sums[r][h][a] = _mm256_setzero_ps();
  for (int64_t p = 0; p < k / 2; ++p) {
    const W* at = w + p * 2 * kOut;
    const char* ahead = reinterpret_cast<const char*>(at) + kAheadBytes;
    _mm_prefetch(ahead, _MM_HINT_T1);
    __m256 first[2], second[2];
    widen(at, first[0], second[0]);
    widen(at + kOut, first[1], second[1]);
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * k + 2 * p);
      const __m256 b = _mm256_broadcast_ss(x + r * k + 2 * p + 1);
      for (int h = 0; h < 2; ++h) {
        sums[r][h][0] = _mm256_fmadd_ps(first[h], a, sums[r][h][0]);
        sums[r][h][kSplit - 1] = _mm256_fmadd_ps(second[h], b, sums[r][h][kSplit - 1]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float out[kOut];
    for (int h = 0; h < 2; ++h) {
      __m256 total = sums[r][h][0];
      if constexpr (kSplit == 2) total = _mm256_add_ps(total, sums[r][h][1]);
      const __m256 s = scale != nullptr ? _mm256_loadu_ps(scale + 8 * h) : _mm256_set1_ps(1.f);
      const __m256 b = bias != nullptr ? _mm256_loadu_ps(bias + 8 * h) : _mm256_setzero_ps();
      _mm256_store_ps(out + 8 * h, _mm256_fmadd_ps(total, s, b));
    }
    for (int64_t o = 0; o < kOut; ++o) y[r * n + o] = bf16(out[o]);  // to nearest even
  }
}
#endif

template <typename W>
void run(const at::Tensor& x, const W* weights, const float* scale, const float* bias,
         int64_t n, at::Tensor& y) {
  const int64_t k = x.size(-1), rows = x.numel() / k;
#ifdef SPEEDKV_BF16_LINEAR
  const Input* xs = x.data_ptr<bf16>();
#else
  std::vector<Input> wide(x.data_ptr<bf16>(), x.data_ptr<bf16>() + rows * k);
  const Input* xs = wide.data();
#endif
  bf16* ys = y.data_ptr<bf16>();
  at::parallel_for(0, n / kOut, 4, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const W* w = weights + t * k * kOut;
      const float* s = scale != nullptr ? scale + t * kOut : nullptr;
      const float* b = bias != nullptr ? bias + t * kOut : nullptr;
      int64_t r = 0;
      for (; r + kRowsPerPass <= rows; r += kRowsPerPass)
        tile_rows<kRowsPerPass>(xs + r * k, k, w, s, b, ys + r * n + t * kOut, n);
      for (; r < rows; ++r) tile_rows<1>(xs + r * k, k, w, s, b, ys + r * n + t * kOut, n);
    }
  });
}

// One float32 entry per output, or an undefined tensor for none.
at::Tensor per_output(const c10::optional<at::Tensor>& values, int64_t n, const char* what) {
  if (!values.has_value() || !values->defined()) return {};
  TORCH_CHECK(values->numel() == n, what, " must have one entry per output");
  return values->to(at::kFloat).contiguous();
}

// x [..., K] bfloat16 times a weight from pack_linear_weight; `scale` (one per output) is
// required for int8 weights and refused for bfloat16 ones.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed,
                         const c10::optional<at::Tensor>& scale,
                         const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.device().is_cpu() && x.is_contiguous(),
              "x must be a contiguous bfloat16 CPU tensor");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kOut && packed.size(3) == 2 &&
                  packed.is_contiguous(),
              "the weight must come from pack_linear_weight");
  const int64_t k = x.size(-1), n = packed.size(0) * kOut;
  TORCH_CHECK(packed.size(1) * 2 == k, "x has ", k, " features, the weight takes ",
              packed.size(1) * 2);
  const bool int8 = packed.scalar_type() == at::kChar;
  TORCH_CHECK(int8 || packed.scalar_type() == at::kBFloat16, "bfloat16 or int8 weights only");
  const at::Tensor scales = per_output(scale, n, "the scale");
  TORCH_CHECK(int8 == scales.defined(), int8 ? "int8 weights need their scale"
                                             : "bfloat16 weights take no scale");
  const at::Tensor biases = per_output(bias, n, "the bias");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor y = at::empty(shape, x.options());
  const float* s = scales.defined() ? scales.data_ptr<float>() : nullptr;
  const float* b = biases.defined() ? biases.data_ptr<float>() : nullptr;
  if (int8)
    run(x, packed.data_ptr<int8_t>(), s, b, n, y);
  else
    run(x, packed.data_ptr<bf16>(), s, b, n, y);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(speedkv, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(speedkv, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("packed_linear", &packed_linear);
}

#endif  // AVX512-BF16 or AVX2: without either the ops are not registered and decode
        // keeps torch's kernels
