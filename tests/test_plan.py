"""The plan (``fp8ptq.config.plan``): one place decides what every module gets and what the run
needs;
the job, the in_memory and the calibrator registry all read it."""

import json

import pytest
import torch

from fp8ptq.calibrators import registry
from fp8ptq.calibrators.layerwise import choose_layerwise
from fp8ptq.checkpoint import save_quantized
from fp8ptq.config.plan import build_plan, needs_calibration, run_facts
from fp8ptq.config.recipe import Recipe
from fp8ptq.errors import UsageError
from fp8ptq.execution import in_memory
from fp8ptq.execution.in_memory import quantize_model, token_batches
from fp8ptq.vision import TinyMobileNet
from tiny_models import IDS, invoke, tiny


@pytest.mark.parametrize("flags", [
    {"act_granularity": "token", "bn_retune": True},
    {"act_granularity": "token", "smoothquant": 0.5},
    {"act_granularity": "token", "quantize_attention": True},
    {"act_granularity": "token", "quantize_residual": True},
    {"act_format": "none", "bn_retune": True},
    {"act_granularity": "token", "weight_calib": "gptq"},
])
def test_every_stage_that_reads_data_makes_the_job_need_calibration(flags):
    recipe = Recipe(**flags)
    assert needs_calibration(recipe)
    assert run_facts(recipe).needs_calibration


def test_dynamic_or_weight_only_alone_need_no_data_and_pass_counts():
    assert not needs_calibration(Recipe(act_granularity="token"))
    assert not needs_calibration(Recipe(act_granularity="tensor", act_format="none"))
    assert run_facts(Recipe(act_granularity="tensor", smoothquant=0.5, bn_retune=True)).passes == 3
    assert run_facts(Recipe(act_granularity="tensor", act_calib="best")).sample_batches == 2
    assert run_facts(Recipe(act_calib="best", act_granularity="token")).sample_batches == 0


