"""Data-parallel calibration of SmolLM2-135M: 1 process vs N torchrun ranks (gloo on CPU).

Same model and calibration windows; wall time, the calibrate step, and whether the checkpoint
tensors are identical bit for bit.

    python benchmarks/bench_distributed.py [--model GGUF|DIR] [--nproc 2] [--num-samples 32]
        [--seq-len 512] [--sequential] [--json PATH]

Every rank holds a full copy of the model and runs its share of the batches; the statistics are
all-reduced once per pass. With ``--sequential`` (MODEL a safetensors folder) every rank streams
the same blocks and the statistics are reduced once per block. On a 2-core CPU two ranks compete
for the same cores (each rank runs with one thread, like torchrun's default), so expect little
speed-up: the point is correctness and the cost of the reduction; on several GPUs or nodes the
calibrate step divides by N.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import CALIB, SMOLLM2, emit
from safetensors.torch import load_file

FP8PTQ = [sys.executable, "-m", "fp8ptq.cli"]


def run(cmd: list[str], env: dict) -> tuple[float, dict]:
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{res.stderr[-2000:]}")
    return wall, json.loads(res.stdout)


def tensors(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    out = {}
    for f in files:
        out.update(load_file(f))
    return {k: v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v
            for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=SMOLLM2)
    ap.add_argument("--calib-data", default=CALIB)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--num-samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--format", default="e4m3")
    ap.add_argument("--sequential", action="store_true",
                    help="block by block (MODEL: a local safetensors folder)")
    ap.add_argument("--json")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fp8ptq-bench-dist-"))
    common = ["quantize", args.model, "--format", args.format, "--calib-data", args.calib_data,
              "--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len), "--json",
              *(["--sequential"] if args.sequential else [])]
    step = "calibrate+quantize" if args.sequential else "calibrate"  # sequential interleaves
    rows = []
    try:
        for threads in (os.cpu_count() or 1, 1):
            env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
            wall, rep = run([*FP8PTQ, *common, "-o", str(tmp / f"one-{threads}")], env)
            rows.append({"run": f"1 process, {threads} thread(s)", "wall s": wall,
                         f"{step} s": rep["seconds"].get(step),
                         "peak RSS MiB (rank 0)": rep["peak_rss_mb"]})
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                  f"--nproc-per-node={args.nproc}", "-m", "fp8ptq.cli"]
        wall, rep = run([*launch, *common, "-o", str(tmp / "ranks")], env)
        a, b = tensors(tmp / "one-1"), tensors(tmp / "ranks")
        same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        rows.append({"run": f"{args.nproc} torchrun ranks, 1 thread each", "wall s": wall,
                     f"{step} s": rep["seconds"].get(step),
                     "peak RSS MiB (rank 0)": rep["peak_rss_mb"]})
        mode = ", sequential" if args.sequential else ""
        emit(f"data-parallel calibration ({args.num_samples} x {args.seq_len} tokens, "
             f"{args.format}{mode}); checkpoint identical to 1 process / 1 thread: {same}", rows,
             args.json, {"identical": same})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
