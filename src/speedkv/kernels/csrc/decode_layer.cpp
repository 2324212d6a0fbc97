// One decoder layer of a decode step in one call: norm, q/k/v product, rotary, the new key and
// value written into each sequence's cache, attention, output product, residual and norm, MLP,
// residual.
//
// A decode step runs each of these for one row per sequence, so each is a few microseconds of
// work; from Python, every one also costs a dispatch, argument checks and the tensors' views
// around it. On 2 cores of an Intel Xeon that was a quarter of SmolLM2's step at 2K tokens.
// Here the layer calls the same operators (speedkv's own, through torch's dispatcher, so this
// library needs none of them to build) in the same order, so its results are the Python
// path's bit for bit; the engine uses it only where every one of them is the one it would
// call (core/engine.py).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;
using Maybe = std::optional<Tensor>;

template <typename Signature>
c10::TypedOperatorHandle<Signature> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// speedkv's operators, looked up once (a library loaded later is found on the next call: a
// failed lookup throws and leaves the static unset)
struct Operators {
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, double)> rms_norm =
      find<Tensor(const Tensor&, const Tensor&, double)>("speedkv::rms_norm");
  c10::TypedOperatorHandle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&,
                                                      const Tensor&, double)>
      add_rms_norm = find<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&,
                                                     const Tensor&, double)>(
          "speedkv::add_rms_norm");
  c10::TypedOperatorHandle<Tensor(const Tensor&)> silu_mul =
      find<Tensor(const Tensor&)>("speedkv::silu_mul");
  c10::TypedOperatorHandle<std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&,
                                                              const Tensor&, int64_t, int64_t)>
      rotary_split = find<std::tuple<Tensor, Tensor, Tensor>(
          const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t)>(
          "speedkv::rotary_split");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Maybe&, const Maybe&)>
      packed_linear = find<Tensor(const Tensor&, const Tensor&, const Maybe&, const Maybe&)>(
          "speedkv::packed_linear");
  c10::TypedOperatorHandle<Tensor(const Tensor&, at::TensorList, at::TensorList, double)>
      decode_attention = find<Tensor(const Tensor&, at::TensorList, at::TensorList, double)>(
          "speedkv::decode_attention");
};

const Operators& operators() {
  static const Operators found;
  return found;
}

// tile_linear is looked up only when a batch needs it (it exists only on CPUs with AMX)
c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Maybe&)> tile_linear() {
  static const auto found =
      find<Tensor(const Tensor&, const Tensor&, const Maybe&)>("speedkv::tile_linear");
  return found;
}

// A product on a weight packed for decode (fused.apply_linear's two packed branches): the AMX
// tile kernel for `tiles` batches (bfloat16 weights, no scale), the one-row kernel otherwise.
Tensor linear(const Tensor& x, const Tensor& packed, const Maybe& scale, const Maybe& bias,
              bool tiles) {
  if (tiles) {
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    const Tensor rows = x.reshape({-1, x.size(-1)}).contiguous();
    const Tensor y = tile_linear().call(rows, packed, bias);
    shape.back() = y.size(-1);
    return y.view(shape);
  }
  return operators().packed_linear.call(x.contiguous(), packed, scale, bias);
}

// the layer's weights in the order the engine passes them, and its four products
constexpr int64_t kInputNorm = 0, kPostNorm = 3;
enum Product { kQkv, kOut, kGateUp, kDown };
constexpr int64_t kWeightOf[] = {1, 2, 4, 5};

// h [B, 1, H] -> the residual leaving the layer. `weights`: input norm, q/k/v, output, post
// norm, gate/up, down (the products packed for decode); `extras`: each product's scale (int8
// weights) and bias, in that order, or None. Sequence b's key, value and position of this
// token go into slot lengths[b] of keys[b], values[b] ([kv_heads, capacity, D]) and
// positions[b] ([kv_heads, capacity]), which must have room; it attends over slots
// [0, lengths[b]].
Tensor decode_layer(const Tensor& h, const Tensor& cos, const Tensor& sin,
                    at::TensorList weights, const c10::List<Maybe>& extras,
                    at::TensorList keys, at::TensorList values, at::TensorList positions,
                    at::IntArrayRef lengths, at::IntArrayRef token_positions, double eps,
                    int64_t q_heads, int64_t kv_heads, bool tiles) {
  TORCH_CHECK(weights.size() == 6 && extras.size() == 8,
              "six weights and a scale and bias for each of the four products");
  const int64_t batch = h.size(0);
  TORCH_CHECK(h.dim() == 3 && h.size(1) == 1, "h must be [batch, 1, hidden]");
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == batch &&
                  static_cast<int64_t>(values.size()) == batch &&
                  static_cast<int64_t>(positions.size()) == batch &&
                  static_cast<int64_t>(lengths.size()) == batch &&
                  static_cast<int64_t>(token_positions.size()) == batch,
              "one cache, length and position per sequence");
  const Operators& ops = operators();
  auto product = [&](const Tensor& x, Product p) {
    return linear(x, weights[kWeightOf[p]], extras.get(2 * p), extras.get(2 * p + 1), tiles);
  };

  const Tensor qkv = product(ops.rms_norm.call(h, weights[kInputNorm], eps), kQkv);
  auto [q, k, v] = ops.rotary_split.call(qkv.view({-1, 1, qkv.size(-1)}), cos, sin, q_heads,
                                         kv_heads);  // [B, heads, 1, D]
  std::vector<Tensor> live_keys, live_values;
  live_keys.reserve(batch);
  live_values.reserve(batch);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t slot = lengths[b];
    TORCH_CHECK(slot < keys[b].size(1), "the cache has no room for the token");
    keys[b].select(1, slot).copy_(k[b].select(1, 0));
    values[b].select(1, slot).copy_(v[b].select(1, 0));
    positions[b].select(1, slot).fill_(token_positions[b]);
    live_keys.push_back(keys[b].narrow(1, 0, slot + 1));
    live_values.push_back(values[b].narrow(1, 0, slot + 1));
  }
  const int64_t dim = q.size(-1);
  const Tensor attended = ops.decode_attention.call(q.reshape({batch, q_heads, dim}).contiguous(),
                                                    live_keys, live_values,
                                                    std::pow(static_cast<double>(dim), -0.5));
  const Tensor out = product(attended.view({batch, 1, q_heads * dim}), kOut);
  auto [residual, x] = ops.add_rms_norm.call(h, out, weights[kPostNorm], eps);
  return residual + product(ops.silu_mul.call(product(x, kGateUp)), kDown);
}

}  // namespace

// a fragment: every kernel is a library of its own, loaded or not on its own (core/native.py)
TORCH_LIBRARY_FRAGMENT(speedkv, m) {
  m.def(
      "decode_layer(Tensor h, Tensor cos, Tensor sin, Tensor[] weights, Tensor?[] extras, "
      "Tensor[] keys, Tensor[] values, Tensor[] positions, int[] lengths, "
      "int[] token_positions, float eps, int q_heads, int kv_heads, bool tiles) -> Tensor");
}

TORCH_LIBRARY_IMPL(speedkv, CPU, m) { m.impl("decode_layer", &decode_layer); }
