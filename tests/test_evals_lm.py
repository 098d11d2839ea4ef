"""fp8ptq.evals on a tiny random Llama: WikiText perplexity, generative SQuAD, run_tasks checks."""

import copy
import json
import math
import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from lm_eval.models.huggingface import HFLM
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from fp8ptq.errors import DataError, UsageError
from fp8ptq.evals.harness import make_lm
from fp8ptq.evals.runner import run_tasks
from fp8ptq.evals.wikitext import (
    SPLIT_RULE,
    evaluate_wikitext,
    prefix_effect,
    read_articles,
    split_articles,
)

ARTICLES = [
    " = Alpha Station = \n"
    " Alpha Station is a railway station in the north of the town . It opened in 1901 . \n"
    " = = History = = \n"
    " The station was built by the Northern Railway , and rebuilt in 1950 after a fire . \n",
    " = The Blue River = \n"
    " The Blue River flows 120 km from the hills to the sea . Its water is cold and clear . \n"
    " Fishing is popular along its banks in the summer months . \n",
    " = Gamma ( album ) = \n"
    " Gamma is the third album by the band . It was recorded in 2004 and sold well . \n"
    " = = Track listing = = \n"
    " The album has ten songs , and the title song was a single . \n",
]

SQUAD = {
    "version": "1.1",
    "data": [
        {
            "title": "Blue_River",
            "paragraphs": [
                {
                    "context": "The Blue River flows 120 km from the hills to the sea.",
                    "qas": [
                        {"id": f"q{i}", "question": q, "answers": [{"text": a, "answer_start": 0}]}
                        for i, (q, a) in enumerate(
                            [("How long is the river?", "120 km"),
                             ("Where does it flow to?", "the sea"),
                             ("Where does it start?", "the hills"),
                             ("What flows?", "The Blue River")]
                        )
                    ],
                }
            ],
        }
    ],
}


@pytest.fixture(autouse=True)
def offline_hf(monkeypatch, tmp_path):
    for name in ("HF_HOME", "HF_DATASETS_CACHE"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="module")
def tokenizer():
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(ARTICLES, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def wiki_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("wikitext") / "wiki.test.raw"
    path.write_bytes("".join(ARTICLES).replace("\n", "\r\n").encode())  # CRLF like the real file
    return path


@pytest.fixture(scope="module")
def squad_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("squad") / "dev.json"
    path.write_text(json.dumps(SQUAD))
    return path


def test_split_articles_on_level_one_headings():
    text = "".join(ARTICLES)
    assert split_articles(text) == ARTICLES
    assert "".join(split_articles(text)) == text


def test_read_articles_crlf_and_missing(wiki_file, tmp_path):
    assert [a["page"] for a in read_articles(wiki_file)] == ARTICLES
    with pytest.raises(DataError):
        read_articles(tmp_path / "missing.raw")


def _direct_loglikelihood(model, tokenizer, text):
    """sum log p(token | BOS, previous tokens): one window, what lm-eval must reproduce."""
    ids = tokenizer(text)["input_ids"]
    inputs = torch.tensor([[tokenizer.bos_token_id, *ids[:-1]]])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(inputs).logits.float(), dim=-1)[0]
    return logprobs[torch.arange(len(ids)), torch.tensor(ids)].sum().item(), len(ids)


def test_wikitext_matches_hand_computation(model, tokenizer, wiki_file):
    lm = make_lm(model, tokenizer, batch_size=4, seq_len=512)  # every article fits one window
    outcome = evaluate_wikitext(lm, wiki_file)
    protocol = outcome.protocol
    assert protocol["context_length"] == 512 and protocol["stride"] == 512
    assert protocol["bos"] is True and protocol["split"] == SPLIT_RULE
    assert protocol["documents"] == len(ARTICLES) == len(outcome.samples)

    loglikelihoods = [s["word_perplexity"][0] for s in outcome.samples]
    words = sum(len(re.split(r"\s+", s["doc"]["page"])) for s in outcome.samples)
    assert outcome.metrics["word_perplexity"] == pytest.approx(
        math.exp(-sum(loglikelihoods) / words))
    nbytes = sum(len(s["doc"]["page"].encode()) for s in outcome.samples)
    assert outcome.metrics["bits_per_byte"] == pytest.approx(
        -sum(loglikelihoods) / nbytes / math.log(2))

    direct = [_direct_loglikelihood(model, tokenizer, s["target"]) for s in outcome.samples]
    assert loglikelihoods == pytest.approx([ll for ll, _ in direct], rel=1e-4)
    assert protocol["tokens"] == sum(n for _, n in direct)
    expected_token_ppl = math.exp(-sum(ll for ll, _ in direct) / protocol["tokens"])
    assert outcome.metrics["token_perplexity"] == pytest.approx(expected_token_ppl, rel=1e-4)


