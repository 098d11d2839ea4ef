"""``fp8ptq quantize MODEL --format e4m3 --output DIR``: flags -> ``fp8ptq.quantize`` -> report."""

from __future__ import annotations

import json

import click

from fp8ptq.execution.budget import parse_budget
from fp8ptq.execution.quantize import quantize, target_request
from fp8ptq.formats import get_format
from fp8ptq.io.loading import check_model_spec
from fp8ptq.io.source import weights_on_disk
from fp8ptq.observe import distributed
from fp8ptq.runtime.usage import bound_heap, heap_threshold

from .help_format import EXAMPLE_MODEL, OneScreenCommand, example
from .options import build_recipe, loading_from, loading_options, note_source, recipe_options
from .progress import progress_bars
from .quantize_report import print_report


@click.command("quantize", cls=OneScreenCommand, epilog=example(
    f"fp8ptq quantize {EXAMPLE_MODEL} --calib-data calib.txt -o out/smollm2-e4m3"),
    common=("fmt", "output", "device", "scheme", "recipe_path", "calib_data", "num_samples",
            "target_delta", "as_json"))
@click.argument("model")
@click.option("--format", "fmt", default=None, help="Format name (fp8ptq formats) [e4m3].")
@click.option("--output", "-o", required=True, type=click.Path(), help="Output folder.")
@click.option("--force", is_flag=True, help="Replace an existing output folder.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or auto.")
@loading_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the report.")
@click.option("--runtime", type=click.Choice(["vllm"]), default=None,
              help="Refuse (exit 4, nothing written) a checkpoint that vLLM would not serve as "
                   "evaluated; without it violations are warnings.")
@click.option("--sequential", is_flag=True,
              help="Quantize block by block from the safetensors folder: the model is built "
                   "without weights, one block's float weights are loaded at a time.")
@click.option("--propagate", type=click.Choice(["quantized", "fp"]), default="quantized",
              show_default=True,
              help="--sequential: next block's inputs from the quantized block (as at inference) "
                   "or from the unquantized one (bit-identical to the in-memory pipeline).")
@click.option("--model-free/--no-model-free", "model_free", default=None,
              help="Quantize straight from the safetensors files without building the model "
                   "(recipes that read no calibration data: weight-only or dynamic per-token "
                   "activations). Default: taken by itself when the recipe and MODEL allow it; "
                   "--model-free insists (an error says why it cannot), --no-model-free loads "
                   "the model.")
@click.option("--target-delta", default=None, metavar="VALUE[%]",
              help="Meet this perplexity loss on held-out text (1% of the baseline, or an "
                   "absolute 0.5): per module the cheapest of the recipe, GPTQ, a finer "
                   "granularity and --fallback-format that keeps the summed predicted loss "
                   "within it; the final loss is measured and reported.")
@click.option("--fallback-format", default="bf16", show_default=True,
              help="--target-delta's last resort per module: bf16 (high precision) or a format.")
@click.option("--target-level", type=click.Choice(["module", "block"]), default="module",
              show_default=True, help="--target-delta decides per GEMM or per decoder block.")
@click.option("--target-data", default=None,
              help="--target-delta's held-out text [every 10th calibration document, not "
                   "calibrated on].")
@click.option("--target-tokens", type=click.IntRange(min=2), default=4096, show_default=True,
              help="Held-out tokens --target-delta measures on (windows of 512).")
@click.option("--target-verify-tokens", type=click.IntRange(min=0), default=16384,
              show_default=True, help="Held-out tokens the final model is checked on again "
              "(windows of 2048; 0: not).")
@click.option("--target-metric", default="kl", show_default=True,
              help="How --target-delta measures a unit's sensitivity: kl (mean KL of the "
                   "next-token distributions against the unquantized model: non-negative per "
                   "token, low variance; predicted perplexity ratio exp(sum)) or ppl (the "
                   "perplexity delta, summed).")
@recipe_options
def command(model, fmt, output, force, device, as_json, runtime, sequential, propagate,
            model_free, target_delta, fallback_format, target_level, target_data, target_tokens,
            target_verify_tokens, target_metric, **flags):
    """Calibrate MODEL (hub id, local folder, .gguf, or a torch-saved .pt CNN) and write an FP8
    checkpoint to OUTPUT. Under torchrun, calibration is data-parallel and rank 0 writes."""
    budget = None  # --max-memory without --device-map: the run's budget, host and GPU
    if flags.get("device_map") is None:  # (with it: accelerate's, as on eval and sensitivity)
        budget = parse_budget(flags.get("max_memory"), device)
        flags["max_memory"] = None
    # a host budget, the run's or accelerate's (with --device-map): the heap stays bounded
    budgeted = (budget.host is not None) if budget is not None else bool(flags.get("max_memory"))
    load_options = loading_from(flags)
    recipe = build_recipe(flags, model=model, format=get_format(fmt).name if fmt else None)
    request = target_request(recipe, target_delta, fallback_format, target_level, target_data,
                             target_tokens, sequential, target_verify_tokens, target_metric)
    check_model_spec(model)  # a missing model is reported before the calibration data
    # a small model on a roomy machine: the heap keeps mid-sized tensors (no pages zeroed afresh)
    bound_heap(heap_threshold(weights_on_disk(model), budgeted))
    note_source(model)  # another tool's FP8 checkpoint: dequantized on load
    with progress_bars(enabled=not as_json and distributed.launched_rank() == 0) as bars:
        report = quantize(model, recipe, output, force=force, device=device,
                          load_options=load_options, sequential=sequential,
                          propagate=propagate, model_free=model_free, max_memory=budget,
                          target=request, runtime=runtime, progress=bars)
    if report is None:  # a torchrun rank that does not write
        return
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        print_report(report)
