"""The one-block GPU path, checked without a GPU: ``quantize_sequential(device="cuda")`` runs on
fake CUDA tensors (``tests/fake_cuda.py``), whose allocator count stands in for
``torch.cuda.memory_allocated``. The safetensors reads and the meta-device model are made
outside the fake mode (real host tensors, as on a GPU machine); everything the path moves to
"cuda" is fake there, so a block that stayed behind, a tensor made on the wrong device or a peak
beyond the prediction shows up as it would on a GPU."""

import gc
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from fake_cuda import fake_cuda
from fp8ptq.algorithms.gptq import experts as gptq_experts
from fp8ptq.config.plan import build_plan
from fp8ptq.config.recipe import Recipe
from fp8ptq.errors import UsageError
from fp8ptq.execution import strategy, streaming
from fp8ptq.execution.budget import Budget, gpu_need, parse_budget, sweep_bytes
from fp8ptq.formats import get_format
from fp8ptq.formats.weight_quant import half_layout
from fp8ptq.io import weight_map
from fp8ptq.io.weights import build_empty
from fp8ptq.model.blocks import find_blocks
from fp8ptq.model.forward import token_batches
from fp8ptq.nn.quant_experts import QuantExperts
from fp8ptq.nn.quant_gemm import simulated_gemms
from tiny_models import IDS, invoke, tiny

GPTQ = dict(format="e4m3", weight_calib="gptq", act_granularity="token")
# the calibration the runs below feed (``IDS[:4, :16]`` in batches of 2), which the
# prediction is sized by
TOKENS = dict(num_samples=4, seq_len=16, batch_size=2, **GPTQ)


class BlockWriter:
    """A checkpoint writer that keeps nothing: at each ``add_block`` it records which
    parameters of the model are on the GPU, and its ``watch`` hooks record the same at every
    block's forward (the model is the one the path built, handed to ``open_writer``)."""

    def __init__(self, mode):
        self.mode = mode
        self.blocks: list[str] = []
        self.strays: list[str] = []  # "while block X: parameter Y was on the GPU"
        self.model = None

    def open(self, model, _plan):
        self.model = model
        _, blocks = find_blocks(model)
        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda m, a, k, i=i: self._check(i), with_kwargs=True)
        return self

    def _check(self, index: int) -> None:
        prefix = f"{find_blocks(self.model)[0]}.{index}."
        self.strays += [f"block {index}: {n}" for n, p in self.model.named_parameters()
                        if p.device.type == "cuda" and not n.startswith(prefix)]

    def add_block(self, block, prefix, reports) -> None:
        self.blocks.append(prefix)
        self._check(int(prefix.rstrip(".").rpartition(".")[2]))

    def add_modules(self, *args, **kwargs) -> None:
        pass

    def add_tensors(self, *args, **kwargs) -> None:
        pass


@pytest.fixture
def host_reads(monkeypatch):
    """Checkpoint reads and meta builds as real host work inside the fake mode; the format's
    tables built before it (as a process's first quantize builds them); a GPU's capability
    for transformers' grouped expert GEMM."""
    for owner, name in ((weight_map.SourceMap, "realize"), (streaming, "build_empty")):
        real = getattr(owner, name)

        def outside(*args, _real=real, **kwargs):
            with unset_fake_temporarily():
                return _real(*args, **kwargs)
        monkeypatch.setattr(owner, name, outside)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    half_layout(get_format("e4m3"))


def saved(tmp_path: Path, arch: str, **config) -> Path:
    folder = tmp_path / arch
    tiny(arch, **config).save_pretrained(folder)
    return folder


