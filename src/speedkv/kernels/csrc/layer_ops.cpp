// A decoder layer's small operations, each fused into one call.
//
// Between its matrix products a decoder layer does a dozen small things to each row: norms,
// residual adds, rotary embedding, splitting q/k/v into heads, SiLU times up. In a decode step
// (one row per sequence) each is microseconds of work behind several microseconds of dispatch;
// in a prefill chunk (a thousand rows) each is a pass over memory. Here each group is one call
// and one pass, rows split across threads when there are many. The arithmetic and its
// roundings are the ones torch's separate operations make (float32 inside, rounded to the
// tensor's dtype wherever torch would round), so results do not move.
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

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kRowsPerTask = 32;  // fewer rows run on the calling thread (a decode step)

template <typename T>
inline T round_to(float x) {
  return static_cast<T>(x);
}

// round_to for the two float vectors that one vector of T widens to: rounded to T and back
template <typename T>
inline std::tuple<at::vec::Vectorized<float>, at::vec::Vectorized<float>> rounded_to(
    const at::vec::Vectorized<float>& lo, const at::vec::Vectorized<float>& hi) {
  return at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(lo, hi));
}

// weight * rms_norm(x) on one row: the norm in float32 and rounded to T, then times the
// weight and rounded again (the order the Llama-family modules use).
// The sum of squares runs in 16 lanes (torch's reduction has an order of its own too): one
// running sum would chain every add on the one before, four cycles each, which made the norm
// of a prefill chunk a tenth of its layer's time.
template <typename T>
float sum_of_squares(const T* x, int64_t width) {
  constexpr int64_t kLanes = 16;
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= width; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) {
      const float v = static_cast<float>(x[i + j]);
      lanes[j] += v * v;
    }
  float squares = 0.f;
  for (; i < width; ++i) {
    const float v = static_cast<float>(x[i]);
    squares += v * v;
  }
  for (const float lane : lanes) squares += lane;
  return squares;
}

template <typename T>
void norm_row(const T* x, const T* weight, int64_t width, float eps, T* out) {
  const float squares = sum_of_squares(x, width);
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(width) + eps);
  int64_t i = 0;
  if constexpr (c10::is_reduced_floating_point_v<T>) {  // the same roundings, a vector at a time
    using Narrow = at::vec::Vectorized<T>;
    const at::vec::Vectorized<float> scale(inv);
    for (; i + Narrow::size() <= width; i += Narrow::size()) {
      auto [x0, x1] = at::vec::convert_to_float<T>(Narrow::loadu(x + i));
      auto [n0, n1] = rounded_to<T>(x0 * scale, x1 * scale);
      auto [w0, w1] = at::vec::convert_to_float<T>(Narrow::loadu(weight + i));
      at::vec::convert_from_float<T>(w0 * n0, w1 * n1).store(out + i);
    }
  }
  for (; i < width; ++i) {
    const T normed = round_to<T>(static_cast<float>(x[i]) * inv);
    out[i] = round_to<T>(static_cast<float>(weight[i]) * static_cast<float>(normed));
  }
}

// a + b rounded to T, element by element
template <typename T>
void add_rounded(const T* a, const T* b, T* out, int64_t count) {
  int64_t i = 0;
  if constexpr (c10::is_reduced_floating_point_v<T>) {
    using Narrow = at::vec::Vectorized<T>;
    for (; i + Narrow::size() <= count; i += Narrow::size()) {
      auto [a0, a1] = at::vec::convert_to_float<T>(Narrow::loadu(a + i));
      auto [b0, b1] = at::vec::convert_to_float<T>(Narrow::loadu(b + i));
      at::vec::convert_from_float<T>(a0 + b0, a1 + b1).store(out + i);
    }
  }
  for (; i < count; ++i) out[i] = round_to<T>(static_cast<float>(a[i]) + static_cast<float>(b[i]));
}

void check_rows(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "contiguous tensors only");
  TORCH_CHECK(weight.dim() == 1 && x.size(-1) == weight.size(0),
              "the weight must have one entry per feature");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "x and the weight must share a dtype");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  at::Tensor out = at::empty_like(x);
  const int64_t width = x.size(-1), rows = x.numel() / width;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xs = x.data_ptr<scalar_t>();
    const scalar_t* ws = weight.data_ptr<scalar_t>();
    scalar_t* os = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r)
        norm_row(xs + r * width, ws, width, static_cast<float>(eps), os + r * width);
    });
  });
  return out;
}

