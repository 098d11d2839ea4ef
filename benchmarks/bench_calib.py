"""The statistics pass of ``quantize`` against a plain forward over the same batches, timed
side by side: both sides alternate in ABBA order, ``--repeat`` timings each, wall and CPU time.

    python benchmarks/bench_calib.py [--model GGUF|DIR] [--scheme fp8-static] [--num-samples 16]
        [--seq-len 512] [--repeat 3] [--threads 1] [--json PATH]

Default: SmolLM2-135M (offline asset), ``fp8-static`` (static per-tensor activations, whose
scales the pass observes), 16 x 512 calibration tokens of calib/wiki-paragraphs.txt, bf16, one
thread. Three sides:

- ``stats pass``: ``collect_stats`` exactly as ``quantize`` runs it (micro-batches, observers on
  every GEMM input, the run's forward replacements and GEMM dtype);
- ``forward``: the same forward code (``lean_forwards``, ``float32_gemms``, LM head on the last
  position) over the whole batches, without observers: the floor the pass is held to;
- ``forward, pass's micro-batches``: that forward split as the pass splits it, so that the
  observers' own cost is the difference from the pass.

Why interleaved, and CPU time beside wall time: on a shared 2-core machine a burst of other work
lands on whichever side runs then; alternating keeps it from favouring one side, and one thread
per side keeps the CPU seconds close to the work done.
"""

from __future__ import annotations

import argparse
import os
import time

from fp8ptq.runtime.usage import exec_with_hugepages

# before torch is imported, as the ``fp8ptq`` command does for quantize (2 MiB pages for the
# forwards' large temporaries)
exec_with_hugepages()

import torch  # noqa: E402
from _common import CALIB, SMOLLM2, emit  # noqa: E402
from bench_all import plain_forward  # noqa: E402

from fp8ptq.config.plan import SAMPLE_BATCHES, build_plan  # noqa: E402
from fp8ptq.config.recipe import Recipe  # noqa: E402
from fp8ptq.config.schemes import get_scheme  # noqa: E402
from fp8ptq.execution import job  # noqa: E402
from fp8ptq.execution.in_memory import collect_stats  # noqa: E402
from fp8ptq.model.forward import micro_batches, run_batch, token_batches  # noqa: E402
from fp8ptq.model.gemm32 import float32_gemms  # noqa: E402
from fp8ptq.model.lean import lean_forwards  # noqa: E402
from fp8ptq.runtime.usage import bound_heap  # noqa: E402


def split_forward(model, batches) -> None:
    """The plain forward in the statistics pass's micro-batches (no observers)."""
    with torch.inference_mode(), float32_gemms(model=model), lean_forwards(model):
        for batch in batches:
            for part in micro_batches(batch):
                run_batch(model, part, logits=False)


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call of ``fn``."""
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=SMOLLM2)
    ap.add_argument("--scheme", default="fp8-static")
    ap.add_argument("--num-samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    recipe = Recipe().merged(**get_scheme(args.scheme).fields, calib_data=CALIB,
                             num_samples=args.num_samples, seq_len=args.seq_len)
    loaded = job.load(args.model, recipe)
    calib = job.calibration_set(loaded, recipe)
    bound_heap()  # the allocator the ``fp8ptq`` command runs with
    model = loaded.model
    batches = list(token_batches(calib.input_ids, recipe.batch_size))
    plan = build_plan(model, recipe)
    samples = SAMPLE_BATCHES if plan.facts.layer_aware else 0
    sides = {
        "stats pass": lambda: collect_stats(model, plan.gemms, batches, sample_batches=samples),
        "forward": lambda: plain_forward(model, batches, lean=True),
        "forward, pass's micro-batches": lambda: split_forward(model, batches),
    }
    for fn in sides.values():  # warm-up: first-call costs (kernels built, pages mapped)
        fn()
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in sides}
    for i in range(args.repeat):  # ABBA...: each side as often first as last
        for name in (list(sides) if i % 2 == 0 else list(reversed(sides))):
            runs[name].append(timed(sides[name]))
    best = {k: (min(w for w, _ in v), min(c for _, c in v)) for k, v in runs.items()}
    floor = best["forward"]
    rows = [{"side": k, "wall s": w, "cpu s": c, "wall / forward": w / floor[0],
             "cpu / forward": c / floor[1],
             "runs": {"wall": [r[0] for r in runs[k]], "cpu": [r[1] for r in runs[k]]}}
            for k, (w, c) in best.items()]
    tokens = calib.input_ids.numel()
    emit(f"statistics pass vs forward: {args.scheme}, {args.num_samples} x {args.seq_len} tokens "
         f"({tokens}), {recipe.dtype}, {args.threads} thread(s), fastest of {args.repeat} "
         "alternated", rows, args.json,
         {"threads": args.threads, "load_average": os.getloadavg(),
          "ratio_wall": best["stats pass"][0] / floor[0],
          "ratio_cpu": best["stats pass"][1] / floor[1]})


if __name__ == "__main__":
    main()
