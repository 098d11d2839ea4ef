"""The one-block GPU path's predictions at the large shapes docs/big-models.md quotes
(``benchmarks/gpu_prediction.py``, meta-device models: nothing is allocated)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import gpu_prediction  # noqa: E402

GIB = 2**30


def test_an_8b_block_fits_a_small_gpu_and_a_70b_wide_one_factors_down_proj_on_the_host():
    h, i, heads, kv = gpu_prediction.SHAPES["8B-shaped (Llama-3-8B's block)"]
    parts, limit = gpu_prediction.predict(h, i, heads, kv, 6, 128, 512)
    assert limit is None and 3.5 * GIB < parts["total"] < 6 * GIB
    # the widest GEMM (down_proj, 14,336 inputs) drives the sweep, the largest part
    assert parts["sweep"] == max(v for k, v in parts.items() if k != "total")
    h, i, heads, kv = gpu_prediction.SHAPES["70B-wide (Llama-3-70B's block)"]
    whole, none = gpu_prediction.predict(h, i, heads, kv, 0, 128, 512)
    capped, limit = gpu_prediction.predict(h, i, heads, kv, 10, 128, 512)
    assert none is None and whole["total"] > 10 * GIB
    # only down_proj (28,672 inputs) goes to the host; the 8,192-input GEMMs stay
    assert h <= limit < i
    assert capped["sweep"] < whole["sweep"] and capped["total"] <= 10 * GIB


def test_the_script_prints_one_row_per_shape_and_cap(capsys):
    gpu_prediction.main(["--caps", "0,10", "--num-samples", "16", "--seq-len", "128"])
    rows = [r for r in capsys.readouterr().out.splitlines()
            if r.startswith("| ") and not r.startswith("| shape")]
    assert len(rows) == 4 and all(r.count("|") == 10 for r in rows)
    assert [r.split(" | ")[1] for r in rows] == ["none", "10 GiB"] * 2
