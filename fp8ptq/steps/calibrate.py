"""The calibration pass: which GEMMs a recipe quantizes, and one pass of the calibration
batches through the model that observes all of their inputs (merged across torchrun ranks)."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from ..config.plan import ModulePlan, plan_gemms
from ..config.recipe import Recipe
from ..model.forward import head_observed, micro_batches, run_batch
from ..model.gemm import input_channel_dim
from ..model.gemm32 import float32_gemms
from ..model.lean import lean_forwards
from ..nn.quant_experts import ExpertObserver
from ..observe import distributed
from ..observe.hessian import HessianCollector
from ..observe.observers import StatsCollector
from ..runtime.usage import release_free_memory
from .quantize_module import Target


def plan_targets(model: nn.Module, recipe: Recipe) -> tuple[list[ModulePlan], list[str]]:
    """Which GEMMs get quantized, in which formats, and which are skipped (``plan.plan_gemms``)."""
    return plan_gemms(model, recipe)


def collect_stats(model: nn.Module, targets: list[Target], batches: list, progress=None,
                  sample_batches: int = 0, taps=None, experts: ExpertObserver | None = None,
                  hessians: HessianCollector | None = None) -> StatsCollector:
    """Run the calibration data through the model once, observing every target's input (and,
    with ``experts``, every expert's GEMM inputs)."""
    modules = {t.name: t.module for t in targets}
    dims = {t.name: input_channel_dim(t.module) for t in targets}
    collector = StatsCollector(modules, dims, sample_batches=sample_batches)
    logits = head_observed(model, modules.values())  # else the head runs on one position
    error = None
    # micro-batches where every statistic adds exactly (GPTQ's X^T X sums would not)
    split = hessians is None or not hessians.modules
    with collector.observing(), experts.observing() if experts else nullcontext(), \
            hessians.observing() if hessians else nullcontext(), torch.inference_mode(), \
            float32_gemms(model=model), lean_forwards(model):
        try:
            # under torchrun each rank runs its share; global indices keep sample order
            for index, batch in distributed.shard(batches):
                collector.batch_index = index
                stride = collector.row_stride if index < sample_batches else 1
                for part in micro_batches(batch, multiple=stride) if split else [batch]:
                    run_batch(model, part, logits=logits)
                release_free_memory()
                if progress is not None:
                    progress()
        except Exception as e:  # noqa: BLE001 - re-raised by agree, on every rank
            error = e
    distributed.agree(error)
    if distributed.active():
        distributed.reduce_stats(collector.stats)
        collector.samples = distributed.gather_samples(collector.samples)
        if experts is not None:
            distributed.reduce_stats(experts.stats)
        if hessians is not None:
            distributed.reduce_sums(hessians.sums, hessians.rows)
    return collector
