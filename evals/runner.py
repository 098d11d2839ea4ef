"""``run_tasks``: evaluate one loaded model on named tasks, one flat metrics dict out."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from lm_eval.tasks import TaskManager

from fp8ptq.errors import DataError, UsageError
from fp8ptq.model.gemm32 import float32_gemms

from . import squad, wikitext
from .extractive_qa import SpanSettings, is_extractive_qa, predict_answers
from .harness import TaskOutcome, evaluate, flatten_metrics, float32_logits, make_lm
from .stats import Records, mean_records, wikitext_records

BUILT_IN = (wikitext.TASK, squad.TASK)


@dataclass
class EvalResult:
    metrics: dict[str, float] = field(default_factory=dict)  # "task.metric" -> value
    protocol: dict[str, dict] = field(default_factory=dict)  # task -> how it was measured
    seconds: dict[str, float] = field(default_factory=dict)  # task -> wall time
    # task -> per-sample records (confidence intervals of deltas; --samples)
    records: dict[str, Records] = field(default_factory=dict)
    samples: dict[str, list[dict]] = field(default_factory=dict)  # task -> auditable records


def run_tasks(
    model,
    tokenizer,
    tasks: list[str],
    *,
    data: dict[str, str] | None = None,
    limit: int | None = None,
    batch_size: int | None = 8,
    seq_len: int | None = None,
    include_path: str | None = None,
    device: str = "cpu",
    prefix_token: str = "auto",
    window_start: str = "first",
) -> EvalResult:
    """Evaluate ``model`` (moved to ``device``) on ``tasks``.

    ``wikitext`` and ``squad`` read ``data[task]`` (a raw WikiText file / a SQuAD v1.1 JSON; absent:
    the hub copy). Any other name is an lm-eval task, looked up in ``include_path`` then lm-eval's
    own. ``limit``: first N documents / questions / samples of each task.
    """
    data = data or {}
    extractive = is_extractive_qa(model)
    task_manager = check_request(tasks, data, include_path, extractive)
    if getattr(model, "hf_device_map", None) is None and \
            model.device.type != torch.device(device).type:  # "cuda" and "cuda:0" count as one;
        # a model dispatched by an accelerate device map stays where accelerate put it
        model.to(device)
    lm = None if extractive else make_lm(model, tokenizer, batch_size=batch_size, seq_len=seq_len,
                                         prefix_token=prefix_token, window_start=window_start)

    result = EvalResult()
    for task in tasks:
        started = time.perf_counter()
        try:
            # bf16 / fp16 GEMMs and attention in float32 on CPUs without fast kernels for them
            # (fp8ptq.model.gemm32): several times faster, same values up to one rounding
            with float32_logits(model), float32_gemms(model=model):
                outcome = _run_one(task, model, tokenizer, lm, data, limit, batch_size, seq_len,
                                   task_manager)
        except ConnectionError as exc:  # a hub data set while offline
            hint = f"; give a local file for {task}" if task in BUILT_IN else ""
            raise DataError(f"{task}: {exc}{hint}") from exc
        result.seconds[task] = time.perf_counter() - started
        result.protocol[task] = outcome.protocol
        result.metrics.update({_key(task, metric): v for metric, v in outcome.metrics.items()})
        records = _records(task, outcome)
        if records is not None:
            result.records[task] = records
        result.samples[task] = _auditable(task, outcome)
    return result


def _records(task: str, outcome: TaskOutcome) -> Records | None:
    if not outcome.samples:
        return None
    if task == wikitext.TASK:
        return wikitext_records(outcome.samples)
    ids = [s.get("doc_id", i) for i, s in enumerate(outcome.samples)]
    return mean_records(outcome.samples, outcome.metrics, ids)


def _auditable(task: str, outcome: TaskOutcome) -> list[dict]:
    """Per-sample records a user can check any number against (``--samples``): the scores, the
    prediction or log-likelihood, never the whole document."""
    out = []
    for i, s in enumerate(outcome.samples):
        rec = {"doc_id": s.get("doc_id", i)}
        for k, v in s.items():
            if k in ("doc", "arguments", "resps", "filtered_resps", "target", "doc_hash",
                     "prompt_hash", "target_hash", "filter", "metrics"):
                continue
            rec[k] = v
        if task == wikitext.TASK:
            rec["loglikelihood"] = s["word_perplexity"][0]
            rec["words"], rec["bytes"] = s["word_perplexity"][1], s["byte_perplexity"][1]
        elif "filtered_resps" in s:
            rec["prediction"] = s["filtered_resps"]
        out.append(rec)
    return out


def _run_one(task, model, tokenizer, lm, data, limit, batch_size, seq_len, task_manager):
    if task == wikitext.TASK:
        return wikitext.evaluate_wikitext(lm, data.get(task), limit=limit)
    if task == squad.TASK:
        return _squad(model, tokenizer, lm, data.get(task), limit, batch_size, seq_len)
    return _lm_eval_task(lm, task, limit, task_manager)


def _key(task: str, metric: str) -> str:
    # a group's subtask metrics arrive qualified already ("subtask.metric"), see _lm_eval_task
    return metric if "." in metric else f"{task}.{metric}"


def check_request(tasks, data, include_path, extractive) -> TaskManager | None:
    """Fail before any model work: unknown tasks, missing files, a task the model can't do."""
    if not tasks:
        raise UsageError("no tasks given")
    for task, path in data.items():
        if task not in BUILT_IN:
            raise UsageError(f"data files are read by {' and '.join(BUILT_IN)} only, not {task!r}")
        if not Path(path).is_file():
            raise DataError(f"{task} data file not found: {path}")
    if extractive and set(tasks) != {squad.TASK}:
        other = ", ".join(sorted(set(tasks) - {squad.TASK}))
        raise UsageError(f"a question-answering model runs only 'squad', not {other}")
    if include_path is not None and not Path(include_path).is_dir():
        raise UsageError(f"include path is not a directory: {include_path}")
    others = [task for task in tasks if task not in BUILT_IN]
    return _task_manager_for(others, include_path) if others else None


