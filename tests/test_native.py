"""The C kernels (fp8ptq.runtime.native) against the pure-torch paths they replace: bit for bit, for
every format, rounding mode, source dtype, scale layout and the observer statistics; plus the
build, the off switch and an end-to-end quantization that must not depend on which path ran."""

import contextlib
import ctypes
import dataclasses
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from fp8ptq.config.recipe import Recipe
from fp8ptq.execution.in_memory import quantize_model
from fp8ptq.formats import binades, codec
from fp8ptq.formats.registry import get_format, preset_names
from fp8ptq.model.forward import token_batches
from fp8ptq.observe.observers import TensorStats
from fp8ptq.runtime import native
from test_formats_fastcodec import _values
from tiny_models import IDS, run, tiny

FORMATS = sorted(set(preset_names()) | {"e3m4", "e2m5", "e5m2b10", "e4m3b5fn", "e3m2", "e6m1",
                                        "e2m1", "e1m6fn"})
ROUNDINGS = ["nearest_even", "half_away", "stochastic", "hybrid"]

needs_native = pytest.mark.skipif(not native.available(),
                                  reason="C kernels off (FP8PTQ_NATIVE=0) or no C compiler")


@pytest.fixture
def native_on(monkeypatch):
    """The kernels switched on whatever FP8PTQ_NATIVE the suite runs under (the tests that use
    this are about building them); ``native.library()`` re-resolved before and after."""
    monkeypatch.setenv("FP8PTQ_NATIVE", "1")
    native.library.cache_clear()
    yield
    native.library.cache_clear()


def test_kernels_build_where_a_compiler_exists(native_on):
    if shutil.which("cc") or shutil.which("gcc"):
        assert native.available()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns, except that any NaN equals any NaN (torch itself writes different
    NaN payloads for bfloat16 in its scalar and vector loops)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    ints = {4: torch.int32, 2: torch.int16}[a.element_size()]
    both_nan = torch.isnan(a) & torch.isnan(b)
    return bool(((a.view(ints) == b.view(ints)) | both_nan).all())


def _inputs(spec):
    x = torch.cat([_values(spec, n=600), torch.tensor([torch.nan, -torch.nan]),
                   torch.randn(1001) * spec.max / 3])
    return [x, x.bfloat16(), x.half()]


def _gen():
    return torch.Generator().manual_seed(7)


def _both(fn):
    got = fn()
    with native.disabled():
        want = fn()
    return got, want


@pytest.mark.slow
@needs_native
@pytest.mark.parametrize("name", FORMATS)
def test_quantize_values_and_encode_are_bit_identical(name):
    base = get_format(name)
    for rounding in ROUNDINGS if base.is_float else ["nearest_even", "half_away"]:
        spec = dataclasses.replace(base, rounding=rounding)
        for x in _inputs(spec):
            options = [(True, False), (False, False), (True, True)] if x.dtype == torch.float32 \
                else [(True, False)]
            for saturate, nan_to_zero in options:
                kw = dict(saturate=saturate, nan_to_zero=nan_to_zero)
                got, want = _both(lambda: codec.quantize_values(x, spec, generator=_gen(), **kw))
                assert _same(got, want), (name, rounding, x.dtype, kw)
                got, want = _both(lambda: codec.encode(x, spec, generator=_gen(), **kw))
                assert _same(got, want), (name, rounding, x.dtype, kw)


@needs_native
@pytest.mark.parametrize("name", FORMATS)
def test_fake_quantize_is_bit_identical_for_every_scale_layout(name):
    base = get_format(name)
    g = torch.Generator().manual_seed(3)
    for rounding in ROUNDINGS if base.is_float else ["nearest_even"]:
        spec = dataclasses.replace(base, rounding=rounding)
        for x in _inputs(spec):
            x2 = x[: x.numel() // 37 * 37].reshape(-1, 37)  # odd width: vector tails per row
            scales = [(x, 0.37), (x, torch.tensor(2.5)), (x2, torch.rand(1, 37, generator=g)),
                      (x2, torch.rand(x2.shape[0], 1, generator=g) + 0.01),
                      (x2[:12].reshape(4, 3, 37), torch.rand(4, 3, 1, generator=g) + 0.01)]
            for t, s in scales:
                got, want = _both(lambda: codec.fake_quantize(t, s, spec, generator=_gen()))
                assert got.dtype == t.dtype
                assert _same(got, want), (name, rounding, t.dtype, getattr(s, "shape", s))


@pytest.mark.slow
@needs_native
@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz", "hfp8", "e3m4",
                                  "e2m5", "e5m2b10", "e4m3b5fn", "e6m1", "e1m6fn", "e3m0",
                                  "e2m0b0", "e2m0b0-ftz", "hif8", "hif8-rne"])
