"""Attention-matmul and residual-add taps (``fp8ptq.taps.taps``) on tiny models built from
configs."""

import math

import pytest
import torch
from torch import nn

from fp8ptq.config.recipe import Recipe
from fp8ptq.errors import Fp8ptqError, UsageError
from fp8ptq.formats import fake_quantize, get_format
from fp8ptq.taps.taps import ATTN_IMPLEMENTATION, ActivationTaps, fp8ptq_eager_attention
from tiny_models import tiny as tiny_model

transformers = pytest.importorskip("transformers")

VOCAB = 100


TAPS_CONFIG = {  # over tiny_models' defaults
    "llama": dict(num_key_value_heads=2, max_position_embeddings=64),
    "bert": dict(max_position_embeddings=64, head=transformers.BertForMaskedLM),
    "gpt2": dict(n_positions=64),
    "opt": dict(max_position_embeddings=64),
}


def tiny(arch: str, attn: str = "eager"):
    return tiny_model(arch, attn=attn, vocab_size=VOCAB, **TAPS_CONFIG[arch])


# attention modules and residual branch modules each tiny model must get
EXPECTED = {
    "llama": ("model.layers.{}.self_attn", "model.layers.{}",
              ("self_attn.o_proj", "mlp.down_proj")),
    "bert": ("bert.encoder.layer.{}.attention.self", "bert.encoder.layer.{}",
             ("attention.output.dense", "output.dense", "attention.output.LayerNorm")),
    "gpt2": ("transformer.h.{}.attn", "transformer.h.{}", ("attn.c_proj", "mlp.c_proj")),
    "opt": ("model.decoder.layers.{}.self_attn", "model.decoder.layers.{}",
            ("self_attn.out_proj", "fc2")),
}


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # padding exercises the mask path
    return {"input_ids": ids, "attention_mask": mask}


def logits(model, b=None):
    with torch.inference_mode():
        return model(**(b or batch())).logits


def calibrated(model, recipe_flags, fmt="e4m3", **freeze_flags):
    taps = ActivationTaps(model, Recipe(**recipe_flags))
    with taps.observing():
        logits(model)
    report = taps.freeze(Recipe(format=fmt, **freeze_flags))
    return taps, report


def rel_change(a, b):
    return float((a - b).abs().mean() / b.abs().mean())


@pytest.mark.parametrize("arch", ["llama", "bert", "gpt2", "opt"])
def test_unfrozen_taps_reproduce_eager_exactly_and_remove_restores(arch):
    model = tiny(arch)
    ref = logits(model)
    taps = ActivationTaps(model, Recipe(quantize_attention=True, quantize_residual=True))
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    assert torch.equal(logits(model), ref)  # pass-through
    with taps.observing():
        assert torch.equal(logits(model), ref)  # observing changes nothing
    assert all(n > 0 for n in taps.calls.values())  # every attention went through fp8ptq_eager
    taps.freeze(Recipe(format="e2m1"))
    assert not torch.equal(logits(model), ref)
    taps.remove()
    assert model.config._attn_implementation == "eager"
    assert torch.equal(logits(model), ref)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_remove_restores_default_sdpa():
    model = tiny("llama", attn=None)
    before = model.config._attn_implementation
    taps = ActivationTaps(model, Recipe(quantize_attention=True))
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    taps.remove()
    assert model.config._attn_implementation == before


@pytest.mark.parametrize("arch", ["llama", "bert", "gpt2", "opt"])
def test_attention_stats_for_every_layer(arch):
    model = tiny(arch)
    attn_fmt = EXPECTED[arch][0]
    taps = ActivationTaps(model, Recipe(quantize_attention=True))
    with taps.observing():
        logits(model)
    names = [attn_fmt.format(i) for i in range(2)]
    assert taps.attention_modules == names
    for name in names:
        for role in "qkvp":
            st = taps.stats[f"{name}:{role}"]
            assert st.seen and st.amax > 0 and st.nonfinite == 0
        assert taps.stats[f"{name}:q"].channel_amax.numel() == 16  # head_dim
        assert taps.stats[f"{name}:p"].amax <= 1.0  # probabilities
        assert taps.warnings == []  # Q K^T and P V found in every eager call


def test_freeze_report_scales_and_kv_scales():
    model = tiny("llama")
    taps, report = calibrated(model, {"quantize_attention": True})
    attn = taps.attention_modules
    assert set(report) == {f"{a}:{r}" for a in attn for r in "qkvp"}
    for entry in report.values():
        assert entry["format"] == "e4m3" and entry["calib"] == "max"
        assert math.isfinite(entry["scale"]) and entry["scale"] > 0
        assert entry["scale"] == pytest.approx(entry["amax"] / 448.0, rel=1e-6)
    kv = taps.kv_scales()
    assert list(kv) == attn
    for a in attn:
        assert kv[a] == {"k_scale": report[f"{a}:k"]["scale"], "v_scale": report[f"{a}:v"]["scale"]}
        assert set(taps.attention_scales()[a]) == {"q_scale", "k_scale", "v_scale", "p_scale"}
    taps.remove()


