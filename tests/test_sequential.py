"""Sequential (block-by-block) quantization: bit-identical to the in-memory pipeline with
``propagate='fp'``, at most two blocks resident, block_inputs spilled under a tiny budget."""

import pytest
import torch

from fp8ptq.config.recipe import Recipe
from fp8ptq.execution.in_memory import quantize_model, token_batches
from fp8ptq.execution.streaming import ActivationStore, quantize_sequential
from fp8ptq.model import block_inputs, forward
from fp8ptq.model.blocks import find_blocks
from fp8ptq.nn.quant_gemm import QuantGemm
from tiny_models import invoke, tiny

VOCAB = 128
IDS = torch.randint(2, VOCAB, (6, 24), generator=torch.Generator().manual_seed(3))


def _tiny(arch):
    kv = {"num_key_value_heads": 2} if arch == "llama" else {}
    return tiny(arch, **{"n_layer" if arch == "gpt2" else "num_hidden_layers": 3}, **kv)


def _saved(arch, tmp_path):
    model = _tiny(arch).eval()
    folder = tmp_path / arch
    model.save_pretrained(folder, max_shard_size="100KB")  # sharded: blocks span files
    return folder


def _quant_state(model):
    return {f"{n}.{b}": t for n, m in model.named_modules() if isinstance(m, QuantGemm)
            for b, t in m.named_buffers(recurse=False) if t is not None}


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "opt"])
def test_sequential_fp_propagation_is_bit_identical(arch, tmp_path):
    folder = _saved(arch, tmp_path)
    recipe = Recipe(act_granularity="tensor", dtype="float32", act_calib="best")
    batches = list(token_batches(IDS, 3))
    ref = type(_tiny(arch)).from_pretrained(folder, dtype=torch.float32).eval()
    quantize_model(ref, recipe, batches)
    result, loader = quantize_sequential(folder, recipe, batches, propagate="fp")
    want, got = _quant_state(ref), _quant_state(result.model)
    assert want and set(want) == set(got)
    for name in want:
        assert torch.equal(want[name], got[name]), name
    assert loader.max_resident <= 2
    assert result.extras["sequential"]["blocks"] == 3
    with torch.no_grad():
        assert torch.equal(ref(input_ids=IDS).logits, result.model(input_ids=IDS).logits)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_micro_batched_block_forwards_stay_bit_identical(arch, tmp_path, monkeypatch):
    """Pieces of one sequence (MICRO_TOKENS = 24): the in-memory statistics pass and the
    sequential blocks' statistics and carrying all run in pieces, and still agree bit for bit."""
    monkeypatch.setattr(forward, "MICRO_TOKENS", 24)
    rows = []
    real = forward.micro_batch_spans
    monkeypatch.setattr(block_inputs, "micro_batch_spans",
                        lambda b, *a, **k: rows.extend(
                            p["hidden_states"].shape[0] for _, p in real(b, *a, **k))
                        or real(b, *a, **k))
    folder = _saved(arch, tmp_path)
    recipe = Recipe(act_granularity="tensor", dtype="float32")
    batches = list(token_batches(IDS, 3))
    ref = type(_tiny(arch)).from_pretrained(folder, dtype=torch.float32).eval()
    quantize_model(ref, recipe, batches)
    result, _ = quantize_sequential(folder, recipe, batches, propagate="fp")
    assert rows and set(rows) == {1}  # the blocks were carried one sequence at a time
    want, got = _quant_state(ref), _quant_state(result.model)
    assert want and set(want) == set(got)
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_spill_under_tiny_budget_gives_the_same_result(tmp_path, monkeypatch):
    folder = _saved("llama", tmp_path)
    recipe = Recipe(act_granularity="tensor", dtype="float32")
    batches = list(token_batches(IDS, 2))
    spilled = []
    real_close = ActivationStore.close

    def close(self):
        spilled.append(self.spilled)
        real_close(self)

    monkeypatch.setattr(ActivationStore, "close", close)
    big, _ = quantize_sequential(folder, recipe, batches, propagate="fp")
    assert sum(spilled) == 0
    tiny, _ = quantize_sequential(folder, recipe, batches, propagate="fp", activation_budget=0,
                                  spill_dir=tmp_path)
    assert sum(spilled) >= 3 * len(batches)
    a, b = _quant_state(big.model), _quant_state(tiny.model)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_quantized_propagation_differs_and_stays_close(tmp_path):
    folder = _saved("llama", tmp_path)
    recipe = Recipe(act_granularity="tensor", dtype="float32")
    batches = list(token_batches(IDS, 3))
    fp, _ = quantize_sequential(folder, recipe, batches, propagate="fp")
    q, _ = quantize_sequential(folder, recipe, batches, propagate="quantized")
    a, b = _quant_state(fp.model), _quant_state(q.model)
    block0 = [k for k in a if ".layers.0." in k and k.endswith("input_scale")]
    later = [k for k in a if ".layers.2." in k and k.endswith("input_scale")]
    assert all(torch.equal(a[k], b[k]) for k in block0)  # block 0 sees the same inputs
    assert any(not torch.equal(a[k], b[k]) for k in later)  # later blocks see quantized error
    assert all(torch.allclose(a[k], b[k], rtol=0.2) for k in later)


