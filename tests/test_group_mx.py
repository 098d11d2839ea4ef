"""Dynamic per-group activations (``--act-granularity group``, FP8_BLOCK's 1x128 groups) and the
MX formats (``--format mxfp8`` / ``mxfp8-e5m2``) wired through the plan, the pipeline and
``QuantGemm``: hand-computed groups, bit-exactness against the OCP MX reference, the plan's
facts (no calibration data needed), mixed overrides."""

import math

import pytest
import torch
from torch import nn

from fp8ptq.config.plan import build_plan, run_facts
from fp8ptq.config.recipe import Recipe
from fp8ptq.execution.in_memory import quantize_model, token_batches
from fp8ptq.formats import encode, fake_quantize, get_format
from fp8ptq.formats.granularity import PerChannel, PerGroup
from fp8ptq.formats.mx import mx_fake_quantize
from fp8ptq.formats.scales import amax_to_scale, dynamic_scale
from fp8ptq.nn.quant_gemm import QuantGemm
from fp8ptq.runtime import native
from tiny_models import IDS, run, tiny

E4M3, MXFP8, MXE5M2 = get_format("e4m3"), get_format("mxfp8"), get_format("mxfp8-e5m2")


def _gemm(in_features, fmt, act_fmt, w_gran, act_granularity="tensor", group=None, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(in_features, 3, bias=False)
    w = lin.weight.detach().float()
    scale = amax_to_scale(w_gran.amax(w), fmt)
    codes = encode(w / w_gran.expand(scale, w), fmt)
    return QuantGemm(lin, weight_format=fmt, weight_codes=codes, weight_scale=scale,
                     weight_granularity=w_gran, act_format=act_fmt, input_scale=None,
                     act_granularity=act_granularity, act_group_size=group)


def test_group_activations_hand_computed():
    """Groups of 2 features: scales 3/448 and 0.5/448. 1 * 448/3 = 149.33 rounds to 144 on the
    e4m3 grid (step 16 in [128, 256)); -3, 0.5 map onto +-448 exactly; 0.25 -> 224 exactly."""
    q = _gemm(4, E4M3, E4M3, PerChannel(), "group", 2)
    x = torch.tensor([[1.0, -3.0, 0.5, 0.25]])
    got = q.quantize_input(x)
    s1 = torch.tensor(3.0) / 448  # float32, as the module computes it
    assert got.tolist() == [[float(144 * s1), -3.0, 0.5, 0.25]]
    # a per-token scale (amax 3) would have rounded 0.25 * 448/3 = 37.33 -> 36: groups keep it
    token = _gemm(4, E4M3, E4M3, PerChannel(), "token")
    assert token.quantize_input(x)[0, 3].item() == pytest.approx(36 * 3 / 448)


def test_group_partial_last_group_and_zero_group():
    q = _gemm(5, E4M3, E4M3, PerChannel(), "group", 2)
    x = torch.tensor([[0.0, 0.0, 1.0, 2.0, -7.0]])  # groups [0, 0] [1, 2] [-7]
    got = q.quantize_input(x)
    assert got[0, :2].tolist() == [0.0, 0.0] and torch.isfinite(got).all()
    assert got[0, 4].item() == -7.0 and got[0, 3].item() == 2.0
    assert dynamic_scale(torch.zeros(1), E4M3).item() > 0


@pytest.mark.parametrize("fmt,elem", [(MXFP8, "e4m3"), (MXE5M2, "e5m2")])
def test_mx_gemm_is_bit_exact_to_the_spec(fmt, elem):
    """Weights and activations of an MX-format QuantGemm equal ``mx_fake_quantize`` (the OCP
    MX v1.0 rule, tested against an independent reference in test_mx.py), for K not a
    multiple of 32, tiny and huge magnitudes and an all-zero block."""
    q = _gemm(70, fmt, fmt, PerGroup(32))
    assert q.act_granularity == "group" and q.act_group_size == 32
    w = q.inner.weight.detach().float()
    assert torch.equal(q.dequantized_weight_2d(), mx_fake_quantize(w, get_format(elem)))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 70, generator=g) * torch.logspace(-20, 20, 70)
    x[0, 1, 32:64] = 0.0
    assert torch.equal(q.quantize_input(x), mx_fake_quantize(x, get_format(elem)))
    xb = x.clamp(-1e30, 1e30).to(torch.bfloat16)
    assert torch.equal(q.quantize_input(xb), mx_fake_quantize(xb, get_format(elem)))
    # every weight scale is a power of two (E8M0)
    m, _ = torch.frexp(q.weight_scale)
    assert bool((m == 0.5).all())


