"""``benchmarks/studies/error_budget.py``'s switches on a tiny Llama: each setting changes
exactly what it names (the weights, the inputs' per-token e4m3 rounding, the first position),
and removing them leaves the float model."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks/studies"))
import error_budget as eb  # noqa: E402

from tiny_models import IDS, tiny  # noqa: E402


def _logits(model):
    with torch.inference_mode():
        return model(IDS[:2, :12], use_cache=False).logits


def test_switches_change_what_they_name_and_nothing_else():
    model = tiny("llama").float().eval()
    ref = _logits(model)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
             and n != "lm_head"]
    # "quantized" weights: visibly different, so a switch that does nothing shows
    weights = {n: model.get_submodule(n).weight.detach() * 1.01 for n in names}
    sw = eb.Switches(model, weights)
    every = set(names)
    sw.set(set(), set())
    assert torch.equal(_logits(model), ref)
    sw.set(every, set())
    w_only = _logits(model)
    sw.set(set(), every)
    a_only = _logits(model)
    assert not torch.allclose(w_only, ref) and not torch.allclose(a_only, ref)
    # the first position attends to itself only: with its GEMM outputs exact it is the float
    # model's there, whatever the other positions get
    sw.set(every, every, exact_first=True)
    got = _logits(model)
    torch.testing.assert_close(got[:, 0], ref[:, 0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[:, 1:], ref[:, 1:])
    sw.set(set(), every, unrounded_first=True)
    torch.testing.assert_close(_logits(model)[:, 0], ref[:, 0], rtol=1e-5, atol=1e-5)
    sw.remove()
    sw.set_float()
    assert torch.equal(_logits(model), ref)
