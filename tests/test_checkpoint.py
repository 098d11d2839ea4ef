"""Checkpoints: round trips (both layouts), transformers / compressed-tensors compatibility,
atomic writes, scale guards, fp8ptq.json, OCP -> FNUZ conversion."""

import errno
import json
from pathlib import Path

import pytest
import torch

import fp8ptq
from fp8ptq.checkpoint import (
    LAYOUT_CT,
    LAYOUT_NATIVE,
    fn_to_fnuz,
    load_quantized,
    read_metadata,
    save_quantized,
)
from fp8ptq.checkpoint import writer as ckpt_writer
from fp8ptq.config.recipe import Recipe
from fp8ptq.errors import Fp8ptqError, NumericsError, UsageError
from fp8ptq.execution.in_memory import quantize_model, token_batches
from fp8ptq.nn.quant_gemm import QuantGemm
from tiny_models import STATIC_RECIPE, tiny

transformers = pytest.importorskip("transformers")

VOCAB = 128


def _llama(dtype=torch.float32, tie=True):
    return tiny("llama", seed=None, dtype=dtype, intermediate_size=96, num_key_value_heads=2,
                tie_word_embeddings=tie)


def _gpt2(dtype=torch.float32):
    return tiny("gpt2", seed=None, dtype=dtype, n_positions=64, bos_token_id=1, eos_token_id=1)


def _opt(dtype=torch.float32):
    return tiny("opt", seed=None, dtype=dtype, ffn_dim=96, max_position_embeddings=64,
                bos_token_id=1, eos_token_id=1, pad_token_id=0)


def _bert(dtype=torch.float32):
    return tiny("bert", seed=None, dtype=dtype, intermediate_size=96, max_position_embeddings=64)


BUILDERS = {"llama": _llama, "gpt2": _gpt2, "opt": _opt, "bert": _bert}


def _ids(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (8, 16), generator=g)


def _quantize(arch="llama", recipe=None, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    model = BUILDERS[arch](dtype).eval()
    recipe = recipe or Recipe()
    result = quantize_model(model, recipe, token_batches(_ids(), 4))
    return result, recipe


def _outputs(model, ids):
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    return out.logits if hasattr(out, "logits") else torch.cat([out.start_logits,
                                                                out.end_logits], -1)


def _save(result, recipe, path, **kw):
    kw.setdefault("source", {"spec": "tiny", "kind": "local", "resolved_path": "/nowhere"})
    kw.setdefault("calib", None)
    return save_quantized(result, recipe, path, **kw)


def _qmods(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantGemm)}


def _strict_json(text):
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


# --- round trips --------------------------------------------------------------------------

