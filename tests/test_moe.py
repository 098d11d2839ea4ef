"""Mixture-of-Experts models whose experts are fused 3-D parameters (transformers 5): every routed
expert is quantized with its own scales, simulated exactly, saved and reloaded bit for bit; no
expert ever ends with a missing, NaN, inf or zero scale; routers stay in high precision."""

import json

import pytest
import torch

import fp8ptq
from fp8ptq.checkpoint import save_quantized
from fp8ptq.config.recipe import Recipe
from fp8ptq.execution.in_memory import quantize_model, token_batches
from fp8ptq.formats import decode, get_format
from fp8ptq.model.experts import expert_weight, find_experts, router_names
from fp8ptq.nn.quant_experts import QuantExperts
from tiny_models import invoke, tiny

VOCAB, E = 128, 8
IDS = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(3))


def batches():
    return list(token_batches(IDS, 2))


def logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_every_expert_quantized_saved_and_reloaded_bit_exact(arch, tmp_path):
    model = tiny(arch)
    found = list(find_experts(model))
    assert len(found) == 2  # one fused experts module per layer
    originals = {n: {p: expert_weight(m, i, p).detach().clone() for p in i.projections}
                 for n, m, i in found}
    ref = logits(model)
    result = quantize_model(model, Recipe(act_granularity="tensor",
                                          format="e4m3", batch_size=2), batches())
    qexperts = {n: m for n, m in model.named_modules() if isinstance(m, QuantExperts)}
    assert set(qexperts) == set(originals)
    for name, q in qexperts.items():
        for proj, w in originals[name].items():
            assert q.codes(proj).shape == (E, *w.shape[1:])
            assert q.weight_scale(proj).shape == (E, w.shape[1], 1)  # per expert, per channel
            s = q.input_scale(proj)
            assert s.shape == (E,) and bool(torch.isfinite(s).all()) and bool((s > 0).all())
            # each expert's weight round-trips within e4m3 precision of its own scale
            for e in range(E):
                deq = q.dequantized_weight(proj, e)
                assert torch.allclose(deq, w[e].float(), rtol=2**-3, atol=1e-6)
    out = logits(model)
    assert not torch.equal(out, ref)  # the experts are really quantized
    assert torch.allclose(out, ref, atol=0.1)
    hp = result.extras["high_precision"]
    assert hp["high_precision_fraction"] < 0.25  # embeddings, lm_head, routers, norms only

    save_quantized(result, Recipe(act_granularity="tensor", format="e4m3"), tmp_path / "ck")
    meta = json.loads((tmp_path / "ck" / "fp8ptq.json").read_text())
    assert set(meta["experts"]) == set(originals)
    loaded = fp8ptq.load(tmp_path / "ck")
    assert torch.equal(logits(loaded.model), out)


def test_routers_stay_high_precision_unless_asked(tmp_path):
    model = tiny("qwen2_moe")
    routers = router_names(model)
    assert "model.layers.0.mlp.shared_expert_gate" in routers
    result = quantize_model(model, Recipe(act_granularity="tensor",
                                          format="e4m3", batch_size=2), batches())
    names = {m.name for m in result.modules}
    assert not names & set(routers)
    assert "model.layers.0.mlp.shared_expert.gate_proj" in names  # shared expert: quantized
    model = tiny("qwen2_moe")
    result = quantize_model(model, Recipe(act_granularity="tensor",
                                          format="e4m3", batch_size=2, quantize_router=True),
                            batches())
    assert set(routers) <= {m.name for m in result.modules}


def _force_router(model, allowed: list[int]):
    """Route every token only to the experts in ``allowed`` (the others never see a token)."""
    for _name, module in model.named_modules():
        if type(module).__name__.endswith("TopKRouter"):
            def forward(hidden_states, module=module):
                hidden_states = hidden_states.reshape(-1, module.hidden_dim)
                logits = torch.nn.functional.linear(hidden_states, module.weight)
                mask = torch.full_like(logits, float("-inf"))
                mask[:, allowed] = 0
                probs = torch.softmax(logits + mask, dim=-1, dtype=torch.float)
                top, idx = torch.topk(probs, module.top_k, dim=-1)
                return logits, top.to(logits.dtype), idx
            module.forward = forward


