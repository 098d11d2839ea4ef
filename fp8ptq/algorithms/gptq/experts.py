"""GPTQ for fused MoE experts (transformers 5's ``...Experts``: ``gate_up_proj`` [E, 2I, H],
``down_proj`` [E, H, I]).

Each expert is two GEMMs with its own inputs, so each gets its own Hessians: ``gate_up``'s from
the hidden states the router sends that expert (gate and up read the same input: one Hessian
for both), ``down``'s from that expert's intermediate ``act(gate) * up``. With
``all_tokens`` (``--gptq-all-experts``, llm-compressor's ``moe_calibrate_all_experts``) every
calibration token counts for every expert instead: the ``gate_up`` Hessian is then the same for
all experts and is held once. Routed tokens are the default: they are the inputs each expert
multiplies at inference, and on held-out tokens they gave a lower error than every-token
Hessians (docs/results/llm-compressor.md, "GPTQ for MoE experts"), whose sweep left one expert
of the tests' tiny Qwen3-MoE above round to nearest.

In sequential GPTQ's order (``fp8ptq.algorithms.gptq.sequential``) an experts module is one
step where the block runs it, in two halves: the forwards stop on entering the experts, each
expert's ``gate_up`` Hessian is summed, every ``gate_up`` is swept and the module becomes its
``QuantExperts`` (``down`` rounded to nearest for the moment); then the forwards stop on
entering the quantized module again, which hands each expert's tokens through its quantized
``gate_up`` (its input quantization included, exactly as inference does) to sum the ``down``
Hessians, and each expert's ``down`` codes and scales are overwritten in place by its sweep.
The groups after the experts (and the next block) see quantized experts.

Memory: the Hessian sums of one experts module and one projection at a time, each allocated
when its expert first receives a token and freed as that expert is swept; an expert that
received no token keeps round-to-nearest. For a Qwen3-30B-A3B layer (128 experts, hidden
2048, expert width 768) with every expert hit: 128 x 2048^2 x 8 B = 4.3 GB of float64
``gate_up`` sums (2.1 GB in float32), then 128 x 768^2 x 8 B = 0.6 GB for ``down``; with
``all_tokens`` one 34 MB ``gate_up`` sum. No float copy of the fused weights is made: each
expert's ``[out, in]`` slice is swept on its own and its codes written into the fused codes.

Sink-aware and asymmetric GPTQ aim the plain GEMMs at corrected targets; the experts get
plain GPTQ under them (their tokens are flattened across sequences, so the first tokens are
not singled out, and no float stream runs through them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ...formats import FormatSpec, decode
from ...formats.scales import sqnr_db
from ...formats.weight_quant import QuantizedWeight, choose_scale, quantize_weight
from ...model.experts import ExpertsInfo, expert_weight
from ...model.forward import run_batch
from ...model.lean import lean_forwards
from ...observe import distributed
from .replay import PartialForwards
from .sweep import Precision, gptq_codes

# feed(module, observe): every calibration batch run up to ``module``'s entry, where
# ``observe(args, kwargs)`` sees the arguments it is called with; the forward stops there
Feed = Callable[[nn.Module, Callable[[tuple, dict], None]], None]
# (experts plan entry, feed) -> its GPTQ facts (``gptq_experts``'s)
QuantizeExperts = Callable[[object, Feed], dict]

SHARED = -1  # the key of the one sum every expert shares (``all_tokens``)


class ExpertHessians:
    """Sums of ``x x^T`` of one projection's input, per expert, allocated when the expert
    first receives a row (``shared``: one sum for every expert, whose rows are the same) and
    given back, scaled as ``2 X^T X / rows``, by ``take`` (which frees a per-expert sum).
    ``diagonal``: only ``diag(X^T X)``, all that Hessian-weighted scales rounded to nearest
    (``hmse``) read."""

    def __init__(self, num_experts: int, shared: bool = False,
                 dtype: torch.dtype = torch.float64, diagonal: bool = False):
        self.num_experts, self.shared, self.dtype = num_experts, shared, dtype
        self.diagonal = diagonal
        self.sums: dict[int, torch.Tensor] = {}
        self.rows: dict[int, int] = {}
        self.peak_bytes = 0

    def add(self, expert: int, x: torch.Tensor) -> None:
        """``x`` [rows, in]: rows that reach ``expert``'s projection (float32 product, summed in
        ``dtype`` on ``x``'s device)."""
        if x.shape[0] == 0:
            return
        key = SHARED if self.shared else expert
        x = x.detach().float()
        product = x.square().sum(dim=0) if self.diagonal else x.T @ x
        if key in self.sums:
            self.sums[key].add_(product)
        else:
            self.sums[key] = product.to(self.dtype, copy=True)
        self.rows[key] = self.rows.get(key, 0) + x.shape[0]
        self.peak_bytes = max(self.peak_bytes, self.nbytes)

    @property
    def nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.sums.values())

    def experts(self) -> list[int]:
        """The experts that received rows."""
        return list(range(self.num_experts)) if SHARED in self.sums else sorted(self.sums)

    def take(self, expert: int) -> torch.Tensor | None:
        """``expert``'s Hessian (None: it received no row); a per-expert sum is scaled in place
        and handed over (no longer held here)."""
        key = SHARED if self.shared else expert
        if key not in self.sums:
            return None
        # (the sums were made under inference mode: scaled out of place, the sum then dropped)
        s = self.sums[key] if self.shared else self.sums.pop(key)
        return s * (2.0 / self.rows[key])

    def reduce(self, features: int, device: torch.device) -> None:
        """Sum across torchrun ranks: every rank first learns which experts any rank saw (a
        rank that saw none of an expert's rows adds zeros), so the collectives agree."""
        if not distributed.active():
            return
        keys = [SHARED] if self.shared else list(range(self.num_experts))
        rows = {"rows": torch.tensor([float(self.rows.get(k, 0)) for k in keys],
                                     dtype=torch.float64, device=device)}
        distributed.reduce_sums(rows, {})
        total = {k: int(r) for k, r in zip(keys, rows["rows"].tolist()) if r > 0}
        shape = (features,) if self.diagonal else (features, features)
        sums = {str(k): self.sums.get(k) if k in self.sums else
                torch.zeros(shape, dtype=self.dtype, device=device) for k in total}
        distributed.reduce_sums(sums, {})
        self.sums = {int(k): s for k, s in sums.items()}
        self.rows = total


