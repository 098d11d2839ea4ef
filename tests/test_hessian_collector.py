"""``HessianCollector``'s sums (``fp8ptq.observe.hessian``): each batch's ``x^T x`` written into
one reused float32 buffer per shape and added in place into float64 sums, and the replayed
records of sequential GPTQ's partial forwards handed out once without a copy."""

import pytest
import torch

from fp8ptq.algorithms.gptq.asym import AsymmetricCollector
from fp8ptq.algorithms.gptq.replay import _replayer
from fp8ptq.algorithms.gptq.sink import SinkCollector
from fp8ptq.observe.hessian import HessianCollector, gram


def _linears(widths):
    return {f"l{i}": torch.nn.Linear(k, 3, bias=False) for i, k in enumerate(widths)}


def test_sums_over_batches_are_each_inputs_own():
    """Three GEMMs, two of the same width fed different inputs, four batches: each sum is its
    own inputs' ``2 X^T X / rows`` (float64 reference), not the other's nor the last batch's
    (the buffer is shared by shape, the sums are not)."""
    g = torch.Generator().manual_seed(0)
    mods = _linears([16, 16, 24])
    c = HessianCollector(mods)
    seen = {n: [] for n in mods}
    with c.observing(), torch.inference_mode():
        for _ in range(4):
            for n, m in mods.items():
                x = torch.randn(2, 5, m.in_features, generator=g) * 3
                seen[n].append(x.reshape(-1, m.in_features).double())
                m(x)
    assert c._buffers == {}  # dropped with the hooks
    for n in mods:
        X = torch.cat(seen[n])
        torch.testing.assert_close(c.hessian(n), 2 * X.T @ X / len(X), rtol=1e-6, atol=1e-6)
        assert c.sums[n].dtype == torch.float64
    assert not torch.allclose(c.hessian("l0"), c.hessian("l1"))


@pytest.mark.parametrize("kind", ["plain", "sink"])
def test_float32_sums_are_their_own_and_close_to_float64(kind):
    """``gptq_hessian_dtype`` float32: the sums are float32 tensors of their own (never the
    reused float32 product buffer, which the next batch overwrites), within float32 rounding of
    the float64 sums after many batches; the sink-aware ``H~`` made from them stays float32
    (it is factored in float32, as the plain one is)."""
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 16, 24, generator=g) * 2 + 1 for _ in range(12)]

    def collected(dtype):
        lin = torch.nn.Linear(24, 3, bias=False)
        c = HessianCollector({"lin": lin}, dtype=dtype) if kind == "plain" else \
            SinkCollector({"lin": lin}, {"lin": None}, 1.0, dtype=dtype)
        with c.observing(), torch.inference_mode():
            for x in batches:
                lin(x)
        return c

    lo, hi = collected(torch.float32), collected(torch.float64)
    assert lo.sums["lin"].dtype == torch.float32 and hi.sums["lin"].dtype == torch.float64
    got, want = lo.hessian("lin"), hi.hessian("lin")
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    X = torch.cat([x.reshape(-1, 24) for x in batches]).double()
    if kind == "plain":  # the buffer's last batch alone would be far off
        torch.testing.assert_close(got.double(), 2 * X.T @ X / len(X), rtol=1e-5, atol=1e-4)