def _adds_bos(tokenizer):
    """The same vocabulary, with a tokenizer that adds its BOS to every encoding (gemma's and
    Llama 3's do)."""
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    bos = tokenizer.bos_token_id
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    adds = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")
    assert adds("a b")["input_ids"][0] == bos != tokenizer("a b")["input_ids"][0]
    return adds


@pytest.mark.parametrize("seq_len", [512, 16])  # one window per article; several
def test_wikitext_opens_with_one_start_token_when_the_tokenizer_adds_it(model, tokenizer,
                                                                        wiki_file, seq_len):
    """lm-eval puts its prefix token (the BOS) before a document the tokenizer has already
    opened with its BOS: two of them, the second scored. The harness takes the tokenizer's own
    off, so the scores are those of a tokenizer that adds none, window for window."""
    adds = _adds_bos(tokenizer)
    plain = evaluate_wikitext(make_lm(model, tokenizer, batch_size=4, seq_len=seq_len),
                              wiki_file)
    lm = make_lm(model, adds, batch_size=4, seq_len=seq_len)
    once = evaluate_wikitext(lm, wiki_file)
    assert once.metrics == pytest.approx(plain.metrics, rel=1e-6)
    assert once.protocol["tokens"] == plain.protocol["tokens"]
    assert once.protocol["own_start_dropped"] and not plain.protocol["own_start_dropped"]
    assert [s["word_perplexity"][0] for s in once.samples] == pytest.approx(
        [s["word_perplexity"][0] for s in plain.samples], rel=1e-6)
    if seq_len == 512:  # and equal to the hand computation with one BOS
        direct = [_direct_loglikelihood(model, tokenizer, s["target"]) for s in once.samples]
        assert [s["word_perplexity"][0] for s in once.samples] == pytest.approx(
            [ll for ll, _ in direct], rel=1e-4)
    # lm-eval's own HFLM scores the doubled start: a different number, more tokens
    upstream = HFLM(pretrained=model, tokenizer=adds, max_length=seq_len, batch_size=4)
    doubled = evaluate_wikitext(upstream, wiki_file)
    assert doubled.protocol["tokens"] == plain.protocol["tokens"] + len(ARTICLES)
    assert doubled.metrics["word_perplexity"] != pytest.approx(
        plain.metrics["word_perplexity"], rel=1e-3)
    # prefix_effect reads the text's tokens, not the tokenizer's BOS as the first one
    text = read_articles(wiki_file)[0]["page"]
    assert prefix_effect(lm, text) == pytest.approx(
        prefix_effect(make_lm(model, tokenizer, batch_size=4, seq_len=seq_len), text),
        rel=1e-6)


def test_wikitext_rolling_windows_and_limit(model, tokenizer, wiki_file):
    lm = make_lm(model, tokenizer, batch_size=4, seq_len=16)  # several windows per article
    outcome = evaluate_wikitext(lm, wiki_file, limit=2)
    assert outcome.protocol["documents"] == 2 and outcome.protocol["context_length"] == 16
    assert [s["doc"]["page"] for s in outcome.samples] == ARTICLES[:2]
    assert set(outcome.metrics) == {"word_perplexity", "byte_perplexity", "bits_per_byte",
                                    "token_perplexity"}
    assert all(math.isfinite(v) and v > 0 for v in outcome.metrics.values())