@dataclass(frozen=True)
class ExpertRounding:
    """The recipe's weight rounding for the experts: format, granularity, weight calibrator
    (``hmse``-like ones choose the scale with the Hessian), and GPTQ's options; ``sweep``
    False: the Hessian serves the scale only (``hmse``: round to nearest)."""

    fmt: FormatSpec
    gran: object
    w_calib: object
    sweep: bool = True
    damp: float = 0.01
    act_order: bool = False
    block: int = 128
    rounding: str | None = None
    pow2: bool = False
    all_tokens: bool = False
    dtype: torch.dtype = torch.float64
    sweep_dtype: tuple = (torch.float32, torch.float32)  # ``sweep.Precision``'s fields


def round_expert(w2d: torch.Tensor, hessian: torch.Tensor, r: ExpertRounding, what: str,
                 warnings: list[str]) -> QuantizedWeight:
    """One expert's ``[out, in]`` matrix rounded with its Hessian, on the weight's device."""
    scale = choose_scale(w2d, r.fmt, r.gran, r.w_calib, pow2=r.pow2, what=what,
                         warnings=warnings, hessian=hessian)
    if not r.sweep:
        return quantize_weight(w2d, scale, r.fmt, r.gran, rounding=r.rounding, name=what)
    w = w2d.detach().float()
    expanded = r.gran.expand(scale, w)
    codes = gptq_codes(w, hessian, expanded, r.fmt, damp=r.damp, act_order=r.act_order,
                       block=r.block, rounding=r.rounding, sweep_dtype=Precision(*r.sweep_dtype))
    deq = decode(codes, r.fmt) * expanded
    return QuantizedWeight(codes, scale, float(w.abs().max()), sqnr_db(w, deq))


def _routing(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden states [tokens, H], top-k expert indices [tokens, k]) of an experts call."""
    x = args[0] if args else kwargs["hidden_states"]
    idx = args[1] if len(args) > 1 else kwargs["top_k_index"]
    x = x.reshape(-1, x.shape[-1])
    return x, idx.reshape(x.shape[0], -1)


def _rows_by_expert(idx: torch.Tensor, num_experts: int, all_tokens: bool):
    """(expert, row selector or None for every row) for each expert that gets rows."""
    if all_tokens:
        return [(e, None) for e in range(num_experts)]
    hit = torch.unique(idx[(idx >= 0) & (idx < num_experts)]).tolist()
    return [(e, (idx == e).any(dim=-1)) for e in hit]


def observe_inputs(hessians: ExpertHessians, args: tuple, kwargs: dict) -> None:
    """``gate_up``'s input rows per expert (shared: every row once)."""
    x, idx = _routing(args, kwargs)
    if hessians.shared:
        hessians.add(SHARED, x)
        return
    for e, rows in _rows_by_expert(idx, hessians.num_experts, False):
        hessians.add(e, x[rows])


def observe_intermediate(hessians: ExpertHessians, q: nn.Module, all_tokens: bool,
                         args: tuple, kwargs: dict) -> None:
    """``down``'s input rows per expert: each expert's tokens through its quantized first
    projection (``QuantExperts._gemm``: input quantization included) and the gating."""
    x, idx = _routing(args, kwargs)
    first = q.info.projections[0]
    for e, rows in _rows_by_expert(idx, q.num_experts, all_tokens):
        h = q._gemm(first, e, x if rows is None else x[rows])
        h = q.inner._apply_gate(h) if q.info.has_gate else q.inner.act_fn(h)
        hessians.add(e, h)


