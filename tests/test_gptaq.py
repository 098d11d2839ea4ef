"""Asymmetric GPTQ (``fp8ptq.algorithms.gptq.asym``, ``--gptq-asym``): the target ``W*`` is the
least-squares
fit of the float model's output on the quantized model's inputs (hand-checked), the Hessian and
cross term handed to each GEMM are what the final quantized model and the float model feed it,
and the layer / model output error against the float model drops below plain GPTQ's."""

import json
from types import SimpleNamespace

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fp8ptq.algorithms.gptq.asym import asymmetric_target, input_quantizer
from fp8ptq.algorithms.gptq.sweep import gptq_codes
from fp8ptq.config.recipe import Recipe
from fp8ptq.errors import UsageError
from fp8ptq.execution import in_memory
from fp8ptq.execution.in_memory import quantize_model, token_batches
from fp8ptq.formats import decode, get_format
from fp8ptq.formats.granularity import weight_granularity
from fp8ptq.model.gemm import weight_2d
from fp8ptq.nn.quant_gemm import QuantGemm
from tiny_models import IDS, invoke, saved_llama_with_calib, tiny

BATCHES = list(token_batches(IDS, 4))
QUANTIZE_TARGET = in_memory.quantize_target
E4M3 = get_format("e4m3")


def _stats(x, xq):
    x, xq = x.double(), xq.double()
    return 2 * xq.T @ xq / len(xq), 2 * x.T @ xq / len(xq)


def test_target_is_the_hand_computed_least_squares_fit():
    """X~ rows (1,0), (0,1), (1,1); float rows (1,0), (0,2), (1,1); W0 = [1, 1]. The float
    outputs are 1, 2, 2; fitting w1 * (1,0,1) + w2 * (0,1,1) to them by least squares:
    [[2,1],[1,2]] w = [3, 4], w = [2/3, 5/3]."""
    xq = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    x = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    H, C = _stats(x, xq)
    got = asymmetric_target(torch.tensor([[1.0, 1.0]]), H, C, damp=0.0)
    torch.testing.assert_close(got, torch.tensor([[2 / 3, 5 / 3]], dtype=torch.float64))
    # 3 x 3, two output rows: the normal equations' solution
    g = torch.Generator().manual_seed(0)
    xq = torch.randn(40, 3, generator=g, dtype=torch.float64)
    x = xq + 0.1 * torch.randn(40, 3, generator=g, dtype=torch.float64)
    w0 = torch.randn(2, 3, generator=g, dtype=torch.float64)
    H, C = _stats(x, xq)
    want = torch.linalg.lstsq(xq, x @ w0.T).solution.T
    torch.testing.assert_close(asymmetric_target(w0, H, C, damp=0.0), want)


def test_same_streams_give_the_weight_itself_whatever_the_dampening():
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    x[:, 3] = 0  # an input that was always zero keeps its column too
    w0 = torch.randn(5, 8, dtype=torch.float64)
    H, C = _stats(x, x)
    for damp in (0.0, 0.01, 0.5):
        assert torch.equal(asymmetric_target(w0, H, C, damp), w0)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), noise=st.floats(0.01, 0.3))
@example(seed=0, noise=0.01)
@example(seed=7, noise=0.3)
def test_gptq_on_the_target_beats_plain_gptq_against_the_float_output(seed, noise):
    """The layer property: on the calibration rows, ``||X~ Q^T - X W0^T||`` of GPTQ aimed at
    ``W*`` is <= that of plain GPTQ (aimed at ``W0``), both with the Hessian of ``X~`` and
    the same scales; X~ = the float rows with a correlated upstream error, then e4m3 per token
    (the GEMM's dynamic input quantization)."""
    g = torch.Generator().manual_seed(seed)
    n, k, m = 256, 32, 16
    x = torch.randn(n, k, generator=g) * torch.linspace(0.2, 3, k)
    mix = torch.eye(k) + noise * torch.randn(k, k, generator=g)
    entry = _entry("token")
    xq = input_quantizer(entry)(x @ mix)
    w0 = torch.randn(m, k, generator=g, dtype=torch.float64)
    H, C = _stats(x, xq)
    scale = (w0.abs().amax(1, keepdim=True) / 448).expand_as(w0)

    def error(aim):
        q = decode(gptq_codes(aim, H, scale, E4M3, damp=0.01), E4M3).double() * scale
        return float(((xq.double() @ q.T - x.double() @ w0.T) ** 2).sum())

    plain = error(w0)
    asym = error(asymmetric_target(w0, H, C, 0.01))
    assert asym <= plain * 1.0001


def _entry(granularity, group_size=None, fmt=E4M3, static=False):
    return SimpleNamespace(act_format=fmt, input=SimpleNamespace(
        granularity=granularity, group_size=group_size, static=static))