def test_asymmetric_sums_do_not_share_the_buffer_by_mistake():
    """The asymmetric collector writes ``X~^T X~`` and then ``X^T X~`` through the same
    buffer: each lands in its own sum."""
    lin = torch.nn.Linear(8, 2, bias=False)
    c = AsymmetricCollector({"lin": lin}, {"lin": None})  # no input rounding: X~ = the input
    xq, xf = torch.randn(6, 8), torch.randn(6, 8)
    c.float_inputs["lin"] = xf  # what the float copy's hook would have recorded
    with c.observing(), torch.inference_mode():
        lin(xq)
    xq64, xf64 = xq.double(), xf.double()
    torch.testing.assert_close(c.hessian("lin"), 2 * xq64.T @ xq64 / 6, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(c.cross_term("lin"), 2 * xf64.T @ xq64 / 6, rtol=1e-6,
                               atol=1e-6)


def test_a_record_is_handed_out_once_then_copied():
    """A replayed module returns its record itself on the first call (it is dropped after the
    forward, so nothing else reads it) and a copy on any later call, which the first caller's
    in-place updates cannot reach."""
    out = (torch.arange(4.0), None)
    forward = _replayer(out)
    first = forward()
    assert first is out
    first[0].mul_(0)  # downstream in-place update of the handed-out record
    second = forward()
    assert second is not out and second[0] is not out[0] and second[1] is None
    assert torch.equal(second[0], out[0])


def test_a_model_quantized_with_float32_sums_is_nearly_the_float64_one():
    """``Recipe(gptq_hessian_dtype="float32")`` reaches the in-order collectors: the recipe
    records it, the largest Hessian held is half the bytes, and the codes differ only where a
    weight sat within summation rounding of a code boundary."""
    from fp8ptq.config.recipe import Recipe
    from fp8ptq.execution.in_memory import quantize_model, token_batches
    from tiny_models import IDS, tiny

    batches = list(token_batches(IDS, 4))
    models, facts = {}, {}
    for dtype in ("float64", "float32"):
        model = tiny("llama").float()
        recipe = Recipe(format="e4m3", act_granularity="token", dtype="float32",
                        weight_calib="gptq", gptq_hessian_dtype=dtype)
        result = quantize_model(model, recipe, batches)
        models[dtype], facts[dtype] = model, result.extras["gptq"]["sequential"]
    assert facts["float32"]["max_hessian_bytes"] * 2 == facts["float64"]["max_hessian_bytes"]
    same = total = 0
    for (_, a), (_, b) in zip(models["float64"].named_modules(),
                              models["float32"].named_modules()):
        if hasattr(a, "weight_codes"):
            same += int((a.weight_codes == b.weight_codes).sum())
            total += a.weight_codes.numel()
    assert total > 0 and same / total > 0.99


@pytest.mark.parametrize("width", [100, 256, 576, 600, 1536])
def test_gram_is_the_full_product_bit_for_bit(width):
    """The upper-block-triangle product is the one GEMM's values exactly, at widths that split
    into whole blocks, a ragged last block, and none (too narrow to split)."""
    x = torch.randn(777, width, generator=torch.Generator().manual_seed(width))
    out = torch.full((width, width), float("nan"))
    assert torch.equal(gram(x, out), torch.mm(x.T, x))


def test_gram_is_what_the_collector_sums():
    """A 1,536-input GEMM (the split path) gets float64 sums of the gram products."""
    lin = torch.nn.Linear(1536, 8)
    col = HessianCollector({"lin": lin})
    xs = [torch.randn(3, 64, 1536, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    with col.observing(), torch.no_grad():
        for x in xs:
            lin(x)
    want = sum(torch.mm(x.reshape(-1, 1536).T, x.reshape(-1, 1536)).double() for x in xs)
    assert torch.equal(col.sums["lin"], want)


def test_bf16_inputs_are_upcast_into_one_kept_buffer():
    """bf16 inputs (a bf16 calibration forward) are upcast into one float32 buffer kept for the
    pass, not a fresh tensor per batch, and their sums are exactly those of ``x.float()``;
    the buffer goes when the pass ends."""
    lin = torch.nn.Linear(64, 8).bfloat16()
    col = HessianCollector({"lin": lin})
    xs = [torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(i)).bfloat16()
          for i in range(3)]
    ptrs = []
    real = col._product

    def spy(a, b):
        ptrs.append(a.data_ptr())
        return real(a, b)
    col._product = spy
    with col.observing(), torch.no_grad():
        for x in xs:
            lin(x)
        assert len(col._buffers) == 2  # the upcast and the product
    assert len(set(ptrs)) == 1 and not col._buffers
    want = sum(torch.mm(x.reshape(-1, 64).float().T, x.reshape(-1, 64).float()).double()
               for x in xs)
    assert torch.equal(col.sums["lin"], want)