def gptq_experts(module: nn.Module, info: ExpertsInfo, feed: Feed,
                 build: Callable[[Callable], nn.Module], r: ExpertRounding) -> dict:
    """Sweep every expert of ``module`` that receives tokens (see the module docstring).
    ``build(round_first)`` makes and installs the ``QuantExperts`` (``quantize_experts``
    with ``round_expert=round_first``) and returns it. Returns the facts for the report."""
    first, down = info.projections
    # a view of the float down weights, kept while the QuantExperts holds codes only
    down_weight = expert_weight(module, info, down).detach()
    device = down_weight.device
    inputs = ExpertHessians(info.num_experts, shared=r.all_tokens, dtype=r.dtype,
                            diagonal=not r.sweep)
    feed(module, lambda args, kwargs: observe_inputs(inputs, args, kwargs))
    inputs.reduce(dict(info.shapes)[first][2], device)
    swept = {first: inputs.experts(), down: []}
    peak = inputs.peak_bytes

    def round_first(proj, e, w2d, warnings):
        hessian = inputs.take(e) if proj == first else None
        return None if hessian is None else round_expert(
            w2d, hessian, r, f"expert {e} {proj} weight", warnings)

    q = build(round_first)
    inputs.sums.clear()
    mids = ExpertHessians(info.num_experts, dtype=r.dtype, diagonal=not r.sweep)
    feed(q, lambda args, kwargs: observe_intermediate(mids, q, r.all_tokens, args, kwargs))
    mids.reduce(dict(info.shapes)[down][2], device)
    peak = max(peak, mids.peak_bytes)
    warnings: list[str] = []
    for e in mids.experts():
        qw = round_expert(down_weight[e], mids.take(e), r, f"expert {e} {down} weight",
                          warnings)
        q.codes(down)[e].copy_(qw.codes)
        q.weight_scale(down)[e].copy_(qw.scale)
        swept[down].append(e)
    return {"swept": {p: len(v) for p, v in swept.items()},
            "rounded_to_nearest": sorted(set(range(info.num_experts)) - set(swept[first])),
            "max_hessian_bytes": peak, "warnings": warnings,
            "down_sqnr_db_min": min(sqnr_db(down_weight[e].float(), q.dequantized_weight(down, e))
                                    for e in range(info.num_experts))}


class ExpertSteps:
    """Runs ``quantize(entry, feed)`` for an experts module reached in run order: ``feed``
    runs every batch up to the module it is given (the experts, then their ``QuantExperts``),
    through sequential GPTQ's partial forwards (``PartialForwards``: what the earlier groups'
    forwards finished is replayed)."""

    def __init__(self, quantize: QuantizeExperts):
        self.quantize = quantize

    def run(self, unit: nn.Module, entry, batches: list, partial: PartialForwards | None,
            facts: dict, record: bool) -> None:
        calls = []  # the first forward is followed by the second: it always records

        def feed(module: nn.Module, observe) -> None:
            keep = record or not calls
            calls.append(module)
            handles = [module.register_forward_pre_hook(
                lambda _m, args, kwargs: observe(args, kwargs), with_kwargs=True),
                module.register_forward_pre_hook(_stop)]
            error = None
            with torch.inference_mode(), lean_forwards(unit):
                try:
                    for j, batch in distributed.shard(batches):
                        if batch is None:
                            continue
                        if partial is None:
                            _run_to_stop(unit, batch)
                        else:
                            partial.run(j, [module], lambda b=batch: _run_to_stop(unit, b),
                                        keep)
                except Exception as e:  # noqa: BLE001 - re-raised by agree, on every rank
                    error = e
                finally:
                    for h in handles:
                        h.remove()
            distributed.agree(error)
            facts["forwards"] += 1

        if not any(b is not None for b in batches):
            return
        done = self.quantize(entry, feed) or {}
        facts["groups"] += 1
        facts["max_hessian_bytes"] = max(facts["max_hessian_bytes"],
                                         done.get("max_hessian_bytes", 0))


class _Stop(Exception):
    pass


def _stop(_module, _args):
    raise _Stop


def _run_to_stop(unit: nn.Module, batch) -> None:
    try:
        run_batch(unit, batch, logits=False)
    except _Stop:
        pass


def expert_output_errors(reference: nn.Module, q: nn.Module, x: torch.Tensor,
                         idx: torch.Tensor) -> dict[int, float]:
    """Per expert, the mean squared error of its own output (router weight 1) computed by
    ``q`` against ``reference`` (the float experts module) on the rows of ``x`` [T, H] the
    top-k indices ``idx`` [T, k] send to it: the experts' layer-output error, one expert at a
    time (what GPTQ minimises; the benchmark and the tests read it on held-out tokens)."""
    out = {}
    with torch.no_grad():
        for e, rows in _rows_by_expert(idx, q.num_experts, False):
            xe = x[rows]
            sel = torch.full((xe.shape[0], 1), e, dtype=idx.dtype, device=idx.device)
            weight = torch.ones(xe.shape[0], 1, dtype=xe.dtype, device=xe.device)
            diff = reference(xe, sel, weight).double() - q(xe, sel, weight).double()
            out[e] = float(diff.square().mean())
    return out
