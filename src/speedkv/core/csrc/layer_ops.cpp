// A decoder layer's small operations, each fused into one call.
//
// Between its matrix products a decoder layer does a dozen small things to each row: norms,
// residual adds, rotary embedding, splitting q/k/v into heads, SiLU times up. In a decode step
// (one row per sequence) each is microseconds of work behind several microseconds of dispatch;
// in a prefill chunk (a thousand rows) each is a pass over memory. Here each group is one call
// and one pass, rows split across threads when there are many. The arithmetic and its
// roundings are the ones torch's separate operations make (float32 inside, rounded to the
// tensor's dtype wherever torch would round), so results do not move.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

constexpr int64_t kRowsPerTask = 32;  // fewer rows run on the calling thread (a decode step)

template <typename T>
inline T round_to(float x) {
  return static_cast<T>(x);
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
  for (int64_t i = 0; i < width; ++i) {
    const T normed = round_to<T>(static_cast<float>(x[i]) * inv);
    out[i] = round_to<T>(static_cast<float>(weight[i]) * static_cast<float>(normed));
  }
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
      for (int64_t i = lo * width; i < hi * width; ++i)
        ss[i] = round_to<scalar_t>(static_cast<float>(hs[i]) + static_cast<float>(ys[i]));
      for (int64_t r = lo; r < hi; ++r)
        norm_row(ss + r * width, ws, width, static_cast<float>(eps), os + r * width);
    });
  });
  return {sum, out};
}

// silu(gate) * up for gate_up = [gate | up] on the last dimension. torch's own vectorized
// kernels do the arithmetic (SiLU needs exp, which they vectorize and thread), so the results
// are theirs bit for bit; the call saves the Python-side split and dispatches.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.is_contiguous(), "a contiguous CPU tensor");
  TORCH_CHECK(gate_up.size(-1) % 2 == 0, "gate and up must be the same width");
  const int64_t width = gate_up.size(-1) / 2;
  return at::silu(gate_up.narrow(-1, 0, width)).mul_(gate_up.narrow(-1, width, width));
}

// x * cos + rotate_half(x) * sin for one head of one token, each product and the sum rounded
// as torch's separate operations round them.
template <typename T>
void rotate_row(const T* x, const T* c, const T* s, int64_t dim, T* out) {
  const int64_t half = dim / 2;
  for (int64_t d = 0; d < dim; ++d) {
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
