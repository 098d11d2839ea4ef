"""Data-parallel calibration under torchrun (2 gloo processes on CPU), in memory and in sequential
mode (``--sequential``: every rank streams the same block, statistics reduced per block): the
checkpoint is the single-process one bit for bit, rank 0 alone writes, and a failure on one rank
ends every rank with one error line and no output."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tiny_models import STATIC, tiny

pytestmark = pytest.mark.slow  # every test here runs over ~5 s (see pyproject.toml)

HERE = Path(__file__).parent
DOCS = ["the quick brown fox jumps over the lazy dog", "a small model reads a few words of text",
        "hello world and hello again"]
CALIB = ["--num-samples", "8", "--seq-len", "8", "--batch-size", "2", *STATIC]  # pinned
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # torchrun's default per worker; same kernels


@pytest.fixture(scope="module")
def models(tmp_path_factory, word_tokenizer):
    root = tmp_path_factory.mktemp("dist")
    tiny("llama").save_pretrained(root / "llama")
    word_tokenizer.save_pretrained(root / "llama")
    tiny("mixtral").save_pretrained(root / "mixtral")
    word_tokenizer.save_pretrained(root / "mixtral")
    (root / "calib.txt").write_text("\n".join(DOCS * 10) + "\n")
    return root


def fp8ptq_cmd():
    exe = shutil.which("fp8ptq", path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", "fp8ptq.cli"]


def run(args, nproc=None, launcher=None, timeout=300, fault=None):
    if nproc:
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                  f"--nproc-per-node={nproc}"]
        cmd = launch + (launcher or ["--no-python", *fp8ptq_cmd()]) + args
    else:
        cmd = fp8ptq_cmd() + args
    env = ENV if fault is None else {**ENV, "FP8PTQ_TEST_FAULT": fault}  # tests/dist_fault.py
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def tensors(path) -> dict[str, torch.Tensor]:
    out = load_file(path / "model.safetensors")
    return {k: v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v
            for k, v in out.items()}


@pytest.mark.parametrize("model,extra", [("llama", ["--act-calib", "best"]),
                                         ("mixtral", ["--routed-experts-only",
                                                      "--weight-granularity", "tensor"])])
def test_two_ranks_write_the_single_process_checkpoint_bit_for_bit(models, tmp_path, model,
                                                                   extra):
    args = ["quantize", str(models / model), "--calib-data", str(models / "calib.txt"), *CALIB,
            *extra]
    one = run([*args, "-o", str(tmp_path / "one")])
    assert one.returncode == 0, one.stderr
    two = run([*args, "-o", str(tmp_path / "two"), "--json"], nproc=2)
    assert two.returncode == 0, two.stderr
    a, b = tensors(tmp_path / "one"), tensors(tmp_path / "two")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    report = json.loads(two.stdout)  # rank 0 alone printed its report
    assert report["ranks"] == 2
    meta = [json.loads((tmp_path / d / "fp8ptq.json").read_text()) for d in ("one", "two")]
    assert meta[0]["modules"] == meta[1]["modules"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]  # no stray folders


def test_python_m_torch_distributed_run_works_too(models, tmp_path):
    res = run(["quantize", str(models / "llama"), "-o", str(tmp_path / "out"), "--calib-data",
               str(models / "calib.txt"), *CALIB], nproc=2, launcher=["-m", "fp8ptq.cli"])
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "out" / "fp8ptq.json").is_file()


def test_a_failure_on_one_rank_ends_every_rank_with_one_error_line(models, tmp_path):
    res = run(["quantize", str(models / "llama"), "-o", str(tmp_path / "out"), "--calib-data",
               str(models / "calib.txt"), *CALIB], nproc=2,
              launcher=[str(HERE / "dist_fault.py")])
    assert res.returncode != 0
    errors = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.startswith("error:")]
    assert errors == ["error: rank 1 failed: injected failure on this rank"]
    assert not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("model,extra", [("llama", ["--act-calib", "best"]),
                                         ("mixtral", ["--weight-granularity", "tensor"])])
def test_sequential_two_ranks_write_the_one_rank_checkpoint_bit_for_bit(models, tmp_path, model,
                                                                        extra):
    """Every rank streams the same blocks, calibrates on its share, and the statistics are
    reduced per block: tensors and fp8ptq.json equal the one-process sequential run's. The
    2-rank run goes through tests/dist_fault.py's spy, which fails any rank but 0 that opens a
    checkpoint writer or moves a folder into place: rank 0 alone writes."""
    args = ["quantize", str(models / model), "--calib-data", str(models / "calib.txt"), *CALIB,
            "--sequential", *extra]
    one = run([*args, "-o", str(tmp_path / "one")])
    assert one.returncode == 0, one.stderr
    two = run([*args, "-o", str(tmp_path / "two"), "--json"], nproc=2,
              launcher=[str(HERE / "dist_fault.py")], fault="spy")
    assert two.returncode == 0, two.stderr
    report = json.loads(two.stdout)
    assert (report["ranks"], report["path"]) == (2, "sequential")
    a, b = tensors(tmp_path / "one"), tensors(tmp_path / "two")
    assert a.keys() == b.keys()
    assert any(k.endswith("weight_scale") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    meta = [json.loads((tmp_path / d / "fp8ptq.json").read_text()) for d in ("one", "two")]
    for m in meta:
        assert m["extras"]["sequential"]["blocks"] == 2
        m.pop("created"), m.pop("command")  # the time and the -o argument
    assert meta[0] == meta[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]  # no scratch left


@pytest.mark.parametrize("fault,line", [
    ("propagate", "error: rank 1 failed: injected failure on this rank"),
    ("write", "error: injected write failure")])
def test_sequential_failure_on_one_rank_after_a_block_was_written_leaves_nothing(
        models, tmp_path, fault, line):
    """Rank 1 failing while it carries block 1's inputs on (a step with no collective of its
    own), or rank 0 failing to write block 1, both after rank 0 wrote block 0 into its
    temporary folder: every rank stops with one error line, and no output, temporary folder or
    scratch folder is left."""
    res = run(["quantize", str(models / "llama"), "-o", str(tmp_path / "out"), "--calib-data",
               str(models / "calib.txt"), *CALIB, "--sequential"], nproc=2,
              launcher=[str(HERE / "dist_fault.py")], fault=fault)
    assert res.returncode != 0
    errors = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.startswith("error:")]
    assert errors == [line]
    assert list(tmp_path.iterdir()) == []