ROUND_TRIPS = [
    # (id, arch, recipe kwargs, dtype, layout)
    ("e4m3-channel-static", "llama", {}, torch.float32, LAYOUT_CT),
    ("e4m3-tensor-token", "llama", dict(weight_granularity="tensor", act_granularity="token"),
     torch.float32, LAYOUT_CT),
    ("e4m3-block48-static", "llama", dict(weight_granularity="block", block_size=48),
     torch.float32, LAYOUT_CT),
    ("e4m3-block32-token-bf16", "llama", dict(weight_granularity="block", block_size=32,
                                             act_granularity="token"), torch.bfloat16, LAYOUT_CT),
    ("e4m3-weight-only", "llama", dict(act_format="none"), torch.float32, LAYOUT_CT),
    ("int8-channel-static", "llama", dict(format="int8"), torch.float32, LAYOUT_CT),
    ("int8-token", "llama", dict(format="int8", act_granularity="token"), torch.float32,
     LAYOUT_CT),
    ("e5m2", "llama", dict(format="e5m2"), torch.float32, LAYOUT_NATIVE),
    ("hif8", "llama", dict(format="hif8"), torch.float32, LAYOUT_NATIVE),
    ("hfp8", "llama", dict(format="hfp8", act_granularity="token"), torch.float32, LAYOUT_NATIVE),
    ("e4m3fnuz-block", "llama", dict(format="e4m3fnuz", weight_granularity="block",
                                     block_size=32), torch.bfloat16, LAYOUT_NATIVE),
    ("generic-e3m4", "llama", dict(format="e3m4"), torch.float32, LAYOUT_NATIVE),
    ("mixed-override", "llama", dict(overrides={"*.down_proj": "e5m2"}), torch.float32,
     LAYOUT_NATIVE),
    ("lm-head-tied", "llama", dict(quantize_lm_head=True), torch.float32, LAYOUT_CT),
    ("gpt2-conv1d-e4m3", "gpt2", {}, torch.float32, LAYOUT_NATIVE),
    ("gpt2-hif8", "gpt2", dict(format="hif8", weight_granularity="block", block_size=48),
     torch.float32, LAYOUT_NATIVE),
    ("opt-e4m3", "opt", {}, torch.float32, LAYOUT_CT),
    ("opt-int8", "opt", dict(format="int8"), torch.float32, LAYOUT_CT),
    ("bert-qa-e4m3", "bert", dict(act_granularity="token"), torch.float32, LAYOUT_CT),
    ("bert-qa-e5m2", "bert", dict(format="e5m2"), torch.float32, LAYOUT_NATIVE),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", ROUND_TRIPS, ids=[c[0] for c in ROUND_TRIPS])
def test_round_trip_is_bit_exact(tmp_path, case):
    _, arch, kwargs, dtype, layout = case
    result, recipe = _quantize(arch, Recipe(**{**STATIC_RECIPE, **kwargs}), dtype)
    ids = _ids(1)
    expected = _outputs(result.model, ids)

    facts = _save(result, recipe, tmp_path / "ckpt")
    assert facts["layout"] == layout
    assert read_metadata(tmp_path / "ckpt")["layout"] == layout

    loaded = load_quantized(tmp_path / "ckpt")
    model = loaded.model
    assert type(model) is type(result.model)
    assert loaded.kind == "fp8ptq"
    assert next(model.parameters()).dtype == dtype
    assert torch.equal(_outputs(model, ids), expected)

    before, after = _qmods(result.model), _qmods(model)
    assert before.keys() == after.keys() and before
    for name, q in before.items():
        r = after[name]
        assert torch.equal(r.weight_codes, q.weight_codes), name
        assert torch.equal(r.weight_scale, q.weight_scale), name
        assert (r.input_scale is None) == (q.input_scale is None), name
        if q.input_scale is not None:
            assert torch.equal(r.input_scale, q.input_scale), name
        assert r.weight_format == q.weight_format and r.act_format == q.act_format, name
        assert r.weight_granularity == q.weight_granularity, name
        assert r.act_granularity == q.act_granularity, name
        assert torch.equal(r.inner.weight, q.inner.weight), name


def test_mixed_override_records_both_formats(tmp_path):
    result, recipe = _quantize("llama", Recipe(overrides={"*.down_proj": "e5m2"}))
    _save(result, recipe, tmp_path / "c")
    mods = read_metadata(tmp_path / "c")["modules"]
    assert mods["model.layers.0.mlp.down_proj"]["weight_format"]["name"] == "e5m2"
    assert mods["model.layers.0.mlp.down_proj"]["act_format"]["name"] == "e5m2"
    assert mods["model.layers.0.mlp.up_proj"]["weight_format"]["name"] == "e4m3"


def test_native_layout_tensors_and_config(tmp_path):
    from safetensors import safe_open

    result, recipe = _quantize("gpt2", Recipe(format="e5m2", **STATIC_RECIPE))
    _save(result, recipe, tmp_path / "c")
    with safe_open(str(tmp_path / "c" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        codes = f.get_tensor("transformer.h.0.attn.c_attn.weight_codes")
        bias = f.get_tensor("transformer.h.0.attn.c_attn.bias")
    assert codes.dtype == torch.uint8 and codes.shape == (192, 64)  # [out, in], not Conv1D's
    assert bias.dtype == torch.float32
    assert "transformer.h.0.attn.c_attn.weight" not in keys
    assert "transformer.h.0.attn.c_attn.input_scale" in keys
    assert "lm_head.weight" not in keys and "transformer.wte.weight" in keys  # tied: stored once
    cfg = transformers.AutoConfig.from_pretrained(str(tmp_path / "c"))
    assert cfg.model_type == "gpt2"
    assert json.loads((tmp_path / "c" / "config.json").read_text())[
        "quantization_config"]["quant_method"] == "fp8ptq"
    result, recipe = _quantize("gpt2", Recipe())  # e4m3, but Conv1D: not compressed-tensors
    _save(result, recipe, tmp_path / "e4m3")
    meta = read_metadata(tmp_path / "e4m3")
    assert meta["layout"] == LAYOUT_NATIVE and "conv1d_hf" in meta["layout_reason"]


def test_load_dtype_override_and_tokenizer(tmp_path, word_tokenizer):
    result, recipe = _quantize("llama", Recipe(), dtype=torch.bfloat16)
    _save(result, recipe, tmp_path / "c", tokenizer=word_tokenizer)
    assert (tmp_path / "c" / "generation_config.json").is_file()
    loaded = fp8ptq.load(tmp_path / "c", dtype="float32")
    assert loaded.tokenizer is not None and loaded.tokenizer.pad_token == "</s>"
    assert next(loaded.model.parameters()).dtype == torch.float32
    for name, q in _qmods(loaded.model).items():
        assert torch.equal(q.inner.weight, q.dequantized_weight_2d()), name

    from fp8ptq.io.loading import load_model

    via_loading = load_model(str(tmp_path / "c"))
    assert via_loading.kind == "fp8ptq" and _qmods(via_loading.model)


def test_sharded_checkpoint_round_trip(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt_writer, "SHARD_BYTES", 40_000)
    result, recipe = _quantize("llama", Recipe())
    facts = _save(result, recipe, tmp_path / "c")
    assert "model.safetensors.index.json" in facts["files"] and len(facts["files"]) > 2
    assert not (tmp_path / "c" / "model.safetensors").exists()
    ids = _ids(2)
    assert torch.equal(_outputs(fp8ptq.load(tmp_path / "c").model, ids),
                       _outputs(result.model, ids))


# --- transformers / compressed-tensors compatibility -------------------------------------

def _ct_quantized_equal(hf_model, ours):
    return all(torch.equal(hf_model.get_submodule(n).weight, q.inner.weight)
               for n, q in _qmods(ours).items())


@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [
    {},
    dict(weight_granularity="tensor", act_granularity="token"),
    dict(weight_granularity="block", block_size=48),
], ids=["channel-static", "tensor-token", "block48-static"])
def test_transformers_loads_e4m3_checkpoint(tmp_path, kwargs):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    result, recipe = _quantize("llama", Recipe(**kwargs))
    _save(result, recipe, tmp_path / "c")
    ours = result.model
    # dequantize=True (formerly run_compressed=False): dense weights decompressed at load time
    dense = AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "c"), quantization_config=CompressedTensorsConfig(dequantize=True))
    for name, q in _qmods(ours).items():
        w = dense.get_submodule(name).weight
        assert w.dtype == torch.float32
        assert torch.equal(w, q.dequantized_weight_2d()), name
    # default: FP8 weights kept, activation quantization applied, decompressed on first forward
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "c"))
    q0 = hf.model.layers[0].self_attn.q_proj
    assert q0.weight.dtype == torch.float8_e4m3fn
    assert str(q0.quantization_scheme.weights.strategy) in ("channel", "tensor", "block")
    ids = _ids(3)
    assert torch.equal(_outputs(hf, ids), _outputs(ours, ids))  # float32: bit-identical
    assert _ct_quantized_equal(hf, ours)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()


