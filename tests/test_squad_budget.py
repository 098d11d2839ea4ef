"""``benchmarks/studies/squad_budget.py``'s pieces: every GEMM of a BERT question-answering model
has exactly one kind, the KL of the answer distributions is zero for the float model's own logits
and grows with the perturbation, padding excluded, the paired interval brackets the mean
difference, and the whole budget runs on the real MiniLM (slow)."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks/studies"))
import squad_budget as sb  # noqa: E402

from tiny_models import tiny  # noqa: E402


def test_every_bert_gemm_has_one_kind_and_every_kind_a_gemm():
    model = tiny("bert")
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    kinds = {n: sb.kind_of(n) for n in names}
    assert None not in kinds.values()
    assert set(kinds.values()) == {k for k, _ in sb.KINDS}
    # ``attention.output.dense`` is not the FFN's ``output.dense``
    assert kinds["bert.encoder.layer.0.attention.output.dense"] == "attention output"
    assert kinds["bert.encoder.layer.0.output.dense"] == "output"


def test_kl_is_zero_for_the_same_logits_and_grows_with_noise():
    g = torch.Generator().manual_seed(0)
    start, end = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
    mask = torch.ones(4, 16, dtype=torch.bool)
    mask[:, 12:] = False  # padding
    ref = [(start, end, mask)]
    assert sb.kl(ref, ref) == 0.0
    noise = torch.randn(4, 16, generator=g)
    small = sb.kl(ref, [(start + 0.01 * noise, end, mask)])
    large = sb.kl(ref, [(start + 0.1 * noise, end, mask)])
    assert 0 < small < large
    # what the padding gets does not count
    padded = start.clone()
    padded[:, 12:] += 100.0
    assert abs(sb.kl(ref, [(padded, end, mask)])) < 1e-6


def test_paired_interval_brackets_the_mean_difference():
    rng = np.random.default_rng(0)
    theirs = rng.uniform(0, 100, 500)
    ours = theirs + rng.normal(1.0, 5.0, 500)
    got = sb.paired(ours, theirs)
    lo, hi = got["ci95"]
    assert lo < got["delta"] < hi and lo > 0  # a +1 shift over 500 samples of sd 5
    assert sb.paired(theirs, theirs) == {"delta": 0.0, "ci95": [0.0, 0.0]}


@pytest.mark.slow
def test_the_budget_runs_end_to_end_on_the_real_minilm(tmp_path):
    """A short MiniLM checkpoint, six questions: the activation rows and the checkpoint's two
    columns are scored, the float model's own F1 is what a comparison's records say, and the
    bound against a comparison whose every question scored 0 is the activations-alone F1."""
    import json

    from fp8ptq.evals import squad
    from tiny_models import invoke

    assets = Path(__file__).resolve().parents[1] / ".." / "shared" / "assets"
    ck = tmp_path / "ck"
    r = invoke(["quantize", str(assets / "models/minilm-squad"), "-o", ck, "--format", "e4m3",
                "--calib-data", str(assets / "calib/wiki-paragraphs.txt"), "--num-samples", 2,
                "--seq-len", 64, "--dtype", "float32"])
    assert r.exit_code == 0, r.output
    ids = [e["id"] for e in squad.load_examples(assets / "squad-v1.1/dev-heldout.json",
                                                limit=6)]
    zero = tmp_path / "zero.json"
    zero.write_text(json.dumps({"records": {"squad": {  # an evaluation JSON's records
        "ids": ids, "columns": {"f1": [0.0] * 6}, "formulas": {"f1": ["mean", "f1", None]},
        "scale": {"f1": 1.0}}}}))
    text = sb.main([str(ck), "--questions", "6", "--oracle-questions", "6", "--threads", "1",
                    "--against", f"nothing={zero}", "--assets", str(assets),
                    "--out", str(tmp_path / "out"), "--doc", ""])
    report = json.loads((tmp_path / "out/report.json").read_text())
    labels = [row["label"] for row in report["rows"]]
    assert labels[0] == "activations only" and len(labels) == 1 + len(sb.KINDS)
    col = report["columns"][0]
    assert col["everything"]["kl"] > 0 and col["weights"]["kl"] > 0
    assert report["rows"][0]["kl"] > 0 and all(row["kl"] >= 0 for row in report["rows"])
    bound = report["oracle"]["against"]["nothing"]
    assert bound["delta"] == pytest.approx(report["oracle"]["f1_activations"])
    assert bound["delta"] > 0 and bound["ci95"][0] <= bound["delta"] <= bound["ci95"][1]
    assert "## MiniLM SQuAD" in text and "`ck`" in text