def test_find_blocks_is_generic():
    assert find_blocks(_tiny("llama"))[0] == "model.layers"
    assert find_blocks(_tiny("gpt2"))[0] == "transformer.h"
    assert find_blocks(_tiny("opt"))[0] == "model.decoder.layers"


def test_activation_store_round_trips_bfloat16(tmp_path):
    s = ActivationStore(0, tmp_path)
    t = torch.randn(3, 5).to(torch.bfloat16)
    s.put(0, t)
    assert s.spilled == 1 and torch.equal(s.get(0), t)
    s.close()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "int8", "hif8", "hfp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantgemm_holds_the_weight_once(fmt, dtype):
    """Only the dequantized weight (+ scales) is stored; the codes come back bit-exact."""
    from fp8ptq.formats import encode, get_format
    from fp8ptq.formats.granularity import weight_granularity

    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 48).to(dtype)
    spec, gran = get_format(fmt), weight_granularity("channel", 128)
    w = lin.weight.detach().float()
    scale = w.abs().amax(dim=1) / spec.max
    codes = encode(w / gran.expand(scale, w), spec)
    q = QuantGemm(lin, weight_format=spec, weight_codes=codes, weight_scale=scale,
                  weight_granularity=gran, act_format=None, input_scale=None)
    assert not q.holds_codes
    assert torch.equal(q.weight_codes, codes)
    held = sum(t.numel() * t.element_size() for t in [*q.parameters(), *q.buffers()])
    assert held == 48 * 96 * lin.weight.element_size() + 48 * 4 + 48 * lin.weight.element_size()


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_quantgemm_makes_no_whole_weight_float32_temporary(granularity, monkeypatch):
    """Building a ``QuantGemm`` (codes -> dequantized bf16 weight, and the check that the codes
    come back) and reading its codes work on row chunks: no op allocates a float32 copy of the
    whole weight (on a 13824 x 5120 GEMM those made the peak of a sequential block, ~0.9 GB
    over its 141 MB of bf16), and the values are the whole-matrix expression's bit for bit.
    The chunk is made 16x smaller than this weight (the real one is 2^22 elements)."""
    from torch.profiler import ProfilerActivity, profile

    from fp8ptq.formats import decode, encode, get_format, weight_quant
    from fp8ptq.formats.granularity import weight_granularity

    monkeypatch.setattr(weight_quant, "BY_ROWS_ELEMENTS", 1 << 15)

    torch.manual_seed(0)
    lin = torch.nn.Linear(512, 1024).to(torch.bfloat16)
    spec, gran = get_format("e4m3"), weight_granularity(granularity, 128)
    w = lin.weight.detach().float()
    scale = gran.amax(w) / spec.max
    codes = encode(w / gran.expand(scale, w), spec)
    want = (decode(codes, spec) * gran.expand(scale, w)).to(torch.bfloat16)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        q = QuantGemm(lin, weight_format=spec, weight_codes=codes, weight_scale=scale,
                      weight_granularity=gran, act_format=None, input_scale=None)
        back = q.weight_codes
    largest = max(e.self_cpu_memory_usage for e in prof.events() if e.name != "[memory]")
    assert 0 < largest <= w.numel() * 2  # the bf16 result (2 bytes an element) at most
    assert torch.equal(q.weight, want) and torch.equal(back, codes) and not q.holds_codes


def test_cli_sequential_writes_the_same_checkpoint_and_transformers_loads_it(tmp_path,
                                                                               word_tokenizer):
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM


    folder = _saved("llama", tmp_path)
    word_tokenizer.save_pretrained(folder)
    calib = tmp_path / "calib.txt"
    calib.write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    args = ["--calib-data", str(calib), "--num-samples", "4", "--seq-len", "16", "--json",
            "--act-granularity", "tensor", "--weight-calib", "max"]
    outs = {}
    for mode, extra in (("memory", []), ("sequential", ["--sequential", "--propagate", "fp"])):
        out = tmp_path / mode
        res = invoke(["quantize", str(folder), "-o", str(out), *args, *extra])
        assert res.exit_code == 0, (res.output, res.exception)
        assert json.loads(res.stdout)["peak_rss_mb"] > 0
        outs[mode] = out
    a = {k: v for f in sorted(outs["memory"].glob("*.safetensors"))
         for k, v in load_file(f).items()}
    b = {k: v for f in sorted(outs["sequential"].glob("*.safetensors"))
         for k, v in load_file(f).items()}
    assert set(a) == set(b) and any(k.endswith("input_scale") for k in a)
    assert all(torch.equal(a[k].view(torch.uint8) if a[k].dtype == torch.float8_e4m3fn else a[k],
                           b[k].view(torch.uint8) if b[k].dtype == torch.float8_e4m3fn else b[k])
               for k in a)
    m = AutoModelForCausalLM.from_pretrained(outs["sequential"])
    with torch.no_grad():
        assert torch.isfinite(m(input_ids=IDS[:, :8] % 10).logits).all()