def test_input_quantizer_is_the_quantgemm_own():
    x = torch.randn(6, 256) * torch.logspace(-3, 2, 256)
    for gran, size in (("token", None), ("group", 128)):
        q = QuantGemm(torch.nn.Linear(256, 4), weight_format=E4M3,
                      weight_codes=torch.zeros(4, 256, dtype=torch.uint8),
                      weight_scale=torch.ones(4), weight_granularity=weight_granularity("channel"),
                      act_format=E4M3, input_scale=None, act_granularity=gran,
                      act_group_size=size)
        assert torch.equal(input_quantizer(_entry(gran, size))(x), q.quantize_input(x))
    assert input_quantizer(_entry("tensor", static=True)) is None
    assert input_quantizer(_entry("token", fmt=None)) is None


def _recorded(monkeypatch, model, recipe):
    seen = {}

    def spy(model_, t, *args, hessian=None, aim=None, **kwargs):
        seen[t.name] = (hessian, aim)
        return QUANTIZE_TARGET(model_, t, *args, hessian=hessian, aim=aim, **kwargs)

    monkeypatch.setattr(in_memory, "quantize_target", spy)
    return quantize_model(model, recipe, BATCHES), seen


def _inputs(model, names, transform=None):
    """name -> the inputs every calibration batch feeds that module (rows, float64)."""
    got = {n: [] for n in names}
    handles = []
    for n in names:
        m = model.get_submodule(n)

        def hook(mod, args, n=n):
            x = args[0]
            x = mod.quantize_input(x) if transform and isinstance(mod, QuantGemm) else x
            got[n].append(x.detach().reshape(-1, x.shape[-1]).double())
        handles.append(m.register_forward_pre_hook(hook))
    with torch.inference_mode():
        for b in BATCHES:
            model(**b)
    for h in handles:
        h.remove()
    return {n: torch.cat(v) for n, v in got.items()}


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_each_target_is_fitted_to_the_final_quantized_and_float_inputs(monkeypatch, arch):
    recipe = Recipe(format="e4m3", act_granularity="token", weight_calib="gptq",
                    dtype="float32", gptq_asym=True)
    model, ref = tiny(arch).float(), tiny(arch).float()
    result, seen = _recorded(monkeypatch, model, recipe)
    facts = result.extras["gptq"]["sequential"]
    assert 0 < facts["aim_correction"]["mean"] <= facts["aim_correction"]["max"] < 0.5
    names = list(seen)
    xq, x = _inputs(model, names, transform=True), _inputs(ref, names)
    for name, (h, aim) in seen.items():
        H, C = _stats(x[name], xq[name])
        torch.testing.assert_close(h.double(), H, rtol=1e-5, atol=1e-7)
        w0 = weight_2d(ref.get_submodule(name)).detach().double()
        want = asymmetric_target(w0, H, C, recipe.gptq_damp)
        # the corrections agree to float32 summation order (the Hessians to 1e-5)
        assert float((aim - want).norm()) <= 1e-3 * float((want - w0).norm()), name


@pytest.mark.slow
def test_model_output_is_closer_to_the_float_model_than_plain_gptq():
    ref = tiny("llama").float()
    errors = {}
    for asym in (False, True):
        model = tiny("llama").float()
        quantize_model(model, Recipe(format="e4m3", act_granularity="token", dtype="float32",
                                     weight_calib="gptq", gptq_asym=asym), BATCHES)
        with torch.inference_mode():
            errors[asym] = sum(float(((model(**b).logits - ref(**b).logits) ** 2).mean())
                               for b in BATCHES)
    assert errors[True] < errors[False]


def test_needs_sequential_gptq():
    with pytest.raises(UsageError, match="sequential"):
        Recipe(gptq_asym=True, gptq_sequential=False)
    Recipe(gptq_sequential=False)  # the default itself never conflicts


def test_cli_flag_is_recorded(tmp_path, word_tokenizer):
    src, calib = saved_llama_with_calib(tmp_path, word_tokenizer)
    out = tmp_path / "out"
    r = invoke(["quantize", src, "-o", out, "--gptq-asym", "--act-granularity", "token",
                "--calib-data", calib, "--num-samples", 2, "--seq-len", 8,
                "--dtype", "float32", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "fp8ptq.json").read_text())
    assert doc["recipe"]["gptq_asym"] is True
    r = invoke(["quantize", src, "-o", tmp_path / "bad", "--gptq-asym", "--no-gptq-sequential",
                "--calib-data", calib, "--num-samples", 2, "--seq-len", 8])
    assert r.exit_code != 0 and "error:" in r.output and not (tmp_path / "bad").exists()
