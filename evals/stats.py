"""How much of a delta is noise: paired bootstrap confidence intervals from per-sample records.

Every metric fp8ptq reports is a function of sums over documents or questions: perplexities
are ``exp(-sum(loglikelihood) / sum(units))`` over documents (words, bytes or tokens), bits per
byte ``-sum(loglikelihood) / (sum(bytes) ln 2)``, accuracy / EM / F1 means over questions. So
each task keeps, per sample, the additive columns its metrics are made of (``Records``), and
a delta between two variants evaluated on the same samples gets a *paired* bootstrap interval:
resample the samples with replacement (the same indices for both variants), recompute both
metrics, take the 2.5th and 97.5th percentiles of the difference (on up to 7 samples every
distinct resample is enumerated with its exact probability instead) (Efron & Tibshirani, "An
Introduction to the Bootstrap", 1993, ch. 13; Koehn, "Statistical Significance Tests for
Machine Translation Evaluation", 2004, for the paired use). Pairing removes the between-sample
variance both variants share, which is most of it: on WikiText a 2-article slice moves the
perplexity of every variant together.
"""

from __future__ import annotations

import itertools
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
    exact = exact_resamples(len(base))
    if exact is not None:
        index, weight = exact
    else:
        rng = np.random.default_rng(seed)
        index = rng.integers(0, len(base), size=(resamples, len(base)))
        weight = np.full(resamples, 1.0 / resamples)
    b, o = base.metric(metric, index), other.metric(metric, index)
    with np.errstate(divide="ignore", invalid="ignore"):
        delta, pct = o - b, 100.0 * (o - b) / np.abs(b)
    # separately: a resample whose baseline is 0 has a delta but no relative delta
    ok, pok = np.isfinite(delta), np.isfinite(pct)
    if not ok.any():
        return None
    if exact is not None:
        lo, hi = weighted_quantiles(delta[ok], weight[ok] / weight[ok].sum(), (0.025, 0.975))
        plo, phi = weighted_quantiles(pct[pok], weight[pok] / weight[pok].sum(),
                                      (0.025, 0.975)) if pok.any() else (None, None)
    else:
        lo, hi = np.percentile(delta[ok], [2.5, 97.5])
        plo, phi = np.percentile(pct[pok], [2.5, 97.5]) if pok.any() else (None, None)
    return {"ci95": [float(lo), float(hi)],
            "pct_ci95": None if plo is None else [float(plo), float(phi)],
            "resamples": int(ok.sum()), "exact": exact is not None}


EXACT_MAX = 5000  # distinct resamples enumerated instead of drawn (n <= 7 samples)


def exact_resamples(n: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Every distinct bootstrap resample of ``n`` samples (a multiset of indices) with its
    probability under resampling with replacement, multinomial ``n! / prod(c_i!) / n**n``;
    ``None`` when there are more than ``EXACT_MAX`` of them (C(2n-1, n)). On such tiny slices a
    drawn bootstrap would add its own noise to an interval that can be computed exactly."""
    if math.comb(2 * n - 1, n) > EXACT_MAX:
        return None
    rows = np.array(list(itertools.combinations_with_replacement(range(n), n)), dtype=np.int64)
    counts = np.stack([(rows == i).sum(axis=1) for i in range(n)], axis=1)
    log_w = math.lgamma(n + 1) - np.vectorize(math.lgamma)(counts + 1).sum(axis=1) \
        - n * math.log(n)
    return rows, np.exp(log_w)


def weighted_quantiles(x: np.ndarray, w: np.ndarray, qs) -> list[float]:
    """Lower quantiles of a discrete distribution: the smallest value whose cumulative
    probability reaches q (up to rounding of the probabilities)."""
    order = np.argsort(x, kind="stable")
    cdf = np.cumsum(w[order])
    return [float(x[order][min(np.searchsorted(cdf, q - 1e-12), len(x) - 1)]) for q in qs]


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
