"""Device bugs caught on a CPU-only machine: every stage below runs on fake ``"cuda"`` tensors
(``tests/fake_cuda.py``), where an op that mixes a CUDA tensor with one the library made on the
CPU raises torch's "Expected all tensors to be on the same device" error, as on a GPU. The
Hessian stays a real CPU tensor, as the collector keeps it. Reads back to the host are counted:
none may happen once per column of a GPTQ sweep."""

import pytest
import torch

from fake_cuda import CUDA, fake_cuda
from fp8ptq.algorithms.gptq.asym import asymmetric_target
from fp8ptq.algorithms.gptq.sweep import gptq_codes
from fp8ptq.calibrators.registry import weight_entry
from fp8ptq.config.recipe import Recipe
from fp8ptq.execution.in_memory import quantize_model, token_batches
from fp8ptq.formats import get_format
from fp8ptq.formats.granularity import weight_granularity
from fp8ptq.formats.weight_quant import choose_scale, half_layout, quantize_weight
from fp8ptq.nn import quant_gemm
from fp8ptq.nn.quant_gemm import QuantGemm
from fp8ptq.observe.hessian import HessianCollector
from tiny_models import IDS, invoke, saved_llama_with_calib, tiny

OUT, IN = 8, 80  # with BLOCK = 32: three GPTQ blocks, the last one partial (fake ops are slow)
BLOCK = 32


@pytest.fixture(autouse=True)
def _format_tables():
    """A format's lookup tables are built once, on the CPU, from real values: built here before
    any fake mode, as a process's first quantize builds them before its first GEMM."""
    half_layout(get_format("e4m3"))


def test_format_tables_built_first_inside_a_fake_mode_are_real():
    """A format whose tables are first asked for inside a tracing mode still gets real CPU
    tables (they are kept for the process: a fake one would poison every later use)."""
    from fp8ptq.formats.binades import binade_tables
    from fp8ptq.formats.spec import FormatSpec
    fresh = FormatSpec("e3m4-traced", exponent_bits=3, mantissa_bits=4, bias=3)
    with fake_cuda():
        lay, tables = fresh.layout, binade_tables(fresh)
    assert type(lay.values) is torch.Tensor and type(tables.step) is torch.Tensor
    assert lay.max == 15.5 and float(tables.step[127]) == 2.0 ** -4


def test_elementwise_work_on_a_gpu_runs_in_few_large_chunks(monkeypatch):
    """On a GPU a chunk costs kernel launches, not cache: one weight's encode and its rounding
    by ``quantize_weight`` run in one piece there (the CPU's cache-sized chunks would cut this
    4M-element weight into 64 and 32 pieces, each with its own reads back to the host)."""
    from fp8ptq.formats import codec
    calls = []
    real = codec._encode_dense

    def counted(x, spec, **kw):
        calls.append(x.numel())
        return real(x, spec, **kw)

    monkeypatch.setattr(codec, "_encode_dense", counted)
    fmt, gran = get_format("e4m3"), weight_granularity("channel")
    with fake_cuda() as mode:
        W = torch.randn(1024, 4096, device=CUDA)
        codec.encode(W, fmt)
        assert calls == [W.numel()]
        scale = gran.amax(W) / fmt.max
        mode.syncs, calls[:] = 0, []
        quantize_weight(W, scale, fmt, gran)
        assert calls == [W.numel()]
        assert mode.syncs <= 3  # amax and the two sums of squares, once for the weight
    calls.clear()
    from fp8ptq.runtime import native
    with native.disabled():  # the torch path on a CPU: cache-sized chunks
        codec.encode(torch.randn(1024, 4096), fmt)
    assert calls == [codec.CHUNK_ELEMENTS] * 64


def test_a_model_is_read_straight_onto_the_gpu(tmp_path, word_tokenizer, monkeypatch):
    """``load_model(..., device="cuda")`` of a local safetensors folder sends each parameter to
    the GPU as it is read, not the whole model gathered in host memory and then copied (the
    placement is recorded here; the tensors themselves stay on this CPU)."""
    from fp8ptq.io import loading, weights
    placed = []
    real = weights.set_module_tensor_to_device

    def record(module, name, device, **kw):
        placed.append(str(device))
        return real(module, name, "cpu", **kw)

    monkeypatch.setattr(weights, "set_module_tensor_to_device", record)
    monkeypatch.setattr(torch.nn.Module, "to", lambda self, *a, **k: self)
    src, _ = saved_llama_with_calib(tmp_path, word_tokenizer)
    loading.load_model(str(src), device="cuda")
    assert placed and set(placed) == {"cuda"}