def test_every_bfloat16_pattern_rounds_identically(name):
    """Every bfloat16 bit pattern (each binade, subnormals, ties, inf, NaN), as bfloat16, as
    float32 and as float32 with random low bits: the kernels' vector loops (integer rounding for
    IEEE-like and tapered grids) against the torch path, saturating and not, fake-quantized and
    encoded."""
    spec = get_format(name.removesuffix("-ftz").removesuffix("-rne"))
    if name.endswith("-ftz"):  # no subnormals: no mantissa bits and the clamped lowest binade
        spec = dataclasses.replace(spec, name=name, subnormals=False)
    if name.endswith("-rne"):  # HiF8's tapered grid rounded half to even, not half away
        spec = dataclasses.replace(spec, rounding="nearest_even")
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    low = torch.randint(0, 1 << 16, x.shape, generator=torch.Generator().manual_seed(5),
                        dtype=torch.int32)
    noisy = (x.float().view(torch.int32) | low).view(torch.float32)
    for t in (x, x.float(), noisy):
        for scale in (torch.tensor(1.0), torch.tensor(0.37)):
            got, want = _both(lambda: codec.fake_quantize(t, scale, spec))
            assert _same(got, want), (name, t.dtype, scale)
        for saturate in (True, False):
            got, want = _both(lambda: codec.encode(t.float(), spec, saturate=saturate))
            assert _same(got, want), (name, t.dtype, saturate)


@needs_native
@pytest.mark.parametrize("name", ["e4m3", "hif8", "int8", "e3m4"])
def test_big_tensors_split_across_threads_identically(name):
    spec = get_format(name)
    x = torch.randn(1031, 577, generator=torch.Generator().manual_seed(1)) * 50
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        for t in (x, x.bfloat16()):
            for s in (torch.tensor(0.2), torch.rand(1031, 1) + 0.05):
                got, want = _both(lambda: codec.fake_quantize(t, s, spec))
                assert _same(got, want)
            got, want = _both(lambda: codec.encode(t.float() / 0.2, spec))
            assert _same(got, want)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
@needs_native
@pytest.mark.parametrize("rounding", ["half_away", "nearest_even"])
@pytest.mark.parametrize("saturate", [True, False])
def test_hif8_encodes_by_lookup_identically_at_every_key_edge(rounding, saturate):
    """HiFloat8's codes come from one table lookup keyed by the float32's top bits (and, for
    half-even, whether any lower bit is set). Every key's extreme members and their neighbours
    across the key edge (low bits 0, 1, all but one, all; both signs; every exponent field,
    inf and NaN payloads included), unscaled, scaled per tensor and per row, from float32 and
    bfloat16: the same codes as the torch path."""
    spec = dataclasses.replace(get_format("hif8"), rounding=rounding)
    tables = binades.native_tables(spec, rounding, saturate)
    assert tables.code_lut and tables.lut_shift == 19 and tables.lut_sticky == (
        rounding == "nearest_even")  # the lookup path is the one under test
    low = (1 << tables.lut_shift) - 1
    top = torch.arange(1 << 13, dtype=torch.int64) << tables.lut_shift
    bits = torch.stack([top, top + 1, top + low - 1, top + low, top - 1], 1).flatten() % (1 << 32)
    x = binades._bits_as_float(bits)
    got, want = _both(lambda: codec.encode(x, spec, saturate=saturate))
    assert _same(got, want)
    if saturate:  # the scaled encodes saturate
        rows = x.reshape(-1, 40)
        for scale in (torch.tensor(0.37), torch.rand(rows.shape[0], 1) + 0.01):
            for t in (rows, rows.bfloat16()):
                got, want = _both(lambda: codec.encode_scaled(t, scale, spec))
                assert _same(got, want), (t.dtype, scale.shape)


