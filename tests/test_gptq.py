"""GPTQ with fp8ptq's formats: hand-checked updates, the layer-output property against
round-to-nearest for every format and granularity, and the pipeline / checkpoint path."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fp8ptq
from fp8ptq.algorithms.gptq.sweep import gptq_codes, output_error
from fp8ptq.checkpoint import save_quantized
from fp8ptq.config.plan import needs_calibration
from fp8ptq.config.recipe import Recipe
from fp8ptq.errors import UsageError
from fp8ptq.execution.in_memory import quantize_model, token_batches
from fp8ptq.formats import decode, encode, get_format
from fp8ptq.formats.granularity import weight_granularity
from tiny_models import IDS, tiny


def test_identity_hessian_is_round_to_nearest():
    torch.manual_seed(0)
    W, fmt = torch.randn(8, 16), get_format("e4m3")
    S = torch.full_like(W, float(W.abs().max() / fmt.max))
    codes = gptq_codes(W, torch.eye(16), S, fmt, damp=0.0)
    assert torch.equal(codes, encode(W / S, fmt))


def test_two_correlated_columns_by_hand():
    """H = [[2, 1], [1, 1]]: rounding column 0 (0.4 -> 0) moves column 1 by
    (w0 - q0) * H01 / H11 = 0.4 (the optimal-brain-surgeon update), so 0.3 becomes 0.7 and
    rounds to 1, where round-to-nearest gives 0."""
    fmt = get_format("int8")
    W = torch.tensor([[0.4, 0.3]])
    S = torch.ones_like(W)
    codes = gptq_codes(W, torch.tensor([[2.0, 1.0], [1.0, 1.0]]), S, fmt, damp=0.0)
    assert decode(codes, fmt).tolist() == [[0.0, 1.0]]
    assert decode(encode(W / S, fmt), fmt).tolist() == [[0.0, 0.0]]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e4m3fnuz", "hfp8", "hif8", "e3m4", "int8"])
@pytest.mark.parametrize("gran", ["tensor", "channel", "block"])
def test_output_error_never_worse_than_round_to_nearest(fmt, gran):
    torch.manual_seed(1)
    fmt = get_format(fmt)
    g = weight_granularity(gran, 16)
    # correlated inputs with outlier channels, like a transformer's
    base = torch.randn(512, 8) @ torch.randn(8, 48)
    X = base + 0.1 * torch.randn(512, 48)
    X[:, 3] *= 20
    W = torch.randn(32, 48) * 0.05
    scale = (g.amax(W) / fmt.calibration_max).clamp(min=1e-12)
    S = g.expand(scale, W).expand_as(W)
    H = X.T.double() @ X.double()
    rtn = decode(encode(W / S, fmt), fmt) * S
    codes = gptq_codes(W, H, S, fmt, damp=0.01)
    gq = decode(codes, fmt) * S
    assert bool(torch.isfinite(gq).all())
    assert output_error(W, gq, X) <= output_error(W, rtn, X) * 1.0001
    act = decode(gptq_codes(W, H, S, fmt, damp=0.01, act_order=True), fmt) * S
    assert output_error(W, act, X) <= output_error(W, rtn, X) * 1.0001


def model_error(recipe):
    """``(result, quantized tiny Llama, mean squared logit error against the float model)``,
    quantized with ``recipe`` on ``IDS``."""
    batches = list(token_batches(IDS, 4))
    with torch.no_grad():
        want = tiny("llama").float()(input_ids=IDS).logits
    model = tiny("llama").float()
    result = quantize_model(model, recipe, batches)
    with torch.no_grad():
        got = model(input_ids=IDS).logits
    return result, model, float(((got - want) ** 2).mean())


def test_pipeline_gptq_lowers_the_model_error_and_round_trips(tmp_path):
    common = dict(format="hif8", act_format="none", dtype="float32")
    _, _, rtn = model_error(Recipe(**common))
    result, model, gptq = model_error(Recipe(weight_calib="gptq", **common))
    assert gptq < rtn
    assert result.extras["gptq"]["distinct_inputs"] < len(result.modules)  # q/k/v share one H
    save_quantized(result, Recipe(weight_calib="gptq", **common), tmp_path / "ck")
    with torch.no_grad():
        assert torch.equal(fp8ptq.load(tmp_path / "ck").model(input_ids=IDS).logits,
                           model(input_ids=IDS).logits)


def test_gptq_needs_calibration_data_even_with_dynamic_activations():
    with pytest.raises(UsageError, match="needs calibration data"):
        quantize_model(tiny("llama"), Recipe(weight_calib="gptq", act_granularity="token"))

    assert needs_calibration(Recipe(weight_calib="gptq", act_granularity="token"))


def _mx_scales(W: torch.Tensor, fmt):
    """MX weight scales the pipeline chooses before the sweep: OCP's E8M0 rule per 32 values
    along K (``amax_to_scale`` on a group-32 amax), expanded to one scale per weight."""
    from fp8ptq.formats.scales import amax_to_scale

    g = weight_granularity("group", fmt.mx_block)
    s = amax_to_scale(g.amax(W), fmt)
    assert s.shape == (W.shape[0], -(-W.shape[1] // 32))
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # powers of two: E8M0 codes
    return g.expand(s, W)


def test_mx_gptq_keeps_e8m0_groups_and_beats_round_to_nearest():
    """MXFP8 weights: GPTQ sweeps with the group-32 power-of-two scales fixed beforehand, so
    its codes times those scales are an MX tensor; round to nearest with the same scales is
    bit-identical to the OCP rule (``mx_fake_quantize``), and GPTQ's layer-output error is
    lower, plain and in activation order (a K that is not a multiple of 32 included)."""
    from fp8ptq.formats.mx import mx_fake_quantize

    fmt = get_format("mxfp8")
    for seed, k in ((0, 96), (1, 80)):
        torch.manual_seed(seed)
        X = (torch.randn(512, 8) @ torch.randn(8, k)) + 0.1 * torch.randn(512, k)
        X[:, 3] *= 20
        W = torch.randn(32, k) * 0.05
        S = _mx_scales(W, fmt)
        H = X.T.double() @ X.double()
        rtn = decode(encode(W / S, fmt), fmt) * S
        assert torch.equal(rtn, mx_fake_quantize(W, fmt))
        for act_order in (False, True):
            gq = decode(gptq_codes(W, H, S, fmt, damp=0.01, act_order=act_order), fmt) * S
            assert output_error(W, gq, X) < 0.1 * output_error(W, rtn, X)


MINILM = Path(os.environ.get("FP8PTQ_ASSETS", Path(__file__).resolve().parents[2] / "shared" /
                            "assets")) / "models" / "minilm-squad"


@pytest.mark.slow
@pytest.mark.skipif(not MINILM.is_dir(), reason="needs ../shared/assets")
def test_mx_gptq_on_real_minilm_layers():
    """The same property on real tensors: MiniLM-SQuAD's FFN GEMMs with the inputs a real
    sentence gives them (GPTQ's calibration rows), MXFP8 scales chosen before the sweep."""
    from transformers import AutoModelForQuestionAnswering, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MINILM)
    model = AutoModelForQuestionAnswering.from_pretrained(MINILM, dtype=torch.float32).eval()
    names = ["bert.encoder.layer.0.intermediate.dense", "bert.encoder.layer.5.output.dense"]
    seen = {}
    hooks = [model.get_submodule(n).register_forward_hook(
        lambda m, i, o, n=n: seen.__setitem__(n, i[0].reshape(-1, i[0].shape[-1]))) for n in names]
    text = ("Which NFL team represented the AFC at Super Bowl 50? The American Football "
            "Conference champion Denver Broncos defeated the National Football Conference "
            "champion Carolina Panthers 24 to 10 to earn their third Super Bowl title. ") * 4
    with torch.no_grad():
        model(**tok(text, return_tensors="pt"))
    for h in hooks:
        h.remove()
    fmt = get_format("mxfp8")
    for n in names:
        W, X = model.get_submodule(n).weight.detach(), seen[n].detach()
        S = _mx_scales(W, fmt)
        H = X.T.double() @ X.double()
        rtn = decode(encode(W / S, fmt), fmt) * S
        gq = decode(gptq_codes(W, H, S, fmt, damp=0.01, act_order=True), fmt) * S
        assert output_error(W, gq, X) < output_error(W, rtn, X)


