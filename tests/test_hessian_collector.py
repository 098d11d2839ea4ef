"""``HessianCollector``'s sums (``fp8ptq.observe.hessian``): each batch's ``x^T x`` written into
one reused float32 buffer per shape and added in place into float64 sums, and the replayed
records of sequential GPTQ's partial forwards handed out once without a copy."""

import torch

from fp8ptq.algorithms.gptq.asym import AsymmetricCollector
from fp8ptq.algorithms.gptq.replay import _replayer
from fp8ptq.observe.hessian import HessianCollector


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