def run_on_gpu(folder, recipe, activations_on="host"):
    """The path on fake CUDA: (result, loader, writer, mode, prediction)."""
    meta = build_empty(folder, getattr(torch, recipe.dtype))
    need = gpu_need(meta, recipe, build_plan(meta, recipe), activations_on == "device")
    batches = list(token_batches(IDS[:4, :16], 2))
    with fake_cuda() as mode:
        writer = BlockWriter(mode)
        with simulated_gemms():
            result, loader = streaming.quantize_sequential(
                folder, recipe, batches, device="cuda", open_writer=writer.open,
                activations_on=activations_on, replay_budget=need["replay"])
        del batches
        gc.collect()
    return result, loader, writer, mode, need


@pytest.mark.slow
@pytest.mark.parametrize("activations_on", ["host", "device"])
def test_one_llama_block_at_a_time_on_the_gpu(tmp_path, host_reads, activations_on):
    """Four blocks, the default recipe (sequential sink-aware GPTQ, dynamic inputs): while a
    block runs and when it is written, every parameter on the GPU is its own; the modules
    outside the blocks stay on the host; nothing is left on the GPU at the end; the peak is
    within the prediction."""
    folder = saved(tmp_path, "llama", num_hidden_layers=4)
    result, loader, writer, mode, need = run_on_gpu(folder, Recipe(dtype="float32", **TOKENS),
                                                    activations_on)
    assert writer.blocks == [f"model.layers.{i}." for i in range(4)]
    assert writer.strays == []
    assert loader.max_resident == 1
    assert all(p.device.type != "cuda" for p in writer.model.parameters())
    assert mode.gpu.bytes == 0  # every block freed, the activations dropped
    assert len(result.modules) == 4 * 7
    assert 0.5 * need["total"] <= mode.gpu.peak <= need["total"]
    assert result.extras["sequential"]["device"] == "cuda:0"


@pytest.mark.slow
def test_the_float_first_token_stream_runs_on_the_gpu_beside_the_block(tmp_path, host_reads):
    """``--gptq-sink-target float`` on the one-block path: the first tokens' float stream is
    captured on the host and carried through each block on the GPU (a device mismatch would
    raise here); every block aims at the float model, and nothing stays on the GPU."""
    folder = saved(tmp_path, "llama", num_hidden_layers=2)
    result, _, writer, mode, need = run_on_gpu(
        folder, Recipe(dtype="float32", gptq_sink_target="float", **TOKENS))
    assert writer.blocks == ["model.layers.0.", "model.layers.1."]
    aims = {b["gptq"]["sequential"]["aim"]["target"]
            for b in result.extras["blocks"].values()}
    assert aims == {"float"}
    assert mode.gpu.bytes == 0 and mode.gpu.peak <= need["total"]


@pytest.mark.slow
def test_activations_on_the_gpu_cost_what_the_prediction_says(tmp_path, host_reads):
    """Kept on the GPU, every batch's hidden states (inputs and outputs) add to the peak
    about what ``gpu_need`` counts for them."""
    folder = saved(tmp_path, "llama", num_hidden_layers=2)
    recipe = Recipe(dtype="float32", **TOKENS)
    peaks = {on: run_on_gpu(folder, recipe, on)[3].gpu.peak for on in ("host", "device")}
    meta = build_empty(folder, torch.float32)
    counted = gpu_need(meta, recipe, build_plan(meta, recipe), True)["activations"]
    assert counted > 0
    assert 0.5 * counted <= peaks["device"] - peaks["host"] <= 1.5 * counted


@pytest.mark.slow
def test_moe_experts_one_block_at_a_time_on_the_gpu(tmp_path, host_reads, monkeypatch):
    """A Qwen3-MoE-shaped model (eight fused experts a layer): every expert quantized, one
    block on the GPU at a time. (The quantized experts' own forward and expert GPTQ's routed
    rows read the routing back to the host, which fake tensors cannot: an output of the right
    shape and every row stand in.)"""
    monkeypatch.setattr(QuantExperts, "forward",
                        lambda self, hidden, *a, **k: torch.zeros_like(hidden))
    # expert GPTQ picks each expert's routed rows by a boolean mask: every row by index here
    monkeypatch.setattr(gptq_experts, "_rows_by_expert", lambda idx, num, _all: [
        (e, torch.arange(idx.shape[0], device=idx.device)) for e in range(num)])
    folder = saved(tmp_path, "qwen3_moe", num_hidden_layers=3)
    result, loader, writer, mode, need = run_on_gpu(folder, Recipe(dtype="bfloat16", **TOKENS))
    assert writer.strays == [] and loader.max_resident == 1
    assert len(writer.blocks) == 3 and mode.gpu.bytes == 0
    assert sorted(result.extras["experts"]) == [f"model.layers.{i}.mlp.experts"
                                               for i in range(3)]
    assert mode.gpu.peak <= need["total"]


