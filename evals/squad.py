"""SQuAD v1.1: data, the official EM/F1, and the generative lm-eval task for causal LMs.

Extractive (``*ForQuestionAnswering``) models are scored by :mod:`fp8ptq.evals.extractive_qa`
with the same metric functions.
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import datasets
from lm_eval.models.huggingface import HFLM

from fp8ptq.errors import DataError

from .harness import TaskOutcome, evaluate, flatten_metrics

TASK = "squad"
HUB_DATASET = "rajpurkar/squad"
PROMPT = "Title: {{title}}\n\nBackground: {{context}}\n\nQuestion: {{question}}\n\n Answer:"
GENERATION = {"until": ["\n"], "do_sample": False, "max_gen_toks": 32}

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


# --- the official SQuAD v1.1 evaluation (evaluate-v1.1.py) -------------------------------------


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation, drop the articles a/an/the, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1(prediction: str, gold: str) -> float:
    """Harmonic mean of token precision and recall of the normalised answers."""
    predicted, expected = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = sum((Counter(predicted) & Counter(expected)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


def best_over_gold(metric: Callable[[str, str], float], prediction: str,
                   golds: Sequence[str]) -> float:
    return max(metric(prediction, gold) for gold in golds)


def score(prediction: str, golds: Sequence[str]) -> dict[str, float]:
    """One question's ``exact_match`` and ``f1`` in percent."""
    return {
        "exact_match": 100.0 * best_over_gold(exact_match, prediction, golds),
        "f1": 100.0 * best_over_gold(f1, prediction, golds),
    }


def score_all(predictions: Sequence[str], examples: Sequence[dict]) -> dict[str, float]:
    """Mean ``exact_match`` / ``f1`` (percent) of ``predictions`` against
    ``examples[i]["answers"]``."""
    if len(predictions) != len(examples) or not examples:
        raise ValueError("need one prediction per example, and at least one example")
    scores = [score(p, e["answers"]) for p, e in zip(predictions, examples)]
    return {name: sum(s[name] for s in scores) / len(scores) for name in ("exact_match", "f1")}


# --- data ---------------------------------------------------------------------------------------


def load_examples(path: str | Path | None = None, *, limit: int | None = None) -> list[dict]:
    """The first ``limit`` questions as
    ``{"id", "title", "context", "question", "answers": [str]}``.

    ``path`` is a SQuAD v1.1 JSON file (``data[].paragraphs[].qas[]``); None reads the hub's
    ``rajpurkar/squad`` validation split.
    """
    examples = _read_json(Path(path)) if path is not None else _read_hub()
    if not examples:
        raise DataError(f"no SQuAD questions in {path or HUB_DATASET}")
    return examples[:limit] if limit is not None else examples


def _read_json(path: Path) -> list[dict]:
    if not path.is_file():
        raise DataError(f"SQuAD data file not found: {path}")
    try:
        articles = json.loads(path.read_text(encoding="utf-8"))["data"]
        return [
            {
                "id": qa["id"],
                "title": article.get("title", ""),
                "context": paragraph["context"],
                "question": qa["question"],
                "answers": [answer["text"] for answer in qa["answers"]],
            }
            for article in articles
            for paragraph in article["paragraphs"]
            for qa in paragraph["qas"]
        ]
    except (ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{path} is not a SQuAD v1.1 JSON file ({type(exc).__name__}: "
                        f"{exc})") from None


def _read_hub() -> list[dict]:
    rows = datasets.load_dataset(HUB_DATASET, split="validation")
    return [
        {key: row[key] for key in ("id", "title", "context", "question")}
        | {"answers": list(row["answers"]["text"])}
        for row in rows
    ]


# --- generative task for causal LMs -------------------------------------------------------------


def _process_results(doc, results):
    (generation,) = results
    return score(generation, doc["answers"])


def task_config(examples: list[dict]) -> dict:
    """lm-eval inline ``generate_until`` task over ``examples``, scored with the official EM/F1."""
    test_split = datasets.DatasetDict({"test": datasets.Dataset.from_list(examples)})
    return {
        "task": TASK,
        "output_type": "generate_until",
        "custom_dataset": lambda **_: test_split,
        "test_split": "test",
        "num_fewshot": 0,
        "doc_to_text": PROMPT,
        "doc_to_target": "{{answers[0]}}",
        "generation_kwargs": dict(GENERATION),
        "process_results": _process_results,
        "metric_list": [
            {"metric": name, "aggregation": "mean", "higher_is_better": True}
            for name in ("exact_match", "f1")
        ],
        "metadata": {"version": 1.0},
    }


def evaluate_generative(lm: HFLM, examples: list[dict], *, source: str) -> TaskOutcome:
    """Greedy answers of a causal LM to ``examples``, zero-shot."""
    results, samples = evaluate(lm, task_config(examples))
    protocol = {
        "mode": "generative",
        "prompt": PROMPT,
        "generation": GENERATION,
        "context_length": lm.max_length,
        "questions": len(samples[TASK]),
        "source": source,
    }
    return TaskOutcome(flatten_metrics(results[TASK]), protocol, samples[TASK])