def test_unseen_taps_get_guarded_scale_and_layer_aware_calib_falls_back():
    model = tiny("llama")
    taps = ActivationTaps(model, Recipe(quantize_attention=True, quantize_residual=True))
    with pytest.raises(Fp8ptqError):
        taps.kv_scales()  # nothing frozen yet
    report = taps.freeze(Recipe(format="e4m3", act_calib="best"))  # no calibration pass at all
    for entry in report.values():
        assert entry["scale"] == 1.0 and entry["warnings"] and entry["calib"] == "max"
    assert torch.isfinite(logits(model)).all()
    taps.remove()


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_attention_quantization_fine_vs_coarse(arch):
    model = tiny(arch)
    ref = logits(model)
    taps, _ = calibrated(model, {"quantize_attention": True}, fmt="e4m3")
    fine = rel_change(logits(model), ref)
    taps.freeze(Recipe(format="e2m1"))  # same statistics, a 4-bit format
    coarse = rel_change(logits(model), ref)
    assert 0 < fine < 0.05
    assert coarse > 3 * fine
    taps.remove()


def test_fp8ptq_eager_quantizes_q_k_v_and_probabilities():
    model = tiny("llama")
    attn = model.model.layers[0].self_attn
    name = "model.layers.0.self_attn"
    taps, report = calibrated(model, {"quantize_attention": True}, fmt="e3m2")
    fmt = get_format("e3m2")
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 5, 16, generator=g)
    k, v = torch.randn(1, 2, 5, 16, generator=g), torch.randn(1, 2, 5, 16, generator=g)
    s = {r: report[f"{name}:{r}"]["scale"] for r in "qkvp"}
    out, _ = fp8ptq_eager_attention(attn, q, k, v, None, scaling=0.25)

    def fq(x, r):
        return fake_quantize(x, torch.tensor(s[r]), fmt)

    kq = fq(k, "k").repeat_interleave(2, dim=1)
    vq = fq(v, "v").repeat_interleave(2, dim=1)
    p = torch.softmax(fq(q, "q") @ kq.transpose(2, 3) * 0.25, dim=-1)
    expect = (fq(p, "p") @ vq).transpose(1, 2)
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-6)
    unquantized_p = (p @ vq).transpose(1, 2)
    assert not torch.allclose(out, unquantized_p, rtol=1e-5, atol=1e-6)  # P really was quantized
    taps.remove()


@pytest.mark.parametrize("arch", ["llama", "bert", "gpt2", "opt"])
def test_residual_taps_cover_every_layer(arch):
    model = tiny(arch)
    ref = logits(model)
    _, layer_fmt, branches = EXPECTED[arch]
    taps, report = calibrated(model, {"quantize_residual": True}, fmt="e2m1")
    assert model.config._attn_implementation == "eager"  # residual alone leaves attention alone
    layers = [layer_fmt.format(i) for i in range(2)]
    assert taps.layers == layers
    expected = {f"{lay}:input" for lay in layers} | {
        f"{lay}.{b}:output" for lay in layers for b in branches}
    assert set(report) == expected
    assert all(taps.stats[t].seen for t in expected)
    assert all(math.isfinite(e["scale"]) and e["scale"] > 0 for e in report.values())
    out = logits(model)
    assert torch.isfinite(out).all() and rel_change(out, ref) > 0.01
    taps.remove()
    assert torch.equal(logits(model), ref)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_no_attention_or_layers_is_a_usage_error():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with pytest.raises(UsageError):
        ActivationTaps(model, Recipe(quantize_attention=True))
    with pytest.raises(UsageError):
        ActivationTaps(model, Recipe(quantize_residual=True))


def test_pipeline_end_to_end():
    from fp8ptq.execution.in_memory import quantize_model, token_batches
    from fp8ptq.nn.quant_gemm import QuantGemm

    model = tiny("llama", attn=None)
    ids = torch.randint(0, VOCAB, (8, 12), generator=torch.Generator().manual_seed(3))
    ref = logits(model, {"input_ids": ids})
    res = quantize_model(model, Recipe(format="e4m3", quantize_attention=True),
                         token_batches(ids, 4))
    taps_report = res.extras["taps"]
    assert set(taps_report) == {f"model.layers.{i}.self_attn:{r}" for i in range(2)
                                for r in "qkvp"}
    assert all(e["scale"] > 0 and math.isfinite(e["scale"]) for e in taps_report.values())
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    out = logits(model, {"input_ids": ids})
    assert torch.isfinite(out).all() and 0 < rel_change(out, ref) < 0.2

    # both taps: the residual hooks follow the branch projections into their QuantGemm
    model = tiny("llama")
    res = quantize_model(model, Recipe(format="e4m3", quantize_attention=True,
                                       quantize_residual=True), token_batches(ids, 4))
    o_proj = model.model.layers[0].self_attn.o_proj
    assert isinstance(o_proj, QuantGemm) and o_proj._forward_hooks
    assert "model.layers.1.mlp.down_proj:output" in res.extras["taps"]
    assert torch.isfinite(logits(model, {"input_ids": ids})).all()
    from fp8ptq.taps.taps import kv_scales_from_report

    kv = kv_scales_from_report(res.extras["taps"])
    assert list(kv) == [f"model.layers.{i}.self_attn" for i in range(2)]
    assert all(set(v) == {"k_scale", "v_scale"} for v in kv.values())
