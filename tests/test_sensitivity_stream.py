"""``--metric sqnr`` streamed block by block (``fp8ptq.execution.sensitivity_stream``): the same
module statistics and unit measures as the in-memory analysis, at most two blocks resident,
activations spilled under a tiny budget, and what cannot stream refused with the reason."""

import json

import pytest
import torch

from fp8ptq import sensitivity as sens
from fp8ptq.config.recipe import Recipe
from fp8ptq.errors import UsageError
from fp8ptq.execution.in_memory import token_batches
from fp8ptq.execution.sensitivity_stream import analyze_streamed
from tiny_models import invoke, tiny

IDS = torch.randint(2, 128, (6, 24), generator=torch.Generator().manual_seed(7))


@pytest.fixture
def folder(tmp_path):
    tiny("llama", num_hidden_layers=3, num_key_value_heads=2).save_pretrained(
        tmp_path / "m", max_shard_size="100KB")
    return tmp_path / "m"


def _same(a, b):
    """Equal to the last bit (repr: NaN-safe, every float's shortest round-trip digits)."""
    assert repr(a) == repr(b)


@pytest.mark.parametrize("level, act_calib", [("module", "max"), ("block", "best")])
def test_streamed_sqnr_equals_the_in_memory_analysis(folder, level, act_calib):
    recipe = Recipe(act_granularity="tensor", act_calib=act_calib, dtype="float32")
    batches = list(token_batches(IDS, 3))
    model = type(tiny("llama")).from_pretrained(folder, dtype=torch.float32).eval()
    kw = dict(formats=("e4m3", "e5m2"), stat_formats=("hif8",), level=level)
    want = sens.analyze(model, recipe, batches, metric="sqnr", verify=False, **kw)
    got, resident = analyze_streamed(folder, recipe, batches, **kw)
    assert resident <= 2
    assert [u.name for u in got.units] == [u.name for u in want.units] and len(got.units) > 2
    for a, b in zip(got.units, want.units):
        _same((a.modules, a.pattern, a.layer, a.results), (b.modules, b.pattern, b.layer,
                                                           b.results))
    assert [m.name for m in got.modules] == [m.name for m in want.modules]
    for a, b in zip(got.modules, want.modules):
        _same(a, b)
        assert set(a.formats) == {"e4m3", "e5m2", "hif8"}
    _same(got.suggestion, want.suggestion)
    assert got.metric == "sqnr" and not got.checks and "check runs" in got.warnings[0]


def test_spilled_activations_give_the_same_analysis(folder, tmp_path):
    recipe = Recipe(act_granularity="tensor", dtype="float32")
    batches = list(token_batches(IDS, 2))
    kept, _ = analyze_streamed(folder, recipe, batches)
    spilled, _ = analyze_streamed(folder, recipe, batches, activation_budget=0,
                                  spill_dir=tmp_path)
    _same(kept.units, spilled.units)
    _same(kept.modules, spilled.modules)


def test_what_cannot_stream_is_refused(folder):
    batches = list(token_batches(IDS, 3))
    with pytest.raises(UsageError, match="lm_head is not one.*--quantize-lm-head"):
        analyze_streamed(folder, Recipe(act_granularity="tensor", quantize_lm_head=True),
                         batches)
    with pytest.raises(UsageError, match="--smoothquant"):
        analyze_streamed(folder, Recipe(act_granularity="tensor", smoothquant=0.5), batches)
    with pytest.raises(UsageError, match="calibration data"):
        analyze_streamed(folder, Recipe(act_granularity="tensor"), [])


def test_cli_streams_sqnr_and_refuses_ppl(folder, tmp_path, word_tokenizer):
    word_tokenizer.save_pretrained(folder)
    calib = tmp_path / "calib.txt"
    calib.write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    base = ["sensitivity", str(folder), "--calib-data", str(calib), "--num-samples", "4",
            "--seq-len", "16", "--act-granularity", "tensor", "--dtype", "float32"]
    out = tmp_path / "sens.json"
    res = invoke([*base, "--metric", "sqnr", "--sequential", "--json", str(out)])
    assert res.exit_code == 0, (res.output, res.exception)
    data = json.loads(out.read_text())
    assert data["metric"] == "sqnr" and len(data["modules"]) == 3 * 7
    assert any("sequential" in w for w in data["warnings"])
    # a budget the model does not fit in streams too; perplexity cannot
    res = invoke([*base, "--max-memory", "1MB"])
    assert res.exit_code == 2 and "--metric ppl runs the whole model" in res.output
    res = invoke([*base, "--metric", "sqnr", "--max-memory", "1MB"])
    assert res.exit_code == 0, (res.output, res.exception)
    assert "sequential" in res.output
