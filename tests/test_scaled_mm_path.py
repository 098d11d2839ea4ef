"""The real FP8 GEMM path of ``QuantGemm`` (``torch._scaled_mm``), checked on the CPU: its
activation quantization (eager: what runs wherever ``torch.compile`` cannot) gives exactly the
simulation's values, the compiled quantizer is chosen only for CUDA, and a layer on a fake
CUDA device (``tests/fake_cuda.py``) routes through ``_scaled_mm`` with devices and scale
layouts that agree."""

import pytest
import torch
from torch import nn

from fake_cuda import CUDA, fake_cuda
from fp8ptq.formats import encode_scaled, get_format
from fp8ptq.formats.granularity import weight_granularity
from fp8ptq.nn import quant_gemm
from fp8ptq.nn.quant_gemm import QuantGemm, activation_quantizer, quantize_activation

E4M3 = get_format("e4m3")


def _gemm(act: str, weight_gran: str = "channel", seed: int = 0, out: int = 32) -> QuantGemm:
    g = torch.Generator().manual_seed(seed)
    inner = nn.Linear(64, out, bias=True)
    with torch.no_grad():
        inner.weight.copy_(torch.randn(out, 64, generator=g))
    gran = weight_granularity(weight_gran)
    w = inner.weight.detach()
    scale = gran.amax(w) / E4M3.layout.max
    codes = encode_scaled(w, gran.expand(scale, w), E4M3)
    static = act == "tensor"
    return QuantGemm(inner, weight_format=E4M3, weight_codes=codes, weight_scale=scale,
                     weight_granularity=gran, act_format=E4M3,
                     input_scale=torch.tensor([0.02]) if static else None,
                     act_granularity=act)


def _activations(seed: int = 1) -> torch.Tensor:
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(seed)) * 3
    x[5] = 0.0  # a token of zeros: the smallest scale, codes all zero
    x[7, 3] = 1e4  # saturates under the static scale
    return x


@pytest.mark.parametrize("act", ["tensor", "token"])
def test_eager_activation_quantization_is_the_simulation(act):
    q = _gemm(act)
    x = _activations()
    quantize = activation_quantizer("e4m3", act == "token", "cpu")
    a, scale = quantize(x, q.input_scale)
    assert a.dtype == torch.float8_e4m3fn
    assert tuple(scale.shape) == ((37, 1) if act == "token" else (1,))
    simulated = q.quantize_input(x)
    assert torch.equal(a.float() * scale, simulated)


def test_the_compiled_quantizer_is_chosen_only_for_cuda(monkeypatch):
    compiled = []

    def fake_compile(fn, **kwargs):
        compiled.append((fn, kwargs))
        return fn
    monkeypatch.setattr(quant_gemm, "_can_compile", lambda: True)
    monkeypatch.setattr(torch, "compile", fake_compile)
    activation_quantizer.cache_clear()
    quant_gemm._compiled.cache_clear()
    try:
        cpu = activation_quantizer("e4m3", True, "cpu")
        assert not compiled and cpu.func is quant_gemm._per_token_rows
        cuda = activation_quantizer("e4m3", True, "cuda")
        assert activation_quantizer("e4m3", True, "cuda") is cuda  # made once per key
        activation_quantizer("e5m2", True, "cuda")
        activation_quantizer("e4m3", False, "cuda")
        # one plain function per scale kind, each compiled once: a partial would share
        # torch.compile's one wrapper frame (and its recompile limit) with every other key
        assert compiled == [(quant_gemm._per_token_rows, {"dynamic": True}),
                            (quant_gemm._static_rows, {"dynamic": True})]
        x = _activations()
        a, scale = cuda(x, None)  # bound to its format: quantize_activation's values
        want, want_scale = quantize_activation(x, None, quant_gemm.act_granularity_of("token"),
                                               E4M3)
        assert torch.equal(a.float(), want.float()) and torch.equal(scale, want_scale)
    finally:
        activation_quantizer.cache_clear()
        quant_gemm._compiled.cache_clear()


def test_a_failing_compile_falls_back_to_the_eager_quantizer():
    def broken(*_args):
        raise RuntimeError("no C compiler")
    eager = activation_quantizer("e4m3", True, "cpu")
    q = quant_gemm._CompiledOrEager(broken, eager)
    x = _activations()
    with pytest.warns(RuntimeWarning, match="no C compiler.*eager quantizer"):
        a, scale = q(x, None)
    assert q.failed
    assert torch.equal(a.float() * scale, _gemm("token").quantize_input(x))
    q(x, None)  # said once: later calls go straight to the eager quantizer


@pytest.mark.parametrize("act,weight_gran", [("tensor", "tensor"), ("tensor", "channel"),
                                             ("token", "channel"), ("token", "tensor")])
