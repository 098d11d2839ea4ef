"""One plan: what every module of a model gets, decided once from the recipe.

``build_plan(model, recipe)`` walks the model's GEMMs and fused-experts modules and gives each a
``ModulePlan``: its weight ``TensorPlan`` (format, granularity, calibrator) and its input
``TensorPlan`` (format, granularity, calibrator, static or dynamic) or ``None`` (weight-only or
skipped). The run-level facts -- does the job need calibration data, how many passes go through
the model, how many batches keep row samples -- are a ``RunFacts`` that ``run_facts(recipe)``
also gives *before* the model is loaded (the CLI reads the calibration data first, so that
missing data fails in seconds).

The pipeline, sensitivity analysis, SmoothQuant, the attention/residual taps and the job all
read this plan instead of re-deriving it from the flat recipe, so they cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from torch import nn

from ..calibrators import registry as calibrators
from ..errors import UsageError
from ..formats import FormatSpec, get_format
from ..formats.granularity import DYNAMIC_GRANULARITIES, weight_granularity
from ..model.auto import is_causal_lm_name
from ..model.experts import ExpertsInfo, find_experts, router_names
from ..model.gemm import CONV_TYPES, find_gemms, is_depthwise, matches
from ..nn.quant_gemm import QuantGemm
from .recipe import OVERRIDE_FIELDS, Recipe, override_formats

SAMPLE_BATCHES = 2  # batches whose input rows are kept for layer-output-aware calibrators


@dataclass(frozen=True)
class TensorPlan:
    """How one tensor (a weight, or a GEMM's input) is quantized."""

    format: FormatSpec
    # weights: tensor | channel | block | group (MX formats); inputs: tensor | token | group
    granularity: str
    calibrator: str  # a registry name (``fp8ptq.calibrators.registry``)
    dynamic: bool = False  # inputs: scales computed at run time (per token / group)
    block_size: int | None = None  # weights: the block edge (block) or group length (group)
    group_size: int | None = None  # inputs with group granularity: features per group

    @property
    def static(self) -> bool:
        return not self.dynamic

    def handler(self):
        """The weight granularity object (``fp8ptq.formats.granularity``)."""
        return weight_granularity(self.granularity, self.block_size or 128)

    def to_dict(self) -> dict:
        return {"format": self.format.name, "granularity": self.granularity,
                "calibrator": self.calibrator, "dynamic": self.dynamic,
                **({"block_size": self.block_size} if self.block_size is not None else {}),
                **({"group_size": self.group_size} if self.group_size is not None else {})}


@dataclass
class ModulePlan:
    """One quantized module: a GEMM, or a fused-experts module (``experts`` set)."""

    name: str
    module: nn.Module
    weight: TensorPlan
    input: TensorPlan | None  # None: weight-only
    experts: ExpertsInfo | None = None

    @property
    def weight_format(self) -> FormatSpec:
        return self.weight.format

    @property
    def act_format(self) -> FormatSpec | None:
        return None if self.input is None else self.input.format

    @property
    def info(self) -> ExpertsInfo | None:  # the fused-experts layout (``model.experts``)
        return self.experts

    def to_dict(self) -> dict:
        return {"name": self.name, "weight": self.weight.to_dict(),
                "input": None if self.input is None else self.input.to_dict(),
                **({"experts": True} if self.experts is not None else {})}


@dataclass(frozen=True)
class RunFacts:
    """What the whole run needs, whatever the model."""

    static_inputs: bool  # some input scale is calibrated (static per-tensor activations)
    layer_aware: bool  # the activation calibrator searches on layer outputs (row samples)
    smoothquant: bool
    taps: bool  # attention / residual activations are quantized (they need statistics)
    bn_retune: bool
    gptq: bool = False  # the weight calibrator reads calibration inputs (GPTQ's Hessians)
    # GPTQ's Hessians gathered group by group from the model quantized so far
    # (``fp8ptq.algorithms.gptq.sequential``), not in the statistics pass
    gptq_in_order: bool = False
    # the whole model is a causal language model (its first token attends to itself alone):
    # sink-aware GPTQ's default; kept by ``QuantPlan.part``, so a streamed block knows it too
    causal_lm: bool = False

    @property
    def needs_statistics_pass(self) -> bool:
        """Whether the run's one statistics pass is needed whatever the model: static input
        scales, a layer-aware calibrator's rows and the taps read it, and every recipe but
        in-order GPTQ gathers its Hessians in it (and reports input amax / SQNR from it). Only
        MoE experts' observers and the one-pass Hessians of GEMMs outside the blocks add to this,
        facts of the modules a call quantizes (``pipeline``)."""
        return self.static_inputs or self.layer_aware or self.taps or not self.gptq_in_order

    @property
    def needs_calibration(self) -> bool:
        """Every stage that reads calibration data, in one place."""
        return (self.static_inputs or self.smoothquant or self.taps or self.bn_retune
                or self.gptq)

    @property
    def passes(self) -> int:
        """How many times the calibration batches go through the model (progress bars)."""
        return 1 + self.smoothquant + self.bn_retune

    @property
    def sample_batches(self) -> int:
        """Batches whose input rows the statistics pass keeps (layer-aware calibrators)."""
        return SAMPLE_BATCHES if self.layer_aware and self.static_inputs else 0


def input_plan(recipe: Recipe, fmt: FormatSpec | None) -> TensorPlan | None:
    """A GEMM input's plan. An MX format fixes it: dynamic, one E8M0 scale per ``mx_block``
    features (OCP MX v1.0), whatever ``--act-granularity`` says for the other formats."""
    if fmt is None:
        return None
    if fmt.mx_block is not None:
        return TensorPlan(fmt, "group", recipe.act_calib, dynamic=True, group_size=fmt.mx_block)
    gran = recipe.act_granularity
    return TensorPlan(fmt, gran, recipe.act_calib, dynamic=gran in DYNAMIC_GRANULARITIES,
                      group_size=recipe.act_group_size if gran == "group" else None)


def weight_plan(recipe: Recipe, fmt: FormatSpec) -> TensorPlan:
    """A weight's plan; an MX format's weights are ``mx_block`` groups along K (its scale is
    the spec's E8M0 rule applied to the weight calibrator's clip range)."""
    if fmt.mx_block is not None:
        return TensorPlan(fmt, "group", recipe.weight_calib, block_size=fmt.mx_block)
    block = recipe.block_size if recipe.weight_granularity == "block" else None
    return TensorPlan(fmt, recipe.weight_granularity, recipe.weight_calib, block_size=block)


def base_formats(recipe: Recipe) -> tuple[FormatSpec, FormatSpec | None]:
    """The recipe's weight and activation formats (activations ``None``: weight-only)."""
    act_name = recipe.act_format or recipe.format
    return (get_format(recipe.weight_format or recipe.format),
            None if act_name == "none" else get_format(act_name))


def run_facts(recipe: Recipe, static_inputs: bool | None = None,
              gptq: bool | None = None) -> RunFacts:
    """The run-level facts from the recipe alone (``static_inputs`` / ``gptq``: as the model's
    plan found them; by default, what the recipe asks of a model where every GEMM is quantized
    its way)."""
    if static_inputs is None:
        act = base_formats(recipe)[1]
        static_inputs = (recipe.act_granularity == "tensor" and act is not None
                         and act.mx_block is None)
    if gptq is None:
        gptq = calibrators.weight_entry(recipe.weight_calib).reads_data
    return RunFacts(static_inputs=static_inputs,
                    layer_aware=calibrators.activation_entry(recipe.act_calib).layer_aware,
                    smoothquant=recipe.smoothquant is not None,
                    taps=(recipe.quantize_attention or recipe.quantize_residual
                          or recipe.kv_cache is not None),
                    bn_retune=recipe.bn_retune, gptq=gptq,
                    gptq_in_order=gptq and recipe.gptq_sequential)


def taps_plan(recipe: Recipe, always: bool = False) -> TensorPlan | None:
    """The attention / residual taps' activations: static per-tensor scales in the activation
    format (the recipe's ``format`` when weight-only), by the activation calibrator's statistics
    form (a layer-aware calibrator has no GEMM to measure here and falls back)."""
    if not (always or recipe.quantize_attention or recipe.quantize_residual):
        return None
    name = recipe.act_format if recipe.act_format not in (None, "none") else recipe.format
    return TensorPlan(get_format(name), "tensor",
                      calibrators.statistics_entry(recipe.act_calib).name)


def needs_calibration(recipe: Recipe) -> bool:
    return run_facts(recipe).needs_calibration


@dataclass
class QuantPlan:
    """The plan of one run: every quantized module, every skipped one, the run-level facts."""

    recipe: Recipe
    gemms: list[ModulePlan]
    experts: list[ModulePlan]
    skipped: list[str]
    facts: RunFacts
    taps: TensorPlan | None = None  # attention / residual activations (``fp8ptq.taps.taps``)

    @property
    def modules(self) -> list[ModulePlan]:
        return [*self.gemms, *self.experts]

    @property
    def needs_calibration(self) -> bool:
        return self.facts.needs_calibration

    @property
    def passes(self) -> int:
        return self.facts.passes

    @property
    def sample_batches(self) -> int:
        return self.facts.sample_batches

    def weight_granularity(self):
        """The recipe's weight granularity object (a module's own: ``m.weight.handler()``,
        which differs for MX-format modules)."""
        return weight_granularity(self.recipe.weight_granularity, self.recipe.block_size)

    def weight_calibrator(self, module: ModulePlan | None = None):
        """The recipe's weight calibrator, or ``module``'s own (a partial-plan override)."""
        name = self.recipe.weight_calib if module is None else module.weight.calibrator
        entry = calibrators.weight_entry(name)
        return entry.build(**entry.options_from(self.recipe))

    def act_calibrator(self):
        """The statistics activation calibrator (a layer-aware one's fallback)."""
        entry = calibrators.statistics_entry(self.recipe.act_calib)
        return entry.build(**entry.options_from(self.recipe))

    def rebind(self, model: nn.Module) -> QuantPlan:
        """Point every module entry, in place, at ``model``'s module of the same name, and
        return the plan. The plan decides by name, so one plan serves every model of a run: the
        meta-device model it was made on, the model then loaded or streamed from that
        checkpoint, the model after a transform (``--rotate``) changed its parameters. A
        ``UsageError`` when ``model`` has no module of a planned name."""
        for m in self.modules:
            try:
                m.module = model.get_submodule(m.name)
            except AttributeError:
                raise UsageError(f"the plan names {m.name}, which the model has no module "
                                 "for") from None
        return self

    def binds(self, model: nn.Module) -> bool:
        """Whether ``model`` has, under every planned name, a module of the planned module's
        type (``rebind`` would give the same plan ``build_plan(model, recipe)`` gives)."""
        for m in self.modules:
            try:
                found = model.get_submodule(m.name)
            except AttributeError:
                return False
            if type(found) is not type(m.module):
                return False
        return True

    def part(self, keep, prefix: str = "") -> QuantPlan:
        """The plan's modules whose full name passes ``keep(name)``, renamed relative to
        ``prefix`` (one block of a streamed model, quantized or measured on its own)."""
        def local(mods):
            return [replace(m, name=m.name[len(prefix):]) for m in mods if keep(m.name)]

        return replace(self, gemms=local(self.gemms), experts=local(self.experts),
                       skipped=[n[len(prefix):] for n in self.skipped if n.startswith(prefix)])

    def to_dict(self) -> dict:
        return {"modules": [m.to_dict() for m in self.modules], "skipped": list(self.skipped),
                "taps": None if self.taps is None else self.taps.to_dict(),
                "needs_calibration": self.needs_calibration, "passes": self.passes,
                "sample_batches": self.sample_batches}


def _override(recipe: Recipe, name: str):
    """The first override whose glob matches ``name``: a format name, ``"none"`` or a partial
    plan (``fp8ptq.config.recipe.OVERRIDE_KEYS``)."""
    return next((v for p, v in recipe.overrides.items() if matches(name, [p])), None)


def _skipped_by_override(recipe: Recipe, name: str) -> bool:
    value = _override(recipe, name)
    return value is not None and override_formats(value).get("weight_format") == "none"


def _module_plan(recipe: Recipe, name: str, module, base_w, base_a, experts=None):
    value = _override(recipe, name)
    w_fmt, a_fmt = base_w, base_a
    fields = {k: value[k] for k in OVERRIDE_FIELDS if k in value} \
        if isinstance(value, dict) else {}
    if fields:  # a partial plan with its own calibrator / granularities
        recipe = recipe.model_copy(update=fields)
    if (isinstance(module, CONV_TYPES) and recipe.act_granularity == "token"
            and "act_granularity" not in recipe.model_fields_set and "act_granularity"
            not in fields):  # the default's per-token scales need a token axis: static here
        recipe = recipe.model_copy(update={"act_granularity": "tensor"})
    if isinstance(value, str):  # GLOB=FORMAT: both formats; a weight-only recipe stays so
        w_fmt = get_format(value)
        a_fmt = get_format(value) if base_a is not None else None
    elif value is not None:  # a partial plan: what it names, the recipe's for the rest
        formats = override_formats(value)
        w_fmt = get_format(formats.get("weight_format", w_fmt.name))
        act = formats.get("act_format")
        if act is not None:
            a_fmt = None if act == "none" else get_format(act)
    return ModulePlan(name, module, weight_plan(recipe, w_fmt), input_plan(recipe, a_fmt),
                      experts)


def plan_gemms(model: nn.Module, recipe: Recipe) -> tuple[list[ModulePlan], list[str]]:
    """Which GEMMs get quantized, in which formats, and which are skipped."""
    base_w, base_a = base_formats(recipe)
    targets, skipped = [], []
    gemms = list(find_gemms(model))
    edge = {gemms[0][0], gemms[-1][0]} if recipe.keep_first_last and gemms else set()
    routers = set() if recipe.quantize_router else set(router_names(model))
    for name, module in gemms:
        if (isinstance(module, QuantGemm) or matches(name, recipe.skip_patterns) or name in edge
                or name in routers or (recipe.keep_depthwise and is_depthwise(module))
                or _skipped_by_override(recipe, name)):
            skipped.append(name)
            continue
        targets.append(_module_plan(recipe, name, module, base_w, base_a))
    return targets, skipped


def plan_experts(model: nn.Module, recipe: Recipe, skipped: list[str]) -> list[ModulePlan]:
    """The fused-experts modules to quantize (``--skip`` / ``--override`` apply to their module
    name, e.g. ``model.layers.0.mlp.experts``); skipped ones are appended to ``skipped``."""
    base_w, base_a = base_formats(recipe)
    out = []
    for name, module, info in find_experts(model):
        if matches(name, recipe.skip_patterns) or _skipped_by_override(recipe, name):
            skipped.append(name)
            continue
        plan = _module_plan(recipe, name, module, base_w, base_a, experts=info)
        if plan.weight.granularity == "group" or (
                plan.input is not None and plan.input.granularity == "group"):
            raise UsageError(f"{name}: fused MoE experts take tensor or token activations and "
                             "non-MX formats (group / MX scaling is for GEMM modules); use "
                             f"--override '{name}=e4m3' or --skip '{name}'")
        out.append(plan)
    return out


def build_plan(model: nn.Module, recipe: Recipe) -> QuantPlan:
    """The plan for quantizing ``model`` with ``recipe`` (the model is only read)."""
    gemms, skipped = plan_gemms(model, recipe)
    experts = plan_experts(model, recipe, skipped)
    static = any(m.input is not None and m.input.static for m in [*gemms, *experts])
    gptq = any(reads_data(m) for m in [*gemms, *experts])
    facts = replace(run_facts(recipe, static_inputs=static, gptq=gptq),
                    causal_lm=is_causal_lm(model))
    return QuantPlan(recipe, gemms, experts, skipped, facts, taps_plan(recipe))


def is_causal_lm(model: nn.Module) -> bool:
    """A transformers causal language model (``...ForCausalLM`` / ``...LMHeadModel``)."""
    return is_causal_lm_name(type(model).__name__)


# What a step that builds its own (meta-device) model is handed instead of a plan: the run's
# plan for that model (``fp8ptq.execution.quantize.RunPlan`` makes it once and re-binds it).
Planner = Callable[[nn.Module], QuantPlan]


def reads_data(m: ModulePlan) -> bool:
    """Does ``m``'s weight calibrator read calibration inputs (GPTQ's Hessian)?"""
    return calibrators.weight_entry(m.weight.calibrator).reads_data


def needs_full_hessian(m: ModulePlan) -> bool:
    """Does ``m``'s weight quantization read the whole Hessian (GPTQ's sweep), not only its
    diagonal (the input energies ``hmse`` weights by)?"""
    return calibrators.weight_entry(m.weight.calibrator).rounding == "gptq"


def hessian_diagonal_only(modules) -> bool:
    """A Hessian collector for ``modules`` may keep diagonals only (none runs GPTQ's sweep)."""
    return not any(needs_full_hessian(m) for m in modules)


def as_plan_parts(plan_or_recipe) -> tuple[Recipe, TensorPlan | None]:
    """``(recipe, taps plan)`` from a ``QuantPlan`` or, for callers outside a run, a recipe."""
    if isinstance(plan_or_recipe, QuantPlan):
        return plan_or_recipe.recipe, plan_or_recipe.taps
    return plan_or_recipe, taps_plan(plan_or_recipe)


__all__ = ["TensorPlan", "ModulePlan", "RunFacts", "QuantPlan", "Planner", "build_plan",
           "run_facts", "needs_calibration", "plan_gemms", "plan_experts", "taps_plan",
           "as_plan_parts", "reads_data", "SAMPLE_BATCHES"]
