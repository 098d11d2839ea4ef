"""Wall time and peak RSS of ``quantize`` on SmolLM2-135M, by step (load / calibrate / write).

Also the cost of the statistics pass against one plain forward pass over the same tokens.

    python benchmarks/bench_quantize.py [--model GGUF|DIR] [--num-samples 128] [--seq-len 512]
        [--format e4m3] [--act-calib max] [--json PATH]

Default: SmolLM2-135M (offline asset), 128 x 512 calibration tokens from calib/wiki-paragraphs.txt,
e4m3 with per-channel weights and per-tensor activations, bf16. The reference is the faster of two
plain forward passes over the calibration batches; "calibrate" is the pipeline's statistics pass
(one forward with observers on every GEMM input).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile

import torch
from _common import CALIB, SMOLLM2, emit, peak_rss_mb, timed

from fp8ptq.checkpoint import save_quantized
from fp8ptq.config.recipe import Recipe
from fp8ptq.execution import job
from fp8ptq.execution.in_memory import run_batch, token_batches


def plain_forward(model, batches) -> float:
    seconds: dict = {}
    with timed(seconds, "forward"), torch.inference_mode():
        for batch in batches:
            run_batch(model, batch)
    return seconds["forward"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=SMOLLM2)
    ap.add_argument("--calib-data", default=CALIB)
    ap.add_argument("--num-samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--format", default="e4m3")
    ap.add_argument("--act-calib", default="max")
    ap.add_argument("--json")
    args = ap.parse_args()
    recipe = Recipe(format=args.format, act_calib=args.act_calib, calib_data=args.calib_data,
                    num_samples=args.num_samples, seq_len=args.seq_len)
    seconds: dict = {}
    with timed(seconds, "load"):
        loaded = job.load(args.model, recipe)
    rss = {"after load": peak_rss_mb()}
    with timed(seconds, "calibration data"):
        calib = job.calibration_set(loaded, recipe)
    batches = list(token_batches(calib.input_ids, recipe.batch_size))
    forward = min(plain_forward(loaded.model, batches) for _ in range(2))

    timings = job.JobTimings()
    with timed(seconds, "calibrate+quantize"):
        result = job.quantize_loaded(loaded, recipe, calib, timings=timings)
    rss["after quantize"] = peak_rss_mb()
    out = tempfile.mkdtemp(prefix="fp8ptq-bench-")
    try:
        with timed(seconds, "write"):
            sizes = save_quantized(result, recipe, f"{out}/ckpt", tokenizer=loaded.tokenizer,
                                   source={"model": args.model}, tool_version="bench")
    finally:
        shutil.rmtree(out, ignore_errors=True)
    rss["after write"] = peak_rss_mb()

    tokens = calib.input_ids.numel()
    rows = [{"stage": k, "seconds": v} for k, v in seconds.items()]
    rows += [{"stage": f"  pipeline: {k}", "seconds": v} for k, v in timings.seconds.items()]
    rows += [{"stage": "plain bf16 forward (reference)", "seconds": forward},
             {"stage": "calibrate / plain forward", "seconds": timings.seconds["calibrate"]
              / forward}]
    rows += [{"stage": f"peak RSS MiB {k}", "seconds": v} for k, v in rss.items()]
    emit(f"quantize {args.model.split('/')[-1]}: {args.format}, {args.num_samples} x "
         f"{args.seq_len} tokens ({tokens} tokens, {tokens / forward:.0f} tok/s plain)", rows,
         args.json, {"sizes": sizes, "threads": torch.get_num_threads(),
                     "ratio_calibrate_to_forward": timings.seconds["calibrate"] / forward,
                     "modules": len(result.modules)})


if __name__ == "__main__":
    main()
