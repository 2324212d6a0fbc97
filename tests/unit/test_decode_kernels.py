"""The decode step's fused pieces against what they replace: decode attention (torch's kernels
and the native batch kernel) against a float64 reference, fused projections against the
separate layers (no extra weight memory, the model's own forward unchanged, stale fusions
rebuilt), the fused RMSNorm against the module."""

import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from speedkv.core.engine import Engine, Request
from speedkv.core.registry import make_policy
from speedkv.core.sampling import SamplingParams
from speedkv.hf import layer_work
from speedkv.hf.backbone import rms_norm
from speedkv.hf.fused import FusedProjection
from speedkv.hf.int8 import Int8Linear
from speedkv.kernels import attention, linear, native, tuning
from speedkv.kernels.config import KernelConfig

from conftest import random_prompt, tiny_model
from helpers import compiler_targets, greedy_with_logits, hf_generate


def reference_decode_attention(q, k, v):
    heads, kv_heads = q.shape[0], k.shape[0]
    packed = q.reshape(1, kv_heads, heads // kv_heads, q.shape[-1]).double()
    out = F.scaled_dot_product_attention(packed, k[None].double(), v[None].double())
    return out.reshape(heads, 1, q.shape[-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 2048, 4099])
def test_decode_attention_equals_reference(dtype, n):  # below and above MATMUL_FROM
    torch.manual_seed(0)
    # a cache buffer with room left, as the engine holds it: k, v are strided views
    k = torch.randn(3, n + 16, 64, dtype=dtype)[:, :n]
    v = torch.randn(3, n + 16, 64, dtype=dtype)[:, :n]
    q = torch.randn(9, 1, 64, dtype=dtype)
    got = attention.decode_attention(q, k, v)
    assert got.shape == (9, 1, 64) and got.dtype == dtype
    # bf16: the fused kernel keeps scores in float32; the matrix products round them to bf16
    # as transformers' eager attention does
    bf16_tolerance = 4e-3 if n < attention.MATMUL_FROM else 2e-2
    tolerance = 1e-6 if dtype == torch.float32 else bf16_tolerance
    assert (got.double() - reference_decode_attention(q, k, v)).abs().max() < tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 4099])
def test_gpu_decode_attention_equals_reference(dtype, n):
    """The GPU's decode attention (flash attention forced for half precision, batched matrix
    products for float32) on the CPU's tensors, which run the same calls."""
    k, v = strided_cache(2, n, 128, dtype, seed=1), strided_cache(2, n, 128, dtype, seed=2)
    q = strided_cache(8, 1, 128, dtype, seed=3).contiguous()
    got = attention.gpu_decode_attention(q, k, v)
    assert got.shape == (8, 1, 128) and got.dtype == dtype
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: one step at magnitude 1
    assert (got.double() - reference_decode_attention(q, k, v)).abs().max() < tolerance
    batched = attention.matmul_decode_attention(q, k, v, per_head=False)
    per_head = attention.matmul_decode_attention(q, k, v, per_head=True)
    # the same sums, though a CPU's batched and single products may add them in other orders
    # (bit-equal on AMD EPYC, not on an Intel Xeon with AMX)
    assert (batched.double() - per_head.double()).abs().max() < tolerance


def strided_cache(kv_heads: int, n: int, dim: int, dtype, seed: int) -> torch.Tensor:
    """A [kv_heads, n, dim] view into a buffer with room left, as the engine holds a cache."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(kv_heads, n + 16, dim, generator=generator).to(dtype)[:, :n]


@pytest.fixture(params=["native", "torch"])
def kernel(request, monkeypatch):
    """Runs a test on the native batch kernel, then on torch's per-sequence fallback. The
    native run uses the kernel whatever this machine's measured choice says (a choice of
    torch's kernels would hold the native kernel's bounds to torch's rounding)."""
    if request.param == "native":
        ops = native.native_ops()
        if ops is None:
            pytest.skip("the native kernels cannot be built here (no C++ compiler?)")
        assert hasattr(ops, "decode_attention"), native.kernel_status()
        monkeypatch.setattr(attention, "engine_kernels", lambda: ops)
    else:
        monkeypatch.setattr(attention, "engine_kernels", lambda: None)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (14, 2, 64), (4, 4, 128)])
def test_batch_decode_attention_equals_reference(kernel, dtype, heads, kv_heads, dim):
    """A batch of caches of different lengths (one token, a partial block, several blocks,
    past the matmul threshold), each a strided view, in one call."""
    lengths = [1, 7, 300, 2100]
    keys = [strided_cache(kv_heads, n, dim, dtype, seed=i) for i, n in enumerate(lengths)]
    values = [strided_cache(kv_heads, n, dim, dtype, seed=10 + i) for i, n in enumerate(lengths)]
    q = torch.randn(len(lengths), heads, 1, dim).to(dtype)
    got = attention.batch_decode_attention(q, keys, values)
    assert got.shape == q.shape and got.dtype == dtype
    for b in range(len(lengths)):
        expected = reference_decode_attention(q[b], keys[b], values[b])
        error = (got[b].double() - expected).abs()
        if dtype == torch.float32:
            assert error.max() < 1e-6, (b, lengths[b])
        elif kernel == "native":  # float32 throughout: only the output is rounded, once
            half_step = 2**-8 if dtype == torch.bfloat16 else 2**-11
            assert (error <= expected.abs() * half_step + 1e-6).all(), (b, lengths[b])
        else:  # torch's matrix products round scores to the cache's dtype as well
            assert error.max() < (2e-2 if dtype == torch.bfloat16 else 2e-3), (b, lengths[b])


