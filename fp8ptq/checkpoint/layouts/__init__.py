"""Checkpoint layouts: a small registry of ``Layout`` objects (see ``base.py``).

``choose_layout(modules)`` tries the registered layouts in order of preference and takes the
first that accepts every module; the fallback (``fp8ptq-native``, which stores anything) comes
last. The writer, the reader and ``verify`` look a layout up by the name fp8ptq.json records
(``get_layout``) and never branch on it.

How to add a layout: write ``layouts/my_layout.py`` with a ``Layout`` subclass (``name``,
``accepts``, the tensors of a GEMM and of fused experts, ``quantization_config``, the read-back
and the ``Expect`` lists for ``verify``), then one line below: ``register(MyLayout())``
(preferred over the ones registered after it) or ``register(MyLayout(), fallback=True)``.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...errors import UsageError
from .base import (
    GemmQuant,
    Layout,
    LayoutChoice,
    ModuleDesc,
    describe_model,
    describe_plan,
    describe_quantized,
    quantized_modules,
)
from .compressed_tensors import CompressedTensorsLayout
from .native import NativeLayout

_PREFERRED: dict[str, Layout] = {}
_FALLBACK: dict[str, Layout] = {}


def register(layout: Layout, *, fallback: bool = False) -> Layout:
    """Add ``layout`` to the registry: preferred layouts are tried in registration order, the
    fallback (one) when none accepts."""
    if not layout.name:
        raise ValueError("a layout needs a name")
    if fallback:
        _FALLBACK.clear()
        _FALLBACK[layout.name] = layout
    else:
        _PREFERRED[layout.name] = layout
    return layout


def names() -> list[str]:
    return [*_PREFERRED, *_FALLBACK]


def get_layout(name) -> Layout:
    """The registered layout called ``name`` (a ``Layout`` or ``LayoutChoice`` is returned as
    its layout)."""
    if isinstance(name, LayoutChoice):
        return name.layout
    if isinstance(name, Layout):
        return name
    layout = _PREFERRED.get(name) or _FALLBACK.get(name)
    if layout is None:
        raise UsageError(f"unknown checkpoint layout {name!r} (known: {', '.join(names())})")
    return layout


def choose_layout(modules: Sequence[ModuleDesc], *, model_type: str | None = None
                  ) -> LayoutChoice:
    """The first registered layout that stores every one of ``modules`` (``describe_plan(plan)``
    before quantizing, ``describe_model(model)`` after: the same answer). ``model_type`` (the
    transformers ``config.model_type``) names fused experts' per-expert tensors."""
    modules = list(modules)
    refused: list[tuple[Layout, str]] = []
    for layout in _PREFERRED.values():
        reason = layout.accepts(modules, model_type=model_type)
        if reason is None:
            return LayoutChoice(layout, layout.why(modules, model_type=model_type),
                                model_type=model_type)
        refused.append((layout, reason))
    fallback = next(iter(_FALLBACK.values()))
    reason = refused[0][1] if refused else fallback.why(modules, model_type=model_type)
    warning = next((w for layout, why in refused
                    if (w := layout.refusal_warning(modules, why, fallback.name))), None)
    return LayoutChoice(fallback, reason, warning, model_type=model_type)


def model_type_of(model) -> str | None:
    """The transformers ``model_type`` of ``model`` (None for a plain module)."""
    return getattr(getattr(model, "config", None), "model_type", None)


register(CompressedTensorsLayout())
register(NativeLayout(), fallback=True)

__all__ = ["Layout", "LayoutChoice", "ModuleDesc", "GemmQuant", "register", "get_layout", "names",
           "choose_layout", "describe_model", "describe_plan", "describe_quantized",
           "quantized_modules", "model_type_of"]
