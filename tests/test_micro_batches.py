"""The statistics pass in micro-batches (``fp8ptq.model.forward.micro_batches``): the same
statistics bit for bit as whole batches, smaller forwards, and heap memory handed back between
batches (``fp8ptq.usage.release_free_memory``)."""

import pytest
import torch

from fp8ptq import pipeline, usage
from fp8ptq.model import forward
from fp8ptq.model.forward import micro_batches, token_batches
from fp8ptq.pipeline import collect_stats, plan_targets
from fp8ptq.recipe import Recipe
from tiny_models import IDS, tiny


def test_micro_batches_split_whole_sequences():
    ids = torch.arange(8 * 6).reshape(8, 6)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    parts = micro_batches(batch, tokens=12)
    assert [p["input_ids"].shape[0] for p in parts] == [2, 2, 2, 2]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts]), ids)
    assert all(torch.equal(p["attention_mask"], torch.ones(2, 6, dtype=ids.dtype)) for p in parts)
    # each piece a multiple of 16 tokens: 3 sequences of 6 are 18, so 8 (48 tokens) it is
    assert [p["input_ids"].shape[0] for p in micro_batches(batch, 12, multiple=16)] == [8]
    assert [p["input_ids"].shape[0] for p in micro_batches(batch, 12, multiple=4)] == [2] * 4
    assert [p["input_ids"].shape[0] for p in micro_batches(batch, 30)] == [5, 3]
    assert micro_batches(batch, tokens=48) == [batch]  # small enough already
    image = torch.zeros(8, 3, 4, 4)
    assert micro_batches(image, tokens=1)[0] is image  # not a dict: whole
    ragged = {"input_ids": ids, "extra": torch.zeros(3)}
    assert micro_batches(ragged, tokens=6) == [ragged]
    with_none = {"input_ids": ids, "attention_mask": None}
    assert micro_batches(with_none, tokens=6) == [with_none]


def _stats(model, targets, batches, sample_batches=0):
    c = collect_stats(model, targets, batches, sample_batches=sample_batches)
    return c.stats, c.row_samples()


@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("gpt2", torch.float32),
                                        ("qwen2", torch.bfloat16)])
def test_statistics_equal_whole_batches_bit_for_bit(arch, dtype, monkeypatch):
    """Batches of 4 x 32 tokens run as pieces of 1 sequence (bf16: with float32 GEMMs forced,
    which is what this CPU runs): amax, channel amax, count and histogram of every GEMM
    input, and the row samples of the layer-aware calibrators, equal the whole batches'."""
    monkeypatch.setenv("FP8PTQ_FLOAT32_GEMMS", "1")
    model = tiny(arch, dtype=dtype).eval()
    targets, _ = plan_targets(model, Recipe(format="e4m3", act_granularity="tensor"))
    batches = list(token_batches(IDS, 4))
    runs = []
    real = forward.run_batch
    monkeypatch.setattr(pipeline, "run_batch",
                        lambda m, b, **kw: runs.append(b["input_ids"].shape[0]) or
                        real(m, b, **kw))
    whole, whole_rows = _stats(model, targets, batches, sample_batches=1)
    assert runs == [4, 4]
    monkeypatch.setattr(forward, "MICRO_TOKENS", 32)
    runs.clear()
    split, split_rows = _stats(model, targets, batches, sample_batches=1)
    # batch 0 is sampled (every 16th row): a piece of 1 x 32 tokens keeps that stride
    assert runs == [1] * 8
    assert set(whole) == set(split) and len(whole) > 4
    for name, a in whole.items():
        b = split[name]
        assert a.amax == b.amax and a.count == b.count and a.nonfinite == b.nonfinite
        assert torch.equal(a.channel_amax, b.channel_amax)
        assert torch.equal(a.histogram, b.histogram)
    assert set(whole_rows) == set(split_rows) and whole_rows
    assert all(torch.equal(whole_rows[n], split_rows[n]) for n in whole_rows)


def test_gptq_hessians_are_collected_from_whole_batches(monkeypatch):
    """X^T X sums would add in another order across pieces: with Hessians collected the
    batches are not split."""
    from fp8ptq.hessian import HessianCollector

    model = tiny("llama").eval()
    targets, _ = plan_targets(model, Recipe(format="e4m3"))
    monkeypatch.setattr(forward, "MICRO_TOKENS", 32)
    runs = []
    real = forward.run_batch
    monkeypatch.setattr(pipeline, "run_batch",
                        lambda m, b, **kw: runs.append(b["input_ids"].shape[0]) or
                        real(m, b, **kw))
    hessians = HessianCollector({t.name: t.module for t in targets})
    collect_stats(model, targets, list(token_batches(IDS, 4)), hessians=hessians)
    assert runs == [4, 4]


def test_free_memory_is_handed_back_between_batches(monkeypatch):
    calls = []
    monkeypatch.setattr(pipeline, "release_free_memory", lambda: calls.append(1))
    model = tiny("llama").eval()
    targets, _ = plan_targets(model, Recipe(format="e4m3", act_granularity="tensor"))
    collect_stats(model, targets, list(token_batches(IDS, 2)))
    assert len(calls) == 4  # after each of the 4 batches


@pytest.mark.skipif(usage._TRIM is None, reason="glibc malloc_trim only")
def test_release_free_memory_lowers_rss_after_heap_churn():
    """Many 4 MB blocks (under glibc's grown mmap threshold: from the heap), all freed but the
    last: the heap below it stays resident until ``malloc_trim``."""
    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * 4096

    big = torch.ones(16 << 20, dtype=torch.uint8)  # mmapped; freeing it raises the threshold
    del big
    blocks = [torch.ones(4 << 20, dtype=torch.uint8) for _ in range(64)]
    keep = blocks[-1]
    del blocks
    before = rss()
    usage.release_free_memory()
    assert rss() < before - (64 << 20)
    assert int(keep[0]) == 1
