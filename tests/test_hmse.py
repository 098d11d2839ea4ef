"""Weight scales by the Hessian-weighted rounding error (``--weight-calib gptq-hmse`` / ``hmse``):
never worse than max's scale on the criterion, exact on the weight an input outlier meets,
GPTQ's layer output error on an outlier case, finite on degenerate weights, and the CLI."""

import json

import pytest
import torch

import fp8ptq
from fp8ptq.algorithms.gptq.sweep import gptq_codes, output_error
from fp8ptq.calibrators import weight_calibrator
from fp8ptq.calibrators.hmse import hmse_ratios
from fp8ptq.checkpoint import read_metadata
from fp8ptq.config.recipe import Recipe
from fp8ptq.formats import decode, encode, get_format
from fp8ptq.formats.granularity import weight_granularity
from fp8ptq.formats.scales import amax_to_scale
from fp8ptq.formats.weight_quant import choose_scale
from test_cli_quantize import assets, in_memory, logits, quantize  # noqa: F401
from tiny_models import IDS


def weighted_error(W, scale, gran, fmt, h):
    """Per scale group ``sum h_j (w - dequantized)^2``, through the codes quantize stores."""
    S = gran.expand(scale, W).expand_as(W)
    deq = decode(encode(W / S, fmt), fmt) * S
    return gran.reduce((W - deq).double().pow(2) * h.double().reshape(1, -1), "sum").double()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "hfp8", "hif8", "int8"])
@pytest.mark.parametrize("gran", ["tensor", "channel", "block"])
def test_weighted_error_never_above_max_scale(fmt, gran):
    torch.manual_seed(2)
    fmt, g = get_format(fmt), weight_granularity(gran, 16)
    W = torch.randn(40, 48) * 0.05
    h = torch.rand(48) ** 4 * 100  # uneven input energies
    h[7] = 1e4
    chosen = amax_to_scale(weight_calibrator("gptq-hmse").amax(W, g, fmt, h), fmt)
    plain = amax_to_scale(g.amax(W), fmt)
    new, old = weighted_error(W, chosen, g, fmt, h), weighted_error(W, plain, g, fmt, h)
    assert bool((new <= old * (1 + 1e-9)).all())
    assert float(new.sum()) < float(old.sum())  # 64 candidates: some group gains
    ratio = (chosen / plain).reshape(-1)
    lo, hi = float(hmse_ratios(fmt).min()), float(hmse_ratios(fmt).max())
    assert bool(((ratio >= lo * (1 - 1e-6)) & (ratio <= hi * (1 + 1e-6))).all())


def test_the_heavy_input_weight_becomes_exact():
    """One row, amax 448 (e4m3: max's scale 1); column 0 meets an input with 10^6x the energy
    of the others and holds 16 r for a candidate ratio r ~ 1.0625: with scale 1 it sits half
    way between 16 and 18 (relative error 1/17); the chosen scale makes it (nearly) exact."""
    fmt, g = get_format("e4m3"), weight_granularity("channel")
    ratios = hmse_ratios(fmt)
    k = int(torch.argmin((ratios - 1.0625).abs()))
    W = torch.randn(1, 32) * 20
    W[0, 1] = 448.0
    W[0, 0] = 16 * float(ratios[k])
    h = torch.ones(32)
    h[0] = 1e6
    plain = amax_to_scale(g.amax(W), fmt)
    chosen = amax_to_scale(weight_calibrator("hmse").amax(W, g, fmt, h), fmt)

    def rel(scale):
        q = float(decode(encode(W[:, :1] / scale, fmt), fmt)[0, 0] * scale[0, 0])
        return abs(q - float(W[0, 0])) / float(W[0, 0])

    assert rel(plain) > 0.02
    assert rel(chosen) < 1e-6
    # without a Hessian every input counts the same: another scale, still no worse than max
    flat = amax_to_scale(weight_calibrator("hmse").amax(W, g, fmt), fmt)
    ones = torch.ones(32)
    assert float(weighted_error(W, flat, g, fmt, ones).sum()) <= \
        float(weighted_error(W, plain, g, fmt, ones).sum())


def test_gptq_output_error_with_the_new_scales_on_an_outlier_input():
    """A sink-like input: 8 rows where one channel carries ~100x the usual magnitude and the
    others are ~0 (no other column can absorb its rounding error), plus ordinary correlated
    rows. GPTQ (act-order) on the Hessian-chosen scales leaves a lower layer output error
    than GPTQ on max's scales, on those rows and on all of them."""
    torch.manual_seed(3)
    fmt, g = get_format("e4m3"), weight_granularity("channel")
    X = torch.randn(256, 6) @ torch.randn(6, 64) + 0.1 * torch.randn(256, 64)
    sink = torch.zeros(8, 64)
    sink[:, 5] = 300 + 10 * torch.randn(8)
    X = torch.cat([sink, X])
    W = torch.randn(48, 64) * 0.05
    H = X.T.double() @ X.double()

    def gptq_with(calib):
        scale = choose_scale(W, fmt, g, weight_calibrator(calib), hessian=H)
        S = g.expand(scale, W).expand_as(W)
        return decode(gptq_codes(W, H, S, fmt, damp=0.01, act_order=True), fmt) * S

    old, new = gptq_with("gptq"), gptq_with("gptq-hmse")
    assert output_error(W, new, X[:8]) < 0.5 * output_error(W, old, X[:8])
    assert output_error(W, new, X) < output_error(W, old, X)


