"""GGUF sources: the streaming conversion equals transformers' GGUF loader tensor for tensor and
holds about one block, and ``--sequential`` quantizes a ``.gguf`` from its converted copy
bit-identically to the in-memory pipeline (``--propagate fp``)."""

import json
import tracemalloc

import gguf
import pytest
import torch
import transformers.modeling_gguf_pytorch_utils as hf_gguf
from transformers import AutoModelForCausalLM, AutoTokenizer

from fp8ptq.config.recipe import Recipe
from fp8ptq.execution import strategy
from fp8ptq.io import gguf_convert, loading
from fp8ptq.io.gguf_convert import convert_gguf
from fp8ptq.io.source import SafetensorsSource
from test_sequential import checkpoint_tensors
from tiny_gguf import moe_gguf, moe_model, tiny_llama_gguf, tiny_qwen2moe_gguf
from tiny_models import IDS, STATIC, invoke, run

WRITERS = {"llama": (tiny_llama_gguf, "LlamaForCausalLM", 3),
           "qwen2moe": (tiny_qwen2moe_gguf, "Qwen2MoeForCausalLM", 2)}


@pytest.fixture(params=sorted(WRITERS))
def any_gguf(request, tmp_path):
    """Each architecture's GGUF: the Llama, and a Qwen2-MoE whose stacked ``ffn_gate_exps`` and
    ``ffn_up_exps`` tensors become one fused ``gate_up_proj`` (gathered across the block)."""
    (tmp_path / "src").mkdir()
    write, architecture, layers = WRITERS[request.param]
    return write(tmp_path / "src" / "tiny.gguf"), architecture, layers


@pytest.fixture
def gguf_file(tmp_path):
    (tmp_path / "src").mkdir()
    return tiny_llama_gguf(tmp_path / "src" / "tiny.gguf")


def test_conversion_equals_transformers_gguf_loader(any_gguf, tmp_path):
    gguf_file, architecture, layers = any_gguf
    out = convert_gguf(gguf_file, tmp_path / "conv", max_shard_bytes=40_000)  # sharded
    want = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                dtype=torch.float32).state_dict()
    src = SafetensorsSource(out)
    assert len(list(out.glob("model-*.safetensors"))) > 1
    assert set(src.names()) == set(want)
    for name in src.names():
        got = src.read_one(name)
        assert got.dtype == torch.float32 and torch.equal(got, want[name]), name
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [architecture] and config["num_hidden_layers"] == layers
    text = "the cat sat, 3.5 km away"
    ref = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    assert AutoTokenizer.from_pretrained(out)(text).input_ids == ref(text).input_ids


def test_checked_parse_reads_what_gguf_reads(any_gguf):
    """The checked reader (plain-array slices of the mapping, not memmap objects) parses the
    very fields and tensors gguf's own reader does: names, types, every part, every tensor's
    bytes, dtype and shape."""
    path = any_gguf[0]
    mine, ref = gguf_convert.open_gguf(path), gguf.GGUFReader(str(path))
    assert list(mine.fields) == list(ref.fields)
    for name, f in ref.fields.items():
        g = mine.fields[name]
        assert g.types == f.types and g.data == f.data and len(g.parts) == len(f.parts), name
        for a, b in zip(g.parts, f.parts):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), name
    assert len(mine.tensors) == len(ref.tensors) > 0
    for t, r in zip(mine.tensors, ref.tensors):
        assert (t.name, t.tensor_type, list(t.shape)) == (r.name, r.tensor_type, list(r.shape))
        assert t.data.dtype == r.data.dtype and t.data.shape == r.data.shape
        assert t.data.tobytes() == r.data.tobytes(), t.name


