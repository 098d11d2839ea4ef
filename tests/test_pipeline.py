"""The quantize pipeline on tiny models of every architecture family we claim."""

import copy

import pytest
import torch
from torch import nn

from fp8ptq.config.recipe import Recipe
from fp8ptq.errors import NumericsError, UsageError
from fp8ptq.execution.in_memory import plan_targets, quantize_model, token_batches
from fp8ptq.formats import decode, fake_quantize, get_format
from fp8ptq.model.gemm import weight_2d
from fp8ptq.nn.quant_gemm import QuantGemm
from tiny_models import IDS, run, tiny

EXPECTED_GEMMS = {"llama": 14, "gpt2": 8, "opt": 12, "bert": 13}


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gpt2", "opt", "bert"])
@pytest.mark.parametrize("fmt", ["e4m3", "int8", "hif8"])
def test_every_gemm_is_quantized_and_output_stays_close(arch, fmt):
    model = tiny(arch)
    ref = run(model, IDS)
    result = quantize_model(model, Recipe(act_granularity="tensor",
                                          format=fmt, dtype="float32"), token_batches(IDS, 4))
    assert len(result.modules) == EXPECTED_GEMMS[arch]
    assert all(isinstance(model.get_submodule(m.name), QuantGemm) for m in result.modules)
    out = run(model, IDS)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert 0 < rel < 0.15
    for m in result.modules:
        assert m.input_scale > 0 and m.weight_scale_min > 0 and m.weight_sqnr_db > 15


def test_weights_are_exactly_format_values_times_scale():
    model = tiny("gpt2")  # Conv1D: [in, out] weights
    original = copy.deepcopy(model)
    quantize_model(model, Recipe(act_granularity="tensor",
                                 format="e4m3", dtype="float32"), token_batches(IDS, 4))
    q = model.transformer.h[0].attn.c_attn
    w_orig = weight_2d(original.transformer.h[0].attn.c_attn).float()
    values = decode(q.weight_codes, get_format("e4m3"))
    assert torch.equal(weight_2d(q.inner).float(), values * q.weight_scale)
    assert q.weight_scale.shape == (w_orig.shape[0], 1)
    assert torch.allclose(q.weight_scale.flatten(), w_orig.abs().amax(1) / 448.0)


def test_lm_head_skipped_by_default_and_globs_and_overrides():
    model = tiny("llama")
    targets, skipped = plan_targets(model, Recipe(act_granularity="tensor", skip=["*.mlp.*"],
                                                  overrides={"*.q_proj": "e5m2",
                                                             "*.k_proj": "none"}))
    names = {t.name: t.weight_format.name for t in targets}
    assert "lm_head" in skipped and not any(".mlp." in n for n in names)
    assert not any(n.endswith("k_proj") for n in names)
    assert names["model.layers.0.self_attn.q_proj"] == "e5m2"
    assert names["model.layers.0.self_attn.v_proj"] == "e4m3"
    targets, skipped = plan_targets(model, Recipe(act_granularity="tensor", quantize_lm_head=True))
    assert "lm_head" in {t.name for t in targets} and not skipped


def test_weight_only_and_dynamic_tokens_need_no_calibration_data():
    for recipe in (Recipe(act_granularity="tensor", act_format="none", dtype="float32"),
                   Recipe(act_granularity="token", dtype="float32")):
        model = tiny("llama")
        result = quantize_model(model, recipe, None)
        assert all(m.input_scale is None for m in result.modules)
        assert torch.isfinite(run(model, IDS)).all()
        q = model.model.layers[0].self_attn.q_proj
        # weight-only GEMMs have no activation granularity (not a placeholder "tensor")
        assert q.act_granularity == (None if recipe.act_format == "none" else "token")
    with pytest.raises(UsageError, match="calibration data"):
        quantize_model(tiny("llama"), Recipe(act_granularity="tensor"), None)


def test_dynamic_token_scales_follow_each_row():
    model = tiny("llama")
    quantize_model(model, Recipe(act_granularity="token", dtype="float32"), None)
    q = model.model.layers[0].self_attn.q_proj
    x = torch.randn(3, 64) * torch.tensor([[1.0], [100.0], [0.01]])
    xq = q.quantize_input(x)
    rel = ((xq - x).norm(dim=1) / x.norm(dim=1))
    assert (rel < 0.05).all()  # each row keeps its own relative precision