def test_experts_without_tokens_get_sibling_scale_and_warning(tmp_path):
    model = tiny("mixtral")
    _force_router(model, [0, 1, 2])
    recipe = Recipe(act_granularity="tensor",
                    format="e4m3", batch_size=2, calibrate_all_experts=False,
                    unify_fused_scales=False)
    result = quantize_model(model, recipe, batches())
    layer = result.extras["experts"]["model.layers.0.mlp.experts"]
    for facts in layer["projections"].values():
        assert facts["experts_without_tokens"] == [3, 4, 5, 6, 7]
        scales = facts["input_scales"]
        assert all(s > 0 and s != float("inf") for s in scales)
        assert scales[3:] == [max(scales[:3])] * 5
    assert any("saw no calibration token" in w for w in result.warnings)
    save_quantized(result, recipe, tmp_path / "ck")
    meta = json.loads((tmp_path / "ck" / "fp8ptq.json").read_text())
    assert any("expert(s) [3, 4, 5, 6, 7]" in w for w in meta["warnings"])
    for key, t in fp8ptq.load(tmp_path / "ck").model.state_dict().items():
        if "scale" in key:
            assert bool(torch.isfinite(t).all()) and bool((t > 0).all()), key


def test_calibrate_all_experts_observes_every_expert():
    model = tiny("mixtral")
    _force_router(model, [0, 1])
    result = quantize_model(model, Recipe(act_granularity="tensor",
                                          format="e4m3", batch_size=2, unify_fused_scales=False),
                            batches())
    layer = result.extras["experts"]["model.layers.0.mlp.experts"]
    first, down = layer["projections"]["gate_up_proj"], layer["projections"]["down_proj"]
    assert first["experts_without_tokens"] == down["experts_without_tokens"] == []
    # every expert saw every token: one shared input, its own intermediate activations
    assert len(set(first["input_scales"])) == 1
    assert len(set(down["input_scales"])) == E


@pytest.mark.slow
@pytest.mark.parametrize("gran,act", [("tensor", "tensor"), ("block", "token"),
                                      ("channel", "token")])
def test_granularities_and_dynamic_activations(gran, act, tmp_path):
    model = tiny("qwen3_moe")
    recipe = Recipe(format="e4m3", weight_granularity=gran, block_size=16,
                    act_granularity=act, batch_size=2)
    result = quantize_model(model, recipe, batches() if act == "tensor" else None)
    q = model.get_submodule("model.layers.1.mlp.experts")
    assert isinstance(q, QuantExperts)
    if act == "token":
        assert q.input_scale("down_proj") is None
    codes = q.codes("down_proj")[0]
    fmt = get_format("e4m3")
    assert bool(torch.isfinite(decode(codes, fmt)).all())
    out = logits(model)
    save_quantized(result, recipe, tmp_path / "ck")
    assert torch.equal(logits(fp8ptq.load(tmp_path / "ck").model), out)


def test_skip_experts_by_glob_lists_them_in_high_precision():
    model = tiny("mixtral")
    result = quantize_model(model, Recipe(act_granularity="tensor", format="e4m3", batch_size=2,
                                          skip=["*.experts"]), batches())
    assert "model.layers.0.mlp.experts" in result.skipped
    hp = result.extras["high_precision"]
    assert hp["high_precision_fraction"] > 0.5
    assert hp["largest_high_precision"][0]["name"].endswith("experts.gate_up_proj")


