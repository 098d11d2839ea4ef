"""``quantize --target-delta --target-metric kl``: the KL probe against hand-computed and
full-vocabulary KL (its top-k + tail approximation and the exact size of its error), the
selection in KL units on synthetic deltas, the disjoint selection / verification documents, and
the CLI option with its fp8ptq.json fields."""

from __future__ import annotations

import math

import pytest
import torch
from click.testing import CliRunner

from fp8ptq.checkpoint import read_metadata
from fp8ptq.cli.main import main
from fp8ptq.config.recipe import Recipe
from fp8ptq.execution.job import selection_and_verify
from fp8ptq.sensitivity.budget import assign, ladder, metric_budget, predicted_delta
from fp8ptq.sensitivity.probes import KLProbe, PerplexityProbe, coarse_kl
from test_target_delta import sensitive_llama, windows
from tiny_models import VOCAB, saved_with_documents, target_delta_report
from tolerances import perplexity_rel_tolerance


def test_coarse_kl_hand_case():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)
    full = float((p * (p / q).log()).sum())
    # top-1 = token 0; tail: P 0.5, Q 0.6
    mass = torch.tensor([0.5, 0.6], dtype=torch.float64).log()  # tails: P 0.5, Q 0.6
    got = float(coarse_kl(p[:1].log()[None], mass[:1], q[:1].log()[None], mass[1:]))
    want = 0.5 * math.log(0.5 / 0.4) + 0.5 * math.log(0.5 / 0.6)
    assert got == pytest.approx(want, rel=1e-6)
    # short of the full KL by the tail's own KL, weighted by its mass
    pt, qt = p[1:] / 0.5, q[1:] / 0.6
    assert full - got == pytest.approx(0.5 * float((pt * (pt / qt).log()).sum()), rel=1e-5)
    # every token in the top-k (no tail): exact
    exact = coarse_kl(p.log()[None], torch.tensor([-math.inf]), q.log()[None],
                      torch.tensor([-math.inf]))
    assert float(exact) == pytest.approx(full, rel=1e-6)


def _full_kl(ref_logits, logits):
    """Mean full-vocabulary KL(p_ref || q) over the scored positions, and the exact shortfall
    of the top-k + tail approximation: mean of P_tail x KL(p | tail || q | tail)."""
    lp, lq = ref_logits.log_softmax(-1).double(), logits.log_softmax(-1).double()
    return float((lp.exp() * (lp - lq)).sum(-1).mean()), lp, lq


def _tail_shortfall(lp, lq, k):
    idx = lp.topk(k, dim=-1).indices
    mask = torch.ones_like(lp, dtype=torch.bool).scatter(-1, idx, False)
    lp_t = lp.masked_fill(~mask, -math.inf)
    lq_t = lq.masked_fill(~mask, -math.inf)
    P, Q = lp_t.logsumexp(-1, keepdim=True), lq_t.logsumexp(-1, keepdim=True)
    cond_p, cond_q = lp_t - P, lq_t - Q
    kl_tail = torch.where(mask, cond_p.exp() * (cond_p - cond_q), 0.0).sum(-1)
    return float((P.squeeze(-1).exp() * kl_tail).mean())


@pytest.fixture(scope="module")
def trained():
    return sensitive_llama()


@pytest.mark.slow
def test_kl_probe_against_full_vocabulary(trained):
    model = trained
    ids = windows(4, 32, 200)
    stack = model.model.layers
    with torch.no_grad():
        ref = model(input_ids=ids).logits[:, :-1].float()
    full_k = KLProbe(model, ids, 2, stack, top_k=VOCAB)
    small_k = KLProbe(model, ids, 2, stack, top_k=4)
    base = full_k.baseline()
    assert small_k.baseline() == base
    assert base == pytest.approx(PerplexityProbe(model, ids, 2)(),
                                 rel=perplexity_rel_tolerance(base))
    assert full_k() == 0.0  # the unquantized model against itself
    weight = model.model.layers[1].mlp.down_proj.weight
    saved = weight.detach().clone()
    try:
        with torch.no_grad():  # a perturbation of layer 1 (layer 0 replayed from the cache)
            weight.add_(0.05 * torch.randn(weight.shape, generator=torch.Generator()
                                           .manual_seed(1)))
            logits = model(input_ids=ids).logits[:, :-1].float()
        want, lp, lq = _full_kl(ref, logits)
        assert want > 1e-4
        got = full_k(1)
        assert got == pytest.approx(want, rel=1e-4)  # every token kept: the full KL
        assert full_k() == pytest.approx(got, rel=1e-6)  # replay changes nothing
        assert full_k.last_ppl == pytest.approx(PerplexityProbe(model, ids, 2)(),
                                                rel=perplexity_rel_tolerance(full_k.last_ppl))
        # top-4 of 128 tokens: a lower bound, short by exactly the tail's weighted KL
        coarse = small_k(1)
        assert 0 < coarse <= got + 1e-9
        assert got - coarse == pytest.approx(_tail_shortfall(lp, lq, 4), rel=1e-3, abs=1e-7)
    finally:
        with torch.no_grad():
            weight.copy_(saved)


