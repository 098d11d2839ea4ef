"""FP8_BLOCK (128x128 block weights + dynamic 1x128 group activations) and MXFP8 checkpoints:
the compressed-tensors arguments as compressed-tensors' own ``QuantizationArgs`` parse them
(checked against its ``FP8_BLOCK`` / ``MXFP8`` presets), E8M0 weight scales, round trips
through both layouts, transformers loading them, ``fp8ptq validate``'s vLLM rules."""

from __future__ import annotations

import json

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.quant_scheme import FP8_BLOCK, MXFP8
from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM,
    CompressedTensorsConfig,
)

from fp8ptq.checkpoint import load_quantized, read_metadata, save_quantized
from fp8ptq.checkpoint.validate import static_violations
from fp8ptq.config.recipe import Recipe
from fp8ptq.errors import DataError
from fp8ptq.execution.in_memory import quantize_model
from fp8ptq.formats.mx import e8m0_decode
from fp8ptq.nn.quant_gemm import QuantGemm
from tiny_models import IDS, run, tiny

pytestmark = pytest.mark.slow  # every test here runs over ~5 s (see pyproject.toml)

# vLLM's block-FP8 path needs K and N in whole 128-blocks: a Llama of 256 / 384 features
CFG = dict(vocab_size=128, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
           intermediate_size=384)


def _llama(dtype=torch.float32):
    return tiny("llama", **CFG).to(dtype)


def _quantized(tmp_path, recipe, dtype=torch.float32, name="q"):
    model = _llama(dtype)
    result = quantize_model(model, recipe, None)
    save_quantized(result, tmp_path / name)
    return model, tmp_path / name


def _tensors(folder) -> dict:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _same_args(ours: dict, preset: QuantizationArgs):
    """Our dumped arguments parse to compressed-tensors' preset (the fields that matter)."""
    got = QuantizationArgs.model_validate(ours)
    for field in ("num_bits", "type", "symmetric", "group_size", "strategy", "block_structure",
                  "dynamic", "scale_dtype"):
        assert getattr(got, field) == getattr(preset, field), field


def _qmods(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantGemm)}


