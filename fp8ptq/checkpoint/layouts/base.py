"""What a checkpoint layout is: the interface every layout implements, and the light module
descriptions a layout is chosen from.

A *layout* decides how the quantized modules of a model are stored: which tensors (names,
dtypes, shapes) a quantized GEMM and a fused-experts module become, the ``quantization_config``
in config.json that runtimes read, the ``stored_as`` facts in fp8ptq.json, how the tensors are
read back, and what ``verify`` expects to find. Writer, reader and verifier only ask the layout;
they never branch on its name (the registry in ``layouts/__init__.py`` maps names to layouts).

The layout is chosen from ``ModuleDesc`` s, not from quantized modules, so that it can be chosen
*before* anything is quantized (``describe_plan(plan)``: a streaming or model-free writer must
know the tensor names of the first block before the last one is quantized) and checked again
after (``describe_model(model)``); both give the same descriptions for the same run.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ...formats import FormatSpec
from ...formats.mx import e8m0_decode, e8m0_encode
from ...model.experts import ExpertsInfo
from ...model.gemm import kind as gemm_kind
from ...nn.quant_experts import ProjectionQuant, QuantExperts
from ...nn.quant_gemm import QuantGemm
from ..expect import Expect


@dataclass(frozen=True)
class ModuleDesc:
    """One quantized module as a layout sees it: no tensors, only what decides the layout."""

    name: str
    kind: str  # linear | conv1d_hf | conv | depthwise_conv | experts
    weight_format: FormatSpec
    act_format: FormatSpec | None  # None: weight-only
    weight_granularity: str  # tensor | channel | block | group (MX formats: 1 x 32 along K)
    act_granularity: str | None  # tensor (static) | token | group (dynamic); None: weight-only
    block_size: int | None = None  # block edge (block) or group length (group weights)
    experts: ExpertsInfo | None = None  # fused experts: projections, orientation, shapes
    act_group_size: int | None = None  # features per dynamic activation group (group)

    @property
    def is_experts(self) -> bool:
        return self.experts is not None

    @property
    def static_inputs(self) -> bool:
        return self.act_format is not None and self.act_granularity == "tensor"


@dataclass
class GemmQuant:
    """The stored form of one quantized GEMM, whatever module (or none) it came from."""

    codes: torch.Tensor  # uint8 [out, in] (the 2-D GEMM view)
    weight_scale: torch.Tensor  # float32, the granularity's shape
    input_scale: torch.Tensor | None  # float32 [1] for static activations


def _block(granularity) -> int | None:
    return getattr(granularity, "size", None) if granularity.name in ("block", "group") else None


def describe_quantized(name: str, q: nn.Module) -> ModuleDesc:
    """The description of a ``QuantGemm`` or ``QuantExperts`` (after quantization)."""
    act_gran = q.act_granularity if q.act_format is not None else None
    common = dict(weight_format=q.weight_format, act_format=q.act_format,
                  weight_granularity=q.weight_granularity.name, act_granularity=act_gran,
                  block_size=_block(q.weight_granularity),
                  act_group_size=getattr(q, "act_group_size", None) if act_gran else None)
    if isinstance(q, QuantExperts):
        return ModuleDesc(name, "experts", experts=q.info, **common)
    return ModuleDesc(name, q.kind, **common)


def quantized_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every ``QuantGemm`` and ``QuantExperts`` of ``model``, in model order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (QuantGemm, QuantExperts))]


def describe_model(model: nn.Module) -> list[ModuleDesc]:
    """Descriptions of the quantized modules of ``model``: GEMMs first, then fused experts
    (the order ``describe_plan`` gives)."""
    descs = [describe_quantized(n, m) for n, m in quantized_modules(model)]
    return [d for d in descs if not d.is_experts] + [d for d in descs if d.is_experts]


def describe_plan(plan) -> list[ModuleDesc]:
    """Descriptions of the modules a ``fp8ptq.config.plan.QuantPlan`` will quantize (before any of
    it
    is quantized; the model may be on the meta device)."""
    out = []
    for mp in plan.modules:
        inp = mp.input
        common = dict(weight_format=mp.weight.format,
                      act_format=None if inp is None else inp.format,
                      weight_granularity=mp.weight.granularity,
                      act_granularity=None if inp is None else inp.granularity,
                      block_size=mp.weight.block_size
                      if mp.weight.granularity in ("block", "group") else None,
                      act_group_size=None if inp is None else inp.group_size)
        kind = "experts" if mp.experts is not None else gemm_kind(mp.module)
        out.append(ModuleDesc(mp.name, kind, experts=mp.experts, **common))
    return out


class Layout:
    """One way of storing quantized modules. Subclasses set ``name`` and implement the methods
    below; ``layouts.register(MyLayout())`` makes writer, reader and verifier use it.

    Every method is given plain data (descriptions, tensors, fp8ptq.json entries), never a
    quantized module, so the same layout serves an in-memory model, a block-by-block writer and
    a model-free one that quantizes tensors straight from the source shards."""

    name: str = ""
    library_name = "fp8ptq"  # model-card front matter: which library loads it
    card_tags: tuple[str, ...] = ()
    runtimes: tuple[str, ...] = ()  # runtimes that load it natively ("transformers", "vllm")

    # -- choosing -----------------------------------------------------------------------------

    def accepts(self, modules: Sequence[ModuleDesc], *, model_type: str | None = None
                ) -> str | None:
        """None when this layout can store ``modules``, else the reason it cannot."""
        raise NotImplementedError

    def module_problem(self, module: ModuleDesc, *, model_type: str | None = None
                       ) -> str | None:
        """Why this layout cannot store this one module whatever the others are (the writer
        checks each module as it arrives, ``accepts`` the whole set at the end)."""
        return None

    def why(self, modules: Sequence[ModuleDesc], *, model_type: str | None = None) -> str:
        """The ``layout_reason`` written to fp8ptq.json when this layout is chosen."""
        return f"{self.name} layout"

    def refusal_warning(self, modules: Sequence[ModuleDesc], reason: str, chosen: str
                        ) -> str | None:
        """A warning for the run's report when this (preferred) layout refused ``modules`` for
        ``reason`` and ``chosen`` was used instead, where a user would want to know (a recipe
        choice made the checkpoint unservable); None for an expected fallback."""
        return None

    # -- writing ------------------------------------------------------------------------------

    def gemm_tensors(self, desc: ModuleDesc, q: GemmQuant) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def gemm_stored_as(self, desc: ModuleDesc) -> dict:
        """fp8ptq.json ``stored_as`` of a GEMM: tensor -> "dtype [shape]" in words."""
        raise NotImplementedError

    def experts_tensors(self, desc: ModuleDesc, projections: dict[str, ProjectionQuant], *,
                        model_type: str | None = None) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def experts_facts(self, desc: ModuleDesc, *, model_type: str | None = None) -> dict:
        """Layout-specific fp8ptq.json facts of a fused-experts entry (``checkpoint_keys``)."""
        return {}

    def kv_cache(self, model: nn.Module, report: dict, tensors: dict[str, torch.Tensor]
                 ) -> tuple[dict[str, torch.Tensor], dict | None, str | None]:
        """(k/v scale tensors to write, ``kv_cache_scheme`` for the config or None, note for
        fp8ptq.json) given the taps' report and its k/v scale tensors."""
        return tensors, None, "tensors <attention>.k_scale / .v_scale (all taps: fp8ptq.json)"

    def quantization_config(self, model: nn.Module, modules: Sequence[ModuleDesc], *,
                            kv_scheme: dict | None = None, attention_targets: Sequence[str] = (),
                            tool_version: str = "") -> dict:
        """config.json ``quantization_config``. ``model`` gives the structure only (it may be
        on the meta device, with its GEMMs not yet wrapped); ``attention_targets``: the
        attention classes FP8 attention quantizes (their query scales written)."""
        raise NotImplementedError

    # -- reading ------------------------------------------------------------------------------

    def read_gemm(self, tensors: dict[str, torch.Tensor], name: str, entry: dict) -> GemmQuant:
        """Pop module ``name``'s tensors from ``tensors`` (``KeyError`` when one is missing)."""
        raise NotImplementedError

    def read_experts(self, tensors: dict[str, torch.Tensor], name: str, entry: dict
                     ) -> dict[str, ProjectionQuant]:
        raise NotImplementedError

    # -- verifying ----------------------------------------------------------------------------

    def expect_gemm(self, name: str, entry: dict) -> Iterable[Expect]:
        raise NotImplementedError

    def expect_experts(self, name: str, entry: dict) -> Iterable[Expect]:
        raise NotImplementedError

    def check_config(self, folder, meta: dict, config: dict, index) -> None:
        """Raise ``DataError`` when config.json disagrees with the tensors (``index``: a
        ``verify.TensorIndex``); nothing to check by default."""

    def __repr__(self) -> str:
        return f"<layout {self.name}>"