@pytest.mark.slow
def test_pipeline_mx_gptq_stores_e8m0_groups(tmp_path):
    """``--format mxfp8 --weight-calib gptq`` end to end: the QuantGemms hold group-32
    power-of-two weight scales, the model error is below round to nearest's, and the
    checkpoint reloads bit-identically."""
    from fp8ptq.nn.quant_gemm import QuantGemm

    common = dict(format="mxfp8", dtype="float32")
    _, _, rtn = model_error(Recipe(**common))
    recipe = Recipe(weight_calib="gptq", gptq_act_order=True, **common)
    result, model, gptq = model_error(recipe)
    assert gptq < rtn
    gemms = [m for m in model.modules() if isinstance(m, QuantGemm)]
    assert gemms
    for m in gemms:
        s = m.weight_scale
        assert s.shape[-1] == -(-m.inner.weight.shape[1] // 32)
        assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    save_quantized(result, recipe, tmp_path / "ck")
    with torch.no_grad():
        assert torch.equal(fp8ptq.load(tmp_path / "ck").model(input_ids=IDS).logits,
                           model(input_ids=IDS).logits)


GPTQ_MEMORY = r"""
import torch
from fp8ptq.algorithms.gptq.sweep import gptq_codes
from fp8ptq.formats import get_format
n, out = 2048, 2048
torch.manual_seed(0)
H = torch.zeros(n, n, dtype=torch.float64)
for _ in range(16):  # built in chunks: the set-up's own peak stays below what is measured
    x = torch.randn(256, n, dtype=torch.float64)
    H.addmm_(x.T, x)
del x
W = torch.randn(out, n)
S = (W.abs().amax(1, keepdim=True) / 448).expand_as(W)
def status(key):
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024
open("/proc/self/clear_refs", "w").write("5")  # the kernel's peak (VmHWM) := current RSS
base, before = status("VmRSS"), status("VmHWM")
gptq_codes(W, H, S, get_format("e4m3"), act_order=True)
print(base, before, status("VmHWM"))
"""


@pytest.mark.slow
def test_gptq_holds_few_hessian_sized_temporaries():
    """GPTQ's working memory beyond the caller's Hessian and weight, measured (the kernel's
    peak RSS of a fresh process, reset just before the call; 2048 x 2048, act-order): at most
    ~3 float64 in x in matrices (the inverse Cholesky's two and LAPACK's copy) and ~2 float64
    weight-sized ones (the transposed weight the sweep updates; the scales stay a view). The
    plain way held ~10 in all, which does not fit for a 70B model's 28,672-input down_proj
    (6 GiB per matrix)."""
    res = subprocess.run([sys.executable, "-c", GPTQ_MEMORY], capture_output=True, text=True,
                         check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    base, before, peak = map(int, res.stdout.split())
    matrix = 8 * 2048 ** 2  # one float64 in x in matrix, and one float64 copy of the weight
    assert before < base + matrix / 8  # the peak was reset: the set-up's does not count
    assert peak - base < 5.5 * matrix, (peak - base) / matrix


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_the_gpu_column_step_is_the_generic_one(name):
    """The sweep's column step on a GPU (one saturating float8 cast) writes the codes and
    errors of the generic encode / decode step, saturated, subnormal and signed zeros
    included; run here on CPU tensors (the step only asks the device's type)."""
    from fp8ptq.algorithms.gptq import sweep
    fmt = get_format(name)
    fast = sweep._column_step(fmt, {}, torch.device("cuda"))
    generic = sweep._column_step(fmt, {}, torch.device("cpu"))
    assert fast.__name__ == "step" and generic.__name__ == "generic"
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4096, generator=g) * torch.logspace(-6, 1, 4096)
    w[:4] = torch.tensor([0.0, -0.0, 1e4, -1e4])
    s = torch.rand(4096, generator=g) * 0.02 + 1e-4
    rows = [(torch.empty(4096, dtype=torch.uint8), torch.empty(4096)) for _ in range(2)]
    for step, (c, e) in zip((fast, generic), rows):
        step(w, s, c, e)
    assert torch.equal(rows[0][0], rows[1][0]) and torch.equal(rows[0][1], rows[1][1])


def test_a_sweep_with_the_gpu_step_gives_the_cpu_codes(monkeypatch):
    from fp8ptq.algorithms.gptq import sweep
    torch.manual_seed(0)
    W, X, fmt = torch.randn(48, 64), torch.randn(256, 64), get_format("e4m3")
    S = (W.abs().amax(1, keepdim=True) / fmt.max).expand_as(W)
    want = gptq_codes(W, X.T @ X, S, fmt, act_order=True, block=16)
    real = sweep._column_step
    monkeypatch.setattr(sweep, "_column_step",
                        lambda f, kw, device: real(f, kw, torch.device("cuda")))
    assert torch.equal(gptq_codes(W, X.T @ X, S, fmt, act_order=True, block=16), want)


def test_shared_factors_factor_one_hessian_once(monkeypatch):
    """Inside ``shared_factors`` a second sweep on the very same Hessian (a group's q/k/v)
    reuses the first one's inverse Cholesky factor, with the same codes; a Hessian modified
    in between, another one, or a sweep outside factors again."""
    from fp8ptq.algorithms.gptq import sweep
    g = torch.Generator().manual_seed(0)
    X = torch.randn(300, 64, generator=g)
    H, H2 = (X.T @ X).double(), (X[:150].T @ X[:150]).double()
    W = [torch.randn(8, 64, generator=g) for _ in range(3)]
    S = torch.full((8, 64), 0.01)
    fmt = get_format("e4m3")
    want = [gptq_codes(w, H, S, fmt, act_order=True) for w in W]
    calls = []
    real = sweep._inverse_cholesky
    monkeypatch.setattr(sweep, "_inverse_cholesky", lambda *a: calls.append(1) or real(*a))
    with sweep.shared_factors():
        got = [gptq_codes(w, H, S, fmt, act_order=True) for w in W]
        assert len(calls) == 1
        gptq_codes(W[0], H2, S, fmt, act_order=True)
        assert len(calls) == 2
        gptq_codes(W[0], H2, S, fmt, act_order=False)  # another column order
        assert len(calls) == 3
        H2.mul_(2.0)  # modified in place: factored again
        gptq_codes(W[0], H2, S, fmt, act_order=False)
        assert len(calls) == 4
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    gptq_codes(W[0], H, S, fmt, act_order=True)
    assert len(calls) == 5


def _textbook_gptq64(W, H, S, fmt, damp):
    """Algorithm 1 of Frantar et al. 2022 without lazy blocks, all in float64: the reference a
    float64 sweep must reproduce."""
    W = W.double().clone()
    n = W.shape[1]
    A = H.double() + damp * torch.diagonal(H).double().mean() * torch.eye(n, dtype=torch.float64)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(A)), upper=True)
    S = S.double()
    codes = torch.empty(W.shape, dtype=torch.uint8)
    for i in range(n):
        codes[:, i] = encode((W[:, i] / S[:, i]).float(), fmt)
        err = (W[:, i] - decode(codes[:, i], fmt).double() * S[:, i]) / U[i, i]
        W[:, i + 1:] -= err[:, None] * U[i, i + 1:][None, :]
    return codes


