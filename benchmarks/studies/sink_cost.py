"""Sink-aware against plain sequential GPTQ on the first N blocks of a causal LM, interleaved in
one process: CPU and wall seconds of calibrate + quantize, the process's resident memory, and a
cProfile of each run's GPTQ functions.

    python benchmarks/studies/sink_cost.py MODEL [--blocks 4] [--reps 1] [--num-samples 32]
        [--out out/sink-cost] [--assets ../shared/assets]

The default recipe (e4m3, channel weights, dynamic per-token activations, sequential act-order
GPTQ, document windows, bfloat16) with ``--gptq-sink 1`` and ``--gptq-sink 0`` on copies of the
same truncated model and the same windows, in alternating order per repetition, so that both
sides see the same machine load (CPU seconds are the steadier figure on a shared machine).
Writes ``--out/report.json``: per run the seconds, the RSS before and after, and the cumulative
seconds of the sink's own functions (``SinkCollector``'s ``aim``, ``hessian``,
``_accumulate``) beside the column sweeps' (``gptq_codes``).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import json
import platform
import pstats
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from fp8ptq.config.recipe import Recipe  # noqa: E402
from fp8ptq.execution import job  # noqa: E402
from fp8ptq.io.data import build_calibration_set, load_texts  # noqa: E402
from fp8ptq.runtime.usage import bound_heap  # noqa: E402

WATCHED = ("aim", "hessian", "_accumulate", "_sink_update", "_rows", "gptq_codes",
           "_group_hessians", "run_block", "damped_cholesky", "quantize_target")


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def truncate(model, blocks: int) -> None:
    """Keep the first ``blocks`` decoder layers (and their per-layer attention kinds)."""
    model.model.layers = torch.nn.ModuleList(list(model.model.layers)[:blocks])
    model.config.num_hidden_layers = blocks
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:blocks]


def profiled_seconds(prof: cProfile.Profile) -> dict[str, float]:
    """Cumulative seconds per watched function name (summed over same-named functions)."""
    out: dict[str, float] = {}
    for (path, _line, name), (_cc, _nc, _tt, ct, _callers) in pstats.Stats(prof).stats.items():
        if name in WATCHED and ("fp8ptq" in path or "calibrators" in path):
            key = f"{Path(path).stem}.{name}"
            out[key] = round(out.get(key, 0.0) + ct, 2)
    # the sink's own work: its target, and its first rows beside the plain sums it extends
    out["sink.own"] = round(out.get("sink.aim", 0.0) + out.get("sink._accumulate", 0.0)
                            - (out.get("hessian._accumulate", 0.0)
                               if "sink._accumulate" in out else 0.0), 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--num-samples", type=int, default=32)
    ap.add_argument("--plain-first", action="store_true",
                    help="each even repetition runs plain GPTQ first (default: sink-aware)")
    ap.add_argument("--out", default="out/sink-cost")
    ap.add_argument("--assets", default=str(ROOT.parent / "shared" / "assets"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    bound_heap()  # as the fp8ptq command runs

    def recipe(sink: float) -> Recipe:
        return Recipe().merged(format="e4m3", num_samples=args.num_samples, seed=0,
                               dtype="bfloat16", gptq_sink=sink,
                               calib_data=str(Path(args.assets) / "calib" / "wiki-paragraphs.txt"))

    loaded = job.load(args.model, recipe(1.0))
    truncate(loaded.model, args.blocks)
    texts = load_texts(str(Path(args.assets) / "calib" / "wiki-paragraphs.txt"))
    calib = build_calibration_set(texts, loaded.tokenizer, num_samples=args.num_samples,
                                  seq_len=512, seed=0, windows="documents")
    base = copy.deepcopy(loaded.model)
    runs = []
    for rep in range(args.reps):
        for sink in ((1.0, 0.0) if (rep + args.plain_first) % 2 == 0 else (0.0, 1.0)):
            loaded.model = copy.deepcopy(base)
            prof = cProfile.Profile()
            c0, w0, r0 = time.process_time(), time.perf_counter(), rss_mb()
            prof.enable()
            job.quantize_loaded(loaded, recipe(sink), calib)
            prof.disable()
            run = {"rep": rep, "sink": sink, "cpu_s": round(time.process_time() - c0, 1),
                   "wall_s": round(time.perf_counter() - w0, 1), "rss_before_mb": round(r0),
                   "rss_after_mb": round(rss_mb()), "profile_s": profiled_seconds(prof)}
            runs.append(run)
            print(json.dumps(run), flush=True)
            loaded.model = None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"model": args.model, "blocks": args.blocks, "num_samples": args.num_samples,
              "machine": platform.machine(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": runs}
    (out / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
