"""The model-free path: a safetensors checkpoint quantized from its weights alone, no model built.

Recipes that read no activation statistics - weight-only (``--act-format none``), dynamic
per-token activations (``--act-granularity token``), per-tensor, per-channel or block weights,
the ``max`` / ``mse`` / ``cast`` weight calibrators - depend on each weight alone. So instead of
loading the model this path

1. builds the architecture on the meta device from config.json (``fp8ptq.io.source``) and takes
   the plan from ``fp8ptq.config.plan.build_plan``, the one place that decides what each module gets
   (skip, overrides, lm_head, routers, fused experts: the same rules as every other path);
2. maps checkpoint keys to parameters with transformers' own loading rules
   (``fp8ptq.io.weight_map``: renamings, per-expert tensors fused by its converters, dtypes);
3. cuts the work into units - one tensor; the shards of a fused group whose per-tensor weight
   scales are unified (q/k/v, gate/up: their tensors may sit in different files); one MoE
   layer's experts - ordered as the files are laid out;
4. runs the units through three overlapping stages (``fp8ptq.execution.model_free_run``): a reader
thread,
   compute threads quantizing with the pipeline's own functions (``quantize_target`` /
   ``quantize_experts_module`` on the meta model's modules, the weight passed in), and the
   caller's thread writing each unit through ``CheckpointWriter`` in order, then dropping it.

Memory is a few units in flight plus the writer's open shard, whatever the model's size; the
checkpoint equals the in-memory path's tensor for tensor (tests), with ``"path": "model-free"``
in fp8ptq.json's extras and in the report. Not here (they read calibration data or need the
whole model): static activation scales, SmoothQuant, GPTQ, rotation, attention / residual taps,
BatchNorm re-tuning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate.utils import set_module_tensor_to_device

from ..config.plan import ModulePlan, Planner, build_plan, run_facts
from ..config.recipe import Recipe
from ..errors import DataError, UsageError
from ..formats import decode
from ..io.source import SafetensorsSource
from ..io.weight_map import Load, SourceMap
from ..io.weights import build_empty
from ..model.gemm import weight_from_2d
from ..nn.fused import fused_groups, unified_weight_scales, unify_fused, unify_input_scales
from .in_memory import (
    QuantizeResult,
    high_precision_report,
    quantize_experts_module,
    quantize_target,
)


class NotModelFree(UsageError):
    """This job cannot run model-free (the in-memory path can): the reason is the message."""


def refusal(recipe: Recipe) -> str | None:
    """The stage of ``recipe`` that needs calibration data or the whole model, or None when
    the recipe can run model-free."""
    facts = run_facts(recipe)
    if facts.static_inputs:
        return ("static activation scales (--act-granularity tensor) are calibrated on "
                "activations; use --act-granularity token (dynamic) or --act-format none "
                "(weight-only)")
    for stage, needed in (("SmoothQuant (--smoothquant)", facts.smoothquant),
                          (f"GPTQ (--weight-calib {recipe.weight_calib})", facts.gptq),
                          ("--quantize-attention / --quantize-residual / --kv-cache", facts.taps),
                          ("--bn-retune", facts.bn_retune)):
        if needed:
            return f"{stage} needs calibration data"
    if recipe.rotate is not None:
        return "--rotate transforms the whole model at once"
    return None


@dataclass
class Unit:
    """Loads quantized (or copied) together, with the planned modules they complete."""

    loads: list[Load]
    gemms: list[ModulePlan] = field(default_factory=list)
    experts: list[ModulePlan] = field(default_factory=list)
    order: tuple = ()

    @property
    def sources(self) -> list[str]:
        return [s for ld in self.loads for s in ld.sources]


@dataclass
class UnitOutput:
    """What one unit gives the writer."""

    modules: list[str]
    tensors: dict[str, torch.Tensor]
    reports: list = field(default_factory=list)
    experts: dict = field(default_factory=dict)
    warnings: dict[str, list[str]] = field(default_factory=dict)  # module -> its warnings


class ModelFreeJob:
    """A checkpoint folder and a recipe, planned: ``units`` to run, nothing read yet. Raises
    ``NotModelFree`` when the recipe or the checkpoint does not allow the path, ``DataError``
    for a broken checkpoint (truncated shard, index naming a missing tensor)."""

    def __init__(self, folder: str | Path, recipe: Recipe, *, task: str | None = None,
                 planner: Planner | None = None):
        """``planner``: the run's plan, asked for the meta-device model built here (made here
        for a job outside a run)."""
        problem = refusal(recipe)
        if problem:
            raise NotModelFree(problem)
        self.folder, self.recipe = Path(folder), recipe
        # where the weights are encoded (``--device``): they are read to and written from the
        # CPU; a GPU does the scale choice and the rounding, the codes come back to be written
        self.device = "cpu"
        self.dtype = getattr(torch, recipe.dtype)
        self.source = SafetensorsSource(self.folder)
        self.model = build_empty(self.folder, self.dtype, task)
        if hasattr(self.model, "tie_weights"):  # tied names share one (meta) parameter
            self.model.tie_weights()
        self.plan = planner(self.model) if planner is not None else build_plan(self.model,
                                                                                recipe)
        if not self.plan.modules:
            raise UsageError("no GEMM module left to quantize (check --skip / --override)")
        self.map = SourceMap(self.model, self.source.names(), self.dtype)
        self.gran = self.plan.weight_granularity()
        self.w_calib = self.plan.weight_calibrator()
        self.a_calib = self.plan.act_calibrator()
        unify = unify_fused(recipe, self.plan.gemms)
        self.groups = fused_groups([t.name for t in self.plan.gemms]) if unify else []
        self.unify_experts = unify_fused(recipe, self.plan.experts)
        self._aliases()
        self.units = self._units()
        self._buffers = {k: v for k, v in self.model.state_dict().items()  # before quantizing
                         if k not in self.alias and k not in self.load_of and not v.is_meta}

    # -- which tensor is which ------------------------------------------------------------------

    def _aliases(self) -> None:
        """Tied parameters (one tensor, several names): the name the in-memory writer keeps
        (the tie source, as ``save_pretrained``) and the one load that provides them."""
        ties = set(getattr(self.model, "all_tied_weights_keys", None) or {})
        keys = list(self.model.state_dict(keep_vars=True))
        by_id: dict[int, list[str]] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(p), []).append(name)
        self.alias = {n: g for g in by_id.values() for n in g}
        order = {k: i for i, k in enumerate(keys)}
        self.kept, self.load_of, missing = {}, {}, []
        for key in keys:
            group = sorted(self.alias.get(key, [key]), key=lambda k: order.get(k, len(order)))
            self.kept[key] = next((k for k in group if k not in ties), group[0])
            load = next((self.map.by_target[k] for k in [self.kept[key], *group]
                         if k in self.map.by_target), None)
            if load is not None:
                self.load_of[key] = load
            elif key in self.alias:  # a parameter (buffers come from the model's code)
                missing.append(key)
        if missing:
            raise NotModelFree(f"{self.folder}: tensors missing from the checkpoint: "
                               f"{', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))

    def _units(self) -> list[Unit]:
        loads = {id(ld): ld for ld in self.load_of.values()}
        parent = {i: i for i in loads}

        def find(i):
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        def join(names):
            ids = [id(self.load_of[n]) for n in names]
            for i in ids[1:]:
                parent[find(i)] = find(ids[0])

        for e in self.plan.experts:
            join([f"{e.name}.{p}" for p in e.info.projections])
        if self.gran.name == "tensor":
            for group in self.groups:
                join([f"{m}.weight" for m in group])
        units: dict[int, Unit] = {}
        for i, ld in loads.items():
            units.setdefault(find(i), Unit([])).loads.append(ld)
        for t in self.plan.gemms:
            units[find(id(self.load_of[f"{t.name}.weight"]))].gemms.append(t)
        for e in self.plan.experts:
            units[find(id(self.load_of[f"{e.name}.{e.info.projections[0]}"]))].experts.append(e)
        entries = self.source.entries
        for u in units.values():
            u.order = min((str(entries[s].file), entries[s].start) for s in u.sources)
        return sorted(units.values(), key=lambda u: u.order)

    # -- one unit ----------------------------------------------------------------------------------

    def compute(self, unit: Unit, tensors: dict[str, torch.Tensor]) -> UnitOutput:
        """Quantize ``unit`` from its source ``tensors`` (consumed)."""
        values: dict[str, torch.Tensor] = {}
        for ld in unit.loads:
            values.update(self.map.realize(ld, tensors.pop))
        out = UnitOutput([], {})
        recipe = self.recipe
        for e in unit.experts:
            for proj in e.info.projections:
                set_module_tensor_to_device(self.model, f"{e.name}.{proj}", "cpu",
                                            value=values.pop(f"{e.name}.{proj}"))
            warnings: list[str] = []
            out.experts[e.name] = quantize_experts_module(
                self.model, e, recipe, self.gran, self.w_calib, self.a_calib, {},
                self.unify_experts, warnings)
            out.warnings[e.name] = warnings
            out.modules.append(e.name)
        weights = {t.name: self._take(values, f"{t.name}.weight").to(self.device)
                   for t in unit.gemms}
        names = {t.name for t in unit.gemms}
        groups = [g for g in self.groups if set(g) <= names]
        unified = unified_weight_scales(unit.gemms, groups, self.gran, self.w_calib, recipe, {},
                                        weights=weights)
        for t in unit.gemms:
            report = quantize_target(self.model, t, recipe, self.gran, self.w_calib,
                                     self.a_calib, None, weight_scale=unified.get(t.name),
                                     weight=weights.pop(t.name))
            self.model.get_submodule(t.name).to_host()
            out.reports.append(report)
            out.warnings[t.name] = [f"{t.name}: {w}" for w in report.warnings]
            out.modules.append(t.name)
            out.tensors.update(self._tied_copy(t))
        for key, value in values.items():
            kept = self.kept.get(key, key)
            if self.load_of.get(kept) is not None and self._is_quantized_weight(kept):
                continue
            out.tensors[kept] = value
        return out

    def _take(self, values: dict, key: str) -> torch.Tensor:
        """The value of parameter ``key`` (under whichever tied name its load produced)."""
        for k in self.alias.get(key, [key]):
            if k in values:
                return values.pop(k)
        raise DataError(f"{self.folder}: no tensor for {key}")

    def _is_quantized_weight(self, key: str) -> bool:
        module, _, leaf = key.rpartition(".")
        return leaf == "weight" and any(t.name == module for t in self.plan.gemms)

    def _tied_copy(self, t: ModulePlan) -> dict[str, torch.Tensor]:
        """A quantized GEMM whose weight is tied to another parameter (a quantized lm_head tied
        to the embeddings): the other name holds the dequantized weight, as in memory, where
        ``QuantGemm`` writes it into the shared tensor."""
        key = f"{t.name}.weight"
        kept = self.kept.get(key, key)
        if kept == key or self._is_quantized_weight(kept):
            return {}
        q = self.model.get_submodule(t.name)
        codes = q.weight_codes
        values = decode(codes, q.weight_format) * self.gran.expand(q.weight_scale, codes)
        return {kept: weight_from_2d(t.module, values.to(self.dtype))}

    # -- the rest ----------------------------------------------------------------------------------

    def buffers(self) -> dict[str, torch.Tensor]:
        """Persistent buffers the checkpoint does not hold: the model's own values."""
        return dict(self._buffers)

    def result(self, outputs: list[UnitOutput], seconds: dict, facts: dict) -> QuantizeResult:
        """The ``QuantizeResult`` the in-memory pipeline would give, in plan order."""
        reports = {r.name: r for o in outputs for r in o.reports}
        experts = {k: v for o in outputs for k, v in o.experts.items()}
        warnings = {k: v for o in outputs for k, v in o.warnings.items()}
        modules = [reports[t.name] for t in self.plan.gemms]
        all_warnings = [w for m in [*self.plan.gemms, *self.plan.experts]
                        for w in warnings.get(m.name, [])]
        extras: dict = {}
        if self.groups:
            extras["fused_groups"] = unify_input_scales(self.model, self.groups, modules)
        if experts:
            extras["experts"] = {e.name: experts[e.name] for e in self.plan.experts}
        extras["high_precision"] = high_precision_report(self.model)
        extras["model_free"] = facts
        extras["path"] = "model-free"
        return QuantizeResult(self.model, modules, list(self.plan.skipped), {}, seconds,
                              all_warnings, extras, recipe=self.recipe, plan=self.plan)


__all__ = ["ModelFreeJob", "NotModelFree", "Unit", "UnitOutput", "refusal"]
