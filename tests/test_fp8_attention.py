"""FP8 attention, ``--kv-cache fp8 --quantize-attention``: the query (after RoPE) calibrated
beside K and V in the one calibration pass, written as llm-compressor writes attention
quantization (a config group on the attention class, ``kv_cache_scheme`` the same arguments,
``<attention>.q_scale`` beside ``k_scale`` / ``v_scale``), re-installed by ``fp8ptq.load``,
simulated when evaluating (Q with vLLM's per-KV-head query scale), checked by ``validate``.
The tiny Llama has grouped-query attention: 4 query heads, 2 KV heads."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp8ptq.checkpoint import load_quantized
from fp8ptq.checkpoint.validate import validate
from fp8ptq.formats import fake_quantize, get_format
from fp8ptq.taps.tap_report import served_query_scale
from fp8ptq.taps.tap_sites import ATTENTION_OWNERS
from tiny_models import IDS, KV_CALIB, gqa_source, invoke, quantize_per_granularity, run, tiny

HEADS, KV_HEADS, LAYERS = 4, 2, 2
ATTN = ["--kv-cache", "fp8", "--quantize-attention"]
SHAPES = {"tensor": ((1,), (1,)), "head": ((HEADS, 1, 1), (KV_HEADS, 1, 1))}


@pytest.fixture(scope="module")
def src(tmp_path_factory, word_tokenizer):
    return gqa_source(tmp_path_factory.mktemp("gqa"), word_tokenizer, KV_HEADS)


@pytest.fixture(scope="module")
def checkpoints(src):
    return quantize_per_granularity(src, *ATTN)


def scale_tensors(ck):
    t = load_file(ck / "model.safetensors")
    return {k: v for k, v in t.items() if k.endswith(("q_scale", "k_scale", "v_scale"))}


@pytest.mark.parametrize("granularity,strategy", [("tensor", "tensor"), ("head", "attn_head")])
def test_written_as_llm_compressor_writes_attention(checkpoints, granularity, strategy):
    from compressed_tensors.quantization import QuantizationConfig

    ck = checkpoints[granularity]
    qc = json.loads((ck / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)  # what transformers and vLLM parse
    group = parsed.config_groups["attention"]
    assert group.targets == ["LlamaAttention"] and group.weights is None
    assert group.output_activations is None and group.format == "dense"
    assert group.input_activations == parsed.kv_cache_scheme  # "the same arguments"
    a = parsed.kv_cache_scheme
    assert (a.num_bits, a.type, a.symmetric, a.dynamic, a.strategy) == (8, "float", True, False,
                                                                        strategy)
    assert parsed.format == "float-quantized"  # the GEMMs' group keeps its own format
    q_shape, kv_shape = SHAPES[granularity]
    t = scale_tensors(ck)
    want = {f"model.layers.{i}.self_attn.{k}" for i in range(LAYERS)
            for k in ("q_scale", "k_scale", "v_scale")}
    assert set(t) == want
    for name, s in t.items():
        shape = q_shape if name.endswith("q_scale") else kv_shape
        assert s.dtype == torch.float32 and tuple(s.shape) == shape, name
        assert bool(torch.isfinite(s).all()) and bool((s > 0).all()), name


def test_query_scale_is_the_min_max_of_the_same_pass(checkpoints):
    """Per tensor = the largest head's scale of the per-head run (one calibration pass each, the
    same data); each scale is amax / 448 (e4m3's largest value: compressed-tensors' min-max
    observer)."""
    tensor, head = scale_tensors(checkpoints["tensor"]), scale_tensors(checkpoints["head"])
    for name, s in head.items():
        assert torch.equal(tensor[name].reshape(()), s.max()), name
    assert any(s.flatten().unique().numel() == HEADS for n, s in head.items()
               if n.endswith("q_scale"))
    taps = json.loads((checkpoints["head"] / "fp8ptq.json").read_text())["taps"]
    q = taps["model.layers.0.self_attn:q"]
    assert q["kind"] == "query" and q["granularity"] == "head" and q["calib"] == "minmax"
    assert torch.allclose(torch.tensor(q["scale"]), torch.tensor(q["amax"]) / 448.0)
    assert not any(k.endswith(":p") for k in taps)  # P is not a runtime tensor here


def test_served_query_scale_takes_each_groups_largest_head():
    s = torch.tensor([1.0, 3.0, 2.0, 0.5, 4.0, 4.5])  # 6 query heads, 2 KV heads
    assert served_query_scale(s, 2).tolist() == [3.0, 3.0, 3.0, 4.5, 4.5, 4.5]
    assert served_query_scale(s, 6).tolist() == s.tolist()  # no GQA: as calibrated
    assert served_query_scale(torch.tensor([2.0]), 2).shape == ()


@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_reload_rounds_q_k_v_with_the_written_scales(checkpoints, granularity):
    """The reloaded model's attention gets Q, K and V rounded to e4m3 with the checkpoint's
    scales (Q's per KV head as vLLM serves it), P untouched."""
    model = load_quantized(checkpoints[granularity], dtype=torch.float32).model
    attn = model.model.layers[1].self_attn
    taps, name = ATTENTION_OWNERS[attn]
    assert set(taps.stats) == {f"model.layers.{i}.self_attn:{r}" for i in range(LAYERS)
                               for r in "qkv"}
    scales = {k.rpartition(".")[2]: v for k, v in scale_tensors(checkpoints[granularity]).items()
              if k.startswith(name + ".")}
    seen = {}

    def eager(module, q, k, v, mask, *args, **kwargs):
        seen.update(q=q, k=k, v=v)
        return torch.zeros(q.shape[0], q.shape[2], q.shape[1], q.shape[3]), None

    q, k, v = (torch.randn(1, h, 5, 16) * 3 for h in (HEADS, KV_HEADS, KV_HEADS))
    taps._attention(name, eager, attn, q, k, v, None)
    e4m3 = get_format("e4m3")
    per_head = scales["q_scale"].numel() > 1
    q_scale = served_query_scale(scales["q_scale"], KV_HEADS)
    q_scale = q_scale.reshape(1, -1, 1, 1) if per_head else q_scale
    assert torch.equal(seen["q"], fake_quantize(q, q_scale, e4m3))
    for key, x in (("k", k), ("v", v)):
        s = scales[f"{key}_scale"]
        s = s.reshape(1, -1, 1, 1) if s.numel() > 1 else s.reshape(())
        assert torch.equal(seen[key], fake_quantize(x, s, e4m3))
    if per_head:  # the served scale differs from the written one where a group's heads differ
        assert not torch.equal(q_scale.flatten(), scales["q_scale"].flatten())
    with_attn = run(model, IDS[:2])
    taps.mode = "pass"
    without = run(model, IDS[:2])
    assert not torch.equal(with_attn, without)
    assert (with_attn - without).abs().max() < 0.1 * without.abs().max()


def test_validate_reads_the_attention_group_as_vllm_does(checkpoints, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(checkpoints["head"], ck)
    report = validate(ck, ("vllm",), reload=False)
    assert report.valid, [v.line() for v in report.violations]
    assert any(v.rule == "attention-backend" and v.severity == "note"
               for v in report.violations)  # per-head scales: the Flash Attention backend
    f = ck / "model.safetensors"
    t = load_file(f)
    del t["model.layers.1.self_attn.q_scale"]
    t["model.layers.0.self_attn.q_scale"] = torch.ones(KV_HEADS, 1, 1)  # k/v's shape, not q's
    save_file(t, f, metadata={"format": "pt"})
    cfg = json.loads((ck / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["attention"]["input_activations"][
        "strategy"] = "tensor"  # not the kv_cache_scheme's arguments
    (ck / "config.json").write_text(json.dumps(cfg))
    res = invoke(["validate", ck, "--runtime", "vllm", "--no-reload"])
    assert res.exit_code == 4, res.output
    lines = [ln for ln in res.stdout.splitlines() if "[attention-scales]" in ln
             or "[attention-group]" in ln]
    assert any("layers.1.self_attn" in ln and "q_scale is missing" in ln for ln in lines), lines
    assert any("layers.0.self_attn.q_scale" in ln and f"({HEADS}, 1, 1)" in ln for ln in lines)
    assert any("[attention-group]" in ln and "kv_cache_scheme" in ln for ln in lines), lines


def test_validate_reload_through_transformers(checkpoints):
    """transformers (compressed-tensors) reads the attention group and quantizes Q / K / V
    itself: its logits stay within the tolerance of fp8ptq.load's."""
    report = validate(checkpoints["head"], ("transformers",))
    assert report.valid and report.reload["ok"], report.reload


def test_bad_input_is_one_error_line(src, tmp_path):
    res = invoke(["quantize", src / "gqa", "-o", tmp_path / "a", "--calib-data",
                  src / "calib.txt", *KV_CALIB, *ATTN, "--format", "e5m2"])
    assert res.exit_code == 2 and not (tmp_path / "a").exists(), res.output
    err = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("error:") and "compressed-tensors" in err[0]
    res = invoke(["quantize", src / "gqa", "-o", tmp_path / "b", *KV_CALIB, *ATTN])
    assert res.exit_code != 0 and not (tmp_path / "b").exists()  # needs calibration data


def test_a_model_without_attention_is_refused():
    """A model whose attention fp8ptq cannot find: a UsageError (one error line) before the
    calibration pass runs a single batch."""
    from fp8ptq.config.recipe import Recipe
    from fp8ptq.errors import UsageError
    from fp8ptq.execution.in_memory import quantize_model

    calls = []
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    mlp.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(UsageError, match="no attention module"):
        quantize_model(mlp, Recipe(kv_cache="fp8", quantize_attention=True),
                       [torch.randn(2, 8)])
    assert calls == []


def test_attention_alone_quantizes_no_gemm():
    """--skip '*' --kv-cache fp8 --quantize-attention prices FP8 attention alone."""
    from fp8ptq.config.recipe import Recipe
    from fp8ptq.execution.in_memory import quantize_model, token_batches

    model = tiny("llama", num_key_value_heads=KV_HEADS, attn=None)
    ref = run(model, IDS[:2])
    res = quantize_model(model, Recipe(skip=["*"], kv_cache="fp8", quantize_attention=True,
                                       kv_granularity="head", dtype="float32"),
                         token_batches(IDS, 4))
    kinds = {k.rpartition(":")[2]: e["kind"] for k, e in res.extras["taps"].items()}
    assert res.modules == [] and kinds == {"q": "query", "k": "kv", "v": "kv"}
    out = run(model, IDS[:2])
    assert not torch.equal(out, ref) and (out - ref).abs().max() < 0.1 * ref.abs().max()


@pytest.mark.slow
def test_eval_compares_attention_next_to_the_plain_variant(src, checkpoints, tmp_path):
    """``--compare e4m3,e4m3+attn-head,CKPT``: the in-memory FP8-attention variant scores what
    its checkpoint scores, and not what the plain e4m3 variant scores."""
    wiki = src / "wiki.raw"
    wiki.write_text(" = Fox = \n\n the quick brown fox jumps over the lazy dog hello world "
                    "and hello again a small model reads a few words of text \n" * 30)
    out = tmp_path / "e.json"
    res = invoke(["eval", src / "gqa", "--tasks", "wikitext", "--data", f"wikitext={wiki}",
                  "--calib-data", src / "calib.txt", "--num-samples", "4",
                  "--calib-seq-len", "16", "--weight-calib", "max", "--dtype", "float32",
                  "--json", out, "--compare", f"e4m3,e4m3+attn-head,{checkpoints['head']}"])
    assert res.exit_code == 0, res.output
    variants = {v["name"]: v for v in json.loads(out.read_text())["variants"]}
    ppl = {n: v["metrics"]["wikitext.token_perplexity"] for n, v in variants.items()}
    assert variants["e4m3+attn-head"]["recipe"]["quantize_attention"] is True
    assert ppl["e4m3+attn-head"] == ppl["head"]
    assert ppl["e4m3+attn-head"] != ppl["e4m3"]