@pytest.mark.slow
def test_cli_quantize_reports_experts_and_high_precision_share(tmp_path, word_tokenizer):


    model_dir = tmp_path / "qwen2moe"
    tiny("qwen2_moe").save_pretrained(model_dir)
    word_tokenizer.save_pretrained(model_dir)
    calib = tmp_path / "calib.txt"
    calib.write_text("the quick brown fox jumps over the lazy dog\nhello world and hello again\n")
    out = tmp_path / "out"
    args = ["quantize", str(model_dir), "-o", str(out), "--calib-data", str(calib),
            "--num-samples", "4", "--seq-len", "8", "--batch-size", "2"]
    res = invoke(args)
    assert res.exit_code == 0, (res.output, res.exception)
    assert "model.layers.0.mlp.experts: 8 experts x 2 GEMMs" in res.output
    assert "left in high precision:" in res.output
    res = invoke([*args, "--force", "--json", "--routed-experts-only"])
    report = json.loads(res.stdout)
    assert set(report["experts"]) == {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"}
    assert report["high_precision"]["high_precision_fraction"] < 0.25
    meta = json.loads((out / "fp8ptq.json").read_text())
    assert meta["recipe"]["calibrate_all_experts"] is False
    loaded = fp8ptq.load(out)
    assert isinstance(loaded.model.get_submodule("model.layers.1.mlp.experts"), QuantExperts)


def test_unified_expert_input_scales_are_the_layer_maximum():
    model = tiny("mixtral")
    own = quantize_model(tiny("mixtral"), Recipe(act_granularity="tensor",
                                                 format="e4m3", batch_size=2,
                                                     unify_fused_scales=False), batches())
    result = quantize_model(model, Recipe(act_granularity="tensor",
                                          format="e4m3", batch_size=2), batches())
    for name, layer in result.extras["experts"].items():
        for proj, facts in layer["projections"].items():
            mine = own.extras["experts"][name]["projections"][proj]["input_scales"]
            assert facts["input_scales"] == [max(mine)] * E


def _ct_layout_case(arch, tmp_path, **recipe):
    model = tiny(arch)
    recipe = Recipe(**{"format": "e4m3", "batch_size": 2, "act_granularity": "tensor", **recipe})
    result = quantize_model(model, recipe,
                            batches() if recipe.act_granularity == "tensor" else None)
    out = logits(model)
    facts = save_quantized(result, recipe, tmp_path / "ck")
    return model, result, out, facts


@pytest.mark.slow
@pytest.mark.parametrize("arch,key", [
    ("mixtral", "model.layers.0.block_sparse_moe.experts.5.w3"),
    ("qwen2_moe", "model.layers.0.mlp.experts.5.up_proj"),
    ("qwen3_moe", "model.layers.0.mlp.experts.5.up_proj")])
@pytest.mark.parametrize("scheme", [{"weight_granularity": "tensor"},
                                    {"act_granularity": "token"}])
def test_servable_moe_recipes_write_compressed_tensors_transformers_loads(arch, key, scheme,
                                                                          tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model, result, out, facts = _ct_layout_case(arch, tmp_path, **scheme)
    assert facts["layout"] == "compressed-tensors"
    tensors = load_file(tmp_path / "ck" / "model.safetensors")
    assert tensors[f"{key}.weight"].dtype == torch.float8_e4m3fn
    assert f"{key}.weight_scale" in tensors
    assert (f"{key}.input_scale" in tensors) == ("act_granularity" not in scheme)
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.mlp.gate" in cfg["ignore"]  # the router stays unquantized
    # fp8ptq reloads it bit for bit
    assert torch.equal(logits(fp8ptq.load(tmp_path / "ck").model), out)
    # transformers merges the per-expert tensors into its fused experts: the same weights
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ck")
    q = model.get_submodule("model.layers.1.mlp.experts")
    fused = hf.get_submodule("model.layers.1.mlp.experts")
    for proj in q.info.projections:
        mine = torch.stack([q.dequantized_weight(proj, e) for e in range(E)])
        assert torch.equal(getattr(fused, proj).detach().float(), mine)


def test_unservable_moe_recipe_is_native_with_a_warning(tmp_path):
    _, result, out, facts = _ct_layout_case("qwen2_moe", tmp_path)  # channel W + static A
    assert facts["layout"] == "fp8ptq-native"
    warning = next(w for w in result.warnings if "vLLM would not serve it" in w)
    assert "--weight-granularity tensor" in warning and "--act-granularity token" in warning
    meta = json.loads((tmp_path / "ck" / "fp8ptq.json").read_text())
    assert warning in meta["warnings"]
    assert torch.equal(logits(fp8ptq.load(tmp_path / "ck").model), out)