@pytest.mark.parametrize("name", ["e4m3", "hif8", "int8"])
@pytest.mark.parametrize("kernels", [True, False])
def test_out_buffers_hold_the_same_bits(name, kernels):
    """``encode(..., out=)`` / ``fake_quantize(..., out=)`` write the allocating call's bits into
    the given tensor and return it, on the kernels' path and the torch path, into a contiguous
    or a strided buffer; a buffer of the wrong shape or dtype is refused."""
    spec = get_format(name)
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(2)) * 40
    scale = torch.rand(64, 1, generator=torch.Generator().manual_seed(3)) + 0.05
    with contextlib.nullcontext() if kernels else native.disabled():
        for t in (x, x.bfloat16()):
            want_fq, want_codes = codec.fake_quantize(t, scale, spec), codec.encode(x / 3, spec)
            for buf in (torch.full_like(t, 7.0), torch.full((96, 64), 7.0, dtype=t.dtype).t()):
                got = codec.fake_quantize(t, scale, spec, out=buf)
                assert got is buf and _same(buf, want_fq)
            codes = torch.zeros(x.shape, dtype=torch.uint8)
            assert codec.encode(x / 3, spec, out=codes) is codes and torch.equal(codes,
                                                                                  want_codes)
    with pytest.raises(ValueError, match="out="):
        codec.fake_quantize(x, scale, spec, out=torch.empty(64, 95))
    with pytest.raises(ValueError, match="out="):
        codec.encode(x, spec, out=torch.empty(x.shape))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2048, 96), (3, 7), (1, 1536), (2, 5, 33)])
