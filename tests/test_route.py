"""Path selection (``fp8ptq.execution.strategy``): ``--max-memory SIZE`` bounds the process and
picks
in-memory / sequential / model-free before anything loads; the report, ``--json`` and
fp8ptq.json say which path ran and why. Tiny models saved in the tests."""

import json

import pytest
import torch
from safetensors.torch import load_file

from fp8ptq.config.recipe import Recipe
from fp8ptq.errors import UsageError
from fp8ptq.execution import strategy
from fp8ptq.io.weights import build_empty
from fp8ptq.model.forward import MICRO_TOKENS
from tiny_models import invoke, tiny


@pytest.fixture
def src(tmp_path, word_tokenizer):
    folder = tmp_path / "src"
    tiny("llama", num_hidden_layers=8).save_pretrained(folder)  # in memory > sequential
    word_tokenizer.save_pretrained(folder)
    return folder


def test_sizes():
    assert strategy.parse_size("4GB") == 4 * 10**9
    assert strategy.parse_size("512MiB") == 512 * 2**20
    assert strategy.parse_size(" 1.5 gib ") == int(1.5 * 2**30)
    assert strategy.process_budget("4GB") == 4 * 10**9
    for accelerate_form in ("0=20GiB,cpu=64GiB", '{"cpu": "4GB"}', None):
        assert strategy.process_budget(accelerate_form) is None
    for bad in ("four", "0GB", "-1GB"):
        with pytest.raises(UsageError, match="--max-memory"):
            strategy.parse_size(bad)
    assert strategy.shard_bytes(None) is None
    assert strategy.shard_bytes(8 * 10**8) == 64 * 2**20  # a small budget: small shards
    assert strategy.shard_bytes(4 * 10**9) == (4 * 10**9 - strategy.RUNTIME_BYTES) // 4
    assert strategy.shard_bytes(10**12) == 2 * 1024**3  # never above the default