@dataclass(frozen=True)
class LayoutChoice:
    """The layout for one checkpoint, why, and a warning for the run's report (or None)."""

    layout: Layout
    reason: str
    warning: str | None = None
    model_type: str | None = None  # transformers model type (per-expert checkpoint names)

    @property
    def name(self) -> str:
        return self.layout.name


def input_scale_tensor(q: GemmQuant) -> torch.Tensor | None:
    return None if q.input_scale is None else q.input_scale.detach().float().reshape(1)


def weight_scale_tensor(desc: ModuleDesc, q: GemmQuant) -> torch.Tensor:
    """The weight scale as stored: E8M0 codes (uint8, OCP MX v1.0 sec. 5.4.1; compressed-tensors'
    ``scale_dtype: uint8``) for MX formats, whose scales are powers of two; float32 otherwise."""
    scale = q.weight_scale.detach().float()
    if desc.weight_format.mx_block is None:
        return scale
    exponent = torch.frexp(scale)[1] - 1  # exact: every MX scale is 2^e
    return e8m0_encode(exponent)


def read_weight_scale(stored: torch.Tensor) -> torch.Tensor:
    """A stored weight scale as float32 (E8M0 codes decoded)."""
    return e8m0_decode(stored) if stored.dtype == torch.uint8 else stored