def test_kl_probe_needs_a_baseline(trained):
    with pytest.raises(Exception, match="baseline"):
        KLProbe(trained, windows(2, 16, 1), 2)()


def test_assign_in_kl_units():
    """KL deltas are >= 0 and add: the 1% budget becomes log(1.01) nats per token, and the
    prediction exp(sum) - 1 of the chosen units stays within it."""
    rungs = ladder(Recipe(weight_calib="gptq", act_granularity="token"))  # base, fallback
    kl = {"a": 0.004, "b": 0.0005, "c": 0.003, "d": 0.0001, "e": 0.002}
    deltas = {u: {"base": v, "fallback": 0.0} for u, v in kl.items()}
    ppl = 30.0
    budget = metric_budget("kl", 0.01 * ppl, ppl)
    assert budget == pytest.approx(math.log(1.01))
    choice = assign(deltas, rungs, budget)
    assert choice == {u: "base" for u in kl}  # summed 0.0096 <= log(1.01) = 0.00995
    # 0.5%: log(1.005) = 0.00499 -- a (0.004) then c (0.003) go, largest first
    choice = assign(deltas, rungs, metric_budget("kl", 0.005 * ppl, ppl))
    assert {u for u, r in choice.items() if r == "fallback"} == {"a", "c"}
    total = sum(kl[u] for u, r in choice.items() if r == "base")
    assert predicted_delta("kl", total, ppl) == pytest.approx(ppl * math.expm1(0.0026))
    assert predicted_delta("kl", total, ppl) <= 0.005 * ppl
    assert predicted_delta("ppl", 0.2, ppl) == 0.2 and metric_budget("ppl", 0.3, ppl) == 0.3


def test_selection_and_verify_documents_are_disjoint():
    docs = [f"d{i}" for i in range(7)]
    sel, ver = selection_and_verify(docs, True)
    assert sel == ["d0", "d2", "d4", "d6"] and ver == ["d1", "d3", "d5"]
    assert selection_and_verify(docs, False) == (docs, [])
    assert selection_and_verify(["one"], True) == (["one"], [])


@pytest.fixture(scope="module")
def kl_dir(tmp_path_factory, word_tokenizer, trained):
    # 200 documents: 20 held out, 10 to choose on and 10 to verify on
    return saved_with_documents(tmp_path_factory.mktemp("target_kl"), trained, word_tokenizer,
                                200)


@pytest.mark.slow
def test_cli_target_metric_kl(kl_dir, tmp_path):
    out = tmp_path / "q"
    t = target_delta_report(kl_dir, out, "--target-delta", "2%", "--target-metric", "kl")
    assert t["metric"] == "kl" and t["eval"]["replay"]  # the sweep replayed layer 0
    assert t["budget_metric"] == pytest.approx(math.log1p(t["budget"] / t["baseline"]))
    assert all(u["deltas"]["base"] >= 0 for u in t["units"])  # KL: never negative
    assert all(set(u["ppl_deltas"]) == set(u["deltas"]) for u in t["units"])
    assert t["predicted"] == pytest.approx(t["baseline"] * math.expm1(t["predicted_metric"]))
    assert t["predicted_metric"] <= t["budget_metric"]
    assert t["measured_metric"] is not None and t["measured_metric"] >= 0
    # verified on the other half of the held-out documents, and that is the headline
    v = t["verify"]
    assert v["disjoint"] and v["tokens"] >= 256
    assert t["headline"] == {"slice": "verify", "predicted_pct": t["predicted_pct"],
                             "measured_pct": v["delta_pct"], "tokens": v["tokens"],
                             "disjoint": True}
    assert read_metadata(out)["extras"]["target_delta"]["metric"] == "kl"
    res = CliRunner().invoke(main, [
        "quantize", str(kl_dir / "llama"), "-o", str(tmp_path / "t"), "--calib-data",
        str(kl_dir / "calib.txt"), "--num-samples", "4", "--seq-len", "32", "--dtype",
        "float32", "--target-delta", "2%", "--target-metric", "kl", "--target-tokens", "128",
        "--target-level", "block"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "by KL against the unquantized model" in text
    assert "held-out documents not chosen on" in text


def test_cli_target_metric_bad_value(kl_dir, tmp_path):
    res = CliRunner().invoke(main, ["quantize", str(kl_dir / "llama"), "-o",
                                    str(tmp_path / "x"), "--calib-data",
                                    str(kl_dir / "calib.txt"), "--target-delta", "1%",
                                    "--target-metric", "entropy"])
    assert res.exit_code == 2, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--target-metric must be one of kl, ppl" in errors[0]
    assert not (tmp_path / "x").exists()
