"""``fp8ptq quantize MODEL --format e4m3 --output DIR``."""

from __future__ import annotations

import json
import warnings
from contextlib import contextmanager
from pathlib import Path

import click

from fp8ptq import __version__, distributed, job, route
from fp8ptq.atomic import check_writable, scratch_dir
from fp8ptq.checkpoint import save_quantized
from fp8ptq.errors import UsageError
from fp8ptq.formats import get_format
from fp8ptq.loading import check_model_spec
from fp8ptq.model_free_run import quantize_checkpoint
from fp8ptq.numbers import finite_or_none
from fp8ptq.route import Selection
from fp8ptq.schemes import scheme_flags
from fp8ptq.sensitivity import parse_target
from fp8ptq.sequential import quantize_folder
from fp8ptq.target import HIGH_PRECISION, check_metric, check_target_recipe
from fp8ptq.usage import usage
from fp8ptq.validate import static_violations

from .help_format import EXAMPLE_MODEL, OneScreenCommand, example
from .options import build_recipe, loading_from, loading_options, recipe_options
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
    budget = None  # a plain --max-memory SIZE: the process's budget (accelerate's CPU budget
    if flags.get("device_map") is None:  # with --device-map, as on eval and sensitivity)
        budget = route.process_budget(flags.get("max_memory"))
        if budget is not None:
            flags["max_memory"] = None
    load_options = loading_from(flags)
    recipe = absolute_calib_path(build_recipe(flags, format=get_format(fmt).name if fmt else None))
    request = target_request(recipe, target_delta, fallback_format, target_level, target_data,
                             target_tokens, sequential, target_verify_tokens, target_metric)
    # Everything that can be checked without the model fails here, before a long load.
    if distributed.launched_rank() == 0:  # the writer (torchrun stops the others if it fails);
        check_output(output, force)  # a late rank of a model-free run may find its output made
    check_model_spec(model)  # a missing model is reported before the calibration data
    job.resolve_device(device)
    timings = job.JobTimings()
    with timings.timed("plan"):
        path = route.choose(model, recipe, sequential=sequential, model_free=model_free,
                            max_memory=budget,
                            trust_remote_code=load_options.get("trust_remote_code", False),
                            whole_model=request and "--target-delta measures the quantized "
                            "model on held-out text")
    if path.path == "model-free":  # no process group: rank 0 does it all, the others leave
        if distributed.launched_rank() == 0:
            _run_model_free(model, output, force, recipe, runtime, path, timings, as_json)
        return
    # under torchrun: join the process group; every rank calibrates its share, rank 0 writes
    distributed.init(job.resolve_device(device))
    try:
        _run(model, output, force, device, load_options, as_json, recipe, runtime,
             propagate, path, timings, request)
    finally:
        distributed.shutdown()


def _run_model_free(model, output, force, recipe, runtime, path: Selection, timings,
                    as_json) -> None:
    with progress_bars(enabled=not as_json) as bars:
        tick = bars.counter(f"quantizing -> {output}")(len(path.job.units))
        with timings.timed("quantize+write"):
            result, sizes = quantize_checkpoint(
                path.folder, recipe, output, force=force, job=path.job, progress=tick,
                max_shard_bytes=route.shard_bytes(path.budget), extras=path.facts(),
                source={"model": model, "kind": path.kind, "path": str(path.folder)},
                tool_version=__version__,
                check_factory=lambda r: runtime_check(r, runtime))
    _emit(report_dict(result, output, sizes, timings, None), path, as_json)


def _emit(report: dict, path: Selection, as_json: bool) -> None:
    report.update(path.facts())
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        print_report(report)


def target_request(recipe, target, fallback, level, data, tokens, sequential, verify_tokens,
                   metric="kl"):
    """The --target-delta request, checked before anything loads (None without the flag)."""
    check_metric(metric)
    if target is None:
        return None
    parse_target(target)
    check_target_recipe(recipe)
    if fallback.lower() not in HIGH_PRECISION:
        get_format(fallback)
    if sequential:
        raise UsageError("--target-delta does not combine with --sequential")
    if distributed.active():
        raise UsageError("--target-delta runs in one process (not under torchrun)")
    return job.TargetRequest(target, fallback, level, tokens, data=data,
                             verify_tokens=verify_tokens, metric=metric)