def test_transformers_loads_int8_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    result, recipe = _quantize("llama", Recipe(format="int8"))
    _save(result, recipe, tmp_path / "c")
    dense = AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "c"), quantization_config=CompressedTensorsConfig(dequantize=True))
    assert _ct_quantized_equal(dense, result.model)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "c"))
    assert hf.model.layers[0].mlp.up_proj.weight.dtype == torch.int8
    _outputs(hf, _ids(3))  # decompresses; activations use compressed-tensors' [-128, 127]
    assert _ct_quantized_equal(hf, result.model)


def test_transformers_dequantize_bf16_and_qa(tmp_path):
    from transformers import AutoModelForQuestionAnswering, CompressedTensorsConfig

    result, recipe = _quantize("llama", Recipe(weight_granularity="block", block_size=32),
                               dtype=torch.bfloat16)
    _save(result, recipe, tmp_path / "llama")
    dense = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "llama"), quantization_config=CompressedTensorsConfig(dequantize=True))
    assert dense.dtype == torch.bfloat16
    assert _ct_quantized_equal(dense, result.model)

    result, recipe = _quantize("bert", Recipe())
    _save(result, recipe, tmp_path / "bert")
    hf = AutoModelForQuestionAnswering.from_pretrained(str(tmp_path / "bert"))
    ids = _ids(4)
    assert torch.equal(_outputs(hf, ids), _outputs(result.model, ids))


