"""One registry of calibrators: each entry says what it calibrates, how (its kind) and which
recipe fields it reads (its option schema).

Two kinds, because they need different inputs:

- ``statistics``: a pure function of the single calibration pass's statistics (activations,
  ``TensorStats``) or of the weight itself (weights): ``factory(**options).amax(...)``.
- ``layer-aware``: judges candidate scales by the error of the layer's *output*, so it needs
  the row samples kept by the statistics pass and the weight; ``choose(...)`` returns one
  ``LayerChoice`` per module. Where no single layer exists (fused experts, attention taps) the
  entry's ``fallback`` (a statistics calibrator) is used instead.

The recipe validation, the CLI help and the pipeline all read this registry, so a new
calibrator is one ``register`` call (see ``fp8ptq.calibrators``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

from fp8ptq.errors import UsageError

STATISTICS = "statistics"
LAYER_AWARE = "layer-aware"


@dataclass(frozen=True)
class CalibratorEntry:
    name: str
    target: str  # "activation" or "weight"
    kind: str = STATISTICS
    factory: Callable | None = None  # statistics: factory(**options) -> calibrator
    choose: Callable | None = None  # layer-aware: choose(model, targets, ...) -> {name: choice}
    # recipe fields the calibrator reads -> what they mean (the factory gets those it names)
    options: dict[str, str] = field(default_factory=dict)
    fallback: str | None = None  # layer-aware: statistics calibrator where no layer exists
    help: str = ""
    rounding: str | None = None  # weights: "gptq" = error-compensating rounding after the scales
    reads_data: bool = False  # weights: needs the calibration inputs (GPTQ's Hessians)

    @property
    def layer_aware(self) -> bool:
        return self.kind == LAYER_AWARE

    def options_from(self, source) -> dict:
        """This entry's options, read from a recipe (or any object / dict with those names)."""
        get = source.get if isinstance(source, dict) else lambda k, d=None: getattr(source, k, d)
        return {k: get(k) for k in self.options if get(k) is not None}

    def build(self, **options):
        """A statistics calibrator; options outside the schema are ignored (callers pass the
        whole recipe's worth)."""
        if self.factory is None:
            raise UsageError(f"calibrator {self.name!r} is layer-aware: it has no statistics "
                             "calibrator to build (use its fallback)")
        takes = inspect.signature(self.factory).parameters
        return self.factory(**{k: v for k, v in options.items()
                               if k in self.options and k in takes})


_REGISTRY: dict[str, dict[str, CalibratorEntry]] = {"activation": {}, "weight": {}}


def register(entry: CalibratorEntry) -> CalibratorEntry:
    if entry.kind not in (STATISTICS, LAYER_AWARE):
        raise ValueError(f"calibrator kind must be {STATISTICS} or {LAYER_AWARE}")
    if entry.kind == LAYER_AWARE and (entry.choose is None or entry.fallback is None):
        raise ValueError("a layer-aware calibrator needs choose() and a statistics fallback")
    _REGISTRY[entry.target][entry.name] = entry
    return entry


def names(target: str, kind: str | None = None) -> tuple[str, ...]:
    return tuple(n for n, e in _REGISTRY[target].items() if kind is None or e.kind == kind)


def entry(target: str, name: str) -> CalibratorEntry:
    found = _REGISTRY[target].get(name)
    if found is None:
        raise UsageError(f"unknown {target} calibrator {name!r}; valid: "
                         f"{', '.join(_REGISTRY[target])}")
    return found


def activation_entry(name: str) -> CalibratorEntry:
    return entry("activation", name)


def weight_entry(name: str) -> CalibratorEntry:
    return entry("weight", name)


def statistics_entry(name: str) -> CalibratorEntry:
    """The statistics calibrator that runs for ``name``: itself, or a layer-aware entry's
    fallback (fused experts and attention taps have no single layer to search)."""
    e = activation_entry(name)
    return activation_entry(e.fallback) if e.layer_aware else e


def help_text(target: str) -> str:
    """``max|percentile|...`` with each entry's short note, for the CLI help."""
    notes = [f"{e.name} = {e.help}" for e in _REGISTRY[target].values() if e.help]
    return "|".join(_REGISTRY[target]) + (f" ({'; '.join(notes)})" if notes else "")


def gptq_variant(name: str) -> str:
    """The GPTQ weight calibrator that sweeps on weight calibrator ``name``'s scales (``max`` ->
    ``gptq``, ``mse`` -> ``gptq-mse``, ``hmse`` -> ``gptq-hmse``); ``gptq`` for the others."""
    factory = weight_entry(name).factory
    return next((n for n in names("weight") if weight_entry(n).rounding == "gptq"
                 and weight_entry(n).factory is factory), "gptq")
