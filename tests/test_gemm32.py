"""bf16 / fp16 GEMMs of calibration forwards computed in float32 (``fp8ptq.model.gemm32``): the
values (correctly rounded float32 results, in row chunks), where the mode applies, that the
quantize pipeline and sequential mode run their forwards under it, and its memory."""

import math

import pytest
import torch
import torch.nn.functional as F

from fp8ptq.config.recipe import Recipe
from fp8ptq.execution.in_memory import quantize_model, token_batches
from fp8ptq.model import gemm32
from fp8ptq.model.gemm32 import float32_gemms, linear32
from fp8ptq.sensitivity.probes import LogitsProbe, PerplexityProbe
from tiny_models import IDS, STATIC_RECIPE, tiny
from tolerances import perplexity_rel_tolerance


def _operands(dtype, n=300, k=96, tokens=(3, 17), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*tokens, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear32_is_the_float32_result_rounded_in_chunks(dtype, with_bias, monkeypatch):
    """One chunk: the float32 GEMM's value rounded to the input dtype. Chunked (the chunk
    shrunk to 7 weight rows here: 43 chunks): against a float64 reference every output is
    within one unit in the last place of that dtype (plus float32 summation's error bound),
    and nearly all within half a unit: correctly rounded."""
    x, w, b = _operands(dtype)
    b = b if with_bias else None
    whole = F.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype)
    assert torch.equal(linear32(x, w, b), whole)
    monkeypatch.setattr(gemm32, "CHUNK_BYTES", 7 * 4 * x.shape[-1])
    assert gemm32.rows_per_chunk(51, x.shape[-1], w.shape[0]) == 7
    out = linear32(x, w, b)
    assert out.dtype == dtype and out.shape == (3, 17, 300)
    # a 7-row GEMM may sum in another order than the whole one: the bound below, not equality
    assert (out != whole).float().mean() < 0.01
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    _, e = torch.frexp(exact.abs())  # |exact| in [2^(e-1), 2^e): spacing 2^(e-1) * eps
    ulp = torch.ldexp(torch.full_like(exact, torch.finfo(dtype).eps), e - 1)
    # plus float32 summation's own error bound, which matters where the terms cancel
    size = F.linear(x.double().abs(), w.double().abs(), None if b is None else b.double().abs())
    sum_error = x.shape[-1] * torch.finfo(torch.float32).eps * size
    assert bool(((out.double() - exact).abs() <= ulp + sum_error).all())
    assert bool(((out.double() - exact).abs() <= ulp / 2 + sum_error).float().mean() > 0.99)


def test_mode_applies_to_low_precision_cpu_inference_only(monkeypatch):
    """Forced on: a bf16 ``nn.Linear`` under inference runs ``linear32`` (and gives its
    values); float32 modules, autograd and the mode forced off run torch's own kernel."""
    x, w, b = _operands(torch.bfloat16)
    lin = torch.nn.Linear(96, 300).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    want32 = linear32(x, w, b)
    seen = _calls(monkeypatch)
    with torch.inference_mode():
        with float32_gemms(force=True):
            assert torch.equal(lin(x), want32) and len(seen) == 1
            with float32_gemms(force=True):  # re-entrant: one mode, one call
                assert torch.equal(lin(x), want32) and len(seen) == 2
        with float32_gemms(force=False):
            assert torch.equal(lin(x), F.linear(x, w, b)) and len(seen) == 2
        lin32 = torch.nn.Linear(96, 300)
        with float32_gemms(force=True):
            lin32(x.float())
    with float32_gemms(force=True):  # autograd: torch's kernel, with its graph
        assert lin(x).requires_grad
    assert len(seen) == 2


def test_environment_decides_before_the_cpu_check(monkeypatch):
    monkeypatch.setenv("FP8PTQ_FLOAT32_GEMMS", "1")
    assert gemm32.wanted(torch.bfloat16) and not gemm32.wanted(torch.float32)
    monkeypatch.setenv("FP8PTQ_FLOAT32_GEMMS", "0")
    assert not gemm32.wanted(torch.bfloat16)
    assert gemm32.wanted(torch.bfloat16, force=True)
    monkeypatch.delenv("FP8PTQ_FLOAT32_GEMMS")
    assert gemm32.wanted(torch.float16) == gemm32.cpu_lacks_fast_lowp(torch.float16)