def test_observer_statistics_are_identical(dtype, shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * torch.exp2(
        torch.randint(-45, 45, shape, generator=g).float())
    flat = x.view(-1)
    flat[3], flat[5], flat[7], flat[-1] = torch.nan, torch.inf, 0.0, -torch.inf
    x = x.to(dtype)
    got, want = TensorStats(), TensorStats()
    got.update(x)
    got.update(x * 3)
    with native.disabled():
        want.update(x)
        want.update(x * 3)
    assert got.amax == want.amax and got.count == want.count
    assert got.nonfinite == want.nonfinite >= 4
    assert torch.equal(got.channel_amax, want.channel_amax)
    assert torch.equal(got.histogram, want.histogram)


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    """``native.library()`` re-resolved under the test's environment (an empty cache folder),
    and restored afterwards."""
    monkeypatch.setenv("FP8PTQ_CACHE", str(tmp_path))
    native.library.cache_clear()
    yield tmp_path / "native"
    native.library.cache_clear()


def test_off_switch(fresh_library, monkeypatch):
    monkeypatch.setenv("FP8PTQ_NATIVE", "0")
    assert native.library() is None and not native.supports(torch.ones(3))
    assert not fresh_library.exists()  # nothing built, nothing written


def test_no_compiler_is_one_log_line_and_the_torch_path(fresh_library, native_on, monkeypatch,
                                                        caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    spec = get_format("e4m3")
    x = torch.randn(300)
    with caplog.at_level("DEBUG", logger="fp8ptq.runtime.native"):
        assert native.library() is None
        got = codec.fake_quantize(x, 0.1, spec)
    assert [r.levelname for r in caplog.records if r.levelname != "DEBUG"] == ["INFO"]
    assert "/nonexistent/cc" in caplog.text
    with native.disabled():
        assert _same(got, codec.fake_quantize(x, 0.1, spec))
    assert not list(fresh_library.glob("*"))  # the failed build left nothing behind


@pytest.mark.slow
@needs_native
def test_concurrent_builds_install_one_complete_library(fresh_library):
    """Two builders racing on one cache path (torchrun ranks starting together): both succeed,
    one library is left and no temporary, and it loads (built -O0 here: the race, not the
    optimiser, is under test)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    flags = ("-O0", "-fPIC", "-shared", "-pthread")
    path = native.library_path(cc, flags)
    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(lambda _: native.build(cc, path, flags), range(2))) == [True, True]
    assert [p.name for p in fresh_library.iterdir()] == [path.name]
    assert ctypes.CDLL(str(path)).fp8ptq_have_f16() in (0, 1)


@pytest.mark.slow
@needs_native
@pytest.mark.parametrize("fmt", ["e4m3", "hif8", "int8"])
@pytest.mark.parametrize("act_granularity", ["tensor", "token"])
def test_quantized_model_does_not_depend_on_the_path(fmt, act_granularity):
    """Calibrate + quantize a tiny bf16 Llama with the kernels and with torch: the same scales,
    the same weights, the same simulated logits."""
    recipe = Recipe(format=fmt, act_granularity=act_granularity, weight_granularity="channel")

    def quantized():
        model = tiny("llama").to(torch.bfloat16)
        result = quantize_model(model, recipe, list(token_batches(IDS, 4)))
        return model, result

    model, result = quantized()
    with native.disabled():
        ref_model, ref_result = quantized()
        ref_logits = run(ref_model, IDS)
    assert [r.input_scale for r in result.modules] == [r.input_scale for r in ref_result.modules]
    for (name, t), (_, u) in zip(model.state_dict().items(), ref_model.state_dict().items()):
        assert _same(t, u), name
    assert _same(run(model, IDS), ref_logits)


def _addr_is_the_kernels_rule(dtype=torch.float32) -> bool:
    """Whether this torch's one-thread ``addr_`` (MKL's ``sger`` / ``dger`` on an AVX2 x86 CPU)
    computes ``w + (-u) * e`` as the C block loop does: fused multiply-adds on each row's first
    ``n - n % 16`` values (float32; ``n - n % 8`` in float64), a product then a sum on the rest.
    The fused reference: float32 through float64 (exact products), float64 through exact
    fractions."""
    from fractions import Fraction
    g = torch.Generator().manual_seed(5)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for n in (100, 300):
            w, u, e = (torch.randn(s, generator=g, dtype=dtype) for s in ((9, n), (9,), (n,)))
            got = w.clone().addr_(u, e, alpha=-1)
            if dtype == torch.float32:
                fused = (w.double() - u.double()[:, None] * e.double()).float()
                k = n - n % 16
            else:
                fused = torch.tensor([[float(Fraction(a) - Fraction(b) * Fraction(c))
                                       for a, c in zip(row.tolist(), e.tolist())]
                                      for row, b in zip(w, u.tolist())], dtype=dtype)
                k = n - n % 8
            want = torch.cat([fused[:, :k], (w - u[:, None] * e)[:, k:]], 1)
            if not torch.equal(got, want):
                return False
    finally:
        torch.set_num_threads(threads)
    return True


@needs_native
@pytest.mark.parametrize("name,rounding", [(n, None) for n in preset_names()] +
                         [("e4m3", "half_away"), ("e3m4", None), ("e5m2b10", None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gptq_block_loop_gives_the_torch_loops_codes(name, rounding, dtype, monkeypatch):
    """The C block loop (``sweep.native_loop``) against the torch column loop it replaces, in
    float32 and float64 sweeps, with act-order, a row length (100) that is not a multiple of
    16 and a partial last block: the same codes bit for bit where torch's rank-1 update is the
    kernel's arithmetic (checked here on this CPU), else the same codes but for a few near a
    rounding boundary."""
    from fp8ptq.algorithms.gptq import sweep
    g = torch.Generator().manual_seed(3)
    fmt = get_format(name)
    X = torch.randn(400, 300, generator=g) * torch.rand(300, generator=g) * 3
    H = (X.T @ X).double()
    W = torch.randn(100, 300, generator=g) * 0.05
    S = (W.abs().amax(1, keepdim=True) / fmt.layout.max).expand_as(W)
    kw = {"act_order": True, "rounding": rounding, "sweep_dtype": dtype}
    assert sweep.native_loop(fmt, {"rounding": rounding} if rounding else {}, W.T.to(dtype),
                             S.T.to(dtype)) is not None
    native_codes = sweep.gptq_codes(W, H, S, fmt, **kw)
    monkeypatch.setattr(sweep, "native_loop", lambda *_: None)
    torch_codes = sweep.gptq_codes(W, H, S, fmt, **kw)
    if _addr_is_the_kernels_rule(dtype):
        assert torch.equal(native_codes, torch_codes)
    else:
        assert (native_codes != torch_codes).float().mean() < 1e-3


def test_gptq_block_loop_only_where_it_holds_the_bits(monkeypatch):
    """The torch loop runs for stochastic rounding (its draws are torch's), a narrower-than-8-bit
    format, a float32 sweep with float64 scales and with the kernels off."""
    from fp8ptq.algorithms.gptq import sweep
    w, e4m3 = torch.zeros(4, 32), get_format("e4m3")
    if native.available():
        assert sweep.native_loop(e4m3, {}, w, w) is not None
        # a float64 sweep takes its scales to float64 a block at a time: any scale dtype
        assert sweep.native_loop(e4m3, {}, w.double(), w.double()) is not None
        assert sweep.native_loop(e4m3, {}, w.double(), w) is not None
    assert sweep.native_loop(e4m3, {"rounding": "stochastic"}, w, w) is None
    assert sweep.native_loop(get_format("e2m1"), {}, w, w) is None
    assert sweep.native_loop(e4m3, {}, w, w.double()) is None
    with native.disabled():
        assert sweep.native_loop(e4m3, {}, w, w) is None
