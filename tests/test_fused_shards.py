"""Fused shards (q/k/v, gate/up): runtimes run them as one GEMM with one input scale and, for
per-tensor weights, one weight scale. fp8ptq unifies both at quantization time so that what it
simulates is what vLLM serves."""

import pytest
import torch

from fp8ptq.config.recipe import Recipe
from fp8ptq.execution.in_memory import fused_groups, quantize_model, token_batches
from fp8ptq.formats import encode, get_format
from tiny_models import IDS, tiny

QKV = [f"model.layers.0.self_attn.{s}_proj" for s in "qkv"]
GATE_UP = ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"]


def test_groups_found_by_sibling_names():
    names = [*QKV, "model.layers.0.self_attn.o_proj", *GATE_UP, "model.layers.1.mlp.down_proj",
             "model.layers.2.self_attn.q_proj"]  # a lone q_proj is no group
    assert fused_groups(names) == [QKV, GATE_UP]


def quantized(recipe):
    model = tiny("llama")
    originals = {n: model.get_submodule(n).weight.detach().float().clone() for n in QKV}
    result = quantize_model(model, recipe, list(token_batches(IDS, 4)))
    return model, result, originals


@pytest.mark.parametrize("act_calib", ["max", "best"])
def test_unified_input_and_per_tensor_weight_scales(act_calib):
    model, result, originals = quantized(Recipe(format="e4m3", weight_granularity="tensor",
                                                act_granularity="tensor", act_calib=act_calib))
    qs = [model.get_submodule(n) for n in QKV]
    assert len({float(q.input_scale) for q in qs}) == 1
    assert len({float(q.weight_scale) for q in qs}) == 1
    # the shared weight scale is the largest of the shards' own, and the codes were rounded
    # from the original weights with it (not requantized from other codes)
    fmt = get_format("e4m3")
    own = [w.abs().max() / fmt.max for w in originals.values()]
    shared = qs[0].weight_scale
    assert torch.isclose(shared, torch.stack(own).max())
    for q, w in zip(qs, originals.values()):
        assert torch.equal(q.weight_codes, encode(w / shared, fmt))
    groups = result.extras["fused_groups"]
    assert QKV in [g["modules"] for g in groups]
    assert ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"] in [
        g["modules"] for g in groups]


def test_no_unify_keeps_own_weight_scales():
    model, result, _ = quantized(Recipe(format="e4m3", weight_granularity="tensor",
                                        act_granularity="tensor", unify_fused_scales=False))
    assert len({float(model.get_submodule(n).weight_scale) for n in QKV}) == 3
    assert "fused_groups" not in result.extras
    # statistics-based calibrators: the shards saw one input, so their input scales agree anyway
    assert len({float(model.get_submodule(n).input_scale) for n in QKV}) == 1


def test_default_is_off_for_formats_without_a_fused_runtime():
    model, result, _ = quantized(Recipe(format="hif8", weight_granularity="tensor"))
    assert "fused_groups" not in result.extras
