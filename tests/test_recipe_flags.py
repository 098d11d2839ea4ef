"""A recipe field is one Recipe line: its flag (help text, name, choices) is declared with the
field (``fp8ptq.config.recipe.flag``) and the click option and ``build_recipe`` are derived from
it, so every recipe flag names a Recipe field (or is mapped in ``FIELD_OF``)."""

import click
from click.testing import CliRunner

from fp8ptq.cli.options import FIELD_OF, PARSE, build_recipe, recipe_options, recipe_params
from fp8ptq.config.recipe import Recipe, flag


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


class _Extended(Recipe):
    """A recipe with fields added in the Recipe alone: nothing in the CLI names them."""

    new_knob: int = flag(3, "A new knob [3].")
    new_mode: str = flag("a", "A new mode [a].", choices=("a", "b"))
    new_switch: bool = flag(False, "A new switch.")
    new_toggle: bool = flag(True, "A new toggle [on].", off="--no-new-toggle")
    new_globs: list[str] = flag(list, "A new glob (repeatable).")
    new_internal: int = 7  # no flag


def test_a_field_added_to_the_recipe_alone_gets_its_flag():
    seen = {}

    @click.command()
    @recipe_options(recipe_type=_Extended)
    def cmd(**flags):
        seen["recipe"] = build_recipe(flags, recipe_type=_Extended)
        seen["left"] = flags

    runner = CliRunner()
    help_text = " ".join(runner.invoke(cmd, ["--help"]).output.split())
    assert "--new-knob INTEGER A new knob [3]." in help_text
    assert "--new-mode [a|b] A new mode [a]." in help_text
    assert "--new-toggle / --no-new-toggle" in help_text and "--new-internal" not in help_text
    result = runner.invoke(cmd, ["--new-knob", "5", "--new-mode", "b", "--new-switch",
                                 "--no-new-toggle", "--new-globs", "x*", "--new-globs", "y*",
                                 "--seq-len", "64"])
    assert result.exit_code == 0, result.output
    r = seen["recipe"]
    assert (r.new_knob, r.new_mode, r.new_switch, r.new_toggle, r.new_globs, r.seq_len) == \
        (5, "b", True, False, ["x*", "y*"], 64)
    assert seen["left"] == {}
    assert runner.invoke(cmd, ["--new-mode", "c"]).exit_code == 2  # click checks the choices
    runner.invoke(cmd, [])
    assert seen["recipe"].new_knob == 3 and seen["recipe"].new_globs == []
    assert "new_knob" in recipe_params(_Extended) and "new_internal" not in \
        recipe_params(_Extended)
