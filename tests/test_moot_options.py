"""Options the resolved recipe makes moot: named in one ``warning:`` line and in ``fp8ptq.json``
(``moot_options``), refused where the command line names both the option and what makes it
moot; options that take effect stay silent."""

import json

import pytest

from fp8ptq.config.moot import moot_options
from fp8ptq.config.recipe import Recipe
from tiny_models import invoke, saved_llama_with_calib

# recipe fields -> the fields moot under them (the recipe-level table)
TABLE = [
    ({"act_calib": "best"}, {"act_calib"}),  # default dynamic per-token activations
    ({"act_calib": "best", "act_granularity": "tensor"}, set()),
    ({"act_calib": "mse", "act_format": "none"}, {"act_calib"}),  # weight-only
    ({"act_calib": "mse", "act_format": "none", "quantize_attention": True}, set()),  # taps
    ({"act_calib": "mse", "format": "mxfp8"}, {"act_calib"}),  # MX inputs are dynamic
    ({"percentile": 99.9}, {"percentile"}),  # default max calibrator
    ({"percentile": 99.9, "act_calib": "percentile"}, {"act_calib", "percentile"}),  # dynamic
    ({"percentile": 99.9, "act_calib": "percentile", "act_granularity": "tensor"}, set()),
    ({"percentile": 99.9, "act_calib": "best", "act_granularity": "tensor"}, set()),
    ({"pow2_range": (-2, 2), "act_calib": "mse", "act_granularity": "tensor"}, {"pow2_range"}),
    ({"pow2_range": (-2, 2), "act_calib": "pow2-search", "act_granularity": "tensor"}, set()),
    ({"gptq_damp": 0.05}, {"gptq_damp"}),  # no calibration data: round to nearest
    ({"gptq_damp": 0.05, "calib_data": "c.txt"}, set()),  # GPTQ by default with data
    ({"gptq_damp": 0.05, "gptq_act_order": False, "gptq_sequential": False,
      "weight_calib": "mse"}, {"gptq_damp", "gptq_act_order", "gptq_sequential"}),
    ({"gptq_block": 64, "weight_calib": "max", "overrides": {"*.o_proj": {
        "weight_calib": "gptq"}}}, set()),  # an override runs GPTQ
    ({"block_size": 64}, {"block_size"}),
    ({"block_size": 64, "weight_granularity": "block"}, set()),
    ({"act_group_size": 64}, {"act_group_size"}),
    ({"act_group_size": 64, "act_granularity": "group"}, set()),
    ({"gptq_sink_target": "float"}, {"gptq_sink_target"}),  # no calibration data: no GPTQ
    ({"gptq_sink_target": "float", "calib_data": "c.txt"}, set()),
    ({"gptq_sink_target": "float", "calib_data": "c.txt", "gptq_sink": 0.0},
     {"gptq_sink_target"}),
    ({"gptq_sink_target": "float", "calib_data": "c.txt", "gptq_asym": True},
     {"gptq_sink_target"}),
    ({"smoothquant_into": "all"}, {"smoothquant_into"}),
    ({"smoothquant_into": "all", "smoothquant": 0.5}, set()),
    ({}, set()),
    ({"percentile": 99.99, "block_size": 128}, set()),  # defaults: nothing was asked
]


@pytest.mark.parametrize("fields,moot", TABLE)
def test_moot_options_table(fields, moot):
    assert {m.field for m in moot_options(Recipe(**fields))} == moot


def test_convolutions_calibrate_their_inputs_by_default():
    """A convolution's default activations are static per tensor: the calibrator counts."""
    recipe = Recipe(act_calib="mse")
    assert {m.field for m in moot_options(recipe)} == {"act_calib"}
    assert moot_options(recipe, convolutions=True) == []
    assert moot_options(Recipe(act_calib="mse", act_granularity="token"),
                        convolutions=True)[0].field == "act_calib"


def test_a_scheme_s_own_fields_are_not_moot_options():
    recipe = Recipe(scheme="FP8_BLOCK")
    assert moot_options(recipe) == []


@pytest.fixture(scope="module")
def src(tmp_path_factory, word_tokenizer):
    return saved_llama_with_calib(tmp_path_factory.mktemp("moot"), word_tokenizer)


CALIB = ["--num-samples", "2", "--seq-len", "8", "--batch-size", "2"]  # max: no GPTQ sweep


