"""Paired bootstrap intervals of deltas: hand-checkable cases, coverage on synthetic data, and
the eval CLI's relative deltas / intervals / --gate-on / --samples / --prefix-token."""

import json
import math

import numpy as np
import pytest

from fp8ptq.evals.report import attach_intervals, check_gates
from fp8ptq.evals.stats import mean_records, paired_interval, wikitext_records


def wiki(ll, words):
    return [{"word_perplexity": (ll_, w), "byte_perplexity": (ll_, 3 * w),
             "bits_per_byte": (ll_, 3 * w), "token_perplexity": (ll_, 2 * w), "doc_id": i}
            for i, (ll_, w) in enumerate(zip(ll, words))]


def test_records_reproduce_lm_eval_aggregations():
    r = wikitext_records(wiki([-10.0, -30.0], [5, 15]))
    assert math.isclose(r.metric("word_perplexity"), math.exp(40 / 20))
    assert math.isclose(r.metric("bits_per_byte"), 40 / (60 * math.log(2)))
    assert math.isclose(r.metric("token_perplexity"), math.exp(40 / 40))


def test_a_uniform_shift_has_an_exact_interval():
    """Every document loses c nats per word: every resample's word perplexity rises by exactly
    the factor exp(c), so the interval collapses onto it."""
    rng = np.random.default_rng(0)
    words = rng.integers(50, 200, 20)
    ll = -rng.uniform(2, 4, 20) * words
    c = 0.05
    base, other = wikitext_records(wiki(ll, words)), wikitext_records(wiki(ll - c * words, words))
    iv = paired_interval(base, other, "word_perplexity")
    want = 100 * (math.exp(c) - 1)
    assert iv["pct_ci95"] == pytest.approx([want, want], rel=1e-9)
    same = paired_interval(base, base, "word_perplexity")
    assert same["ci95"] == [0.0, 0.0]


def test_mean_metrics_keep_only_what_reproduces_the_reported_value():
    rows = [{"acc": 1.0, "f1": 50.0, "label": "x"}, {"acc": 0.0, "f1": 100.0, "label": "y"}]
    r = mean_records(rows, {"acc": 0.5, "f1": 75.0, "other": 3.0})
    assert set(r.formulas) == {"acc", "f1"}
    assert r.metric("acc") == 0.5 and r.metric("f1") == 75.0
    pct = mean_records(rows, {"acc": 50.0})  # reported in percent: scale found
    assert pct.metric("acc") == 50.0
    # not a mean: no interval rather than a wrong one
    assert mean_records(rows, {"acc": 0.7}) is None


def test_interval_coverage_on_synthetic_documents():
    """Documents whose per-word log-likelihood differs by a random amount with a known mean:
    the 95% interval of the word-perplexity ratio covers the population value ~95% of the time."""
    rng = np.random.default_rng(1)
    covered, trials, n = 0, 100, 60
    mu = 0.02
    for t in range(trials):
        words = np.full(n, 100)
        base_ll = -3.0 * words + rng.normal(0, 20, n)
        shift = rng.normal(mu, 0.05, n)
        base = wikitext_records(wiki(base_ll, words))
        other = wikitext_records(wiki(base_ll - shift * words, words))
        iv = paired_interval(base, other, "word_perplexity", resamples=400, seed=t)
        # population: mean log-likelihood per word drops by mu
        truth = 100 * (math.exp(mu) - 1)
        covered += iv["pct_ci95"][0] <= truth <= iv["pct_ci95"][1]
    assert 0.85 <= covered / trials <= 1.0


def test_gate_on_ci_upper_fails_what_the_point_estimate_passes():
    rng = np.random.default_rng(2)
    words = np.full(10, 100)
    ll = -3.0 * words + rng.normal(0, 30, 10)
    noisy = ll - rng.normal(0.0, 0.2, 10) * words
    variants = [{"name": "baseline", "metrics": {}, "records": {"wikitext": wikitext_records(
        wiki(ll, words))}}, {"name": "q", "metrics": {}, "records": {
            "wikitext": wikitext_records(wiki(noisy, words))}}]
    for v in variants:
        v["metrics"]["wikitext.word_perplexity"] = float(
            v["records"]["wikitext"].metric("word_perplexity"))
    attach_intervals(variants)
    iv = variants[1]["intervals"]["wikitext.word_perplexity"]
    point = variants[1]["metrics"]["wikitext.word_perplexity"] - \
        variants[0]["metrics"]["wikitext.word_perplexity"]
    limit = max(point, 0) + 1e-6 + (iv["ci95"][1] - max(point, 0)) / 2  # between the two
    gate = [f"word_perplexity={limit}"]
    assert check_gates(variants, gate) == []
    failures = check_gates(variants, gate, "ci-upper")
    assert len(failures) == 1 and "worse end of the 95% CI" in failures[0]


