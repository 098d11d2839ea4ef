"""The model-free path writes the in-memory path's checkpoint, tensor for tensor and module entry
for module entry, without building the model: sharded sources with fused groups split across
files, tied embeddings, GPT-2's Conv1D (native layout), MoE experts saved per expert; weight-only,
dynamic per-token and block + dynamic recipes. Plus the CLI's choice of path, torchrun, and the
memory bound of the reader/compute/writer stages."""

import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from fp8ptq.checkpoint import save_quantized
from fp8ptq.cli.main import main
from fp8ptq.config.recipe import Recipe
from fp8ptq.execution import model_free_run
from fp8ptq.execution.in_memory import quantize_model
from fp8ptq.execution.model_free import ModelFreeJob, NotModelFree, refusal
from fp8ptq.execution.model_free_run import quantize_checkpoint
from fp8ptq.io.loading import load_model
from fp8ptq.io.source import SafetensorsSource
from test_distributed import fp8ptq_cmd
from tiny_models import tiny

WEIGHT_ONLY = {"act_format": "none"}
DYNAMIC = {"act_granularity": "token"}
BLOCK = {"weight_granularity": "block", "block_size": 32, "act_granularity": "token"}
TENSOR = {"weight_granularity": "tensor", "act_granularity": "token"}  # fused scales unified


def build(name):
    return tiny("llama", tie_word_embeddings=True) if name == "tied-llama" else tiny(name)


def save_source(name, folder, tokenizer):
    model = build(name)
    model.save_pretrained(folder, max_shard_size="20KB")  # nearly a tensor per file
    tokenizer.save_pretrained(folder)
    return folder


def tensors(folder):
    out = {}
    for f in folder.glob("*.safetensors"):
        out.update({k: v.view(torch.uint8) if v.dtype.itemsize == 1 and v.is_floating_point()
                    else v for k, v in load_file(f).items()})
    return out


def same_checkpoint(a, b):
    ta, tb = tensors(a), tensors(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k
    ma, mb = (json.loads((d / "fp8ptq.json").read_text()) for d in (a, b))
    for key in ("layout", "modules", "experts", "skipped", "warnings", "untied", "dtype",
                "recipe", "taps"):
        assert ma[key] == mb[key], key
    assert ma["sizes"]["original_bytes"] == mb["sizes"]["original_bytes"]
    drop = ("path", "path_reason", "model_free", "max_memory_bytes", "activation_budget_bytes",
            "memory_estimate")
    assert {k: v for k, v in ma["extras"].items() if k not in drop} == \
        {k: v for k, v in mb["extras"].items() if k not in drop}
    ca, cb = (json.loads((d / "config.json").read_text()) for d in (a, b))
    assert ca == cb
    return ma, mb


def in_memory(folder, recipe, out):
    loaded = load_model(str(folder), dtype=getattr(torch, recipe.dtype))
    result = quantize_model(loaded.model, recipe, None)
    save_quantized(result, recipe, out, tokenizer=loaded.tokenizer)


CASES = [("llama", WEIGHT_ONLY), ("llama", DYNAMIC), ("llama", BLOCK), ("llama", TENSOR),
         ("tied-llama", {**DYNAMIC, "quantize_lm_head": True}), ("tied-llama", WEIGHT_ONLY),
         ("gpt2", DYNAMIC), ("gpt2", TENSOR), ("opt", BLOCK), ("bert", WEIGHT_ONLY),
         ("mixtral", DYNAMIC), ("mixtral", {**WEIGHT_ONLY, "weight_granularity": "tensor"}),
         ("qwen2_moe", DYNAMIC), ("qwen3_moe", BLOCK)]


@pytest.mark.parametrize("name,recipe", CASES,
                         ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in r.items())}"
                              for n, r in CASES])
def test_model_free_equals_in_memory(name, recipe, tmp_path, word_tokenizer):
    src = save_source(name, tmp_path / "src", word_tokenizer)
    recipe = Recipe(**recipe)
    in_memory(src, recipe, tmp_path / "mem")
    result, sizes = quantize_checkpoint(src, recipe, tmp_path / "free", workers=2)
    meta, _ = same_checkpoint(tmp_path / "free", tmp_path / "mem")
    assert meta["extras"]["path"] == "model-free"
    assert result.extras["model_free"]["bytes_read"] == SafetensorsSource(src).total_bytes
    if name == "gpt2":
        assert meta["layout"] == "fp8ptq-native"  # Conv1D
    if name == "tied-llama" and recipe.quantize_lm_head:
        assert meta["untied"] == ["lm_head"]
    if name == "llama" and recipe.weight_granularity == "tensor":
        groups = meta["extras"]["fused_groups"]  # q/k/v in three files, one weight scale
        assert all(len(set(g["weight_scale"])) == 1 for g in groups) and len(groups) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["free", "mem", "src"]


def test_fused_group_spans_files_and_reloads(tmp_path, word_tokenizer):
    src = save_source("llama", tmp_path / "src", word_tokenizer)
    source = SafetensorsSource(src)
    qkv = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    assert len({source.entries[k].file for k in qkv}) == 3
    job = ModelFreeJob(src, Recipe(**TENSOR))
    unit = next(u for u in job.units if any(t.name.endswith("q_proj") for t in u.gemms))
    assert {t.name.rsplit(".", 1)[1] for t in unit.gemms} == {"q_proj", "k_proj", "v_proj"}
    quantize_checkpoint(src, Recipe(**TENSOR), tmp_path / "out")
    loaded = load_model(str(tmp_path / "out"))
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        assert torch.isfinite(loaded.model(input_ids=ids).logits).all()