def test_native_kernel_is_built_where_a_compiler_exists():
    """The suite must exercise the native kernel, not only the fallback, on machines that can
    build it (CI included)."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine")
    if not native.native_enabled():
        pytest.skip(f"{native.SWITCH}=torch: this run checks torch's kernels only")
    assert native.native_ops() is not None
    # every kernel, so that one failed build (recorded, not retried) is seen here, not only
    # as a test of that kernel quietly running torch's
    assert set(native.kernel_status().values()) == {"built"}, native.kernel_status()


def test_native_kernel_refuses_what_it_cannot_run():
    ops = native.native_ops()
    if ops is None:
        pytest.skip("the native kernel cannot be built here")
    q = torch.randn(2, 9, 64)
    k = [torch.randn(3, 5, 64), torch.randn(3, 6, 64)]
    with pytest.raises(RuntimeError, match="at least one sequence"):
        ops.decode_attention(q[:0], [], [], 0.125)
    with pytest.raises(RuntimeError, match="one key and one value tensor per sequence"):
        ops.decode_attention(q, k[:1], k[:1], 0.125)
    with pytest.raises(RuntimeError, match="must match keys"):
        ops.decode_attention(q, k, [k[0], k[0]], 0.125)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.decode_attention(q, k, [v.double() for v in k], 0.125)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        ops.decode_attention(torch.randn(2, 8, 64), k, k, 0.125)
    with pytest.raises(RuntimeError, match="rows must be contiguous"):
        columns = [torch.randn(3, 64, 5).transpose(1, 2), torch.randn(3, 64, 6).transpose(1, 2)]
        ops.decode_attention(q, columns, columns, 0.125)
    # what the native kernel does not take goes to torch's kernels instead
    odd = [torch.randn(3, 5, 48), torch.randn(3, 6, 48)]
    got = attention.batch_decode_attention(torch.randn(2, 9, 1, 48), odd, odd)
    assert got.shape == (2, 9, 1, 48)


def test_native_kernels_switch_off_and_fall_back_when_the_build_fails(monkeypatch, tmp_path):
    build = native.native_ops.__wrapped__  # uncached: each call decides again
    monkeypatch.setenv(native.SWITCH, "torch")
    assert build() is None
    monkeypatch.delenv(native.SWITCH)
    monkeypatch.setenv("SPEEDKV_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setattr(native, "_reported", set())
    attempts = []

    def broken(name, source, build_dir):
        attempts.append(name)
        raise OSError("c++: command not found")

    monkeypatch.setenv(native.BUILD_JOBS, "1")  # builds in this process, where _compile breaks
    monkeypatch.setattr(native, "_compile", broken)
    with pytest.warns(RuntimeWarning, match="not available.*command not found"):
        assert build() is None
    assert sorted(attempts) == sorted(native.KERNELS)
    # the failures are recorded: a later process does not try again
    monkeypatch.setattr(native, "_reported", set())
    with pytest.warns(RuntimeWarning, match="recorded in"):
        assert build() is None
    assert len(attempts) == len(native.KERNELS)


def batch_tokens(engine: Engine, prompts: list, specs: list[str], new_tokens: int) -> list:
    """The greedy tokens of every prompt under every method, decoded as one batch."""
    sampling = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    shape = engine.shape
    requests = [Request(ids, make_policy(s, shape), sampling) for ids in prompts for s in specs]
    return [g.output_ids for g in engine.generate(requests)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_engine_decode_is_the_same_on_native_and_torch_kernels(dtype, monkeypatch):
    """A batch mixing methods (full, SPEED, an evicting method, a per-query-head cache) and
    lengths gives each sequence the tokens it gets alone: the per-query-head cache goes to
    torch's kernel and the others stay on the native one. In float32 the native batch kernel
    decodes the same tokens as torch's per-sequence kernels, with logits within rounding; in
    bfloat16 the two round in other orders, and logits agree within a few roundings."""
    ops = native.native_ops()
    if ops is None:
        pytest.skip("the native kernel cannot be built here")
    monkeypatch.setattr(attention, "engine_kernels", lambda: ops)  # whatever the choice says
    model = tiny_model("llama")
    model.hf_model.to(dtype)
    engine = Engine(model)
    specs = [
        "full",
        "speed:lcut=3,anchors=bos,deep=1",
        "h2o:heavy=0.3,recent=0.3",
        "snapkv:retain=0.5,window=4,gqa=false",
    ]
    prompts = [random_prompt(n, seed=n) for n in (9, 40)]

    def logits():
        return greedy_with_logits(engine, prompts[1], make_policy(specs[1], model.shape), 5)[1]

    native_tokens, native_logits = batch_tokens(engine, prompts, specs, 8), logits()
    assert native_tokens == [batch_tokens(engine, [p], [s], 8)[0] for p in prompts for s in specs]
    monkeypatch.setattr(attention, "engine_kernels", lambda: None)
    torch_tokens, torch_logits = batch_tokens(engine, prompts, specs, 8), logits()
    if dtype == torch.float32:
        assert torch_tokens == native_tokens
        assert (torch_logits - native_logits).abs().max() < 1e-4
    else:  # the first decode step, on the same cache: within 4 of bf16's steps at logits < 8
        assert native_logits.abs().max() < 8
        assert (torch_logits[1] - native_logits[1]).abs().max() <= 4 * 2.0**-5


def storage_bytes(module: nn.Module) -> int:
    storages = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in module.parameters()
    }
    return sum(storages.values())


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", ["linear", "int8"])
def test_fused_projection_equals_separate_layers_without_extra_memory(kind, bias):
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(32, out, bias=bias) for out in (48, 16, 16))
    if kind == "int8":
        layers = nn.ModuleList(Int8Linear(layer) for layer in layers)
    layers.requires_grad_(False)
    before = storage_bytes(layers)
    x = torch.randn(3, 5, 32)
    expected = torch.cat([layer(x) for layer in layers], -1)
    fused = FusedProjection(list(layers))
    assert fused.sizes == [48, 16, 16]
    assert torch.allclose(fused(x), expected, atol=1e-6)
    # every part now reads its rows of one stack: the same bytes, and the parts still compute
    # what they did (the model's own forward is unchanged)
    assert storage_bytes(layers) == before
    assert len({p.untyped_storage().data_ptr() for p in layers.parameters()}) == (
        3 if bias else 2
    ) - (kind == "linear")
    assert torch.allclose(torch.cat([layer(x) for layer in layers], -1), expected, atol=1e-6)


def test_fused_projection_runs_trainable_or_wrapped_layers_one_by_one():
    torch.manual_seed(0)
    trainable = [nn.Linear(8, 4), nn.Linear(8, 4)]  # requires grad: training must see them
    fused = FusedProjection(trainable)
    x = torch.randn(2, 8)
    assert torch.equal(fused(x), torch.cat([m(x) for m in trainable], -1))
    assert trainable[0].weight.untyped_storage().data_ptr() != (
        trainable[1].weight.untyped_storage().data_ptr()
    )
    wrapped = [nn.Sequential(nn.Linear(8, 4)), nn.Linear(8, 4)]  # not a plain layer
    wrapped[0].out_features = 4
    fused = FusedProjection(wrapped)
    assert torch.equal(fused(x), torch.cat([m(x) for m in wrapped], -1))


def test_engine_follows_weights_replaced_after_fusion():
    """A fusion is rebuilt when a layer's weight is replaced (an adapter merged, new weights
    loaded): the engine must compute with the weights the model has now."""
    model = tiny_model("llama")
    engine = Engine(model)
    policy = make_policy("full", model.shape)
    ids = random_prompt(12)
    greedy_with_logits(engine, ids, policy.fresh(), 4)  # fuses every layer
    attn = model.hf_model.model.layers[2].self_attn
    attn.k_proj.weight = nn.Parameter(torch.randn_like(attn.k_proj.weight) * 3, requires_grad=False)
    tokens, _, _ = greedy_with_logits(engine, ids, policy.fresh(), 6)
    assert tokens == hf_generate(model.hf_model, ids, 6, min_new_tokens=6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_equals_the_module(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    norm = LlamaRMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(4, 3, 64, dtype=dtype) * 5
    expected = norm(x)
    got = rms_norm(norm, x)
    assert got.dtype == expected.dtype
    if dtype == torch.float32:
        assert torch.allclose(got, expected, atol=1e-6, rtol=1e-6)
    else:  # the same float32 value rounded once: at most one bfloat16 step apart
        assert torch.allclose(got.float(), expected.float(), rtol=2**-7, atol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_decode_equals_plain_weights(family, dtype):
    """--prepack decodes with oneDNN's copy of the weights: the same tokens and logits (float32
    within rounding), for full attention and SPEED, batched with different lengths."""
    model = tiny_model(family)
    model.hf_model.to(dtype)
    engine = Engine(model)
    specs = ["full", "speed:lcut=3,anchors=bos,deep=1", "speed:lcut=4,anchors=none,deep=3"]
    prompts = [random_prompt(n, seed=n) for n in (9, 23, 40)]

    def run():
        return batch_tokens(engine, prompts, specs, 6)

    def logits(spec):
        return greedy_with_logits(engine, prompts[1], make_policy(spec, model.shape), 5)[1]

    plain, plain_rows = run(), [logits(s) for s in specs]
    engine = Engine(model, prepack=True)
    packed_layer = model.backbone.decode_weights()[0]
    native_layout = dtype == torch.bfloat16 and native.has_linear_kernel(native.native_ops())
    assert packed_layer is not None
    if native_layout:  # speedkv's own layout: [out / 16, in / 2, 16, 2]
        assert packed_layer.qkv[0].dim() == 4
    elif dtype == torch.float32 or linear.onednn_bf16():
        assert packed_layer.qkv[0].is_mkldnn
    else:  # an AVX2-only x86 CPU: oneDNN takes no bfloat16 weights, so they stay as they are
        assert not packed_layer.qkv[0].is_mkldnn and packed_layer.qkv[0].dim() == 2
    assert run() == plain
    for spec, rows in zip(specs, plain_rows):
        # oneDNN's copy gives bit-identical bf16 results; the native kernel sums in another
        # order, so bf16 outputs may differ by a rounding step, and the logits by its effect
        tolerance = 1e-4 if dtype == torch.float32 else (0.1 if native_layout else 0.0)
        error = (logits(spec) - rows).abs().max()
        assert error <= tolerance, spec


def test_prepack_leaves_bfloat16_weights_plain_where_onednn_refuses_them(monkeypatch):
    """On an x86 CPU without AVX512BW (AVX2 only) oneDNN raises on bfloat16 weights: prepacking
    declines them there and the engine decodes on torch's kernels, with the same tokens."""
    monkeypatch.setenv(native.SWITCH, "torch")  # no native layout either
    monkeypatch.setattr(linear, "onednn_bf16", lambda: False)
    model = tiny_model("llama")
    model.hf_model.to(torch.bfloat16)
    specs = ["full", "speed:lcut=3,anchors=bos,deep=1"]
    prompts = [random_prompt(n, seed=n) for n in (9, 23)]
    plain = batch_tokens(Engine(model), prompts, specs, 6)
    engine = Engine(model, prepack=True)
    assert not linear.can_prepack((torch.zeros(16, 16, dtype=torch.bfloat16), None))
    assert linear.can_prepack((torch.zeros(16, 16), None)) == torch.backends.mkldnn.is_available()
    assert batch_tokens(engine, prompts, specs, 6) == plain
    layer = model.backbone.decode_weights()[0]
    assert layer is not None and not layer.qkv[0].is_mkldnn