def _low_rank_problem():
    """(W, H, S, e4m3): 300 inputs of rank-16 activations plus noise (a badly conditioned
    Hessian), 64 rows, channel max scales: three 128-column blocks, the last partial."""
    g = torch.Generator().manual_seed(3)
    X = torch.randn(2048, 16, generator=g) @ torch.randn(16, 300, generator=g)
    X += 0.01 * torch.randn(2048, 300, generator=g)
    W = torch.randn(64, 300, generator=g) * 0.05
    fmt = get_format("e4m3")
    S = (W.abs().amax(1, keepdim=True) / fmt.max).expand_as(W).contiguous()
    return W, (X.T @ X).double(), S, fmt


def test_float64_sweep_is_the_textbook_algorithm_in_float64(monkeypatch):
    """``sweep_dtype=float64`` (``--gptq-sweep-dtype float64``) carries the weight copy, the
    factor, the scales and the errors in float64: its codes are the unblocked float64
    algorithm's, code for code, across several 128-column blocks; the float32 sweep is the
    same algorithm within float32 rounding (a few codes at rounding boundaries may differ)."""
    from fp8ptq.algorithms.gptq import sweep
    W, H, S, fmt = _low_rank_problem()
    want = _textbook_gptq64(W, H, S, fmt, 0.01)
    seen = set()  # (weight block, factor block, scales, errors) dtypes of every block loop
    from fp8ptq.runtime import native
    real_c, real_torch = native.gptq_block, sweep._column_loop
    monkeypatch.setattr(native, "gptq_block", lambda t, v, W1, U1, S1, err, *a: seen.add(
        (W1.dtype, U1.dtype, S1.dtype, err.dtype)) or real_c(t, v, W1, U1, S1, err, *a))
    monkeypatch.setattr(sweep, "_column_loop", lambda W1, U1, S1, err, *a: seen.add(
        (W1.dtype, U1.dtype, S1.dtype, err.dtype)) or real_torch(W1, U1, S1, err, *a))
    got64 = gptq_codes(W, H, S, fmt, damp=0.01, sweep_dtype=torch.float64)
    assert torch.equal(got64, want)
    assert seen == {(torch.float64,) * 4}
    seen.clear()
    got32 = gptq_codes(W, H, S, fmt, damp=0.01)
    assert float((got32 != want).float().mean()) < 0.001  # a handful of boundary codes
    assert seen == {(torch.float32,) * 4}


