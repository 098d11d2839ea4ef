"""GPTQ's one-kernel block sweep (``fp8ptq.algorithms.gptq.fused``) on a CPU: the Triton kernel
through Triton's interpreter (``TRITON_INTERPRET=1``) against the torch column loop it replaces,
bit for bit, for every format it takes and every scale layout; and, under a fake CUDA device,
the device of everything the kernel would be handed. The GPU tier runs the compiled kernel.

Triton reads ``TRITON_INTERPRET`` when it is imported, so the interpreter's cases run in one
child process (``fused_cases.py``) whose results the tests below read, one assertion each."""

import importlib.util
import json
import os
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from fake_cuda import CUDA, fake_cuda
from fp8ptq.algorithms.gptq import fused, sweep
from fp8ptq.formats import get_format
from fused_cases import FORMATS, LAYOUTS, PRECISIONS, problem, scales

_no_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="Triton runs the fused sweep (its interpreter here)")


def needs_triton(test):
    """Triton's interpreter runs it; ``slow``: the cases take ~30 s (one child process), the
    full suite's time, not the quick tier's."""
    return pytest.mark.slow(_no_triton(test))


@pytest.fixture(scope="module")
def cases():
    """Every case of ``fused_cases.py`` run once under the interpreter: name -> result."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "FP8PTQ_GPTQ_TRITON": "1"}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("fused_cases.py"))],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@needs_triton
@pytest.mark.parametrize("name", FORMATS)
def test_kernel_gives_the_torch_loops_codes_for_every_format(cases, name):
    case = cases[f"format/{name}"]
    assert case["fused"], "the sweep did not take the kernel"
    assert case["differ"] == 0
    assert case["distinct_codes"] > 20  # a real spread of codes, not a degenerate case


@needs_triton
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("act_order", [False, True])
def test_kernel_gives_the_torch_loops_codes_for_every_scale_layout(cases, layout, act_order):
    case = cases[f"layout/{layout}/{act_order}"]
    assert case["fused"] and case["differ"] == 0


@needs_triton
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", ["e4m3", "e5m2", "int8"])
def test_float64_kernel_gives_the_cpu_float64_loops_codes(cases, precision, name):
    """The float64 tile (``LOOP64``; ``gptq_sweep_dtype`` float64, and mixed's float32
    storage) against the CPU's float64 loop: the same codes but at rounding boundaries, where
    the CPU fuses part of the rank-one update's multiply-adds and the kernel rounds each."""
    case = cases[f"dtype/{precision}/{name}"]
    assert case["fused"], "the sweep did not take the kernel"
    assert case["differ"] <= case["codes"] // 1000


@needs_triton
def test_kernel_codes_carry_the_error_feedback(cases):
    """Not round-to-nearest in disguise: the kernel's codes are GPTQ's, and lower the layer's
    output error (tr((W - Q) H (W - Q)^T)) well below plain rounding with the same scales."""
    case = cases["feedback"]
    assert case["differ_from_nearest"] > 0
    assert case["error"] < 0.9 * case["nearest_error"]


def test_what_the_kernel_does_not_take(monkeypatch):
    fused._kernel.cache_clear()
    monkeypatch.setattr(fused, "_kernel", lambda: object())  # Triton "importable"
    W = torch.randn(8, 16)
    e4m3 = get_format("e4m3")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not fused.wanted(e4m3, {}, W)  # a CPU weight, no interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fused.wanted(e4m3, {}, W)
    assert not fused.wanted(get_format("hif8"), {}, W)  # rounds half away from zero
    assert not fused.wanted(e4m3, {"rounding": "stochastic"}, W)
    assert sweep.fused_block(e4m3, {}, W, 512) is None  # the tile would not fit in registers
    assert sweep.fused_block(e4m3, {}, W, 256) is not None
    assert sweep.fused_block(e4m3, {}, W, 256, torch.float64) is None  # twice the registers
    assert sweep.fused_block(e4m3, {}, W.double(), 128) is not None
    assert sweep.fused_block(e4m3, {}, W.half(), 128) is None
    monkeypatch.setenv("FP8PTQ_GPTQ_TRITON", "0")
    assert not fused.wanted(e4m3, {}, W)