def test_no_whole_weight_float32_copy():
    """The weight is upcast by chunks: no allocation reaches the float32 size of the weight
    (here 4x the chunk budget)."""
    from torch.profiler import ProfilerActivity, profile

    k, n = 1024, 4 * gemm32.CHUNK_BYTES // (4 * 1024)  # float32 weight: 4 chunks
    x = torch.randn(8, k).to(torch.bfloat16)
    w = torch.randn(n, k).to(torch.bfloat16)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        linear32(x, w)
    largest = max(e.self_cpu_memory_usage for e in prof.events() if e.name != "[memory]")
    assert 0 < largest <= gemm32.CHUNK_BYTES < n * k * 4
    rows = gemm32.CHUNK_BYTES // (4 * k)  # 8192 weight rows a chunk
    assert gemm32.extra_bytes(8, k, n) == 4 * (8 * k + rows * k + 8 * rows)


def _calls(monkeypatch) -> list:
    seen = []
    real = gemm32.linear32

    def spy(x, w, b=None):
        seen.append(tuple(w.shape))
        return real(x, w, b)

    monkeypatch.setattr(gemm32, "linear32", spy)
    return seen


def test_quantize_model_calibrates_with_float32_gemms(monkeypatch):
    """A bf16 model's statistics pass runs its GEMMs through ``linear32`` (forced on), and the
    static input amax is the one a forward under the mode sees."""
    monkeypatch.setenv("FP8PTQ_FLOAT32_GEMMS", "1")
    model = tiny("llama", dtype=torch.bfloat16).eval()
    seen = _calls(monkeypatch)
    amax = {}
    hooks = [m.register_forward_pre_hook(
        lambda mod, a, name=name: amax.__setitem__(name, max(amax.get(name, 0.0),
                                                             float(a[0].abs().max()))))
        for name, m in model.named_modules() if name.endswith("down_proj")]
    with torch.inference_mode(), float32_gemms():
        for batch in token_batches(IDS, 4):
            model(**batch)
    for h in hooks:
        h.remove()
    seen.clear()
    result = quantize_model(model, Recipe(format="e4m3", **STATIC_RECIPE),
                            list(token_batches(IDS, 4)))
    assert seen  # the forwards went through the float32 GEMM
    got = {r.name: r.input_amax for r in result.modules if r.name.endswith("down_proj")}
    assert got == pytest.approx(amax, rel=0, abs=0) and len(got) == 2


@pytest.mark.parametrize("probe", ["ppl", "logits"])
def test_sensitivity_probes_run_float32_gemms(probe, monkeypatch):
    """``fp8ptq sensitivity`` / ``--target-delta``'s model passes (perplexity and logits
    probes) run a bf16 model's GEMMs through ``linear32``, and measure what a forward under the
    mode gives (bit for bit)."""
    monkeypatch.setenv("FP8PTQ_FLOAT32_GEMMS", "1")
    model = tiny("llama", dtype=torch.bfloat16).eval()
    seen = _calls(monkeypatch)
    if probe == "ppl":
        value = PerplexityProbe(model, IDS, batch_size=len(IDS)).baseline()
        with torch.inference_mode(), float32_gemms():
            want = math.exp(float(model(input_ids=IDS, labels=IDS, use_cache=False).loss))
        # scored in chunks of the output layer and summed in float64; HF averages in float32
        assert value == pytest.approx(want, rel=perplexity_rel_tolerance(want))
    else:
        p = LogitsProbe(model, IDS)
        p.baseline()
        with torch.inference_mode(), float32_gemms():
            want = model(input_ids=IDS).logits.float()
        assert torch.equal(p.ref, want)
    assert seen