def test_mx_scale_rule_in_amax_to_scale():
    """amax 3 -> 2^(1 - 8); amax 448 -> 2^(8 - 8) = 1 (448 itself then stays 448); zero block
    -> 2^-127, the smallest E8M0 value (never 0)."""
    s = amax_to_scale(torch.tensor([3.0, 448.0, 0.0]), MXFP8)
    assert s.tolist() == [2.0 ** -7, 1.0, 2.0 ** -127]
    assert amax_to_scale(torch.tensor([3.0]), MXE5M2).tolist() == [2.0 ** -14]


def test_dynamic_scale_uses_calibration_max():
    """Dynamic scales follow the calibrated rule: HiF8's amax maps onto 2^4 (the top of its
    3-bit-mantissa range), not onto its max 2^15."""
    hif8 = get_format("hif8")
    assert dynamic_scale(torch.tensor([32.0]), hif8).item() == 2.0
    assert dynamic_scale(torch.tensor([448.0]), E4M3).item() == 1.0


def test_plan_of_mx_and_group_recipes():
    model = tiny("llama")
    plan = build_plan(model, Recipe(format="mxfp8"))
    m = plan.gemms[0]
    assert (m.weight.granularity, m.weight.block_size) == ("group", 32)
    assert (m.input.granularity, m.input.group_size, m.input.dynamic) == ("group", 32, True)
    assert not plan.needs_calibration and not run_facts(Recipe(format="mxfp8")).needs_calibration
    plan = build_plan(model, Recipe(weight_granularity="block", act_granularity="group",
                                    act_group_size=64))
    m = plan.gemms[0]
    assert m.input.to_dict() == {"format": "e4m3", "granularity": "group", "calibrator": "max",
                                 "dynamic": True, "group_size": 64}
    assert not plan.needs_calibration


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [
    Recipe(format="mxfp8", dtype="float32"),
    Recipe(format="mxfp8-e5m2", dtype="float32"),
    Recipe(weight_granularity="block", block_size=32, act_granularity="group", act_group_size=32,
           dtype="float32"),
])
def test_quantize_without_calibration_data(recipe):
    model = tiny("llama")
    ref = run(model, IDS)
    result = quantize_model(model, recipe, None)
    qs = [m for m in model.modules() if isinstance(m, QuantGemm)]
    assert qs and all(q.act_granularity == "group" and q.input_scale is None for q in qs)
    out = run(model, IDS)
    assert torch.isfinite(out).all()
    err = float((out - ref).pow(2).mean() / ref.pow(2).mean())
    assert 0 < err < 0.05, err
    assert not result.warnings


def test_mx_override_in_a_static_recipe_with_a_layer_aware_calibrator():
    """An MX module inside a static best-of recipe: the layer-aware search skips it (its
    activations are dynamic), it gets its own group granularity, the others stay static."""
    model = tiny("llama")
    recipe = Recipe(act_calib="best", act_granularity="tensor", dtype="float32",
                    overrides={"*.mlp.down_proj": "mxfp8"})
    result = quantize_model(model, recipe, token_batches(IDS, 4))
    down = model.get_submodule("model.layers.0.mlp.down_proj")
    up = model.get_submodule("model.layers.0.mlp.up_proj")
    assert down.weight_format.name == "mxfp8" and down.weight_granularity == PerGroup(32)
    assert down.input_scale is None and down.act_granularity == "group"
    assert up.input_scale is not None and up.weight_granularity.name == "channel"
    report = {r.name: r for r in result.modules}
    assert report["model.layers.0.mlp.up_proj"].act_calib.startswith("best:")
    assert math.isfinite(float(run(model, IDS).abs().max()))


