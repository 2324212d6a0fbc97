"""The native bfloat16 prefill kernel (kernels/csrc/prefill_attention.cpp) against a float64
reference and torch's kernel; which calls take it; its refusals; the engine on it."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from speedkv.core.engine import Engine
from speedkv.core.registry import make_policy
from speedkv.hf.loading import LoadedModel
from speedkv.kernels import attention, native

from conftest import TINY, random_prompt
from helpers import compiler_targets


@pytest.fixture(scope="module")
def ops():
    ops = native.native_ops()
    if not native.has_prefill_kernel(ops):
        pytest.skip("no native prefill kernel here (no compiler, or no AVX512-BF16)")
    return ops


def reference(q, k, v):
    """float64 causal attention, the queries being the last keys."""
    n_q, n_k = q.shape[1], k.shape[1]
    visible = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)
    return F.scaled_dot_product_attention(
        q.double()[None], k.double()[None], v.double()[None], attn_mask=visible, enable_gqa=True
    )[0]


def torch_bf16(q, k, v):
    n_q, n_k = q.shape[1], k.shape[1]
    visible = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)
    return F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=visible, enable_gqa=True
    )[0]


def torch_bf16_runs_here() -> bool:
    """Whether torch's bfloat16 attention runs at all: on an AMX CPU whose ATen is kept to AVX2
    (`ATEN_CPU_CAPABILITY=avx2`, a test setting) it raises "pack_vnni2 is only supported when
    avx512 is supported" from 65 keys on."""
    q = torch.zeros(2, 80, 64, dtype=torch.bfloat16)
    try:
        torch_bf16(q, q, q)
    except RuntimeError:
        return False
    return True


def assert_near_torchs_error(got, q, k, v, floor: float) -> None:
    """got is within twice torch's own bfloat16 error against the float64 reference, or within
    `floor` (the bound alone where torch's bfloat16 attention does not run here)."""
    expected = reference(q, k, v)
    error = (got.double() - expected).abs().max().item()
    theirs = torch_bf16(q, k, v) if torch_bf16_runs_here() else expected
    torch_error = (theirs.double() - expected).abs().max().item()
    assert error <= max(2 * torch_error, floor), (error, torch_error)