def test_fp8_block_checkpoint(tmp_path):
    model, out = _quantized(tmp_path, Recipe(scheme="fp8-block", dtype="float32"))
    meta = read_metadata(out)
    assert meta["layout"] == "compressed-tensors"
    entry = meta["modules"]["model.layers.0.mlp.down_proj"]
    assert (entry["weight_granularity"], entry["block_size"], entry["act_granularity"],
            entry["act_group_size"]) == ("block", 128, "group", 128)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    _same_args(group["weights"], FP8_BLOCK["weights"])
    _same_args(group["input_activations"], FP8_BLOCK["input_activations"])
    assert group["format"] == "float-quantized"
    t = _tensors(out)
    assert t["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert t["model.layers.0.mlp.down_proj.weight_scale"].shape == (2, 3)  # [256/128, 384/128]
    assert "model.layers.0.mlp.down_proj.input_scale" not in t  # dynamic
    ref = run(model, IDS)
    assert torch.equal(run(load_quantized(out).model, IDS), ref)
    # transformers: FP8 weights kept, compressed-tensors' dynamic group quantization of the
    # inputs in forward -- the same numbers fp8ptq simulates, bit for bit in float32
    hf = AutoModelForCausalLM.from_pretrained(str(out))
    q0 = hf.model.layers[0].self_attn.q_proj
    assert q0.weight.dtype == torch.float8_e4m3fn
    assert str(q0.quantization_scheme.input_activations.strategy) == "group"
    assert torch.equal(run(hf, IDS), ref)
    assert [v for v in static_violations(out, "vllm") if v.severity == "error"] == []


def test_mxfp8_checkpoint(tmp_path):
    model, out = _quantized(tmp_path, Recipe(format="mxfp8", dtype="float32"))
    meta = read_metadata(out)
    assert meta["layout"] == "compressed-tensors"
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    _same_args(group["weights"], MXFP8["weights"])
    _same_args(group["input_activations"], MXFP8["input_activations"])
    assert group["format"] == qc["format"] == "mxfp8-quantized"
    t = _tensors(out)
    scale = t["model.layers.0.mlp.down_proj.weight_scale"]
    assert scale.dtype == torch.uint8 and scale.shape == (256, 384 // 32)
    q = _qmods(model)["model.layers.0.mlp.down_proj"]
    assert torch.equal(e8m0_decode(scale), q.weight_scale)  # E8M0 codes of the exact scales
    ref = run(model, IDS)
    assert torch.equal(run(load_quantized(out).model, IDS), ref)
    # transformers + compressed-tensors' MXFP8 decompressor give fp8ptq's weights bit for bit
    dense = AutoModelForCausalLM.from_pretrained(
        str(out), quantization_config=CompressedTensorsConfig(dequantize=True))
    assert all(torch.equal(dense.get_submodule(n).weight, m.inner.weight)
               for n, m in _qmods(model).items())
    assert [v for v in static_violations(out, "vllm") if v.severity == "error"] == []


def test_mxfp8_ceil_checkpoint_keeps_its_rule(tmp_path):
    """``--format mxfp8-ceil`` (the E8M0 exponent rounded up, as NVIDIA's kernels and vLLM's
    MXFP8 path compute it): the same compressed-tensors MXFP8 layout, weight scales never below
    the spec rule's and at least one a binade above it (a block whose amax mantissa saturates
    under the floor rule), the rule kept through fp8ptq.json so the reloaded model simulates
    the same activation scales, and vLLM's rules pass."""
    model, out = _quantized(tmp_path, Recipe(format="mxfp8-ceil", dtype="float32"))
    floor_model, _ = _quantized(tmp_path, Recipe(format="mxfp8", dtype="float32"), name="f")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mxfp8-quantized"
    ours, floors = _qmods(model), _qmods(floor_model)
    ratio = torch.cat([(ours[n].weight_scale / floors[n].weight_scale).flatten() for n in ours])
    assert set(ratio.unique().tolist()) == {1.0, 2.0}
    meta = read_metadata(out)["modules"]["model.layers.0.mlp.up_proj"]
    assert meta["weight_format"]["mx_scale_rounding"] == "ceil"
    loaded = load_quantized(out).model
    assert _qmods(loaded)["model.layers.0.mlp.up_proj"].act_format.mx_scale_rounding == "ceil"
    assert torch.equal(run(loaded, IDS), run(model, IDS))
    assert [v for v in static_violations(out, "vllm") if v.severity == "error"] == []


def test_mxfp8_bf16_model_runs_in_transformers(tmp_path):
    """compressed-tensors' own MX activation scales round the block amax to the nearest power
    of two before flooring (fp8ptq follows the spec's floor, fp8ptq/formats/mx.py): the logits are
    close, not identical. (With a float32 model compressed-tensors 0.20 fails on its bfloat16
    E8M0 scales; dequantize=True loads either.)"""
    model, out = _quantized(tmp_path, Recipe(format="mxfp8"), dtype=torch.bfloat16)
    hf = AutoModelForCausalLM.from_pretrained(str(out))
    ours, theirs = run(model, IDS).float(), run(hf, IDS).float()
    assert float((ours - theirs).pow(2).mean() / ours.pow(2).mean()) < 5e-3


def test_mxfp8_e5m2_is_native_with_e8m0_scales(tmp_path):
    model, out = _quantized(tmp_path, Recipe(format="mxfp8-e5m2", dtype="float32"))
    meta = read_metadata(out)
    assert meta["layout"] == "fp8ptq-native"
    assert meta["modules"]["model.layers.0.mlp.up_proj"]["weight_format"]["mx_block"] == 32
    t = _tensors(out)
    assert t["model.layers.0.mlp.up_proj.weight_scale"].dtype == torch.uint8
    assert torch.equal(run(load_quantized(out).model, IDS), run(model, IDS))


def test_mixed_mx_and_e4m3_modules(tmp_path):
    """An MXFP8 override inside an FP8_DYNAMIC recipe: two config groups, each module named,
    the config's format mixed-precision; the round trip is exact."""
    recipe = Recipe(scheme="fp8-dynamic", dtype="float32", overrides={"*.mlp.*": "mxfp8"})
    model, out = _quantized(tmp_path, recipe)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    formats = sorted(g["format"] for g in qc["config_groups"].values())
    assert formats == ["float-quantized", "mxfp8-quantized"] and qc["format"] == "mixed-precision"
    assert torch.equal(run(load_quantized(out).model, IDS), run(model, IDS))


def test_verify_refuses_an_e8m0_nan_code(tmp_path):
    from safetensors.torch import save_file

    _, out = _quantized(tmp_path, Recipe(format="mxfp8", dtype="float32"))
    t = _tensors(out)
    t["model.layers.1.self_attn.o_proj.weight_scale"][3, 2] = 255
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(DataError, match="o_proj.weight_scale.*E8M0 scale code"):
        load_quantized(out)


def test_eval_compares_another_tools_checkpoint_folder(tmp_path, word_tokenizer):
    """``eval --compare DIR`` with a compressed-tensors folder that fp8ptq did not write (here
    an FP8_BLOCK checkpoint with its fp8ptq.json removed, as llm-compressor would leave it):
    a checkpoint variant without fp8ptq metadata, loaded by transformers with its quantization
    applied -- the numbers fp8ptq simulates."""
    from fp8ptq.evals.compare import load_variant, plan_variants

    model, out = _quantized(tmp_path, Recipe(scheme="fp8-block", dtype="float32"))
    (out / "fp8ptq.json").unlink()
    word_tokenizer.save_pretrained(out)
    variants, _ = plan_variants(str(out), None, [str(out)], Recipe(dtype="float32"))
    peer = variants[-1]
    assert (peer.kind, peer.meta, peer.name) == ("checkpoint", None, "q")
    loaded = load_variant(peer)
    assert torch.equal(run(loaded.model, IDS), run(model, IDS))