def test_estimate_counts_the_weights_blocks_and_calibration(src):
    model = build_empty(src, torch.bfloat16)
    est = strategy.estimate(model, Recipe(act_granularity="tensor",
                                       num_samples=4, seq_len=16, batch_size=2))
    real = tiny("llama", num_hidden_layers=8)
    numel = sum(p.numel() for p in real.parameters())
    layer = sum(p.numel() for p in real.model.layers[0].parameters())
    assert est.weights == 2 * numel
    assert est.parts["block_bytes"] == 2 * layer
    assert est.parts["outside_blocks_bytes"] == 2 * (numel - 8 * layer)
    # the sequential writer's open shard: the blocks' codes (1 byte a weight), at most a shard
    assert est.parts["open_shard_bytes"] == 8 * layer
    # one block resident (the next loads after the last is written and freed)
    assert est.sequential_fixed == (strategy.RUNTIME_BYTES + est.parts["outside_blocks_bytes"]
                                    + est.parts["block_bytes"] + 5 * 128 * 64
                                    + est.parts["block_forward_bytes"] + 8 * layer)
    assert est.parts["quantize_temporaries_bytes"] == 5 * 128 * 64  # an MLP GEMM: 128 x 64
    # one batch: 2 x 16 tokens x (6 hidden + 2 intermediate + vocab) + 2 x 4 heads x 16^2
    assert est.parts["calibration_batch_bytes"] == 4 * (32 * (6 * 64 + 2 * 128 + 128)
                                                        + 2 * 4 * 16 * 16)
    # a block forward of the whole (small) batch, no logits (the head is not quantized, so it
    # never runs on the calibration batches), and the batch's bf16 output as stored
    assert est.parts["block_forward_bytes"] == (4 * (32 * (6 * 64 + 2 * 128) + 2 * 4 * 16 * 16)
                                                + 32 * 64 * 2)
    assert est.parts["hessian_bytes"] == est.parts["block_hessian_bytes"] == 0  # max weights
    with_head = strategy.estimate(model, Recipe(act_granularity="tensor", num_samples=4,
                                             seq_len=16, batch_size=2, quantize_lm_head=True))
    assert with_head.parts["block_forward_bytes"] == (est.parts["block_forward_bytes"]
                                                      + 4 * 32 * 128)  # float32 logits
    long = strategy.estimate(model, Recipe(act_granularity="tensor", num_samples=8, seq_len=512,
                                        batch_size=8))
    # a batch of 8 x 512 runs through a block in micro-batches of MICRO_TOKENS (4 x 512) tokens
    rows = MICRO_TOKENS // 512
    assert rows == 4
    assert long.parts["block_forward_bytes"] == (4 * (rows * 512 * (6 * 64 + 2 * 128)
                                                      + rows * 4 * 512 ** 2) + 4096 * 64 * 2)
    # GPTQ's float64 sums: in run order one group's (the MLP's down_proj reads 128 features),
    # else a block's, one per distinct input (q/k/v share one, gate/up one; o and down read
    # 64 and 128) and the whole model's in memory; plus the sweep's working memory for the
    # largest GEMM (down_proj: 3 float64 128 x 128 matrices and 2 float64 copies of 64 x 128)
    gptq = strategy.estimate(model, Recipe(act_granularity="tensor", weight_calib="gptq"))
    assert gptq.parts["hessian_bytes"] == gptq.parts["block_hessian_bytes"] == 8 * 128 ** 2
    work = 3 * 8 * 128 ** 2 + 16 * 64 * 128
    assert gptq.parts["gptq_work_bytes"] == work
    assert gptq.sequential_fixed - est.sequential_fixed >= 8 * 128 ** 2 + work
    one_pass = strategy.estimate(model, Recipe(act_granularity="tensor", weight_calib="gptq",
                                            gptq_sequential=False))
    block_h = 8 * (3 * 64 ** 2 + 128 ** 2)
    assert one_pass.parts["block_hessian_bytes"] == block_h
    assert one_pass.parts["hessian_bytes"] == 8 * block_h
    # hmse rounding to nearest reads diagonals only, and runs no sweep
    hmse = strategy.estimate(model, Recipe(act_granularity="tensor", weight_calib="hmse",
                                        gptq_sequential=False))
    assert hmse.parts["block_hessian_bytes"] == 8 * (3 * 64 + 128)
    assert hmse.parts["gptq_work_bytes"] == 0
    assert est.parts["gptq_work_bytes"] == 0
    assert est.activations == 2 * 4 * 16 * 64 * 2
    assert est.in_memory > est.sequential_fixed > strategy.RUNTIME_BYTES
    weight_only = strategy.estimate(model, Recipe(act_granularity="tensor", act_format="none"))
    assert weight_only.parts["calibration_batch_bytes"] == 0 and weight_only.activations == 0


def test_choose_by_budget(src):
    static = Recipe(act_granularity="tensor", num_samples=4, seq_len=16)
    assert strategy.choose(str(src), static).path == "in-memory"
    big = strategy.choose(str(src), static, max_memory=8 * 10**9)
    assert big.path == "in-memory" and "fit --max-memory 8.00 GB" in big.reason
    est = strategy.estimate(build_empty(src, torch.bfloat16), static)
    between = (est.in_memory + est.sequential_fixed) // 2
    small = strategy.choose(str(src), static, max_memory=between)
    assert small.path == "sequential" and "exceed --max-memory 0.67 GB" in small.reason
    assert small.activation_budget == between - est.sequential_fixed > 0
    assert "may be exceeded" not in small.reason
    assert small.sequential_options() == {"activation_budget": small.activation_budget,
                                          "max_shard_bytes": strategy.shard_bytes(between)}
    assert strategy.estimate(build_empty(src, torch.bfloat16), static,
                          budget=between).sequential_fixed == est.sequential_fixed
    tiny_budget = strategy.choose(str(src), static, max_memory=10**6)
    assert tiny_budget.path == "sequential" and tiny_budget.activation_budget == 0
    assert "the budget may be exceeded" in tiny_budget.reason
    forced = strategy.choose(str(src), static, sequential=True, max_memory=8 * 10**9)
    assert forced.path == "sequential" and forced.reason.startswith("--sequential")
    assert forced.activation_budget == 8 * 10**9 - forced.estimate.sequential_fixed
    # no calibration: model-free whatever the budget (it needs a few tensors in memory)
    free = strategy.choose(str(src), Recipe(act_granularity="tensor",
                                         act_format="none"), max_memory=10**6)
    assert free.path == "model-free" and free.job is not None
    no_free = strategy.choose(str(src), Recipe(act_granularity="tensor",
                                            act_format="none"), model_free=False,
                           max_memory=10**6)
    assert no_free.path == "sequential"
    assert strategy.choose(str(src), Recipe(act_granularity="tensor",
                                         act_format="none"), model_free=False).path == \
        "in-memory"
    with pytest.raises(UsageError, match="two different paths"):
        strategy.choose(str(src), static, sequential=True, model_free=True)