def test_conversion_parses_the_file_once(gguf_file, tmp_path, monkeypatch):
    """The config, the processor's config, the name map and the tokenizer are read from one
    parse of the file (they used to parse it four times), gguf's name table is built once
    (not once per submodule), and gguf's and transformers' names are theirs again after."""
    parses, tables = [], []
    real_reader, real_names = gguf.GGUFReader, gguf.get_tensor_name_map

    def counted_reader(path, *args, **kwargs):
        parses.append(str(path))
        return real_reader(path, *args, **kwargs)

    def counted_names(*args):
        tables.append(args)
        return real_names(*args)

    monkeypatch.setattr(gguf, "GGUFReader", counted_reader)
    monkeypatch.setattr(gguf, "get_tensor_name_map", counted_names)
    real_open = gguf_convert.open_gguf  # the checked parse (a truncated file's one line)

    def counted_open(path):
        parses.append(str(path))
        return real_open(path)

    monkeypatch.setattr(gguf_convert, "GGUFReader", counted_reader)
    monkeypatch.setattr(gguf_convert, "open_gguf", counted_open)
    load = hf_gguf.load_gguf_checkpoint
    out = convert_gguf(gguf_file, tmp_path / "conv")
    assert parses == [str(gguf_file)] and len(tables) == 1
    assert gguf.GGUFReader is counted_reader and gguf.get_tensor_name_map is counted_names
    assert hf_gguf.load_gguf_checkpoint is load
    text = "the cat sat, 3.5 km away"
    ref = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    assert AutoTokenizer.from_pretrained(out)(text).input_ids == ref(text).input_ids


@pytest.mark.slow
def test_conversion_holds_about_one_block(tmp_path):
    """Peak traced allocation (numpy arrays the dequantizer makes, which the written tensors
    share) while converting a 6-block model with one-tensor shards: under two blocks' float32
    weights, whereas holding the model would take all six."""
    hidden, inter, layers = 256, 512, 6
    gguf_file = tiny_llama_gguf(tmp_path / "big.gguf", layers=layers, hidden_size=hidden,
                                intermediate_size=inter)
    block = 4 * (2 * hidden * hidden + 2 * hidden * hidden // 2 + 3 * hidden * inter)
    tracemalloc.start()
    try:
        convert_gguf(gguf_file, tmp_path / "conv", max_shard_bytes=1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * block, (peak, block)
    assert SafetensorsSource(tmp_path / "conv").total_bytes > layers * block  # it all arrived


def test_incomplete_gguf_is_refused(gguf_file, tmp_path, monkeypatch):
    real = gguf_convert._stream_tensors

    def drop_norm(reader, processor, key_map, writer):
        written = real(reader, processor, key_map, writer)
        return {k: v for k, v in written.items() if k != "model.norm.weight"}

    monkeypatch.setattr(gguf_convert, "_stream_tensors", drop_norm)
    with pytest.raises(Exception, match="no tensor for model.norm.weight"):
        convert_gguf(gguf_file, tmp_path / "conv")
    assert not (tmp_path / "conv").exists() and list(tmp_path.iterdir()) == [tmp_path / "src"]


@pytest.mark.parametrize("inside", ["header", "tensor"])
def test_truncated_gguf_is_one_line_naming_what_is_missing(gguf_file, tmp_path, inside):
    """A GGUF cut short (an interrupted download): one ``error:`` line naming the file, where it
    ends and what it ends inside (the header, or the tensor whose data is cut), not numpy's
    wording of a short read; exit 2."""
    whole = gguf_file.read_bytes()
    tensor = gguf.GGUFReader(str(gguf_file)).tensors[4]
    cut = 1000 if inside == "header" else tensor.data_offset + tensor.n_bytes // 2
    short = tmp_path / "short.gguf"
    short.write_bytes(whole[:cut])
    res = invoke(["quantize", str(short), "-o", str(tmp_path / "out")])
    where = ("its header (metadata and tensor index)" if inside == "header" else
             f"tensor {tensor.name} (whose data ends at byte "
             f"{tensor.data_offset + tensor.n_bytes:,})")
    assert res.exit_code == 2, res.output
    assert [ln for ln in res.stderr.splitlines() if ln.startswith("error:")] == [
        f"error: truncated GGUF file {short}: it ends at byte {cut:,}, inside {where}"]
    assert not (tmp_path / "out").exists()


def test_moe_expert_widths_come_from_the_file(tmp_path, monkeypatch):
    """transformers' GGUF config mapping reads neither expert width of a Qwen2-MoE, so every
    such model but the one whose widths are the config defaults would get wrong shapes: the
    conversion takes them from the file (``expert_feed_forward_length``,
    ``expert_shared_feed_forward_length``), and a tensor whose shape disagrees with the config
    is refused, leaving nothing behind."""
    (tmp_path / "src").mkdir()
    path = tiny_qwen2moe_gguf(tmp_path / "src" / "w.gguf", moe_width=64, shared_width=96)
    out = convert_gguf(path, tmp_path / "conv")
    config = json.loads((out / "config.json").read_text())
    assert (config["moe_intermediate_size"], config["shared_expert_intermediate_size"]) == (64, 96)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)  # strict shapes
    reader = gguf.GGUFReader(str(path))
    down = next(t for t in reader.tensors if t.name == "blk.1.ffn_down_exps.weight")
    want = torch.from_numpy(gguf.dequantize(down.data, down.tensor_type).copy())
    assert torch.equal(model.model.layers[1].mlp.experts.down_proj.data, want)
    monkeypatch.setattr(gguf_convert, "_complete_config", lambda *a: None)  # transformers' way
    with pytest.raises(Exception, match=r"shared_expert.gate_proj.weight has shape \[96, 32\], "
                                        r"but the architecture its metadata describes expects "
                                        r"\[5632, 32\]"):
        convert_gguf(path, tmp_path / "conv2")
    assert not (tmp_path / "conv2").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conv", "src"]


# family -> the widths, expert count and used count of a MoE unlike its config class's defaults
MOE_GGUFS = {
    "qwen2_moe": dict(moe_intermediate_size=40, shared_expert_intermediate_size=72,
                      num_experts=6, num_experts_per_tok=3),
    "qwen3_moe": dict(moe_intermediate_size=40, head_dim=16, norm_topk_prob=True,
                      num_experts=6, num_experts_per_tok=3),
}


@pytest.mark.parametrize("family", sorted(MOE_GGUFS))
def test_moe_gguf_loads_as_the_transformers_model(family, tmp_path, monkeypatch):
    """A Qwen2-MoE / Qwen3-MoE GGUF (float32 tensors) loads through ``load_model`` with the
    expert widths, expert count and used count of its metadata, and computes the logits of the
    transformers model it was written from, exactly."""
    monkeypatch.setenv("FP8PTQ_CACHE", str(tmp_path / "cache"))
    ref = moe_model(family, layers=2, seed=3, **MOE_GGUFS[family])
    path = moe_gguf(tmp_path / f"{family}.gguf", ref, quantize=False)
    model = loading.load_model(str(path), dtype=torch.float32).model
    assert type(model) is type(ref)
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size", "num_experts",
                "num_experts_per_tok", "head_dim", "norm_topk_prob"):
        assert getattr(model.config, key, None) == getattr(ref.config, key, None), key
    ids = IDS[:2] % 256  # byte tokens of the GGUF vocabulary
    assert torch.equal(run(model, ids), run(ref, ids))


