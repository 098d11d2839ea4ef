"""Calibrators that judge a scale by the error of the layer's OUTPUT, not its input.

- ``best`` (Micikevicius et al. 2022 sec 4.2): per GEMM, the max, percentile and MSE input
  scales from the one calibration pass compete; the one whose quantized output (quantized input
  x quantized weight) is closest to the high-precision output on sampled input rows wins.
- ``pow2-search`` (Luo et al. 2024 Algorithm 1): layer by layer in forward order, search
  power-of-two scales 2^-Ea for the input and 2^-Ew for the weight (Ea, Ew in
  ``recipe.pow2_range``) that minimise the MSE of the layer output against the high-precision
  output, while every layer is fed the quantized output of the layers before it. For formats
  whose precision is uniform across the range (not HiF8) the exponents are searched around the
  power-of-two max scale instead of around 1, so that the same range suits E4M3's max of 448 and
  int8's 127. With per-channel or block weights only Ea is searched; the weight keeps its
  calibrated scales.

Both read the row samples kept by the single statistics pass (``StatsCollector``); the search
also runs the first calibration batch once more. Convolutions compare input error instead of
output error (the samples are channel rows, not im2col patches).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fp8ptq.formats import fake_quantize
from fp8ptq.formats.granularity import PerTensor
from fp8ptq.formats.scales import amax_to_scale
from fp8ptq.model.forward import head_observed, run_batch
from fp8ptq.model.gemm import CONV_TYPES, input_channel_dim, weight_2d, weight_from_2d
from fp8ptq.observe.observers import sample_rows

from .registry import activation_entry


@dataclass
class LayerChoice:
    method: str
    input_amax: float | None = None
    input_scale: torch.Tensor | None = None
    weight_scale: torch.Tensor | None = None
    weight_granularity: object | None = None
    error: float | None = None


def choose_layerwise(model, targets, stats, samples, recipe, gran, w_calib, batches) -> dict:
    """Run the layer-aware calibrator ``recipe.act_calib`` names (dispatched by its registry
    entry) on every target with a static input; ``{module name: LayerChoice}``."""
    choose = activation_entry(recipe.act_calib).choose
    if choose is None:
        raise ValueError(f"{recipe.act_calib!r} is not a layer-aware calibrator")
    targets = [t for t in targets if t.input is not None and t.input.static
               and t.name in samples]
    return choose(model, targets, stats, samples, recipe, gran, w_calib, batches)


def choose_best(model, targets, stats, samples, recipe, gran, w_calib, batches) -> dict:
    """``best``: the statistics calibrators compete per layer on its output error."""
    return {t.name: _best_of(t, stats[t.name], samples[t.name], recipe, gran, w_calib)
            for t in targets}


def choose_pow2_search(model, targets, stats, samples, recipe, gran, w_calib, batches) -> dict:
    """``pow2-search``: the layer-by-layer power-of-two search, on the first batch."""
    return _pow2_search(model, targets, stats, samples, recipe, gran, w_calib, batches[:1])


def _quantized_weight(t, gran, w_calib, recipe):
    w = weight_2d(t.module).detach().float()
    scale = amax_to_scale(w_calib.amax(w, gran, t.weight_format), t.weight_format,
                          pow2=recipe.scale_pow2)
    return w, fake_quantize(w, gran.expand(scale, w), t.weight_format)


def _output_error(t, x, x_q, w, w_q) -> float:
    if isinstance(t.module, CONV_TYPES):
        return float((x_q - x).pow(2).mean())
    return float((x_q @ w_q.T - x @ w.T).pow(2).mean())


def _best_of(t, st, x, recipe, gran, w_calib) -> LayerChoice:
    w, w_q = _quantized_weight(t, gran, w_calib, recipe)
    best = None
    for name in ("max", "percentile", "mse"):
        calib = activation_entry(name)
        amax = calib.build(**calib.options_from(recipe)).amax(st, t.act_format)
        scale = amax_to_scale(amax, t.act_format, pow2=recipe.scale_pow2)
        err = _output_error(t, x, fake_quantize(x, scale, t.act_format), w, w_q)
        if best is None or err < best.error:
            best = LayerChoice(f"best:{name}", input_amax=amax, input_scale=scale, error=err)
    return best


def _base_exponent(amax: float, fmt) -> int:
    """Exponent e of the starting scale 2^e: 0 (direct cast) for tapered formats, else the
    power-of-two scale that maps amax inside the format's range."""
    if fmt.tapered or amax <= 0 or not math.isfinite(amax):
        return 0
    return math.ceil(math.log2(amax / fmt.max))


def _pow2_search(model, targets, stats, samples, recipe, gran, w_calib, batches) -> dict:
    low, high = recipe.pow2_range
    exps = torch.arange(low, high + 1, dtype=torch.float32)
    search_weight = isinstance(gran, PerTensor)
    choices, originals, handles = {}, {}, []

    def make_hook(t):
        dim = input_channel_dim(t.module)

        def hook(module, args):
            x = args[0]
            rows_q = sample_rows(x.detach(), dim, 16).float()
            x_fp = samples[t.name][: rows_q.shape[0]]
            choice, w_q = _search_layer(t, stats[t.name], x_fp, rows_q, exps, search_weight,
                                        gran, w_calib, recipe)
            choices[t.name] = choice
            # Downstream layers must see this layer's quantized output (Algorithm 1, line 14).
            originals[t.name] = module.weight.data
            module.weight.data = weight_from_2d(module, w_q).to(module.weight.dtype)
            return (fake_quantize(x, choice.input_scale, t.act_format), *args[1:])

        return hook

    try:
        handles = [t.module.register_forward_pre_hook(make_hook(t)) for t in targets]
        logits = head_observed(model, [t.module for t in targets])
        with torch.inference_mode():
            for batch in batches:
                run_batch(model, batch, logits=logits)
                for h in handles:  # search once, on the first batch
                    h.remove()
    finally:
        for h in handles:
            h.remove()
        for t in targets:
            if t.name in originals:
                t.module.weight.data = originals[t.name]
    return choices


def _search_layer(t, st, x_fp, x_chain, exps, search_weight, gran, w_calib, recipe):
    w = weight_2d(t.module).detach().float()
    a_base = _base_exponent(st.amax, t.act_format)
    a_scales = torch.exp2(a_base - exps)
    if search_weight:
        w_base = _base_exponent(float(w.abs().max()), t.weight_format)
        w_scales = torch.exp2(w_base - exps).reshape(-1, 1)
    else:
        w_scales = amax_to_scale(w_calib.amax(w, gran, t.weight_format), t.weight_format,
                                 pow2=recipe.scale_pow2).unsqueeze(0)
    w_candidates = [fake_quantize(w, gran.expand(s, w) if not search_weight else s.reshape(1, 1),
                                  t.weight_format) for s in w_scales]
    reference = x_fp @ w.T
    best = None
    for sa in a_scales:
        x_q = fake_quantize(x_chain, sa, t.act_format)
        for sw, w_q in zip(w_scales, w_candidates):
            if isinstance(t.module, CONV_TYPES):
                err = float((x_q - x_fp).pow(2).mean())
            else:
                err = float((x_q @ w_q.T - reference).pow(2).mean())
            if best is None or err < best[0]:
                best = (err, sa, sw, w_q)
    err, sa, sw, w_q = best
    choice = LayerChoice("pow2-search", input_amax=float(sa) * t.act_format.calibration_max,
                         input_scale=sa.reshape(1), error=err)
    if search_weight:
        choice.weight_scale, choice.weight_granularity = sw.reshape(1), gran
    return choice, w_q
