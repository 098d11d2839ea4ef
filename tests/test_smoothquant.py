"""SmoothQuant (``fp8ptq.algorithms.smoothquant.norms``) on tiny Llama / GPT-2 / OPT / BERT
models."""

import copy
import json
import math

import pytest
import torch

from fp8ptq.algorithms.smoothquant.norms import (
    FACTOR_MAX,
    FACTOR_MIN,
    apply_smoothquant,
    smoothing_factors,
)
from fp8ptq.checkpoint import load_quantized, read_metadata, save_quantized
from fp8ptq.config.recipe import Recipe
from fp8ptq.execution.in_memory import (
    SAMPLE_BATCHES,
    collect_stats,
    plan_targets,
    quantize_model,
    token_batches,
)
from fp8ptq.formats import fake_quantize, get_format
from fp8ptq.formats.scales import amax_to_scale
from fp8ptq.model.gemm import weight_2d
from tiny_models import IDS, run, tiny

LAYERS = (0, 1)
EXPECTED_GROUPS = {
    "llama": {**{f"model.layers.{i}.input_layernorm": [
        f"model.layers.{i}.self_attn.{p}_proj" for p in "qkv"] for i in LAYERS},
        **{f"model.layers.{i}.post_attention_layernorm": [
            f"model.layers.{i}.mlp.gate_proj", f"model.layers.{i}.mlp.up_proj"] for i in LAYERS}},
    "gpt2": {**{f"transformer.h.{i}.ln_1": [f"transformer.h.{i}.attn.c_attn"] for i in LAYERS},
             **{f"transformer.h.{i}.ln_2": [f"transformer.h.{i}.mlp.c_fc"] for i in LAYERS}},
    "opt": {**{f"model.decoder.layers.{i}.self_attn_layer_norm": [
        f"model.decoder.layers.{i}.self_attn.{p}_proj" for p in "qkv"] for i in LAYERS},
        **{f"model.decoder.layers.{i}.final_layer_norm": [f"model.decoder.layers.{i}.fc1"]
           for i in LAYERS}},
    # post-LN: only the last norm, which feeds the QA head alone, folds exactly
    "bert": {"bert.encoder.layer.1.output.LayerNorm": ["qa_outputs"]},
}
BERT_POST_LN = ["bert.embeddings.LayerNorm", "bert.encoder.layer.0.output.LayerNorm",
                *[f"bert.encoder.layer.{i}.attention.output.LayerNorm" for i in LAYERS]]
OUTLIER_NORMS = {"llama": ("input_layernorm", "post_attention_layernorm"), "gpt2": ("ln_1", "ln_2")}
# the GEMMs whose input no norm produces: left out of the error comparison, so that it
# measures the smoothed GEMMs only
UNSMOOTHABLE = ["*.o_proj", "*.down_proj", "*.c_proj"]


def smooth(model, recipe):
    """What the pipeline's SmoothQuant stage does, without quantizing afterwards."""
    targets, _ = plan_targets(model, recipe)
    pre = collect_stats(model, targets, list(token_batches(IDS, 4)),
                        sample_batches=SAMPLE_BATCHES)
    samples = pre.row_samples()
    return apply_smoothquant(model, targets, pre.stats, samples, recipe), targets, pre, samples


def with_outliers(arch, factor=50.0, channels=(3, 17, 40)):
    """A tiny model whose norm outputs carry a few channels ``factor`` times larger."""
    model = tiny(arch)
    with torch.no_grad():
        for name, m in model.named_modules():
            if name.rsplit(".", 1)[-1] in OUTLIER_NORMS[arch]:
                m.weight[list(channels)] *= factor
    return model