# flags -> (exit code, the flags named in the warning line or the error)
CLI_TABLE = [
    (["--act-calib", "best"], 0, ["--act-calib best"]),
    (["--act-calib", "best", "--act-granularity", "tensor"], 0, []),
    (["--percentile", "99.9", "--block-size", "64"], 0, ["--percentile 99.9",
                                                         "--block-size 64"]),
    (["--act-granularity", "token", "--act-calib", "mse"], 2, ["--act-calib mse",
                                                               "--act-granularity token"]),
    (["--weight-calib", "max", "--gptq-damp", "0.05"], 2, ["--gptq-damp 0.05",
                                                           "--weight-calib max"]),
    (["--weight-calib", "gptq", "--gptq-sink", "0", "--gptq-sink-target", "float"], 2,
     ["--gptq-sink-target float", "--gptq-sink"]),
]


@pytest.mark.parametrize("flags,code,named", CLI_TABLE)
def test_quantize_names_moot_flags_once(src, tmp_path, flags, code, named):
    model, calib = src
    out = tmp_path / "out"
    res = invoke(["quantize", model, "-o", out, "--calib-data", calib, *CALIB,
                  "--weight-calib", "max", *flags])
    assert res.exit_code == code, res.output
    warnings = [ln for ln in res.stderr.splitlines() if ln.startswith("warning: options")]
    if code:
        error = res.stderr.strip().splitlines()[-1]
        assert error.startswith("error: ") and all(f in error for f in named), res.stderr
        assert not out.exists()
        return
    meta = json.loads((out / "fp8ptq.json").read_text())
    if not named:
        assert warnings == [] and meta["moot_options"] == {}, res.stderr
        return
    assert len(warnings) == 1 and all(f in warnings[0] for f in named), res.stderr
    fields = {f.split()[0][2:].replace("-", "_") for f in named}
    assert set(meta["moot_options"]) == fields


def _eval(model, calib, out):
    return ["eval", model, "--tasks", "wikitext", "--data", f"wikitext={calib}", "--compare",
            "e4m3", "--json", out, "--calib-data", calib, "--allow-calib-overlap",
            "--num-samples", "2", "--calib-seq-len", "8"]


def _sensitivity(model, calib, out):
    return ["sensitivity", model, "--calib-data", calib, "--metric", "sqnr", "--json", out,
            *CALIB]


# the other commands taking recipe flags: the same warning line, the same refusal
OTHER_COMMANDS = {"eval": _eval, "sensitivity": _sensitivity}


@pytest.mark.parametrize("command", [pytest.param("eval", marks=pytest.mark.slow),  # ~13 s
                                     "sensitivity"])
@pytest.mark.parametrize("flags,code,named", [CLI_TABLE[0], CLI_TABLE[1], CLI_TABLE[3]])
def test_eval_and_sensitivity_name_moot_flags_as_quantize_does(src, tmp_path, command, flags,
                                                               code, named):
    model, calib = src
    res = invoke([*OTHER_COMMANDS[command](model, calib, tmp_path / "r.json"), *flags])
    assert res.exit_code == code, res.output
    warnings = [ln for ln in res.stderr.splitlines() if ln.startswith("warning: options")]
    if code:
        error = res.stderr.strip().splitlines()[-1]
        assert error.startswith("error: ") and all(f in error for f in named), res.stderr
    elif named:
        assert len(warnings) == 1 and all(f in warnings[0] for f in named), res.stderr
    else:
        assert warnings == [], res.stderr


@pytest.mark.slow  # a quantize and two evaluations
def test_eval_of_a_checkpoint_names_only_the_flags_given(src, tmp_path):
    """eval of an fp8ptq checkpoint quantizes --compare formats with the checkpoint's own
    recipe: its moot options were named when it was made; eval names the flags given."""
    model, calib = src
    ck = tmp_path / "ck"
    made = invoke(["quantize", model, "-o", ck, "--calib-data", calib, *CALIB,
                   "--weight-calib", "max", "--act-calib", "best"])
    assert made.exit_code == 0 and "--act-calib best" in made.stderr, made.output
    plain = invoke(_eval(str(ck), calib, tmp_path / "a.json"))
    assert plain.exit_code == 0 and "warning: options" not in plain.stderr, plain.stderr
    given = invoke([*_eval(str(ck), calib, tmp_path / "b.json"), "--block-size", "64"])
    warnings = [ln for ln in given.stderr.splitlines() if ln.startswith("warning: options")]
    assert given.exit_code == 0 and len(warnings) == 1, given.output
    assert "--block-size 64" in warnings[0] and "--act-calib" not in warnings[0]
