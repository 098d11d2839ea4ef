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

``alpha="auto"`` searches alpha per group for the smallest output error of the group's GEMMs
quantized in their target formats, on the row samples of the statistics pass:
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
import weakref
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from .calibrators import weight_calibrator
from .formats import fake_quantize
from .granularity import PerBlock, PerTensor, weight_granularity
from .model.forward import run_batch
from .model.gemm import Conv1D, find_gemms, weight_2d, weight_from_2d
from .plan import as_plan_parts
from .scales import TINY, amax_to_scale

ALPHA_GRID = tuple(round(0.1 * i, 1) for i in range(11))  # 0.0, 0.1, ..., 1.0
ALPHA_REFINE = 0.05  # second stage of the search: best grid alpha +- this
FACTOR_MIN, FACTOR_MAX = 1e-5, 1e5
MAX_SEARCH_ROWS = 512  # input rows (tokens) used by the alpha search
MAX_SEARCH_OUT = 256  # output channels per GEMM used by the alpha search
SMOOTHABLE = (nn.Linear,) + ((Conv1D,) if Conv1D else ())


@dataclass
class Group:
    norm_name: str
    norm: nn.Module
    consumers: list[str]
    modules: list[nn.Module] = field(default_factory=list)
    style: str = "scale"  # how 1/s folds into the norm weight: "scale" (w/s) or "offset"


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
    """Smooth ``model`` in place (norm -> GEMM groups among ``targets``) and return the report.

    ``plan``: the run's ``QuantPlan`` (or, outside a run, its recipe): alpha, the weight
    granularity and calibrator the scales will be chosen with.

    ``stats``: name -> ``TensorStats`` (per-channel input amax) of the targets; ``row_samples``:
    name -> float32 ``[rows, in_features]`` input rows (used by ``alpha="auto"``); ``example``: a
    batch to trace the model with (its first row is used; default: the model's ``dummy_inputs``).

    Report (plain JSON types): ``alpha`` (the recipe's), ``groups`` {norm: {consumers, channels,
    alpha (null: auto left it unsmoothed), factor_min, factor_max, search (auto)}}, ``skipped``
    {producer: why}, ``unmatched`` (quantized GEMMs whose input is no module's output, e.g.
    ``o_proj``, ``down_proj``: nothing to fold into), ``smoothed`` (groups changed).
    """
    recipe, _ = as_plan_parts(plan)
    alpha_opt = recipe.smoothquant
    report = {"alpha": alpha_opt, "groups": {}, "skipped": {}, "unmatched": [], "smoothed": 0}
    by_name = {t.name: t for t in targets}
    example = _trace_input(model, example)
    if example is None:
        report["skipped"]["*"] = ("no example input to trace the model with (pass a calibration "
                                  "batch; the model has no dummy_inputs); nothing smoothed")
        return report

    was_training = {m: m.training for m in model.modules()}
    model.eval()
    try:
        candidates = _discover(model, example, by_name, stats, report)
        if candidates:
            _check_exact(model, example, candidates, report)
    finally:
        for m, flag in was_training.items():
            m.training = flag

    gran = weight_granularity(recipe.weight_granularity, recipe.block_size)
    w_calib = weight_calibrator(recipe.weight_calib)
    for g in candidates:
        act_amax = _act_amax(g, stats)
        w_amax = torch.stack([weight_2d(m).detach().abs().amax(dim=0).float().cpu()
                              for m in g.modules]).amax(dim=0)
        entry: dict = {"consumers": list(g.consumers), "channels": int(act_amax.numel())}
        if alpha_opt == "auto":
            x = row_samples.get(g.consumers[0]) if row_samples else None
            if x is None or x.numel() == 0:
                alpha = 0.5
                entry["note"] = "no row samples for the alpha search; alpha 0.5 used"
            else:
                alpha, search = _search_alpha(g, x, act_amax, w_amax, by_name, recipe, gran,
                                              w_calib)
                entry["search"] = search
                if alpha is None:
                    entry.update(alpha=None, note="no alpha beat the unsmoothed output error; "
                                 "left unsmoothed")
                    report["groups"][g.norm_name] = entry
                    continue
        else:
            alpha = float(alpha_opt)
        s = smoothing_factors(act_amax, w_amax, alpha)
        problem = _fold(g, s)
        if problem:
            report["skipped"][g.norm_name] = problem
            continue
        entry.update(alpha=alpha, factor_min=float(s.min()), factor_max=float(s.max()))
        if g.style != "scale":
            entry["fold"] = g.style
        report["groups"][g.norm_name] = entry
    report["smoothed"] = sum(e["alpha"] is not None for e in report["groups"].values())
    return report


# --- discovery -----------------------------------------------------------------------------