def checkpoint_tensors(folder):
    from safetensors.torch import load_file

    out = {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}
    return {k: v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v
            for k, v in out.items()}


def _meta(folder):
    import json

    meta = json.loads((folder / "fp8ptq.json").read_text())
    for key in ("created", "command", "files"):
        meta.pop(key)
    return meta


@pytest.mark.parametrize("arch,recipe", [
    ("llama", dict(quantize_lm_head=True)),  # tied embeddings, a GEMM outside the blocks
    ("opt", dict(act_granularity="token", weight_granularity="channel")),
])
def test_blocks_written_as_quantized_equal_the_whole_model_saved(arch, recipe, tmp_path):
    """``write_sequential`` writes each block as soon as it is quantized and frees it; the
    checkpoint (tensors and fp8ptq.json) is the one ``save_quantized`` writes from the whole
    sequential result, and a freed block never comes back: at most one quantized block plus
    the one loading hold real tensors."""
    from fp8ptq.checkpoint import save_quantized
    from fp8ptq.execution.streaming import BlockLoader, write_sequential

    model = tiny(arch, **({"tie_word_embeddings": True} if arch == "llama" else {}),
                 **{"num_hidden_layers": 3})
    folder = tmp_path / arch
    model.save_pretrained(folder, max_shard_size="100KB")
    recipe = Recipe(**{"act_granularity": "tensor", "dtype": "float32", **recipe})
    batches = list(token_batches(IDS, 3))
    whole, _ = quantize_sequential(folder, recipe, batches, propagate="fp")
    save_quantized(whole, recipe, tmp_path / "whole")

    real = BlockLoader.load_block
    resident = []

    def load_block(self, index, prefix):
        _, blocks = find_blocks(self.model)
        resident.append(sum(not next(b.parameters()).is_meta for b in blocks))
        real(self, index, prefix)

    BlockLoader.load_block = load_block
    try:
        streamed, sizes = write_sequential(folder, recipe, batches, tmp_path / "streamed",
                                           propagate="fp")
    finally:
        BlockLoader.load_block = real
    assert resident == [0, 0, 0]  # each block written and freed before the next loads
    _, blocks = find_blocks(streamed.model)
    assert all(p.is_meta for p in blocks.parameters())
    a, b = checkpoint_tensors(tmp_path / "whole"), checkpoint_tensors(tmp_path / "streamed")
    assert set(a) == set(b) and any(k.endswith("weight_scale") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert _meta(tmp_path / "whole") == _meta(tmp_path / "streamed")
    assert sizes["checkpoint_bytes"] == sum(
        f.stat().st_size for f in (tmp_path / "streamed").glob("*.safetensors"))


def test_a_failing_block_write_leaves_nothing(tmp_path, monkeypatch):
    from fp8ptq.checkpoint.writer import CheckpointWriter
    from fp8ptq.errors import Fp8ptqError
    from fp8ptq.execution.streaming import write_sequential

    folder = _saved("llama", tmp_path)
    calls = []

    def add_block(self, block, prefix="", reports=None):
        calls.append(prefix)
        if len(calls) == 2:
            raise OSError("disk went away")

    monkeypatch.setattr(CheckpointWriter, "add_block", add_block)
    with pytest.raises(Fp8ptqError, match="disk went away; nothing was written"):
        write_sequential(folder, Recipe(act_granularity="tensor",
                                        dtype="float32"), list(token_batches(IDS, 3)),
                         tmp_path / "out")
    assert calls == ["model.layers.0.", "model.layers.1."]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama"]


def test_the_writer_holds_at_most_one_shard_of_the_size_asked(tmp_path, monkeypatch):
    """The writer keeps the open shard's tensors until it is full, so the shard size bounds
    what sequential mode holds besides the block (``--max-memory`` sizes it,
    ``route.shard_bytes``): every shard written stays under ``max_shard_bytes``, and the
    tensors are those of the one-shard checkpoint."""
    from fp8ptq.checkpoint.shards import ShardWriter
    from fp8ptq.execution.streaming import write_sequential

    folder = _saved("llama", tmp_path)
    recipe, batches = Recipe(act_granularity="tensor", dtype="float32"), list(token_batches(IDS, 3))
    written = []
    real = ShardWriter._write

    def _write(self, tensors):
        written.append(sum(t.numel() * t.element_size() for t in tensors.values()))
        real(self, tensors)

    monkeypatch.setattr(ShardWriter, "_write", _write)
    write_sequential(folder, recipe, batches, tmp_path / "one")
    assert len(written) == 1  # default 2 GiB: the whole tiny checkpoint in one shard
    whole, written[:] = written[0], []
    limit = 40_000  # above the largest tensor (the 128 x 64 float32 embeddings: 32 KiB)
    write_sequential(folder, recipe, batches, tmp_path / "small", max_shard_bytes=limit)
    assert len(written) >= whole // limit and max(written) <= limit
    assert sum(written) == whole
    assert len(list((tmp_path / "small").glob("model-*-of-*.safetensors"))) == len(written)
    a, b = checkpoint_tensors(tmp_path / "one"), checkpoint_tensors(tmp_path / "small")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
