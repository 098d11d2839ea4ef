"""``quantize --target-delta``: the ladder of choices, the greedy assignment (hand-made deltas),
and on a tiny Llama with one module forced to be sensitive: that module alone leaves the base
rung, the prediction meets the target, the final model is measured, and the decisions are in
fp8ptq.json, the recorded recipe and the report."""

from __future__ import annotations

import math

import pytest
import torch
from click.testing import CliRunner

from fp8ptq.checkpoint import read_metadata
from fp8ptq.cli.main import main
from fp8ptq.config.recipe import Recipe
from fp8ptq.errors import UsageError
from fp8ptq.execution.in_memory import quantize_model, token_batches
from fp8ptq.nn.quant_gemm import QuantGemm
from fp8ptq.observe.hessian import HessianCollector
from fp8ptq.sensitivity.budget import (
    Rung,
    assign,
    choose,
    ladder,
    measure,
    perplexity,
    split_heldout,
    verify,
)
from tiny_models import IDS, VOCAB, saved_with_documents, target_delta_report, tiny
from tolerances import pct_delta_abs_tolerance, perplexity_rel_tolerance

SENSITIVE = "model.layers.0.mlp.down_proj"


def test_ladder():
    names = [r.name for r in ladder(Recipe(act_granularity="tensor"))]
    assert names == ["base", "gptq", "finer", "fallback"]
    rungs = {r.name: r for r in ladder(Recipe(act_granularity="tensor"))}
    assert rungs["gptq"].fields == {"weight_calib": "gptq"}
    assert rungs["finer"].fields == {"weight_calib": "gptq", "act_granularity": "token"}
    assert rungs["fallback"].skip and rungs["fallback"].override() == "none"
    # already GPTQ (MSE scales) with dynamic activations and tensor weights
    r = {x.name: x for x in ladder(Recipe(weight_calib="mse", act_granularity="token",
                                          weight_granularity="tensor"), "e5m2")}
    assert list(r) == ["base", "gptq", "finer", "fallback"]
    assert r["gptq"].fields == {"weight_calib": "gptq-mse"}
    assert r["finer"].fields == {"weight_calib": "gptq-mse", "weight_granularity": "channel"}
    # hmse's scales keep their own GPTQ twin (the registry pairs them by factory)
    assert ladder(Recipe(weight_calib="hmse"))[1].fields == {"weight_calib": "gptq-hmse"}
    assert r["fallback"].fields == {"weight_calib": "gptq-mse", "format": "e5m2"}
    # nothing finer for FP8_DYNAMIC with GPTQ: base, fallback
    assert [x.name for x in ladder(Recipe(weight_calib="gptq", act_granularity="token"))] == [
        "base", "fallback"]
    # the rung's recipe for the sweep
    assert rungs["finer"].recipe(Recipe(act_granularity="tensor")).act_granularity == "token"
    assert Rung("fallback", {"format": "e5m2"}, 4).recipe(
        Recipe(act_granularity="tensor", weight_format="e4m3")).weight_format is None


def test_assign_by_gain_per_cost():
    rungs = ladder(Recipe(act_granularity="tensor"))  # costs base 0, gptq 1, finer 2, fallback 4
    deltas = {"a": {"base": 1.0, "gptq": 0.2, "finer": 0.1, "fallback": 0.0},
              "b": {"base": 0.3, "gptq": 0.29, "finer": 0.05, "fallback": 0.0},
              "c": {"base": -0.1, "gptq": 0.0, "finer": 0.0, "fallback": 0.0}}
    # sum 1.3 > 0.6: a -> gptq (gain 0.8 per 1) -> 0.5 <= 0.6
    assert assign(deltas, rungs, 0.6) == {"a": "gptq", "b": "base", "c": "base"}
    # 0.3: then b -> finer (0.25 / 2 = 0.125 per cost) beats a -> finer (0.1 / 1)
    assert assign(deltas, rungs, 0.3) == {"a": "gptq", "b": "finer", "c": "base"}
    # 0: every positive delta must go
    got = assign(deltas, rungs, 0.0)
    assert got["a"] == got["b"] == "fallback" and got["c"] == "base"
    assert assign(deltas, rungs, 10.0) == {u: "base" for u in deltas}


def test_split_heldout():
    cal, held = split_heldout([f"d{i}" for i in range(25)])
    assert held == ["d9", "d19"] and len(cal) == 23 and not set(cal) & set(held)
    assert split_heldout(["a", "b", "c"]) == (["a", "b"], ["c"])
    with pytest.raises(UsageError):
        split_heldout(["only"])


# A periodic token sequence a tiny Llama learns in a few steps (perplexity ~1.1), so that
# damage to a module shows as a clear perplexity increase (a random model's perplexity can go
# either way when a module is perturbed).
PERIOD = torch.randperm(VOCAB - 2, generator=torch.Generator().manual_seed(0))[:11] + 2
SEQUENCE = PERIOD.repeat(64)