def test_bfloat16_products_run_in_float32_where_onednn_takes_no_bfloat16(monkeypatch):
    """There torch's bfloat16 product is a plain loop: from UPCAST_FROM rows (a prefill's) the
    product runs in float32 and is rounded once, as a bfloat16 product's float32 sums are; a
    decode step's rows stay in bfloat16."""
    monkeypatch.setattr(linear, "onednn_bf16", lambda: False)
    widened = []
    in_float32 = linear.linear_in_float32
    monkeypatch.setattr(
        linear, "linear_in_float32", lambda x, w, b: widened.append(len(x)) or in_float32(x, w, b)
    )
    torch.manual_seed(0)
    x, w, b = (torch.randn(*shape).bfloat16() for shape in ((64, 96), (48, 96), (48,)))
    got = linear.apply_linear(x, (w, b))
    exact = F.linear(x.double(), w.double(), b.double())
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.double(), exact, rtol=2**-8, atol=1e-6)  # rounded once
    linear.apply_linear(x[: linear.UPCAST_FROM - 1], (w, b))
    assert widened == [64]
    monkeypatch.setattr(linear, "onednn_bf16", lambda: True)  # oneDNN's own bfloat16 path
    linear.apply_linear(x, (w, b))
    assert widened == [64]
    # ... unless float32 was measured faster here (oneDNN without AMX, say)
    measured = KernelConfig(float32_products=True)
    chunk = x.repeat(linear.MEASURED_UPCAST_FROM // len(x), 1)  # a prefill chunk's rows
    linear.apply_linear(chunk, (w, b), measured)
    assert widened == [64, len(chunk)]
    linear.apply_linear(x, (w, b), measured)  # a decode batch's rows stay in bfloat16
    assert widened == [64, len(chunk)]


# -- the native small operations of a layer (kernels/csrc/layer_ops.cpp) ------------------------
@pytest.fixture(scope="module")
def small_ops():
    ops = native.native_ops()
    if ops is None:
        pytest.skip("the native kernels cannot be built here")
    return ops


def torch_small_steps(h, y, norm, gate_up, qkv, cos, sin, heads, kv_heads, dim):
    """What the native operations replace, composed of torch's operations as layer_work
    composes them."""
    from speedkv.hf import layer_work

    summed = h + y
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    q, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    q, k, v = (layer_work.heads(t, dim) for t in (q, k, v))
    return {
        "rms_norm": layer_work.rms_norm(h, norm, 1e-5),
        "add_rms_norm": (summed, layer_work.rms_norm(summed, norm, 1e-5)),
        "silu_mul": F.silu(gate) * up,
        "rotary_split": (
            layer_work.apply_rope(q, cos, sin),
            layer_work.apply_rope(k, cos, sin),
            v,
        ),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (14, 2, 64), (4, 4, 128)])