def bf16_inputs(heads, kv_heads, n_q, n_k, dim, seed=0):
    """Random q, k, v; k and v as strided views into a buffer with room left, as a cache is."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_q, heads, dim, generator=g).bfloat16().transpose(0, 1)  # [H, n, D] view
    k = torch.randn(kv_heads, n_k + 8, dim, generator=g).bfloat16()[:, :n_k]
    v = torch.randn(kv_heads, n_k + 8, dim, generator=g).bfloat16()[:, :n_k]
    return q, k, v


@pytest.mark.parametrize(
    ("heads", "kv_heads", "n_q", "n_k", "dim"),
    [
        (9, 3, 1, 1, 64),  # one token
        (9, 3, 31, 31, 64),  # less than a block of queries
        (9, 3, 65, 65, 64),  # one past a block of keys
        (9, 3, 300, 300, 64),  # several blocks, tails on both
        (14, 2, 100, 100, 64),  # Qwen2.5's grouping
        (4, 4, 77, 77, 128),  # no grouping, the widest heads
        (2, 1, 40, 40, 32),
        (9, 3, 5, 200, 64),  # queries after cached keys (a continued prompt)
        (9, 3, 70, 133, 128),
    ],
)
def test_native_prefill_equals_reference(ops, heads, kv_heads, n_q, n_k, dim):
    q, k, v = bf16_inputs(heads, kv_heads, n_q, n_k, dim)
    got = ops.causal_attention(q, k, v, dim**-0.5)
    assert got.shape == (heads, n_q, dim) and got.dtype == torch.bfloat16
    # probabilities are rounded to bf16 before the second product: a little above torch's
    # error, which is the output's own rounding (half a bf16 step at |x| < 2 is 4e-3)
    assert_near_torchs_error(got, q, k, v, floor=8e-3)


@pytest.mark.parametrize("climb", [1.0, 30.0])
def test_native_prefill_when_scores_climb(ops, climb):
    """Later keys outscore earlier ones by more and more, so each row's running max moves
    again and again (block after block, and by more than the kernel's slack), and the output
    sums so far must be rescaled each time; then sharp attention (few keys carry a row)."""
    q, k, v = bf16_inputs(9, 3, 400, 400, 64, seed=1)
    ramp = torch.linspace(0.1, climb, 400)[None, :, None]
    k = (k.float() * ramp).bfloat16()
    got = ops.causal_attention(q, k, v, 0.125)
    # sharp rows are close to one value row (|x| < 4): half a bf16 step there is 1.6e-2
    assert_near_torchs_error(got, q, k, v, floor=1.6e-2)


def test_native_prefill_follows_the_scale(ops):
    q, k, v = bf16_inputs(9, 3, 50, 50, 64)
    got = ops.causal_attention(q, k, v, 0.5)
    expected = reference(q * (0.5 * 8), k, v)  # reference scales by 1/sqrt(64) = 1/8
    assert (got.double() - expected).abs().max() < 2e-2


def test_native_prefill_refuses_what_it_cannot_run(ops):
    q, k, v = bf16_inputs(9, 3, 10, 10, 64)
    with pytest.raises(RuntimeError, match="bfloat16 only"):
        ops.causal_attention(q.float(), k.float(), v.float(), 0.125)
    with pytest.raises(RuntimeError, match="n_k >= n_q"):
        ops.causal_attention(q, k[:, :5], v[:, :5], 0.125)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        ops.causal_attention(q[:8], k, v, 0.125)
    with pytest.raises(RuntimeError, match="rows must be contiguous"):
        columns = torch.randn(3, 64, 10).bfloat16().transpose(1, 2)
        ops.causal_attention(q, columns, columns, 0.125)
    with pytest.raises(RuntimeError, match="head_dim must be"):
        odd = torch.randn(3, 10, 48).bfloat16()
        ops.causal_attention(torch.randn(9, 10, 48).bfloat16(), odd, odd, 0.125)
    with pytest.raises(RuntimeError, match="one shape"):
        ops.causal_attention(q, k, v[:, :9], 0.125)


def test_prefill_attention_takes_the_native_kernel_only_for_bf16_causal(ops, monkeypatch):
    calls = []

    class Counting:
        def causal_attention(self, *args):
            calls.append(args[0].dtype)
            return ops.causal_attention(*args)

    monkeypatch.setattr(attention, "engine_kernels", lambda: Counting())
    q, k, v = bf16_inputs(9, 3, 20, 20, 64)
    attention.prefill_attention(q, k, v)
    assert calls == [torch.bfloat16]
    mask = torch.ones(20, 20, dtype=torch.bool).tril()
    masked = attention.prefill_attention(q, k, v, mask)  # an explicit mask: torch's kernel
    exact = attention.prefill_attention(q.float(), k.float(), v.float())  # float32: torch's
    assert calls == [torch.bfloat16]
    assert (masked.double() - reference(q, k, v)).abs().max() < 8e-3
    assert (exact.double() - reference(q, k, v)).abs().max() < 1e-5


def forced_logits(engine: Engine, ids: list[int], policy, forced=(5, 17, 42)) -> torch.Tensor:
    """Logits after the prompt, then after each of the `forced` tokens: greedy choices could
    part on a near tie and make later rows incomparable."""
    done = engine.prefill_ids(ids, policy, spare=len(forced))
    rows = [done.logits]
    for i, token in enumerate(forced):
        rows.append(engine.decode_step([done.cache], [policy], [token], [len(ids) + i])[0])
    return torch.stack(rows).float()


def tiny_bf16_model(family: str) -> LoadedModel:
    """A tiny random model with heads of 32 dimensions (the kernel's smallest), in bf16."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = {**TINY, "hidden_size": 128}
    if family == "llama":
        hf = LlamaForCausalLM(LlamaConfig(**config))
    else:
        hf = Qwen2ForCausalLM(Qwen2Config(**config))
    with torch.no_grad():  # random init is too flat for decisive greedy choices
        for p in hf.parameters():
            p.mul_(3.0)
    hf.to(torch.bfloat16).eval().requires_grad_(False)
    return LoadedModel(name=f"tiny-{family}-bf16", hf_model=hf, tokenizer=None, source="memory")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_engine_prefill_on_the_native_kernel_is_as_close_to_float32_as_torchs(
    ops, family, monkeypatch
):
    """A bf16 tiny model, full and SPEED: the logits after prefill and three decode steps (of
    the same given tokens) on the native kernel are as close to the same weights in float32
    as torch's kernel gets."""
    import copy

    if not torch_bf16_runs_here():
        pytest.skip("torch's bfloat16 attention, the yardstick here, does not run here")
    model = tiny_bf16_model(family)
    exact = copy.deepcopy(model)
    exact.hf_model.float()
    prompt = random_prompt(150, seed=3)
    specs = ("full", "speed:lcut=3,anchors=bos,deep=1")

    def logits(loaded):
        engine = Engine(loaded)
        return [forced_logits(engine, prompt, make_policy(s, loaded.shape)) for s in specs]

    on_native = logits(model)
    reference_logits = logits(exact)
    monkeypatch.setattr(attention, "engine_kernels", lambda: None)
    on_torch = logits(model)
    for spec, got, theirs, truth in zip(specs, on_native, on_torch, reference_logits):
        error = (got - truth).abs().max().item()
        torch_error = (theirs - truth).abs().max().item()
        assert error <= 1.5 * torch_error + 0.02, (spec, error, torch_error)


def test_native_prefill_kernel_is_built_where_the_cpu_has_bf16_dot_products():
    """On a CPU with AVX512-BF16 and a compiler (this machine, CI) the suite must run the
    native prefill kernel, not only torch's."""
    if native.native_ops() is None or not compiler_targets("__AVX512BF16__"):
        pytest.skip("this CPU has no AVX512-BF16, or nothing can be compiled here")
    assert native.has_prefill_kernel(native.native_ops())


def test_the_products_run_on_amx_tiles_where_the_compiler_targets_them(ops):
    """On a CPU with AMX (this machine if an Intel Xeon since Sapphire Rapids) the tests above
    ran the tile path; elsewhere the dot-product path. Which one is said, for `doctor`."""
    targets_amx = compiler_targets("__AMX_TILE__", "__AMX_BF16__")
    cpuinfo = Path("/proc/cpuinfo")
    # Linux lists amx_tile only where it hands processes the tile state
    granted = cpuinfo.is_file() and " amx_tile" in cpuinfo.read_text()
    unit = ops.prefill_attention_unit()
    assert unit == ("AMX tiles" if targets_amx and granted else "AVX512-BF16")
