"""The weight sweep's C kernels (``fp8ptq.runtime.native.weight_sweep`` / ``row_absmax``) against
the
torch path of ``fp8ptq.formats.weight_quant.quantize_weight`` and the granularities' ``amax``: the
same
codes and scales bit for bit, the same amax, the same SQNR up to the order of a float64 sum,
for every preset and small ExMy formats, both roundings the kernel takes, float32 and bfloat16
weights, odd widths (vector tails), rows split across threads, NaN / inf refused."""

import dataclasses
import math

import pytest
import torch

from fp8ptq.errors import NumericsError
from fp8ptq.formats.granularity import weight_granularity
from fp8ptq.formats.registry import get_format, preset_names
from fp8ptq.formats.weight_quant import quantize_weight
from test_native import _both, needs_native

FORMATS = sorted(set(preset_names()) | {"e3m4", "e2m5", "e5m2b10", "e3m2", "e2m1"})


def _weight(rows, cols, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.05
    w[0, :5] = torch.tensor([0.0, -0.0, 1e-30, -3.0, 2.0])  # zeros, a subnormal, row outliers
    w[2] = 0.0  # an all-zero row
    return w.to(dtype)


@pytest.mark.slow
@needs_native
@pytest.mark.parametrize("name", FORMATS)
def test_sweep_gives_the_torch_paths_codes_and_report(name):
    base = get_format(name)
    for rounding in ["nearest_even", "half_away"] if base.is_float else ["nearest_even"]:
        fmt = dataclasses.replace(base, rounding=rounding)
        for gran_name in ("tensor", "channel"):
            gran = weight_granularity(gran_name)
            for dtype in (torch.float32, torch.bfloat16):
                w = _weight(67, 133, dtype)  # 133 = 16 * 8 + 5: every row has a scalar tail
                scale, want_scale = _both(lambda: gran.amax(w))
                assert torch.equal(scale, want_scale)
                scale = (scale / fmt.max).clamp_min(1e-12)
                got, want = _both(lambda: quantize_weight(w, scale, fmt, gran))
                assert torch.equal(got.codes, want.codes), (name, rounding, gran_name, dtype)
                assert got.amax == want.amax and torch.equal(got.scale, want.scale)
                assert math.isclose(got.sqnr_db, want.sqnr_db, rel_tol=1e-12), (got, want)


@needs_native
def test_sweep_splits_rows_across_threads_identically():
    fmt, gran = get_format("e4m3"), weight_granularity("channel")
    w = _weight(1031, 577, torch.bfloat16, seed=3)
    scale = (gran.amax(w) / fmt.max).clamp_min(1e-12)  # row 2 is all zeros
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = quantize_weight(w, scale, fmt, gran)
        torch.set_num_threads(3)
        three = quantize_weight(w, scale, fmt, gran)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one.codes, three.codes) and one.amax == three.amax
    assert one.sqnr_db == three.sqnr_db  # per-row sums, added in row order either way


@needs_native
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_weights_are_refused_and_amax_propagates_nan(bad, dtype):
    gran = weight_granularity("channel")
    w = _weight(9, 21, dtype)
    w[4, 19] = bad  # in a row's scalar tail
    got, want = _both(lambda: gran.amax(w))
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(
        got[~got.isnan()], want[~want.isnan()])
    assert math.isnan(got[4].item()) == math.isnan(bad)
    with pytest.raises(NumericsError, match="weight of m contains NaN or inf"):
        quantize_weight(w, torch.full((9, 1), 0.01), get_format("e4m3"), gran, name="m")
    w[4, 19], w[6, 3] = 0.0, bad  # in the vector body
    with pytest.raises(NumericsError):
        quantize_weight(w, torch.full((9, 1), 0.01), get_format("e4m3"), gran, name="m")


@needs_native
def test_a_transposed_weight_and_a_float64_scale_take_a_path_that_agrees():
    """A Conv1D-style transposed view is made contiguous for the kernel; a scale the kernel does
    not take (float64) goes the torch way; both give the torch path's codes."""
    fmt, gran = get_format("e4m3"), weight_granularity("channel")
    w = _weight(40, 24, torch.bfloat16).t()
    scale = (gran.amax(w) / fmt.max).clamp_min(1e-12)
    got, want = _both(lambda: quantize_weight(w, scale, fmt, gran))
    assert torch.equal(got.codes, want.codes)
    got64 = quantize_weight(w, scale.double(), fmt, gran)
    assert torch.equal(got64.codes, want.codes)
