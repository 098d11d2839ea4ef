"""``--act-calib search``: per-tensor static input scales chosen by the GEMM's output error over
a dense grid of clip ranges (plus best's max / percentile / MSE candidates)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fp8ptq.formats import fake_quantize, get_format
from fp8ptq.pipeline import quantize_model
from fp8ptq.recipe import Recipe
from fp8ptq.scales import amax_to_scale

E4M3 = get_format("e4m3")
STRIDE = 16  # the statistics pass keeps every 16th row for layer-aware calibrators


def _quantize(model, x, calib):
    m = copy.deepcopy(model)
    result = quantize_model(m, Recipe(format="e4m3", act_granularity="tensor",
                                      weight_granularity="channel", act_calib=calib,
                                      dtype="float32", num_samples=1), [x])
    (report,) = result.modules
    return report


def _sample_error(linear, x, input_scale) -> float:
    """Output MSE on the rows the calibrator saw, with the weight quantized as the pipeline
    does (per-channel max)."""
    w = linear.weight.detach().float()
    w_scale = amax_to_scale(w.abs().amax(dim=1), E4M3).unsqueeze(1)
    w_q = fake_quantize(w, w_scale, E4M3)
    rows = x[::STRIDE]
    x_q = fake_quantize(rows, torch.tensor(input_scale), E4M3)
    return float((x_q @ w_q.T - rows @ w.T).pow(2).mean())


def test_search_clips_an_outlier_the_output_does_not_see():
    # The bulk (|x| ~ 0.05) lands in e4m3's subnormals when one value of 3000 sets the
    # scale (0.05 * 448 / 3000 = 0.0075 < 2^-6); the outlier's channel has zero weight, so
    # clipping it costs the output nothing and buys the bulk 3 mantissa bits.
    torch.manual_seed(0)
    x = torch.randn(64 * STRIDE, 4) * 0.05
    x[0, 3] = 3000.0  # row 0 is among the sampled rows
    linear = nn.Linear(4, 3, bias=False)
    with torch.no_grad():
        linear.weight[:, 3] = 0.0
    model = nn.Sequential(linear)
    best, search = _quantize(model, x, "best"), _quantize(model, x, "search")
    assert best.act_calib == "best:max" and best.input_amax == pytest.approx(3000.0)
    assert search.act_calib.startswith("search:max*")
    assert search.input_amax <= 3000.0 / 4  # clipped by at least 4x (grid: down to 1/8)
    e_best, e_search = (_sample_error(linear, x, r.input_scale) for r in (best, search))
    assert e_search < 0.25 * e_best  # ~10x less on this data


@pytest.mark.parametrize("seed", range(4))
def test_search_is_never_worse_than_best_on_the_rows_it_judged(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32 * STRIDE, 16, generator=g) * torch.rand(16, generator=g) * 2
    spikes = torch.randint(0, x.shape[0], (3,), generator=g)
    x[spikes, torch.randint(0, 16, (3,), generator=g)] = 200.0 * (seed + 1)
    model = nn.Sequential(nn.Linear(16, 8, bias=False))
    torch.manual_seed(seed)
    nn.init.normal_(model[0].weight)
    best, search = _quantize(model, x, "best"), _quantize(model, x, "search")
    assert search.act_calib.startswith("search:")
    assert _sample_error(model[0], x, search.input_scale) <= \
        _sample_error(model[0], x, best.input_scale)
    assert 0 < search.input_amax <= best.input_amax * 1.0001 or \
        search.act_calib in ("search:percentile", "search:mse", "search:max")