def windows(n: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(SEQUENCE) - length, (n,), generator=g)
    return torch.stack([SEQUENCE[s:s + length] for s in starts.tolist()])


def sensitive_llama():
    """A tiny Llama trained on the periodic sequence, whose layer-0 down_proj (zeroed, the
    perplexity rises ~50%) then gets one huge weight column fed by an input channel that is
    always zero: the unquantized model ignores it, but its per-channel scale (set by that
    column) flushes every other weight of the row to zero in e4m3."""
    model = tiny("llama").train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny steps: threads only add contention on a shared CPU
    try:
        torch.manual_seed(0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(20):
            ids = windows(8, 32, step)
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    model.eval()
    mlp = model.model.layers[0].mlp
    with torch.no_grad():
        mlp.up_proj.weight[0].zero_()
        mlp.down_proj.weight[:, 0] = 1e6
    return model


@pytest.mark.slow
def test_choose_moves_only_the_sensitive_module():
    model = sensitive_llama()
    batches = list(token_batches(windows(8, 32, 100), 4))
    eval_ids = windows(4, 32, 200)
    recipe = Recipe(act_granularity="tensor", dtype="float32")
    result = choose(model, recipe, batches, eval_ids, target="2%")
    units = {u.unit: u for u in result.units}
    assert units[SENSITIVE].deltas["base"] > 10 * max(
        u.deltas["base"] for n, u in units.items() if n != SENSITIVE)
    assert units[SENSITIVE].rung == "fallback"
    assert result.predicted <= result.budget == pytest.approx(0.02 * result.baseline)
    assert result.overrides[SENSITIVE] == "none"
    assert not any(isinstance(m, QuantGemm) for m in model.modules())  # left unquantized
    final = result.recipe(recipe)
    more_ids = windows(2, 64, 300)
    more_baseline = perplexity(model, more_ids)
    quantize_model(model, final, batches)
    assert not isinstance(model.get_submodule(SENSITIVE), QuantGemm)
    assert isinstance(model.get_submodule("model.layers.0.mlp.up_proj"), QuantGemm)
    measure(model, eval_ids, result)
    # the verification slice is measured like the held-out one: on the same windows and
    # baseline it gives the same numbers; on other windows its own
    same = verify(model, eval_ids, result.baseline, result).verify
    # (the default metric kl scores the measured perplexity from log-softmax, not
    # cross_entropy: equal to a few float32 ulps of the log-likelihood)
    assert same["measured"] == pytest.approx(
        result.measured, rel=perplexity_rel_tolerance(result.measured))
    assert same["tokens"] == eval_ids.numel()
    assert same["delta_pct"] == pytest.approx(
        100 * result.measured_delta / result.baseline,
        abs=pct_delta_abs_tolerance(result.measured, result.baseline))
    v = verify(model, more_ids, more_baseline, result).to_dict()["verify"]
    assert (v["windows"], v["seq_len"], v["tokens"]) == (2, 64, 128)
    assert v["baseline"] == more_baseline != result.baseline
    assert v["delta_pct"] == pytest.approx(100 * (v["measured"] - more_baseline) / more_baseline)
    d = result.to_dict()
    assert math.isfinite(d["measured"]) and d["measured_delta"] == pytest.approx(
        d["measured"] - d["baseline"])
    # the prediction adds single-module deltas; on this tiny model it must be the right size
    assert abs(d["measured_delta"] - d["predicted"]) < result.budget
    assert d["modules_per_rung"]["fallback"] == 1


def test_offloaded_hessians_round_trip(tmp_path):
    """``offload`` moves the sums to files and ``hessian`` reads back exactly what it gave
    before (float64, bit for bit); nothing stays counted in memory; ``release`` removes the
    files."""
    model = tiny("llama")
    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
             "model.layers.0.mlp.down_proj"]
    h = HessianCollector({n: model.get_submodule(n) for n in names})
    with h.observing(), torch.no_grad():
        model(input_ids=IDS)
    before = {n: h.hessian(n) for n in names}
    assert h.alias == {names[1]: names[0]} and h.nbytes > 0
    h.offload(tmp_path)
    assert h.nbytes == 0 and len(list(tmp_path.rglob("*.bin"))) == 2  # q/k share one
    for n in names:
        got = h.hessian(n)
        assert got.dtype == torch.float64 and torch.equal(got, before[n]), n
    h.release()
    assert not list(tmp_path.rglob("*.bin")) and h.hessian(names[0]) is None