def test_a_cuda_layer_runs_scaled_mm_with_its_plan(act, weight_gran, monkeypatch):
    q = _gemm(act, weight_gran)
    calls = []
    real = torch._scaled_mm

    def scaled_mm(a, b, **kw):
        calls.append((a.device, b.device, kw["scale_a"].shape, kw["scale_b"].shape,
                      kw["scale_a"].device, kw["scale_b"].device))
        return real(a, b, **kw)
    monkeypatch.setattr(quant_gemm, "_fp8_capable", lambda device: device.type == "cuda")
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    assert q.scaled_mm_plan(torch.device("cpu")) is None  # the CPU simulates
    with fake_cuda():
        q.to(CUDA)
        y = q(torch.randn(2, 5, 64, device=CUDA))
        plan = q.scaled_mm_plan(CUDA)
    assert y.device == CUDA and tuple(y.shape) == (2, 5, 32)
    rowwise = act == "token" or weight_gran == "channel"
    assert plan.rowwise == rowwise and plan.device == CUDA
    assert calls == [(CUDA, CUDA, (10, 1) if rowwise else (), (1, 32) if rowwise else (),
                      CUDA, CUDA)]


def test_a_layer_scaled_mm_cannot_take_is_simulated_on_cuda(monkeypatch):
    """``_scaled_mm`` needs both GEMM dimensions to be multiples of 16: 24 outputs are not."""
    monkeypatch.setattr(quant_gemm, "_fp8_capable", lambda device: device.type == "cuda")
    q = _gemm("token", out=24)
    with fake_cuda():
        q.to(CUDA)
        y = q(torch.randn(3, 64, device=CUDA))
        assert q.scaled_mm_plan(CUDA) is None
    assert y.device == CUDA and tuple(y.shape) == (3, 24)


def test_simulated_gemms_turns_the_real_path_off_for_its_block(monkeypatch):
    monkeypatch.setattr(quant_gemm, "_fp8_capable", lambda device: device.type == "cuda")
    q = _gemm("token")
    with fake_cuda():
        q.to(CUDA)
        with quant_gemm.simulated_gemms():
            assert q.scaled_mm_plan(CUDA) is None
            assert quant_gemm.gemm_paths(q) == {"gemms": 1, "real_fp8": 0, "simulated": 1}
        assert q.scaled_mm_plan(CUDA) is not None
        assert quant_gemm.gemm_paths(q) == {"gemms": 1, "real_fp8": 1, "simulated": 0}


@pytest.mark.parametrize("act", ["token", "tensor"])
def test_siblings_fed_one_input_quantize_it_once_per_token(act, monkeypatch):
    """q/k/v (gate/up) read the same hidden states: with per-token scales the codes are the
    same for all three, so the real path quantizes them once; static scales are per module
    (reading them to compare would sync the GPU), and an in-place change is never served
    stale."""
    monkeypatch.setattr(quant_gemm, "_fp8_capable", lambda device: device.type == "cuda")
    quantized = []
    name = "_per_token_rows" if act == "token" else "_static_rows"
    real = getattr(quant_gemm, name)

    def counting(x, static_scale, *, fmt):
        quantized.append(x.shape)
        return real(x, static_scale, fmt=fmt)
    monkeypatch.setattr(quant_gemm, name, counting)
    quant_gemm.activation_quantizer.cache_clear()
    q, k = _gemm(act, seed=0), _gemm(act, seed=1)
    try:
        with fake_cuda():
            q.to(CUDA), k.to(CUDA)
            x = torch.randn(3, 64, device=CUDA)
            q(x), k(x)
            assert len(quantized) == (1 if act == "token" else 2)
            x.mul_(2)
            q(x)
            q(torch.randn(3, 64, device=CUDA))
            assert len(quantized) == (3 if act == "token" else 4)
    finally:
        quant_gemm.activation_quantizer.cache_clear()


@pytest.mark.parametrize("per_token", [True, False])
def test_the_compiled_activation_kernels_trace_as_one_graph(per_token):
    """What torch.compile sees of the real path's activation quantization is one graph, no
    break (a break leaves eager kernels between graphs: the unfused cost the compile is
    for), and traced it computes the eager values."""
    kernel = quant_gemm._per_token_rows if per_token else quant_gemm._static_rows
    constants = {"fmt": quant_gemm._kernel_format(E4M3)}
    x = _activations().reshape(1, 37, 64).to(torch.bfloat16)
    scale = None if per_token else torch.tensor([0.02])
    torch._dynamo.reset()
    explained = torch._dynamo.explain(kernel)(x, scale, **constants)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    traced = torch.compile(kernel, backend="eager", dynamic=True)(x, scale, **constants)
    want = kernel(x, scale, **constants)
    assert torch.equal(traced[0].float(), want[0].float()) and torch.equal(traced[1], want[1])
    torch._dynamo.reset()