def test_group_size_recipe_check():
    from fp8ptq.errors import UsageError
    with pytest.raises(UsageError, match="act_group_size"):
        Recipe(act_group_size=0)
    with pytest.raises(UsageError, match="act_granularity"):
        Recipe(act_granularity="row")


def test_moe_experts_refuse_group_activations():
    from transformers import MixtralConfig, MixtralForCausalLM

    from fp8ptq.errors import UsageError
    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                        num_experts_per_tok=2)
    model = MixtralForCausalLM(cfg).eval()
    with pytest.raises(UsageError, match="fused MoE experts"):
        build_plan(model, Recipe(format="mxfp8"))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [Recipe(format="mxfp8", dtype="float32"),
                                    Recipe(scheme="fp8-block", block_size=32, act_group_size=32,
                                           dtype="float32")])
def test_native_round_trip(recipe, tmp_path):
    """Until compressed-tensors writing of group / MX scales: the native layout stores them and
    fp8ptq.load rebuilds the same model (group sizes, MX formats, codes and scales)."""
    from fp8ptq.checkpoint import load_quantized, read_metadata, save_quantized

    model = tiny("llama")
    result = quantize_model(model, recipe, None)
    ref = run(model, IDS)
    save_quantized(result, tmp_path / "q")
    meta = read_metadata(tmp_path / "q")
    entry = meta["modules"]["model.layers.0.mlp.down_proj"]
    assert entry["act_granularity"] == "group" and entry["act_group_size"] == 32
    back = load_quantized(tmp_path / "q").model
    q = back.get_submodule("model.layers.0.mlp.down_proj")
    assert q.act_group_size == 32 and q.weight_granularity.size == 32
    assert q.weight_format == model.get_submodule("model.layers.0.mlp.down_proj").weight_format
    assert torch.equal(run(back, IDS), ref)


@pytest.mark.parametrize("fmt", ["e4m3", "hif8", "mxfp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols,size", [(576, 128), (256, 128), (96, 32), (7, 2)])
def test_group_scales_read_by_the_kernels_equal_the_expanded_scale(fmt, dtype, cols, size):
    """``fake_quantize(..., group_size=)`` (the kernels read one scale per group, the last one
    partial where ``cols`` is no multiple) and ``PerGroup.amax`` (one pass of the kernel) give
    the bits of the torch path on the scale expanded to the input's shape: NaN, inf, zero
    groups and tiny values included, 3-D input."""
    spec, gran = get_format(fmt), PerGroup(size)
    g = torch.Generator().manual_seed(cols)
    x = torch.randn(3, 5, cols, generator=g) * torch.exp2(
        torch.randint(-20, 20, (3, 5, cols), generator=g).float())
    x[0, 0, 0], x[0, 1, -1], x[1, 0, :size] = torch.nan, torch.inf, 0.0
    x = x.to(dtype)
    amax = gran.amax(x)
    with native.disabled():
        want_amax = gran.amax(x)
    assert amax.shape == want_amax.shape == (3, 5, -(-cols // size))
    assert torch.equal(amax.nan_to_num(7.0), want_amax.nan_to_num(7.0))
    scale = dynamic_scale(want_amax.nan_to_num(1.0), spec)
    got = fake_quantize(x, scale, spec, group_size=size)
    with native.disabled():
        want = fake_quantize(x, gran.expand(scale, x), spec)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(3.0).float().view(torch.int32),
                       want.nan_to_num(3.0).float().view(torch.int32))
    with pytest.raises(ValueError, match="scale per"):
        fake_quantize(x, scale[..., :-1] if scale.shape[-1] > 1 else scale[:1], spec,
                      group_size=size)