def _run(model, output, force, device, load_options, as_json, recipe, runtime, propagate,
         path: Selection, timings: job.JobTimings, request=None):
    main_rank = distributed.is_main()
    with progress_bars(enabled=not as_json and main_rank) as bars:
        texts, heldout = None, None
        if job.needs_calibration(recipe) or request is not None:
            with bars.step("reading calibration data"), timings.timed("calibration data"):
                texts = job.calibration_texts(recipe, model)
                if request is not None:
                    texts, heldout = job.target_texts(recipe, request, texts)
        calib, data_warnings, result, sizes = None, [], None, None
        if path.path == "sequential":  # each block written as it is quantized, then freed
            def close_kwargs(result, calib):
                route.record(result, path)  # fp8ptq.json's extras say which path ran
                return dict(source={"model": model, "kind": path.kind or "local",
                                    "path": str(path.folder or model)},
                            calib=calib_facts(calib), tool_version=__version__,
                            check=runtime_check(result, runtime))

            with timings.timed("calibrate+quantize"), scratch_dir(output) as scratch:
                result, loaded, calib, sizes = quantize_folder(
                    path.folder or model, recipe, texts, propagate=propagate,
                    spill_dir=scratch, progress=None, output=output, force=force,
                    close_kwargs=close_kwargs, **path.sequential_options())
            timings.seconds.update(result.seconds)
        else:
            with bars.step(f"loading {model}"), timings.timed("load"), _no_transformers_bars():
                loaded = job.load(model, recipe, device=device, **load_options)
        if texts is not None and result is None:
            with bars.step("preparing calibration data"), timings.timed("calibration data"), \
                    warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                calib = job.calibration_set(loaded, recipe, texts)
            data_warnings = [str(w.message) for w in caught]  # e.g. overlapping windows
        if result is None and request is not None:
            with scratch_dir(output) as scratch:  # GPTQ's Hessians wait there during the sweep
                result = job.quantize_to_target(loaded, recipe, calib, heldout, request,
                                                timings=timings, spill_dir=scratch,
                                                progress=lambda d, total: bars.counter(d)(total))
        if result is None:
            result = job.quantize_loaded(loaded, recipe, calib, timings=timings,
                                         progress=bars.counter("calibrating"))
        route.record(result, path)
        result.warnings[:0] = data_warnings
        error = None
        if main_rank and sizes is None:
            try:
                with bars.step(f"writing {output}"), timings.timed("write"):
                    # the recipe the model was quantized with (--target-delta's decisions
                    # are overrides in it, so --recipe OUTPUT reproduces them)
                    sizes = save_quantized(
                        result, result.recipe or recipe, output, tokenizer=loaded.tokenizer,
                        force=force,
                        source={"model": model, "kind": loaded.kind,
                                "path": loaded.resolved_path},
                        calib=calib_facts(calib), tool_version=__version__,
                        check=runtime_check(result, runtime))
            except Exception as e:  # noqa: BLE001 - every rank learns it and exits with it
                error = e
        distributed.agree(error)
    if not main_rank:
        return
    report = report_dict(result, output, sizes, timings, calib)
    if distributed.active():
        report["ranks"] = distributed.world()
    _emit(report, path, as_json)


def runtime_check(result, runtime):
    """The static vLLM rules on the complete temporary checkpoint: violations become warnings
    in the report, or (``--runtime vllm``) an error before anything is written."""
    def check(tmp):
        errors = [x for x in static_violations(tmp, "vllm") if x.severity == "error"]
        if errors and runtime == "vllm":
            raise RuntimeRefused(f"vLLM would not serve this checkpoint: {errors[0].line()}"
                                 + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""))
        result.warnings += [f"vllm: {x.line()}" for x in errors]

    return check


class RuntimeRefused(UsageError):
    exit_code = 4


def check_output(output, force: bool) -> None:
    out = Path(output).expanduser()
    if (out.exists() or out.is_symlink()) and not force:
        raise UsageError(f"output directory {out.absolute()} already exists (use --force to "
                         "replace it)")
    check_writable(out)


def absolute_calib_path(recipe):
    """A local calibration file is recorded by absolute path, so that ``--recipe OUTPUT``
    reproduces the run from any working directory."""
    path = Path(recipe.calib_data).expanduser() if recipe.calib_data else None
    return recipe.merged(calib_data=str(path.absolute())) if path and path.is_file() else recipe


@contextmanager
def _no_transformers_bars():
    """transformers' own tqdm "Loading weights" bar would duplicate ours on stderr."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def calib_facts(calib) -> dict | None:
    if calib is None:
        return None
    return {"source": calib.source, "sha256": calib.sha256, "num_samples": calib.num_samples,
            "seq_len": calib.seq_len, "seed": calib.seed, "num_tokens": calib.num_tokens,
            "windows": calib.windows}



def report_dict(result, output, sizes, timings, calib) -> dict:
    recipe = result.recipe
    return {
        "output": str(output),
        # the preset the run started from and the flags it stands for (explicit flags win)
        "scheme": None if recipe is None or recipe.scheme is None else {
            "name": recipe.scheme, "flags": scheme_flags(recipe.scheme)},
        "modules": [{k: finite_or_none(v) for k, v in vars(m).items()} for m in result.modules],
        "skipped": result.skipped,
        "warnings": result.warnings,
        "experts": result.extras.get("experts", {}),
        "high_precision": result.extras.get("high_precision"),
        "rotation": result.extras.get("rotation"),  # --rotate: method, kind, seed
        # --smoothquant: alpha, into, groups (norms) and pairs (GEMM -> GEMM) smoothed, skipped
        "smoothquant": result.extras.get("smoothquant"),
        "gptq": result.extras.get("gptq"),  # --weight-calib gptq: hessian_bytes, damp, ...
        "target_delta": result.extras.get("target_delta"),  # decisions, predicted vs measured
        "calibration": calib_facts(calib),
        "sizes": sizes,
        **usage(timings.seconds),  # seconds, peak_rss_mb
        "model_free": result.extras.get("model_free"),  # throughput facts of that path
    }
