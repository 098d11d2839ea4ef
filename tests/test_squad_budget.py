"""``benchmarks/squad_budget.py``'s pieces: every GEMM of a BERT question-answering model has
exactly one kind, the KL of the answer distributions is zero for the float model's own logits
and grows with the perturbation, padding included or not, and the paired interval brackets
the mean difference."""

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
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