def test_quantized_tied_lm_head_is_stored_untied(tmp_path):
    result, recipe = _quantize("llama", Recipe(quantize_lm_head=True))
    _save(result, recipe, tmp_path / "c")
    assert read_metadata(tmp_path / "c")["untied"] == ["lm_head"]
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False
    assert cfg["quantization_config"]["ignore"] == []
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "c"))
    ids = _ids(5)
    assert torch.equal(_outputs(hf, ids), _outputs(result.model, ids))


def test_config_validates_with_compressed_tensors(tmp_path):
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig

    for kwargs, fmt in [({}, "float-quantized"), (dict(format="int8"), "int-quantized"),
                        (dict(act_format="none"), "naive-quantized"),
                        (dict(weight_granularity="block", block_size=32,
                              act_granularity="token"), "float-quantized")]:
        result, recipe = _quantize("llama", Recipe(**kwargs))
        out = tmp_path / fmt / str(len(kwargs))
        _save(result, recipe, out)
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        parsed = QuantizationConfig.model_validate(qc)
        assert parsed.format == fmt and parsed.quantization_status == "compressed"
        assert parsed.ignore == ["lm_head"]
        (group,) = parsed.config_groups.values()
        assert group.targets == ["Linear"]
        hf_config = transformers.CompressedTensorsConfig.from_dict(qc)
        assert hf_config.is_quantization_compressed
        assert ModelCompressor.from_compression_config(hf_config) is not None
    assert ct.__version__


# --- atomicity and guards ------------------------------------------------------------------

