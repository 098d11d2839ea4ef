"""``fp8ptq.evaluate``: a model and its variants evaluated as one library call, exactly what
``fp8ptq eval`` does before it prints (the CLI only parses flags, prints the table and writes
the files).

Everything that can fail without a model - task names, data files, the calibration-overlap
policy, the variants' sources - fails before the first model loads."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config.plan import needs_calibration
from ..config.recipe import Recipe
from ..execution import job
from ..io.loading import check_model_spec
from . import runner
from .compare import (
    calibration_files,
    check_calib_overlap,
    checkpoint_meta,
    evaluate_variants,
    plan_variants,
)
from .harness import check_windows
from .report import attach_intervals


@dataclass
class Evaluation:
    """One row per variant (baseline first) with metrics, deltas and paired intervals; the
    protocol (how each variant was scored); notes; the calibration set that was used."""

    rows: list[dict]
    protocol: dict
    notes: list[str] = field(default_factory=list)
    calib: object = None

    @property
    def stage_seconds(self) -> dict[str, float]:
        """Seconds per stage (load, calibrate+quantize, eval) summed over the variants."""
        out: dict[str, float] = {}
        for row in self.rows:
            for stage, value in (row.get("timings") or {}).items():
                value = sum(value.values()) if isinstance(value, dict) else value
                out[stage] = out.get(stage, 0.0) + value
        return out


@dataclass
class EvalRequest:
    """What ``evaluate`` will run, checked before any model loads (``prepare``): the variants,
    the recipe the on-the-fly ones are quantized with, and the calibration documents."""

    variants: list
    recipe: Recipe
    tasks: list[str]
    notes: list[str]
    texts: object
    options: dict

    @property
    def has_baseline(self) -> bool:
        return self.variants[0].kind == "baseline"

    def run(self, progress=None) -> Evaluation:
        rows, protocol, calib = evaluate_variants(
            self.variants, self.recipe, self.texts, self.tasks, self.notes,
            progress=progress, **self.options)
        attach_intervals(rows)
        return Evaluation(rows, protocol, self.notes, calib)


def prepare(model: str, tasks: list[str], compare: list[str] | None = None, *,
            recipe: Recipe | dict | None = None, data: dict[str, str] | None = None,
            limit: int | None = None, batch_size: int | None = None,
            seq_len: int | None = None, include_path: str | None = None,
            device: str = "cpu", load_options: dict | None = None,
            prefix_token: str = "auto", window_start: str = "first",
            allow_calib_overlap: bool = False) -> EvalRequest:
    """Everything ``evaluate`` checks before a model loads: the variants' sources, the
    calibration-overlap policy, task names and data files, the calibration documents."""
    check_model_spec(model)
    check_windows(prefix_token, window_start)
    model_meta = checkpoint_meta(model)
    if recipe is None:
        recipe = Recipe.load(model) if model_meta is not None else Recipe()
    elif not isinstance(recipe, Recipe):
        recipe = Recipe().merged(**recipe)
    data = dict(data or {})
    device = job.resolve_device(device)
    variants, notes = plan_variants(model, model_meta, list(compare or []), recipe)
    notes += check_calib_overlap(calibration_files(variants, recipe), data, allow_calib_overlap)
    # built-in names, data files, include path and lm-eval task names, before any model loads
    runner.check_request(tasks, data, include_path, extractive=False)
    calibrated = [v for v in variants if v.kind == "quantized" and needs_calibration(v.recipe)]
    texts = job.calibration_texts(recipe, calibrated[0].spec) if calibrated else None
    options = dict(data=data, limit=limit, batch_size=batch_size, seq_len=seq_len,
                   include_path=include_path, device=device,
                   load_options=dict(load_options or {}), prefix_token=prefix_token,
                   window_start=window_start)
    return EvalRequest(variants, recipe, list(tasks), notes, texts, options)


def evaluate(model: str, tasks: list[str], compare: list[str] | None = None, *, progress=None,
             **options) -> Evaluation:
    """Evaluate ``model`` and each of ``compare`` (formats or schemes quantized on the fly with
    ``recipe``, dtypes, checkpoint folders) on ``tasks`` (wikitext, squad, lm-eval task
    names); ``data`` maps a task to a local file. When ``model`` is an fp8ptq checkpoint and no
    recipe is given, variants quantized on the fly use the recipe it was made with. The other
    ``options`` are ``prepare``'s."""
    return prepare(model, tasks, compare, **options).run(progress)


__all__ = ["EvalRequest", "Evaluation", "evaluate", "prepare"]