def _hessian(cols: int = IN) -> torch.Tensor:
    x = torch.randn(4 * cols, cols, generator=torch.Generator().manual_seed(0))
    x[:, 3] = 0.0  # an input that was always zero (the sweep's "dead" columns)
    return (2 * x.T @ x / x.shape[0]).double()


@pytest.mark.parametrize("act_order", [True, False])
def test_gptq_sweeps_a_cuda_weight_with_a_cpu_hessian(act_order):
    """The default recipe's two crashes on a GPU: the act-order permutation made on the
    Hessian's device indexing the CUDA weight, and (without act order) the CUDA scales dividing
    a CPU copy of the weight."""
    H = _hessian()
    fmt = get_format("e4m3")
    with fake_cuda() as mode:
        W = torch.randn(OUT, IN, device=CUDA)
        S = torch.ones(OUT, 1, device=CUDA).expand(OUT, IN)
        codes = gptq_codes(W, H, S, fmt, act_order=act_order, block=BLOCK)
    assert codes.device == CUDA and codes.dtype == torch.uint8
    assert tuple(codes.shape) == (OUT, IN)
    # the Cholesky's success and its finiteness: a fixed number of reads per layer, none per
    # column (IN columns would show up as dozens)
    assert mode.syncs <= 2


@pytest.mark.slow
def test_host_reads_do_not_grow_with_the_columns():
    """A sweep over twice the columns reads back to the host exactly as often."""
    fmt = get_format("e4m3")
    counts = []
    for cols in (IN, 2 * IN):
        H = _hessian(cols)
        with fake_cuda() as mode:
            W = torch.randn(OUT, cols, device=CUDA)
            gptq_codes(W, H, torch.ones(OUT, 1, device=CUDA).expand(OUT, cols), fmt,
                       act_order=True, block=BLOCK)
        counts.append(mode.syncs)
    assert counts[0] == counts[1]


@pytest.mark.parametrize("calibrator", ["gptq", "gptq-mse", "gptq-hmse", "hmse", "mse", "max",
                                        "cast"])
@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_weight_calibrators_on_a_cuda_weight(calibrator, granularity):
    """Each weight calibrator's scale choice and rounding, as ``quantize_target`` runs them,
    on a CUDA weight with a CPU Hessian."""
    H = _hessian()
    fmt = get_format("e4m3")
    entry = weight_entry(calibrator)
    w_calib = entry.build()
    gran = weight_granularity(granularity, 16)
    with fake_cuda():
        W = torch.randn(OUT, IN, device=CUDA)
        scale = choose_scale(W, fmt, gran, w_calib, hessian=H)
        assert scale.device == CUDA
        if entry.rounding == "gptq":
            codes = gptq_codes(W, H, gran.expand(scale, W), fmt, block=BLOCK)
        else:
            codes = quantize_weight(W, scale, fmt, gran).codes
    assert codes.device == CUDA and tuple(codes.shape) == (OUT, IN)


def test_asymmetric_gptq_target_on_a_cuda_weight():
    """GPTAQ's ``W*`` from a CUDA weight and the collector's CPU ``H`` and ``C``."""
    H, C = _hessian(), _hessian() * 1.01
    with fake_cuda():
        target = asymmetric_target(torch.randn(OUT, IN, device=CUDA), H, C, 0.01)
    assert target.device == CUDA and target.dtype == torch.float64


def test_hessian_collector_observes_a_cuda_gemm():
    """The collector sums a CUDA layer's inputs into a CPU float64 Hessian."""
    layer = torch.nn.Linear(IN, OUT, bias=False)
    collector = HessianCollector({"layer": layer})
    with fake_cuda():
        layer.to(CUDA)
        with collector.observing():
            layer(torch.randn(3, 5, IN, device=CUDA))
        H = collector.hessian("layer")
    assert H.device.type == "cpu" and H.dtype == torch.float64 and tuple(H.shape) == (IN, IN)


RECIPES = {
    "gptq-token": dict(act_granularity="token", weight_calib="gptq"),  # sink-aware (a causal LM)
    "gptq-plain": dict(act_granularity="token", weight_calib="gptq", gptq_sink=0),
    # the CLI's default with --calib-data (weight_calib gptq; a Recipe without calib_data
    # would default to max and run no GPTQ at all)
    "gptq-static": dict(weight_calib="gptq"),
    "gptq-asym": dict(gptq_asym=True, act_granularity="token", weight_calib="gptq"),
    "mse": dict(act_calib="mse", weight_calib="mse"),
    "block-group": dict(weight_granularity="block", act_granularity="group",
                        weight_calib="max"),
    "rotate": dict(rotate="hadamard", weight_calib="max", act_granularity="token"),
}