def test_a_fake_cuda_weight_goes_the_torch_way_unless_the_kernel_is_faked(monkeypatch):
    """Under a fake CUDA device (no memory to hand to a kernel) the sweep runs the torch loop;
    with the launch replaced by a check, every tensor the kernel would get is on the weight's
    device, and the sweep still returns its codes there."""
    fmt = get_format("e4m3")
    launches = []

    class Launcher:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                devices = {a.device for a in args if torch.is_tensor(a)}
                launches.append((grid, devices, kwargs["WIDTH"]))
            return launch

    W, H = problem(out_features=40, in_features=136)
    with fake_cuda():
        Wc = W.to(CUDA)
        S = scales(Wc, fmt, "channel")
        assert sweep.fused_block(fmt, {}, Wc, 128) is None  # a fake tensor: not launchable
        monkeypatch.setattr(fused, "launchable", lambda t: True)
        monkeypatch.setattr(fused, "_kernel", lambda: Launcher())
        entered = []  # the device context each launch runs in (no CUDA context on this build)
        monkeypatch.setattr(fused, "_on", lambda device: entered.append(device) or nullcontext())
        codes = sweep.gptq_codes(Wc, H, S, fmt, act_order=True)
        assert codes.device == Wc.device and codes.shape == W.shape
    assert [(g, w) for g, _, w in launches] == [((2,), 128), ((2,), 8)]  # 136 = 128 + 8 columns
    assert all(d == {Wc.device} for _, d, _ in launches)
    assert entered == [Wc.device] * 2  # launched on the weight's GPU, whichever is current


@pytest.mark.parametrize("storage", [torch.float32, torch.float64])
def test_a_float64_loop_launches_the_float64_tile_on_the_weights_device(monkeypatch, storage):
    """A float64 column loop on a (fake) GPU, float32 storage (mixed) or float64: the kernel
    gets ``LOOP64`` and the float64 tile's row blocks, float64 scales and errors, the storage
    dtype's weight and factor blocks, all on the weight's device."""
    fmt = get_format("e4m3")
    launches = []

    class Launcher:
        def __getitem__(self, grid):
            def launch(w, u, s, v, e, *args, **kwargs):
                launches.append((grid, kwargs["LOOP64"], kwargs["BLOCK_R"], w.dtype, u.dtype,
                                 s.dtype, e.dtype, {w.device, u.device, s.device, e.device}))
            return launch

    W, H = problem(out_features=40, in_features=136)
    with fake_cuda():
        Wc = W.to(CUDA)
        S = scales(Wc, fmt, "channel")
        monkeypatch.setattr(fused, "launchable", lambda t: True)
        monkeypatch.setattr(fused, "_kernel", lambda: Launcher())
        monkeypatch.setattr(fused, "_on", lambda device: nullcontext())
        sweep.gptq_codes(Wc, H, S, fmt, act_order=True,
                         sweep_dtype=sweep.Precision(storage, torch.float64))
    f64 = torch.float64
    assert [(g, loop64, rows) for g, loop64, rows, *_ in launches] == [((3,), True, 16)] * 2
    assert all(d[3:6] == (storage, storage, f64) and d[6] == f64 for d in launches)
    assert all(d[7] == {Wc.device} for d in launches)


def test_a_kernel_that_cannot_be_built_leaves_the_torch_loops_codes(monkeypatch):
    """A GPU whose Triton cannot build the kernel: one warning, the torch loop's codes, and
    no second try in the process."""
    fmt = get_format("e4m3")
    W, H = problem(out_features=16, in_features=136)
    S = scales(W, fmt, "channel")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    want = sweep.gptq_codes(W, H, S, fmt, act_order=True)
    tries = []

    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                tries.append(grid)
                raise RuntimeError("PTX .version 9.9 does not support .target sm_00")
            return launch

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # lets a CPU weight ask for the kernel
    monkeypatch.setattr(fused, "_kernel", lambda: Broken())
    monkeypatch.setattr(fused, "_FAILED", [])
    with pytest.warns(RuntimeWarning, match="torch column loop"):
        got = sweep.gptq_codes(W, H, S, fmt, act_order=True)
    assert torch.equal(got, want)
    assert len(tries) == 1 and not fused.wanted(fmt, {}, W)
