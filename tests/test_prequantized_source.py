"""A checkpoint another tool wrote in FP8 (compressed-tensors float-quantized, as llm-compressor
writes FP8 / FP8_DYNAMIC / FP8_BLOCK) as a source: read as the float model it stands for
(codes x scales) by every path, with a ``note:``, and quantized again to any recipe. The
stand-in is fp8ptq's own compressed-tensors output without its fp8ptq.json."""

import json

import pytest
import torch
from safetensors.torch import load_file

from fp8ptq.checkpoint import load_quantized
from fp8ptq.errors import DataError
from fp8ptq.io.loading import load_model
from fp8ptq.io.source import SafetensorsSource
from tiny_models import invoke, saved_llama_with_calib

CALIB = ["--num-samples", "2", "--seq-len", "8", "--batch-size", "2", "--dtype", "float32"]
RECIPES = {  # llm-compressor's FP8_DYNAMIC, FP8 (static per-tensor), FP8_BLOCK
    "channel": ["--weight-calib", "max"],
    "tensor": ["--weight-granularity", "tensor", "--act-granularity", "tensor",
               "--weight-calib", "max"],
    "block": ["--weight-granularity", "block", "--block-size", "32", "--weight-calib", "max"],
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory, word_tokenizer):
    """{scale kind: (another tool's FP8 folder, its model as fp8ptq.load reads it, calib)}."""
    root = tmp_path_factory.mktemp("prequantized")
    src, calib = saved_llama_with_calib(root, word_tokenizer)
    out = {}
    for kind, flags in RECIPES.items():
        ck = root / kind
        res = invoke(["quantize", src, "-o", ck, "--calib-data", calib, *CALIB, *flags])
        assert res.exit_code == 0, res.output
        reference = load_quantized(ck, dtype=torch.float32).model
        (ck / "fp8ptq.json").unlink()  # now only config.json says how it was quantized
        out[kind] = (ck, reference, calib)
    return out


def dequantized(reference) -> dict[str, torch.Tensor]:
    return {f"{n}.weight": m.dequantized_weight_2d() for n, m in reference.named_modules()
            if hasattr(m, "dequantized_weight_2d")}


@pytest.mark.parametrize("kind", list(RECIPES))
def test_source_reads_codes_times_scales(sources, kind):
    ck, reference, _ = sources[kind]
    stored = load_file(ck / "model.safetensors")
    source = SafetensorsSource(ck)
    assert source.prequantized is not None and kind in source.prequantized.describe()
    assert not [n for n in source.names() if n.endswith(("_scale", "zero_point"))]
    want = dequantized(reference)
    assert want and set(want) <= set(source.names())
    for name, w in want.items():
        assert stored[name].dtype == torch.float8_e4m3fn
        got = source.read_one(name)
        assert got.dtype == torch.float32 and torch.equal(got, w), name
    if kind == "block":  # 64 x 128 GEMMs in 32 x 32 tiles: scales differ across tiles
        assert stored["model.layers.0.mlp.down_proj.weight_scale"].shape == (2, 4)


def test_in_memory_load_is_the_dequantized_model(sources):
    ck, reference, _ = sources["block"]
    model = load_model(str(ck), dtype=torch.float32).model
    assert getattr(model.config, "quantization_config", None) is None
    params = dict(model.named_parameters())
    for name, w in dequantized(reference).items():
        assert torch.equal(params[name], w), name


@pytest.mark.parametrize("path_flags,path", [
    ([], "model-free"), (["--no-model-free"], "in-memory"), (["--sequential"], "sequential")])
def test_requantize_is_idempotent_on_every_path(sources, tmp_path, path_flags, path):
    """Per-channel max scales of weights that are already e4m3 codes x per-channel scales give
    back the same scales and codes: on every path, bit for bit."""
    ck, _, calib = sources["channel"]
    out = tmp_path / "again"
    res = invoke(["quantize", ck, "-o", out, *CALIB, "--weight-calib", "max", "--json",
                  *path_flags])
    assert res.exit_code == 0, res.output
    assert "note: " in res.stderr and "dequantized on load" in res.stderr
    assert json.loads(res.stdout)["path"] == path
    before, after = load_file(ck / "model.safetensors"), load_file(out / "model.safetensors")
    weights = [k for k, v in before.items() if v.dtype == torch.float8_e4m3fn]
    assert weights and set(before) == set(after)
    for k in weights:
        assert torch.equal(before[k].view(torch.uint8), after[k].view(torch.uint8)), k
        assert torch.equal(before[f"{k}_scale"], after[f"{k}_scale"]), k
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"


def test_requantize_block_fp8_to_hif8_with_gptq(sources, tmp_path):
    ck, reference, calib = sources["block"]
    out = tmp_path / "hif8"
    res = invoke(["quantize", ck, "-o", out, "--format", "hif8", "--calib-data", calib, *CALIB,
                  "--weight-calib", "gptq"])
    assert res.exit_code == 0, res.output
    meta = json.loads((out / "fp8ptq.json").read_text())
    assert meta["layout"] == "fp8ptq-native" and meta["recipe"]["weight_calib"] == "gptq"
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8ptq"  # its own, not the source's compressed-tensors one
    again = dict(load_quantized(out, dtype=torch.float32).model.named_modules())
    for name, w in dequantized(reference).items():
        q = again[name.removesuffix(".weight")].dequantized_weight_2d()
        assert (q - w).norm() / w.norm() < 0.1, name  # HiF8 of the FP8 model's weights


def test_compressed_tensors_weights_it_cannot_undo_are_one_error(sources, tmp_path):
    ck, _, _ = sources["channel"]
    cfg = json.loads((ck / "config.json").read_text())
    cfg["quantization_config"]["format"] = "pack-quantized"
    for g in cfg["quantization_config"]["config_groups"].values():
        g["format"] = "pack-quantized"
        g["weights"].update(num_bits=4, type="int")
    bad = tmp_path / "int4"
    bad.mkdir()
    for f in ck.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DataError, match="pack-quantized"):
        SafetensorsSource(bad)
    res = invoke(["quantize", bad, "-o", tmp_path / "out"])
    assert res.exit_code != 0 and res.stderr.strip().splitlines()[-1].startswith("error: ")
    assert not (tmp_path / "out").exists()