@pytest.mark.slow
def test_a_hessian_too_wide_for_the_gpu_is_factored_on_the_host(tmp_path, host_reads,
                                                                monkeypatch):
    """With a factor limit below ``down_proj``'s 128 inputs, its sums go to the host after
    collection and are factored there; the narrower groups' stay on the GPU; every sweep and
    its codes are on the GPU; the prediction counts only the inverse factor for it."""
    from fp8ptq.algorithms.gptq import sweep
    seen = []
    real = sweep._inverse_cholesky

    def spy(H, *args, **kwargs):
        seen.append((H.shape[0], H.device.type))
        return real(H, *args, **kwargs)
    monkeypatch.setattr(sweep, "_inverse_cholesky", spy)
    folder = saved(tmp_path, "llama", num_hidden_layers=2)
    recipe = Recipe(dtype="float32", **TOKENS)
    batches = list(token_batches(IDS[:4, :16], 2))
    with fake_cuda():
        writer = BlockWriter(None)
        with simulated_gemms():
            result, _ = streaming.quantize_sequential(
                folder, recipe, batches, device="cuda", open_writer=writer.open,
                gpu_factor_limit=100)
    assert {d for k, d in seen if k == 128} == {"cpu"}
    assert {d for k, d in seen if k == 64} == {"cuda"}
    assert writer.strays == [] and len(result.modules) == 14
    meta = build_empty(folder, torch.float32)
    plan = build_plan(meta, recipe)
    on_gpu, on_host = (gpu_need(meta, recipe, plan, False, "cuda", 0, limit)["sweep"]
                       for limit in (None, 100))
    assert on_host < on_gpu


def test_hessians_and_their_factor_are_float32_on_a_gpu():
    """``auto``: the sums in float32 on a GPU (the factor follows the sums), float64 on the
    CPU."""
    from fp8ptq.algorithms.gptq.sweep import factor_dtype
    recipe = Recipe()
    assert recipe.gptq_hessian_dtype == "auto"
    assert recipe.hessian_dtype_on("cuda") == torch.float32
    assert recipe.hessian_dtype_on("cpu") == torch.float64
    assert Recipe(gptq_hessian_dtype="float64").hessian_dtype_on("cuda") == torch.float64
    assert factor_dtype(torch.eye(3)) == torch.float32
    assert factor_dtype(torch.eye(3, dtype=torch.float64)) == torch.float64
    assert factor_dtype(torch.eye(3, dtype=torch.bfloat16)) == torch.float64


def test_float32_factor_matches_float64_and_falls_back():
    """The float32 inverse factor agrees with the float64 one to float32 precision; a matrix
    float32 cannot factor at any dampening is factored in float64 instead of failing."""
    from fp8ptq.algorithms.gptq.sweep import _inverse_cholesky
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(0))
    H = x.T @ x
    u32 = _inverse_cholesky(H, 0.01, dtype=torch.float32)
    u64 = _inverse_cholesky(H.double(), 0.01)
    assert u32.dtype == torch.float32
    assert torch.allclose(u32.double(), u64, rtol=1e-3, atol=1e-5 * float(u64.abs().max()))
    bad = torch.full((4, 4), float("nan"))
    with pytest.raises(ValueError, match="not positive definite"):
        _inverse_cholesky(bad, 0.01, dtype=torch.float32)