def _trace_input(model, example):
    """One row of ``example`` (or of the model's ``dummy_inputs``), on the model's device."""
    if example is None:
        try:
            example = getattr(model, "dummy_inputs", None)
        except Exception:  # noqa: BLE001 - a property that cannot build inputs for this model
            example = None
        if not example:
            return None
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if vocab and isinstance(example, Mapping) and torch.is_tensor(example.get("input_ids")):
            example = {**example, "input_ids": example["input_ids"] % vocab}
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if torch.is_tensor(example):
        return example[:1].to(device)
    if isinstance(example, Mapping):
        lead = next((v.shape[0] for v in example.values() if torch.is_tensor(v) and v.dim()), None)
        return {k: (v[:1] if v.dim() and v.shape[0] == lead else v).to(device)
                if torch.is_tensor(v) else v for k, v in example.items()}
    return example


def _run(model, example):
    with torch.inference_mode():
        return run_batch(model, example)


def _discover(model, example, by_name, stats, report) -> list[Group]:
    """Trace which module's output feeds which GEMM; return the foldable candidate groups."""
    names = {}
    for name, m in model.named_modules():
        names.setdefault(m, name)
    gemms = dict(find_gemms(model))
    produced: dict[int, tuple[str, weakref.ref]] = {}
    feeds: dict[str, list[str | None]] = defaultdict(list)

    def out_hook(name):
        def hook(_m, _args, out):
            if torch.is_tensor(out):
                prev = produced.get(id(out))
                if prev is None or prev[1]() is not out:  # first producer wins: pass-throughs
                    produced[id(out)] = (name, weakref.ref(out))  # (eval dropout) keep it
        return hook

    def in_hook(name):
        def hook(_m, args):
            x = args[0] if args else None
            p = produced.get(id(x)) if torch.is_tensor(x) else None
            feeds[name].append(p[0] if p is not None and p[1]() is x else None)
        return hook

    handles = []
    try:
        for m, name in names.items():
            handles.append(m.register_forward_hook(out_hook(name)))
        for name, m in gemms.items():
            handles.append(m.register_forward_pre_hook(in_hook(name)))
        _run(model, example)
    finally:
        for h in handles:
            h.remove()

    by_producer: dict[str, list[str]] = defaultdict(list)
    for consumer, producers in feeds.items():
        if len(set(producers)) == 1 and producers[0] is not None:
            by_producer[producers[0]].append(consumer)
        elif consumer in by_name:
            report["unmatched"].append(consumer)
    param_uses = defaultdict(int)
    for _, p in model.named_parameters(remove_duplicate=False):
        param_uses[id(p)] += 1

    candidates = []
    for producer, consumers in by_producer.items():
        norm = model.get_submodule(producer) if producer else model
        reason = _group_problem(norm, producer, consumers, gemms, by_name, stats, feeds,
                                param_uses)
        if reason is None:
            style = _fold_style(norm)
            if style is None:
                reason = (f"{type(norm).__name__}'s output is not proportional to its weight "
                          "(folding 1/s into it is not exact)")
        if reason is not None:
            report["skipped"][producer or "<model>"] = f"-> {', '.join(consumers)}: {reason}"
            continue
        candidates.append(Group(producer, norm, consumers, [gemms[c] for c in consumers], style))
    return candidates


def _group_problem(norm, producer, consumers, gemms, by_name, stats, feeds, param_uses):
    w = getattr(norm, "weight", None)
    if not isinstance(w, nn.Parameter) or w.dim() != 1:
        return f"producer {type(norm).__name__} has no per-channel affine weight to fold into"
    b = getattr(norm, "bias", None)
    if b is not None and (not isinstance(b, nn.Parameter) or b.shape != w.shape):
        return f"producer {type(norm).__name__} has a bias that is not per-channel"
    if not w.dtype.is_floating_point:
        return "norm weight is not floating point"
    # every GEMM this norm feeds (a GEMM fed by several producers is not in ``consumers``)
    mixed = [c for c, ps in feeds.items() if producer in ps and c not in consumers]
    if mixed:
        return f"{', '.join(mixed)} also take(s) other inputs"
    outside = [c for c in consumers if c not in by_name]
    if outside:
        return f"feeds GEMM(s) that are not quantized: {', '.join(outside)}"
    odd = [c for c in consumers if not isinstance(gemms[c], SMOOTHABLE)]
    if odd:
        return f"feeds convolution(s): {', '.join(odd)}"
    bad_width = [c for c in consumers if weight_2d(gemms[c]).shape[1] != w.numel()]
    if bad_width:
        return f"width of the norm ({w.numel()}) differs from the inputs of {', '.join(bad_width)}"
    shared = [n for n, p in [(producer, w), (producer, b)] + [(c, gemms[c].weight)
                                                             for c in consumers]
              if p is not None and param_uses[id(p)] > 1]
    if shared:
        return f"weights shared with other modules (tied): {', '.join(sorted(set(shared)))}"
    unseen = [c for c in consumers if stats.get(c) is None or not stats[c].seen
              or stats[c].channel_amax is None or stats[c].channel_amax.numel() != w.numel()]
    if unseen:
        return f"no per-channel calibration statistics for {', '.join(unseen)}"
    return None


def _pow2_factors(n: int, seed: int = 0) -> torch.Tensor:
    """Random per-channel powers of two in {1/4, 1/2, 2, 4}: scaling by them is exact."""
    g = torch.Generator().manual_seed(seed)
    e = torch.tensor([-2.0, -1.0, 1.0, 2.0])[torch.randint(0, 4, (n,), generator=g)]
    return torch.exp2(e)


