"""Checkpoint layouts as a registry, the layout chosen before quantizing, and the streaming writer:
a checkpoint written piece by piece (per block, per tensor, from a meta-device model) equals the
one ``save_quantized`` writes at once."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import safe_open

import fp8ptq
from fp8ptq.checkpoint import (
    CheckpointWriter,
    ShardWriter,
    check_checkpoint,
    choose_layout,
    describe_model,
    describe_plan,
    get_layout,
    layouts,
    model_type_of,
    read_metadata,
    save_quantized,
)
from fp8ptq.checkpoint.contents import gemm_quant, plain_tensors
from fp8ptq.checkpoint.layouts.native import NativeLayout
from fp8ptq.config.plan import build_plan
from fp8ptq.config.recipe import Recipe
from fp8ptq.errors import Fp8ptqError, UsageError
from fp8ptq.execution.in_memory import quantize_model, token_batches
from fp8ptq.nn.quant_gemm import QuantGemm
from tiny_models import IDS, run, tiny

BUILD = {"llama": lambda: tiny("llama"), "gpt2": lambda: tiny("gpt2"),
         "moe": lambda: tiny("qwen3_moe", num_experts=4)}
CHOICES = [
    # (architecture, recipe, expected layout)
    ("llama", Recipe(dtype="float32"), "compressed-tensors"),
    ("llama", Recipe(dtype="float32", format="int8", act_granularity="token"),
     "compressed-tensors"),
    ("llama", Recipe(dtype="float32", overrides={"*.down_proj": "e5m2"}), "fp8ptq-native"),
    ("llama", Recipe(dtype="float32", weight_granularity="block", block_size=32,
                     act_format="none"), "compressed-tensors"),
    ("gpt2", Recipe(dtype="float32"), "fp8ptq-native"),
    ("moe", Recipe(dtype="float32", weight_granularity="tensor", act_granularity="tensor"),
     "compressed-tensors"),
    ("moe", Recipe(dtype="float32", act_granularity="tensor"), "fp8ptq-native"),  # channel W
    # + static A: not servable
    ("moe", Recipe(dtype="float32", format="hif8"), "fp8ptq-native"),
]


@pytest.mark.slow
@pytest.mark.parametrize("arch,recipe,expected", CHOICES,
                         ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(CHOICES)])
def test_layout_chosen_from_the_plan_equals_the_one_from_the_quantized_model(arch, recipe,
                                                                             expected):
    model = BUILD[arch]()
    plan = build_plan(model, recipe)
    before = describe_plan(plan)
    choice_before = choose_layout(before, model_type=model_type_of(model))
    quantize_model(model, recipe, token_batches(IDS, 4), plan=plan)
    after = describe_model(model)
    assert before == after
    choice_after = choose_layout(after, model_type=model_type_of(model))
    assert (choice_before.name, choice_before.reason, choice_before.warning) == \
        (choice_after.name, choice_after.reason, choice_after.warning)
    assert choice_after.name == expected
    if arch == "moe" and expected == "fp8ptq-native" and recipe.format == "e4m3":
        assert "vLLM would not serve it" in choice_after.warning  # a recipe choice: say so


def _tensors(folder: Path) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                t = h.get_tensor(k).contiguous()
                out[k] = (t.dtype, tuple(t.shape), hashlib.sha256(
                    t.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest())
    return out


def _meta(folder: Path) -> dict:
    meta = json.loads((folder / "fp8ptq.json").read_text())
    for volatile in ("created", "command"):
        meta.pop(volatile)
    return meta


def _same_checkpoint(a: Path, b: Path, *, same_files=True):
    ta, tb = _tensors(a), _tensors(b)
    assert ta == tb and ta
    ma, mb = _meta(a), _meta(b)
    if not same_files:
        ma.pop("files"), mb.pop("files"), ma.pop("sizes"), mb.pop("sizes")
    assert ma == mb
    assert json.loads((a / "config.json").read_text()) == \
        json.loads((b / "config.json").read_text())
    if same_files:
        for f in a.glob("*.safetensors"):
            assert f.read_bytes() == (b / f.name).read_bytes(), f.name


def _quantized(arch, recipe):
    model = BUILD[arch]()
    return quantize_model(model, recipe, token_batches(IDS, 4))


@pytest.mark.slow
@pytest.mark.parametrize("arch,recipe", [
    ("llama", Recipe(dtype="float32", quantize_attention=True)),
    ("gpt2", Recipe(dtype="float32", format="hif8")),
    ("moe", Recipe(dtype="float32", weight_granularity="tensor")),
    ("moe", Recipe(dtype="float32", format="e5m2")),
], ids=["llama-ct-kv", "gpt2-native", "moe-ct", "moe-native"])
def test_block_by_block_checkpoint_equals_save_quantized(tmp_path, arch, recipe):
    result = _quantized(arch, recipe)
    model = result.model
    save_quantized(result, tmp_path / "once")

    choice = choose_layout(describe_plan(result.plan), model_type=model_type_of(model))
    blocks = model.model.layers if arch != "gpt2" else model.transformer.h
    prefix = "model.layers" if arch != "gpt2" else "transformer.h"
    with CheckpointWriter.open(tmp_path / "blocks", choice) as ckpt:
        for i, block in enumerate(blocks):  # one block at a time, as a sequential run would
            ckpt.add_block(block, f"{prefix}.{i}", result.modules)
        rest = plain_tensors(model, set(ckpt_names(model)),
                             tie_targets=getattr(model, "all_tied_weights_keys", None) or {})
        ckpt.add_tensors({k: v for k, v in rest.items()
                          if not k.startswith(f"{prefix}.")})
        ckpt.add_modules(model, [n for n in ckpt_names(model) if not n.startswith(prefix)],
                         result.modules)
        ckpt.close(model, result.recipe, result=result)
    _same_checkpoint(tmp_path / "once", tmp_path / "blocks")
    assert torch.equal(run(fp8ptq.load(tmp_path / "blocks").model, IDS), run(model, IDS))


def ckpt_names(model):
    return [n for n, _ in layouts.quantized_modules(model)]


def test_model_free_writer_from_a_meta_model_equals_save_quantized(tmp_path):
    """A writer that holds no quantized module: the structure is a meta-device model, each GEMM
    arrives as codes + scales (``add_gemm``), every other tensor as it is (``add_tensors``)."""
    recipe = Recipe(dtype="float32", weight_granularity="block", block_size=32)
    result = _quantized("llama", recipe)
    save_quantized(result, tmp_path / "once")

    with torch.device("meta"):
        skeleton = tiny("llama")  # same architecture, no weights
    descs = {d.name: d for d in describe_plan(build_plan(skeleton, recipe))}
    choice = choose_layout(list(descs.values()), model_type=model_type_of(skeleton))
    source = result.model
    reports = {r.name: r for r in result.modules}
    with CheckpointWriter.open(tmp_path / "free", choice, max_shard_bytes=50_000) as ckpt:
        for name, q in source.named_modules():
            if isinstance(q, QuantGemm):
                ckpt.add_gemm(descs[name], gemm_quant(q), module_class="Linear",
                              weight_shape=q.inner.weight.shape, report=reports[name])
        ckpt.add_tensors(plain_tensors(source, set(descs), tie_targets=getattr(
            source, "all_tied_weights_keys", None) or {}))
        ckpt.close(skeleton, recipe, result=result)
    assert len(list((tmp_path / "free").glob("model-*-of-*.safetensors"))) > 1
    _same_checkpoint(tmp_path / "once", tmp_path / "free", same_files=False)
    check_checkpoint(tmp_path / "free")
    assert torch.equal(run(fp8ptq.load(tmp_path / "free").model, IDS), run(source, IDS))


def test_shard_writer_shards_like_huggingface_hub_and_writes_as_it_goes(tmp_path):
    g = torch.Generator().manual_seed(0)
    sizes = [300, 700, 100, 1200, 50, 400, 400, 900, 10, 600]  # float32 elements
    tensors = {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate(sizes)}
    limit = 2800  # bytes; t3 (4800 bytes) is larger: a shard of its own
    writer = ShardWriter(tmp_path, limit)
    written_before_finish = []
    for k, v in tensors.items():
        writer.add({k: v})
        written_before_finish.append(len(list(tmp_path.iterdir())))
    assert written_before_finish[-1] >= 3  # shards appear while tensors still arrive
    assert writer.peak_buffered_bytes <= limit
    files = writer.finish()
    hub = split_torch_state_dict_into_shards(tensors, max_shard_size=limit)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert files == [*hub.filename_to_tensors, "model.safetensors.index.json"]
    assert index["weight_map"] == hub.tensor_to_filename
    assert index["metadata"] == hub.metadata
    for fname, keys in hub.filename_to_tensors.items():
        with safe_open(str(tmp_path / fname), "pt") as f:
            assert sorted(f.keys()) == sorted(keys)
            for k in keys:
                assert torch.equal(f.get_tensor(k), tensors[k])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files)  # no leftover parts

    one = ShardWriter(tmp_path / "one", 10**9)
    (tmp_path / "one").mkdir()
    one.add(tensors)
    assert one.finish() == ["model.safetensors"]


def test_an_exception_or_a_missing_close_leaves_nothing(tmp_path):
    result = _quantized("llama", Recipe(dtype="float32"))
    out = tmp_path / "ck"
    choice = choose_layout(describe_model(result.model))
    with pytest.raises(RuntimeError, match="boom"):
        with CheckpointWriter.open(out, choice) as ckpt:
            ckpt.add_modules(result.model)
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(Fp8ptqError, match="without close"):
        with CheckpointWriter.open(out, choice) as ckpt:
            ckpt.add_modules(result.model)
    assert list(tmp_path.iterdir()) == []
    ckpt = CheckpointWriter.open(out, choice)
    ckpt.add_modules(result.model)
    with pytest.raises(UsageError, match="added twice"):  # the session aborts itself
        ckpt.add_modules(result.model, ["model.layers.0.self_attn.q_proj"])
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(UsageError, match="closed"):
        ckpt.add_tensors({})
    # a module the chosen layout cannot store is refused at close (here: an e5m2 module
    # written into a compressed-tensors checkpoint by a caller that chose it wrongly)
    e5m2 = _quantized("llama", Recipe(dtype="float32", format="e5m2"))
    with pytest.raises(Fp8ptqError, match="compressed-tensors layout cannot store"):
        with CheckpointWriter.open(out, "compressed-tensors") as ckpt:
            ckpt.add_modules(e5m2.model)
            ckpt.close(e5m2.model, e5m2.recipe, result=e5m2)
    assert list(tmp_path.iterdir()) == []
    # each module fits, the set does not (one 8-bit type per compressed-tensors checkpoint)
    mixed = _quantized("llama", Recipe(dtype="float32", overrides={"*.down_proj": "int8"}))
    assert choose_layout(describe_model(mixed.model)).reason == "float and int modules mixed"
    with pytest.raises(Fp8ptqError, match="cannot store these modules: float and int modules"):
        with CheckpointWriter.open(out, "compressed-tensors") as ckpt:
            ckpt.add_modules(mixed.model)
            ckpt.close(mixed.model, mixed.recipe, result=mixed)
    assert list(tmp_path.iterdir()) == []


class CodesAsQweight(NativeLayout):
    """A layout defined in one class: the native layout with its codes renamed."""

    name = "test-qweight"

    def accepts(self, modules, *, model_type=None):
        return None if all(m.weight_format.name == "e5m2" for m in modules) else "e5m2 only"

    def why(self, modules, *, model_type=None):
        return "every module is e5m2"

    def gemm_tensors(self, desc, q):
        t = super().gemm_tensors(desc, q)
        t[f"{desc.name}.qweight"] = t.pop(f"{desc.name}.weight_codes")
        return t

    def read_gemm(self, tensors, name, entry):
        tensors[f"{name}.weight_codes"] = tensors.pop(f"{name}.qweight")
        return super().read_gemm(tensors, name, entry)

    def expect_gemm(self, name, entry):
        for x in super().expect_gemm(name, entry):
            yield x if not x.key.endswith(".weight_codes") else type(x)(
                f"{name}.qweight", x.role, x.dtypes, x.shape, x.required, x.source)


def test_a_new_layout_is_one_class_and_one_register_line(tmp_path, monkeypatch):
    monkeypatch.setattr(layouts, "_PREFERRED", dict(layouts._PREFERRED))
    layouts.register(CodesAsQweight())
    result = _quantized("llama", Recipe(dtype="float32", format="e5m2"))
    save_quantized(result, tmp_path / "ck")
    meta = read_metadata(tmp_path / "ck")
    assert (meta["layout"], meta["layout_reason"]) == ("test-qweight", "every module is e5m2")
    keys = _tensors(tmp_path / "ck")
    assert "model.layers.0.mlp.down_proj.qweight" in keys
    assert not any(k.endswith("weight_codes") for k in keys)
    check_checkpoint(tmp_path / "ck")  # verify asks the layout what to expect
    assert torch.equal(run(fp8ptq.load(tmp_path / "ck").model, IDS), run(result.model, IDS))
    assert get_layout("test-qweight").name == "test-qweight"
    with pytest.raises(UsageError, match="unknown checkpoint layout"):
        get_layout("nope")
    # other formats still go where they went
    assert choose_layout(describe_model(_quantized("llama", Recipe()).model)).name == \
        "compressed-tensors"