def test_float32_sums_on_the_device_are_added_in_place():
    """On the inputs' device with float32 sums, each batch's ``x^T x`` is added by the GEMM
    itself: no ``in x in`` product buffer is kept beside the sums."""
    from fp8ptq.observe.hessian import HessianCollector
    layer = torch.nn.Linear(16, 4)
    c = HessianCollector({"l": layer}, on_device=True, dtype=torch.float32)
    xs = [torch.randn(5, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    with c.observing():
        for x in xs:
            layer(x)
        assert len(c._buffers) <= 1  # the first batch's product only (the sums' start)
    want = sum(x.T @ x for x in xs)
    assert torch.allclose(c.sums["l"], want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- budgets and the strategy


def test_parse_budget_forms():
    assert parse_budget(None, "cuda") == Budget()
    assert parse_budget("4GB", "cpu") == Budget(host=4 * 10**9)
    assert parse_budget("0=20GiB,cpu=64GiB", "cuda") == Budget(host=64 * 2**30, gpu=20 * 2**30)
    assert parse_budget("cuda:1=2GiB", "cuda:1") == Budget(gpu=2 * 2**30)
    with pytest.raises(UsageError, match="on the CPU"):
        parse_budget("0=20GiB", "cpu")
    with pytest.raises(UsageError, match="GPU 1"):
        parse_budget("0=20GiB", "cuda:1")
    with pytest.raises(UsageError, match="unknown device"):
        parse_budget("tpu=1GB", "cuda")


def test_the_gpu_budget_chooses_the_path(tmp_path):
    """A model whose in-memory estimate exceeds the GPU budget goes one block at a time on
    the GPU, with both peaks predicted; one that fits is loaded whole; ``--sequential`` forces
    the one-block path."""
    folder = saved(tmp_path, "llama", num_hidden_layers=4)
    recipe = Recipe(calib_data="x.txt", **GPTQ)
    small = strategy.choose(str(folder), recipe, device="cuda", gpu_budget=2 * 2**20)
    assert small.path == "sequential" and small.device == "cuda"
    assert "one block at a time on cuda" in small.reason
    facts = small.facts()
    assert facts["predicted_gpu_mb"] > 0 and facts["predicted_rss_mb"] > 0
    assert facts["compute_device"] == "cuda" and facts["activations_on"] in ("host", "device")
    assert small.sequential_options()["device"] == "cuda"
    roomy = strategy.choose(str(folder), recipe, device="cuda", gpu_budget=80 * 2**30)
    assert roomy.path == "in-memory" and "fit the GPU budget" in roomy.reason
    forced = strategy.choose(str(folder), recipe, device="cuda", gpu_budget=80 * 2**30,
                             sequential=True)
    assert forced.path == "sequential" and forced.reason.startswith("--sequential")
    # every batch's hidden states fit beside the block in a roomy budget: kept on the GPU
    assert forced.activations_on == "device"
    assert small.activations_on == "host"


def test_gpu_prediction_grows_with_the_widest_gemm(tmp_path):
    """The down_proj sweep dominates an 8B-like block: doubling the intermediate width adds
    at least its Hessian's growth (float32, ``in^2``) to the prediction."""
    recipe = Recipe(calib_data="x.txt", dtype="bfloat16", **GPTQ)
    totals = []
    for inter in (256, 512):
        folder = saved(tmp_path / str(inter), "llama", intermediate_size=inter)
        meta = build_empty(folder, torch.bfloat16)
        totals.append(gpu_need(meta, recipe, build_plan(meta, recipe), False)["total"])
    assert totals[1] - totals[0] >= 4 * (512 ** 2 - 256 ** 2)


def test_gpu_prediction_counts_the_sweeps_storage_dtype(tmp_path):
    """A float64 sweep holds its inverse factor and weight copy in float64: the sweep part
    grows by their second 4 bytes an element; mixed (float32 storage, float64 block loops)
    adds one 128-column block's float64 buffers only."""
    folder = saved(tmp_path, "llama", intermediate_size=512)
    meta = build_empty(folder, torch.bfloat16)
    sweeps = {}
    for name in ("float32", "mixed", "float64"):
        recipe = Recipe(calib_data="x.txt", dtype="bfloat16", gptq_sweep_dtype=name, **GPTQ)
        sweeps[name] = gpu_need(meta, recipe, build_plan(meta, recipe), False)["sweep"]
    out, k = 64, 512  # the tiny Llama's down_proj, the widest GEMM; float32 sums, sink-aware
    assert sweeps["float32"] == sweep_bytes(out, k, 4, 4, True, store=4, loop=4)
    assert sweeps["mixed"] == sweep_bytes(out, k, 4, 4, True, store=4, loop=8)
    assert sweeps["float64"] == sweep_bytes(out, k, 4, 4, True, store=8, loop=8)
    assert sweeps["float64"] > sweeps["float32"]
    # where the sweep phase is the peak (an 8B down_proj: 4,096 x 14,336), float64 adds the
    # factor's and the weight copy's second 4 bytes (and a block's wider buffers); mixed a
    # block's buffers alone: under 0.5% of the sweep
    out, k = 4096, 14336
    f32 = sweep_bytes(out, k, 4, 4, True)
    assert sweep_bytes(out, k, 4, 4, True, store=8, loop=8) - f32 \
        == 4 * k * k + 4 * out * k + 128 * out * 8
    assert 0 < sweep_bytes(out, k, 4, 4, True, store=4, loop=8) - f32 < 0.005 * f32


def test_out_of_memory_on_the_gpu_is_one_error_line(tmp_path, word_tokenizer, monkeypatch):
    """A CUDA out-of-memory error says what to do in one line, no traceback."""
    import fp8ptq.cli.quantize_cmd as cmd

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(cmd, "quantize", oom)
    src = saved(tmp_path, "llama")
    word_tokenizer.save_pretrained(src)
    res = invoke(["quantize", src, "-o", tmp_path / "out", "--act-format", "none"])
    errors = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert res.exit_code == 1 and len(errors) == 1
    assert "GPU ran out of memory" in errors[0] and "--max-memory 0=" in errors[0]
    assert "Traceback" not in res.output


def test_a_model_larger_than_the_gpu_is_not_loaded_whole_onto_it(tmp_path, monkeypatch):
    """``eval`` / an in-memory load with ``--device cuda`` of a model whose weights exceed what
    the GPU has free stops with one line naming the budget, before anything is loaded."""
    from fp8ptq.execution import job
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(job, "gpu_free_bytes", lambda device: 1000)
    monkeypatch.setattr(job, "load_model", lambda *a, **k: pytest.fail("loaded anyway"))
    folder = saved(tmp_path, "llama")
    with pytest.raises(UsageError, match=r"more than the GPU budget 0\.00 GB"):
        job.load(str(folder), Recipe(), device="cuda")
    monkeypatch.setattr(job, "gpu_free_bytes", lambda device: 80 * 2**30)
    monkeypatch.setattr(job, "load_model", lambda *a, **k: "loaded")
    assert job.load(str(folder), Recipe(), device="cuda") == "loaded"


def test_the_report_prints_predicted_and_measured_peaks():
    """The quantize report's ``memory:`` line: each predicted peak beside the measured one."""
    from fp8ptq.cli.quantize_report import memory_line
    line = memory_line({"predicted_gpu_mb": 4300.4, "peak_gpu_mb": 3990.2,
                        "predicted_rss_mb": 2100.0, "peak_rss_mb": 1800.7})
    assert line == ("memory: GPU 3990 MiB measured / 4300 predicted, "
                    "host 1801 MiB measured / 2100 predicted")
    assert memory_line({"predicted_gpu_mb": 10.0}) == "memory: GPU - MiB measured / 10 predicted"