def _close(a: torch.Tensor, b: torch.Tensor, dtype) -> bool:
    tol = 1e-4 if dtype in (torch.float32, torch.float64) else 2e-2
    a, b = a.double(), b.double()
    if a.shape != b.shape or not bool(torch.isfinite(a).all() and torch.isfinite(b).all()):
        return False
    return float((a - b).norm()) <= tol * float(b.norm()) + 1e-12


@torch.no_grad()
def _fold_style(norm) -> str | None:
    """How 1/s folds into the norm's weight, verified on a random input: "scale" (``w / s``,
    LayerNorm/RMSNorm) or "offset" (``(1 + w) / s - 1``, norms computing ``x * (1 + w)``)."""
    w, b = norm.weight, getattr(norm, "bias", None)
    n = w.numel()
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, n, generator=g) * 2 + 0.5).to(w.device, w.dtype)
    f = _pow2_factors(n, seed=2).to(w.device)
    saved = (w.detach().clone(), None if b is None else b.detach().clone())
    try:
        with torch.inference_mode():
            ref = norm(x)
        if not torch.is_tensor(ref) or ref.shape != x.shape:
            return None
        want = ref.float() / f
        for style in ("scale", "offset"):
            w.copy_(_folded_norm_weight(saved[0], f, style))
            if b is not None:
                b.copy_((saved[1].float() / f).to(b.dtype))
            with torch.inference_mode():
                got = norm(x)
            w.copy_(saved[0])
            if b is not None:
                b.copy_(saved[1])
            if _close(got.float(), want, w.dtype):
                return style
    except Exception:  # noqa: BLE001 - a module that does not run on a plain [rows, n] input
        w.copy_(saved[0])
        if b is not None:
            b.copy_(saved[1])
    return None


def _folded_norm_weight(w, s, style):
    """The norm weight (float32) that divides the norm's output by ``s``."""
    w = w.float()
    return w / s if style == "scale" else (1 + w) / s - 1


def _flat_tensors(out) -> list[torch.Tensor]:
    if torch.is_tensor(out):
        return [out] if out.dtype.is_floating_point else []
    if isinstance(out, Mapping):
        return [t for v in out.values() for t in _flat_tensors(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _flat_tensors(v)]
    return []


def _check_exact(model, example, candidates: list[Group], report) -> None:
    """Drop (in place) the groups whose norm output also reaches the model output by a path
    other than their GEMMs (a residual branch, typically): perturb and compare outputs."""
    reference = _flat_tensors(_run(model, example))
    dtype = next((p.dtype for p in model.parameters()), torch.float32)

    def exact(groups) -> bool:
        handles = []
        try:
            for i, g in enumerate(groups):
                f = _pow2_factors(g.norm.weight.numel(), seed=10 + i).to(g.norm.weight.device)

                def out_hook(_m, _args, out, f=f):
                    return out / f.to(out.dtype) if torch.is_tensor(out) else out

                def in_hook(_m, args, f=f):
                    return (args[0] * f.to(args[0].dtype), *args[1:])

                handles.append(g.norm.register_forward_hook(out_hook))
                handles += [m.register_forward_pre_hook(in_hook) for m in g.modules]
            got = _flat_tensors(_run(model, example))
        finally:
            for h in handles:
                h.remove()
        return len(got) == len(reference) and all(_close(a, b, dtype)
                                                  for a, b in zip(got, reference))

    if not reference or exact(candidates):
        if not reference:
            for g in candidates:
                report["skipped"][g.norm_name] = "model output has no float tensor to verify with"
            candidates.clear()
        return
    keep = [g for g in candidates if exact([g])]
    for g in candidates:
        if g not in keep:
            report["skipped"][g.norm_name] = (
                f"-> {', '.join(g.consumers)}: the norm output also feeds another path (e.g. the "
                "residual stream of a post-LN block); folding would not be exact")
    candidates[:] = keep


# --- smoothing -----------------------------------------------------------------------------

def _act_amax(g: Group, stats) -> torch.Tensor:
    return torch.stack([stats[c].channel_amax.float().cpu() for c in g.consumers]).amax(dim=0)


@torch.no_grad()
def _fold(g: Group, s: torch.Tensor) -> str | None:
    """X / s into the norm, W * s into the GEMMs; returns why not, if the result would not be
    finite in the model's dtypes (nothing is changed then)."""
    w = g.norm.weight
    sd = s.to(w.device)
    new = {w: _folded_norm_weight(w.detach(), sd, g.style).to(w.dtype)}
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
def _search_alpha(g: Group, x, act_amax, w_amax, by_name, recipe, gran, w_calib):
    """The alpha with the smallest quantized output error of the group's GEMMs (None: no
    smoothing is better still) and the search's record."""
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
                tried[a] = error(smoothing_factors(act_amax, w_amax, a).to(device))
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
        return (xs.abs().amax(dim=-1, keepdim=True) / fmt.max).clamp(min=TINY)
    return amax_to_scale(channel_amax.max(), fmt, pow2=recipe.scale_pow2).to(xs.device)
