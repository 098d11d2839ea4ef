"""SmoothQuant groups: which GEMMs share one norm output, found by tracing the model, and the
check that folding ``1/s`` into the norm is exact (see ``fp8ptq.algorithms.smoothquant.norms`` for
the method
and why each rule exists)."""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from ...model.forward import run_batch
from ...model.gemm import Conv1D, find_gemms, weight_2d

SMOOTHABLE = (nn.Linear,) + ((Conv1D,) if Conv1D else ())


@dataclass
class Group:
    norm_name: str
    norm: nn.Module
    consumers: list[str]
    modules: list[nn.Module] = field(default_factory=list)
    style: str = "scale"  # how 1/s folds into the norm weight: "scale" (w/s) or "offset"


def trace_input(model, example):
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


def discover_groups(model, example, by_name, stats, report) -> list[Group]:
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
            w.copy_(folded_norm_weight(saved[0], f, style))
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


def folded_norm_weight(w, s, style):
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


def check_exact(model, example, candidates: list[Group], report) -> None:
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
