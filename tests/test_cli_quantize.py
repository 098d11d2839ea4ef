"""``fp8ptq quantize`` through click's CliRunner on a tiny Llama folder: checkpoints and their
round trip, --json, granularity flags, skip/override/recipe handling, errors, the report table;
and one real process for ``python -m fp8ptq.cli`` and the ``fp8ptq`` script."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

import fp8ptq
from fp8ptq.checkpoint import read_metadata
from fp8ptq.config.plan import needs_calibration
from fp8ptq.config.recipe import Recipe
from fp8ptq.execution import job
from fp8ptq.io.data import token_sha256
from tiny_models import STATIC, STATIC_RECIPE, invoke, tiny

DOCS = ["the quick brown fox jumps over the lazy dog", "a small model reads a few words of text",
        "hello world and hello again"] * 10
CALIB = ["--num-samples", "4", "--seq-len", "16", *STATIC]  # the static recipe, pinned
LAYER0 = [f"model.layers.0.{m}" for m in ("self_attn.q_proj", "self_attn.k_proj",
                                          "self_attn.v_proj", "self_attn.o_proj",
                                          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]


@pytest.fixture(scope="module")
def assets(tmp_path_factory, word_tokenizer):
    """A tiny Llama saved with save_pretrained (+ tokenizer), calibration .txt and .jsonl."""
    root = tmp_path_factory.mktemp("quantize-cli")
    model = root / "llama"
    tiny("llama").save_pretrained(model)
    word_tokenizer.save_pretrained(model)
    (root / "calib.txt").write_text("\n".join(DOCS) + "\n")
    (root / "calib.jsonl").write_text("".join(json.dumps({"id": i, "body": d}) + "\n"
                                              for i, d in enumerate(DOCS)))
    return root


def quantize(model, out, *args, env=None):
    return invoke(["quantize", str(model), "-o", str(out), *args], env=env)


def quantize_json(assets, out, *args):
    res = quantize(assets / "llama", out, "--calib-data", str(assets / "calib.txt"), *CALIB,
                   *args, "--json")
    assert res.exit_code == 0, (res.output, res.exception)
    return json.loads(res.stdout)  # the whole of stdout is one JSON document


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


def in_memory(model_dir, recipe):
    """The same model quantized in this process, through the library calls the CLI makes."""
    loaded = job.load(str(model_dir), recipe)
    calib = job.calibration_set(loaded, recipe) if needs_calibration(recipe) else None
    job.quantize_loaded(loaded, recipe, calib)
    return loaded.model, calib


def tensors(out) -> dict[str, torch.Tensor]:
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


IDS = torch.randint(2, 20, (2, 12), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("fmt,layout,weight_key,dtype", [
    ("e4m3", "compressed-tensors", "weight", torch.float8_e4m3fn),
    ("int8", "compressed-tensors", "weight", torch.int8),
    ("e5m2", "fp8ptq-native", "weight_codes", torch.uint8),
    ("hif8", "fp8ptq-native", "weight_codes", torch.uint8),
    ("hfp8", "fp8ptq-native", "weight_codes", torch.uint8),
])
def test_checkpoint_reloads_to_the_in_memory_logits(assets, tmp_path, fmt, layout, weight_key,
                                                    dtype):
    out = tmp_path / "out"
    report = quantize_json(assets, out, "--format", fmt)
    recipe = Recipe(format=fmt, calib_data=str(assets / "calib.txt"), num_samples=4, seq_len=16,
                    **STATIC_RECIPE)
    meta = read_metadata(out)
    assert meta["layout"] == layout and meta["recipe"] == recipe.to_dict()
    t = tensors(out)
    assert t[f"model.layers.1.mlp.down_proj.{weight_key}"].dtype == dtype
    assert t["model.layers.1.mlp.down_proj.weight_scale"].shape == (64, 1)  # channel default
    assert t["model.layers.1.mlp.down_proj.input_scale"].shape == (1,)
    assert t["lm_head.weight"].dtype == torch.bfloat16  # skipped, in the model dtype
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    if layout == "compressed-tensors":
        assert qcfg["quant_method"] == "compressed-tensors" and qcfg["ignore"] == ["lm_head"]
        assert qcfg["format"] == ("float-quantized" if fmt == "e4m3" else "int-quantized")
    else:
        assert qcfg["quant_method"] == "fp8ptq"
        assert {m["weight_format"]["name"] for m in meta["modules"].values()} == {fmt}

    expected_model, calib = in_memory(assets / "llama", recipe)
    reloaded = fp8ptq.load(out)
    assert reloaded.kind == "fp8ptq" and reloaded.tokenizer is not None
    assert torch.equal(logits(reloaded.model, IDS), logits(expected_model, IDS))
    assert report["calibration"]["sha256"] == token_sha256(calib.input_ids) == calib.sha256
    assert report["calibration"]["num_tokens"] == calib.num_tokens


def test_json_report(assets, tmp_path):
    out = tmp_path / "out"
    res = quantize(assets / "llama", out, "--calib-data", str(assets / "calib.txt"), *CALIB,
                   "--json")
    assert res.exit_code == 0, res.output
    assert res.stdout.lstrip().startswith("{") and res.stdout.rstrip().endswith("}")
    report = json.loads(res.stdout)
    assert "calibrating" not in res.stderr and "Loading weights" not in res.stderr
    assert len(report["modules"]) == 14 and report["skipped"] == ["lm_head"]
    m = {r["name"]: r for r in report["modules"]}["model.layers.1.mlp.down_proj"]
    assert m["weight_format"] == m["act_format"] == "e4m3"
    assert 0 < m["weight_scale_min"] <= m["weight_scale_max"]
    assert m["input_scale"] == pytest.approx(m["input_amax"] / 448, rel=1e-6)
    assert m["weight_sqnr_db"] > 20 and m["input_sqnr_db"] > 20
    sizes = report["sizes"]
    assert 0 < sizes["checkpoint_bytes"] < sizes["original_bytes"]
    assert sizes["checkpoint_bytes"] == (out / "model.safetensors").stat().st_size
    assert {"load", "calibrate", "quantize", "write"} <= set(report["seconds"])
    calib = report["calibration"]
    assert calib["source"] == str(assets / "calib.txt") and len(calib["sha256"]) == 64
    assert (calib["num_samples"], calib["seq_len"]) == (4, 16) and calib["num_tokens"] > 64
    meta = read_metadata(out)
    assert meta["calibration"] == calib and set(meta["recipe"]) == set(Recipe().to_dict())


@pytest.mark.parametrize("path", [[], ["--sequential"]])
def test_calib_prefix_token_opens_the_calibration_windows(assets, tmp_path, word_tokenizer,
                                                          path):
    """``--calib-prefix-token`` chooses what each document window opens with, in memory and on
    the one-block path alike: ``auto`` the evaluation's own choice (this BOS-less tokenizer's
    EOS), ``none`` nothing; recorded in the report and the checkpoint's recipe; moot under
    random windows."""
    eos = word_tokenizer.eos_token_id
    for choice, want in (("auto", [eos]), ("none", [])):
        out = tmp_path / f"{choice}{len(path)}"
        report = quantize_json(assets, out, "--calib-windows", "documents",
                               "--calib-prefix-token", choice, *path)
        assert report["calibration"]["start_ids"] == want
        assert read_metadata(out)["recipe"]["calib_prefix_token"] == choice
    res = quantize(assets / "llama", tmp_path / "r", "--calib-data", str(assets / "calib.txt"),
                   *CALIB, "--calib-windows", "random", "--calib-prefix-token", "eos")
    assert res.exit_code != 0 and "calib-prefix-token" in res.output


def test_jsonl_text_field_gives_the_same_tokens_as_the_txt(assets, tmp_path):
    many = ["--num-samples", "40"]  # 40 x 16 tokens > the ~250 of the data: windows overlap
    txt = quantize_json(assets, tmp_path / "a", *many)
    jsonl = quantize_json(assets, tmp_path / "b", "--calib-data", str(assets / "calib.jsonl"),
                          "--text-field", "body", *many)
    assert jsonl["calibration"]["source"].endswith("calib.jsonl")
    assert jsonl["calibration"]["sha256"] == txt["calibration"]["sha256"]
    meta = read_metadata(tmp_path / "b")
    assert meta["recipe"]["text_field"] == "body"
    # the data warning is reported (JSON, fp8ptq.json), not printed as a Python warning
    assert any("windows will overlap" in w for w in jsonl["warnings"])
    assert meta["warnings"] == jsonl["warnings"]


def test_granularity_flags_set_the_scale_shapes(assets, tmp_path):
    # block 48 does not divide 64/128: partial tiles round up
    quantize_json(assets, tmp_path / "block", "--weight-granularity", "block", "--block-size", "48")
    t = tensors(tmp_path / "block")
    assert t["model.layers.0.self_attn.q_proj.weight_scale"].shape == (2, 2)  # [64, 64]
    assert t["model.layers.0.mlp.gate_proj.weight_scale"].shape == (3, 2)  # [128, 64]
    assert t["model.layers.0.mlp.down_proj.weight_scale"].shape == (2, 3)  # [64, 128]
    group = json.loads((tmp_path / "block/config.json").read_text())["quantization_config"][
        "config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "block"
    assert group["weights"]["block_structure"] == [48, 48]

    report = quantize_json(assets, tmp_path / "tok", "--weight-granularity", "tensor",
                           "--act-granularity", "token")
    t = tensors(tmp_path / "tok")
    assert t["model.layers.0.mlp.down_proj.weight_scale"].shape == (1,)
    assert not any(k.endswith("input_scale") for k in t)  # dynamic: nothing calibrated
    assert report["calibration"] is None
    assert all(m["input_scale"] is None for m in report["modules"])
    group = json.loads((tmp_path / "tok/config.json").read_text())["quantization_config"][
        "config_groups"]["group_0"]
    assert group["input_activations"]["strategy"] == "token"
    assert group["input_activations"]["dynamic"] is True


def test_skip_override_and_lm_head(assets, tmp_path):
    out = tmp_path / "out"
    report = quantize_json(assets, out, "--skip", "model.layers.0.*", "--quantize-lm-head",
                           "--override", "*.down_proj=e5m2", "--override", " *.o_proj = none")
    formats = {m["name"]: m["weight_format"] for m in report["modules"]}
    assert sorted(report["skipped"]) == sorted(LAYER0 + ["model.layers.1.self_attn.o_proj"])
    assert formats.pop("model.layers.1.mlp.down_proj") == "e5m2"
    assert formats.pop("lm_head") == "e4m3"
    assert set(formats.values()) == {"e4m3"} and len(formats) == 5
    meta = read_metadata(out)
    assert meta["layout"] == "fp8ptq-native"  # e5m2 beside e4m3
    assert meta["recipe"]["overrides"] == {"*.down_proj": "e5m2", "*.o_proj": "none"}
    t = tensors(out)
    assert t["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.0.mlp.down_proj.weight_scale" not in t
    assert t["model.layers.1.self_attn.o_proj.weight"].dtype == torch.bfloat16
    assert t["lm_head.weight_codes"].dtype == torch.uint8
    assert torch.isfinite(logits(fp8ptq.load(out).model, IDS)).all()


def test_recipe_file_flags_override_it_and_an_output_reproduces_it(assets, tmp_path):
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump({
        "format": "e5m2", "weight_granularity": "tensor", "act_calib": "percentile",
        "percentile": 99.9, "skip": "model.layers.1.mlp.*",  # a bare glob, not a list
        "calib_data": str(assets / "calib.txt"), "num_samples": 4, "seq_len": 16}))
    res = quantize(assets / "llama", tmp_path / "a", "--recipe", str(recipe_file),
                   "--format", "e4m3", "--percentile", "99.5", "--json")
    assert res.exit_code == 0, res.output
    first = read_metadata(tmp_path / "a")
    recipe = first["recipe"]
    assert (recipe["format"], recipe["percentile"]) == ("e4m3", 99.5)  # flags win
    assert (recipe["weight_granularity"], recipe["act_calib"]) == ("tensor", "percentile")
    assert recipe["skip"] == ["model.layers.1.mlp.*"] and recipe["num_samples"] == 4
    assert {"model.layers.1.mlp.up_proj", "lm_head"} <= set(first["skipped"])

    res = quantize(assets / "llama", tmp_path / "b", "--recipe", str(tmp_path / "a"), "--json")
    assert res.exit_code == 0, res.output
    second = read_metadata(tmp_path / "b")
    assert second["recipe"] == recipe and second["calibration"] == first["calibration"]
    a, b = tensors(tmp_path / "a"), tensors(tmp_path / "b")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


# Each setup returns (MODEL, extra args) for one failing run.
def _existing_output(tmp, assets):
    (tmp / "out").mkdir()
    (tmp / "out" / "keep.txt").write_text("mine")
    return assets / "llama", []


def _nan_model(tmp, assets):
    model = tiny("llama")
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[3, 5] = math.nan
    model.save_pretrained(tmp / "nan-model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(assets / "llama" / name, tmp / "nan-model")
    return tmp / "nan-model", []


def _file(name, text, flag="--calib-data"):
    def make(tmp, assets):
        (tmp / name).write_text(text)
        return assets / "llama", [flag, str(tmp / name)]
    return make


def _args(*args, model=None):
    return lambda tmp, assets: (model or assets / "llama", list(args))


ERRORS = {
    "unknown format": (2, _args("--format", "nope"), "unknown format 'nope'"),
    "unknown override format": (2, _args("--override", "*.o_proj=e9m9"), "override *.o_proj"),
    "missing model": (2, _args(model="./no/such-model"), "no such file or folder"),
    "missing calib": (2, _args("--calib-data", "/no/such/calib.txt"), "not found"),
    "empty calib": (2, _file("empty.txt", "\n\n  \n"), "no text in calibration data"),
    "short calib": (2, _file("short.txt", "hello world\n"), "too short"),
    "bad override": (2, _args("--override", "*.o_proj"), "--override expects PATTERN=FORMAT"),
    "percentile 0": (2, _args("--percentile", "0"), "percentile must be in (0, 100]"),
    "bad device": (2, _args("--device", "gpu0"), "unknown device 'gpu0'"),
    "recipe type": (2, _file("r.yaml", "num_samples: many\n", "--recipe"),
                    "num_samples must be an integer"),
    "existing output": (2, _existing_output, "already exists (use --force"),
    "nan weight": (1, _nan_model, "model.layers.0.mlp.down_proj"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors_exit_with_one_line_and_leave_nothing(assets, tmp_path, case):
    code, setup, message = ERRORS[case]
    model, args = setup(tmp_path, assets)
    before = sorted(os.listdir(tmp_path))
    res = quantize(model, tmp_path / "out", "--calib-data", str(assets / "calib.txt"), *CALIB,
                   *args, "--json")
    assert res.exit_code == code, (res.output, res.exception)
    assert res.stdout == ""
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], res.stderr
    assert "Traceback" not in res.stderr
    assert sorted(os.listdir(tmp_path)) == before  # no output, no .tmp-* leftovers
    if case == "existing output":
        assert os.listdir(tmp_path / "out") == ["keep.txt"]


def test_force_replaces_an_existing_output(assets, tmp_path):
    _existing_output(tmp_path, assets)
    res = quantize(assets / "llama", tmp_path / "out", "--calib-data",
                   str(assets / "calib.txt"), *CALIB, "--force", "--json")
    assert res.exit_code == 0, res.output
    assert not (tmp_path / "out" / "keep.txt").exists()
    assert read_metadata(tmp_path / "out")["layout"] == "compressed-tensors"
    assert not list(tmp_path.glob(".*fp8ptq-tmp*"))


@pytest.mark.parametrize("columns", [80, 200])
def test_report_table_shows_module_names(assets, tmp_path, columns):
    res = quantize(assets / "llama", tmp_path / "out", "--calib-data", str(assets / "calib.txt"),
                   *CALIB, env={"COLUMNS": str(columns)})
    assert res.exit_code == 0, res.output
    text = res.stdout
    assert "…" not in text and max(map(len, text.splitlines())) <= columns
    assert "quantized 14 modules" in text and "kept in high precision: lm_head" in text
    if columns == 80:  # the layer stack's prefix is cut, and said so in the title
        assert "N.name = model.layers.N.name" in text
        assert " 1.mlp.down_proj " in text and " 0.self_attn.q_proj " in text
    else:
        assert " model.layers.1.mlp.down_proj " in text and "A amax" in text
    assert "checkpoint" in text and "KiB vs original" in text


@pytest.mark.slow
def test_real_processes(assets, tmp_path):
    """``python -m fp8ptq.cli`` and the installed ``fp8ptq`` script, run side by side (each
    process pays the torch/transformers import)."""
    # the script installed beside this interpreter (a venv's own), else the one on PATH
    beside = Path(sys.executable).parent / "fp8ptq"
    script = str(beside) if beside.is_file() else shutil.which("fp8ptq")
    common = [str(assets / "llama"), "--calib-data", str(assets / "calib.txt"), *CALIB]
    env = {**os.environ, "COLUMNS": "100"}
    runs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env)
            for cmd in ([sys.executable, "-m", "fp8ptq.cli", "quantize", *common, "-o",
                         str(tmp_path / "a"), "--json"],
                        [script, "quantize", *common, "-o", str(tmp_path / "b"), "--format",
                         "int8"])]
    (out_a, err_a), (out_b, err_b) = (p.communicate(timeout=300) for p in runs)
    assert runs[0].returncode == 0, err_a
    report = json.loads(out_a)
    assert len(report["modules"]) == 14 and report["sizes"]["layout"] == "compressed-tensors"
    assert runs[1].returncode == 0, err_b
    assert "quantized 14 modules" in out_b and "int8" in out_b
    assert read_metadata(tmp_path / "b")["recipe"]["format"] == "int8"


@pytest.mark.parametrize("args, fragment", [
    ([], "Missing argument 'MODEL'"),
    (["m", "-o", "x", "--weight-granularity", "rows"], "'--weight-granularity'"),
    (["m", "-o", "x", "--num-samples", "many"], "'--num-samples'"),
])
def test_click_usage_errors_are_one_error_line(args, fragment):
    result = invoke(["quantize", *args])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0]


def test_rotate_flag_is_recorded_and_the_checkpoint_reloads(assets, tmp_path):
    """--rotate hadamard through the CLI: recorded in fp8ptq.json, lm_head untied in the
    written config, and the checkpoint reloads as a standard Llama."""
    out = tmp_path / "rot"
    report = quantize_json(assets, out, "--rotate", "hadamard", "--dtype", "float32")
    assert report["rotation"]["kind"].startswith("random Hadamard")
    meta = read_metadata(out)
    assert meta["recipe"]["rotate"] == "hadamard"
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert fp8ptq.load(out).model.config.model_type == "llama"


def test_the_default_recipe_is_fp8_dynamic_with_sequential_gptq(assets, tmp_path):
    """No recipe flags: channel weights + dynamic per-token activations (FP8_DYNAMIC) with GPTQ
    (sequential, act-order) when calibration data is given; plain FP8_DYNAMIC, which reads no
    data (so the model-free path takes it), when none is."""
    sizes = ["--num-samples", "4", "--seq-len", "16"]
    with_data = json.loads(quantize(assets / "llama", tmp_path / "a", "--calib-data",
                                    str(assets / "calib.txt"), *sizes, "--json").stdout)
    recipe = read_metadata(tmp_path / "a")["recipe"]
    assert (recipe["act_granularity"], recipe["weight_granularity"]) == ("token", "channel")
    assert recipe["weight_calib"] == "gptq" and recipe["gptq_act_order"]
    assert recipe["gptq_sequential"] and with_data["gptq"]["sequential"]["blocks"] == 2
    assert not any(k.endswith("input_scale") for k in tensors(tmp_path / "a"))
    group = json.loads((tmp_path / "a/config.json").read_text())["quantization_config"][
        "config_groups"]["group_0"]
    assert group["input_activations"] == {**group["input_activations"], "strategy": "token",
                                          "dynamic": True}
    assert group["weights"]["strategy"] == "channel"
    expected = Recipe(calib_data=str(assets / "calib.txt"), num_samples=4, seq_len=16)
    model, _ = in_memory(assets / "llama", expected)
    assert torch.equal(logits(fp8ptq.load(tmp_path / "a").model, IDS), logits(model, IDS))

    no_data = json.loads(quantize(assets / "llama", tmp_path / "b", *sizes, "--json").stdout)
    recipe = read_metadata(tmp_path / "b")["recipe"]
    assert (recipe["act_granularity"], recipe["weight_calib"]) == ("token", "max")
    assert no_data["path"] == "model-free" and no_data["calibration"] is None


def test_calib_windows_documents(assets, tmp_path):
    """``--calib-windows documents`` calibrates on windows that open documents (recorded), and
    the checkpoint equals the library run with the same recipe field."""
    out = tmp_path / "out"
    report = quantize_json(assets, out, "--calib-windows", "documents")
    recipe = Recipe(format="e4m3", calib_data=str(assets / "calib.txt"), num_samples=4,
                    seq_len=16, calib_windows="documents", **STATIC_RECIPE)
    expected_model, calib = in_memory(assets / "llama", recipe)
    assert calib.windows == report["calibration"]["windows"] == "documents"
    assert report["calibration"]["sha256"] == calib.sha256
    assert read_metadata(out)["recipe"]["calib_windows"] == "documents"
    assert torch.equal(logits(fp8ptq.load(out).model, IDS), logits(expected_model, IDS))
    random = quantize_json(assets, tmp_path / "random", "--calib-windows", "random")
    assert random["calibration"]["windows"] == "random"
    assert random["calibration"]["sha256"] != calib.sha256
