"""One plan per run: ``fp8ptq.quantize`` makes the plan once (``RunPlan``) and hands it down,
whichever path runs; a plan made on a checkpoint's meta-device model is re-bound by name to the
model loaded or streamed from it; ``--rotate`` keeps the plan the in-memory run was given."""

import pytest
import torch

import fp8ptq
from fp8ptq.config import plan as plan_module
from fp8ptq.config.plan import build_plan
from fp8ptq.config.recipe import Recipe
from fp8ptq.errors import UsageError
from fp8ptq.execution import in_memory, job, model_free, quantize, strategy, streaming
from fp8ptq.execution.in_memory import quantize_model, token_batches
from fp8ptq.io.weights import build_empty
from tiny_models import IDS, tiny


@pytest.fixture
def src(tmp_path, word_tokenizer):
    folder = tmp_path / "src"
    tiny("llama", num_hidden_layers=3).save_pretrained(folder)
    word_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def plans(monkeypatch):
    """Every plan made, wherever ``build_plan`` is called from."""
    made = []

    def counted(model, recipe):
        made.append(build_plan(model, recipe))
        return made[-1]

    for module in (plan_module, quantize, strategy, model_free, streaming, job, in_memory):
        if hasattr(module, "build_plan"):
            monkeypatch.setattr(module, "build_plan", counted)
    return made


@pytest.mark.parametrize("options, path", [
    (dict(recipe={"act_format": "none", "weight_calib": "max"}), "model-free"),
    (dict(recipe={"act_granularity": "tensor"}, sequential=True, propagate="fp"),
     "sequential"),
    (dict(recipe={"act_granularity": "tensor"}, max_memory=8 * 10**9),
     "in-memory"),  # the estimate's meta plan, re-bound to the loaded model
    (dict(recipe={"act_granularity": "tensor"}), "in-memory"),
])
def test_a_run_plans_once(src, calib, tmp_path, plans, options, path):
    options = dict(options)
    recipe = {**options.pop("recipe"), "calib_data": str(calib), "num_samples": 4,
              "seq_len": 16}
    report = fp8ptq.quantize(str(src), recipe, tmp_path / "out", **options)
    assert report["path"] == path
    assert len(plans) == 1, [type(p) for p in plans]


def test_a_meta_plan_rebinds_to_the_loaded_model(src):
    recipe = Recipe(act_granularity="tensor")
    meta = build_empty(src, torch.float32)
    run = quantize.RunPlan(recipe)
    plan = run(meta)
    assert all(m.module.weight.is_meta for m in plan.modules)
    loaded = tiny("llama", num_hidden_layers=3)
    assert run(loaded) is plan and run.built == 1
    assert all(m.module is loaded.get_submodule(m.name) for m in plan.modules)
    assert plan.to_dict() == build_plan(loaded, recipe).to_dict()
    assert run(loaded, recipe.merged(skip=["*.q_proj"])) is not plan  # another recipe
    with pytest.raises(UsageError, match="the plan names"):
        plan.rebind(torch.nn.Linear(2, 2))


def test_rotation_keeps_the_plan_it_was_given():
    batches = list(token_batches(IDS, 4))
    recipe = Recipe(format="e4m3", act_format="none", dtype="float32", rotate="hadamard")
    model = tiny("llama").float()
    given = build_plan(model, recipe)
    result = quantize_model(model, recipe, batches, plan=given)
    assert result.plan is given and result.extras["rotation"]["method"] == "hadamard"
    reference = tiny("llama").float()
    expected = quantize_model(reference, recipe, batches)  # planned after the rotation
    assert given.to_dict() == expected.plan.to_dict()
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS).logits, reference(input_ids=IDS).logits)


def test_a_block_part_names_modules_relative_to_it():
    model = tiny("llama", num_hidden_layers=2)
    plan = build_plan(model, Recipe())
    part = plan.part(lambda n: n.startswith("model.layers.1."), "model.layers.1.")
    assert part.modules and all(not m.name.startswith("model.") for m in part.modules)
    block = model.get_submodule("model.layers.1")
    assert all(m.module is block.get_submodule(m.name) for m in part.modules)
    assert plan.modules[0].name.startswith("model.")  # the whole plan is left as it was