def test_run_tasks_wikitext_and_generative_squad(model, tokenizer, wiki_file, squad_file):
    result = run_tasks(
        model, tokenizer, ["wikitext", "squad"],
        data={"wikitext": str(wiki_file), "squad": str(squad_file)}, limit=3, seq_len=256,
    )
    assert set(result.metrics) == {
        "wikitext.word_perplexity", "wikitext.byte_perplexity", "wikitext.bits_per_byte",
        "wikitext.token_perplexity", "squad.exact_match", "squad.f1",
    }
    assert math.isfinite(result.metrics["wikitext.token_perplexity"])
    assert 0 <= result.metrics["squad.exact_match"] <= result.metrics["squad.f1"] <= 100
    assert result.protocol["squad"]["questions"] == 3
    assert result.protocol["squad"]["mode"] == "generative"
    assert result.protocol["wikitext"]["documents"] == 3
    assert set(result.seconds) == {"wikitext", "squad"}


@pytest.mark.slow
def test_run_tasks_rejects_bad_requests(model, tokenizer, wiki_file, tmp_path):
    with pytest.raises(UsageError, match="unknown task"):
        run_tasks(model, tokenizer, ["no_such_task_xyz"], include_path=str(tmp_path))
    with pytest.raises(DataError, match="not found"):
        run_tasks(model, tokenizer, ["wikitext"], data={"wikitext": str(tmp_path / "nope.raw")})
    with pytest.raises(UsageError):
        run_tasks(model, tokenizer, ["wikitext"], data={"hellaswag": str(wiki_file)})
    with pytest.raises(UsageError):
        run_tasks(model, tokenizer, [])


def test_run_tasks_passes_other_names_to_lm_eval(model, tokenizer, tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": article}) + "\n" for article in ARTICLES))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_rolling.yaml").write_text(
        "task: tiny_rolling\n"
        "dataset_path: json\n"
        f"dataset_kwargs: {{data_files: {{test: {docs}}}, cache_dir: {tmp_path / 'cache'}}}\n"
        "output_type: loglikelihood_rolling\n"
        "test_split: test\n"
        'doc_to_text: ""\n'
        'doc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n"
    )
    result = run_tasks(model, tokenizer, ["tiny_rolling"], include_path=str(tasks), limit=2,
                       seq_len=64)
    assert list(result.metrics) == ["tiny_rolling.word_perplexity"]
    assert math.isfinite(result.metrics["tiny_rolling.word_perplexity"])
    assert result.protocol["tiny_rolling"]["samples"] == {"tiny_rolling": 2}


def test_bf16_models_are_scored_from_float32_logits(model, tokenizer, wiki_file, monkeypatch):
    from fp8ptq.evals.harness import float32_logits

    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    lm = make_lm(bf16, tokenizer, batch_size=4, seq_len=512)
    with float32_logits(bf16):
        outcome = evaluate_wikitext(lm, wiki_file)
    loglikelihoods = [s["word_perplexity"][0] for s in outcome.samples]
    direct = [_direct_loglikelihood(bf16, tokenizer, s["target"])[0] for s in outcome.samples]
    assert loglikelihoods == pytest.approx(direct, rel=1e-5)
    # fp8ptq's chunked scoring takes the log-softmax in float32 even without the hook ...
    ours = [s["word_perplexity"][0] for s in evaluate_wikitext(lm, wiki_file).samples]
    assert ours == pytest.approx(direct, rel=1e-5)
    # ... while lm-eval's own HFLM sums bf16 log-probabilities: visibly rounded
    from lm_eval.models.huggingface import HFLM

    upstream = HFLM(pretrained=bf16, tokenizer=tokenizer, max_length=512, batch_size=4)
    plain = [s["word_perplexity"][0] for s in evaluate_wikitext(upstream, wiki_file).samples]
    assert plain != pytest.approx(direct, rel=1e-5)
    monkeypatch.setenv("FP8PTQ_FLOAT32_GEMMS", "0")  # torch's bf16 kernels, as above
    metrics = run_tasks(bf16, tokenizer, ["wikitext"], data={"wikitext": str(wiki_file)},
                        seq_len=512).metrics
    assert metrics["wikitext.word_perplexity"] == pytest.approx(outcome.metrics["word_perplexity"])


