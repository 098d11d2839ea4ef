"""Weight scales chosen by the Hessian-weighted rounding error (``--weight-calib gptq-hmse`` /
``hmse``).

Why: with a floating-point format (e4m3, e5m2, FNUZ, HFP8, HiF8, ExMy) the SIZE of a weight's
relative rounding error barely depends on its scale above the subnormals, but WHICH weights
round up and which down does. A row's (block's, tensor's) scale is therefore free within
``[amax / fmt_max, 1.15 amax / fmt_max)`` at almost no cost in range, and that one free
parameter can be spent on the weights that matter for the layer's output: the scale that
minimises ``sum_j H_jj (W_cj - s Q(W_cj / s))^2``, ``H_jj`` the diagonal of the calibration
inputs' Hessian (GPTQ's ``X^T X``: the energy of input ``j``). On SmolLM2 a few "sink" input
channels carry ~10^4x the energy of the others at the first position of every window (massive
activations), and there the GEMM output is set by ONE column, whose rounding error no other
column can compensate (GPTQ's sweep cannot either); this criterion makes those weights nearly
exact. For int8 (a uniform grid, where a larger scale costs resolution) the same criterion runs
over clip ratios ``[0.5, 1]`` instead: the activation-aware clip search of AWQ-style methods.

The candidates always include ``r = 1`` (max's scale), tried first, so the chosen scales'
weighted error is never above max's (ties keep max's). Where no Hessian exists (fused experts,
convolutions, the fused-shard per-tensor scale), every input counts the same: the plain weight
MSE over the same candidates. The scales are ordinary per-group scales, so the checkpoint
layouts are unchanged; GPTQ (``gptq-hmse``) or round-to-nearest (``hmse``) then uses them.
"""

from __future__ import annotations

import torch

from .mse import best_amax, weighted_errors

# 64 candidates: for floats a grid over one rounding period above amax (a relative step of
# e4m3's 3-bit mantissa is 1/16..1/8); for integers clip ratios (a uniform grid loses
# resolution above amax, clipping trades range for it).
FLOAT_RATIOS = torch.linspace(1.0, 1.15, 64)
INT_RATIOS = torch.linspace(1.0, 0.5, 64)
# with ``clip``: also clip candidates below amax for floats (MSE-style), 16 down to 0.8
FLOAT_CLIP_RATIOS = torch.cat([FLOAT_RATIOS, torch.linspace(0.9875, 0.8, 16)])


def hmse_ratios(fmt, clip: bool = False) -> torch.Tensor:
    """The candidate multiples of amax for ``fmt`` (the first is 1: max's scale)."""
    if not fmt.is_float:
        return INT_RATIOS
    return FLOAT_CLIP_RATIOS if clip else FLOAT_RATIOS


class HessianMseWeightCalibrator:
    """amax (clip range) per scale group minimising the Hessian-diagonal-weighted rounding
    error; ``amax(w2d, gran, fmt, hdiag)`` with ``hdiag`` the [in] input energies (None:
    all equal)."""

    name = "hmse"
    uses_hessian = True

    def __init__(self, clip: bool = False):
        self.clip = clip

    def amax(self, w2d: torch.Tensor, granularity, fmt,
             hdiag: torch.Tensor | None = None) -> torch.Tensor:
        amax = granularity.amax(w2d)
        if fmt.mx_block is not None or w2d.numel() == 0:
            return amax  # MX scales are the spec's power of two: nothing to choose
        ratios = hmse_ratios(fmt, self.clip)
        errors = weighted_errors(w2d, granularity, fmt, amax, ratios, hdiag)
        return best_amax(amax, ratios, errors)
