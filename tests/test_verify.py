"""fp8ptq.checkpoint.verify: data-driven checks of a checkpoint before anything is built from it
(fused experts in both layouts, E8M0 scales, a new tensor kind plugged in by one table entry,
headers and scale values only)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import fp8ptq
from fp8ptq.checkpoint import check_checkpoint, save_quantized
from fp8ptq.checkpoint import verify as V
from fp8ptq.config.recipe import Recipe
from fp8ptq.errors import DataError
from fp8ptq.execution.in_memory import quantize_model
from test_moe import batches
from tiny_models import tiny

EXPERTS = "model.layers.0.mlp.experts"


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """A native (channel weights, static activations) and a compressed-tensors (per-tensor
    weights) checkpoint of a tiny Qwen3-MoE with fused experts."""
    root = tmp_path_factory.mktemp("moe")
    for name, recipe in (("native", Recipe(act_granularity="tensor", format="e4m3", batch_size=2)),
                         ("ct", Recipe(act_granularity="tensor",
                                       format="e4m3", batch_size=2, weight_granularity="tensor"))):
        result = quantize_model(tiny("qwen3_moe"), recipe, batches())
        facts = save_quantized(result, recipe, root / name)
        assert facts["layout"] == {"native": "fp8ptq-native", "ct": "compressed-tensors"}[name]
    return root


def edited(src, dst, fn):
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    fn(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_valid_moe_checkpoints_pass(moe):
    for name in ("native", "ct"):
        meta = check_checkpoint(moe / name)
        assert EXPERTS in meta["experts"]


@pytest.mark.parametrize("layout,key,fn,message", [
    ("native", f"{EXPERTS}.gate_up_proj_scale", lambda t: t.fill_(float("nan")),
     "scale value(s) that are NaN"),
    ("native", f"{EXPERTS}.down_proj_input_scale", lambda t: t.fill_(0.0),
     "finite and > 0"),
    ("native", f"{EXPERTS}.down_proj_codes", None, "is missing"),
    ("native", f"{EXPERTS}.gate_up_proj_codes", "shape", "has shape"),
    ("ct", "model.layers.1.mlp.experts.3.down_proj.weight_scale",
     lambda t: t.fill_(float("inf")), "finite and > 0"),
    ("ct", "model.layers.1.mlp.experts.7.up_proj.weight", None, "is missing"),
])
def test_broken_expert_tensors_are_refused_with_their_name(moe, tmp_path, layout, key, fn,
                                                           message):
    def edit(tensors):
        assert key in tensors, sorted(k for k in tensors if "experts" in k)[:8]
        if fn is None:
            del tensors[key]
        elif fn == "shape":
            tensors[key] = tensors[key][:, :-1].contiguous()
        else:
            fn(tensors[key])

    ck = edited(moe / layout, tmp_path / "ck", edit)
    with pytest.raises(DataError) as e:
        fp8ptq.load(ck)
    assert key in str(e.value) and message in str(e.value)


def test_scale_rules_by_storage_dtype():
    assert V.scale_problem(torch.tensor([0.5, 2.0])) is None
    assert "NaN, inf, zero or negative" in V.scale_problem(torch.tensor([0.5, -1.0]))
    assert "NaN, inf, zero or negative" in V.scale_problem(torch.tensor([float("nan")],
                                                                        dtype=torch.bfloat16))
    e8m0 = torch.tensor([127, 0, 254], dtype=torch.uint8)  # 2^0, 2^-127, 2^127: all finite
    assert V.scale_problem(e8m0) is None
    assert "E8M0 scale code(s) 255" in V.scale_problem(torch.tensor([127, 255],
                                                                    dtype=torch.uint8))


def test_a_new_tensor_kind_plugs_in_with_one_table_entry(moe, tmp_path, monkeypatch):
    """E.g. MX blocks: an fp8ptq.json section whose entries imply uint8 E8M0 scales. The
    generic checks (presence, dtype, shape, scale values) apply with no other change."""
    def mx(name, entry, layout):
        yield V.Expect(f"{name}.weight_scale_e8m0", "scale", (torch.uint8,), entry["shape"],
                       source=f"fp8ptq.json mx {name}")

    monkeypatch.setitem(V.EXPECTATIONS, "mx", mx)
    ck = edited(moe / "native", tmp_path / "ck",
                lambda t: t.update({"lm_head.weight_scale_e8m0": torch.tensor(
                    [[127, 255]], dtype=torch.uint8)}))
    meta_file = ck / "fp8ptq.json"
    meta = json.loads(meta_file.read_text())
    meta["mx"] = {"lm_head": {"shape": [1, 2], "weight_format": meta["modules"][next(iter(
        meta["modules"]))]["weight_format"]}}
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(DataError, match="lm_head.weight_scale_e8m0 has 1 E8M0 scale code"):
        check_checkpoint(ck)
    meta["mx"]["lm_head"]["shape"] = [2, 1]
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(DataError, match=r"lm_head.weight_scale_e8m0 has shape \[1, 2\], "):
        check_checkpoint(ck)


def test_checks_read_headers_and_scale_values_only(moe, monkeypatch):
    read = []
    value = V.TensorIndex.value

    def spy(self, key):
        read.append(key)
        return value(self, key)

    monkeypatch.setattr(V.TensorIndex, "value", spy)
    check_checkpoint(moe / "native")
    assert read and all(k.endswith(V.SCALE_SUFFIXES) for k in read)
    assert not [k for k in read if k.endswith(("_codes", ".weight"))]