@pytest.mark.slow
def test_eval_cli_reports_relative_deltas_intervals_and_samples(tmp_path, word_tokenizer):

    from tiny_models import invoke, tiny

    tiny("llama").save_pretrained(tmp_path / "m")
    word_tokenizer.save_pretrained(tmp_path / "m")
    (tmp_path / "wiki.raw").write_text(
        " = a = \n the quick brown fox jumps over the lazy dog . \n"
        " = b = \n hello world and hello again . \n = c = \n a small model reads text . \n")
    (tmp_path / "calib.txt").write_text("hello world and hello again\n" * 20)
    args = ["eval", str(tmp_path / "m"), "--tasks", "wikitext", "--data",
            f"wikitext={tmp_path / 'wiki.raw'}", "--compare", "e5m2", "--calib-data",
            str(tmp_path / "calib.txt"), "--num-samples", "4", "--calib-seq-len", "8",
            "--dtype", "float32", "--json", str(tmp_path / "r.json"), "--samples",
            str(tmp_path / "s.jsonl"), "--markdown", str(tmp_path / "r.md"), "--prefix-token",
            "eos"]
    res = invoke(args)
    assert res.exit_code == 0, (res.output, res.exception)
    assert "95% CI" in res.stdout and "%, 95% CI" in res.stdout
    assert "prefix_token=eos" in res.stdout
    doc = json.loads((tmp_path / "r.json").read_text())
    q = doc["variants"][1]
    key = "wikitext.word_perplexity"
    assert q["deltas_pct"][key] == pytest.approx(100 * q["deltas"][key] /
                                                 doc["variants"][0]["metrics"][key])
    lo, hi = q["deltas_ci95"][key]
    assert lo <= hi
    records = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert {(r["variant"], r["doc_id"]) for r in records} == {
        (v, i) for v in ("baseline", "e5m2") for i in range(3)}
    base = [r for r in records if r["variant"] == "baseline"]
    ll, words = sum(r["loglikelihood"] for r in base), sum(r["words"] for r in base)
    assert math.exp(-ll / words) == pytest.approx(doc["variants"][0]["metrics"][key], rel=1e-6)
    res = invoke([*args[:-2], "--delta", "abs", "--json",
                  str(tmp_path / "r2.json")])
    assert res.exit_code == 0 and "%," not in res.stdout.split("protocol")[0]


def test_prefix_token_none_scores_all_but_the_first_token(tmp_path, word_tokenizer):
    """With no prefix, the log-likelihood is that of tokens 2..n given the first, computed by
    hand from the model's logits."""
    import copy

    import torch

    from fp8ptq.evals.harness import make_lm
    from fp8ptq.evals.wikitext import evaluate_wikitext
    from tiny_models import tiny

    word_tokenizer = copy.deepcopy(word_tokenizer)  # HFLM sets a pad token on the one it gets
    model = tiny("llama").float()
    text = " = a = \n the quick brown fox jumps over the lazy dog . \n"
    (tmp_path / "w.raw").write_text(text)
    lm = make_lm(model, word_tokenizer, batch_size=1, prefix_token="none")
    outcome = evaluate_wikitext(lm, tmp_path / "w.raw")
    ll, tokens = outcome.samples[0]["token_perplexity"]
    ids = make_lm(model, word_tokenizer).tok_encode(
        __import__("fp8ptq.evals.wikitext", fromlist=["x"]).wikitext_detokenizer({"page": text}))
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids[:-1]])).logits.float(), -1)[0]
    direct = float(logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum())
    assert tokens == len(ids) - 1
    assert ll == pytest.approx(direct, rel=1e-5)
    assert outcome.protocol["prefix_token"].startswith("none")


def test_exact_bootstrap_on_tiny_slices_by_hand():
    """Two questions, one flips from wrong to right: the resampled mean delta is 0, 1/2 or 1
    with probabilities 1/4, 1/2, 1/4, so the 95% interval is [0, 1]. Three questions, one
    flips: k of 3 draws hit it with probability C(3,k)(1/3)^k(2/3)^(3-k) = 8/27, 12/27, 6/27,
    1/27; the 97.5% point is 1 (P(<= 2/3) = 26/27 < 0.975), the 2.5% point 0."""
    from fp8ptq.evals.stats import exact_resamples

    rows, w = exact_resamples(3)
    assert len(rows) == math.comb(5, 3) and math.isclose(w.sum(), 1.0)
    assert math.isclose(w[0], 1 / 27) and math.isclose(w[1], 3 / 27)  # (0,0,0), (0,0,1)
    for acc_base, acc_q, want in (([0, 1], [1, 1], [0.0, 1.0]),
                                  ([0, 1, 1], [1, 1, 1], [0.0, 1.0]),
                                  ([1, 1, 1], [1, 1, 1], [0.0, 0.0])):
        base = mean_records([{"acc": float(a)} for a in acc_base])
        q = mean_records([{"acc": float(a)} for a in acc_q])
        iv = paired_interval(base, q, "acc")
        assert iv["exact"] and iv["ci95"] == want
    # four questions, three flip: P(none drawn) = 1/256 < 2.5% <= P(at most one) = 13/256
    three = paired_interval(mean_records([{"acc": a} for a in (0.0, 0.0, 0.0, 1.0)]),
                            mean_records([{"acc": a} for a in (1.0, 1.0, 1.0, 1.0)]), "acc")
    assert three["ci95"] == [0.25, 1.0]
    assert three["pct_ci95"] is not None  # resamples with a 0 baseline have no relative delta


def test_exact_and_drawn_bootstrap_agree():
    from fp8ptq.evals import stats

    rng = np.random.default_rng(3)
    words = rng.integers(50, 150, 7)
    ll = -3.0 * words + rng.normal(0, 20, 7)
    base = wikitext_records(wiki(ll, words))
    other = wikitext_records(wiki(ll - rng.normal(0.05, 0.05, 7) * words, words))
    exact = paired_interval(base, other, "word_perplexity")
    assert exact["exact"]
    limit, stats.EXACT_MAX = stats.EXACT_MAX, 0
    try:
        drawn = paired_interval(base, other, "word_perplexity", resamples=20000)
    finally:
        stats.EXACT_MAX = limit
    assert not drawn["exact"]
    assert drawn["pct_ci95"] == pytest.approx(exact["pct_ci95"], abs=0.25)
