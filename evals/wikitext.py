"""WikiText perplexity through lm-eval's ``loglikelihood_rolling`` (rolling windows in HFLM).

The task is lm-eval's built-in ``wikitext`` (same detokenizer, same word/byte metrics) plus a
token-level perplexity; it reads a local raw file (split into articles like the hub's
document-level copy) or, without a file, the hub data set.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import datasets
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks.wikitext.preprocess_wikitext import process_results as wikitext_scores
from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer

from fp8ptq.errors import DataError

from .harness import TaskOutcome, evaluate, flatten_metrics

TASK = "wikitext"
SPLIT_RULE = "articles on ' = X = ' headings"
HUB_DATASET = ("EleutherAI/wikitext_document_level", "wikitext-2-raw-v1")

# A level-1 heading is a whole line " = Title = "; " = = Section = = " lines stay in the article.
_ARTICLE_START = re.compile(r"(?m)^(?= = [^=].* = $)")

# metric -> lm-eval aggregation; all four are lower-is-better
_METRICS = {
    "word_perplexity": "weighted_perplexity",
    "byte_perplexity": "weighted_perplexity",
    "bits_per_byte": "bits_per_byte",
    "token_perplexity": "weighted_perplexity",
}


def split_articles(text: str) -> list[str]:
    """Cut raw WikiText into articles at level-1 headings; the articles concatenate to ``text``
    (less any whitespace-only preamble)."""
    return [piece for piece in _ARTICLE_START.split(text) if piece.strip()]


def read_articles(path: str | Path) -> list[dict[str, str]]:
    """``[{"page": article}, ...]`` from a raw WikiText file (CRLF read as LF)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"wikitext data file not found: {path}")
    articles = split_articles(path.read_text(encoding="utf-8"))
    if not articles:
        raise DataError(f"wikitext data file has no text: {path}")
    return [{"page": article} for article in articles]


def task_config(lm: HFLM, articles: list[dict[str, str]] | None = None) -> dict:
    """lm-eval inline task config: the built-in ``wikitext`` task plus ``token_perplexity``.

    ``articles`` None reads the hub's document-level WikiText-2 test split instead.
    """

    def process_results(doc, results):
        scores = wikitext_scores(doc, results)
        (loglikelihood,) = results
        # HFLM predicts every scored token once, the first after the prefix token
        scored = len(scored_ids(lm, wikitext_detokenizer(doc)))
        scores["token_perplexity"] = (loglikelihood, scored)
        return scores

    config = {
        "task": TASK,
        "output_type": "loglikelihood_rolling",
        "test_split": "test",
        "num_fewshot": 0,
        "doc_to_text": "",
        "doc_to_target": wikitext_detokenizer,
        "process_results": process_results,
        "metric_list": [
            {"metric": name, "aggregation": aggregation, "higher_is_better": False}
            for name, aggregation in _METRICS.items()
        ],
        "metadata": {"version": 2.0},
    }
    if articles is None:
        config["dataset_path"], config["dataset_name"] = HUB_DATASET
    else:
        test_split = datasets.DatasetDict({"test": datasets.Dataset.from_list(articles)})
        config["custom_dataset"] = lambda **_: test_split
    return config


def scored_ids(lm: HFLM, text: str) -> list[int]:
    """The tokens of document ``text`` that ``lm``'s rolling log-likelihood scores (an HFLM
    of lm-eval's own scores every token ``tok_encode`` gives)."""
    if hasattr(lm, "scored_ids"):
        return lm.scored_ids(text)
    return lm.tok_encode(text)


def _token_name(tokenizer, token_id) -> str:
    which = "bos" if token_id == tokenizer.bos_token_id else \
        "eos" if token_id == tokenizer.eos_token_id else "other"
    return f"{which} {tokenizer.convert_ids_to_tokens(token_id)!r}"


def prefix_effect(lm: HFLM, text: str) -> float:
    """Perplexity over a document's tokens 2..n with the prefix token in front, divided by the
    same without it (conditioned on the document's own first token): far from 1 means the
    chosen prefix is a context the model does not expect (e.g. an end-of-text token for a model
    trained with a BOS), a regime in which every perturbation moves perplexity by percents.
    Scored through ``lm``'s own log-likelihood path, so a chunked LM never holds a document's
    context x vocabulary float32 logits (4 GB at context 2048 with a 262k vocabulary)."""
    tokens = scored_ids(lm, wikitext_detokenizer({"page": text}))[: lm.max_length - 1]
    if len(tokens) < 3:
        return 1.0
    (with_prefix, _), (without, _) = lm._loglikelihood_tokens(
        [(None, [lm.prefix_token_id, tokens[0]], tokens[1:]), (None, [tokens[0]], tokens[1:])])
    return math.exp((without - with_prefix) / (len(tokens) - 1))


def evaluate_wikitext(lm: HFLM, data: str | Path | None = None, *,
                      limit: int | None = None) -> TaskOutcome:
    """Perplexities of the first ``limit`` articles of ``data`` (a raw WikiText file; None: hub)."""
    articles = read_articles(data) if data is not None else None
    results, samples = evaluate(lm, task_config(lm, articles), limit=limit)
    docs = samples[TASK]
    bos_id = lm.tokenizer.bos_token_id
    protocol = {
        "context_length": lm.max_length,
        # context_len=1 rolling windows: disjoint, each conditioned on the last token of the
        # previous one (``every``: and opened by the prefix token, one token shorter)
        "stride": lm.max_length - (getattr(lm, "window_start", "first") == "every"),
        "window_start": getattr(lm, "window_start", "first"),
        "bos": bos_id is not None and lm.prefix_token_id == bos_id,
        "prefix_token_id": lm.prefix_token_id,
        "prefix_token": "none (first token of each document is context)"
        if getattr(lm, "scored_offset", 0) else _token_name(lm.tokenizer, lm.prefix_token_id),
        # the tokenizer opens every encoding with the prefix token itself: its copy taken off
        # (``RollingDocs``), so a document opens with one start token, not two
        "own_start_dropped": not getattr(lm, "scored_offset", 0)
        and len(scored_ids(lm, "a")) < len(lm.tok_encode("a")),
        "documents": len(docs),
        "split": SPLIT_RULE,
        "tokens": sum(doc["token_perplexity"][1] for doc in docs),
        "source": str(data) if data is not None else "/".join(HUB_DATASET) + ":test",
    }
    return TaskOutcome(flatten_metrics(results[TASK]), protocol, docs)