@pytest.mark.slow
def test_sweep_reads_hessians_from_disk(tmp_path, monkeypatch):
    """``choose`` keeps GPTQ's Hessians on disk during the sweeps (none resident when a unit
    is quantized), removes them afterwards, and decides exactly as with them in memory."""
    model = tiny("llama")
    batches = list(token_batches(windows(8, 32, 100), 4))
    eval_ids = windows(4, 32, 200)
    recipe = Recipe(act_granularity="tensor", weight_calib="max", dtype="float32")
    seen = []
    real = HessianCollector.hessian

    def spy(self, name):
        seen.append((self.nbytes, len(list((tmp_path / "spill").rglob("*.bin")))))
        return real(self, name)

    monkeypatch.setattr(HessianCollector, "hessian", spy)
    (tmp_path / "spill").mkdir()
    result = choose(model, recipe, batches, eval_ids, target="2%", spill_dir=tmp_path / "spill")
    assert seen and all(resident == 0 and files > 0 for resident, files in seen)
    assert not list((tmp_path / "spill").iterdir())
    monkeypatch.setattr(HessianCollector, "offload", lambda self, spill_dir=None: None)
    seen.clear()
    in_memory = choose(model, recipe, batches, eval_ids, target="2%")
    assert seen and all(resident > 0 for resident, _ in seen)
    assert [(u.unit, u.rung, u.deltas) for u in result.units] == \
        [(u.unit, u.rung, u.deltas) for u in in_memory.units]


def test_partial_plan_overrides_reach_the_pipeline():
    """What --target-delta writes as overrides: a module's own weight calibrator (GPTQ, with its
    Hessian) and activation granularity."""
    recipe = Recipe(act_granularity="tensor", dtype="float32", gptq_sequential=False, overrides={
        "model.layers.0.mlp.down_proj": {"weight_calib": "gptq", "act_granularity": "token"}})
    for sequential in (False, True):
        model = tiny("llama")
        result = quantize_model(model, recipe.merged(gptq_sequential=sequential),
                                token_batches(IDS, 4))
        down = model.get_submodule("model.layers.0.mlp.down_proj")
        other = model.get_submodule("model.layers.0.mlp.up_proj")
        assert down.act_granularity == "token" and down.input_scale is None
        assert other.act_granularity == "tensor" and other.input_scale is not None
        gptq = result.extras["gptq"]
        if sequential:  # one Hessian gathered, down_proj's (in_features 128, float64)
            assert gptq["sequential"]["max_hessian_bytes"] == 128 * 128 * 8
        else:
            assert gptq["distinct_inputs"] == 1  # only down_proj's Hessian
    with pytest.raises(UsageError, match="override x weight_calib"):
        Recipe(act_granularity="tensor", overrides={"x": {"weight_calib": "nope"}})


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, word_tokenizer):
    # the word tokenizer's ids are not the sequence's; the CLI test checks the plumbing
    return saved_with_documents(tmp_path_factory.mktemp("target"), sensitive_llama(),
                                word_tokenizer, 40)


@pytest.mark.slow
def test_cli_target_delta(llama_dir, tmp_path):
    out = tmp_path / "q"
    report = target_delta_report(llama_dir, out, "--target-delta", "0", "--target-metric", "ppl")
    # a zero budget moves every unit with a positive delta off the base rung (by KL, the
    # default, every unit: nothing would be left to quantize)
    assert report["predicted"] == 0 and report["measured"] is not None
    # the default verification slice shrinks to the ~160 held-out tokens: one window of all
    v = report["verify"]
    assert v["windows"] == 1 and v["tokens"] == v["seq_len"] > 128 and v["measured"] > 0
    assert report["overrides"] == {u["pattern"]: "none" if u["rung"] == "fallback" else {
        "weight_calib": "gptq", **({"act_granularity": "token"} if u["rung"] == "finer" else {})}
        for u in report["units"] if u["rung"] != "base"}
    assert report["overrides"]
    meta = read_metadata(out)
    assert meta["extras"]["target_delta"]["overrides"] == report["overrides"]
    assert meta["recipe"]["overrides"] == report["overrides"]
    skipped = {p for p, v in report["overrides"].items() if v == "none"}
    assert skipped <= set(meta["skipped"]) and not skipped & set(meta["modules"])
    # the table report prints predicted vs measured
    res = CliRunner().invoke(main, [
        "quantize", str(llama_dir / "llama"), "-o", str(tmp_path / "t"), "--calib-data",
        str(llama_dir / "calib.txt"), "--num-samples", "4", "--seq-len", "32", "--dtype",
        "float32", "--target-delta", "2%", "--target-tokens", "128", "--target-level", "block"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "target-delta 2%" in text and "predicted" in text and "measured" in text
    assert "verified on" in text and "(1 x" in text


@pytest.mark.parametrize("args,message", [
    (["--target-delta", "lots"], "--target-delta expects VALUE or VALUE%"),
    (["--target-delta", "1%", "--fallback-format", "fp9"], "unknown format 'fp9'"),
    (["--target-delta", "1%", "--sequential"], "does not combine with --sequential"),
    (["--target-delta", "1%", "--smoothquant", "0.5"], "does not combine with --smoothquant"),
])
def test_cli_target_delta_bad_input(llama_dir, tmp_path, args, message):
    res = CliRunner().invoke(main, ["quantize", str(llama_dir / "llama"), "-o",
                                    str(tmp_path / "x"), "--calib-data",
                                    str(llama_dir / "calib.txt"), *args])
    assert res.exit_code == 2, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0]
    assert not (tmp_path / "x").exists()
