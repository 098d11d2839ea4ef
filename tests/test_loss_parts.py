"""benchmarks/studies/loss_parts.py: the activation-only floor against the baseline, and
each seed's checkpoint (and their pool) against the floor, paired over the articles."""

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "studies"))

import loss_parts as lp  # noqa: E402

WORDS = np.array([100.0, 120.0, 90.0, 110.0, 80.0])


def _row(nll_per_word: list[float]) -> dict:
    nll = np.array(nll_per_word) * WORDS
    ppl = float(np.exp(nll.sum() / WORDS.sum()))
    return {"metrics": {lp.METRIC: ppl},
            "records": {"wikitext": {"ids": [0, 1, 2, 3, 4],
                                     "columns": {"nll": (-nll).tolist(),
                                                 "words": WORDS.tolist()},
                                     "formulas": {"word_perplexity": ["ppl", "nll", "words"]},
                                     "scale": {}}}}


def test_floor_and_seeds_against_it(tmp_path):
    base = [3.40, 3.30, 3.50, 3.35, 3.45]
    floor = _row([b + 0.01 for b in base])  # worse than the baseline on every article
    (tmp_path / "baseline.json").write_text(json.dumps(_row(base)))
    above = _row([b + 0.02 for b in base])  # above the floor on every article
    below = _row([b + 0.005 for b in base])  # below it on every article
    for s, doc in ((0, above), (1, below), (2, above)):
        (tmp_path / f"d-seed{s}.json").write_text(json.dumps(doc))
    res = lp.floor_report(tmp_path, floor, ["d"], [0, 1, 2, 3])
    f = res["floor"]
    assert f["minus_baseline"] > 0 and f["ci95"][0] > 0
    assert np.isclose(f["pct"], f["minus_baseline"])
    seeds = res["rows"]["d"]["seeds"]
    assert seeds[0]["minus_floor"] > 0 and seeds[0]["ci95"][0] > 0
    assert seeds[1]["minus_floor"] < 0 and seeds[1]["ci95"][1] < 0
    assert seeds[3] == {"missing": "d-seed3.json"}
    p = res["rows"]["d"]["pooled"]
    assert (p["below"], p["n"]) == (1, 3)
    # the pool averages each article's log-likelihood: two seeds above, one below -> above
    assert 0 < p["minus_floor"] < seeds[0]["minus_floor"]
    text = "\n".join(lp.lines(res))
    assert "below it at 1 of 3 seeds" in text and "seed 3: d-seed3.json missing" in text


def test_parts_keep_only_the_weights_or_only_the_input_rounding(tmp_path, word_tokenizer):
    """``only("weights")`` loads a checkpoint with its FP8 weights and unrounded inputs,
    ``only("acts")`` with the float model's weights and the per-token input rounding; the
    baseline is loaded untouched."""
    import torch

    import fp8ptq.evals.compare as cmp
    from fp8ptq.config.recipe import Recipe
    from fp8ptq.nn.quant_gemm import QuantGemm
    from tiny_models import invoke, tiny

    src, ck = tmp_path / "llama", tmp_path / "ck"
    tiny("llama").save_pretrained(src)
    word_tokenizer.save_pretrained(src)
    (tmp_path / "calib.txt").write_text("the quick brown fox jumps over the lazy dog .\n" * 40)
    res = invoke(["quantize", str(src), "--format", "e4m3", "-o", str(ck), "--calib-data",
                  str(tmp_path / "calib.txt"), "--num-samples", "4", "--seq-len", "16",
                  "--dtype", "float32"])
    assert res.exit_code == 0, res.output
    recipe = Recipe(dtype="float32")
    floats = {n: m.weight.detach().clone() for n, m in cmp.load_variant(
        cmp.Variant("b", "baseline", str(src), recipe)).model.named_modules()
        if isinstance(m, torch.nn.Linear)}

    def gemms(part):
        with lp.only(part, str(src)) if part else _nothing():
            loaded = cmp.load_variant(cmp.Variant("c", "checkpoint", str(ck), recipe))
        return {n: m for n, m in loaded.model.named_modules() if isinstance(m, QuantGemm)}

    served, weights, acts = gemms(None), gemms("weights"), gemms("acts")
    assert served and served.keys() == weights.keys() == acts.keys()
    for name, m in served.items():
        assert m.act_format is not None and acts[name].act_format is not None
        assert weights[name].act_format is None
        assert torch.equal(weights[name].inner.weight, m.inner.weight)
        assert torch.equal(acts[name].inner.weight, floats[name])
        assert not torch.equal(m.inner.weight, floats[name])  # FP8 rounding changed it
    assert all(m.act_format is not None for m in gemms(None).values())  # patch undone


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_section_tables_the_parts_and_the_rows(tmp_path):
    base = [3.40, 3.30, 3.50, 3.35, 3.45]
    doc = _row(base)
    doc["protocol"] = {"wikitext": {"documents": 5, "context_length": 2048, "tokens": 900,
                                    "prefix_token": "bos '<bos>'", "own_start_dropped": True}}
    (tmp_path / "baseline.json").write_text(json.dumps(doc))
    for s in (0, 1):
        (tmp_path / f"d-seed{s}.json").write_text(json.dumps(_row([b + 0.004 for b in base])))
    acts = _row([b + 0.01 for b in base])
    res = lp.floor_report(tmp_path, acts, ["d"], [0, 1])
    parts = {"weights": _row([b - 0.002 for b in base]), "acts": acts}
    text = lp.section(res, parts, _row([b + 0.004 for b in base]), "d-seed0", ["F"])
    assert "once (the tokenizer's own BOS taken off)" in text
    assert "| the input rounding only (float weights) |" in text
    weights_line = next(x for x in text.splitlines() if "weights only" in x)
    assert "| -0." in weights_line  # below the baseline: a negative delta
    assert "| `d` |" in text and "t -0." in text
