"""Every speed target of fp8ptq in one table (SmolLM2-135M, codecs on 4096 x 4096 float32).

The regression check for a change.

    python benchmarks/bench_all.py [--quick] [--dtype D] [--json PATH] [--no-llmc]
        [--remeasure-llmc] [--only codecs,build,calib,eval,quantize] [--threads N]

Each row is printed as soon as it is measured (measured value, the reference it is divided by,
the ratio, the target, met?), then the whole table; ``--json`` writes the rows. Rows:

- codecs: ``encode`` and ``fake_quantize`` GB/s of a 4096 x 4096 float32 tensor (GB of float32
  input per second) against the same run's memory copy of that tensor, for e4m3, e5m2,
  e4m3fnuz, e5m2fnuz (target >= 50% of the copy), hfp8, hif8, the generic ExMy e3m4 and e2m5
  and int8 (>= 25%); each codec into a preallocated tensor (``out=``) against a copy into a
  preallocated one, and into a new tensor against ``clone()`` (``codec_rows``).
- the C kernels' first-call build (``fp8ptq.runtime.native`` into an empty cache folder): seconds.
- calibration: the statistics pass of ``quantize`` (``pipeline.collect_stats``; SmolLM2-135M,
  e4m3, channel weights, static per-tensor activations, batch 8, N x 512 tokens of
  calib/wiki-paragraphs.txt) against two floors, a plain forward pass over the same batches
  (the same forward: LM head on the last position only), alternated, the faster of two each.
  Target <= 1.15x against each: transformers' own forward (the first floor), and the same
  forward under the replacements the statistics pass runs (``fp8ptq.model.lean``, and
  ``float32_gemms`` for bf16 on a CPU without bf16 GEMMs), so that leaner forwards cannot hide
  slower observers: the second ratio is what observing costs.
- simulated eval: lm-eval WikiText perplexity of the quantized model (static per-tensor
  activations) for each format, and e4m3 with dynamic per-token activations (the default
  recipe's) and dynamic per-group-128 ones (FP8_BLOCK's), against the same model's eval
  unquantized, same tokens, timed alternately with it (ABBA, as many timings each:
  ``paired_evals``), with the CPU seconds of both beside the wall. Target <= 1.15x.
- quantize: a fresh ``fp8ptq quantize`` process (load to written checkpoint) against
  llm-compressor's ``oneshot`` + save of the same job on the same token windows in its venv
  (``llmc_timing.py``; its time cached with its date and load). Target <= 0.5x. Its own
  number of windows (``--quantize-samples``: 16 with ``--quick``, the default 128 without):
  both tools pay ~10 s of fixed costs here (interpreter, imports of torch / transformers,
  load, write), which at 4 windows would be most of the comparison.

Allocator: every model row runs with glibc's mmap threshold fixed at 1 MiB
(``fp8ptq.runtime.usage.bound_heap``), as the ``fp8ptq`` command and ``quantize_model`` run, so
baseline
and variants pay the same page faults, and, like the command, the bench re-executes itself with
glibc's huge-page tunable (``fp8ptq.runtime.usage.exec_with_hugepages``) before importing torch; one
extra row times the float32 eval with glibc's own threshold first, before ``bound_heap``, and
gives the memory bound's time cost as a ratio.

Model dtype: bfloat16 by default, float32 with ``--quick``. On a CPU without native bf16 GEMMs
(AVX2 only, like the 2-core development machine) a bf16 forward is ~7x slower than float32, so
the bf16 rows take far too long for a quick check, and they are the easier ones: the model's
GEMMs dominate and hide the quantization work. float32 is the harder denominator.

``--quick`` (< 3 minutes on 2 quiet cores): 4 x 512 calibration tokens (16 x 512 for the
quantize-wall row), a ~2000-token WikiText slice (one eval timing >= ~5 s: ~1.5 s timings of a
500-token slice varied by +-15% on a quiet machine and read 1.47x for a 1.0x variant under
load), eval rows for e4m3 and hif8 (the slowest codec) only, the faster of two eval timings
each against the baseline's two timings around them, the best of 5 per codec. Report timings taken
on a quiet machine.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

from fp8ptq.runtime.usage import exec_with_hugepages

# Before torch is imported, as the ``fp8ptq`` command does: the in-process rows (calibration,
# eval) then run with the command's allocator, 2 MiB pages for ``bound_heap``'s mappings.
exec_with_hugepages()

import llmc_timing  # noqa: E402
import torch  # noqa: E402
from _common import ASSETS, CALIB, SMOLLM2, WIKITEXT, best_seconds, emit  # noqa: E402
from rich.console import Console  # noqa: E402

from fp8ptq.config.recipe import Recipe  # noqa: E402
from fp8ptq.evals import run_tasks  # noqa: E402
from fp8ptq.evals.wikitext import split_articles  # noqa: E402
from fp8ptq.execution import job  # noqa: E402
from fp8ptq.execution.in_memory import build_plan, collect_stats  # noqa: E402
from fp8ptq.formats import encode, fake_quantize, get_format  # noqa: E402
from fp8ptq.model.forward import run_batch, token_batches  # noqa: E402
from fp8ptq.model.gemm32 import float32_gemms  # noqa: E402
from fp8ptq.model.lean import lean_forwards  # noqa: E402
from fp8ptq.runtime import native  # noqa: E402
from fp8ptq.runtime.usage import bound_heap  # noqa: E402

CODEC_TARGETS = {"e4m3": 0.5, "e5m2": 0.5, "e4m3fnuz": 0.5, "e5m2fnuz": 0.5, "hfp8": 0.25,
                 "hif8": 0.25, "e3m4": 0.25, "e2m5": 0.25, "int8": 0.25}
EVAL_FORMATS = ("e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz", "hfp8", "hif8", "e3m4", "e2m5", "int8")
QUICK_EVAL_FORMATS = ("e4m3", "hif8")  # the OCP kernel and the slowest codec
SECTIONS = ("codecs", "build", "calib", "eval", "quantize")


class Rows:
    """The rows measured so far; each is printed the moment it is added."""

    def __init__(self):
        self.rows: list[dict] = []
        self.t0 = time.perf_counter()
        self.console = Console(highlight=False, soft_wrap=True)

    def add(self, what: str, value: float, unit: str, reference: float | None = None,
            ref_unit: str = "", target: str = "", met: bool | None = None, **extra) -> None:
        row = {"what": what, "value": value, "unit": unit, "reference": reference,
               "ref unit": ref_unit, "ratio": None if reference is None else value / reference,
               "target": target, "met": None if met is None else ("yes" if met else "NO"),
               **extra}
        self.rows.append(row)
        ref = "" if reference is None else \
            f" vs {reference:.3g} {ref_unit} = {row['ratio']:.3g}x"
        verdict = "" if met is None else f" target {target}: {row['met']}"
        self.console.print(f"[{time.perf_counter() - self.t0:5.0f} s] {what}: {value:.3g} {unit}"
                           f"{ref}{verdict}")

    def note(self, text: str) -> None:
        self.console.print(f"[{time.perf_counter() - self.t0:5.0f} s] {text}")


def abba(a, b, repeat: int) -> tuple[list, list]:
    """``a()`` and ``b()`` called alternately in ABBA order (a, b, b, a, ...), ``repeat``
    times each, so that both sides have the same number of calls and the same neighbours;
    their return values, one list per side."""
    runs: tuple[list, list] = ([], [])
    for i in range(2 * repeat):
        second = i % 4 in (1, 2)
        runs[second].append((b if second else a)())
    return runs


def paired_seconds(ref, fn, repeat: int) -> tuple[float, float]:
    """(fastest ``ref``, fastest ``fn``) timed alternately (``abba``), ``repeat`` calls each
    after one warm-up call of both.

    Why: a codec and its copy are both 2-thread, memory-bound passes of ~5-15 ms; whenever any
    other process is runnable, one thread waits on the other and both read up to 2x slow
    (the same codec has read nearly 2x apart in two runs a minute apart). Timing each codec
    beside its own copy keeps a burst of that from landing on one side of a ratio only, as the
    copy measured once at the start of the section did."""
    ref()
    fn()

    def timed(f):
        def call():
            t0 = time.perf_counter()
            f()
            return time.perf_counter() - t0
        return call

    refs, fns = abba(timed(ref), timed(fn), repeat)
    return min(refs), min(fns)


def codec_rows(out: Rows, repeat: int) -> None:
    """Each codec two ways, each against the copy that writes memory the same way: into a
    preallocated tensor (``out=``) against ``dst.copy_(x)``, and into a new tensor against
    ``x.clone()``, timed in alternation with it (``paired_seconds``). A new 64 MB tensor's
    pages are faulted in and zeroed by the kernel on first write, which here costs about as
    much as the copy itself, so the second pair measures the allocator as much as the codec."""
    torch.manual_seed(0)
    x = torch.randn(4096, 4096)
    gb = x.numel() * 4 / 1e9
    dst, codes = torch.empty_like(x), torch.empty(x.shape, dtype=torch.uint8)

    def copy():
        dst.copy_(x)

    copy_gbs = gb / best_seconds(copy, max(repeat, 3))
    out.add("memory copy 4096x4096 fp32 (into a preallocated tensor)", copy_gbs, "GB/s")
    clone_gbs = gb / best_seconds(x.clone, max(repeat, 3))
    out.add("memory copy 4096x4096 fp32 (into a new tensor: clone)", clone_gbs, "GB/s")
    scale = torch.tensor(x.abs().max().item() / 400.0)
    y = x / scale
    for name, target in CODEC_TARGETS.items():
        spec = get_format(name)
        for op, fn, ref, ref_unit in (
                ("encode (out=)", lambda s=spec: encode(y, s, out=codes), copy, "GB/s copy"),
                ("fake-quant (out=)", lambda s=spec: fake_quantize(x, scale, s, out=dst),
                 copy, "GB/s copy"),
                ("encode (new tensor)", lambda s=spec: encode(y, s), x.clone, "GB/s clone"),
                ("fake-quant (new tensor)", lambda s=spec: fake_quantize(x, scale, s),
                 x.clone, "GB/s clone")):
            ref_s, fn_s = paired_seconds(ref, fn, repeat)
            out.add(f"{op} {name}", gb / fn_s, "GB/s", gb / ref_s,
                    f"{ref_unit} (paired)", f">= {target:.0%} of {ref_unit.split()[-1]}",
                    ref_s / fn_s >= target)


def build_row(out: Rows) -> None:
    """The C kernels built from scratch into a temporary cache folder (the first-call cost on a
    fresh machine; later processes load the cached library)."""
    with tempfile.TemporaryDirectory() as tmp:
        old = os.environ.get("FP8PTQ_CACHE")
        os.environ["FP8PTQ_CACHE"] = tmp
        try:
            cc = os.environ.get("CC") or "cc"
            flags = native.FLAGS + native.ARCH_FLAGS
            t0 = time.perf_counter()
            ok = native.build(cc, native.library_path(cc, flags), flags)
            seconds = time.perf_counter() - t0
        finally:
            if old is None:
                os.environ.pop("FP8PTQ_CACHE")
            else:
                os.environ["FP8PTQ_CACHE"] = old
    out.add("C kernels first-call build" + ("" if ok else " (FAILED)"), seconds, "s",
            target="once per machine")


def issue_recipe(samples: int, dtype: str, **fields) -> Recipe:
    """The speed comparison's job: e4m3, channel weights rounded to nearest
    (``weight_calib="max"``, what llm-compressor's ``QuantizationModifier`` does; the default
    with calibration data would be sequential GPTQ), static per-tensor activations, batch 8,
    ``samples`` x 512 tokens."""
    return Recipe(**{"format": "e4m3", "weight_granularity": "channel",
                     "act_granularity": "tensor", "weight_calib": "max", "calib_data": CALIB,
                     "num_samples": samples, "seq_len": 512, "batch_size": 8, "dtype": dtype,
                     **fields})


def plain_forward(model, batches, lean: bool = False) -> float:
    """The floor: the same forward the calibration pass runs (LM head on the last position
    only, ``logits=False``), without observers. A forward that computes every position's
    logits would be ~25% slower for SmolLM2 and flatter the ratio.

    ``lean``: under the same forward replacements and GEMM dtype as the statistics pass
    (``lean_forwards``, ``float32_gemms``), the floor that only the observers are measured
    against; without them, transformers' own forward, which the calibration's leaner forwards
    can beat, so that ratio alone could hide slower observers."""
    t0 = time.perf_counter()
    with torch.inference_mode(), float32_gemms(model=model) if lean else nullcontext(), \
            lean_forwards(model, enabled=lean):
        for batch in batches:
            run_batch(model, batch, logits=False)
    return time.perf_counter() - t0


def eval_slice(tokens: int | None, folder: Path) -> str:
    """The first WikiText-2 test article, cut to about ``tokens`` tokens (~4 characters per
    token) at a line end, as a raw file; None: the whole file (the eval's ``limit`` applies)."""
    if tokens is None:
        return WIKITEXT
    article = split_articles(Path(WIKITEXT).read_text(encoding="utf-8"))[0]
    cut = article.rfind("\n", 0, tokens * 4)
    path = folder / "wiki-slice.raw"
    path.write_text(article[:cut + 1], encoding="utf-8")
    return str(path)


def eval_timing(model, tokenizer, data: str, articles: int) -> tuple[float, float]:
    """(wall seconds of one WikiText eval as ``run_tasks`` reports it, CPU seconds of this
    process over the same call: user + system time of every thread)."""
    before = resource.getrusage(resource.RUSAGE_SELF)
    result = run_tasks(model, tokenizer, ["wikitext"], data={"wikitext": data}, limit=articles,
                       batch_size=8)
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return result.seconds["wikitext"], cpu


def eval_seconds(model, tokenizer, data: str, articles: int, repeat: int) -> float:
    return min(eval_timing(model, tokenizer, data, articles)[0] for _ in range(repeat))


def paired_evals(base_model, model, tokenizer, data: str, articles: int, repeat: int) -> dict:
    """The baseline and a variant timed alternately (``abba``: ``repeat`` timings each).
    Returns the fastest wall of each side and the CPU seconds of that same timing.

    Why: on the 2-core machine a 2-thread forward slows several-fold whenever any other
    process is runnable (one OpenMP thread is descheduled and the other waits at every
    barrier): the same float32 eval read 6.9-26.9 s in one ``cpu-quiet`` run with an
    unregistered job beside it, while at 1 thread it stayed within 3% (9.0-9.4 s). The
    previous bench divided the fastest of two variant timings by the fastest of up to 2 x
    (number of variants) baseline timings; under such heavy-tailed noise the minimum of more
    draws is lower, so every variant read far slower than its work per eval differed
    (docs/results/speed.md, "Benchmarks")."""
    bases, variants = abba(lambda: eval_timing(base_model, tokenizer, data, articles),
                           lambda: eval_timing(model, tokenizer, data, articles), repeat)
    base, variant = min(bases), min(variants)
    return {"base": base[0], "base_cpu": base[1], "variant": variant[0],
            "variant_cpu": variant[1]}


def model_rows(out: Rows, sections, dtype: str, samples: int, eval_tokens: int | None,
               articles: int, formats, repeat: int, dynamic: bool = True) -> None:
    recipe = issue_recipe(samples, dtype)
    loaded = job.load(SMOLLM2, recipe)
    calib = job.calibration_set(loaded, recipe)
    pristine = copy.deepcopy(loaded.model)
    unbounded = None
    if "eval" in sections:
        # the allocator's cost, once: the float32 eval with glibc's own (dynamic) mmap
        # threshold, before ``bound_heap`` fixes it for the rest of the process
        with tempfile.TemporaryDirectory() as tmp:
            unbounded = eval_seconds(pristine, loaded.tokenizer, eval_slice(eval_tokens, Path(tmp)),
                                     articles, repeat)
    # Every row below runs as the ``fp8ptq`` command runs: with glibc's mmap threshold fixed
    # at 1 MiB (``bound_heap``, called by the CLI at start-up and by ``quantize_model``). The
    # first ``quantize_loaded`` would otherwise switch it on between the baseline's first
    # timing and the variants', and every eval variant would read slow.
    bound_heap()
    if "calib" in sections:
        batches = list(token_batches(calib.input_ids, recipe.batch_size))
        targets = build_plan(loaded.model, recipe).gemms
        # alternated, the faster of two each: a load change mid-run hits all sides alike
        forward = lean = cal = float("inf")
        for _ in range(2):
            forward = min(forward, plain_forward(loaded.model, batches))
            lean = min(lean, plain_forward(loaded.model, batches, lean=True))
            t0 = time.perf_counter()
            collect_stats(loaded.model, targets, batches)  # the pipeline's statistics pass
            cal = min(cal, time.perf_counter() - t0)
        what = f"calibrate e4m3 ({dtype}, {samples}x512 tokens)"
        out.add(what, cal, "s", forward, f"s {dtype} forward (transformers')", "<= 1.15x",
                cal / forward <= 1.15)
        # the same pass against the same forward code without observers: what observing costs
        out.add(what, cal, "s", lean, f"s {dtype} forward (lean_forwards, as calibration)",
                "<= 1.15x", cal / lean <= 1.15)
    if "eval" not in sections:
        return
    # the eval variants' scales come from one short batch: eval speed does not depend on them
    small = recipe.merged(num_samples=2, seq_len=128)
    small_calib = job.calibration_set(loaded, small)
    with tempfile.TemporaryDirectory() as tmp:
        data = eval_slice(eval_tokens, Path(tmp))
        what = "WikiText slice" if eval_tokens else f"{articles} WikiText article(s)"
        variants = [(f"{fmt} (static A)", small.merged(format=fmt)) for fmt in formats]
        if dynamic:
            # the default recipe's activations (FP8_DYNAMIC): a per-token amax at every forward
            variants.append(("e4m3 (dynamic per-token A)",
                             small.merged(format="e4m3", act_granularity="token")))
            # FP8_BLOCK's activations: a scale per 128 features of each token, every forward
            variants.append(("e4m3 (dynamic per-group-128 A)",
                             small.merged(format="e4m3", act_granularity="group")))
        # Each variant against baseline timings interleaved with its own (ABBA, equal counts:
        # ``paired_evals``); CPU seconds beside the wall (a 2-thread wall swells under any
        # other runnable process, the CPU time of a 1-thread run does not: ``--threads 1``).
        base = float("inf")
        for name, variant in variants:
            loaded.model = copy.deepcopy(pristine)
            job.quantize_loaded(loaded, variant, small_calib)
            pair = paired_evals(pristine, loaded.model, loaded.tokenizer, data, articles, repeat)
            base = min(base, pair["base"])
            out.add(f"simulated eval {name}", pair["variant"], "s", pair["base"],
                    f"s {dtype} eval (paired)", "<= 1.15x", pair["variant"] / pair["base"] <= 1.15,
                    cpu_s=round(pair["variant_cpu"], 2), base_cpu_s=round(pair["base_cpu"], 2),
                    cpu_ratio=round(pair["variant_cpu"] / pair["base_cpu"], 3))
        out.add(f"eval {dtype} ({what}, fastest of {repeat * len(variants)})", base, "s")
        out.add(f"eval {dtype} under bound_heap (1 MiB mmap threshold) vs glibc's default",
                base, "s", unbounded, f"s {dtype} eval, default threshold",
                "(the memory bound's time cost)")


def quantize_row(out: Rows, dtype: str, samples: int, remeasure: bool, repeat: int) -> None:
    walls, stages, theirs = llmc_timing.quantize_walls(SMOLLM2, CALIB, samples, 512, dtype,
                                                       remeasure, repeat)
    ours = min(walls)
    if len(walls) > 1:
        out.note("fp8ptq quantize walls: " + ", ".join(f"{w:.1f} s" for w in walls))
    staged = sum(v for k, v in stages.items() if k != "calibrate+quantize")
    out.note("fp8ptq quantize stages: " + ", ".join(
        f"{k} {v:.2f} s" for k, v in stages.items() if k != "calibrate+quantize" and v >= 0.01)
        + f"; the rest (interpreter, imports, report) {ours - staged:.2f} s")
    when = "cached, " if theirs.get("cached") else ""
    load = theirs["load_before"][0]
    out.add(f"quantize wall ({dtype}, {samples}x512, fresh process)", ours, "s",
            theirs["seconds"], f"s llm-compressor ({when}measured {theirs['measured_at']} at "
            f"load {load:.1f})", "<= 0.5x", ours / theirs["seconds"] <= 0.5,
            llmc_measured_at=theirs["measured_at"], llmc_cached=bool(theirs.get("cached")),
            walls=[round(w, 2) for w in walls])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="< 3 minutes quiet (see the docstring)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"),
                    help="model dtype (default: bfloat16, float32 with --quick)")
    ap.add_argument("--json")
    ap.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    ap.add_argument("--no-llmc", action="store_true", help="skip the llm-compressor row")
    ap.add_argument("--remeasure-llmc", action="store_true",
                    help="rerun llm-compressor instead of reading its cached time")
    ap.add_argument("--samples", type=int, help="calibration windows (override)")
    ap.add_argument("--quantize-samples", type=int,
                    help="calibration windows of the quantize-wall row (override)")
    ap.add_argument("--quantize-repeat", type=int, default=1,
                    help="fresh fp8ptq processes of the quantize-wall row (the fastest is the "
                    "row; the first runs before llm-compressor, the others after it)")
    ap.add_argument("--eval-tokens", type=int, help="WikiText slice length (override)")
    ap.add_argument("--formats", help="comma-separated eval formats (override)")
    ap.add_argument("--eval-repeat", type=int,
                    help="timings of each eval variant and of its baseline (default 2)")
    ap.add_argument("--no-dynamic", action="store_true",
                    help="eval: only the static-activation rows of --formats (no e4m3 "
                    "per-token / per-group-128 rows)")
    ap.add_argument("--threads", type=int,
                    help="torch threads of this process (default: torch's, one per core); 1 "
                    "gives eval ratios that a busy 2-core machine does not distort")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sections = set(args.only.split(","))
    if args.quick:
        dtype, samples, q_samples, eval_tokens, articles, formats, repeat = (
            args.dtype or "float32", 4, 16, 2000, 1, QUICK_EVAL_FORMATS, 2)
    else:
        dtype, samples, q_samples, eval_tokens, articles, formats, repeat = (
            args.dtype or "bfloat16", 32, 128, None, 1, EVAL_FORMATS, 2)
    samples = args.samples or samples
    q_samples = args.quantize_samples or q_samples
    eval_tokens = args.eval_tokens or eval_tokens
    formats = args.formats.split(",") if args.formats else formats
    out = Rows()
    load0 = os.getloadavg()
    out.note(f"{torch.get_num_threads()} threads, native kernels "
             f"{'on' if native.available() else 'OFF'}, load {load0[0]:.2f}, model {dtype}")
    if "codecs" in sections:
        codec_rows(out, max(repeat, 12))  # ~10-40 ms a call: 12 pairs each cost ~10 s in all
    if "build" in sections:
        build_row(out)
    if not Path(SMOLLM2).is_file():
        out.note(f"SmolLM2 not found under {ASSETS} (set FP8PTQ_ASSETS): model rows skipped")
    else:
        if sections & {"calib", "eval"}:
            model_rows(out, sections, dtype, samples, eval_tokens, articles, formats,
                       args.eval_repeat or repeat, dynamic=not args.no_dynamic)
        if "quantize" in sections and not args.no_llmc:
            if llmc_timing.available():
                quantize_row(out, dtype, q_samples, args.remeasure_llmc,
                             args.quantize_repeat)
            else:
                out.note(f"no llm-compressor venv at {llmc_timing.LLMC_PY}: quantize row skipped")
    load1 = os.getloadavg()
    emit(f"fp8ptq speed targets ({torch.get_num_threads()} threads, native kernels "
         f"{'on' if native.available() else 'OFF'}, model {dtype}, load {load0[0]:.2f} -> "
         f"{load1[0]:.2f}, {time.perf_counter() - out.t0:.0f} s)", out.rows, args.json,
         {"quick": args.quick, "dtype": dtype, "load_before": load0, "load_after": load1,
          "native": native.available(), "seconds": time.perf_counter() - out.t0})
    missed = [r["what"] for r in out.rows if r["met"] == "NO"]
    print(json.dumps({"missed": missed}) if args.json else f"missed: {len(missed)}")


if __name__ == "__main__":
    main()
