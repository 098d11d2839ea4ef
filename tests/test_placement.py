"""accelerate placement: --device-map / --max-memory / --offload-folder pass through to
from_pretrained; offloaded blocks (CPU or disk) calibrate through accelerate's hooks and
quantize exactly as an in-memory model does."""

import json

import pytest
import torch
from safetensors.torch import load_file

from fp8ptq.errors import UsageError
from fp8ptq.io.placement import Placement, parse_device_map, parse_max_memory
from tiny_models import invoke, tiny

DOCS = ["the quick brown fox jumps over the lazy dog", "a small model reads a few words of text",
        "hello world and hello again"]
CALIB = ["--num-samples", "8", "--seq-len", "8", "--batch-size", "2"]
DISK_MAP = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
            "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}


@pytest.fixture(scope="module")
def assets(tmp_path_factory, word_tokenizer):
    root = tmp_path_factory.mktemp("placement")
    tiny("llama").save_pretrained(root / "llama")
    word_tokenizer.save_pretrained(root / "llama")
    (root / "calib.txt").write_text("\n".join(DOCS * 10) + "\n")
    (root / "map.json").write_text(json.dumps(DISK_MAP))
    return root


def test_parsers():
    assert parse_device_map("auto") == "auto"
    assert parse_device_map('{"a": "disk", "b": "0", "c": 1}') == {"a": "disk", "b": 0, "c": 1}
    assert parse_max_memory("4gb") == {"cpu": "4GB"}
    assert parse_max_memory("0=20GiB, cpu=64GiB") == {0: "20GiB", "cpu": "64GiB"}
    assert parse_max_memory('{"cpu": "1GB", "cuda:1": "2GB"}') == {"cpu": "1GB", 1: "2GB"}
    for bad in ("fast", '{"a": "tpu"}', "[1, 2]", '{"a": '):
        with pytest.raises(UsageError):
            parse_device_map(bad)
    for bad in ("lots", "gpu=4GB", "cpu=4 apples"):
        with pytest.raises(UsageError):
            parse_max_memory(bad)
    with pytest.raises(UsageError, match="needs --device-map"):
        Placement(max_memory={"cpu": "1GB"}).from_pretrained_kwargs()


def quantize(assets, out, *extra):
    res = invoke(["quantize", str(assets / "llama"), "-o", str(out),
                  "--calib-data", str(assets / "calib.txt"), *CALIB, *extra])
    assert res.exit_code == 0, (res.output, res.exception)
    return load_file(out / "model.safetensors")


@pytest.mark.parametrize("extra", [["--act-calib", "best"], ["--smoothquant", "0.5"]])
def test_disk_offloaded_block_quantizes_like_the_in_memory_model(assets, tmp_path, extra):
    ref = quantize(assets, tmp_path / "ref", *extra)
    offload = tmp_path / "offload"
    got = quantize(assets, tmp_path / "disk", "--device-map", str(assets / "map.json"),
                   "--offload-folder", str(offload), *extra)
    assert ref.keys() == got.keys()
    for key in ref:
        a, b = ref[key], got[key]
        if a.dtype == torch.float8_e4m3fn:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b), key


def test_the_map_really_offloads_and_materializing_restores_the_weights(assets):
    from fp8ptq.io.loading import load_model
    from fp8ptq.io.placement import has_offload, materialize_offloaded, parse_placement

    ref = load_model(str(assets / "llama")).model
    loaded = load_model(str(assets / "llama"),
                        device_map=parse_placement(str(assets / "map.json"), None))
    layer = loaded.model.model.layers[1].self_attn.q_proj
    assert layer.weight.device.type == "meta" and has_offload(loaded.model)
    assert materialize_offloaded(loaded.model) > 0 and not has_offload(loaded.model)
    assert torch.equal(layer.weight, ref.model.layers[1].self_attn.q_proj.weight)


def test_auto_map_with_a_cpu_budget_offloads_and_still_works(assets, tmp_path):
    ref = quantize(assets, tmp_path / "ref")
    got = quantize(assets, tmp_path / "auto", "--device-map", "auto", "--max-memory", "100KB")
    for key in ref:
        assert torch.equal(ref[key].view(torch.uint8) if ref[key].dtype == torch.float8_e4m3fn
                           else ref[key], got[key].view(torch.uint8)
                           if got[key].dtype == torch.float8_e4m3fn else got[key]), key


def test_bad_device_map_is_one_error_line(assets, tmp_path):
    res = invoke(["quantize", str(assets / "llama"), "-o", str(tmp_path / "o"),
                  "--device-map", "everywhere"])
    assert res.exit_code == 2
    assert res.output.count("error:") == 1 and "--device-map" in res.output
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_eval_and_sensitivity_take_the_device_map(assets, tmp_path):
    wiki = tmp_path / "wiki.test.raw"
    wiki.write_text(" = hello world = \n the quick brown fox jumps over the lazy dog . \n"
                    " = the lazy dog = \n hello world and hello again . \n")
    common = ["--calib-data", str(assets / "calib.txt"), *CALIB[:4], "--dtype", "float32"]

    def eval_json(*extra):
        out = tmp_path / f"eval{len(extra)}.json"
        res = invoke([
            "eval", str(assets / "llama"), "--tasks", "wikitext", "--data", f"wikitext={wiki}",
            "--compare", "e4m3", "--calib-batch-size", "2", "--calib-seq-len", "8",
            "--json", str(out), *common[:2], "--num-samples", "8", "--dtype", "float32",
            *extra])
        assert res.exit_code == 0, (res.output, res.exception)
        return {v["name"]: v["metrics"] for v in json.loads(out.read_text())["variants"]}

    plain = eval_json()
    mapped = eval_json("--device-map", str(assets / "map.json"))
    assert plain == mapped  # the same numbers with layer 1 on disk
    res = invoke([
        "sensitivity", str(assets / "llama"), "--format", "e4m3", "--metric", "sqnr",
        "--no-verify", "--device-map", str(assets / "map.json"), *common])
    assert res.exit_code == 0, (res.output, res.exception)
