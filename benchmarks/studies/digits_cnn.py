"""Accuracy of a digits CNN with BatchNorm, fp32 vs FP8 formats (Sun et al. 2019 Table 1).

Trans-precision inference of a small CNN (Sun et al. 2019 sec 3 / Table 1 analogue): accuracy
of a MobileNet-style CNN trained on scikit-learn's digits, fp32 vs quantized, per format and
scales.

    python benchmarks/studies/digits_cnn.py [--seeds 0,1,2]
        [--formats e4m3,hfp8,e5m2,e2m3fn,e4m0fn] [--calib-images 512] [--json PATH]

Scales: ``cast`` = direct cast, scale 1 (no calibration: Sun et al.'s trans-precision inference);
``max`` = calibrated max scales (per-channel weights, per-tensor activations). Variants:
``direct``; ``+BN`` BatchNorm statistics re-tuned with quantization active (--bn-retune);
``+DW`` depthwise convolutions kept in high precision (--keep-depthwise); ``+BN+DW`` both;
``+FL`` first and last GEMM kept (--keep-first-last). Each cell is the mean over the training
seeds (a model trained per seed, its own 80/20 split); ``err`` is the relative output error
E||Z - Z_fp32||^2 / E||Z_fp32||^2 of the logits. Calibration/re-tuning uses the first
``--calib-images`` training images.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common

from _common import emit  # noqa: E402

from fp8ptq.config.recipe import Recipe  # noqa: E402
from fp8ptq.evals.vision import quantize_and_score  # noqa: E402
from fp8ptq.vision import (
    accuracy,
    image_batches,
    load_digits_data,
    train_digits_cnn,
)

VARIANTS = {"direct": {}, "+BN": {"bn_retune": True}, "+DW": {"keep_depthwise": True},
            "+BN+DW": {"bn_retune": True, "keep_depthwise": True},
            "+FL": {"keep_first_last": True}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2", help="training seeds, comma-separated")
    ap.add_argument("--formats", default="e4m3,hfp8,e5m2,e2m3fn,e4m0fn")
    ap.add_argument("--scales", default="cast,max")
    ap.add_argument("--calib-images", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (tiny CNN: 1 is best)")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")]
    formats, scales = args.formats.split(","), args.scales.split(",")

    runs: list[dict] = []  # one per seed x format x scales x variant
    fp32, train_s = {}, {}
    for seed in seeds:
        t0 = time.perf_counter()
        model = train_digits_cnn(epochs=args.epochs, seed=seed)
        train_s[seed] = time.perf_counter() - t0
        train_x, _ = load_digits_data("train", seed)
        test_x, test_y = load_digits_data("test", seed)
        calib = image_batches(train_x[:args.calib_images], 128)
        fp32[seed] = accuracy(model, test_x, test_y)
        for fmt in formats:
            for scale in scales:
                for variant, options in VARIANTS.items():
                    recipe = Recipe(format=fmt, act_calib=scale, weight_calib=scale,
                                    dtype="float32", **options)
                    acc, err, _ = quantize_and_score(model, recipe, calib, test_x, test_y)
                    runs.append({"seed": seed, "format": fmt, "scales": scale,
                                 "variant": variant, "accuracy": acc, "output_error": err})
        print(f"seed {seed}: trained in {train_s[seed]:.1f}s, fp32 accuracy {fp32[seed]:.4f}",
              flush=True)

    rows = [{"format": "fp32", "scales": "-", "acc direct": statistics.mean(fp32.values())}]
    for fmt in formats:
        for scale in scales:
            row = {"format": fmt, "scales": scale}
            cells = {v: [r for r in runs if (r["format"], r["scales"], r["variant"]) ==
                         (fmt, scale, v)] for v in VARIANTS}
            row.update({f"acc {v}": statistics.mean(r["accuracy"] for r in rs)
                        for v, rs in cells.items()})
            row.update({f"err {v}": statistics.mean(r["output_error"] for r in rs)
                        for v, rs in cells.items()})
            rows.append(row)
    emit(f"digits CNN (TinyMobileNet), accuracy and output error, mean of seeds {args.seeds}",
         rows, args.json, extra={"runs": runs, "fp32": fp32, "train_seconds": train_s,
                                 "calib_images": args.calib_images, "epochs": args.epochs})


if __name__ == "__main__":
    main()
