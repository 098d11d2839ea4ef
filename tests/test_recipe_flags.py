"""A recipe field is one Recipe line plus one flag spec: ``build_recipe`` is derived from the
flag specs, so every recipe flag must name a Recipe field (or be mapped in ``FIELD_OF``)."""

import click
from click.testing import CliRunner

from fp8ptq.cli.options import FIELD_OF, PARSE, build_recipe, recipe_options, recipe_params
from fp8ptq.config.recipe import Recipe


def test_every_recipe_flag_names_a_recipe_field():
    fields = set(Recipe.model_fields)
    missing = [p for p in recipe_params() if FIELD_OF.get(p, p) not in fields]
    assert not missing, f"recipe flags without a Recipe field: {missing}"
    assert set(FIELD_OF) | set(PARSE) <= set(recipe_params())


def test_flags_reach_the_recipe_through_the_derived_builder():
    seen = {}

    @click.command()
    @recipe_options
    def cmd(**flags):
        seen["recipe"] = build_recipe(flags)
        seen["left"] = flags

    args = ["--calib-data", "c.txt", "--seq-len", "64", "--batch-size", "2", "--skip", "lm_*",
            "--override", "model.layers.0.*=e5m2", "--pow2-range", "-2,3", "--gptq-damp", "0.05",
            "--no-gptq-act-order"]
    result = CliRunner().invoke(cmd, args)
    assert result.exit_code == 0, result.output
    r = seen["recipe"]
    assert (r.calib_data, r.seq_len, r.batch_size, r.gptq_damp, r.gptq_act_order) == \
        ("c.txt", 64, 2, 0.05, False)
    assert r.skip == ["lm_*"] and r.pow2_range == (-2, 3)
    assert r.overrides == {"model.layers.0.*": {"format": "e5m2"}} or \
        r.overrides == {"model.layers.0.*": "e5m2"}
    assert seen["left"] == {}  # every recipe flag consumed
    assert Recipe().seq_len != 64 and Recipe().gptq_act_order is True