def test_bf16_eval_runs_its_gemms_and_attention_in_float32(model, tokenizer, wiki_file,
                                                            monkeypatch):
    """``run_tasks`` runs a bf16 model's linear layers and attention in float32 (forced on:
    ``fp8ptq.model.gemm32``), and its scores move only by bf16 rounding: each document's
    log-likelihood within 0.01% of the pure-bf16 run's, and the sum no farther from the float32
    model's than the pure-bf16 run's is."""
    from fp8ptq.model import gemm32

    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    calls = []
    for name in ("linear32", "attention32"):
        real = getattr(gemm32, name)
        monkeypatch.setattr(gemm32, name, lambda *a, _r=real, _n=name, **k:
                            calls.append(_n) or _r(*a, **k))

    def loglikelihoods(m, force):
        monkeypatch.setenv("FP8PTQ_FLOAT32_GEMMS", force)
        result = run_tasks(m, tokenizer, ["wikitext"], data={"wikitext": str(wiki_file)},
                           seq_len=512)
        return [r["loglikelihood"] for r in result.samples["wikitext"]]

    plain = loglikelihoods(bf16, "0")
    assert calls == []
    mode = loglikelihoods(bf16, "1")
    assert {"linear32", "attention32"} <= set(calls)
    assert mode != plain  # another rounding, not the same kernels
    assert mode == pytest.approx(plain, rel=1e-4)
    exact = loglikelihoods(model, "1")  # float32 model: the mode changes nothing
    assert abs(sum(mode) - sum(exact)) <= abs(sum(plain) - sum(exact))


def _served_windows_loglikelihood(model, tokenizer, text, length):
    """sum log p over windows of ``length - 1`` scored tokens, each opened by the BOS (and,
    after the first, the token before its first scored one): what ``every`` must give."""
    ids, bos, total, p = tokenizer(text)["input_ids"], tokenizer.bos_token_id, 0.0, 0
    while p < len(ids):
        e = min(len(ids), p + length - 1)
        x = [bos, *ids[:e - 1]] if p == 0 else [bos, *ids[p - 1:e - 1]]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([x])).logits.float(), dim=-1)[0]
        y = torch.tensor(ids[p:e])
        total += logp[-len(y):].gather(1, y[:, None]).sum().item()
        p = e
    return total


@pytest.mark.parametrize("adds_bos", [False, True])
def test_every_window_opens_with_the_prefix_token(model, tokenizer, wiki_file, adds_bos):
    tok = _adds_bos(tokenizer) if adds_bos else tokenizer
    lm = make_lm(model, tok, batch_size=4, seq_len=16, prefix_token="bos", window_start="every")
    every = evaluate_wikitext(lm, wiki_file)
    first = evaluate_wikitext(make_lm(model, tok, batch_size=4, seq_len=16, prefix_token="bos"),
                              wiki_file)
    assert every.protocol["window_start"] == "every" and every.protocol["stride"] == 15
    assert first.protocol["window_start"] == "first" and first.protocol["stride"] == 16
    assert every.protocol["tokens"] == first.protocol["tokens"]  # the same tokens scored
    got = [s["word_perplexity"][0] for s in every.samples]
    want = [_served_windows_loglikelihood(model, tokenizer, s["target"], 16)
            for s in every.samples]
    assert got == pytest.approx(want, rel=1e-4)
    assert got != pytest.approx([s["word_perplexity"][0] for s in first.samples], rel=1e-4)
    assert lm.max_length == 16  # only while lm-eval cuts the windows


def test_every_window_needs_a_prefix_token(model, tokenizer):
    with pytest.raises(UsageError, match="--prefix-token none"):
        make_lm(model, tokenizer, prefix_token="none", window_start="every")
    with pytest.raises(UsageError, match="--window-start must be one of"):
        make_lm(model, tokenizer, window_start="all")