def _task_manager_for(names: list[str], include_path: str | None) -> TaskManager:
    # indexing lm-eval's own ~15k task files takes seconds: try the include path alone first
    if include_path is not None:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(name in local.all_tasks for name in names):
            return local
    manager = TaskManager(include_path=include_path)
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        raise UsageError(
            f"unknown task {', '.join(map(repr, unknown))} "
            f"(built in: {', '.join(BUILT_IN)}; others must be lm-eval tasks or in --include-path)"
        )
    return manager


def _squad(model, tokenizer, lm, path, limit, batch_size, seq_len) -> TaskOutcome:
    """Generative through lm-eval for a causal LM (``lm``), span prediction for a QA model."""
    examples = squad.load_examples(path, limit=limit)
    source = str(path or squad.HUB_DATASET)
    if lm is not None:
        return squad.evaluate_generative(lm, examples, source=source)
    settings = SpanSettings(max_length=seq_len) if seq_len else SpanSettings()
    answers = predict_answers(model, tokenizer, examples, batch_size=batch_size or 8,
                              settings=settings)
    protocol = {"mode": "extractive", **settings.as_protocol(), "questions": len(examples),
                "source": source}
    per_question = [{"doc_id": e.get("id", i), "prediction": a, **squad.score(a, e["answers"])}
                    for i, (a, e) in enumerate(zip(answers, examples))]
    return TaskOutcome(squad.score_all(answers, examples), protocol, per_question)


def _lm_eval_task(lm, task: str, limit: int | None, task_manager: TaskManager) -> TaskOutcome:
    results, samples = evaluate(lm, task, limit=limit, task_manager=task_manager)
    metrics = {}
    for name, task_results in results.items():
        prefix = "" if name == task else f"{name}."
        metrics.update({f"{prefix}{m}": v for m, v in flatten_metrics(task_results).items()})
    protocol = {
        "lm_eval_task": task,
        "limit": limit,
        "context_length": lm.max_length,
        "samples": {name: len(s) for name, s in samples.items()},
    }
    # per-sample records of the task itself (groups of subtasks get no interval)
    return TaskOutcome(metrics, protocol, samples.get(task, []))