// (h + y, weight * rms_norm(h + y)): a residual add and the next norm.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& h, const at::Tensor& y,
                                                const at::Tensor& weight, double eps) {
  check_rows(h, weight);
  TORCH_CHECK(y.sizes() == h.sizes() && y.is_contiguous() && y.scalar_type() == h.scalar_type(),
              "h and y must have one shape and dtype");
  at::Tensor sum = at::empty_like(h), out = at::empty_like(h);
  const int64_t width = h.size(-1), rows = h.numel() / width;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* hs = h.data_ptr<scalar_t>();
    const scalar_t* ys = y.data_ptr<scalar_t>();
    const scalar_t* ws = weight.data_ptr<scalar_t>();
    scalar_t* ss = sum.data_ptr<scalar_t>();
    scalar_t* os = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t lo, int64_t hi) {
      add_rounded(hs + lo * width, ys + lo * width, ss + lo * width, (hi - lo) * width);
      for (int64_t r = lo; r < hi; ++r)
        norm_row(ss + r * width, ws, width, static_cast<float>(eps), os + r * width);
    });
  });
  return {sum, out};
}

// silu(gate) rounded to T, times up, rounded again: what torch's SiLU kernel and its product
// compute, in one pass over the row instead of two passes and a temporary. Rows whose width
// is a whole number of torch's double vectors only: torch computes the rest of a row with the
// C library's exp, not its vectorized one.
//
// A bfloat16 or float16 gate has only 65536 values, so SiLU is a table of torch's own results
// for every one of them (`silu_table`), read 16 lanes at a time by a gather: equal to torch's
// kernel by construction, without its exp and division. Without AVX512 the row computes
// x / (1 + exp(-x)) with torch's own vectorized exp (SLEEF's), as torch's kernel does.
template <typename T>
const uint16_t* silu_table() {
  static const std::vector<uint16_t> table = [] {
    const at::Tensor bits = at::arange(-32768, 32768, at::TensorOptions(at::kInt)).to(at::kShort);
    const at::Tensor silu = at::silu(bits.view(c10::CppTypeToScalarType<T>::value));
    const int16_t* in = bits.data_ptr<int16_t>();
    const int16_t* out = silu.view(at::kShort).data_ptr<int16_t>();
    std::vector<uint16_t> entries(65536 + 1, 0);  // +1: a 32-bit read of the last entry
    for (int64_t i = 0; i < 65536; ++i)
      entries[static_cast<uint16_t>(in[i])] = static_cast<uint16_t>(out[i]);
    return entries;
  }();
  return table.data();
}

template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t width, const uint16_t* table) {
  using Narrow = at::vec::Vectorized<T>;
  for (int64_t i = 0; i < width; i += Narrow::size()) {
#if defined(CPU_CAPABILITY_AVX512)
    // 32 gates: two gathers of 16 entries (each the low half of a 32-bit read), narrowed back
    // to 16-bit lanes in order
    auto lookup = [table](const T* at) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
      return _mm512_cvtepi32_epi16(_mm512_i32gather_epi32(_mm512_cvtepu16_epi32(bits), table, 2));
    };
    const Narrow silu(
        _mm512_inserti64x4(_mm512_castsi256_si512(lookup(gate + i)), lookup(gate + i + 16), 1));
#else
    (void)table;
    const at::vec::Vectorized<float> one(1.f);
    auto [g0, g1] = at::vec::convert_to_float<T>(Narrow::loadu(gate + i));
    const Narrow silu =
        at::vec::convert_from_float<T>(g0 / (one + g0.neg().exp()), g1 / (one + g1.neg().exp()));
#endif
    auto [s0, s1] = at::vec::convert_to_float<T>(silu);
    auto [u0, u1] = at::vec::convert_to_float<T>(Narrow::loadu(up + i));
    at::vec::convert_from_float<T>(s0 * u0, s1 * u1).store(out + i);
  }
}

// silu(gate) * up for gate_up = [gate | up] on the last dimension. bfloat16 and float16 rows
// run `silu_mul_row`; anything else (float32, the exact reference; odd widths) runs torch's
// own kernels, bit for bit theirs either way.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.is_contiguous(), "a contiguous CPU tensor");
  TORCH_CHECK(gate_up.size(-1) % 2 == 0, "gate and up must be the same width");
  const int64_t width = gate_up.size(-1) / 2;
  const auto dtype = gate_up.scalar_type();
  constexpr int64_t kWhole = 2 * at::vec::Vectorized<at::BFloat16>::size();
  if ((dtype != at::kBFloat16 && dtype != at::kHalf) || width % kWhole != 0)
    return at::silu(gate_up.narrow(-1, 0, width)).mul_(gate_up.narrow(-1, width, width));
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = width;
  at::Tensor out = at::empty(shape, gate_up.options());
  const int64_t rows = gate_up.numel() / (2 * width);
  AT_DISPATCH_REDUCED_FLOATING_TYPES(dtype, "silu_mul", [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* os = out.data_ptr<scalar_t>();
    const uint16_t* table = silu_table<scalar_t>();  // built before the threads start
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r)
        silu_mul_row(in + 2 * r * width, in + (2 * r + 1) * width, os + r * width, width, table);
    });
  });
  return out;
}