@pytest.mark.slow
@pytest.mark.parametrize("flags, needed", [
    ({"act_granularity": "token", "weight_calib": "gptq"}, False),  # Hessians in order, alone
    ({"act_granularity": "token", "weight_calib": "gptq", "gptq_sequential": False}, True),
    ({"act_granularity": "tensor", "weight_calib": "gptq"}, True),  # static input scales
    ({"act_granularity": "token", "weight_calib": "gptq", "quantize_attention": True}, True),
    ({"act_granularity": "token", "weight_calib": "max"}, True),  # input amax / SQNR reported
])
def test_the_statistics_pass_runs_exactly_when_the_plan_says(flags, needed, monkeypatch):
    recipe = Recipe(dtype="float32", **flags)
    model = tiny("llama")
    plan = build_plan(model, recipe)
    assert plan.facts.needs_statistics_pass is needed
    calls = []
    real = in_memory.collect_stats
    monkeypatch.setattr(in_memory, "collect_stats",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    quantize_model(model, recipe, list(token_batches(IDS, 4)), plan=plan)
    assert bool(calls) is needed


def test_plan_gives_each_module_its_weight_and_input_plan():
    model = tiny("llama")
    plan = build_plan(model, Recipe(act_granularity="tensor",
                                    format="e4m3", overrides={"*.mlp.*": "e5m2",
                                                              "*.self_attn.o_proj": "none"},
                                    act_calib="percentile", weight_granularity="block",
                                    block_size=16))
    by_name = {m.name: m for m in plan.modules}
    down = next(m for n, m in by_name.items() if n.endswith("mlp.down_proj"))
    assert down.weight.format.name == "e5m2" and down.input.format.name == "e5m2"
    q = next(m for n, m in by_name.items() if n.endswith("self_attn.q_proj"))
    assert q.weight.format.name == "e4m3" and q.weight.granularity == "block"
    assert q.weight.block_size == 16 and q.input.calibrator == "percentile"
    assert q.input.static and not q.input.dynamic
    assert any(n.endswith("o_proj") for n in plan.skipped) and "lm_head" in plan.skipped
    assert plan.needs_calibration and plan.passes == 1
    json.dumps(plan.to_dict())  # recordable


def test_overriding_every_module_to_none_makes_static_recipe_need_no_data():
    plan = build_plan(tiny("llama"), Recipe(act_granularity="tensor", overrides={"*": "none"}))
    assert plan.modules == [] and not plan.facts.static_inputs


def test_result_carries_its_recipe_and_plan_and_save_records_it(tmp_path):
    model, recipe = tiny("llama"), Recipe(format="e4m3", act_granularity="token")
    result = quantize_model(model, recipe)
    assert result.recipe is recipe and result.plan.recipe is recipe
    assert [r.name for r in result.modules] == [m.name for m in result.plan.gemms]
    save_quantized(result, tmp_path / "c")
    meta = json.loads((tmp_path / "c" / "fp8ptq.json").read_text())
    assert meta["recipe"]["act_granularity"] == "token"


def test_registry_entries_carry_kind_and_options_and_drive_validation():
    assert registry.activation_entry("best").layer_aware
    assert registry.activation_entry("pow2-search").options == {
        "pow2_range": registry.activation_entry("pow2-search").options["pow2_range"]}
    assert not registry.activation_entry("percentile").layer_aware
    assert registry.statistics_entry("pow2-search").name == "max"
    assert registry.activation_entry("percentile").build(percentile=50.0,
                                                          pow2_range=(1, 2)).percentile == 50.0
    assert set(registry.names("activation", registry.LAYER_AWARE)) == {"best", "pow2-search"}
    with pytest.raises(UsageError, match="act_calib must be one of"):
        Recipe(act_granularity="tensor", act_calib="kl")
    with pytest.raises(UsageError, match="layer-aware"):
        registry.activation_entry("best").build()


def test_choose_layerwise_dispatches_by_entry_and_a_new_layer_aware_entry_runs(monkeypatch):
    calls = []

    def choose(model, targets, *args):
        calls.append([t.name for t in targets])
        return {}

    entry = registry.CalibratorEntry("probe", "activation", registry.LAYER_AWARE, choose=choose,
                                     fallback="max")
    monkeypatch.setitem(registry._REGISTRY["activation"], "probe", entry)
    model = tiny("llama")
    recipe = Recipe(act_granularity="tensor", act_calib="probe")
    plan = build_plan(model, recipe)
    samples = {m.name: torch.zeros(1) for m in plan.gemms}
    choose_layerwise(model, plan.gemms, {}, samples, recipe, None, None, [])
    assert calls == [[m.name for m in plan.gemms]]
    with pytest.raises(ValueError, match="not a layer-aware"):
        choose_layerwise(model, plan.gemms, {}, samples, Recipe(act_granularity="tensor",
                                                                act_calib="max"), None, None, [])


def test_cli_token_activations_with_bn_retune_read_the_calibration_data(tmp_path):
    """``--act-granularity token --bn-retune --calib-data F`` used to skip F (the job's own
    needs-calibration rule ignored BN re-tuning) and then fail for want of data."""
    model_file = tmp_path / "cnn.pt"
    torch.save(TinyMobileNet(num_classes=10, in_channels=1, width=16).eval(), model_file)
    res = invoke([
        "quantize", str(model_file), "--calib-data", "digits", "--act-granularity", "token",
        "--bn-retune", "--num-samples", "32", "--batch-size", "16", "--dtype", "float32",
        "-o", str(tmp_path / "q"), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["calibration"]["source"] == "digits"
    assert report["calibration"]["num_samples"] == 32


def test_quantize_model_batches_feed_token_dynamic_smoothquant():
    model = tiny("llama")
    batches = list(token_batches(IDS, 2))
    result = quantize_model(model, Recipe(act_granularity="token", smoothquant=0.5), batches)
    assert "smoothquant" in result.extras and result.plan.passes == 2


def test_overrides_are_partial_plans_and_the_short_form_keeps_working():
    model = tiny("llama")
    recipe = Recipe(act_granularity="tensor",
                    format="e4m3", overrides={"*.mlp.*": {"act_format": "none"},
                                              "*.self_attn.q_proj": {"weight_format": "e5m2"},
                                              "*.self_attn.k_proj": "int8",
                                              "*.self_attn.v_proj": {"weight_format": "none"}})
    plan = {m.name.split(".", 3)[-1]: m for m in build_plan(model, recipe).modules}
    down = plan["mlp.down_proj"]
    assert down.weight.format.name == "e4m3" and down.input is None  # weight-only there
    q = plan["self_attn.q_proj"]
    assert q.weight.format.name == "e5m2" and q.input.format.name == "e4m3"
    k = plan["self_attn.k_proj"]
    assert k.weight.format.name == "int8" and k.input.format.name == "int8"
    assert "self_attn.v_proj" not in plan
    assert Recipe.from_dict(recipe.to_dict()) == recipe  # records and reloads as given
    with pytest.raises(UsageError, match="partial plans with keys"):
        Recipe(act_granularity="tensor", overrides={"x": {"granularity": "tensor"}})
    with pytest.raises(UsageError, match="override x=e9m9"):
        Recipe(act_granularity="tensor", overrides={"x": {"act_format": "e9m9"}})


def test_default_recipe_is_dynamic_per_token_and_static_on_convolutions():
    """The default (FP8_DYNAMIC) on a CNN: per-token scales need a token axis, so the
    convolutions get static per-tensor input scales and the linear head dynamic per-token
    ones; an explicit --act-granularity is what every module gets."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 6 * 6, 10))
    plan = build_plan(model, Recipe())
    got = {m.name: (m.input.granularity, m.input.static) for m in plan.gemms}
    assert got == {"0": ("tensor", True), "3": ("token", False)}
    assert plan.needs_calibration and Recipe().weight_calib == "max"
    assert Recipe(calib_data="c.txt").weight_calib == "gptq"
    assert Recipe(calib_data="c.txt", scheme="fp8-dynamic").weight_calib == "max"
    explicit = build_plan(model, Recipe(act_granularity="token"))
    assert {m.input.granularity for m in explicit.gemms} == {"token"}
    assert not build_plan(tiny("llama"), Recipe()).needs_calibration
