// Linear layers of many rows (a prefill chunk, a large decode batch) on AMX tiles: y = x W^T + b.
//
// The weight is the copy packed for decode (decode_linear.cpp: [N / 16][K / 2][16][2]). That is
// the layout the tile unit's bfloat16 product takes for its right operand: 16 rows of 64 bytes,
// each a pair of input features for 16 outputs. So one packed copy serves decode steps and
// prefills, and x is read as it is: a left tile is 16 rows of 32 input features. Each step
// multiplies 32 rows of x by 32 outputs (four tiles of float32 sums, see amx_tiles.h) over 32
// input features; the sums are rounded once, to bfloat16, as oneDNN rounds them.
//
// Work is split into blocks of kTaskRows rows by kTaskCols outputs, handed out over threads. A
// block's rows of x and its outputs' weights stay in the core's L2 cache while its 32 x 32
// steps go over them. Rows past the last (a chunk that is not a multiple of 32) are read from a
// zeroed copy, so every tile is full.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SPEEDKV_TILE_LINEAR
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#ifdef SPEEDKV_TILE_LINEAR
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "bf16_pairs.h"

namespace {

using speedkv::bf16;
using speedkv::store_rounded;
constexpr int64_t kStep = 32;       // rows and outputs of one 2 x 2 tile step
constexpr int64_t kTaskRows = 256;  // rows of x per block of work
constexpr int64_t kTaskCols = 256;  // outputs per block of work

// 32 rows of x from `first` (zero past `rows`) as one contiguous panel; `x` itself where all 32
// rows exist.
const bf16* left_panel(const bf16* x, int64_t rows, int64_t k, int64_t first, bf16* spare) {
  if (first + kStep <= rows) return x + first * k;
  const int64_t valid = rows - first;
  std::memcpy(spare, x + first * k, valid * k * sizeof(bf16));
  std::memset(spare + valid * k, 0, (kStep - valid) * k * sizeof(bf16));
  return spare;
}

// One 32 x 32 block of y: the float32 sums at `sums`, plus bias, rounded into `y`.
void write_block(const float* sums, const float* bias, int64_t valid_rows, bf16* y, int64_t n) {
  const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  for (int64_t r = 0; r < valid_rows; ++r) {
    store_rounded(y + r * n, _mm512_add_ps(_mm512_loadu_ps(sums + r * kStep), b0));
    store_rounded(y + r * n + 16, _mm512_add_ps(_mm512_loadu_ps(sums + r * kStep + 16), b1));
  }
}

at::Tensor tile_linear(const at::Tensor& x, const at::Tensor& packed,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() &&
                  x.device().is_cpu(),
              "x must be a contiguous bfloat16 CPU [rows, in] matrix");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous() && packed.size(2) == 16 && packed.size(3) == 2,
              "the weight must be bfloat16, packed by pack_linear_weight");
  const int64_t rows = x.size(0), k = x.size(1), n = packed.size(0) * 16;
  TORCH_CHECK(packed.size(1) * 2 == k, "x has ", k, " inputs, the weight ", packed.size(1) * 2);
  TORCH_CHECK(k % kStep == 0 && n % kStep == 0, "inputs and outputs must be multiples of 32");
  TORCH_CHECK(speedkv::amx_granted(), "this process may not use the AMX tiles");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "the bias must be n contiguous float32 values");
    b = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
  const bf16* xs = x.data_ptr<bf16>();
  const bf16* w = packed.data_ptr<bf16>();
  bf16* y = out.data_ptr<bf16>();
  const int64_t row_tasks = (rows + kTaskRows - 1) / kTaskRows;
  const int64_t col_tasks = (n + kTaskCols - 1) / kTaskCols;
  // bytes between: rows of x; the two left tiles; the weight's rows of pairs; its two tiles
  const int64_t x_stride = k * sizeof(bf16), left_half = 16 * x_stride;
  const int64_t w_stride = 64, right_half = k / 2 * 32 * sizeof(bf16);
  at::parallel_for(0, row_tasks * col_tasks, 1, [&](int64_t begin, int64_t end) {
    speedkv::configure_tiles();
    std::vector<bf16> spare(kStep * k);
    alignas(64) float sums[kStep * kStep];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r0 = task / col_tasks * kTaskRows, c0 = task % col_tasks * kTaskCols;
      const int64_t r1 = std::min(rows, r0 + kTaskRows), c1 = std::min(n, c0 + kTaskCols);
      for (int64_t c = c0; c < c1; c += kStep) {
        const bf16* right = w + c / 16 * (k / 2) * 32;  // the 16-output blocks c and c + 16
        for (int64_t r = r0; r < r1; r += kStep) {
          const bf16* left = left_panel(xs, rows, k, r, spare.data());
          speedkv::zero_sums_2x2();
          for (int64_t i = 0; i < k; i += kStep)  // 32 inputs: 16 rows of pairs of the weight
            speedkv::product_2x2(left + i, x_stride, left_half, right + i * 16, w_stride,
                                 right_half);
          speedkv::store_sums_2x2(sums, kStep * sizeof(float));
          write_block(sums, b ? b + c : nullptr, std::min(kStep, rows - r), y + r * n + c, n);
        }
      }
    }
    _tile_release();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(speedkv, m) {
  m.def("tile_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(speedkv, CPU, m) { m.impl("tile_linear", &tile_linear); }

#endif  // AMX: without it the op is not registered and these layers keep oneDNN