def test_mixed_sweep_keeps_float32_storage_and_loops_in_float64(monkeypatch):
    """``mixed`` (``sweep.Precision(float32, float64)``): the weight copy and the inverse
    factor stay float32 (a float32 sweep's memory), every block's column loop runs on float64
    copies of its columns, factor block and scales with float64 errors; the codes are float64's
    but for a few at rounding boundaries."""
    from fp8ptq.algorithms.gptq import sweep
    from fp8ptq.runtime import native
    W, H, S, fmt = _low_rank_problem()
    loops, factors = set(), []
    real_c, real_factor = native.gptq_block, sweep._factor
    monkeypatch.setattr(native, "gptq_block", lambda t, v, W1, U1, S1, err, *a: loops.add(
        (W1.dtype, U1.dtype, S1.dtype, err.dtype)) or real_c(t, v, W1, U1, S1, err, *a))
    monkeypatch.setattr(sweep, "_factor", lambda *a: factors.append(a[-1]) or real_factor(*a))
    mixed = gptq_codes(W, H, S, fmt, sweep_dtype=sweep.Precision(torch.float32, torch.float64))
    if native.available():
        assert loops == {(torch.float64,) * 4}
    assert factors == [torch.float32]
    want = _textbook_gptq64(W, H, S, fmt, 0.01)
    assert float((mixed != want).float().mean()) < 0.001


