"""Checkpoints of models quantized with ``--quantize-attention`` / ``--quantize-residual``: the
tap scales are written (fp8ptq.json; k_scale / v_scale tensors, compressed-tensors
``kv_cache_scheme`` where it applies) and ``fp8ptq.load`` re-installs the taps exactly."""

import json

import pytest
import torch
from safetensors import safe_open

from fp8ptq.checkpoint import (
    LAYOUT_CT,
    LAYOUT_NATIVE,
    load_quantized,
    read_metadata,
    reader,
    save_quantized,
)
from fp8ptq.checkpoint.layouts.compressed_tensors import _cached_attention
from fp8ptq.config.recipe import Recipe
from fp8ptq.errors import Fp8ptqError, NumericsError
from fp8ptq.execution.in_memory import quantize_model, token_batches
from fp8ptq.taps.taps import ATTN_IMPLEMENTATION, kv_scales_from_report
from tiny_models import IDS, run, tiny

transformers = pytest.importorskip("transformers")

CASES = [
    # (id, arch, recipe kwargs, layout, kv_cache_scheme type or None)
    ("llama-e4m3-attn", "llama", dict(quantize_attention=True), LAYOUT_CT, "float"),
    ("llama-e4m3-residual", "llama", dict(quantize_residual=True), LAYOUT_CT, None),
    ("llama-hif8-both", "llama", dict(format="hif8", quantize_attention=True,
                                      quantize_residual=True), LAYOUT_NATIVE, None),
    ("opt-int8-attn", "opt", dict(format="int8", quantize_attention=True), LAYOUT_CT, "int"),
    ("gpt2-e4m3-both", "gpt2", dict(quantize_attention=True, quantize_residual=True),
     LAYOUT_NATIVE, None),
    ("bert-e4m3-both", "bert", dict(quantize_attention=True, quantize_residual=True),
     LAYOUT_CT, None),  # BERT's query/key/value: no compressed-tensors KV cache
]


def ct_caches_attention(arch) -> bool:
    """Does the installed compressed-tensors treat this architecture's attention as KV-cached?
    (0.20 looks for a ``past_key_value(s)`` argument; transformers 5.24 renamed it ``cache``,
    and then fp8ptq writes no ``kv_cache_scheme``, saying why in fp8ptq.json.)"""
    model = tiny(arch)
    attn = next(m for n, m in model.named_modules() if n.endswith(("self_attn", "attn")))
    return _cached_attention(attn)


def quantized(arch, **kwargs):
    model = tiny(arch)
    recipe = Recipe(dtype="float32", **kwargs)
    return quantize_model(model, recipe, token_batches(IDS, 4)), recipe


def tensor_names(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if k.endswith(("k_scale", "v_scale"))}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_taps_round_trip_exactly(tmp_path, monkeypatch, case):
    _, arch, kwargs, layout, kv_type = case
    if kv_type and not ct_caches_attention(arch):
        kv_type = None  # not written: the note in fp8ptq.json says why (checked below)
    result, recipe = quantized(arch, **kwargs)
    expected = run(result.model, IDS)
    save_quantized(result, recipe, tmp_path / "c")

    meta = read_metadata(tmp_path / "c")
    assert meta["layout"] == layout
    assert meta["taps"] == result.extras["taps"]
    kinds = {e["kind"] for e in meta["taps"].values()}
    assert kinds == {k for k, flag in (("attention", kwargs.get("quantize_attention")),
                                       ("residual", kwargs.get("quantize_residual"))) if flag}
    kv = kv_scales_from_report(meta["taps"])
    stored = tensor_names(tmp_path / "c")
    qc = json.loads((tmp_path / "c" / "config.json").read_text())["quantization_config"]
    if layout == LAYOUT_CT:
        assert (qc["kv_cache_scheme"] or {}).get("type") == kv_type
    if kv_type or (layout == LAYOUT_NATIVE and kv):
        assert set(stored) == {f"{a}.{k}" for a in kv for k in ("k_scale", "v_scale")}
        for a, scales in kv.items():
            for k, v in scales.items():
                assert stored[f"{a}.{k}"].dtype == torch.float32
                assert float(stored[f"{a}.{k}"]) == v
    else:
        assert not stored
        assert "not written" in meta["kv_cache_scales"] if kv else meta["kv_cache_scales"] is None

    loaded = load_quantized(tmp_path / "c").model
    if "attention" in kinds:
        assert loaded.config._attn_implementation == ATTN_IMPLEMENTATION
    if "residual" in kinds:
        assert any(m._forward_hooks for m in loaded.modules())
    assert torch.equal(run(loaded, IDS), expected)

    # the taps matter: without them the reloaded model computes something else
    monkeypatch.setattr(reader, "install_taps", lambda *a: None)
    assert not torch.equal(run(load_quantized(tmp_path / "c").model, IDS), expected)


def test_transformers_reads_kv_cache_scales(tmp_path):
    from compressed_tensors.quantization import QuantizationConfig

    if not ct_caches_attention("llama"):
        pytest.skip("this compressed-tensors does not treat transformers' attention as KV-cached")
    result, recipe = quantized("llama", quantize_attention=True)
    save_quantized(result, recipe, tmp_path / "c")
    qc = json.loads((tmp_path / "c" / "config.json").read_text())["quantization_config"]
    assert QuantizationConfig.model_validate(qc).kv_cache_scheme.strategy == "tensor"
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "c"),
                                                                 output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    kv = kv_scales_from_report(result.extras["taps"])
    for name, scales in kv.items():
        attn = hf.get_submodule(name)
        assert attn.k_scale.item() == scales["k_scale"]
        assert attn.v_scale.item() == scales["v_scale"]


def test_bad_tap_scale_refused_and_kv_tensor_checked(tmp_path):
    result, recipe = quantized("llama", format="hif8", quantize_attention=True)
    name = "model.layers.0.self_attn:k"
    good = result.extras["taps"][name]["scale"]
    result.extras["taps"][name]["scale"] = float("nan")
    with pytest.raises(NumericsError, match="self_attn:k"):
        save_quantized(result, recipe, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()

    result.extras["taps"][name]["scale"] = good
    save_quantized(result, recipe, tmp_path / "c")
    meta = read_metadata(tmp_path / "c")
    meta["taps"][name]["scale"] = good * 2  # fp8ptq.json and the tensor now disagree
    (tmp_path / "c" / "fp8ptq.json").write_text(json.dumps(meta))
    with pytest.raises(Fp8ptqError, match="k_scale"):
        load_quantized(tmp_path / "c")
