"""``--kv-cache fp8``: K (after RoPE) and V scales from the one calibration pass, per tensor or
per KV head, written as vLLM reads them (``kv_cache_scheme`` + ``<attention>.k_scale`` /
``.v_scale``), re-installed by ``fp8ptq.load``, simulated when evaluating, checked by
``validate``. The tiny Llama has grouped-query attention (2 KV heads for 4 query heads)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp8ptq.checkpoint import load_quantized
from fp8ptq.checkpoint.validate import validate
from tiny_models import IDS, KV_CALIB, gqa_source, invoke, quantize_per_granularity, run, tiny

KV_HEADS, LAYERS = 2, 2


@pytest.fixture(scope="module")
def src(tmp_path_factory, word_tokenizer):
    return gqa_source(tmp_path_factory.mktemp("gqa"), word_tokenizer, KV_HEADS)


@pytest.fixture(scope="module")
def checkpoints(src):
    return quantize_per_granularity(src, "--kv-cache", "fp8")


def kv_tensors(ck):
    t = load_file(ck / "model.safetensors")
    return {k: v for k, v in t.items() if k.endswith(("k_scale", "v_scale"))}


@pytest.mark.parametrize("granularity,strategy,shape", [
    ("tensor", "tensor", (1,)), ("head", "attn_head", (KV_HEADS, 1, 1))])
def test_every_attention_layer_has_both_scales(checkpoints, granularity, strategy, shape):
    from compressed_tensors.quantization import QuantizationArgs

    ck = checkpoints[granularity]
    qc = json.loads((ck / "config.json").read_text())["quantization_config"]
    args = QuantizationArgs.model_validate(qc["kv_cache_scheme"])
    assert (args.num_bits, args.type, args.symmetric, args.dynamic, args.strategy) == (
        8, "float", True, False, strategy)
    assert args.observer == "minmax"
    t = kv_tensors(ck)
    want = {f"model.layers.{i}.self_attn.{k}" for i in range(LAYERS) for k in ("k_scale",
                                                                               "v_scale")}
    assert set(t) == want  # vLLM would use 1.0 for a missing one
    for name, s in t.items():
        assert s.dtype == torch.float32 and tuple(s.shape) == shape, name
        assert bool(torch.isfinite(s).all()) and bool((s > 0).all()), name


def test_per_tensor_scale_is_the_largest_head_scale(checkpoints):
    """The same calibration pass: per tensor = max over the KV heads; heads differ."""
    tensor, head = kv_tensors(checkpoints["tensor"]), kv_tensors(checkpoints["head"])
    for name, s in head.items():
        assert torch.equal(tensor[name].reshape(()), s.max()), name
    assert any(s.flatten().unique().numel() == KV_HEADS for s in head.values())


@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_reload_quantizes_k_and_v(checkpoints, granularity):
    model = load_quantized(checkpoints[granularity], dtype=torch.float32).model
    meta = json.loads((checkpoints[granularity] / "fp8ptq.json").read_text())
    kv = {k: e for k, e in meta["taps"].items() if e["kind"] == "kv"}
    assert len(kv) == 2 * LAYERS and all(e["granularity"] == granularity for e in kv.values())
    with_kv = run(model, IDS[:2])
    from fp8ptq.taps.tap_sites import ATTENTION_OWNERS

    taps = ATTENTION_OWNERS[model.model.layers[0].self_attn][0]
    assert set(taps.stats) == {f"model.layers.{i}.self_attn:{r}" for i in range(LAYERS)
                               for r in "kv"}
    taps.mode = "pass"  # K and V unquantized: the logits move
    without = run(model, IDS[:2])
    assert not torch.equal(with_kv, without)
    assert (with_kv - without).abs().max() < 0.1 * without.abs().max()


def test_validate_checks_names_shapes_and_values(checkpoints, tmp_path):
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(checkpoints["head"], ck)
    assert validate(ck, ("vllm",), reload=False).valid
    f = ck / "model.safetensors"
    t = load_file(f)
    del t["model.layers.1.self_attn.v_scale"]
    t["model.layers.0.self_attn.k_scale"] = torch.ones(1)  # a per-tensor shape under attn_head
    t["model.layers.1.self_attn.k_scale"] = torch.tensor([[[1.0]], [[float("nan")]]])
    save_file(t, f, metadata={"format": "pt"})
    res = invoke(["validate", ck, "--runtime", "vllm", "--no-reload"])
    assert res.exit_code == 4, res.output
    lines = [ln for ln in res.stdout.splitlines() if "[kv-scales]" in ln]
    assert any("layers.1.self_attn" in ln and "v_scale is missing" in ln for ln in lines)
    assert any("layers.0.self_attn.k_scale" in ln and "(2, 1, 1)" in ln for ln in lines)
    assert any("layers.1.self_attn.k_scale" in ln and "finite" in ln for ln in lines)


def test_kv_cache_refusals_and_moot_granularity(src, tmp_path):
    res = invoke(["quantize", src / "gqa", "-o", tmp_path / "b", *KV_CALIB,
                  "--kv-granularity", "head", "--kv-cache", "fp8"])
    assert res.exit_code != 0 and not (tmp_path / "b").exists()  # needs calibration data
    res = invoke(["quantize", src / "gqa", "-o", tmp_path / "c", *KV_CALIB,
                  "--kv-granularity", "head"])
    assert res.exit_code == 0 and "--kv-granularity head (the KV cache is not quantized)" in \
        res.stderr


@pytest.mark.slow
def test_eval_simulates_the_fp8_kv_cache(src, checkpoints, tmp_path):
    """The eval table prices the FP8 KV cache: an in-memory variant with --kv-cache scores what
    its checkpoint scores (reloaded with its KV scales), and not what the variant without it
    scores."""
    wiki = src / "wiki.raw"
    wiki.write_text(" = Fox = \n\n the quick brown fox jumps over the lazy dog hello world "
                    "and hello again a small model reads a few words of text \n" * 30)
    docs = {}
    for name, flags in (("kv", ["--compare", f"e4m3,{checkpoints['head']}", "--kv-cache", "fp8",
                                "--kv-granularity", "head"]), ("plain", ["--compare", "e4m3"])):
        out = tmp_path / f"{name}.json"
        res = invoke(["eval", src / "gqa", "--tasks", "wikitext", "--data", f"wikitext={wiki}",
                      "--calib-data", src / "calib.txt", "--num-samples", "4",
                      "--calib-seq-len", "16", "--weight-calib", "max", "--dtype", "float32",
                      "--json", out, *flags])
        assert res.exit_code == 0, res.output
        docs[name] = {v["name"]: v for v in json.loads(out.read_text())["variants"]}
    ppl = {f"{k}:{n}": v["metrics"]["wikitext.token_perplexity"] for k, d in docs.items()
           for n, v in d.items()}
    assert docs["kv"]["e4m3"]["recipe"]["kv_cache"] == "fp8"
    assert ppl["kv:e4m3"] == ppl["kv:head"]  # in memory = the checkpoint reloaded
    assert ppl["kv:e4m3"] != ppl["plain:e4m3"]
    assert ppl["kv:baseline"] == ppl["plain:baseline"]


def test_kv_cache_alone_quantizes_no_gemm():
    """--skip '*' --kv-cache fp8 prices the KV cache alone: no GEMM quantized, K and V taps."""
    from fp8ptq.config.recipe import Recipe
    from fp8ptq.execution.in_memory import quantize_model, token_batches

    model = tiny("llama", num_key_value_heads=KV_HEADS, attn=None)
    ref = run(model, IDS[:2])
    res = quantize_model(model, Recipe(skip=["*"], kv_cache="fp8", kv_granularity="head",
                                       dtype="float32"), token_batches(IDS, 4))
    assert res.modules == [] and {e["kind"] for e in res.extras["taps"].values()} == {"kv"}
    assert all(len(e["scale"]) == KV_HEADS for e in res.extras["taps"].values())
    out = run(model, IDS[:2])
    assert not torch.equal(out, ref) and (out - ref).abs().max() < 0.1 * ref.abs().max()


def test_validate_reload_with_the_kv_cache(checkpoints):
    """transformers quantizes the KV cache only where compressed-tensors treats its attention as
    KV-cached: the reload is compared with fp8ptq.load's K / V taps on and off, both recorded."""
    report = validate(checkpoints["head"], ("transformers",))
    r = report.reload
    assert report.valid and r["ok"], r
    assert r["kv_cache_off"]["relative"] != r["relative"]  # the KV taps change the logits
    best = r["relative"] if r["transformers_quantizes_kv_cache"] else \
        r["kv_cache_off"]["relative"]
    assert best <= r["tolerance"]
