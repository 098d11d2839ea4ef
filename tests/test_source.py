"""Reading checkpoints without building models: ``fp8ptq.io.source`` (shards, headers, where MODEL
lives), ``fp8ptq.io.weight_map`` (transformers' key rules) and ``fp8ptq.formats.weight_quant`` (the
one-sweep round-to-nearest every weight goes through)."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp8ptq.errors import DataError, NumericsError
from fp8ptq.formats import decode, encode, get_format
from fp8ptq.formats.granularity import weight_granularity
from fp8ptq.formats.registry import preset_names
from fp8ptq.formats.scales import sqnr_db
from fp8ptq.formats.weight_quant import _decoder, half_layout, quantize_weight
from fp8ptq.io import loading
from fp8ptq.io.loading import resolve_safetensors
from fp8ptq.io.source import SafetensorsSource
from fp8ptq.io.weight_map import SourceMap
from fp8ptq.io.weights import build_empty
from tiny_gguf import tiny_llama_gguf
from tiny_models import tiny


def _saved(model, folder, shard="40KB"):
    model.save_pretrained(folder, max_shard_size=shard)
    return folder


def test_source_reads_every_tensor_of_a_sharded_checkpoint(tmp_path):
    folder = _saved(tiny("llama"), tmp_path / "m")
    src = SafetensorsSource(folder)
    want = {}
    for f in folder.glob("*.safetensors"):
        want.update(load_file(f))
    assert len(list(folder.glob("*.safetensors"))) > 2 and set(src.names()) == set(want)
    for name, t in want.items():
        got = src.read_one(name)
        assert got.dtype == t.dtype and torch.equal(got, t), name
    assert src.total_bytes == sum(t.numel() * t.element_size() for t in want.values())
    # file order, then offset order: one sequential pass per file
    order = [(str(src.entries[n].file), src.entries[n].start) for n in src.names()]
    assert order == sorted(order)


def test_truncated_shard_and_missing_tensor_are_one_line(tmp_path):
    folder = _saved(tiny("llama"), tmp_path / "m")
    shard = sorted(folder.glob("*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(DataError, match="corrupt or truncated") as e:
        SafetensorsSource(folder)
    assert shard.name in str(e.value) and "\n" not in str(e.value)
    shard.write_bytes(data)
    index = folder / "model.safetensors.index.json"
    meta = json.loads(index.read_text())
    meta["weight_map"]["model.layers.9.mlp.up_proj.weight"] = shard.name
    index.write_text(json.dumps(meta))
    with pytest.raises(DataError, match="model.layers.9.mlp.up_proj.weight .* missing"):
        SafetensorsSource(folder)


def test_single_file_and_what_is_not_a_safetensors_checkpoint(tmp_path):
    save_file({"a": torch.arange(6.0).reshape(2, 3)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")
    assert torch.equal(SafetensorsSource(tmp_path).read_one("a"), torch.arange(6.0).reshape(2, 3))
    assert resolve_safetensors(str(tmp_path)) == (tmp_path.resolve(), "local")
    (tmp_path / "fp8ptq.json").write_text("{}")
    assert "already quantized" in resolve_safetensors(str(tmp_path))
    bin_only = tmp_path / "bin"
    bin_only.mkdir()
    (bin_only / "config.json").write_text("{}")
    assert "no config.json with safetensors" in resolve_safetensors(str(bin_only))
    assert "not a safetensors checkpoint" in resolve_safetensors(str(tmp_path / "x.pt"))


def test_hub_id_resolves_to_its_local_snapshot(tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    snap = hub / "models--org--tiny" / "snapshots" / "abc123"
    _saved(tiny("llama"), snap)
    (hub / "models--org--tiny" / "refs").mkdir()
    (hub / "models--org--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(hub))
    assert resolve_safetensors("org/tiny") == (snap, "hub")
    assert "no local snapshot of org/other" in resolve_safetensors("org/other")


def test_gguf_resolves_to_its_converted_cache(tmp_path, monkeypatch):
    gguf = tiny_llama_gguf(tmp_path / "tiny.gguf")
    made = []
    real = loading.convert_gguf
    monkeypatch.setattr(loading, "convert_gguf", lambda p, t, task: made.append(p) or real(p, t))
    folder, kind = resolve_safetensors(str(gguf))
    assert kind == "gguf" and folder == loading.gguf_cache_dir(gguf.resolve())
    assert SafetensorsSource(folder).names() and made == [gguf.resolve()]
    assert resolve_safetensors(str(gguf)) == (folder, "gguf") and len(made) == 1  # cached


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_source_map_builds_what_from_pretrained_builds(arch, tmp_path):
    """Per-expert checkpoint tensors are fused by transformers' own converters, renamed keys
    (Mixtral's block_sparse_moe) found: every parameter equal, in from_pretrained's dtype."""
    model = tiny(arch)
    folder = _saved(model, tmp_path / arch, "50KB")
    src = SafetensorsSource(folder)
    meta = build_empty(folder, torch.bfloat16)
    smap = SourceMap(meta, src.names(), torch.bfloat16)
    ref = type(model).from_pretrained(folder, dtype=torch.bfloat16).state_dict()
    got = {}
    for load in smap.loads:
        got.update(smap.realize(load, src.read_one))
    assert set(got) == set(ref) and not smap.unused
    assert any(load.converter is not None for load in smap.loads)
    for k, v in ref.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


@pytest.mark.parametrize("gran", ["tensor", "channel", "block"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e4m3fnuz", "hif8", "int8"])
def test_weight_sweep_matches_whole_matrix_arithmetic(gran, fmt):
    torch.manual_seed(0)
    w = (torch.randn(300, 150) * torch.rand(300, 1)).to(torch.bfloat16)
    g, spec = weight_granularity(gran, 64), get_format(fmt)
    scale = (g.amax(w.float()) / spec.calibration_max).clamp(min=1e-12)
    q = quantize_weight(w, scale, spec, g)
    wf = w.float()
    codes = encode(wf / g.expand(scale, wf), spec)
    assert torch.equal(q.codes, codes)
    want = sqnr_db(wf, decode(codes, spec) * g.expand(scale, wf))
    assert q.sqnr_db == pytest.approx(want, rel=1e-8) and q.amax == float(wf.abs().max())


def test_half_layout_decodes_every_finite_code_exactly():
    """The SQNR sweep decodes through float16 bits where that is exact; the layouts are the
    hand-derived ones (float16 bias 15: e4m3 bias 7 -> 2^8, e4m3fnuz bias 8 -> 2^7, e5m2 is
    float16's top byte); HiF8, HFP8, e5m2fnuz (finite values at float16's inf exponent) and
    int8 keep their table."""
    want = {"e4m3": (7, 256.0), "e5m2": (8, 1.0), "e4m3fnuz": (7, 128.0),
            # MX elements: e4m3 / e5m2
            "mxfp8": (7, 256.0), "mxfp8-ceil": (7, 256.0), "mxfp8-e5m2": (8, 1.0)}
    codes = torch.arange(256, dtype=torch.uint8)
    for name in preset_names():
        spec = get_format(name)
        if name in want:
            assert half_layout(spec) == want[name], name
        if name in ("hif8", "hfp8", "e5m2fnuz", "int8"):
            assert half_layout(spec) is None, name
        table = decode(codes, spec)
        finite = torch.isfinite(table)
        got = _decoder(spec)(codes)
        assert torch.equal(got[finite], table[finite]), name
    e3m4 = get_format("e3m4")  # a generic ExMy with IEEE specials: bias 3 -> 2^12
    assert half_layout(e3m4) == (6, 4096.0)
    table = decode(codes, e3m4)
    assert torch.equal(_decoder(e3m4)(codes)[torch.isfinite(table)], table[torch.isfinite(table)])


def test_weight_sweep_is_thread_count_independent_and_refuses_nan():
    w = torch.randn(2000, 600)
    spec, g = get_format("e4m3"), weight_granularity("channel")
    scale = g.amax(w) / spec.max
    threads, results = torch.get_num_threads(), []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(quantize_weight(w, scale, spec, g).sqnr_db)
    finally:
        torch.set_num_threads(threads)
    assert results[0] == results[1] and math.isfinite(results[0])
    w[1500, 3] = float("nan")
    with pytest.raises(NumericsError, match="layer.x contains NaN"):
        quantize_weight(w, scale, spec, g, name="layer.x")
