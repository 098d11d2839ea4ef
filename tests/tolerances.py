"""Tolerances derived from the float32 arithmetic behind the quantities a test compares.

Two code paths that evaluate the same quantity from the same float32 model outputs (log-softmax
then gather vs cross_entropy, float64 vs float32 sums, chunked vs whole output layer) round
differently, and how differently depends on the CPU's kernels and the thread count. A fixed
relative tolerance that happens to hold on one CPU fails on another; these bounds follow from
the float32 epsilon and the size of the terms instead.
"""

from __future__ import annotations

import math

import torch

F32_EPS = torch.finfo(torch.float32).eps

# Rounding steps one per-token term and its float32 mean carry, in ulps of the term's size:
# the log-softmax's subtraction and logsumexp (~2), the float32 mean's cascaded sum (~log2 of
# the token count for the few hundred tokens the tests score, bounded by 8 together).
NLL_ULPS = 8


def perplexity_rel_tolerance(ppl: float) -> float:
    """Relative tolerance of one perplexity evaluated by two float32 code paths. The mean
    negative log-likelihood log(ppl) is known to ``NLL_ULPS`` float32 ulps of the per-token
    terms' size (about log(ppl), at least 1 nat); ppl = exp(mean) turns that absolute error into
    a relative one (d ppl / ppl = d log ppl)."""
    return NLL_ULPS * F32_EPS * max(abs(math.log(ppl)), 1.0)


def pct_delta_abs_tolerance(measured: float, baseline: float) -> float:
    """Absolute tolerance of the percentage delta 100 (measured - baseline) / baseline when
    ``measured`` comes from another float32 code path than the reference (``baseline`` the
    same number in both): 100 x the relative error of ``measured`` x measured / baseline. A
    relative tolerance on the delta itself would shrink with the delta (two nearly equal
    perplexities) while the rounding does not."""
    return 100 * perplexity_rel_tolerance(measured) * measured / baseline
