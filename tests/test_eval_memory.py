"""Evaluation never materializes batch x context x vocabulary float32 logits: a small-hidden
model with a 262,144-token vocabulary at context 2048, batch 8, measured in a subprocess
(peak RSS), against the bound model bytes + 2 GB (lm-eval's own path needs ~17 GB there)."""

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, resource, sys, torch
    sys.path.insert(0, {tests!r})
    from transformers import LlamaConfig, LlamaForCausalLM
    from fp8ptq.evals.harness import make_lm
    from fp8ptq.evals.wikitext import evaluate_wikitext
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