// x * cos + rotate_half(x) * sin for one head of one token, each product and the sum rounded
// as torch's separate operations round them.
template <typename T>
void rotate_row(const T* x, const T* c, const T* s, int64_t dim, T* out) {
  const int64_t half = dim / 2;
  int64_t d = 0;
  if constexpr (c10::is_reduced_floating_point_v<T>) {
    // the same products and roundings, a vector of T at a time, where halves hold whole ones
    using Narrow = at::vec::Vectorized<T>;
    if (half % Narrow::size() == 0) {
      for (; d < dim; d += Narrow::size()) {
        auto [x0, x1] = at::vec::convert_to_float<T>(Narrow::loadu(x + d));
        auto [c0, c1] = at::vec::convert_to_float<T>(Narrow::loadu(c + d));
        auto [s0, s1] = at::vec::convert_to_float<T>(Narrow::loadu(s + d));
        auto [r0, r1] = at::vec::convert_to_float<T>(Narrow::loadu(d < half ? x + d + half
                                                                              : x + d - half));
        if (d < half) r0 = r0.neg(), r1 = r1.neg();
        auto [a0, a1] = rounded_to<T>(x0 * c0, x1 * c1);
        auto [b0, b1] = rounded_to<T>(r0 * s0, r1 * s1);
        at::vec::convert_from_float<T>(a0 + b0, a1 + b1).store(out + d);
      }
    }
  }
  for (; d < dim; ++d) {
    const float rotated =
        d < half ? -static_cast<float>(x[d + half]) : static_cast<float>(x[d - half]);
    const T a = round_to<T>(static_cast<float>(x[d]) * static_cast<float>(c[d]));
    const T r = round_to<T>(rotated * static_cast<float>(s[d]));
    out[d] = round_to<T>(static_cast<float>(a) + static_cast<float>(r));
  }
}

// One row per token: qkv [B, 1, (Hq + 2 Hkv) * D] -> q [B, Hq, 1, D] and k [B, Hkv, 1, D]
// with rotary embedding (rotate-half layout) and v [B, Hkv, 1, D]; cos and sin hold B rows of
// D ([B, 1, 1, D] in a decode step, one token per sequence; [B, D] for a prefill chunk of B
// tokens).
std::tuple<at::Tensor, at::Tensor, at::Tensor> rotary_split(const at::Tensor& qkv,
                                                             const at::Tensor& cos,
                                                             const at::Tensor& sin,
                                                             int64_t q_heads, int64_t kv_heads) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 3 && qkv.size(1) == 1 && qkv.is_contiguous(),
              "qkv must be a contiguous CPU [batch, 1, width]");
  const int64_t batch = qkv.size(0), heads = q_heads + 2 * kv_heads;
  TORCH_CHECK(q_heads > 0 && kv_heads > 0 && qkv.size(2) % heads == 0,
              "qkv's width must be (q_heads + 2 kv_heads) head_dim");
  const int64_t dim = qkv.size(2) / heads;
  TORCH_CHECK(dim % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == batch * dim &&
                  sin.numel() == batch * dim,
              "cos and sin must be contiguous rows of head_dim, one per token");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "cos, sin and qkv must share a dtype");
  at::Tensor q = at::empty({batch, q_heads, 1, dim}, qkv.options());
  at::Tensor k = at::empty({batch, kv_heads, 1, dim}, qkv.options());
  at::Tensor v = at::empty({batch, kv_heads, 1, dim}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary_split", [&] {
    using T = scalar_t;
    const T* in = qkv.data_ptr<T>();
    T *qs = q.data_ptr<T>(), *ks = k.data_ptr<T>(), *vs = v.data_ptr<T>();
    at::parallel_for(0, batch, kRowsPerTask, [&](int64_t lo, int64_t hi) {
      for (int64_t b = lo; b < hi; ++b) {
        const T* row = in + b * heads * dim;
        const T* c = cos.data_ptr<T>() + b * dim;
        const T* s = sin.data_ptr<T>() + b * dim;
        for (int64_t h = 0; h < q_heads; ++h)
          rotate_row(row + h * dim, c, s, dim, qs + (b * q_heads + h) * dim);
        for (int64_t h = 0; h < kv_heads; ++h)
          rotate_row(row + (q_heads + h) * dim, c, s, dim, ks + (b * kv_heads + h) * dim);
        std::copy(row + (q_heads + kv_heads) * dim, row + heads * dim, vs + b * kv_heads * dim);
      }
    });
  });
  return {q, k, v};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(speedkv, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor h, Tensor y, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def(
      "rotary_split(Tensor qkv, Tensor cos, Tensor sin, int q_heads, int kv_heads)"
      " -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(speedkv, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rotary_split", &rotary_split);
}