@pytest.mark.slow
@pytest.mark.parametrize("fp8_cores", [True, False])
@pytest.mark.parametrize("name", list(RECIPES))
def test_recipes_quantize_a_cuda_model(monkeypatch, name, fp8_cores):
    """Each recipe on a tiny Llama on "cuda" (the default: sequential GPTQ): calibration
    forwards, statistics, Hessians, each group's sweep, the quantized layers' forwards that
    feed the next group (simulated on every GPU: no real-kernel plan is made while
    quantizing), then the quantized model's forward with real FP8 GEMMs (``fp8_cores``) or
    simulated ones."""
    if not fp8_cores and name != "gptq-token":
        pytest.skip("the simulated GEMMs are checked on one recipe")
    monkeypatch.setattr(quant_gemm, "_fp8_capable", lambda device: fp8_cores)
    plans = []
    real_plan = QuantGemm.scaled_mm_plan
    monkeypatch.setattr(QuantGemm, "scaled_mm_plan",
                        lambda self, device: plans.append(real_plan(self, device)) or plans[-1])
    model = tiny("llama")
    recipe = Recipe(format="e4m3", dtype="float32", **RECIPES[name])
    with fake_cuda():
        model.to(CUDA)
        batches = [{k: v.to(CUDA) for k, v in b.items()}
                   for b in token_batches(IDS[:2, :8], 2)]
        quantize_model(model, recipe, batches)
        assert not any(plans)  # quantizing never ran a real FP8 GEMM
        model(**batches[0])
    layers = [m for m in model.modules() if isinstance(m, QuantGemm)]
    assert layers and all(m.weight.device == CUDA and m.weight_scale.device == CUDA
                          for m in layers)
    assert any(plans) == (fp8_cores and recipe.act_granularity != "group")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gptq-token", "gptq-plain", "gptq-asym"])
def test_sequential_hessians_stay_on_the_gpu(monkeypatch, name):
    """Sequential GPTQ sums each group's Hessians (and cross terms) on the GPU its inputs are
    on: no per-batch copy of an ``in x in`` matrix to the host."""
    from fp8ptq.algorithms.gptq import sequential
    devices = set()
    original = sequential._group_hessians

    def spy(*args, **kwargs):
        collector = original(*args, **kwargs)
        devices.update(t.device.type for store in collector._stores() for t in store.values())
        return collector

    monkeypatch.setattr(sequential, "_group_hessians", spy)
    monkeypatch.setattr(quant_gemm, "_fp8_capable", lambda device: True)
    model = tiny("llama")
    with fake_cuda():
        model.to(CUDA)
        batches = [{k: v.to(CUDA) for k, v in b.items()}
                   for b in token_batches(IDS[:2, :8], 2)]
        quantize_model(model, Recipe(format="e4m3", dtype="float32", **RECIPES[name]), batches)
    assert devices == {"cuda"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("command", ["quantize", "eval", "sensitivity"])
def test_device_cuda_without_cuda_is_one_error_line(tmp_path, word_tokenizer, command):
    src, calib = saved_llama_with_calib(tmp_path, word_tokenizer)
    out = tmp_path / "out"
    args = {"quantize": ["-o", out, "--calib-data", calib],
            "eval": ["--tasks", "wikitext", "--data", f"wikitext={calib}", "--calib-data", calib],
            "sensitivity": ["--calib-data", calib, "--eval-data", calib]}[command]
    res = invoke([command, src, *args, "--device", "cuda"])
    assert res.exit_code != 0
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert errors == ["error: --device cuda requested but no CUDA device is available"]
    assert "Traceback" not in res.output
    assert not out.exists()


def test_the_fake_mode_leaves_fake_tensors_as_it_found_them():
    """torch re-enters the active mode from inside its dispatch; the patched host reads must
    still come off FakeTensor at the end (torch.compile traces with FakeTensors of its own)."""
    from torch._subclasses.fake_tensor import FakeTensor
    before = dict(FakeTensor.__dict__)
    fmt = get_format("e4m3")
    with fake_cuda():
        w = torch.randn(OUT, IN, device=CUDA)
        s = (w.abs().amax(1, keepdim=True) / fmt.max).expand_as(w)
        gptq_codes(w, _hessian(), s, fmt, act_order=True, block=BLOCK)
    assert dict(FakeTensor.__dict__) == before
