"""``fp8ptq validate``: runtime rules (each violation one line naming module, rule and fix),
the reload comparison through transformers and fp8ptq.load, exit codes, and quantize's
``--runtime vllm`` refusing before anything is written."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp8ptq.checkpoint.validate import RULES, validate
from tiny_models import STATIC, invoke, tiny

DOCS = ["the quick brown fox jumps over the lazy dog", "hello world and hello again"]
CALIB = ["--num-samples", "4", "--seq-len", "8", "--batch-size", "2", *STATIC]


@pytest.fixture(scope="module")
def A(tmp_path_factory, word_tokenizer):
    root = tmp_path_factory.mktemp("validate")
    tiny("llama").save_pretrained(root / "llama")
    word_tokenizer.save_pretrained(root / "llama")
    (root / "calib.txt").write_text("\n".join(DOCS * 10) + "\n")
    return root


def quantize(A, out, *extra):
    res = invoke(["quantize", str(A / "llama"), "-o", str(out), "--calib-data",
                  str(A / "calib.txt"), *CALIB, *extra])
    return res


def test_every_rule_cites_its_source():
    assert all(r.source and r.runtime in ("vllm", "transformers") for r in RULES)


def test_default_e4m3_checkpoint_is_valid_and_reloads_identically(A, tmp_path):
    assert quantize(A, tmp_path / "ck").exit_code == 0
    res = invoke(["validate", str(tmp_path / "ck"), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["valid"] and report["reload"]["ok"]
    assert report["reload"]["max_abs_logit_diff"] == 0.0  # transformers computes what we do
    assert all(v["severity"] == "note" for v in report["violations"])
    assert report["peak_rss_mb"] > 0 and report["seconds"]["validate"] > 0
    text = invoke(["validate", str(tmp_path / "ck"), "--no-reload"])
    assert re.search(r"^time: validate \d+\.\ds; peak RSS \d+ MiB( in \w+)?$", text.stdout, re.M)


@pytest.mark.parametrize("extra,rule", [
    (["--format", "hif8"], "layout"),
    (["--weight-granularity", "block", "--block-size", "48"], "block-shape"),
    (["--weight-granularity", "block", "--block-size", "32"], "block-activations"),
])
def test_violations_exit_4_one_line_each(A, tmp_path, extra, rule):
    assert quantize(A, tmp_path / "ck", *extra).exit_code == 0
    res = invoke(["validate", str(tmp_path / "ck"), "--runtime", "vllm",
                  "--no-reload"])
    assert res.exit_code == 4, res.output
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("invalid")]
    assert any(f"[{rule}]" in ln and "fix:" in ln for ln in lines), res.stdout


def test_fused_shards_with_different_scales_are_flagged(A, tmp_path):
    assert quantize(A, tmp_path / "ck", "--weight-granularity", "tensor").exit_code == 0
    assert validate(tmp_path / "ck", ("vllm",), reload=False).valid
    f = tmp_path / "ck" / "model.safetensors"
    tensors = load_file(f)
    key = "model.layers.0.self_attn.k_proj.input_scale"
    tensors[key] = tensors[key] * 2
    save_file(tensors, f, metadata={"format": "pt"})
    report = validate(tmp_path / "ck", ("vllm",), reload=False)
    assert not report.valid
    assert any(v.rule == "fused-scales" and "--unify-fused-scales" in v.fix
               for v in report.violations)


def test_moe_reload_difference_is_measured_within_tolerance(tmp_path, word_tokenizer):
    """transformers does not quantize the inputs of fused experts: a real, small difference."""

    tiny("qwen2_moe").save_pretrained(tmp_path / "moe")
    word_tokenizer.save_pretrained(tmp_path / "moe")
    (tmp_path / "calib.txt").write_text("\n".join(DOCS * 10) + "\n")
    res = invoke(["quantize", str(tmp_path / "moe"), "-o", str(tmp_path / "ck"),
                  "--calib-data", str(tmp_path / "calib.txt"), *CALIB,
                  "--weight-granularity", "tensor"])
    assert res.exit_code == 0, res.output
    report = validate(tmp_path / "ck")
    assert 0 < report.reload["relative"] <= report.reload["tolerance"]
    assert report.valid, [v.line() for v in report.violations]


def test_quantize_runtime_vllm_refuses_before_writing(A, tmp_path):
    res = quantize(A, tmp_path / "ck", "--format", "e5m2", "--runtime", "vllm")
    assert res.exit_code == 4
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "vLLM would not serve" in errors[0]
    assert list(tmp_path.iterdir()) == []
    res = quantize(A, tmp_path / "warn", "--format", "e5m2", "--json")
    assert res.exit_code == 0
    assert any(w.startswith("vllm: checkpoint: [layout]")
               for w in json.loads(res.stdout)["warnings"])


def test_model_card_in_every_output_and_update_card(A, tmp_path):
    import yaml

    assert quantize(A, tmp_path / "ck", "--weight-granularity", "tensor").exit_code == 0
    card = (tmp_path / "ck" / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert {"fp8", "fp8ptq", "compressed-tensors"} <= set(front["tags"])
    assert front["library_name"] == "transformers"
    assert "e4m3/e4m3 tensor/tensor" in card and "vllm serve" in card
    assert "kept in high precision: `lm_head`" in card
    assert "fp8ptq quantize" in card and "Not evaluated yet" in card
    wiki = tmp_path / "wiki.raw"
    wiki.write_text(" = a = \n the quick brown fox . \n = b = \n hello world . \n")
    res = invoke(["eval", str(tmp_path / "ck"), "--tasks", "wikitext",
                  "--data", f"wikitext={wiki}", "--update-card"])
    assert res.exit_code == 0, res.output
    card = (tmp_path / "ck" / "README.md").read_text()
    assert "Not evaluated yet" not in card and "| baseline |" in card and "95% CI" in card
    assert card.count("<!-- fp8ptq:eval:begin -->") == 1
    res = invoke(["eval", str(A / "llama"), "--tasks", "wikitext", "--data",
                  f"wikitext={wiki}", "--update-card"])
    assert res.exit_code == 2 and "needs MODEL to be an fp8ptq checkpoint" in res.stderr


def _args(**kw):
    from compressed_tensors.quantization import QuantizationArgs

    dynamic = kw.pop("force_dynamic", None)  # a config compressed-tensors itself refuses
    q = QuantizationArgs(num_bits=8, **kw)
    return q if dynamic is None else q.model_copy(update={"dynamic": dynamic})


@pytest.mark.parametrize("w,a,scheme", [
    (dict(type="float", strategy="channel"), dict(type="float", strategy="tensor"),
     "CompressedTensorsW8A8Fp8"),
    (dict(type="float", strategy="block", block_structure=[128, 128]),
     dict(type="float", strategy="group", group_size=128, dynamic=True),
     "CompressedTensorsW8A8Fp8"),
    (dict(type="float", strategy="tensor"), None, "CompressedTensorsW8A16Fp8"),
    (dict(type="int", strategy="channel"), dict(type="int", strategy="token", dynamic=True),
     "CompressedTensorsW8A8Int8"),
    # static activations must be per-tensor (vLLM's _is_fp8_w8a8 / _is_static_tensor_w8a8)
    (dict(type="float", strategy="channel"), dict(type="float", strategy="channel"), None),
    # ... and symmetric for FP8
    (dict(type="float", strategy="channel"), dict(type="float", strategy="tensor",
                                                  symmetric=False), None),
    (dict(type="float", strategy="channel", force_dynamic=True), None, None),  # dynamic weights
    (dict(type="float", strategy="group", group_size=32, scale_dtype=torch.uint8),
     dict(type="float", strategy="group", group_size=32, dynamic=True),
     "CompressedTensorsW8A8Mxfp8"),  # MXFP8: E8M0 (uint8) scales over 32 elements
    (dict(type="float", strategy="group", group_size=32), None, None),  # float scales: not MX
    (dict(type="int", strategy="block", block_structure=[128, 128]),
     dict(type="int", strategy="token", dynamic=True), None),
])
def test_vllm_scheme_selection_table(w, a, scheme):
    from fp8ptq.checkpoint.validate import vllm_linear_scheme

    assert vllm_linear_scheme(_args(**w), None if a is None else _args(**a)) == scheme


def test_config_json_that_vllm_cannot_serve_is_flagged(A, tmp_path):
    assert quantize(A, tmp_path / "ck").exit_code == 0
    cfg_path = tmp_path / "ck" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    groups = cfg["quantization_config"]["config_groups"]
    assert groups and not [v for v in validate(tmp_path / "ck", ("vllm",), reload=False)
                           .violations if v.rule == "ct-scheme"]
    for g in groups.values():
        g["input_activations"].update(dynamic=False, strategy="tensor", symmetric=False)
    cfg_path.write_text(json.dumps(cfg))
    res = invoke(["validate", str(tmp_path / "ck"), "--runtime", "vllm",
                  "--no-reload"])
    assert res.exit_code == 4, res.output
    line = next(ln for ln in res.stdout.splitlines() if "[ct-scheme]" in ln)
    assert "asymmetric" in line and "fix:" in line and "group_0" in line


@pytest.mark.parametrize("runtime", ["vllm", "transformers", "all"])
def test_config_compressed_tensors_cannot_parse_fails_every_runtime(A, tmp_path, runtime):
    """Static per-token activations: compressed-tensors' QuantizationConfig refuses them, and
    vLLM parses config.json with that class, so every runtime fails with the parse error."""
    ck = tmp_path / "ck"
    assert quantize(A, ck).exit_code == 0
    cfg = json.loads((ck / "config.json").read_text())
    for g in cfg["quantization_config"]["config_groups"].values():
        g["input_activations"].update(strategy="token", dynamic=False)
    (ck / "config.json").write_text(json.dumps(cfg))
    res = invoke(["validate", str(ck), "--runtime", runtime, "--no-reload"])
    assert res.exit_code == 4, res.output
    lines = [ln for ln in res.stdout.splitlines() if "[ct-config]" in ln]
    assert len(lines) == 1 and lines[0].startswith("invalid"), res.stdout
    assert "Cannot perform static token quantization" in lines[0] and "group_0" in lines[0]
