"""Granularities, observers, calibrators and scale guards against hand-computed cases."""

import math

import pytest
import torch

from fp8ptq.calibrators import activation_calibrator, weight_calibrator
from fp8ptq.errors import UsageError
from fp8ptq.formats import get_format, quantize_values
from fp8ptq.formats.granularity import PerBlock, PerChannel, PerTensor, PerToken
from fp8ptq.formats.scales import amax_to_scale, sqnr_db
from fp8ptq.observe.observers import TensorStats, bin_edges, histogram_index

E4M3, INT8 = get_format("e4m3"), get_format("int8")


def test_granularity_amax_shapes_and_values():
    w = torch.tensor([[1.0, -3.0, 0.5], [2.0, 0.25, -0.125]])
    assert PerTensor().amax(w).tolist() == [3.0]
    assert PerChannel().amax(w).tolist() == [[3.0], [2.0]]
    blocks = PerBlock(2).amax(w)  # tiles: cols 0-1 and col 2
    assert blocks.tolist() == [[3.0, 0.5]]
    assert PerBlock(2).expand(blocks, w).tolist() == [[3.0, 3.0, 0.5], [3.0, 3.0, 0.5]]
    assert PerToken().amax(w).tolist() == [[3.0], [2.0]]


def test_block_reduce_sums_partial_tiles():
    w = torch.arange(15, dtype=torch.float32).reshape(3, 5)
    sums = PerBlock(2).reduce(w, "sum")
    assert sums.shape == (2, 3)
    assert sums[1, 2].item() == w[2, 4].item()  # lone corner element
    assert sums.sum().item() == w.sum().item()


def test_observer_tracks_amax_channels_and_counts_over_batches():
    st = TensorStats()
    st.update(torch.tensor([[1.0, -2.0], [0.0, 0.5]]))
    st.update(torch.tensor([[-4.0, 0.25]]))
    assert st.amax == 4.0
    assert st.channel_amax.tolist() == [4.0, 2.0]
    assert st.count == 6 and st.zeros == 1
    assert st.histogram.sum().item() == 6


def test_observer_channel_dim_for_conv_inputs():
    st = TensorStats()
    x = torch.zeros(2, 3, 4, 4)
    x[:, 1] = -7.0
    st.update(x, channel_dim=1)
    assert st.channel_amax.tolist() == [0.0, 7.0, 0.0]


def test_observer_ignores_and_counts_nonfinite():
    st = TensorStats()
    st.update(torch.tensor([1.0, float("inf"), float("nan"), -3.0]))
    assert st.amax == 3.0 and st.nonfinite == 2


def test_histogram_index_matches_edges():
    a = torch.cat([torch.rand(10000) * 1000, torch.rand(1000) * 1e-6, torch.zeros(5)])
    idx = histogram_index(a)
    upper = bin_edges()
    lower = torch.cat([torch.zeros(1, dtype=torch.float64), upper[:-1]])
    assert bool(((a.double() >= lower[idx]) & (a.double() < upper[idx])).all())


def test_merge_equals_single_pass():
    x = torch.randn(100, 8)
    one, a, b = TensorStats(), TensorStats(), TensorStats()
    one.update(x)
    a.update(x[:40]), b.update(x[40:])
    a.merge(b)
    assert a.amax == one.amax and torch.equal(a.histogram, one.histogram)
    assert torch.equal(a.channel_amax, one.channel_amax)


def test_max_and_percentile_calibrators():
    st = TensorStats()
    x = torch.ones(10000)
    x[:10] = 100.0  # 0.1% outliers
    st.update(x)
    assert activation_calibrator("max").amax(st, E4M3) == 100.0
    p = activation_calibrator("percentile", percentile=99.0).amax(st, E4M3)
    assert 1.0 <= p <= 1.0 * (1 + 1 / 32)  # the bin holding 1.0
    assert activation_calibrator("percentile", percentile=100).amax(st, E4M3) == 100.0


@pytest.mark.slow
@pytest.mark.parametrize("fmt", [INT8, E4M3], ids=["int8", "e4m3"])
def test_mse_calibrator_is_near_the_brute_force_optimum(fmt):
    torch.manual_seed(0)
    x = torch.distributions.StudentT(2.0).sample((50000,))
    st = TensorStats()
    st.update(x)

    def err(amax):
        s = amax / fmt.max
        return (quantize_values(x / s, fmt) * s - x).pow(2).sum().item()

    brute = min(err(a) for a in torch.linspace(st.amax / 100, st.amax, 1000).tolist())
    chosen = activation_calibrator("mse").amax(st, fmt)
    assert err(chosen) <= brute * 1.02
    if fmt is INT8:  # a heavy tail is worth clipping with uniform steps
        assert chosen < 0.9 * st.amax and err(chosen) < 0.85 * err(st.amax)


def test_mse_calibrator_minimises_error_on_the_histogram():
    """The chosen clip range is no worse than the max calibrator's on the actual data."""
    torch.manual_seed(1)
    x = torch.randn(20000) * torch.rand(20000).pow(4) * 10
    st = TensorStats()
    st.update(x)

    def err(amax):
        s = amax / INT8.max
        return (quantize_values(x / s, INT8) * s - x).pow(2).sum().item()

    assert err(activation_calibrator("mse").amax(st, INT8)) <= err(st.amax) * 1.01


def test_mse_weight_calibrator_picks_each_channels_best_candidate():
    """Per channel, the chosen clip equals a brute-force argmin over the same candidates; with a
    coarse 4-bit format most Gaussian rows are better off clipped."""
    from fp8ptq.calibrators.mse import WEIGHT_RATIOS

    fmt = get_format("e2m1")
    torch.manual_seed(2)
    w = torch.randn(16, 256)
    gran = PerChannel()
    chosen = weight_calibrator("mse").amax(w, gran, fmt)
    amax = gran.amax(w)

    def row_err(a):
        s = a / fmt.max
        return ((quantize_values(w / s, fmt) * s - w) ** 2).sum(1)

    errs = torch.stack([row_err(amax * r) for r in WEIGHT_RATIOS.tolist()])
    expected = amax.flatten() * WEIGHT_RATIOS[errs.argmin(0)]
    assert torch.allclose(chosen.flatten(), expected)
    assert (chosen < amax).sum() >= 8
    assert (row_err(chosen) <= row_err(amax)).all()


def test_unknown_calibrator_is_a_usage_error():
    with pytest.raises(UsageError, match="valid: max, percentile, mse, cast, best, pow2-search"):
        activation_calibrator("kl")


def test_scale_guards():
    warnings = []
    s = amax_to_scale(torch.tensor([0.0, float("nan"), float("inf"), 448.0]), E4M3,
                      warnings=warnings)
    assert s.tolist() == [1.0, 1.0, 1.0, 1.0]
    assert len(warnings) == 1 and "3 of 4" in warnings[0]
    assert torch.isfinite(amax_to_scale(torch.tensor([1e-45]), E4M3)).all()
    assert amax_to_scale(torch.tensor([448.0 * 3]), E4M3, pow2=True).item() == 4.0


def test_sqnr():
    x = torch.tensor([3.0, 4.0])
    assert sqnr_db(x, x) == math.inf
    assert sqnr_db(x, torch.tensor([3.0, 3.0])) == pytest.approx(10 * math.log10(25.0))
