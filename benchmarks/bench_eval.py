"""Wall time of simulated-FP8 eval vs bf16 eval: SmolLM2-135M, the same WikiText-2 tokens.

    python benchmarks/bench_eval.py [--model GGUF|DIR] [--formats e4m3,int8] [--limit 1]
        [--repeat 2] [--json PATH]

Default: SmolLM2-135M, lm-eval WikiText perplexity on the first ``--limit`` articles of
WikiText-2 test, bf16; each quantized variant is calibrated on 32 x 512 tokens of
calib/wiki-paragraphs.txt (calibration time is not part of the eval time). Each eval runs
``--repeat`` times and the fastest counts. Target: at most 1.15x the bf16 eval on CPU.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from _common import CALIB, SMOLLM2, WIKITEXT, emit

from fp8ptq.config.recipe import Recipe
from fp8ptq.evals import run_tasks
from fp8ptq.execution import job


def eval_seconds(model, tokenizer, args) -> tuple[float, dict]:
    best, metrics = float("inf"), {}
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        metrics = run_tasks(model, tokenizer, ["wikitext"], data={"wikitext": args.data},
                            limit=args.limit, batch_size=args.batch_size).metrics
        best = min(best, time.perf_counter() - t0)
    return best, metrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=SMOLLM2)
    ap.add_argument("--data", default=WIKITEXT)
    ap.add_argument("--formats", default="e4m3,int8")
    ap.add_argument("--act-granularity", default="tensor")
    ap.add_argument("--limit", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    base_recipe = Recipe(calib_data=CALIB, num_samples=32, act_granularity=args.act_granularity)
    loaded = job.load(args.model, base_recipe)
    calib = job.calibration_set(loaded, base_recipe)
    pristine = copy.deepcopy(loaded.model)
    ref, metrics = eval_seconds(loaded.model, loaded.tokenizer, args)
    rows = [{"variant": f"baseline ({base_recipe.dtype})", "eval s": ref, "x baseline": 1.0,
             **metrics}]
    for fmt in args.formats.split(","):
        loaded.model = copy.deepcopy(pristine)
        job.quantize_loaded(loaded, base_recipe.merged(format=fmt), calib)
        seconds, metrics = eval_seconds(loaded.model, loaded.tokenizer, args)
        rows.append({"variant": fmt, "eval s": seconds, "x baseline": seconds / ref, **metrics})
    emit(f"eval wall time, WikiText-2 test first {args.limit} article(s), "
         f"{torch.get_num_threads()} threads", rows, args.json,
         {"limit": args.limit, "act_granularity": args.act_granularity})


if __name__ == "__main__":
    main()
