"""BatchNorm re-tuning for trans-precision inference (Sun et al. 2019 sec 3).

Quantizing the GEMM before a BatchNorm adds noise Q to its input Y: the BN input's variance grows
to sigma_Y^2 + sigma_Q^2 (and its mean may shift), while the running statistics still describe
the FP32 model. Re-estimating mean/var with the quantized model on a little unlabeled data makes
the output error grow sub-linearly instead of linearly in sigma_Q^2 (the paper's Eqn. 2; 2% of
one ImageNet epoch suffices there).
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import DataError
from ..model.forward import run_batch

BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def batchnorm_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """BatchNorms with running statistics (the others always normalise with batch stats)."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, BN_TYPES) and m.track_running_stats]


def retune_batchnorm(model: nn.Module, batches, progress=None) -> dict:
    """Re-estimate every BatchNorm's running mean/var on ``batches`` with the model as it is
    (quantized). Running stats are a cumulative average over all batches (momentum None); only
    the BNs run in train mode. Modes and momentum are restored; on error, so are the old stats.

    Returns ``layers``, ``batches``, ``mean_shift`` (mean |new - old| running mean, averaged over
    layers), ``var_ratio`` (mean new/old running var, averaged over layers), and ``per_layer``.
    """

    bns = batchnorm_layers(model)
    if not bns:
        return {"layers": 0}
    batches = list(batches) if batches is not None else []
    if not batches:
        raise DataError("BatchNorm re-tuning needs at least one calibration batch")

    old = {name: [t.clone() for t in _stats(bn)] for name, bn in bns}
    modes = {m: m.training for m in model.modules()}
    momenta = {bn: bn.momentum for _, bn in bns}
    try:
        model.eval()
        for _, bn in bns:
            bn.reset_running_stats()
            bn.momentum = None
            bn.train()
        with torch.no_grad():
            for batch in batches:
                run_batch(model, batch)
                if progress is not None:
                    progress()
    except BaseException:
        for name, bn in bns:
            for buf, value in zip(_stats(bn), old[name]):
                buf.copy_(value)
        raise
    finally:
        for m, training in modes.items():
            m.training = training
        for bn, momentum in momenta.items():
            bn.momentum = momentum

    per_layer = {}
    for name, bn in bns:
        old_mean, old_var, _ = old[name]
        per_layer[name] = {
            "mean_shift": float((bn.running_mean - old_mean).abs().mean()),
            "var_ratio": float((bn.running_var / old_var.clamp(min=bn.eps)).mean()),
        }
    return {
        "layers": len(bns),
        "batches": len(batches),
        "mean_shift": _average(per_layer, "mean_shift"),
        "var_ratio": _average(per_layer, "var_ratio"),
        "per_layer": per_layer,
    }


def _stats(bn: nn.Module) -> tuple[torch.Tensor, ...]:
    return bn.running_mean, bn.running_var, bn.num_batches_tracked


def _average(per_layer: dict, key: str) -> float:
    return sum(v[key] for v in per_layer.values()) / len(per_layer)