def _quantize(*args):
    res = invoke(["quantize", *args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_cli_budget_too_small_for_in_memory_runs_sequential(src, calib, tmp_path):
    common = [src, "--calib-data", calib, "--num-samples", "4", "--seq-len", "16",
              "--act-granularity", "tensor", "--weight-calib", "max"]
    est = strategy.estimate(build_empty(src, torch.bfloat16), Recipe(act_granularity="tensor",
                                                                  num_samples=4, seq_len=16))
    between = (est.in_memory + est.sequential_fixed) // 2  # in bytes: the tiny model is small
    seq = _quantize(*common, "-o", tmp_path / "seq", "--max-memory", between, "--propagate",
                    "fp")
    assert seq["path"] == "sequential" and "exceed --max-memory 0.67 GB" in seq["path_reason"]
    assert seq["max_memory_bytes"] == between
    assert seq["activation_budget_bytes"] == between - est.sequential_fixed
    assert seq["memory_estimate"]["weights_bytes"] > 0 and seq["peak_rss_mb"] > 0
    meta = json.loads((tmp_path / "seq" / "fp8ptq.json").read_text())
    assert meta["extras"]["path"] == "sequential"
    assert meta["extras"]["path_reason"] == seq["path_reason"]
    assert meta["extras"]["sequential"]["activation_budget"] == seq["activation_budget_bytes"]
    mem = _quantize(*common, "-o", tmp_path / "mem", "--max-memory", "8GB")
    assert mem["path"] == "in-memory" and "fit --max-memory 8.00 GB" in mem["path_reason"]
    # the same tensors (--propagate fp makes sequential bit-identical)
    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("seq", "mem"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k].view(torch.uint8) if a[k].dtype.itemsize == 1 else a[k],
                           b[k].view(torch.uint8) if b[k].dtype.itemsize == 1 else b[k])
               for k in a)
    res = invoke(["quantize", *common, "-o", tmp_path / "t", "--max-memory", "600MB"])
    assert res.exit_code == 0
    text = " ".join(res.stdout.split())
    assert "path: sequential (weights" in text and "exceed --max-memory 0.60 GB" in text
    assert "the budget may be exceeded" in text  # below sequential's own fixed memory


def test_cli_max_memory_forms(src, calib, tmp_path):
    res = invoke(["quantize", src, "-o", tmp_path / "x", "--max-memory", "0=20GiB,cpu=64GiB"])
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert res.exit_code == 2 and len(errors) == 1 and "--device cuda" in errors[0]
    res = invoke(["quantize", src, "-o", tmp_path / "x", "--max-memory", "lots"])
    assert res.exit_code == 2 and "--max-memory" in res.stderr
    free = _quantize(src, "-o", tmp_path / "free", "--act-format", "none", "--max-memory", "1GB")
    assert free["path"] == "model-free" and free["max_memory_bytes"] == 10**9
    assert not (tmp_path / "x").exists()