@pytest.mark.slow
def test_sequential_gguf_equals_in_memory(any_gguf, tmp_path):
    gguf_file, architecture, _ = any_gguf
    calib = tmp_path / "calib.txt"
    calib.write_text("the quick brown fox jumps over the lazy dog, then sleeps.\n" * 40)
    args = ["--calib-data", str(calib), "--num-samples", "4", "--seq-len", "32", "--json",
            "--dtype", "float32", *STATIC]
    runs = {}
    for mode, extra in (("memory", ["--no-model-free"]),
                        ("sequential", ["--sequential", "--propagate", "fp"])):
        res = invoke(["quantize", str(gguf_file), "-o", str(tmp_path / mode), *args, *extra])
        assert res.exit_code == 0, (res.output, res.exception)
        runs[mode] = json.loads(res.stdout)
    assert runs["sequential"]["path"] == "sequential"
    assert runs["memory"]["path"] == "in-memory"
    a, b = checkpoint_tensors(tmp_path / "memory"), checkpoint_tensors(tmp_path / "sequential")
    assert set(a) == set(b) and any(k.endswith("input_scale") for k in a)
    if architecture == "Qwen2MoeForCausalLM":  # the fused experts were quantized, not skipped
        assert {"model.layers.1.mlp.experts.gate_up_proj_input_scale",
                "model.layers.1.mlp.experts.down_proj_scale"} <= set(a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    cache = loading.gguf_cache_dir(gguf_file.resolve())
    for mode in runs:
        source = json.loads((tmp_path / mode / "fp8ptq.json").read_text())["source"]
        assert source["kind"] == "gguf" and source["path"] == str(cache)


def test_sequential_needs_a_safetensors_or_gguf_source(tmp_path):
    pt = tmp_path / "m.pt"
    pt.write_bytes(b"")
    with pytest.raises(Exception, match="--sequential reads a safetensors checkpoint or a "
                                        ".gguf file"):
        strategy.choose(str(pt), Recipe(), sequential=True)