def randomize_norms(model):
    """Fresh models have norm weights 1 and biases 0, which would hide a wrong fold."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for m in model.modules():
            if "Norm" in type(m).__name__:
                for p in (m.weight, getattr(m, "bias", None)):
                    if p is not None:
                        p.copy_(p + 0.3 * torch.randn(p.shape, generator=g))
    return model


def rel_error(out, ref):
    return float((out - ref).norm() / ref.norm())


# --- the factors ------------------------------------------------------------------------------

def test_smoothing_factors_hand_computed():
    act = torch.tensor([4.0, 1.0, 9.0, 0.5])
    w = torch.tensor([1.0, 4.0, 0.25, 2.0])
    # s_j = max|X_j|^a / max|W_j|^(1 - a)
    torch.testing.assert_close(smoothing_factors(act, w, 0.5),
                               torch.tensor([2.0, 0.5, 6.0, 0.5]))
    torch.testing.assert_close(smoothing_factors(act, w, 0.75),
                               torch.tensor([4**0.75, 4**-0.25, 9**0.75 / 0.25**0.25,
                                             0.5**0.75 / 2**0.25]))
    torch.testing.assert_close(smoothing_factors(act, w, 1.0), act)
    torch.testing.assert_close(smoothing_factors(act, w, 0.0), 1 / w)
    assert smoothing_factors(act, w, 0.5).dtype == torch.float32


def test_smoothing_factors_guard_dead_and_extreme_channels():
    act = torch.tensor([0.0, 3.0, float("nan"), float("inf"), 1e30, 1e-30, 2.0])
    w = torch.tensor([2.0, 0.0, 1.0, 1.0, 1e-30, 1e30, float("inf")])
    for alpha in (0.0, 0.5, 0.85, 1.0):
        s = smoothing_factors(act, w, alpha)
        assert torch.isfinite(s).all() and (s > 0).all()
        assert s[:4].tolist() == [1.0, 1.0, 1.0, 1.0]  # nothing to balance: left alone
        assert s[6] == 1.0
        assert FACTOR_MIN <= s.min() and s.max() <= FACTOR_MAX
    assert smoothing_factors(act, w, 0.5)[4] == pytest.approx(FACTOR_MAX)
    assert smoothing_factors(act, w, 0.5)[5] == pytest.approx(FACTOR_MIN)


# --- smoothing alone is exact -----------------------------------------------------------------

@pytest.mark.parametrize("arch,alpha", [("llama", 0.5), ("gpt2", 0.5), ("opt", 0.5),
                                        ("bert", 0.5), ("gpt2", "auto")])
def test_smoothed_model_computes_the_same_in_fp32(arch, alpha):
    model = randomize_norms(tiny(arch))
    original = copy.deepcopy(model)
    ref = run(model, IDS)
    report, *_ = smooth(model, Recipe(act_granularity="tensor",
                                      format="e4m3", smoothquant=alpha, dtype="float32"))

    assert {n: g["consumers"] for n, g in report["groups"].items()} == EXPECTED_GROUPS[arch]
    for norm, group in report["groups"].items():
        if group["alpha"] is None:  # auto found smoothing no better for this group
            continue
        assert not torch.equal(model.get_submodule(norm).weight,
                               original.get_submodule(norm).weight), norm
        for c in group["consumers"]:  # GPT-2's Conv1D stores [in, out]: weight_2d handles it
            w0 = weight_2d(original.get_submodule(c)).detach()
            s = weight_2d(model.get_submodule(c)).detach()[0] / w0[0]
            torch.testing.assert_close(s.min(), torch.tensor(group["factor_min"]), rtol=1e-4,
                                       atol=0)
            torch.testing.assert_close(s.max(), torch.tensor(group["factor_max"]), rtol=1e-4,
                                       atol=0)
    assert report["smoothed"] == sum(g["alpha"] is not None for g in report["groups"].values())
    assert report["smoothed"] > 0
    torch.testing.assert_close(run(model, IDS), ref, rtol=1e-5, atol=1e-5)
    if arch == "bert":
        for norm in BERT_POST_LN:
            assert "post-LN" in report["skipped"][norm], norm


# --- smoothing helps quantization when activations have outliers --------------------------

@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("fmt", ["int8", "e4m3", "hif8"])
def test_smoothquant_lowers_quantized_error_with_outlier_channels(arch, fmt):
    base = with_outliers(arch)
    ref = run(base, IDS)

    def quantized_error(alpha):
        model = copy.deepcopy(base)
        result = quantize_model(model, Recipe(act_granularity="tensor",
                                              format=fmt, smoothquant=alpha, dtype="float32",
                                              skip=UNSMOOTHABLE), token_batches(IDS, 4))
        return rel_error(run(model, IDS), ref), result

    plain, result = quantized_error(None)
    assert "smoothquant" not in result.extras
    amax = result.stats[next(iter(EXPECTED_GROUPS[arch].values()))[0]].channel_amax
    assert amax.max() > 20 * amax.median()  # the outliers are really there
    half, result = quantized_error(0.5)
    assert result.extras["smoothquant"]["smoothed"] == 4
    auto, result = quantized_error("auto")
    assert half < 0.95 * plain and auto < 0.95 * plain, (plain, half, auto)


def _objective(x, act_amax, weights, fmt, s):
    """The group's output error that "auto" minimises, written out: static per-tensor max
    activation scale, per-channel max weight scales."""
    xs = x / s
    xq = fake_quantize(xs, amax_to_scale((act_amax / s).max(), fmt), fmt)
    total = 0.0
    for w in weights:
        ws = w * s
        wq = fake_quantize(ws, amax_to_scale(ws.abs().amax(dim=1, keepdim=True), fmt), fmt)
        total += float((xq @ wq.T - x @ w.T).double().pow(2).sum())
    return total


@pytest.mark.parametrize("fmt", ["int8", "e4m3", "hif8"])
def test_auto_alpha_is_no_worse_than_half_on_its_objective(fmt):
    model = with_outliers("llama")
    original = copy.deepcopy(model)
    report, _, pre, samples = smooth(model, Recipe(act_granularity="tensor",
                                                   format=fmt, smoothquant="auto",
                                                   dtype="float32"))
    spec = get_format(fmt)
    assert report["alpha"] == "auto" and len(report["groups"]) == 4
    for norm, group in report["groups"].items():
        consumers = group["consumers"]
        x = samples[consumers[0]]
        act = torch.stack([pre.stats[c].channel_amax for c in consumers]).amax(dim=0)
        weights = [weight_2d(original.get_submodule(c)).detach().float() for c in consumers]
        w_amax = torch.stack([w.abs().amax(dim=0) for w in weights]).amax(dim=0)

        def objective(alpha):
            s = torch.ones_like(act) if alpha is None else smoothing_factors(act, w_amax, alpha)
            return _objective(x, act, weights, spec, s)

        search = group["search"]
        tried = dict((a, e) for a, e in search["tried"])
        assert 0.5 in tried
        assert tried[0.5] == pytest.approx(objective(0.5), rel=1e-5)
        assert search["error_unsmoothed"] == pytest.approx(objective(None), rel=1e-5)
        chosen = objective(group["alpha"])
        assert chosen <= objective(0.5) * (1 + 1e-6), norm
        assert chosen <= objective(None) * (1 + 1e-6), norm
        assert chosen < 0.9 * objective(None), norm  # the outliers make smoothing pay here


def test_auto_leaves_a_group_unsmoothed_when_no_alpha_beats_that():
    # weight-only e4m3: smoothing only moves range into the weights; for some groups of this
    # model no alpha beats leaving them alone
    model = tiny("llama")
    original = copy.deepcopy(model)
    ref = run(model, IDS)
    report, *_ = smooth(model, Recipe(act_granularity="tensor",
                                      format="e4m3", act_format="none", smoothquant="auto",
                                      dtype="float32"))
    kept = {n: g for n, g in report["groups"].items() if g["alpha"] is None}
    assert kept and len(kept) < len(report["groups"])
    for norm, group in kept.items():
        assert all(group["search"]["error_unsmoothed"] <= e for _, e in group["search"]["tried"])
        assert torch.equal(model.get_submodule(norm).weight, original.get_submodule(norm).weight)
        assert "unsmoothed" in group["note"]
    assert report["smoothed"] == len(report["groups"]) - len(kept)
    torch.testing.assert_close(run(model, IDS), ref, rtol=1e-5, atol=1e-5)


# --- the report --------------------------------------------------------------------------------

@pytest.mark.parametrize("alpha", [0.5, "auto"])
def test_report_is_json_records_alpha_per_group_and_checkpoint_keeps_it(tmp_path, alpha):
    model = with_outliers("llama")
    recipe = Recipe(act_granularity="tensor", format="e4m3", smoothquant=alpha, dtype="float32")
    result = quantize_model(model, recipe, token_batches(IDS, 4))
    report = result.extras["smoothquant"]
    assert json.loads(json.dumps(report, allow_nan=False)) == report
    assert report["alpha"] == alpha
    for group in report["groups"].values():
        if alpha == "auto" and group["alpha"] is None:
            continue
        assert group["alpha"] == 0.5 if alpha == 0.5 else 0 <= group["alpha"] <= 1
        assert 0 < group["factor_min"] <= group["factor_max"] < math.inf

    save_quantized(result, recipe, tmp_path / "c")
    assert read_metadata(tmp_path / "c")["extras"]["smoothquant"] == report
    loaded = load_quantized(tmp_path / "c").model  # smoothed norms are ordinary tensors
    assert torch.equal(run(loaded, IDS), run(model, IDS))