def test_nan_weight_is_a_clear_error_naming_the_tensor():
    model = tiny("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(NumericsError, match="model.layers.1.mlp.up_proj"):
        quantize_model(model, Recipe(act_granularity="tensor"), token_batches(IDS, 4))


class WithUnusedExpert(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(8, 8)
        self.zero = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)  # an MoE expert no calibration token was routed to
        with torch.no_grad():
            self.zero.weight.zero_()

    def forward(self, x):
        return self.zero(self.used(x))


def test_unused_module_and_zero_weight_get_defined_scales_and_warnings():
    model = WithUnusedExpert()
    result = quantize_model(model, Recipe(act_granularity="tensor",
                                          dtype="float32"), [torch.randn(4, 8)])
    by_name = {m.name: m for m in result.modules}
    assert any("saw no calibration tokens" in w for w in by_name["unused"].warnings)
    assert any("amax 0" in w for w in by_name["zero"].warnings)
    for m in result.modules:
        assert m.input_scale == pytest.approx(m.input_scale) and m.input_scale > 0
        assert m.weight_scale_min > 0
    assert torch.isfinite(model(torch.randn(2, 8))).all()


def test_keep_first_last_and_depthwise():
    cnn = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Conv2d(4, 4, 3, groups=4), nn.Conv2d(4, 4, 1),
                        nn.Flatten(), nn.Linear(4 * 4 * 4, 3))
    targets, skipped = plan_targets(cnn, Recipe(act_granularity="tensor",
                                                keep_first_last=True, keep_depthwise=True))
    assert [t.name for t in targets] == ["2"] and skipped == ["0", "1", "4"]
    result = quantize_model(cnn, Recipe(act_granularity="tensor",
                                        dtype="float32"), [torch.randn(2, 1, 8, 8)])
    assert {m.kind for m in result.modules} == {"conv", "depthwise_conv", "linear"}


@pytest.mark.parametrize("calib", ["best", "pow2-search"])
def test_layer_aware_calibrators_pick_scales_no_worse_than_max(calib):
    model = tiny("llama")
    ref = run(model, IDS)

    def error(recipe):
        m = copy.deepcopy(model)
        result = quantize_model(m, recipe, token_batches(IDS, 4))
        return ((run(m, IDS) - ref).norm() / ref.norm()).item(), result

    base, _ = error(Recipe(act_granularity="tensor",
                           format="hif8", act_calib="cast", weight_calib="cast",
                           weight_granularity="tensor", dtype="float32"))
    err, result = error(Recipe(act_granularity="tensor",
                               format="hif8", act_calib=calib, weight_granularity="tensor",
                               dtype="float32"))
    assert err < base  # beats the direct cast the seed compares against
    assert all(m.act_calib.startswith(calib.split("-")[0]) for m in result.modules)
    if calib == "pow2-search":
        for m in result.modules:  # powers of two, per Luo et al. 2024 Algorithm 1
            for s in (m.input_scale, m.weight_scale_max):
                assert torch.log2(torch.tensor(s)).frac() == 0


def test_pow2_search_leaves_fp_weights_untouched_before_quantization():
    model = tiny("llama")
    w = model.model.layers[0].mlp.down_proj.weight.detach().clone()
    result = quantize_model(model, Recipe(act_granularity="tensor",
                                          format="hif8", act_calib="pow2-search",
                                          weight_granularity="tensor", dtype="float32"),
                            token_batches(IDS, 4))
    q = model.model.layers[0].mlp.down_proj
    # the stored weight is the quantization of the ORIGINAL weight, not of a quantized copy
    scale = q.weight_scale
    expected = decode(q.weight_codes, get_format("hif8")) * scale
    assert torch.equal(weight_2d(q.inner).float(), expected)
    assert torch.equal(expected, fake_quantize(w, scale, get_format("hif8")))
    assert result.modules


def test_shared_inputs_are_fake_quantized_once_and_never_served_stale(monkeypatch):
    from fp8ptq.nn import quant_gemm

    model = tiny("llama")
    quantize_model(model, Recipe(act_granularity="tensor",
                                 format="e4m3", dtype="float32"), token_batches(IDS, 4))
    calls = []
    real = quant_gemm.fake_quantize
    monkeypatch.setattr(quant_gemm, "fake_quantize",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        cached = run(model, IDS)
    # per layer: q/k/v share one input and gate/up another (max calibration gives them one scale)
    assert len(calls) == 2 * 4
    attn = model.model.layers[0].self_attn
    x = torch.randn(2, 5, 64)
    before = attn.q_proj(x)
    x.mul_(3.0)  # same object, new version: must be re-quantized
    assert not torch.equal(attn.k_proj.quantize_input(x), attn.q_proj.quantize_input(x / 3.0))
    assert torch.equal(attn.q_proj(x / 3.0), before)
    monkeypatch.setattr(quant_gemm._SharedInput, "key_of", staticmethod(lambda q, x: None))
    with torch.no_grad():
        assert torch.equal(run(model, IDS), cached)