@pytest.mark.parametrize("gran", ["tensor", "channel", "block"])
def test_degenerate_weights_and_inputs_give_finite_scales(gran):
    fmt, g = get_format("e4m3"), weight_granularity(gran, 16)
    W = torch.randn(32, 32)
    W[3] = 0.0  # a zero row
    W[:, 5] = 0.0
    h = torch.rand(32)
    h[:10] = 0.0  # dead inputs
    calib = weight_calibrator("gptq-hmse")
    for w, hd in ((W, h), (W, torch.zeros(32)), (torch.zeros(32, 32), h), (W, None)):
        scale = amax_to_scale(calib.amax(w, g, fmt, hd), fmt)
        assert bool(torch.isfinite(scale).all()) and bool((scale > 0).all())
    # no Hessian signal at all: every candidate ties, so max's scale stays
    assert torch.equal(calib.amax(W, g, fmt, torch.zeros(32)), g.amax(W))


@pytest.mark.slow
@pytest.mark.parametrize("calib", ["gptq-hmse", "hmse"])
def test_cli_quantize_with_hessian_scales(assets, tmp_path, calib):  # noqa: F811
    out, sizes = tmp_path / "out", ["--num-samples", "4", "--seq-len", "16"]
    res = quantize(assets / "llama", out, "--calib-data", str(assets / "calib.txt"), *sizes,
                   "--weight-calib", calib, "--json")
    assert res.exit_code == 0, (res.output, res.exception)
    facts = json.loads(res.stdout)["gptq"]
    assert facts["sequential"]["blocks"] == 2  # in-order Hessians
    # the report says what the Hessians were for: hmse rounds to nearest, no GPTQ sweep
    assert facts["hessians_for"] == ("gptq" if calib == "gptq-hmse"
                                     else "hmse scales (round to nearest)")
    # round to nearest reads only the Hessians' diagonals: 8 bytes per input, not per pair
    widest = max(m.in_features for n, m in fp8ptq.load(out).model.named_modules()
                 if n.startswith("model.layers.") and hasattr(m, "in_features"))
    assert facts["sequential"]["max_hessian_bytes"] == 8 * widest * (widest if calib ==
                                                                      "gptq-hmse" else 1)
    assert read_metadata(out)["recipe"]["weight_calib"] == calib
    expected = Recipe(calib_data=str(assets / "calib.txt"), num_samples=4, seq_len=16,
                      weight_calib=calib)
    model, _ = in_memory(assets / "llama", expected)
    assert torch.equal(logits(fp8ptq.load(out).model, IDS), logits(model, IDS))
    # the scales differ from max's somewhere (the criterion moved them)
    plain = tmp_path / "plain"
    assert quantize(assets / "llama", plain, "--calib-data", str(assets / "calib.txt"), *sizes,
                    "--weight-calib", "gptq" if calib == "gptq-hmse" else "max").exit_code == 0
    ours, theirs = fp8ptq.load(out).model, fp8ptq.load(plain).model
    name = "model.layers.0.mlp.down_proj"
    assert not torch.equal(ours.get_submodule(name).weight_scale,
                           theirs.get_submodule(name).weight_scale)


def test_diagonal_collector_keeps_the_full_hessians_diagonal():
    """``HessianCollector(diagonal=True)`` (what ``hmse`` with round to nearest gets): the
    same input energies as the full matrix's diagonal, shared inputs (q/k/v) counted once,
    8 bytes per input; and the one-pass pipeline hands hmse diagonals, GPTQ whole matrices."""
    from fp8ptq.execution.in_memory import quantize_model, token_batches
    from fp8ptq.observe.hessian import HessianCollector
    from tiny_models import tiny

    model = tiny("llama")
    mods = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
            and n.startswith("model.layers.")}
    full, diag = HessianCollector(mods), HessianCollector(mods, diagonal=True)
    with full.observing(), diag.observing(), torch.no_grad():
        model(IDS)
        model(IDS.flip(1))
    assert set(full.sums) == set(diag.sums) and len(diag.sums) < len(mods)  # shared inputs
    for n in mods:
        assert torch.allclose(diag.hessian(n), torch.diagonal(full.hessian(n)), rtol=1e-6)
    assert diag.nbytes == sum(8 * h.shape[0] for h in diag.sums.values())
    # the tiny Llama's blocks: inputs of 64 (q/k/v, o, gate/up) and 128 (down) features
    widths = [64, 64, 64, 128] * 2
    for calib, square in (("hmse", False), ("gptq-hmse", True)):
        recipe = Recipe(weight_calib=calib, gptq_sequential=False, act_granularity="token")
        result = quantize_model(tiny("llama"), recipe, list(token_batches(IDS, 4)))
        facts = result.extras["gptq"]
        assert facts["distinct_inputs"] == len(widths)
        assert facts["hessian_bytes"] == sum(8 * w * (w if square else 1) for w in widths)
