"""Evaluation never materializes batch x context x vocabulary float32 logits: a small-hidden
model with a 262,144-token vocabulary at context 2048, batch 8, measured in a subprocess
(peak RSS), against the bound model bytes + 2 GB (lm-eval's own path needs ~17 GB there); and
at the allocation level (torch's profiler, per op) on a 32k-vocabulary model, against lm-eval's
own path as the control."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from fp8ptq.evals import compare
from fp8ptq.evals import wikitext as prefix_effect_module
from fp8ptq.evals.harness import ChunkedLogitsMixin, make_lm
from fp8ptq.evals.wikitext import evaluate_wikitext, prefix_effect, wikitext_detokenizer
from fp8ptq.model import gemm32, lm_head
from fp8ptq.sensitivity import probes
from fp8ptq.sensitivity.probes import PerplexityProbe
from tiny_models import tiny

SCRIPT = textwrap.dedent("""
    import json, resource, sys, torch
    sys.path.insert(0, {tests!r})
    from transformers import LlamaConfig, LlamaForCausalLM
    from fp8ptq.evals.harness import make_lm
    from fp8ptq.evals.wikitext import evaluate_wikitext, prefix_effect, wikitext_detokenizer
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=262144, hidden_size=16, num_hidden_layers=1,
                      num_attention_heads=2, intermediate_size=32, max_position_embeddings=2048,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    backend = Tokenizer(models.WordLevel(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.train_from_iterator(["the quick brown fox jumps over the lazy dog = a b"],
                                trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>")
    tok.pad_token = tok.eos_token
    words = " ".join(["the quick brown fox jumps over the lazy dog"] * 900)
    open({wiki!r}, "w").write(" = a = \\n " + words + " \\n = b = \\n " + words + " \\n")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    lm = make_lm(model, tok, batch_size=8, seq_len=2048)
    out = evaluate_wikitext(lm, {wiki!r})
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({{"model_bytes": model_bytes, "before": before, "peak": peak,
                      "tokens": out.protocol["tokens"], "ppl": out.metrics["word_perplexity"]}}))
""")


@pytest.mark.slow
def test_big_vocabulary_eval_peak_rss_is_model_plus_two_gb(tmp_path):
    from pathlib import Path

    tests = str(Path(__file__).parent)
    code = SCRIPT.format(tests=tests, wiki=str(tmp_path / "wiki.raw"))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    facts = json.loads(res.stdout.strip().splitlines()[-1])
    assert facts["tokens"] > 2 * 2048  # several full-context windows, batched
    assert facts["ppl"] > 0
    assert facts["peak"] <= facts["model_bytes"] + 2 * 1024**3 + facts["before"], facts


VOCAB, CONTEXT, BATCH = 32768, 512, 4


def _largest_allocation(lm, wiki) -> tuple[int, float]:
    """The most bytes any one torch op allocated while ``lm`` evaluated ``wiki`` (torch's
    profiler, per call: what the op's outputs and temporaries took), and the perplexity."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = evaluate_wikitext(lm, wiki)
    calls = [e for e in prof.events() if e.name != "[memory]"]
    return max(e.self_cpu_memory_usage for e in calls), out.metrics["word_perplexity"]


@pytest.mark.slow
def test_no_op_allocates_logits_beyond_one_chunk(tmp_path, word_tokenizer, monkeypatch):
    """Allocation-level guard (torch profiler, not RSS or wall time): with a 32k vocabulary at
    context 512, batch 4, lm-eval's own path allocates the batch's float32 logits at once
    (batch x context x vocabulary x 4 bytes = 256 MiB, checked as the control); the chunked path
    never allocates even one sequence's logits (64 MiB): its largest op output is a chunk of
    positions (4 MiB with the chunk set to 2^20 elements here) or one layer's attention scores,
    and the perplexity is the same."""
    model = tiny("llama", vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1,
                 num_attention_heads=2, intermediate_size=32, max_position_embeddings=CONTEXT,
                 tie_word_embeddings=True)
    word_tokenizer.pad_token = word_tokenizer.eos_token
    words = " ".join(["the quick brown fox jumps over the lazy dog"] * 250)
    wiki = tmp_path / "wiki.raw"
    wiki.write_text(" = a = \n " + words + " \n = b = \n " + words + " \n")
    monkeypatch.setattr(ChunkedLogitsMixin, "CHUNK_ELEMENTS", 1 << 20)
    chunked, ppl = _largest_allocation(make_lm(model, word_tokenizer, batch_size=BATCH,
                                               seq_len=CONTEXT), wiki)
    monkeypatch.setattr(ChunkedLogitsMixin, "_check_split", lambda self: False)
    whole, ppl_whole = _largest_allocation(make_lm(model, word_tokenizer, batch_size=BATCH,
                                                   seq_len=CONTEXT), wiki)
    assert whole >= BATCH * CONTEXT * VOCAB * 4  # the control: lm-eval's path
    assert chunked < CONTEXT * VOCAB * 4 // 4, chunked  # < a quarter of one sequence's logits
    assert abs(ppl - ppl_whole) <= 1e-6 * ppl_whole


def test_prefix_note_scores_through_the_chunked_path(word_tokenizer, monkeypatch):
    """eval's prefix-token note (``prefix_effect``) used to run the model's full forward on a
    whole document: context x vocabulary float32 logits (4 GB at 2048 x 262,144, the peak of
    the whole eval). It now scores through the LM's chunked log-likelihoods: the same ratio,
    and no op allocates a quarter of one sequence's logits."""
    model = tiny("llama", vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1,
                 num_attention_heads=2, intermediate_size=32, max_position_embeddings=CONTEXT,
                 tie_word_embeddings=True)
    word_tokenizer.pad_token = word_tokenizer.eos_token
    text = " ".join(["the quick brown fox jumps over the lazy dog"] * 80)
    monkeypatch.setattr(ChunkedLogitsMixin, "CHUNK_ELEMENTS", 1 << 20)
    lm = make_lm(model, word_tokenizer, batch_size=1, seq_len=CONTEXT)
    tokens = lm.tok_encode(wikitext_detokenizer({"page": text}))[: lm.max_length - 1]
    assert len(tokens) > CONTEXT // 2

    def nll(ids, skip):  # the direct computation the note used to make
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids[:-1]])).logits.float(), -1)[0]
        target = torch.tensor(ids[1:])
        return -logp[torch.arange(len(target)), target][skip:].double().mean()

    want = float(torch.exp(nll([lm.prefix_token_id, *tokens], 1) - nll(tokens, 0)))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        got = prefix_effect(lm, text)
    assert abs(got - want) <= 1e-5 * want
    largest = max(e.self_cpu_memory_usage for e in prof.events() if e.name != "[memory]")
    assert largest < CONTEXT * VOCAB * 4 // 4, largest


