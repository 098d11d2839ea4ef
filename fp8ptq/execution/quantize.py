"""``fp8ptq.quantize``: a whole quantize run as one library call, exactly what ``fp8ptq
quantize`` does.

The execution strategy - model-free (weights only, no model built), block streaming (one
decoder block in memory at a time) or in memory - is chosen once from the recipe, the model and
the memory budget (``fp8ptq.execution.strategy.choose``); then calibration data is read,
the model quantized (``--target-delta`` included) and the checkpoint written atomically. The
CLI only parses flags into these arguments and prints the returned report; a Python user gets
the same run, the same report and the same checkpoint.

Under ``torchrun`` every rank calls this: calibration is data-parallel and rank 0 writes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from ..checkpoint import save_quantized
from ..checkpoint.validate import static_violations
from ..config.plan import QuantPlan, build_plan, needs_calibration
from ..config.recipe import Recipe
from ..config.schemes import scheme_flags
from ..errors import UsageError
from ..files.atomic import check_writable, scratch_dir
from ..formats import get_format
from ..io.loading import check_model_spec
from ..numbers import finite_or_none
from ..observe import distributed
from ..runtime.usage import usage
from ..sensitivity import parse_target
from ..sensitivity.budget import HIGH_PRECISION, check_metric, check_target_recipe
from ..version import __version__
from . import job, strategy
from .budget import Budget
from .model_free_run import quantize_checkpoint
from .strategy import Selection
from .streaming import quantize_folder


class RuntimeRefused(UsageError):
    """``runtime="vllm"``: the checkpoint breaks a vLLM rule; nothing was written."""

    exit_code = 4


def quantize(model: str, recipe: Recipe | dict | None, output: str | Path, *,
             force: bool = False,
             device: str = "cpu", load_options: dict | None = None, sequential: bool = False,
             propagate: str = "quantized", model_free: bool | None = None,
             max_memory: int | Budget | None = None,
             target: job.TargetRequest | None = None,
             runtime: str | None = None, progress=None) -> dict | None:
    """Quantize ``model`` (hub id, local folder, ``.gguf``, or a torch-saved ``.pt`` CNN) with
    ``recipe`` (a ``Recipe``, a dict of its fields, or None for the default recipe) and write
    the checkpoint to ``output``; returns the run's report (the dict ``fp8ptq quantize --json``
    prints), or None on a torchrun rank that does not write.

    ``sequential`` forces block streaming, ``model_free`` True insists on / False refuses the
    model-free path (None: taken where the recipe allows), ``max_memory`` is the process's
    budget in bytes or a ``Budget`` (host and GPU: it picks the strategy; on a GPU a model
    that does not fit is quantized one block at a time there), ``target`` a ``--target-delta``
    request
    (``target_request``), ``runtime="vllm"`` refuses what vLLM would not serve
    (``RuntimeRefused``, nothing written); ``load_options``: ``device_map``,
    ``trust_pickle``, ``trust_remote_code``."""
    load_options = dict(load_options or {})
    progress = progress or job.NoProgress()
    recipe = absolute_calib_path(recipe if isinstance(recipe, Recipe)
                                 else Recipe().merged(**(recipe or {})))
    # Everything that can be checked without the model fails here, before a long load.
    if distributed.launched_rank() == 0:  # the writer (torchrun stops the others if it fails);
        check_output(output, force)  # a late rank of a model-free run may find its output made
    check_model_spec(model)  # a missing model is reported before the calibration data
    job.resolve_device(device)
    budget = Budget.of(max_memory)
    timings = job.JobTimings()
    planner = RunPlan(recipe)
    with timings.timed("plan"):
        path = strategy.choose(model, recipe, sequential=sequential, model_free=model_free,
                               max_memory=budget.host, device=device, gpu_budget=budget.gpu,
                               trust_remote_code=load_options.get("trust_remote_code", False),
                               whole_model=target and "--target-delta measures the quantized "
                               "model on held-out text", planner=planner)
    run = Run(model, output, force, device, load_options, recipe, runtime, propagate, path,
              timings, target, progress, planner)
    if path.path == "model-free":  # no process group: rank 0 does it all, the others leave
        return STRATEGIES[path.path](run) if distributed.launched_rank() == 0 else None
    # under torchrun: join the process group; every rank calibrates its share, rank 0 writes
    distributed.init(job.resolve_device(device))
    try:
        return STRATEGIES[path.path](run)
    finally:
        distributed.shutdown()


@dataclass
class RunPlan:
    """The run's one plan (``fp8ptq.config.plan``), made when a step first asks for it and
    handed to every later step. The plan decides by module name, so the plan made on the
    meta-device model the strategy sized or the model-free job reads is re-bound
    (``QuantPlan.rebind``) to the model then loaded or streamed from the same checkpoint, not
    made again. It is made anew only for another recipe (``--target-delta``'s decisions, which
    are overrides) or for a model whose modules are not the planned ones (a type differs)."""

    recipe: Recipe
    plan: QuantPlan | None = None
    built: int = 0  # how many times it was made (once, in a run without --target-delta)

    def __call__(self, model: nn.Module, recipe: Recipe | None = None) -> QuantPlan:
        if recipe is not None and recipe is not self.recipe:
            self.recipe, self.plan = recipe, None
        if self.plan is not None and self.plan.binds(model):
            return self.plan.rebind(model)
        self.plan = build_plan(model, self.recipe)
        self.built += 1
        return self.plan


@dataclass
class Run:
    """One quantize run as the strategies see it: the request, the chosen path, the clock."""

    model: str
    output: str | Path
    force: bool
    device: str
    load_options: dict
    recipe: Recipe
    runtime: str | None
    propagate: str
    path: Selection
    timings: job.JobTimings
    request: job.TargetRequest | None
    progress: object
    planner: RunPlan

    def source(self, kind, path) -> dict:
        return {"model": self.model, "kind": kind, "path": str(path)}

    def report(self, result, sizes, calib) -> dict:
        report = {**report_dict(result, self.output, sizes, self.timings, calib),
                  **self.path.facts()}
        if distributed.active():
            report["ranks"] = distributed.world()
        return report


def target_request(recipe: Recipe, target: str | None, fallback: str = "bf16",
                   level: str = "module", data: str | None = None, tokens: int = 4096,
                   sequential: bool = False, verify_tokens: int = 16384,
                   metric: str = "kl") -> job.TargetRequest | None:
    """The ``--target-delta`` request, checked before anything loads (None without a target)."""
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


def _model_free(run: Run) -> dict:
    """Weights quantized straight from the safetensors files, no model built."""
    path = run.path
    path.job.device = job.resolve_device(run.device)
    tick = run.progress.counter(f"quantizing -> {run.output}")(len(path.job.units))
    with run.timings.timed("quantize+write"):
        result, sizes = quantize_checkpoint(
            path.folder, run.recipe, run.output, force=run.force, job=path.job, progress=tick,
            max_shard_bytes=strategy.shard_bytes(path.budget), extras=path.facts(),
            source=run.source(path.kind, path.folder), tool_version=__version__,
            check_factory=lambda r: runtime_check(r, run.runtime))
    return run.report(result, sizes, None)


def _calibration_texts(run: Run):
    """(calibration documents, --target-delta's held-out documents), read before any model
    loads so that missing data fails in seconds; (None, None) where nothing reads them."""
    if not (needs_calibration(run.recipe) or run.request is not None):
        return None, None
    with run.progress.step("reading calibration data"), run.timings.timed("calibration data"):
        texts = job.calibration_texts(run.recipe, run.model)
        if run.request is not None:
            return job.target_texts(run.recipe, run.request, texts)
    return texts, None


def _streaming(run: Run) -> dict | None:
    """Block by block from the safetensors folder: each block loaded, quantized, written and
    freed (``fp8ptq.execution.streaming``)."""
    texts, _ = _calibration_texts(run)
    path = run.path

    def close_kwargs(result, calib):
        strategy.record(result, path)  # fp8ptq.json's extras say which path ran
        return dict(source=run.source(path.kind or "local", path.folder or run.model),
                    calib=calib_facts(calib), tool_version=__version__,
                    check=runtime_check(result, run.runtime))

    with run.timings.timed("calibrate+quantize"), scratch_dir(run.output) as scratch:
        result, _, calib, sizes = quantize_folder(
            path.folder or run.model, run.recipe, texts, propagate=run.propagate,
            spill_dir=scratch, progress=None, output=run.output, force=run.force,
            close_kwargs=close_kwargs, planner=run.planner, **path.sequential_options())
    run.timings.seconds.update(result.seconds)
    strategy.record(result, path)
    distributed.agree(None)
    return run.report(result, sizes, calib) if distributed.is_main() else None


def _in_memory(run: Run) -> dict | None:
    """The whole model loaded (or placed by accelerate), quantized in place, then written."""
    texts, heldout = _calibration_texts(run)
    progress, timings, recipe = run.progress, run.timings, run.recipe
    with progress.step(f"loading {run.model}"), timings.timed("load"), _no_transformers_bars():
        loaded = job.load(run.model, recipe, device=run.device, **run.load_options)
    calib, data_warnings = None, []
    if texts is not None:
        with progress.step("preparing calibration data"), timings.timed("calibration data"), \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            calib = job.calibration_set(loaded, recipe, texts)
        data_warnings = [str(w.message) for w in caught]  # e.g. overlapping windows
    if run.request is not None:
        with scratch_dir(run.output) as scratch:  # GPTQ's Hessians wait there during the sweep
            result = job.quantize_to_target(
                loaded, recipe, calib, heldout, run.request, timings=timings,
                spill_dir=scratch, progress=lambda d, total: progress.counter(d)(total),
                planner=run.planner)
    else:
        result = job.quantize_loaded(loaded, recipe, calib, timings=timings,
                                     progress=progress.counter("calibrating"),
                                     plan=run.planner(loaded.model))
    strategy.record(result, run.path)
    result.warnings[:0] = data_warnings
    error, sizes = None, None
    if distributed.is_main():
        try:
            with progress.step(f"writing {run.output}"), timings.timed("write"):
                # the recipe the model was quantized with (--target-delta's decisions are
                # overrides in it, so --recipe OUTPUT reproduces them)
                sizes = save_quantized(
                    result, result.recipe or recipe, run.output, tokenizer=loaded.tokenizer,
                    force=run.force, source=run.source(loaded.kind, loaded.resolved_path),
                    calib=calib_facts(calib), tool_version=__version__,
                    check=runtime_check(result, run.runtime))
        except Exception as e:  # noqa: BLE001 - every rank learns it and exits with it
            error = e
    distributed.agree(error)
    return run.report(result, sizes, calib) if distributed.is_main() else None


# The execution strategies, by the path ``strategy.choose`` names: one interface, (Run) ->
# report (None on a torchrun rank that does not write). A new strategy is a function here and
# a reason in ``strategy.choose`` to pick it.
STRATEGIES: dict[str, Callable[[Run], dict | None]] = {
    "model-free": _model_free, "sequential": _streaming, "in-memory": _in_memory}


def runtime_check(result, runtime: str | None):
    """The static vLLM rules on the complete temporary checkpoint: violations become warnings
    in the report, or (``runtime="vllm"``) an error before anything is written."""
    def check(tmp):
        errors = [x for x in static_violations(tmp, "vllm") if x.severity == "error"]
        if errors and runtime == "vllm":
            raise RuntimeRefused(f"vLLM would not serve this checkpoint: {errors[0].line()}"
                                 + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""))
        result.warnings += [f"vllm: {x.line()}" for x in errors]

    return check


def check_output(output, force: bool) -> None:
    out = Path(output).expanduser()
    if (out.exists() or out.is_symlink()) and not force:
        raise UsageError(f"output directory {out.absolute()} already exists (use --force to "
                         "replace it)")
    check_writable(out)


def absolute_calib_path(recipe: Recipe) -> Recipe:
    """A local calibration file is recorded by absolute path, so that ``--recipe OUTPUT``
    reproduces the run from any working directory."""
    path = Path(recipe.calib_data).expanduser() if recipe.calib_data else None
    return recipe.merged(calib_data=str(path.absolute())) if path and path.is_file() else recipe


@contextmanager
def _no_transformers_bars():
    """transformers' own tqdm "Loading weights" bar would duplicate the caller's progress."""
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
            "windows": calib.windows,
            "start_ids": None if calib.start_ids is None else list(calib.start_ids)}


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


__all__ = ["STRATEGIES", "Run", "RunPlan", "RuntimeRefused", "absolute_calib_path",
           "calib_facts", "check_output", "quantize", "report_dict", "runtime_check",
           "target_request"]