@pytest.mark.parametrize("masked", [False, True])
def test_attention_runs_in_float32_under_the_mode(masked, monkeypatch):
    """bf16 ``scaled_dot_product_attention`` under the mode (forced on) is the float32
    attention of the same inputs (a float mask upcast too) rounded once to bf16; off, or with
    autograd, torch's own bf16 kernel runs."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 33, 16, generator=g).to(torch.bfloat16) for _ in range(3))
    kw = {"attn_mask": torch.randn(33, 33, generator=g).to(torch.bfloat16)} if masked else \
        {"is_causal": True}
    want = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(),
        **{n: t.float() if torch.is_tensor(t) else t for n, t in kw.items()}).to(torch.bfloat16)
    bf16 = F.scaled_dot_product_attention(q, k, v, **kw)
    assert not torch.equal(want, bf16)  # the two kernels round differently
    with torch.no_grad():
        with float32_gemms(force=True):
            assert torch.equal(F.scaled_dot_product_attention(q, k, v, **kw), want)
        with float32_gemms(force=False):
            assert torch.equal(F.scaled_dot_product_attention(q, k, v, **kw), bf16)
    with float32_gemms(force=True):  # autograd: torch's kernel
        assert torch.equal(F.scaled_dot_product_attention(q, k, v, **kw), bf16)


@pytest.mark.parametrize("dtype, entered", [(torch.float32, False), (torch.bfloat16, True)])
def test_a_model_that_never_upcasts_enters_no_mode(dtype, entered, monkeypatch):
    """``float32_gemms(model=...)`` on a float32 model pushes no torch-function mode (every
    torch call would pay its Python dispatch for nothing); on a bf16 one it does."""
    monkeypatch.setenv("FP8PTQ_FLOAT32_GEMMS", "1")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).to(dtype)
    stack = torch.overrides._get_current_function_mode_stack
    before = len(stack())
    with float32_gemms(model=model):
        assert len(stack()) - before == int(entered)
    assert len(stack()) == before
    assert gemm32.float_dtype(model) == dtype


def test_upcast_into_scratch_keeps_values_and_layout():
    """GEMM inputs and attention operands are upcast into this thread's scratch buffer: the
    values and strides of ``t.float()`` (a transposed view stays transposed), the same memory
    at the next call; a tensor that is not dense, or whose float32 copy exceeds
    ``CHUNK_BYTES``, gets a new tensor instead."""
    g = torch.Generator().manual_seed(0)
    t = torch.randn(2, 5, 3, 4, generator=g).to(torch.bfloat16).transpose(1, 2)
    u = gemm32._upcast(t, "test")
    assert torch.equal(u, t.float()) and u.stride() == t.float().stride() == t.stride()
    again = gemm32._upcast(torch.randn(2, 5, 3, 4, generator=g).to(torch.bfloat16)
                           .transpose(1, 2), "test")
    assert again.data_ptr() == u.data_ptr()
    sparse = t[..., ::2]
    got = gemm32._upcast(sparse, "test")
    assert torch.equal(got, sparse.float()) and got.data_ptr() != u.data_ptr()
    big = torch.zeros(gemm32.CHUNK_BYTES // 4 + 1, dtype=torch.bfloat16)
    assert gemm32._upcast(big, "test").data_ptr() != u.data_ptr()
    gemm32._active.scratch = None


def test_linear32_allocates_only_its_output_once_warm():
    """After the first call, a GEMM allocates nothing but its bf16 output: its float32 input,
    weight chunk and output chunk live in the scratch buffers (no fresh pages to fault in)."""
    from torch.profiler import ProfilerActivity, profile

    x, w, b = _operands(torch.bfloat16, n=3000, k=512, tokens=(4, 300))
    want = linear32(x, w, b)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        got = linear32(x, w, b)
    assert torch.equal(got, want)
    sizes = [e.self_cpu_memory_usage for e in prof.events()
             if e.name != "[memory]" and e.self_cpu_memory_usage > 0]
    out_bytes = got.numel() * got.element_size()
    assert max(sizes) == out_bytes and sum(sizes) < out_bytes + 4 * w.shape[0] + 4096
    gemm32._active.scratch = None


def test_attention32_on_transposed_operands():
    """Attention operands as transformers passes them ([B, T, H, D] transposed to
    [B, H, T, D]) give the float32 attention of the same values, rounded once."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 33, 4, 16, generator=g).to(torch.bfloat16).transpose(1, 2)
               for _ in range(3))
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                          is_causal=True).to(torch.bfloat16)
    with torch.no_grad(), float32_gemms(force=True):
        assert torch.equal(F.scaled_dot_product_attention(q, k, v, is_causal=True), want)