@pytest.mark.parametrize("batch", [5, 100])  # a decode step's rows; a prefill chunk's, threaded
def test_native_small_ops_equal_torchs(small_ops, dtype, heads, kv_heads, dim, batch):
    """Bit for bit in bfloat16 (the same roundings, in the same places), but for the norms'
    sum of squares, which runs in another order than torch's: over many rows a rare element
    (well under 1 in 1000) lands a step away (two at most: the normed value, then its product
    with the weight). float16 within one step and float32 within a few ulps."""
    g = torch.Generator().manual_seed(dim + heads)
    hidden, inner = heads * dim, 3 * heads * dim

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    h, y, norm = rand(batch, 1, hidden, scale=4), rand(batch, 1, hidden), rand(hidden) + 1
    gate_up = rand(batch, 1, 2 * inner, scale=3)
    qkv = rand(batch, 1, (heads + 2 * kv_heads) * dim, scale=2)
    angles = torch.rand(batch, 1, 1, dim, generator=g) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    expected = torch_small_steps(h, y, norm, gate_up, qkv, cos, sin, heads, kv_heads, dim)
    got = {
        "rms_norm": small_ops.rms_norm(h, norm, 1e-5),
        "add_rms_norm": small_ops.add_rms_norm(h, y, norm, 1e-5),
        "silu_mul": small_ops.silu_mul(gate_up),
        "rotary_split": small_ops.rotary_split(qkv, cos, sin, heads, kv_heads),
    }
    for name, outputs in got.items():
        wanted = expected[name]
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        wanted = wanted if isinstance(wanted, tuple) else (wanted,)
        for out, want in zip(outputs, wanted, strict=True):
            assert out.shape == want.shape and out.dtype == dtype, name
            if dtype == torch.bfloat16 and "norm" in name:
                apart = out != want
                assert apart.float().mean() < 1e-3, name
                assert torch.allclose(out[apart].float(), want[apart].float(), rtol=2**-6), name
            elif dtype == torch.bfloat16:
                assert torch.equal(out, want), name
            else:
                step = 1e-5 if dtype == torch.float32 else 2**-10
                assert torch.allclose(out, want, rtol=step, atol=step), name


