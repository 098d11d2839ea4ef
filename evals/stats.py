"""How much of a delta is noise: paired bootstrap confidence intervals from per-sample records.

Every metric fp8ptq reports is a function of sums over documents or questions: perplexities
are ``exp(-sum(loglikelihood) / sum(units))`` over documents (words, bytes or tokens), bits per
byte ``-sum(loglikelihood) / (sum(bytes) ln 2)``, accuracy / EM / F1 means over questions. So
each task keeps, per sample, the additive columns its metrics are made of (``Records``), and
a delta between two variants evaluated on the same samples gets a *paired* bootstrap interval:
resample the samples with replacement (the same indices for both variants), recompute both
metrics, take the 2.5th and 97.5th percentiles of the difference (Efron & Tibshirani, "An
Introduction to the Bootstrap", 1993, ch. 13; Koehn, "Statistical Significance Tests for
Machine Translation Evaluation", 2004, for the paired use). Pairing removes the between-sample
variance both variants share, which is most of it: on WikiText a 2-article slice moves the
perplexity of every variant together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

LN2 = math.log(2.0)
SEED = 1234
RESAMPLES = 1000


@dataclass
class Records:
    """Per-sample additive columns of one task, and how each metric is made of their sums.

    ``formulas[metric] = (kind, numerator column, denominator column or None)`` with kind
    ``ppl`` (exp(-num/den)), ``bpb`` (-num/(den ln 2)) or ``mean`` (scale * num/count)."""

    ids: list
    columns: dict[str, np.ndarray]
    formulas: dict[str, tuple[str, str, str | None]]
    scale: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.ids)

    def metric(self, name: str, index: np.ndarray | None = None) -> np.ndarray | float:
        """The metric on all samples, or on each row of resampled ``index`` [B, n]."""
        kind, num, den = self.formulas[name]
        x = self.columns[num]
        if index is None:
            s_num = x.sum()
            s_den = self.columns[den].sum() if den else len(x)
        else:
            s_num = x[index].sum(axis=-1)
            s_den = self.columns[den][index].sum(axis=-1) if den else index.shape[-1]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            if kind == "ppl":
                return np.exp(-s_num / s_den)
            if kind == "bpb":
                return -s_num / (s_den * LN2)
            return self.scale.get(name, 1.0) * s_num / s_den


def paired_interval(base: Records, other: Records, metric: str, *, resamples: int = RESAMPLES,
                    seed: int = SEED) -> dict | None:
    """95% intervals of ``other - base`` (absolute and in percent of base) for ``metric``;
    None when the two were not measured on the same samples."""
    if metric not in base.formulas or metric not in other.formulas or \
            base.ids != other.ids or len(base) < 2:
        return None
    rng = np.random.default_rng(seed)
    index = rng.integers(0, len(base), size=(resamples, len(base)))
    b, o = base.metric(metric, index), other.metric(metric, index)
    with np.errstate(divide="ignore", invalid="ignore"):
        delta, pct = o - b, 100.0 * (o - b) / np.abs(b)
    ok = np.isfinite(delta) & np.isfinite(pct)
    if not ok.any():
        return None
    lo, hi = np.percentile(delta[ok], [2.5, 97.5])
    plo, phi = np.percentile(pct[ok], [2.5, 97.5])
    return {"ci95": [float(lo), float(hi)], "pct_ci95": [float(plo), float(phi)],
            "resamples": int(ok.sum())}


# --- records from what the tasks return -------------------------------------------------------

WIKITEXT_UNITS = {"word_perplexity": "words", "byte_perplexity": "bytes",
                  "bits_per_byte": "bytes", "token_perplexity": "tokens"}


def wikitext_records(samples: list[dict]) -> Records:
    """lm-eval's per-document wikitext records: ``(loglikelihood, words)`` etc."""
    ll = np.array([float(s["word_perplexity"][0]) for s in samples])
    columns = {"loglikelihood": ll}
    for metric, unit in WIKITEXT_UNITS.items():
        columns[unit] = np.array([float(s[metric][1]) for s in samples])
    formulas = {m: ("bpb" if m == "bits_per_byte" else "ppl", "loglikelihood", unit)
                for m, unit in WIKITEXT_UNITS.items()}
    return Records([s.get("doc_id", i) for i, s in enumerate(samples)], columns, formulas)


def mean_records(rows: list[dict], metrics: dict[str, float] | None = None,
                 ids: list | None = None) -> Records | None:
    """Per-sample scalar scores whose task metric is their mean (accuracy, EM, F1, ...): a
    metric is kept only if the mean of its per-sample values reproduces the reported one (up to
    a percent scale), so a metric with another aggregation never gets a wrong interval."""
    if not rows:
        return None
    names = [k for k, v in rows[0].items() if _scalar(v) and all(_scalar(r.get(k)) for r in rows)]
    columns, formulas, scale = {}, {}, {}
    for name in names:
        x = np.array([float(r[name]) for r in rows])
        factor = 1.0
        if metrics is not None:
            reported = metrics.get(name)
            if reported is None:
                continue
            mean = float(x.mean())
            factor = next((f for f in (1.0, 100.0, 0.01)
                           if math.isclose(mean * f, reported, rel_tol=1e-6, abs_tol=1e-9)), None)
            if factor is None:
                continue
        columns[name], formulas[name], scale[name] = x, ("mean", name, None), factor
    if not formulas:
        return None
    return Records(ids if ids is not None else list(range(len(rows))), columns, formulas, scale)


def _scalar(v) -> bool:
    return isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool) \
        or isinstance(v, bool)