@pytest.mark.parametrize("workers", [1, 2])
def test_units_in_flight_are_bounded(tmp_path, word_tokenizer, monkeypatch, workers):
    """Between the first read of a unit and its write, at most workers + 2 units: memory is a
    few tensors, whatever the model's size (the reader never runs ahead of the writer)."""
    src = save_source("llama", tmp_path / "src", word_tokenizer)
    job = ModelFreeJob(src, Recipe(**DYNAMIC))
    unit_of = {s: i for i, u in enumerate(job.units) for s in u.sources}
    started, written, peak = set(), [0], [0]
    real = SafetensorsSource.read_one

    def read_one(self, name):
        started.add(unit_of[name])
        peak[0] = max(peak[0], len(started) - written[0])
        return real(self, name)

    class Sink:
        def add_modules(self, model, names, reports):
            pass

        def add_tensors(self, tensors):
            written[0] += 1

    monkeypatch.setattr(SafetensorsSource, "read_one", read_one)
    model_free_run.run(job, Sink(), workers=workers)
    assert len(job.units) > 10 and written[0] == len(job.units) + 1  # + the buffers
    assert 1 <= peak[0] <= workers + 2


def test_recipes_that_need_calibration_are_named():
    assert refusal(Recipe(act_granularity="tensor", act_format="none")) is None
    assert refusal(Recipe(act_granularity="token", weight_calib="mse")) is None
    assert "static activation scales" in refusal(Recipe(act_granularity="tensor"))
    assert "SmoothQuant" in refusal(Recipe(act_granularity="token", smoothquant=0.5))
    assert "GPTQ" in refusal(Recipe(act_granularity="tensor",
                                    act_format="none", weight_calib="gptq"))
    assert "--quantize-attention" in refusal(Recipe(act_granularity="token",
                                                    quantize_attention=True))
    assert "--rotate" in refusal(Recipe(act_granularity="tensor",
                                        act_format="none", rotate="hadamard"))


def test_missing_tensor_is_named(tmp_path, word_tokenizer):
    src = save_source("llama", tmp_path / "src", word_tokenizer)
    index = src / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    del doc["weight_map"]["model.norm.weight"]
    index.write_text(json.dumps(doc))
    with pytest.raises(NotModelFree, match="missing from the checkpoint: model.norm.weight"):
        ModelFreeJob(src, Recipe(**DYNAMIC))


def _cli(*args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    return res, (json.loads(res.stdout) if res.exit_code == 0 and "--json" in args else None)


def test_cli_takes_the_path_by_itself_and_says_so(tmp_path, word_tokenizer):
    src = save_source("llama", tmp_path / "src", word_tokenizer)
    calib = tmp_path / "calib.txt"
    calib.write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    res, free = _cli("quantize", src, "-o", tmp_path / "a", "--act-granularity", "token",
                     "--json")
    assert res.exit_code == 0, res.output
    assert free["path"] == "model-free" and "safetensors" in free["path_reason"]
    assert free["model_free"]["units"] > 0 and free["peak_rss_mb"] > 0
    res, mem = _cli("quantize", src, "-o", tmp_path / "b", "--act-granularity", "token",
                    "--no-model-free", "--json")
    assert res.exit_code == 0 and mem["path"] == "in-memory"
    same_checkpoint(tmp_path / "a", tmp_path / "b")
    assert [m["weight_sqnr_db"] for m in free["modules"]] == \
        [m["weight_sqnr_db"] for m in mem["modules"]]
    res, static = _cli("quantize", src, "-o", tmp_path / "c", "--calib-data", calib,
                       "--num-samples", "4", "--seq-len", "8", "--act-granularity", "tensor",
                       "--weight-calib", "max", "--json")
    assert res.exit_code == 0 and static["path"] == "in-memory"
    assert "static activation scales" in static["path_reason"]
    res, _ = _cli("quantize", src, "-o", tmp_path / "d", "--model-free", "--calib-data", calib,
                  "--act-granularity", "tensor", "--weight-calib", "max")
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert res.exit_code == 2 and len(errors) == 1
    assert "--model-free: static activation scales" in errors[0]
    res, text = _cli("quantize", src, "-o", tmp_path / "e", "--act-format", "none")
    assert res.exit_code == 0 and "path: model-free" in res.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c", "calib.txt", "e", "src"]


@pytest.mark.slow
def test_torchrun_rank_zero_writes_the_single_process_checkpoint(tmp_path, word_tokenizer):
    src = save_source("llama", tmp_path / "src", word_tokenizer)
    args = ["quantize", str(src), "--act-granularity", "token", "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([*fp8ptq_cmd(), *args, "-o", str(tmp_path / "one")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node=2", "--no-python", *fp8ptq_cmd(), *args, "-o",
                          str(tmp_path / "two")], capture_output=True, text=True, timeout=300,
                         env=env)
    assert two.returncode == 0, two.stderr
    assert json.loads(two.stdout)["path"] == "model-free"  # one report: rank 0's
    same_checkpoint(tmp_path / "one", tmp_path / "two")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "src", "two"]


def test_a_failing_worker_stops_everything_and_leaves_nothing(tmp_path, word_tokenizer,
                                                             monkeypatch):
    src = save_source("llama", tmp_path / "src", word_tokenizer)
    calls = []
    real = ModelFreeJob.compute

    def compute(self, unit, tensors):
        calls.append(unit)
        if len(calls) == 5:
            raise RuntimeError("boom")
        return real(self, unit, tensors)

    monkeypatch.setattr(ModelFreeJob, "compute", compute)
    with pytest.raises(RuntimeError, match="boom"):
        model_free_run.quantize_checkpoint(src, Recipe(**DYNAMIC), tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    assert torch.get_num_threads() >= 1
