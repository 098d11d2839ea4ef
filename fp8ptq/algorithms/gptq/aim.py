"""What each GEMM's GPTQ aims at: its own weight (plain), the float model's output (asymmetric
GPTQ, ``fp8ptq.algorithms.gptq.asym``) or, besides, the first tokens' outputs (sink-aware GPTQ,
``fp8ptq.algorithms.gptq.sink``); decided once per run from the recipe and the model's kind."""

from __future__ import annotations

from dataclasses import dataclass

from ...calibrators.registry import weight_entry

# sink-aware GPTQ's default weight for causal language models: the first tokens weighted as
# much as all calibration tokens together (docs/results/llm-compressor.md, "fp8ptq's default
# recipe against llm-compressor": the two against plain GPTQ on SmolLM2, seed by seed)
SINK_WEIGHT = 1.0


@dataclass(frozen=True)
class Aim:
    """What each GEMM's GPTQ aims at instead of its own weight: ``"asym"`` (asymmetric GPTQ,
    ``fp8ptq.algorithms.gptq.asym``: the float model's output, a float stream carried beside
    the quantized one) or ``"sink"`` (sink-aware GPTQ, ``fp8ptq.algorithms.gptq.sink``: the
    first tokens' exact outputs too, with ``weight``; ``target``: ``"layer"``, the float
    weight's output on the quantized model's first-token input, or ``"float"``, the float
    model's, from a float stream of the first positions); ``damp``: the dampening of ``W*``."""

    kind: str
    damp: float = 0.01
    weight: float = 0.0
    target: str = "layer"

    @property
    def anchored(self) -> bool:
        """Sink-aware, aimed at the float model's first-token outputs."""
        return self.kind == "sink" and self.target == "float"

    @property
    def asym(self) -> bool:
        return self.kind == "asym"

    @property
    def sink(self) -> float:
        """The sink-aware weight (0: not sink-aware)."""
        return self.weight if self.kind == "sink" else 0.0

    @classmethod
    def of(cls, recipe, causal_lm: bool) -> Aim | None:
        """The recipe's when its weights are rounded by GPTQ (``gptq_asym``, else
        ``gptq_sink``: its default is
        ``SINK_WEIGHT`` for a causal language model, whose first token attends to itself
        alone, and 0 for any other), None for plain GPTQ."""
        if weight_entry(recipe.weight_calib).rounding != "gptq":
            return None  # no column sweep (``hmse``: Hessian-weighted scales, then nearest)
        if recipe.gptq_asym:
            return cls("asym", recipe.gptq_damp)
        weight = recipe.gptq_sink
        if weight is None:
            weight = SINK_WEIGHT if causal_lm else 0.0
        return cls("sink", recipe.gptq_damp, weight, recipe.gptq_sink_target) if weight \
            else None
