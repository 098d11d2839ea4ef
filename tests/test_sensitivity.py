"""``fp8ptq sensitivity``: a module made deliberately hard to quantize must come out on top."""

import json

import pytest
import torch

from fp8ptq import sensitivity as sens
from fp8ptq.config.recipe import Recipe
from fp8ptq.execution.in_memory import SAMPLE_BATCHES, collect_stats, plan_targets, token_batches
from fp8ptq.files.atomic import write_file
from fp8ptq.formats import fake_quantize, get_format
from fp8ptq.formats.scales import histogram_sqnr_db, sqnr_db
from fp8ptq.model.gemm import weight_2d
from fp8ptq.nn.quant_gemm import QuantGemm
from fp8ptq.observe.observers import StatsCollector
from fp8ptq.sensitivity.probes import PerplexityProbe
from test_pipeline import tiny
from tiny_models import invoke

HARD = "model.layers.0.self_attn.o_proj"
SENTENCES = ["the quick brown fox jumps over the lazy dog",
             "a small model reads a few words of text",
             "hello world and hello again"]
RECIPE = Recipe(act_granularity="tensor", dtype="float32")  # static inputs: pinned


def _corpus(word_tokenizer, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    text = " ".join(SENTENCES[i] for i in torch.randint(0, 3, (n,), generator=g).tolist())
    return torch.tensor(word_tokenizer(text)["input_ids"])


def _windows(ids: torch.Tensor, seq: int) -> torch.Tensor:
    return ids[: ids.numel() // seq * seq].reshape(-1, seq)


@pytest.fixture(scope="module")
def data(word_tokenizer):
    return {"calib": _windows(_corpus(word_tokenizer, 60, 1), 32)[:8],
            "eval": _windows(_corpus(word_tokenizer, 40, 2), 32)[:4]}


@pytest.fixture(scope="module")
def hard_model(word_tokenizer):
    """The tiny Llama, trained a little on sentences in random order (a random model has flat
    logits, so no perplexity moves), then made hostile to quantization without changing its
    function: value channel 7 of layer 0's attention is scaled by 1e-6 in v_proj and by 1e6 in
    o_proj, so one column of o_proj's weight is a 1e6x outlier and the per-row weight scales
    flush the rest of each row to zero."""
    model = tiny("llama").train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(40):
        ids = _windows(_corpus(word_tokenizer, 30, 100 + step), 32)[:8]
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval().requires_grad_(False)
    before = _logits(model, ids)
    attn = model.model.layers[0].self_attn
    attn.v_proj.weight[7] *= 1e-6
    attn.o_proj.weight[:, 7] *= 1e6
    assert torch.allclose(_logits(model, ids), before, rtol=1e-4, atol=1e-4)
    return model


def _analyze(model, data, **kw):
    kw.setdefault("formats", ["e4m3"])
    kw.setdefault("stat_formats", ["e4m3", "int8"])
    return sens.analyze(model, RECIPE, list(token_batches(data["calib"], 4)),
                        eval_ids=data["eval"], **kw)


@pytest.fixture(scope="module")
def module_ppl(hard_model, data):
    return _analyze(hard_model, data, target="1%")


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.slow
def test_hard_module_ranks_first_and_is_skipped(module_ppl):
    r = module_ppl
    assert r.baseline < 20  # trained: far below the vocabulary size of a random model
    top = r.units[0]
    assert top.name == HARD and top.modules == [HARD]
    deltas = [u.results["e4m3"].delta for u in r.units]
    assert deltas == sorted(deltas, reverse=True)
    assert top.results["e4m3"].delta > 5 * max(deltas[1], 1e-3)
    assert HARD in r.suggestion.skip
    assert r.suggestion.estimated_delta <= r.suggestion.target_delta < \
        r.suggestion.estimated_delta_all
    # the suggestion measured: far better than quantizing everything
    assert r.checks["suggested"]["delta"] < r.checks["all_quantized"]["delta"] / 5
    assert r.eval["replay"] is True and len(r.modules) == 14


@pytest.mark.slow
def test_model_is_left_unchanged(hard_model, data):
    before = _logits(hard_model, data["eval"])
    r = _analyze(hard_model, data, level="block", metric="sqnr", stat_formats=["e4m3"])
    assert not any(isinstance(m, QuantGemm) for m in hard_model.modules())
    assert torch.equal(_logits(hard_model, data["eval"]), before)
    # sqnr estimates are scaled onto the measured logits noise
    nsr_all = sum(u.results["e4m3"].delta for u in r.units)
    assert r.suggestion.delta_scale == pytest.approx(r.checks["all_quantized"]["nsr"] / nsr_all)
    assert r.suggestion.estimated_delta_all == pytest.approx(r.checks["all_quantized"]["nsr"])


@pytest.mark.slow
def test_hard_statistics(module_ppl):
    m = {s.name: s for s in module_ppl.modules}
    hard, other = m[HARD], m["model.layers.1.self_attn.o_proj"]
    assert hard.weight.outlier_ratio > 3 * other.weight.outlier_ratio
    assert hard.weight.kurtosis > 20 * other.weight.kurtosis
    # the weight's own SQNR looks perfect (its power sits in the outlier column); the output's
    # SQNR shows the damage
    assert hard.formats["e4m3"].weight_sqnr_db > 60
    assert hard.formats["e4m3"].output_sqnr_db < 10 < other.formats["e4m3"].output_sqnr_db
    assert set(hard.formats) == {"e4m3", "int8"}


@pytest.mark.slow
def test_sqnr_matches_hand_computation(hard_model, data):
    """Weight, input and output SQNR of one module, recomputed from scratch."""
    r = _analyze(hard_model, data, metric="sqnr", stat_formats=["e4m3"], verify=False)
    name, fmt = "model.layers.0.mlp.up_proj", get_format("e4m3")
    module = hard_model.get_submodule(name)
    w = weight_2d(module).float()
    w_scale = w.abs().amax(1, keepdim=True) / fmt.max
    wq = fake_quantize(w, w_scale, fmt)
    targets, _ = plan_targets(hard_model, RECIPE)
    target = [t for t in targets if t.name == name]
    collector = collect_stats(hard_model, target, list(token_batches(data["calib"], 4)),
                              sample_batches=SAMPLE_BATCHES)
    stats, x = collector.stats[name], collector.row_samples()[name]
    a_scale = float(torch.tensor(stats.amax, dtype=torch.float32) / fmt.max)
    got = next(s for s in r.modules if s.name == name).formats["e4m3"]
    assert got.weight_sqnr_db == pytest.approx(sqnr_db(w, wq), abs=1e-6)
    assert got.input_scale == pytest.approx(a_scale, rel=1e-6)
    assert got.input_sqnr_db == pytest.approx(histogram_sqnr_db(stats, a_scale, fmt), abs=1e-6)
    expected = sqnr_db(x @ w.T, fake_quantize(x, torch.tensor(a_scale), fmt) @ wq.T)
    assert got.output_sqnr_db == pytest.approx(expected, abs=1e-3)
    unit = next(u for u in r.units if u.name == name)
    assert unit.results["e4m3"].delta == pytest.approx(10 ** (-expected / 10), rel=1e-3)
    assert r.units[0].name == HARD  # the cheap proxy finds it too


def test_input_moments_from_histogram_match_exact():
    x = torch.randn(4096, 64) * torch.linspace(0.1, 3, 64)
    x[:, 3] = torch.distributions.StudentT(3.0).sample((4096,))  # heavy tails
    collector = StatsCollector({"m": torch.nn.Identity()})
    collector.stats["m"].update(x)
    got = sens.summarize_input(collector.stats["m"])
    x = x.double()
    m2, m4 = x.pow(2).mean(), x.pow(4).mean()
    assert got.rms == pytest.approx(float(m2.sqrt()), rel=2e-3)
    assert got.kurtosis == pytest.approx(float(m4 / m2**2), rel=1e-2)
    assert got.outlier_ratio == pytest.approx(float(x.abs().max() / m2.sqrt()), rel=2e-3)
    ch = x.abs().amax(0)
    assert got.channel_ratio == pytest.approx(float(ch.max() / ch.median()), rel=1e-5)


@pytest.mark.slow
def test_block_level_and_replay(hard_model, data):
    r = _analyze(hard_model, data, level="block", stat_formats=["e4m3"], target="0")
    assert [u.name for u in r.units] == ["model.layers.0", "model.layers.1"]
    assert r.units[0].pattern == "model.layers.0.*" and len(r.units[0].modules) == 7
    assert r.suggestion.skip[0] == "model.layers.0.*" and r.suggestion.estimated_delta == 0
    # replaying layer 0 from the cache gives what a full pass gives, quantized or not
    probe = PerplexityProbe(hard_model, data["eval"], 2, hard_model.model.layers)
    base = probe.baseline()
    assert probe.cache is not None and probe(1) == pytest.approx(base, rel=1e-6)
    targets = plan_targets(hard_model, RECIPE)[0]
    collector = collect_stats(hard_model, targets, list(token_batches(data["calib"], 4)))
    plan = sens.format_plan(hard_model, RECIPE, "e4m3", collector, [])
    with sens.swapped(hard_model, plan, ["model.layers.1.mlp.up_proj"], collector.stats):
        assert probe(1) == pytest.approx(probe(None), rel=1e-6)
        assert probe(1) != base


@pytest.mark.slow
def test_replay_that_does_not_reproduce_the_baseline_is_dropped(hard_model, data, monkeypatch):
    from fp8ptq.sensitivity import probes

    monkeypatch.setattr(probes, "clone_output", torch.zeros_like)
    probe = PerplexityProbe(hard_model, data["eval"], 4, hard_model.model.layers)
    base = probe.baseline()
    assert probe.cache is None and "did not reproduce" in probe.notes[0]
    assert probe(1) == base  # a full pass


def test_suggest_greedy_and_overrides():
    deltas = {"a": {"e4m3": 3.0, "int8": 0.5}, "b": {"e4m3": 2.0, "int8": 4.0},
              "c": {"e4m3": 0.2, "int8": 0.1}, "d": {"e4m3": -0.1, "int8": 0.0}}
    patterns = {k: f"p.{k}" for k in deltas}
    s = sens.suggest(deltas, patterns, "e4m3", "1.0", 1.0)
    # a moves to int8 (3 -> 0.5), b has no better format and is kept; 0.5 + 0.2 + 0 <= 1
    assert s.overrides == {"p.a": "int8"} and s.skip == ["p.b"]
    assert s.estimated_delta_all == pytest.approx(5.2) and s.estimated_delta == pytest.approx(0.7)
    only = sens.suggest({k: {"e4m3": v["e4m3"]} for k, v in deltas.items()}, patterns, "e4m3",
                        "0", 0.0)
    assert only.skip == ["p.a", "p.b", "p.c"] and only.estimated_delta == 0
    assert sens.parse_target("1%") == (0.01, True) and sens.parse_target("0.5") == (0.5, False)
    assert sens.target_value("2%", "ppl", 10.0) == pytest.approx(0.2)
    for bad in ("x", "-1", "nan%"):
        with pytest.raises(sens.UsageError):
            sens.parse_target(bad)


def test_quantize_flags():
    recipe = Recipe(num_samples=8, seq_len=64, act_calib="percentile", skip=["lm_x"],
                    calib_data="c.txt", scale_pow2=True)
    s = sens.Suggestion("e4m3", "1%", 0.1, 1.0, 0.05, ["model.layers.3.*"],
                        {"model.layers.4.*": "int8"})
    assert sens.quantize_flags(recipe, s) == [
        "--format", "e4m3", "--act-calib", "percentile", "--scale-pow2", "--calib-data",
        "c.txt", "--skip", "lm_x", "--skip", "model.layers.3.*",
        "--override", "model.layers.4.*=int8"]


def test_group_units():
    model = tiny("gpt2")
    names = [t.name for t in plan_targets(model, RECIPE)[0]]
    blocks = sens.group_units(model, names, "block")
    assert [(u.name, u.layer, len(u.modules)) for u in blocks] == [
        ("transformer.h.0", 0, 4), ("transformer.h.1", 1, 4)]
    modules = sens.group_units(model, names, "module")
    assert [u.pattern for u in modules] == names and modules[-1].layer == 1


# --------------------------------------------------------------------------------------------
# CLI


@pytest.fixture(scope="module")
def model_dir(hard_model, word_tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hard-llama")
    hard_model.save_pretrained(folder)
    word_tokenizer.save_pretrained(folder)
    text = folder / "text.txt"
    text.write_text("\n".join(SENTENCES[i % 3] + " " + SENTENCES[(i + 1) % 3]
                              for i in range(40)))
    return folder


def _cli(model_dir, *args):
    return invoke([
        "sensitivity", str(model_dir), "--calib-data", str(model_dir / "text.txt"),
        "--num-samples", "8", "--seq-len", "24", "--eval-data", str(model_dir / "text.txt"),
        "--eval-tokens", "96", "--eval-seq-len", "24", "--dtype", "float32", *args])


@pytest.mark.slow
def test_cli_json_plot_and_suggestion(model_dir, tmp_path):
    out, png = tmp_path / "sens.json", tmp_path / "sens.png"
    result = _cli(model_dir, "--formats", "e4m3,hif8", "--top", "3", "--json", str(out),
                  "--plot", str(png))
    assert result.exit_code == 0, result.output
    assert HARD in result.output and "fp8ptq quantize" in result.output
    assert f"--skip {HARD}" in result.output
    data = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"bare {c}"))
    assert data["schema"] == sens.SCHEMA and data["metric"] == "ppl"
    assert data["peak_rss_mb"] > 0 and set(data["seconds"]) >= {"load", "tokenize"}
    assert "; peak RSS " in result.output
    assert data["baseline"] > 0 and data["formats"] == ["e4m3"]
    assert data["stat_formats"] == ["e4m3", "hif8"]
    assert data["units"][0]["name"] == HARD and len(data["units"]) == 14
    assert set(data["units"][0]["results"]["e4m3"]) == {"value", "delta"}
    module = next(m for m in data["modules"] if m["name"] == HARD)
    assert set(module) >= {"name", "kind", "unit", "weight", "input", "formats"}
    assert set(module["weight"]) >= {"amax", "rms", "outlier_ratio", "kurtosis"}
    assert set(module["formats"]) == {"e4m3", "hif8"}
    assert set(module["formats"]["hif8"]) >= {"weight_scale_min", "weight_scale_max",
                                              "weight_sqnr_db", "input_scale", "input_sqnr_db",
                                              "output_sqnr_db"}
    assert HARD in data["suggestion"]["skip"]
    assert data["quantize_command"].startswith(f"fp8ptq quantize {model_dir} --format e4m3")
    assert set(data["checks"]) == {"all_quantized", "suggested"}
    assert data["calibration"]["num_samples"] == 8 and data["eval"]["tokens"] == 96
    assert data["recipe"]["dtype"] == "float32" and "definitions" in data
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.pyplot as plt

    assert plt.imread(png).shape[0] > 300
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.slow
def test_cli_block_sqnr_layer_aware_calibrator(model_dir, tmp_path):
    result = invoke([
        "sensitivity", str(model_dir), "--calib-data", str(model_dir / "text.txt"),
        "--plot", str(tmp_path / "s.png"),
        "--num-samples", "4", "--seq-len", "16", "--dtype", "float32", "--metric", "sqnr",
        "--granularity-level", "block", "--formats", "e4m3", "--no-verify",
        "--act-calib", "best"])
    assert result.exit_code == 0, result.output
    assert "out dB" in result.output and "--act-calib best" in result.output
    assert "--skip 'model.layers.0.*'" in result.output
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


def test_write_atomic_keeps_old_file_on_failure(tmp_path):
    path = tmp_path / "out.json"
    write_file(path, lambda tmp: tmp.write_text("old"))

    def fail(tmp):
        tmp.write_text("partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_file(path, fail)
    assert path.read_text() == "old" and [f.name for f in tmp_path.iterdir()] == ["out.json"]


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["--format", "e9m9"], "format"),
    (["--formats", ","], "--formats"),
    (["--target-delta", "lots"], "--target-delta"),
    (["--smoothquant", "0.5"], "--smoothquant"),
    (["--plot", "out.jpg"], "PNG"),
    (["--json", "/no/such/dir/x.json"], "does not exist"),
    (["--top", "0"], "--top"),
    (["--eval-data", "/no/such/file.txt"], "not found"),
    (["--granularity-level", "layer"], "granularity-level"),
])
def test_cli_errors_exit_2(model_dir, args, message):
    result = _cli(model_dir, *args)
    assert result.exit_code == 2, result.output
    assert message in result.output
