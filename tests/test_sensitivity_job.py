"""``fp8ptq.execution.sensitivity_job``: the library decides where the analysis runs (the
command only parses, calls and prints): streamed block by block with ``sequential`` or a budget
the model does not fit in, refused for a metric that needs the whole model, else in memory."""

import pytest
import torch

from fp8ptq.config.recipe import Recipe
from fp8ptq.errors import UsageError
from fp8ptq.execution.sensitivity_job import run_sensitivity, streamed_selection
from tiny_models import tiny


@pytest.fixture
def folder(tmp_path, word_tokenizer):
    tiny("llama", num_hidden_layers=2).save_pretrained(tmp_path / "m")
    word_tokenizer.save_pretrained(tmp_path / "m")
    (tmp_path / "calib.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    return tmp_path / "m"


def test_where_the_analysis_runs(folder):
    recipe = Recipe(act_granularity="tensor")
    assert streamed_selection(str(folder), recipe, "ppl") is None  # in memory
    assert streamed_selection(str(folder), recipe, "sqnr", sequential=True).path == "sequential"
    assert streamed_selection(str(folder), recipe, "sqnr", max_memory=8 * 10**9) is None
    assert streamed_selection(str(folder), recipe, "sqnr", max_memory=10**6).path == \
        "sequential"
    with pytest.raises(UsageError, match="cannot stream"):
        streamed_selection(str(folder), recipe, "ppl", sequential=True)


def test_a_streamed_run_equals_the_in_memory_one(folder):
    recipe = Recipe(act_granularity="tensor", calib_data=str(folder.parent / "calib.txt"),
                    num_samples=4, seq_len=16, batch_size=2, weight_calib="max",
                    dtype="float32")
    kw = dict(formats=["e4m3"], stat_formats=["e4m3"], metric="sqnr")
    streamed = run_sensitivity(str(folder), recipe, sequential=True, **kw)
    whole = run_sensitivity(str(folder), recipe, verify=False, **kw)
    assert streamed.result.warnings[0].startswith("sequential: ")
    assert {"tokenize"} <= set(streamed.result.seconds)
    assert {"load", "tokenize"} <= set(whole.result.seconds)
    assert torch.equal(streamed.calib.input_ids, whole.calib.input_ids)
    assert [u.name for u in streamed.result.units] == [u.name for u in whole.result.units]
