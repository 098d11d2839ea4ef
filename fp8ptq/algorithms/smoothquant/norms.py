"""SmoothQuant (Xiao et al., 2023): move activation outliers into the weights before quantizing.

For every input channel j of a group of GEMMs that share one input X (the output of a norm),

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)

(``max|W_j|``: column j of the ``[out, in]`` weights, over all GEMMs of the group). ``X / s`` is
folded into the norm's affine weight (and bias), ``W * s`` into every GEMM's input columns, so the
high-precision model computes the same function while the quantized one sees flatter inputs.
Nothing here special-cases a number format: int8, e4m3, hif8, ... are all smoothed alike.

Groups are found, not listed per architecture: one small forward (an example batch, else the
model's ``dummy_inputs``) with hooks matches each GEMM's input tensor, by identity, to the module
that produced it. A group is smoothed only when

- its producer has a 1-D affine ``weight`` (LayerNorm, RMSNorm and friends) and folding 1/s into
  that weight (``w / s``, or ``(1 + w) / s - 1`` for Gemma-style ``x * (1 + w)`` norms) and bias
  is checked to divide the norm's output by s;
- every GEMM fed by that output is a quantization target (``nn.Linear`` / transformers
  ``Conv1D``), fed only by that norm, with weights shared with no other module;
- the norm output reaches the model's output through those GEMMs only. This is checked on the
  example: the norm output is divided and the GEMM inputs multiplied by random powers of two
  (exact in any float dtype) and the model output must not change. Pre-LN blocks pass; in post-LN
  models (BERT, OPT-350m) the norm output also feeds the residual stream, where folding is not
  exact, so those groups are reported as skipped.

Found this way: Llama-family ``input_layernorm -> q/k/v_proj`` and ``post_attention_layernorm ->
gate/up_proj``, GPT-2 ``ln_1 -> attn.c_attn`` and ``ln_2 -> mlp.c_fc``, OPT (pre-LN)
``self_attn_layer_norm -> q/k/v_proj`` and ``final_layer_norm -> fc1``. Final norms feed the
(unquantized, often tied) ``lm_head`` and are skipped; BERT's pairings (``embeddings.LayerNorm ->
layer.0 query/key/value``, ``attention.output.LayerNorm -> intermediate.dense``,
``output.LayerNorm -> next layer's query/key/value``) are found and skipped as post-LN; only
the last layer's ``output.LayerNorm -> qa_outputs`` (or another head Linear) is exact and
smoothed.

``recipe.smoothquant_into`` (``--smoothquant-into``) says where ``1/s`` goes: "norms" (the
groups above; the default), "gemms" (GEMM -> GEMM pairs, ``up_proj -> down_proj`` and
``v_proj -> o_proj``, whose inputs no norm produces and where small decoders carry their
massive activations: ``fp8ptq.algorithms.smoothquant.pairs``) or "all". Pairs are smoothed after the
norms (a producer's rows and its columns take independent factors).

``alpha="auto"`` searches alpha per group (and per pair) for the smallest output error of the
group's GEMMs quantized in their target formats, on the row samples of the statistics pass:
``sum_c || Qa(X / s) Qw(W_c * s)^T - X W_c^T ||^2`` (per-tensor activation scale from the amax of
X / s over all calibration data, i.e. max calibration, or per-token; the recipe's weight
granularity and calibrator). Coarse to fine: ``ALPHA_GRID`` (steps of 0.1, 0.5 included), then
the two neighbours at +-``ALPHA_REFINE`` of the best. No smoothing (s = 1) is a candidate too: a
group where it wins is left as it is (``alpha`` null in the report), so "auto" never raises this
error above that of the unsmoothed model. At most ``MAX_SEARCH_ROWS`` input rows and
``MAX_SEARCH_OUT`` output channels per GEMM (whole blocks for block scales) are used, so the
search costs about one calibration pass on CPU.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ...calibrators import weight_calibrator
from ...config.plan import as_plan_parts
from ...formats import fake_quantize
from ...formats.granularity import PerBlock, PerTensor, weight_granularity
from ...formats.scales import TINY, amax_to_scale, divide
from ...model.gemm import weight_2d, weight_from_2d
from .groups import Group, check_exact, discover_groups, folded_norm_weight, trace_input
from .pairs import discover_pairs, fold_pair, reduce_to_producer

ALPHA_GRID = tuple(round(0.1 * i, 1) for i in range(11))  # 0.0, 0.1, ..., 1.0
ALPHA_REFINE = 0.05  # second stage of the search: best grid alpha +- this
FACTOR_MIN, FACTOR_MAX = 1e-5, 1e5
MAX_SEARCH_ROWS = 512  # input rows (tokens) used by the alpha search
MAX_SEARCH_OUT = 256  # output channels per GEMM used by the alpha search


def smoothing_factors(act_amax: torch.Tensor, weight_amax: torch.Tensor,
                      alpha: float) -> torch.Tensor:
    """s = act^alpha / weight^(1 - alpha) per channel (float32), finite and in
    [FACTOR_MIN, FACTOR_MAX]; channels whose activation or weight amax is 0 (or not finite)
    get s = 1."""
    a, w = act_amax.double(), weight_amax.double()
    s = a.pow(alpha) / w.pow(1.0 - alpha)
    ok = (a > 0) & (w > 0) & torch.isfinite(a) & torch.isfinite(w) & torch.isfinite(s) & (s > 0)
    s = torch.where(ok, s, torch.ones_like(s)).clamp(FACTOR_MIN, FACTOR_MAX)
    return s.float()


def apply_smoothquant(model: nn.Module, targets, stats: dict, row_samples: dict, plan,
                      example=None) -> dict:
    """Smooth ``model`` in place and return the report: norm -> GEMM groups among ``targets``
    (``recipe.smoothquant_into`` "norms" or "all") and GEMM -> GEMM pairs (``up_proj ->
    down_proj``, ``v_proj -> o_proj``; "gemms" or "all", ``fp8ptq.algorithms.smoothquant.pairs``).

    ``plan``: the run's ``QuantPlan`` (or, outside a run, its recipe): alpha, the weight
    granularity and calibrator the scales will be chosen with.

    ``stats``: name -> ``TensorStats`` (per-channel input amax) of the targets; ``row_samples``:
    name -> float32 ``[rows, in_features]`` input rows (used by ``alpha="auto"``); ``example``: a
    batch to trace the model with (its first row is used; default: the model's ``dummy_inputs``).

    Report (plain JSON types): ``alpha`` (the recipe's), ``into``, ``groups`` {norm:
    {consumers, channels, alpha (null: auto left it unsmoothed), factor_min, factor_max, search
    (auto)}}, ``pairs`` {"producer -> consumer": {producer, consumers, channels, repeats, alpha,
    factor_min, factor_max, search}}, ``skipped`` {producer or consumer: why}, ``unmatched``
    (quantized GEMMs whose input is no module's output, e.g. ``o_proj``, ``down_proj``, and that
    no pair smoothed), ``smoothed`` (groups and pairs changed).
    """
    recipe, _ = as_plan_parts(plan)
    alpha_opt, into = recipe.smoothquant, recipe.smoothquant_into
    report = {"alpha": alpha_opt, "into": into, "groups": {}, "pairs": {}, "skipped": {},
              "unmatched": [], "smoothed": 0}
    by_name = {t.name: t for t in targets}
    example = trace_input(model, example)
    if example is None:
        report["skipped"]["*"] = ("no example input to trace the model with (pass a calibration "
                                  "batch; the model has no dummy_inputs); nothing smoothed")
        return report

    was_training = {m: m.training for m in model.modules()}
    model.eval()
    try:
        candidates = discover_groups(model, example, by_name, stats, report)
        if into == "gemms":
            candidates = []
        if candidates:
            check_exact(model, example, candidates, report)
        pairs = [] if into == "norms" else discover_pairs(
            model, example, by_name, stats, report["unmatched"], report)
    finally:
        for m, flag in was_training.items():
            m.training = flag

    ctx = (alpha_opt, row_samples, by_name, recipe,
           weight_granularity(recipe.weight_granularity, recipe.block_size),
           weight_calibrator(recipe.weight_calib))
    for g in candidates:
        act_amax = _act_amax(g, stats)
        w_amax = torch.stack([weight_2d(m).detach().abs().amax(dim=0).float().cpu()
                              for m in g.modules]).amax(dim=0)
        entry: dict = {"consumers": list(g.consumers), "channels": int(act_amax.numel())}
        report["groups"][g.norm_name] = entry
        done = _smooth_one(report, "groups", g.norm_name, g.norm_name, g, act_amax,
                           lambda a, x=act_amax, w=w_amax: smoothing_factors(x, w, a),
                           lambda s: s, lambda s, g=g: _fold(g, s), ctx)
        if done and g.style != "scale":
            entry["fold"] = g.style
    for p in pairs:  # after the norms: rows of a producer commute with its columns' factors
        act_c = stats[p.consumer].channel_amax.float().cpu()
        w_c = weight_2d(p.cons).detach().abs().amax(dim=0).float().cpu()
        act_p, w_p = reduce_to_producer(act_c, p), reduce_to_producer(w_c, p)
        entry = {"producer": p.producer, "consumers": [p.consumer],
                 "channels": int(act_p.numel()), "repeats": p.repeats}
        report["pairs"][p.name] = entry
        _smooth_one(report, "pairs", p.name, p.consumer,
                    Group(p.name, p.prod, [p.consumer], [p.cons]), act_c,
                    lambda a, x=act_p, w=w_p: smoothing_factors(x, w, a),
                    lambda s, i=p.index: s[i], lambda s, p=p: fold_pair(p, s), ctx)
    paired = {p.consumer for p in pairs}
    report["unmatched"] = [c for c in report["unmatched"]
                           if c not in paired and c not in report["skipped"]]
    report["smoothed"] = sum(e["alpha"] is not None for part in ("groups", "pairs")
                             for e in report[part].values())
    return report


def _smooth_one(report, part, key, skip_key, g: Group, act_amax, factors, per_input, fold,
                ctx) -> bool:
    """Choose alpha for one norm group or GEMM pair (``report[part][key]``, already created),
    fold its factors ``factors(alpha)`` (per producer channel; ``per_input`` maps them to the
    consumers' input channels for the alpha search) and record them; True when folded. A fold
    that would overflow moves the entry to ``report["skipped"][skip_key]``."""
    entry = report[part][key]
    alpha = _choose_alpha(g, act_amax, lambda a: per_input(factors(a)), entry, ctx)
    if alpha is None:
        return False
    s = factors(alpha)
    problem = fold(s)
    if problem:
        del report[part][key]
        report["skipped"][skip_key] = problem
        return False
    entry.update(alpha=alpha, factor_min=float(s.min()), factor_max=float(s.max()))
    return True


def _choose_alpha(g: Group, act_amax, factors, entry: dict, ctx) -> float | None:
    """The recipe's alpha, or the searched one ("auto"; None: leave the group unsmoothed,
    recorded in ``entry``)."""
    alpha_opt, row_samples, by_name, recipe, gran, w_calib = ctx
    if alpha_opt != "auto":
        return float(alpha_opt)
    x = row_samples.get(g.consumers[0]) if row_samples else None
    if x is None or x.numel() == 0:
        entry["note"] = "no row samples for the alpha search; alpha 0.5 used"
        return 0.5
    alpha, entry["search"] = _search_alpha(g, x, act_amax, factors, by_name, recipe, gran,
                                           w_calib)
    if alpha is None:
        entry.update(alpha=None, note="no alpha beat the unsmoothed output error; left "
                     "unsmoothed")
    return alpha


# --- smoothing -----------------------------------------------------------------------------

def _act_amax(g: Group, stats) -> torch.Tensor:
    return torch.stack([stats[c].channel_amax.float().cpu() for c in g.consumers]).amax(dim=0)


@torch.no_grad()
def _fold(g: Group, s: torch.Tensor) -> str | None:
    """X / s into the norm, W * s into the GEMMs; returns why not, if the result would not be
    finite in the model's dtypes (nothing is changed then)."""
    w = g.norm.weight
    sd = s.to(w.device)
    new = {w: folded_norm_weight(w.detach(), sd, g.style).to(w.dtype)}
    b = getattr(g.norm, "bias", None)
    if b is not None:
        new[b] = (b.detach().float() / sd).to(b.dtype)
    for m in g.modules:
        w2 = weight_2d(m).detach().float() * s.to(m.weight.device)
        new[m.weight] = weight_from_2d(m, w2).to(m.weight.dtype)
    if not all(bool(torch.isfinite(v).all()) for v in new.values()):
        return f"smoothed weights overflow {w.dtype}; left unsmoothed"
    for p, v in new.items():
        p.copy_(v)
    return None


@torch.no_grad()
def _search_alpha(g: Group, x, act_amax, factors, by_name, recipe, gran, w_calib):
    """The alpha with the smallest quantized output error of the group's GEMMs (None: no
    smoothing is better still) and the search's record. ``factors(alpha)``: s per input
    channel of the group's GEMMs."""
    device = g.modules[0].weight.device
    x = x.float()
    if x.shape[0] > MAX_SEARCH_ROWS:
        x = x[torch.linspace(0, x.shape[0] - 1, MAX_SEARCH_ROWS).round().long()]
    x = x.to(device)
    act_amax_d = act_amax.to(device)
    det = {"rounding": recipe.rounding} if recipe.rounding in ("nearest_even", "half_away") else {}
    layers = []
    for name, m in zip(g.consumers, g.modules):
        w = weight_2d(m).detach().float()
        rows = _output_rows(w.shape[0], gran)
        w_rows = w if rows is None else w[rows]
        layers.append((by_name[name], w, w_rows, x @ w_rows.T, w.shape[0] / w_rows.shape[0]))

    def error(s) -> float:
        xs = x / s
        xq_cache, total = {}, 0.0
        for t, w, w_rows, ref, weight in layers:
            fmt = t.act_format
            key = None if fmt is None else fmt.name
            if key not in xq_cache:
                xq_cache[key] = xs if fmt is None else fake_quantize(
                    xs, _act_scale(xs, act_amax_d / s, fmt, recipe), fmt)
            ws = w_rows * s
            if isinstance(gran, PerTensor):  # the scale depends on the whole matrix
                w_scale = _weight_scale(w * s, gran, w_calib, t.weight_format, recipe)
            else:  # per-row / whole-block-row scales: the sampled rows are enough
                w_scale = _weight_scale(ws, gran, w_calib, t.weight_format, recipe)
            wq = fake_quantize(ws, gran.expand(w_scale, ws), t.weight_format, **det)
            total += float((xq_cache[key] @ wq.T - ref).double().pow(2).sum()) * weight
        return total

    tried: dict[float, float] = {}

    def best_of(alphas) -> float:
        for a in alphas:
            if a not in tried:
                tried[a] = error(factors(a).to(device))
        return min(tried, key=lambda a: (tried[a], a))

    best = best_of(ALPHA_GRID)
    best = best_of([a for a in (round(best - ALPHA_REFINE, 4), round(best + ALPHA_REFINE, 4))
                    if 0 <= a <= 1])
    baseline = error(torch.ones_like(act_amax_d))
    search = {"tried": [[a, tried[a]] for a in sorted(tried)], "error": tried[best],
              "error_unsmoothed": baseline}
    return (None if baseline <= tried[best] else best), search


def _output_rows(out: int, gran) -> torch.Tensor | None:
    """Output channels the search uses: all, or an even spread (whole blocks for block
    scales, in order, so the block grid of the sub-matrix matches the full one)."""
    if out <= MAX_SEARCH_OUT:
        return None
    if isinstance(gran, PerBlock):
        n_blocks = math.ceil(out / gran.size)
        k = max(1, MAX_SEARCH_OUT // gran.size)
        if k >= n_blocks:
            return None
        blocks = torch.linspace(0, n_blocks - 1, k).round().long().unique()
        return torch.cat([torch.arange(b * gran.size, min((b + 1) * gran.size, out))
                          for b in blocks.tolist()])
    return torch.linspace(0, out - 1, MAX_SEARCH_OUT).round().long().unique()


def _weight_scale(w, gran, w_calib, fmt, recipe):
    return amax_to_scale(w_calib.amax(w, gran, fmt), fmt, pow2=recipe.scale_pow2).to(w.device)


def _act_scale(xs, channel_amax, fmt, recipe):
    if recipe.act_granularity == "token":
        return divide(xs.abs().amax(dim=-1, keepdim=True), fmt.max).clamp(min=TINY)
    return amax_to_scale(channel_amax.max(), fmt, pow2=recipe.scale_pow2).to(xs.device)
