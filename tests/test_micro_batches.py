"""The statistics pass in micro-batches (``fp8ptq.model.forward.micro_batches``): the same
statistics bit for bit as whole batches, smaller forwards, and heap memory handed back between
batches (``fp8ptq.runtime.usage.release_free_memory``)."""

import pytest
import torch

from fp8ptq.config.recipe import Recipe
from fp8ptq.model import forward
from fp8ptq.model.block_inputs import ActivationStore, capture_block_inputs, run_block
from fp8ptq.model.forward import micro_batch_spans, micro_batches, token_batches
from fp8ptq.runtime import usage
from fp8ptq.steps import calibrate
from fp8ptq.steps.calibrate import collect_stats, plan_targets
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
    assert [p["attention_mask"] for p in micro_batches(with_none, tokens=6)] == [None] * 8


def test_block_inputs_split_with_their_arguments():
    """A block's recorded inputs (sequential mode): the hidden states and per-sequence masks
    split, rotary tables of shared positions (first dimension 1) and flags kept whole."""
    hidden = torch.randn(4, 6, 8)
    cos, sin = torch.randn(1, 6, 2), torch.randn(1, 6, 2)
    mask = torch.zeros(4, 1, 6, 6)
    inputs = {"hidden_states": hidden, "attention_mask": mask,
              "position_embeddings": (cos, sin), "use_cache": False}
    parts = micro_batches(inputs, tokens=12)
    assert [p["hidden_states"].shape[0] for p in parts] == [2, 2]
    assert torch.equal(torch.cat([p["hidden_states"] for p in parts]), hidden)
    assert all(p["attention_mask"].shape == (2, 1, 6, 6) for p in parts)
    assert all(p["position_embeddings"][0] is cos and p["position_embeddings"][1] is sin
               and p["use_cache"] is False for p in parts)
    odd = dict(inputs, position_embeddings=(torch.randn(3, 6, 2), sin))  # neither 4 nor 1
    assert micro_batches(odd, tokens=12) == [odd]


def test_spans_give_each_piece_its_first_row():
    """``micro_batch_spans``: the pieces of ``micro_batches`` with their offsets in the batch,
    a short last piece included; a batch kept whole is one span at row 0."""
    batch = {"input_ids": torch.arange(48).reshape(8, 6), "attention_mask": None}
    spans = micro_batch_spans(batch, tokens=18)
    assert [start for start, _ in spans] == [0, 3, 6]
    for start, piece in spans:
        rows = piece["input_ids"].shape[0]
        assert torch.equal(piece["input_ids"], batch["input_ids"][start:start + rows])
    assert all(torch.equal(p["input_ids"], q["input_ids"])
               for (_, p), q in zip(spans, micro_batches(batch, tokens=18)))
    assert micro_batch_spans(batch, tokens=48) == [(0, batch)]
    assert micro_batch_spans(torch.zeros(2, 3), tokens=1)[0][0] == 0