def test_the_recipe_selects_the_float64_sweep(monkeypatch):
    """``gptq_sweep_dtype`` reaches the sweep of every GEMM (the CLI's
    ``--gptq-sweep-dtype``), and the model's codes change only where float32's rounding
    flips one."""
    from fp8ptq.algorithms.gptq import sweep
    seen = []
    real = sweep.gptq_codes

    def spy(*a, **kw):
        seen.append(kw.get("sweep_dtype"))
        return real(*a, **kw)
    import fp8ptq.steps.quantize_module as qm
    monkeypatch.setattr(qm, "gptq_codes", spy)
    f32, f64 = torch.float32, torch.float64
    for name, want in (("float64", (f64, f64)), ("mixed", (f32, f64))):
        seen.clear()
        r = Recipe(format="e4m3", weight_calib="gptq", gptq_sweep_dtype=name)
        quantize_model(tiny("llama"), r, token_batches(IDS, 2))
        assert seen and set(seen) == {want}
    default = Recipe(format="e4m3")  # auto: float64 on the CPU, mixed on a GPU
    assert default.sweep_dtype_on("cpu") == (f64, f64)
    assert default.sweep_dtype_on("cuda") == (f32, f64)
    assert Recipe(format="e4m3", gptq_sweep_dtype="mixed").sweep_dtype_on("cpu") == (f32, f64)
    assert Recipe(format="e4m3", gptq_sweep_dtype="float32").sweep_dtype_on("cuda") == (f32, f32)
    for key in ("gptq_sweep_dtype", "gptq_hessian_dtype"):  # a recipe file's typo
        with pytest.raises(UsageError, match=key):
            Recipe(format="e4m3", **{key: "bfloat16"}).check_values()