def test_native_small_ops_refuse_what_they_cannot_run(small_ops):
    h = torch.randn(2, 1, 64)
    with pytest.raises(RuntimeError, match="one entry per feature"):
        small_ops.rms_norm(h, torch.ones(63), 1e-5)
    with pytest.raises(RuntimeError, match="share a dtype"):
        small_ops.rms_norm(h, torch.ones(64, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(RuntimeError, match="one shape and dtype"):
        small_ops.add_rms_norm(h, torch.randn(2, 2, 64), torch.ones(64), 1e-5)
    with pytest.raises(RuntimeError, match="same width"):
        small_ops.silu_mul(torch.randn(2, 1, 7))
    cos = torch.randn(2, 1, 1, 16)
    with pytest.raises(RuntimeError, match="q_heads \\+ 2 kv_heads"):
        small_ops.rotary_split(torch.randn(2, 1, 100), cos, cos, 4, 2)
    with pytest.raises(RuntimeError, match="cos and sin must be"):
        small_ops.rotary_split(torch.randn(2, 1, 128), cos[:1], cos[:1], 4, 2)
    with pytest.raises(RuntimeError, match="\\[batch, 1, width\\]"):
        small_ops.rotary_split(torch.randn(2, 3, 128), cos, cos, 4, 2)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_decode_is_the_same_with_and_without_the_small_ops(small_ops, family, dtype):
    """A batch of full and SPEED sequences of different lengths decodes the same tokens with
    the native small operations as with torch's; float32 logits within rounding, bfloat16
    logits identical."""
    model = tiny_model(family)
    model.hf_model.to(dtype)
    engine = Engine(model)
    assert model.backbone.native_ops is not None  # the engine handed them over
    specs = ["full", "speed:lcut=3,anchors=bos,deep=1"]
    prompts = [random_prompt(n, seed=n) for n in (9, 40)]

    def logits():
        return greedy_with_logits(engine, prompts[1], make_policy(specs[1], model.shape), 5)[1]

    fused_tokens, fused_logits = batch_tokens(engine, prompts, specs, 6), logits()
    model.backbone.use_kernels(KernelConfig())
    assert batch_tokens(engine, prompts, specs, 6) == fused_tokens
    tolerance = 1e-4 if dtype == torch.float32 else 0.0
    assert (logits() - fused_logits).abs().max() <= tolerance


# -- the native bfloat16 linear kernel for decode (kernels/csrc/decode_linear.cpp) ----------------
@pytest.fixture(scope="module")
def linear_ops():
    ops = native.native_ops()
    if not native.has_linear_kernel(ops):
        pytest.skip("no native linear kernel here (no compiler, or neither AVX512-BF16 nor AVX2)")
    return ops


@pytest.mark.parametrize("rows", [1, 3, 4, 9])  # one row, under a pass of 4, a pass, both
@pytest.mark.parametrize(("out", "inputs"), [(960, 576), (576, 1536), (32, 10), (48, 6)])
@pytest.mark.parametrize("bias", [False, True])
def test_native_linear_equals_reference(linear_ops, rows, out, inputs, bias):
    """Against float64: within the output's own rounding, as torch's bf16 linear is (sums in
    float32, rounded once); any number of rows, odd numbers of input pairs, with a bias."""
    g = torch.Generator().manual_seed(out + inputs + rows)
    weight = torch.randn(out, inputs, generator=g).bfloat16()
    b = torch.randn(out, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, 1, inputs, generator=g).bfloat16()
    got = linear.apply_linear(x, linear.prepacked((weight, b), linear_ops))
    assert got.shape == (rows, 1, out) and got.dtype == torch.bfloat16
    expected = x.double() @ weight.double().T + (b.double() if bias else 0)
    torch_error = (F.linear(x, weight, b).double() - expected).abs().max()
    assert (got.double() - expected).abs().max() <= max(1.01 * torch_error, 1e-2)


def test_the_native_linear_kernel_is_built_where_the_cpu_takes_it():
    """On an x86 CPU with AVX512-BF16, or AVX2 and FMA, and a compiler (every machine this
    project has run on), the suite must run the decode linear kernel, not skip its tests."""
    targets = compiler_targets("__AVX512BF16__") or compiler_targets("__AVX2__", "__FMA__")
    if native.native_ops() is None or not targets:
        pytest.skip("nothing can be compiled here, or the CPU has neither instruction set")
    assert native.has_linear_kernel(native.native_ops())


def test_native_linear_refuses_what_it_cannot_run(linear_ops):
    with pytest.raises(RuntimeError, match="multiple of 16"):
        linear_ops.pack_linear_weight(torch.randn(20, 8).bfloat16())
    with pytest.raises(RuntimeError, match="bfloat16 or int8 CPU"):
        linear_ops.pack_linear_weight(torch.randn(32, 8))
    packed = linear_ops.pack_linear_weight(torch.randn(32, 8).bfloat16())
    x = torch.randn(1, 8).bfloat16()
    with pytest.raises(RuntimeError, match="x has 6 features, the weight takes 8"):
        linear_ops.packed_linear(torch.randn(1, 6).bfloat16(), packed, None, None)
    with pytest.raises(RuntimeError, match="bias must have one entry per output"):
        linear_ops.packed_linear(x, packed, None, torch.randn(31))
    with pytest.raises(RuntimeError, match="pack_linear_weight"):
        linear_ops.packed_linear(x, torch.randn(32, 8), None, None)
    with pytest.raises(RuntimeError, match="take no scale"):
        linear_ops.packed_linear(x, packed, torch.ones(32), None)
    rows = linear_ops.pack_linear_weight(torch.randint(-127, 128, (32, 8), dtype=torch.int8))
    with pytest.raises(RuntimeError, match="need their scale"):
        linear_ops.packed_linear(x, rows, None, None)
    # shapes it does not take keep oneDNN's layout, where oneDNN takes bfloat16 (not on AVX2)
    odd_shape = (torch.randn(20, 8).bfloat16(), None)
    assert linear.can_prepack(odd_shape, linear_ops) == linear.onednn_bf16()
    if linear.onednn_bf16():
        assert linear.prepacked(odd_shape, linear_ops)[0].is_mkldnn


@pytest.mark.parametrize("rows", [1, 3, 4, 9])
@pytest.mark.parametrize("bias", [False, True])
def test_native_int8_linear_equals_reference(linear_ops, rows, bias):
    """int8 rows with one scale per output, packed: against float64 within the output's own
    rounding, as torch's int8 kernel is; float32 or non-bf16 models keep torch's kernel."""
    from speedkv.hf.int8 import Int8Linear

    g = torch.Generator().manual_seed(rows)
    layer = Int8Linear(nn.Linear(576, 960, bias=bias).to(torch.bfloat16))
    x = torch.randn(rows, 1, 576, generator=g).bfloat16()
    tensors = layer.tensors()
    packed = linear.prepacked(tensors, linear_ops)
    assert packed[0].dim() == 4 and packed[0].dtype == torch.int8
    got = linear.apply_linear(x, packed)
    weight = layer.qweight.double() * layer.scale.double()[:, None]
    expected = x.double() @ weight.T + (layer.bias.double() if bias else 0)
    torch_error = (linear.apply_linear(x, tensors).double() - expected).abs().max()
    assert (got.double() - expected).abs().max() <= max(1.01 * torch_error, 1e-2)
    float_layer = Int8Linear(nn.Linear(576, 960))
    assert not linear.can_prepack(float_layer.tensors(), linear_ops)  # float32 scale: no


# -- the AMX tile kernel for many rows on the packed copy (kernels/csrc/tile_linear.cpp) ----------
@pytest.fixture(scope="module")
def tile_ops():
    ops = native.native_ops()
    if ops is None or not hasattr(ops, "tile_linear"):
        pytest.skip("no tile kernel here (no compiler, or no AMX)")
    return ops


@pytest.mark.parametrize("rows", [1, 17, 32, 70])  # part of a tile, one step, several and a tail
@pytest.mark.parametrize(("out", "inputs"), [(960, 576), (576, 1536), (32, 32), (320, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_tile_linear_equals_reference(tile_ops, rows, out, inputs, bias):
    """Against float64: within the output's own rounding, as oneDNN's bfloat16 product is."""
    g = torch.Generator().manual_seed(out + inputs + rows)
    weight = torch.randn(out, inputs, generator=g).bfloat16()
    b = torch.randn(out, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, inputs, generator=g).bfloat16()
    packed = linear.prepacked((weight, b), tile_ops)
    got = tile_ops.tile_linear(x, packed[0], packed[1])
    assert got.shape == (rows, out) and got.dtype == torch.bfloat16
    expected = x.double() @ weight.double().T + (b.double() if bias else 0)
    torch_error = (F.linear(x, weight, b).double() - expected).abs().max()
    assert (got.double() - expected).abs().max() <= max(1.01 * torch_error, 1e-2)


def test_tile_linear_refuses_what_it_cannot_run(tile_ops):
    packed = tile_ops.pack_linear_weight(torch.randn(32, 64).bfloat16())
    x = torch.randn(4, 64).bfloat16()
    odd = tile_ops.pack_linear_weight(torch.randn(32, 48).bfloat16())
    with pytest.raises(RuntimeError, match="multiples of 32"):
        tile_ops.tile_linear(torch.randn(4, 48).bfloat16(), odd, None)
    with pytest.raises(RuntimeError, match="x has 32 inputs, the weight 64"):
        tile_ops.tile_linear(torch.randn(4, 32).bfloat16(), packed, None)
    with pytest.raises(RuntimeError, match="bias must be n contiguous float32"):
        tile_ops.tile_linear(x, packed, torch.randn(31))
    with pytest.raises(RuntimeError, match="packed by pack_linear_weight"):
        tile_ops.tile_linear(x, torch.randn(32, 64).bfloat16(), None)
    with pytest.raises(RuntimeError, match="contiguous bfloat16"):
        tile_ops.tile_linear(x.float(), packed, None)
    # what it does not take (int8 rows, inputs not in whole tiles) stays on the packed kernel
    assert not linear.tiles_take(linear.prepacked((torch.randn(32, 48).bfloat16(), None), tile_ops))
    rows = torch.randint(-127, 128, (32, 64), dtype=torch.int8)
    assert not linear.tiles_take((tile_ops.pack_linear_weight(rows), torch.ones(32), None))


def test_engine_batches_on_tiles_decode_the_same_tokens(tile_ops, monkeypatch):
    """A decode batch above the one-row kernel's rows runs every layer on the tile kernel (the
    packed copy) where the choice says so: the same tokens as on the plain weights."""
    from speedkv.kernels.tuning import TILES, KernelChoice

    model = tiny_model("llama")
    model.hf_model.to(torch.bfloat16)
    specs = ["full", "speed:lcut=3,anchors=bos,deep=1", "speed:lcut=4,anchors=none,deep=3"]
    prompts = [random_prompt(n, seed=n) for n in (9, 23, 40)]
    plain = batch_tokens(Engine(model), prompts, specs, 6)

    choice = KernelChoice(decode_linear_native_rows=1, decode_linear_batches=TILES)
    monkeypatch.setattr(tuning, "kernel_choice", lambda: choice)
    monkeypatch.setattr(tuning, "engine_kernels", lambda: tile_ops)  # whatever is stored
    on_tiles = []
    real = linear._on_tiles
    monkeypatch.setattr(linear, "_on_tiles", lambda *a: on_tiles.append(real(*a)) or on_tiles[-1])
    real_layer = layer_work.decode_layer  # a whole layer in one call: its products' kernel
    monkeypatch.setattr(
        layer_work, "decode_layer", lambda *a: on_tiles.append(a[-1]) or real_layer(*a)
    )
    engine = Engine(model, prepack=True)
    assert model.backbone.tile_batches and model.backbone.kernels.tiles_above == 1
    assert batch_tokens(engine, prompts, specs, 6) == plain
    assert any(on_tiles)  # the batch's layers went to the tile kernel


def test_a_stored_tile_choice_without_the_tile_kernel_keeps_the_plain_weights(
    tile_ops, monkeypatch
):
    """A choice stored when the tile kernel built outlives a library since lost: the engine
    then decodes batches on the plain weights, never calling a kernel it does not have."""
    from speedkv.kernels.tuning import TILES, KernelChoice

    choice = KernelChoice(decode_linear_native_rows=1, decode_linear_batches=TILES)
    without = native.NativeKernels(
        {name: getattr(tile_ops, name) for name in tile_ops.names if name != "tile_linear"}
    )
    monkeypatch.setattr(tuning, "kernel_choice", lambda: choice)
    monkeypatch.setattr(tuning, "engine_kernels", lambda: without)
    model = tiny_model("llama")
    model.hf_model.to(torch.bfloat16)
    Engine(model, prepack=True)
    assert not model.backbone.tile_batches and model.backbone.kernels.tiles_above is None


# -- a decode step's whole layer in one native call (kernels/csrc/decode_layer.cpp) ---------------
# shapes every native decode kernel takes: head_dim 32 (two vectors of 16 lanes), products and
# the vocabulary in whole tiles of 32, an MLP width of whole vectors for the one-pass SiLU
NATIVE_SHAPED = dict(hidden_size=128, intermediate_size=256, vocab_size=128)
ONE_CALL_SPECS = [
    "full",
    "speed:lcut=3,anchors=bos,deep=1",
    "speed:lcut=4,anchors=sink:2,deep=2,selfonly=true",  # deep layers keep no decode K/V
    "fastkv:tsp_layer=2,tsp_rate=0.5,retain=0.5,window=4",  # a cut prompt cache: still appends
]


@pytest.fixture(scope="module")
def layer_ops():
    ops = native.native_ops()
    if ops is None or not hasattr(ops, "decode_layer") or not hasattr(ops, "packed_linear"):
        pytest.skip("no native decode layer here (no compiler, or neither AVX512-BF16 nor AVX2)")
    return ops


def logits_per_step(engine, prompts, specs, steps, one_call: bool) -> tuple[list, list]:
    """Every decode step's logits for one batch of every prompt under every method, with the
    layers run in one native call each where the engine can (`one_call`) or in parts; and
    whether each step ran them in one call."""
    from speedkv.core import engine as engine_module

    logits, used = [], []
    real_step, real_choice = Engine.decode_step, Engine._layers_in_one_call

    def choose(self, *args):
        used.append(one_call and real_choice(self, *args))
        return used[-1]

    def step(self, *args):
        logits.append(real_step(self, *args))
        return logits[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_module.Engine, "_layers_in_one_call", choose)
        patch.setattr(engine_module.Engine, "decode_step", step)
        batch_tokens(engine, prompts, specs, steps)
    return logits, used


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v products with a bias
@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
@pytest.mark.parametrize("batches", ["one-row kernel", "tile kernel"])
def test_a_decode_layer_in_one_call_is_the_layer_in_parts_bit_for_bit(
    layer_ops, monkeypatch, family, weights, batches
):
    """A batch of methods and lengths: every step's logits equal the layer-by-parts path's,
    bit for bit, and every step ran its layers in one call."""
    from speedkv.hf.loading import quantize_int8
    from speedkv.kernels.tuning import TILES, KernelChoice

    if batches == "tile kernel" and (weights == "int8" or not hasattr(layer_ops, "tile_linear")):
        pytest.skip("the tile kernel takes bfloat16 weights, on CPUs with AMX")
    choice = KernelChoice()  # every kind native, every batch on the one-row kernel
    if batches == "tile kernel":
        choice = KernelChoice(decode_linear_native_rows=1, decode_linear_batches=TILES)
    monkeypatch.setattr(tuning, "kernel_choice", lambda: choice)
    monkeypatch.setattr(tuning, "engine_kernels", lambda: layer_ops)
    monkeypatch.setattr(attention, "engine_kernels", lambda: layer_ops)
    model = tiny_model(family, **NATIVE_SHAPED)
    model.hf_model.to(torch.bfloat16)
    if weights == "int8":
        model = quantize_int8(model)
    engine = Engine(model, prepack=True)
    prompts = [random_prompt(n, seed=n) for n in (9, 23, 40)]

    in_parts, used = logits_per_step(engine, prompts, ONE_CALL_SPECS, 5, one_call=False)
    assert not any(used)
    in_one_call, used = logits_per_step(engine, prompts, ONE_CALL_SPECS, 5, one_call=True)
    assert used and all(used)
    assert len(in_one_call) == len(in_parts) == 4  # the first token comes from the prefill
    for a, b in zip(in_one_call, in_parts):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "spec",
    [
        "h2o:heavy=0.3,recent=0.3",  # evicts after each step
        "swiftkv:k=3,acrosskv=1",  # K/V of upper layers from layer 3's input
        "snapkv:retain=0.5,window=4,gqa=false",  # a cache per query head
    ],
)
def test_methods_that_do_more_than_append_decode_in_parts(layer_ops, monkeypatch, spec):
    """A batch with one sequence whose decode does more than append its token to each layer's
    own cache runs every layer in parts, with the tokens of each sequence decoded alone."""
    from speedkv.kernels.tuning import KernelChoice

    monkeypatch.setattr(tuning, "kernel_choice", lambda: KernelChoice())
    monkeypatch.setattr(tuning, "engine_kernels", lambda: layer_ops)
    monkeypatch.setattr(attention, "engine_kernels", lambda: layer_ops)
    model = tiny_model("llama", **NATIVE_SHAPED)
    model.hf_model.to(torch.bfloat16)
    engine = Engine(model, prepack=True)
    prompts = [random_prompt(30, seed=3)]
    _, used = logits_per_step(engine, prompts, ["full", spec], 4, one_call=True)
    assert used and not any(used)
    _, used = logits_per_step(engine, prompts, ["full"], 4, one_call=True)
    assert all(used)  # alone, full attention does run in one call
    together = batch_tokens(engine, prompts, ["full", spec], 6)
    assert together == [batch_tokens(engine, prompts, [s], 6)[0] for s in ("full", spec)]


def test_no_decode_layer_in_one_call_without_every_native_piece(layer_ops, monkeypatch):
    """Under torch's kernels for any kind of work the layer calls, or on float32 weights (the
    exact reference, on oneDNN's layout), decode runs its layers in parts."""
    from speedkv.kernels.tuning import TORCH, KernelChoice

    model = tiny_model("llama", **NATIVE_SHAPED)
    model.hf_model.to(torch.bfloat16)
    for kind in ("decode_attention", "layer_ops", "decode_linear"):
        choice = KernelChoice(**{kind: TORCH})
        monkeypatch.setattr(tuning, "kernel_choice", lambda choice=choice: choice)
        kept = native.NativeKernels(
            {n: getattr(layer_ops, n) for n in layer_ops.names
             if n not in choice.hidden_operators()}
        )  # fmt: skip
        monkeypatch.setattr(tuning, "engine_kernels", lambda kept=kept: kept)
        engine = Engine(model, prepack=True)
        engine.backbone.check_weights()
        assert "decode_layer" not in kept.names
        assert not engine.backbone.layers_in_one_call(1), kind
    float_model = tiny_model("llama", **NATIVE_SHAPED)
    monkeypatch.setattr(tuning, "kernel_choice", lambda: KernelChoice())
    monkeypatch.setattr(tuning, "engine_kernels", lambda: layer_ops)
    engine = Engine(float_model, prepack=True)
    engine.backbone.check_weights()
    assert not engine.backbone.layers_in_one_call(1)


def test_silu_mul_equals_torchs_on_every_bfloat16_value(small_ops):
    """Every finite bfloat16 gate value, against torch's SiLU and product: bit for bit (the
    one-pass kernel uses torch's own vectorized exp and rounds where torch rounds)."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gate = every[torch.isfinite(every.float())]
    gate = gate[: gate.numel() // 256 * 256].view(-1, 256)
    up = torch.randn(gate.shape, generator=torch.Generator().manual_seed(0)).bfloat16()
    got = small_ops.silu_mul(torch.cat([gate, up], dim=-1))
    assert torch.equal(got.view(torch.int16), (F.silu(gate) * up).view(torch.int16))
