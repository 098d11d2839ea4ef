"""Quantized fused experts: per-expert codes and scales for transformers 5 ``...Experts`` modules.

``QuantExperts`` replaces an experts module (see ``fp8ptq.model.experts``). Per projection it
holds the weight codes ``[E, out, in]`` (uint8, always in this orientation), the weight scales
``[E, *granularity shape]`` and, for static activations, one input scale per expert ``[E]``: each
expert is its own GEMM with its own inputs, so it gets its own scales, as in vLLM's fused-MoE
FP8 layers (``w13_input_scale`` / ``w2_input_scale`` are per expert there too).

The weights are held once, as codes: each expert's matrix is decoded when its tokens arrive
(a 256-entry table lookup), so memory stays at one byte per expert weight. The forward is the
eager per-expert loop transformers itself uses, with the GEMM inputs quantize-dequantized
exactly as ``QuantGemm`` does, so CPU simulation is exact and a reloaded checkpoint reproduces
the in-memory model bit for bit.

Calibration: ``ExpertObserver`` wraps each experts module's forward for the calibration pass.
The real (routed) output is computed unchanged; in addition each expert's two GEMM inputs are
observed, either for the tokens the router sent to it, or - ``calibrate_all_experts``, the
default - for every token, so that rarely chosen experts still get statistics from the whole
calibration set (the most common source of broken MoE FP8 checkpoints is an expert that saw
no token and got a NaN or missing scale).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from ..formats import FormatSpec, decode, fake_quantize, get_format
from ..formats.scales import amax_to_scale, dynamic_scale, histogram_sqnr_db
from ..formats.weight_quant import choose_scale, quantize_weight
from ..model.experts import ExpertsInfo, expert_unit_name, expert_weight
from ..observe.observers import TensorStats


@dataclass
class ProjectionQuant:
    """The quantized form of one projection of every expert."""

    codes: torch.Tensor  # uint8 [E, out, in]
    weight_scale: torch.Tensor  # float32 [E, ...granularity shape]
    input_scale: torch.Tensor | None  # float32 [E] (static activations) or None


class QuantExperts(nn.Module):
    def __init__(self, inner: nn.Module, info: ExpertsInfo, *, weight_format: FormatSpec,
                 weight_granularity, act_format: FormatSpec | None, act_granularity: str,
                 projections: dict[str, ProjectionQuant]):
        super().__init__()
        self.info = info
        self.num_experts = info.num_experts
        self.weight_format = get_format(weight_format)
        self.weight_granularity = weight_granularity
        self.act_format = get_format(act_format) if act_format is not None else None
        self.act_granularity = act_granularity
        self.kind = "experts"
        dtype = getattr(inner, info.projections[0]).dtype
        for proj in info.projections:
            # the fused high-precision weights leave the model: the codes are the weights now
            inner._parameters.pop(proj, None)
            pq = projections[proj]
            self.register_buffer(f"{proj}_codes", pq.codes.to(torch.uint8).clone())
            self.register_buffer(f"{proj}_scale", pq.weight_scale.float().clone())
            self.register_buffer(f"{proj}_input_scale", None if pq.input_scale is None
                                 else pq.input_scale.float().reshape(-1).clone())
        self.inner = inner  # keeps act_fn, biases and the class's own gating (_apply_gate)
        self.dtype = dtype

    # -- weights ---------------------------------------------------------------------------

    def codes(self, proj: str) -> torch.Tensor:
        return getattr(self, f"{proj}_codes")

    def weight_scale(self, proj: str) -> torch.Tensor:
        return getattr(self, f"{proj}_scale")

    def input_scale(self, proj: str) -> torch.Tensor | None:
        return getattr(self, f"{proj}_input_scale")

    def release_codes(self) -> None:
        """Keep only the codes' shapes (meta tensors): after the model-free path has written
        this module, its codes leave memory."""
        for proj in self.info.projections:
            c = self.codes(proj)
            self.register_buffer(f"{proj}_codes", torch.empty(c.shape, dtype=c.dtype,
                                                               device="meta"))

    def dequantized_weight(self, proj: str, expert: int) -> torch.Tensor:
        """Expert ``expert``'s ``[out, in]`` weight as float32, decoded from its codes."""
        w = decode(self.codes(proj)[expert], self.weight_format)
        return w * self.weight_granularity.expand(self.weight_scale(proj)[expert], w)

    # -- forward ---------------------------------------------------------------------------

    def _gemm(self, proj: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        if self.act_format is not None:
            if self.act_granularity == "token":
                amax = x.detach().abs().amax(dim=-1, keepdim=True).float()
                scale = dynamic_scale(amax, self.act_format)
            else:
                scale = self.input_scale(proj)[expert].reshape(1)
            x = fake_quantize(x, scale, self.act_format)
        w = self.dequantized_weight(proj, expert).to(x.dtype)
        bias = getattr(self.inner, f"{proj}_bias", None) if self.info.has_bias else None
        return F.linear(x, w, None if bias is None else bias[expert].to(x.dtype))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        first, down = self.info.projections
        out = torch.zeros_like(hidden_states)
        hit = torch.unique(top_k_index[(top_k_index >= 0) & (top_k_index < self.num_experts)])
        for e in hit.tolist():
            token_idx, pos = torch.where(top_k_index == e)
            h = self._gemm(first, e, hidden_states[token_idx])
            h = self.inner._apply_gate(h) if self.info.has_gate else self.inner.act_fn(h)
            y = self._gemm(down, e, h) * top_k_weights[token_idx, pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out

    def extra_repr(self) -> str:
        act = "none" if self.act_format is None else (
            f"{self.act_format.name}/{self.act_granularity}")
        return (f"experts={self.num_experts}, weight={self.weight_format.name}/"
                f"{self.weight_granularity.name}, act={act}")


# ---------------------------------------------------------------------------------------------
# calibration


class ExpertObserver:
    """Per-expert statistics of both GEMM inputs of every observed experts module, keyed by
    ``expert_unit_name`` (``...experts.3.gate_up_proj``)."""

    def __init__(self, modules: dict[str, tuple[nn.Module, ExpertsInfo]],
                 all_experts: bool = True):
        self.modules = modules
        self.all_experts = all_experts
        self.stats: dict[str, TensorStats] = {
            expert_unit_name(name, e, p): TensorStats()
            for name, (_, info) in modules.items()
            for e in range(info.num_experts) for p in info.projections}

    @contextmanager
    def observing(self):
        saved = {}
        for name, (module, info) in self.modules.items():
            saved[name] = module.__dict__.get("forward")
            module.forward = self._forward(name, module, info)
        try:
            yield self
        finally:
            for name, (module, _) in self.modules.items():
                if saved[name] is None:
                    module.__dict__.pop("forward", None)
                else:
                    module.forward = saved[name]

    def _forward(self, name: str, module: nn.Module, info: ExpertsInfo):
        original = type(module).forward.__get__(module)
        first, down = info.projections

        def forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs):
            out = original(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
            with torch.no_grad():
                for e in range(info.num_experts):
                    x = hidden_states if self.all_experts else \
                        hidden_states[(top_k_index == e).any(dim=-1)]
                    if x.shape[0] == 0:
                        continue
                    self.stats[expert_unit_name(name, e, first)].update(x)
                    w = expert_weight(module, info, first)[e]
                    bias = getattr(module, f"{first}_bias", None) if info.has_bias else None
                    h = F.linear(x, w.to(x.dtype), None if bias is None else bias[e].to(x.dtype))
                    h = module._apply_gate(h) if info.has_gate else module.act_fn(h)
                    self.stats[expert_unit_name(name, e, down)].update(h)
            return out

        return forward


# ---------------------------------------------------------------------------------------------
# quantization


@dataclass
class ExpertsReport:
    """What happened to one experts module: per projection, the weight SQNR range, the per-expert
    input scales and the experts that saw no calibration token (and got their siblings' largest
    input scale)."""

    name: str
    num_experts: int
    weight_format: str
    act_format: str | None
    parameters: int
    projections: dict[str, dict] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def quantize_experts(name: str, module: nn.Module, info: ExpertsInfo, *, weight_format,
                     act_format, act_granularity: str, gran, w_calib, a_calib,
                     stats: dict[str, TensorStats], rounding: str | None = None,
                     pow2: bool = False, round_expert=None) -> tuple[QuantExperts, ExpertsReport]:
    """Quantize every expert of ``module`` (each expert's matrix like one ``QuantGemm``
    weight); static input scales per expert from ``stats`` (keys from ``expert_unit_name``).
    ``round_expert(proj, e, w2d, warnings)``: a ``QuantizedWeight`` for that expert's matrix
    (GPTQ's, ``fp8ptq.algorithms.gptq.experts``) or None (rounded to nearest here). The codes
    are written expert by expert into one ``[E, out, in]`` tensor."""
    params = sum(getattr(module, p).numel() for p in info.projections)
    report = ExpertsReport(name, info.num_experts, weight_format.name,
                           act_format.name if act_format else None, params)
    projections = {}
    for proj in info.projections:
        weights = expert_weight(module, info, proj).detach()
        codes = torch.empty(weights.shape, dtype=torch.uint8, device=weights.device)
        scales, sqnrs = [], []
        for e in range(info.num_experts):
            w2d = weights[e]
            qw = None if round_expert is None else round_expert(proj, e, w2d, report.warnings)
            if qw is None:
                scale = choose_scale(w2d, weight_format, gran, w_calib, pow2=pow2,
                                     what=f"expert {e} {proj} weight", warnings=report.warnings)
                qw = quantize_weight(w2d, scale, weight_format, gran, rounding=rounding,
                                     name=expert_unit_name(name, e, proj))
            codes[e] = qw.codes
            scales.append(qw.scale)
            sqnrs.append(qw.sqnr_db)
        input_scale, unseen, input_sqnr = None, [], []
        if act_format is not None and act_granularity == "tensor":
            input_scale, unseen, input_sqnr = _input_scales(name, proj, info, act_format,
                                                            a_calib, stats, pow2, report)
        projections[proj] = ProjectionQuant(codes, torch.stack(scales), input_scale)
        report.projections[proj] = {
            "weight_sqnr_db_min": min(sqnrs),
            "weight_scale_min": float(torch.stack(scales).min()),
            "weight_scale_max": float(torch.stack(scales).max()),
            "input_scales": None if input_scale is None else [float(s) for s in input_scale],
            "input_sqnr_db_min": min(input_sqnr) if input_sqnr else None,
            "experts_without_tokens": unseen,
        }
    q = QuantExperts(module, info, weight_format=weight_format, weight_granularity=gran,
                     act_format=act_format, act_granularity=act_granularity,
                     projections=projections)
    return q, report


def unify_expert_input_scales(q: QuantExperts) -> None:
    """One static input scale per projection for all experts of a layer (vLLM's fused-MoE
    kernels use the largest): an expert's own scale would be replaced at load time anyway."""
    for proj in q.info.projections:
        s = q.input_scale(proj)
        if s is not None:
            s.fill_(s.max())


def _input_scales(name, proj, info, act_format, a_calib, stats, pow2, report):
    """One static input scale per expert; an expert that saw no token takes the largest scale
    of its siblings in this layer (a scale that covers what the others saw is the safest guess:
    clipping an outlier costs more than a coarser grid), and is named in a warning."""
    scales: list[torch.Tensor | None] = []
    sqnr = []
    for e in range(info.num_experts):
        st = stats.get(expert_unit_name(name, e, proj))
        if st is None or not st.seen:
            scales.append(None)
            continue
        amax = a_calib.amax(st, act_format)
        s = amax_to_scale(amax, act_format, pow2=pow2, what=f"expert {e} {proj} input",
                          warnings=report.warnings)
        scales.append(s.reshape(()))
        sqnr.append(histogram_sqnr_db(st, float(s), act_format))
    unseen = [e for e, s in enumerate(scales) if s is None]
    seen = [s for s in scales if s is not None]
    if unseen:
        fallback = torch.stack(seen).max() if seen else amax_to_scale(
            0.0, act_format, pow2=pow2, what=f"{proj} input", warnings=report.warnings
        ).reshape(())
        scales = [fallback if s is None else s for s in scales]
        report.warnings.append(
            f"{proj}: expert(s) {unseen} saw no calibration token; they use "
            + ("the largest input scale of their sibling experts" if seen else
               "scale 1 (no expert of this layer saw a token)"))
    return torch.stack(scales).float(), unseen, sqnr