@pytest.mark.slow
def test_perplexity_probe_scores_without_the_batch_logits(monkeypatch):
    """``sensitivity`` / ``--target-delta``'s perplexity probe used ``model(ids, labels=ids)``:
    the batch's float32 logits and, inside the loss, their log-softmax (~0.8 GB per SmolLM2
    probe at 4 x 512). It now scores body + output layer in chunks: the loss HF computes (to
    5e-6: HF averages in float32), no op allocating a quarter of one sequence's logits;
    ``model(labels=)`` is the control, and the fallback when the split does not reproduce the
    logits."""
    model = tiny("llama", vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2,
                 num_attention_heads=2, intermediate_size=32, max_position_embeddings=CONTEXT,
                 tie_word_embeddings=True).eval()
    ids = torch.randint(0, VOCAB, (BATCH, CONTEXT), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = float(torch.exp(model(input_ids=ids, labels=ids).loss))
    monkeypatch.setattr(lm_head, "CHUNK_ELEMENTS", 1 << 20)
    monkeypatch.setattr(probes, "next_token_nll",
                        lambda m, x: lm_head.next_token_nll(m, x, 1 << 20))
    probe = PerplexityProbe(model, ids, batch_size=BATCH, stack=model.model.layers)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        got = probe.baseline()
    assert probe.split and probe.cache is not None and probe(1) == got  # replay still works
    assert abs(got - want) <= 5e-6 * want, (got, want)  # HF averages in float32
    largest = max(e.self_cpu_memory_usage for e in prof.events() if e.name != "[memory]")
    assert largest < CONTEXT * VOCAB * 4 // 4, largest
    control = PerplexityProbe(model, ids, batch_size=BATCH)
    control.split = False
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        plain = control()
    assert max(e.self_cpu_memory_usage for e in prof.events()
               if e.name != "[memory]") >= BATCH * CONTEXT * VOCAB * 4
    assert abs(plain - want) <= 1e-7 * want  # the same loss, through float64


def test_prefix_note_runs_the_evaluations_float32_gemms(word_tokenizer, monkeypatch, tmp_path):
    """The note scores two windows of the baseline, which ran through torch's own bf16 GEMMs
    (40% of a SmolLM2 three-model comparison on a CPU without fast bf16 kernels) while the
    evaluation itself runs them in float32 (``float32_gemms``): now under the same mode."""
    model = tiny("llama", vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1,
                 num_attention_heads=2, intermediate_size=32, max_position_embeddings=CONTEXT,
                 tie_word_embeddings=True).to(torch.bfloat16)
    word_tokenizer.pad_token = word_tokenizer.eos_token
    wiki = tmp_path / "wiki.test.raw"
    wiki.write_text(" \n = Fox = \n \n " + " ".join(["the quick brown fox"] * 40) + " \n")
    monkeypatch.setattr(gemm32, "wanted", lambda dtype, force=None: True)
    seen = []
    monkeypatch.setattr(prefix_effect_module, "prefix_effect",
                        lambda lm, text: seen.append(getattr(gemm32._active, "on", False)) or 1.0)
    assert compare.prefix_notes(model, word_tokenizer, "auto",
                                {"data": {"wikitext": str(wiki)}, "seq_len": 64}) == []
    assert seen == [True]
