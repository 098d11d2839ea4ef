"""``fp8ptq sensitivity`` as one library call: the analysis of MODEL, in memory or streamed.

Where the analysis runs is decided here, not by the command: block by block from the
safetensors folder (``fp8ptq.execution.sensitivity_stream``) with ``--sequential``, or when a plain
``--max-memory SIZE`` is too small for the whole model (``fp8ptq.execution.strategy`` sizes it
as for ``quantize``); else the model is loaded whole (``analyze``). The CLI parses flags into
these arguments, calls ``run_sensitivity`` and prints the result, as ``fp8ptq quantize`` does
with ``fp8ptq.quantize``. It sits in ``fp8ptq.execution``, above the analysis it runs
(``fp8ptq.sensitivity``), since it builds on the quantize job and strategy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config.recipe import Recipe
from ..errors import DataError, UsageError
from ..io.data import FILE_SUFFIXES, load_texts
from ..io.placement import materialize_offloaded
from ..runtime.usage import timed
from ..sensitivity.report import SensitivityResult
from ..sensitivity.run import (
    DEFAULT_EVAL_DATA,
    DEFAULT_STAT_FORMATS,
    analyze,
    check_recipe,
    eval_windows,
)
from ..sensitivity.suggest import parse_target
from ..sensitivity.swap import plan_format
from . import job, strategy
from .in_memory import token_batches
from .sensitivity_stream import analyze_streamed
from .streaming import calibration_from_folder


@dataclass
class SensitivityRun:
    """What ``run_sensitivity`` returns: the result (its ``seconds`` include loading and
    tokenizing), the calibration windows it measured on (their facts go into ``--json``)."""

    result: SensitivityResult
    calib: object


def streamed_selection(spec: str, recipe: Recipe, metric: str, sequential: bool = False,
                       max_memory: int | None = None, fmt: str | None = None
                       ) -> strategy.Selection | None:
    """The path's selection when the analysis streams block by block (``sequential``, or a
    ``max_memory`` process budget the model does not fit in: sized with the plan of ``fmt``,
    the measured format), else None; a ``UsageError`` when the metric needs the whole
    model."""
    if not sequential and max_memory is None:
        return None
    if max_memory is None:
        chosen = strategy.choose(spec, recipe, sequential=True)
    else:
        chosen = strategy.by_budget(spec, recipe, max_memory, forced_sequential=sequential,
                                    planner=lambda model: plan_format(model, recipe, fmt))
        if chosen.path == "in-memory":
            return None
    if metric == "ppl":
        raise UsageError("--metric ppl runs the whole model once per unit and cannot stream "
                         "block by block; use --metric sqnr (it streams: --sequential, or "
                         "--max-memory SIZE), or --device-map to offload")
    return chosen


def eval_texts(spec: str, tokens: int, seq_len: int) -> list[str]:
    """The perplexity slice's documents, read before the (long) model load."""
    if tokens < 2 or seq_len < 2:
        raise UsageError(f"--eval-tokens and --eval-seq-len must be >= 2, got {tokens}, "
                         f"{seq_len}")
    local = Path(spec).expanduser()
    if not local.exists() and (local.suffix.lower() in FILE_SUFFIXES
                               or spec.startswith(("/", ".", "~"))):
        raise DataError(f"--eval-data file not found: {spec}")
    return load_texts(spec)


def run_sensitivity(model: str, recipe: Recipe, *, formats=("e4m3",),
                    stat_formats=DEFAULT_STAT_FORMATS, level: str = "module",
                    metric: str = "ppl", eval_data: str | None = None, eval_tokens: int = 2048,
                    eval_seq_len: int = 512, eval_batch_size: int = 4, target: str = "1%",
                    verify: bool = True, sequential: bool = False,
                    max_memory: int | None = None, device: str = "cpu",
                    load_options: dict | None = None, progress=None) -> SensitivityRun:
    """The sensitivity of MODEL ``model`` (hub id, local folder, ...) under ``recipe``:
    ``formats`` measured with ``metric`` (the first is the suggestion's base format),
    ``stat_formats`` summarized, per ``level`` unit, the suggestion for ``target``.
    ``sequential`` / ``max_memory`` (the process's budget in bytes) may stream it block by
    block (``streamed_selection``); ``progress``: ``step(description)`` / ``counter(
    description)(total)`` as for ``fp8ptq.quantize`` (``fp8ptq.execution.job.NoProgress``)."""
    progress = progress or job.NoProgress()
    check_recipe(recipe)
    parse_target(target)
    streamed = streamed_selection(model, recipe, metric, sequential, max_memory, formats[0])
    eval_spec = eval_data or DEFAULT_EVAL_DATA
    texts = eval_texts(eval_spec, eval_tokens, eval_seq_len) if metric == "ppl" else None

    def bar(description, total):
        return progress.counter(description)(total)

    prep: dict[str, float] = {}
    if streamed is not None:
        with timed(prep, "tokenize"):
            _, calib, batches = calibration_from_folder(streamed.folder, recipe,
                                                        job.calibration_texts(recipe))
        result, _ = analyze_streamed(
            streamed.folder, recipe, batches, formats=formats, stat_formats=stat_formats,
            level=level, target=target, activation_budget=streamed.activation_budget or 1 << 30,
            progress=bar)
        result.warnings.insert(0, f"{streamed.path}: {streamed.reason}")
    else:
        with progress.step(f"loading {model}"), timed(prep, "load"):
            loaded = job.load(model, recipe, device=device, **(load_options or {}))
            materialize_offloaded(loaded.model)  # modules are swapped one at a time below
        with progress.step("tokenizing"), timed(prep, "tokenize"):
            calib = job.calibration_set(loaded, recipe)
            windows = None if texts is None else eval_windows(
                texts, loaded.tokenizer, tokens=eval_tokens, seq_len=eval_seq_len,
                seed=recipe.seed, source=eval_spec)
        device_ = next(loaded.model.parameters()).device
        batches = list(token_batches(calib.input_ids, recipe.batch_size, device_))
        result = analyze(
            loaded.model, recipe, batches, formats=formats, stat_formats=stat_formats,
            level=level, metric=metric, eval_ids=None if windows is None else windows.input_ids,
            eval_batch_size=eval_batch_size, target=target, verify=verify, progress=bar)
        if windows is not None:
            result.eval.update(source=eval_spec, sha256=windows.sha256)
    result.seconds = {**prep, **result.seconds}
    return SensitivityRun(result, calib)


__all__ = ["SensitivityRun", "eval_texts", "run_sensitivity", "streamed_selection"]