def _leftovers(parent: Path):
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    import safetensors.torch

    result, recipe = _quantize("llama", Recipe(format="e5m2"))

    def boom(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(Fp8ptqError, match="no space left on device writing .*c; nothing"):
        _save(result, recipe, tmp_path / "c")
    assert not (tmp_path / "c").exists()
    assert _leftovers(tmp_path) == []


def test_existing_dir_refused_then_replaced_with_force(tmp_path, monkeypatch):
    import safetensors.torch

    out = tmp_path / "c"
    out.mkdir()
    (out / "old.txt").write_text("keep me")
    result, recipe = _quantize("llama", Recipe())
    with pytest.raises(UsageError, match="already exists"):
        _save(result, recipe, out)
    assert (out / "old.txt").read_text() == "keep me"

    real = safetensors.torch.save_file
    monkeypatch.setattr(safetensors.torch, "save_file",
                        lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError):
        _save(result, recipe, out, force=True)
    assert (out / "old.txt").read_text() == "keep me"  # old checkpoint untouched
    monkeypatch.setattr(safetensors.torch, "save_file", real)

    _save(result, recipe, out, force=True)
    assert not (out / "old.txt").exists() and (out / "fp8ptq.json").is_file()
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("what,value", [("weight_scale", float("nan")),
                                        ("weight_scale", 0.0),
                                        ("input_scale", float("inf"))])
def test_bad_scale_refused(tmp_path, what, value):
    result, recipe = _quantize("llama", Recipe(**STATIC_RECIPE))
    q = result.model.model.layers[1].mlp.down_proj
    getattr(q, what).view(-1)[0] = value
    with pytest.raises(NumericsError, match="down_proj"):
        _save(result, recipe, tmp_path / "c")
    assert not (tmp_path / "c").exists() and _leftovers(tmp_path) == []


# --- fp8ptq.json --------------------------------------------------------------------------

def test_metadata_keys_and_strict_json(tmp_path):
    result, recipe = _quantize("llama", Recipe(act_granularity="tensor"))
    result.modules[0].weight_sqnr_db = float("inf")
    result.modules[1].input_sqnr_db = float("nan")
    calib = {"source": "wikitext", "sha256": "ab" * 32, "num_samples": 8, "seq_len": 16,
             "seed": 0, "num_tokens": 128}
    facts = _save(result, recipe, tmp_path / "c", calib=calib, tool_version="9.9.9")
    text = (tmp_path / "c" / "fp8ptq.json").read_text()
    meta = _strict_json(text)
    _strict_json((tmp_path / "c" / "config.json").read_text())
    for key in ("tool", "version", "created", "layout", "source", "recipe", "calibration",
                "modules", "skipped", "sizes"):
        assert key in meta, key
    assert meta["tool"] == "fp8ptq" and meta["version"] == "9.9.9"
    assert meta["calibration"] == calib
    assert meta["source"]["kind"] == "local"
    assert Recipe.from_dict(meta["recipe"]) == recipe
    assert meta["skipped"] == ["lm_head"]
    assert set(meta["sizes"]) >= {"checkpoint_bytes", "original_bytes"}
    assert meta["sizes"]["checkpoint_bytes"] == facts["checkpoint_bytes"] > 0
    assert meta["sizes"]["original_bytes"] > meta["sizes"]["checkpoint_bytes"]
    assert len(meta["modules"]) == 14
    for entry in meta["modules"].values():
        for key in ("kind", "weight_format", "act_format", "weight_granularity", "block_size",
                    "act_granularity", "weight_scale_shape", "input_scale", "weight_sqnr_db",
                    "input_sqnr_db", "weight_amax", "input_amax"):
            assert key in entry, key
        assert entry["weight_format"]["name"] == "e4m3"
        assert entry["input_scale"] > 0
    first, second = (meta["modules"][m.name] for m in result.modules[:2])
    assert first["weight_sqnr_db"] == "inf"
    assert second["input_sqnr_db"] is None
    assert meta["modules"]["model.layers.0.self_attn.k_proj"]["weight_scale_shape"] == [32, 1]


def test_result_without_quantized_modules_refused(tmp_path):
    result, recipe = _quantize("llama", Recipe())
    result.model = _llama()
    with pytest.raises(UsageError):
        _save(result, recipe, tmp_path / "c")


# --- OCP -> FNUZ ----------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,fn_name,fnuz_name", [("e4m3", "float8_e4m3fn", "float8_e4m3fnuz"),
                                                  ("e5m2", "float8_e5m2", "float8_e5m2fnuz")])
def test_fn_to_fnuz_matches_ml_dtypes(fmt, fn_name, fnuz_name):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    import numpy as np

    fn, fnuz = getattr(ml_dtypes, fn_name), getattr(ml_dtypes, fnuz_name)
    all_codes = np.arange(256, dtype=np.uint8)
    finite = np.isfinite(all_codes.view(fn).astype(np.float32))
    codes = torch.from_numpy(all_codes[finite].copy())
    scale = torch.tensor([0.375])
    new_codes, new_scale = fn_to_fnuz(codes, scale, fmt)
    assert torch.equal(new_scale, scale * 2)

    src_vals = codes.numpy().view(fn).astype(np.float64) * 0.375
    dst_vals = new_codes.numpy().view(fnuz).astype(np.float64) * 0.75
    assert np.array_equal(src_vals, dst_vals)  # every value, -0 -> +0 included
    # bit-exact: the codes ml_dtypes itself picks for the halved values
    expected = (codes.numpy().view(fn).astype(np.float32) / 2).astype(fnuz).view(np.uint8)
    assert np.array_equal(new_codes.numpy(), expected)
    changed = codes.numpy() != new_codes.numpy()
    assert codes.numpy()[changed].tolist() == [0x80]

    nan_code = torch.tensor([int(np.flatnonzero(~finite)[0])], dtype=torch.uint8)
    with pytest.raises(NumericsError):
        fn_to_fnuz(nan_code, 1.0, fmt)


def test_fn_to_fnuz_on_a_quantized_module():
    result, _ = _quantize("llama", Recipe())
    q = result.model.model.layers[0].self_attn.q_proj
    codes, scale = fn_to_fnuz(q.weight_codes, q.weight_scale)
    from fp8ptq.formats import decode, get_format

    fnuz = get_format("e4m3fnuz")
    assert torch.equal(decode(codes, fnuz) * scale, q.dequantized_weight_2d())
