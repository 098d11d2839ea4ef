"""``--scheme`` presets: each expands to the plan its peers' name means, explicit flags and
recipe keys override it, the name is recorded in fp8ptq.json and the report, and ``eval
--compare`` accepts scheme names."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from fp8ptq.checkpoint import read_metadata
from fp8ptq.cli.main import main
from fp8ptq.config.plan import build_plan
from fp8ptq.config.recipe import Recipe
from fp8ptq.config.schemes import SCHEMES, expand_scheme, get_scheme, scheme_flags
from fp8ptq.errors import UsageError
from fp8ptq.evals.compare import plan_variants
from tiny_models import tiny

# scheme -> (weight format, weight granularity, input format, input granularity, dynamic)
EXPECTED = {
    "fp8-static": ("e4m3", "tensor", "e4m3", "tensor", False),
    "fp8-dynamic": ("e4m3", "channel", "e4m3", "token", True),
    "fp8-block": ("e4m3", "block", "e4m3", "group", True),
    "mxfp8": ("mxfp8", "group", "mxfp8", "group", True),
    "mxfp8-e5m2": ("mxfp8-e5m2", "group", "mxfp8-e5m2", "group", True),
    "w8a16": ("e4m3", "channel", None, None, None),
    "hif8-pts": ("hif8", "tensor", "hif8", "tensor", False),
    "hif8-cast": ("hif8", "tensor", "hif8", "tensor", False),
}


def test_every_scheme_is_tested():
    assert set(EXPECTED) <= set(SCHEMES)
    assert not set(SCHEMES) - set(EXPECTED) - {n for n in SCHEMES if n.startswith("fp8ptq")}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_scheme_expands_to_its_plan(name):
    recipe = Recipe(scheme=name)
    assert recipe.scheme == name
    m = build_plan(tiny("llama"), recipe).gemms[0]
    w_fmt, w_gran, a_fmt, a_gran, dynamic = EXPECTED[name]
    assert (m.weight.format.name, m.weight.granularity) == (w_fmt, w_gran)
    if a_fmt is None:
        assert m.input is None
    else:
        assert (m.input.format.name, m.input.granularity, m.input.dynamic) == (
            a_fmt, a_gran, dynamic)


def test_scheme_details():
    assert Recipe(scheme="fp8-block").block_size == 128
    assert Recipe(scheme="fp8-block").act_group_size == 128
    assert Recipe(scheme="hif8-pts").act_calib == "pow2-search"
    r = Recipe(scheme="hif8-cast")
    assert (r.weight_calib, r.act_calib) == ("cast", "cast")
    assert scheme_flags("fp8-dynamic") == ["--format", "e4m3", "--weight-granularity", "channel",
                                           "--act-granularity", "token"]


def test_explicit_fields_override_the_preset_and_the_name_is_canonical():
    r = Recipe(scheme="FP8_DYNAMIC", weight_calib="gptq", format="hif8")
    assert (r.scheme, r.act_granularity, r.weight_calib, r.format) == (
        "fp8-dynamic", "token", "gptq", "hif8")
    # a full dict (what to_dict / fp8ptq.json give) round-trips unchanged
    assert Recipe.from_dict(r.to_dict()) == r
    # merged(): the scheme goes over the base recipe, the other flags over the scheme
    base = Recipe(act_calib="best", act_granularity="tensor", weight_granularity="tensor",
                  seed=7)
    m = base.merged(scheme="fp8-block", block_size=64)
    assert (m.weight_granularity, m.act_granularity, m.block_size, m.seed, m.act_calib) == (
        "block", "group", 64, 7, "max")  # the scheme pins its calibrator too


def test_unknown_scheme():
    with pytest.raises(UsageError, match="unknown scheme 'fp9'.*fp8-dynamic"):
        Recipe(scheme="fp9")
    with pytest.raises(UsageError):
        get_scheme("")


def test_recipe_file_with_a_scheme(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"scheme": "fp8-static", "act_calib": "best"}))
    r = Recipe.load(path)
    assert (r.weight_granularity, r.act_granularity, r.act_calib) == ("tensor", "tensor", "best")
    assert expand_scheme("fp8-static")["act_calib"] == "max"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, word_tokenizer):
    root = tmp_path_factory.mktemp("schemes")
    tiny("llama").save_pretrained(root / "llama")
    word_tokenizer.save_pretrained(root / "llama")
    (root / "calib.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    return root


def test_cli_scheme_recorded_and_printed(llama_dir, tmp_path):
    out = tmp_path / "q"
    res = CliRunner().invoke(main, ["quantize", str(llama_dir / "llama"), "-o", str(out),
                                    "--scheme", "fp8-dynamic", "--weight-calib", "mse"])
    assert res.exit_code == 0, res.output
    assert "scheme fp8-dynamic: --format e4m3 --weight-granularity channel " \
           "--act-granularity token" in " ".join(res.output.split())  # rich wraps at 80
    recipe = read_metadata(out)["recipe"]
    assert (recipe["scheme"], recipe["act_granularity"], recipe["weight_calib"]) == (
        "fp8-dynamic", "token", "mse")
    res = CliRunner().invoke(main, ["quantize", str(llama_dir / "llama"), "-o",
                                    str(tmp_path / "j"), "--scheme", "w8a16", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["scheme"]["name"] == "w8a16"
    # --recipe OUTPUT reproduces the scheme run
    res = CliRunner().invoke(main, ["quantize", str(llama_dir / "llama"), "-o",
                                    str(tmp_path / "again"), "--recipe", str(out)])
    assert res.exit_code == 0, res.output
    assert read_metadata(tmp_path / "again")["recipe"] == recipe


def test_cli_unknown_scheme_is_one_line(llama_dir, tmp_path):
    res = CliRunner().invoke(main, ["quantize", str(llama_dir / "llama"), "-o",
                                    str(tmp_path / "x"), "--scheme", "fp8-turbo"])
    assert res.exit_code == 2
    assert [line for line in res.output.splitlines() if line.startswith("error:")] == [
        "error: unknown scheme 'fp8-turbo'; valid: " + ", ".join(SCHEMES)]
    assert not (tmp_path / "x").exists()


def test_cli_schemes_command():
    res = CliRunner().invoke(main, ["schemes", "--json"])
    assert res.exit_code == 0
    rows = json.loads(res.stdout)
    assert [r["name"] for r in rows] == list(SCHEMES)
    assert next(r for r in rows if r["name"] == "fp8-block")["flags"][:2] == ["--format", "e4m3"]


def test_eval_compare_schemes(llama_dir):
    variants, _ = plan_variants(str(llama_dir / "llama"), None,
                                ["fp8-dynamic", "fp8-static", "FP8_BLOCK", "e4m3"],
                                Recipe(seed=3))
    names = [v.name for v in variants]
    assert names == ["baseline", "fp8-dynamic", "fp8-static", "fp8-block", "e4m3"]
    by = {v.name: v.recipe for v in variants}
    assert by["fp8-dynamic"].act_granularity == "token" and by["fp8-dynamic"].seed == 3
    assert by["fp8-static"].weight_granularity == "tensor"
    # the same recipe twice is evaluated once
    variants, _ = plan_variants(str(llama_dir / "llama"), None, ["e4m3", "fp8"], Recipe())
    assert [v.name for v in variants] == ["baseline", "e4m3"]