def _block_run(model, batches, monkeypatch, tokens):
    """Every batch through block 0 by ``run_block`` (``MICRO_TOKENS`` = ``tokens``): the
    outputs, the rows of each block forward, and the largest single allocation."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr(forward, "MICRO_TOKENS", tokens)
    block = model.model.layers[0]
    store, out = ActivationStore(1 << 30), ActivationStore(1 << 30)
    kwargs = capture_block_inputs(model, block, batches, store)
    rows = []
    handle = block.register_forward_pre_hook(
        lambda _m, a, kw: rows.append((a[0] if a else kw["hidden_states"]).shape[0]),
        with_kwargs=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_block(block, store, kwargs, out)
    handle.remove()
    largest = max(e.self_cpu_memory_usage for e in prof.events() if e.name != "[memory]")
    return [out.get(i) for i in range(len(batches))], rows, largest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_forwards_in_micro_batches_equal_whole_batches(dtype, monkeypatch):
    """Sequential mode carries each batch through a block in pieces of ~MICRO_TOKENS tokens:
    the block's outputs equal the whole batch's bit for bit (bf16 with float32 GEMMs forced,
    what this CPU runs), and its largest allocation (the MLP's intermediate activations) is a
    piece's, not the batch's."""
    monkeypatch.setenv("FP8PTQ_FLOAT32_GEMMS", "1")
    model = tiny("llama", dtype=dtype, intermediate_size=1024).eval()
    ids = torch.randint(2, 128, (8, 64), generator=torch.Generator().manual_seed(5))
    batches = list(token_batches(ids, 8))
    whole, whole_rows, whole_peak = _block_run(model, batches, monkeypatch, 4096)
    split, split_rows, split_peak = _block_run(model, batches, monkeypatch, 64)
    assert whole_rows == [8] and split_rows == [1] * 8
    assert all(torch.equal(a, b) for a, b in zip(whole, split))
    assert split_peak * 4 < whole_peak, (split_peak, whole_peak)
    uneven, uneven_rows, _ = _block_run(model, batches, monkeypatch, 3 * 64)
    assert uneven_rows == [3, 3, 2]  # a short last piece lands at its own rows
    assert all(torch.equal(a, b) for a, b in zip(whole, uneven))


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
    monkeypatch.setattr(calibrate, "run_batch",
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
    from fp8ptq.observe.hessian import HessianCollector

    model = tiny("llama").eval()
    targets, _ = plan_targets(model, Recipe(format="e4m3"))
    monkeypatch.setattr(forward, "MICRO_TOKENS", 32)
    runs = []
    real = forward.run_batch
    monkeypatch.setattr(calibrate, "run_batch",
                        lambda m, b, **kw: runs.append(b["input_ids"].shape[0]) or
                        real(m, b, **kw))
    hessians = HessianCollector({t.name: t.module for t in targets})
    collect_stats(model, targets, list(token_batches(IDS, 4)), hessians=hessians)
    assert runs == [4, 4]


def test_free_memory_is_handed_back_between_batches(monkeypatch):
    calls = []
    monkeypatch.setattr(calibrate, "release_free_memory", lambda: calls.append(1))
    model = tiny("llama").eval()
    targets, _ = plan_targets(model, Recipe(format="e4m3", act_granularity="tensor"))
    collect_stats(model, targets, list(token_batches(IDS, 2)))
    assert len(calls) == 4  # after each of the 4 batches


@pytest.mark.skipif(usage._TRIM is None, reason="glibc malloc_trim only")
def test_release_free_memory_lowers_rss_after_heap_churn():
    """Many 4 MB blocks from the heap (a 32 MiB mmap threshold, as glibc's grown dynamic one;
    set explicitly because ``bound_heap``, called by any quantize in this process, lowers it
    to 1 MiB), all freed but the last: the heap below it stays resident until
    ``malloc_trim``."""
    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * 4096

    if not usage.bound_heap(32 << 20):
        pytest.skip("MALLOC_MMAP_THRESHOLD_ set in the environment")
    try:
        blocks = [torch.ones(4 << 20, dtype=torch.uint8) for _ in range(64)]
        keep = blocks[-1]
        del blocks
        before = rss()
        usage.release_free_memory()
        assert rss() < before - (64 << 20)
        assert int(keep[0]) == 1
    finally:
        usage.bound_heap()


def test_row_samples_own_their_rows_not_the_whole_input():
    """The kept samples are copies of every 16th row: a strided view of a float32 input would
    keep the whole input tensor alive (16x the memory the samples need)."""
    model = tiny("llama", dtype=torch.float32).eval()
    targets, _ = plan_targets(model, Recipe(format="e4m3", act_granularity="tensor"))
    c = collect_stats(model, targets, list(token_batches(IDS, 4)), sample_batches=1)
    assert c.samples
    for name, kept in c.samples.items():
        for _, rows in kept:
            assert rows.is_contiguous()
            assert rows.untyped_storage().nbytes() == rows.numel() * rows.element_size(), name
