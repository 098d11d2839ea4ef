"""Where the activation taps of ``fp8ptq.taps.taps`` sit: the ``fp8ptq_eager`` attention function
registered with transformers (the model's own eager attention, with the Q / K / V / P taps of
the ``ActivationTaps`` that owns the module) and the residual branches of each layer type.
See ``fp8ptq.taps.taps`` for what is quantized and why."""

from __future__ import annotations

import inspect
import sys
import weakref

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..errors import UsageError

ATTN_IMPLEMENTATION = "fp8ptq_eager"
ATTENTION_ROLES = ("q", "k", "v", "p")

# Residual branches per layer type: the first entry whose ``required`` submodules all exist in
# a layer wins; ``optional`` ones are tapped when present; ``mid`` are post-LN norm outputs that
# carry the stream between the sub-blocks.
RESIDUAL_SPECS = (
    {"arch": "sandwich-norm (Gemma 2/3 style)",
     "required": ("post_attention_layernorm", "post_feedforward_layernorm"), "optional": ()},
    {"arch": "llama-family", "required": ("self_attn.o_proj", "mlp.down_proj"), "optional": ()},
    {"arch": "gpt2", "required": ("attn.c_proj", "mlp.c_proj"),
     "optional": ("crossattention.c_proj",)},
    {"arch": "opt", "required": ("self_attn.out_proj", "fc2"), "optional": ()},
    {"arch": "bert", "required": ("attention.output.dense", "output.dense"),
     "optional": ("crossattention.output.dense",),
     "mid": ("attention.output.LayerNorm", "crossattention.output.LayerNorm")},
)

# attention module -> (taps, name) of the ActivationTaps that owns it
ATTENTION_OWNERS: weakref.WeakKeyDictionary[nn.Module, tuple] = weakref.WeakKeyDictionary()
_EAGER_CACHE: dict[type, object] = {}
_IS_ATTENTION_CACHE: dict[type, bool] = {}


# ---------------------------------------------------------------------------------------------
# The attention function
# ---------------------------------------------------------------------------------------------

def _generic_eager_attention(module, query, key, value, attention_mask, scaling=None,
                             dropout=0.0, **kwargs):
    """Llama-style eager attention, for attention classes whose module defines none."""
    groups = getattr(module, "num_key_value_groups", 1) or 1
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return out, weights


def model_eager_attention(module: nn.Module):
    """The ``eager_attention_forward`` of ``module``'s modeling file (or of a base class's)."""
    cls = type(module)
    if cls not in _EAGER_CACHE:
        fn = None
        for klass in cls.__mro__:
            mod = sys.modules.get(klass.__module__)
            fn = getattr(mod, "eager_attention_forward", None) if mod is not None else None
            if callable(fn):
                break
        _EAGER_CACHE[cls] = fn if callable(fn) else _generic_eager_attention
    fn = _EAGER_CACHE[cls]
    # GPT-2's eager path has a second variant (upcast + reordered QK^T with baddbmm)
    if getattr(module, "reorder_and_upcast_attn", False) and hasattr(
            module, "_upcast_and_reordered_attn"):
        return lambda m, q, k, v, mask, *a, **kw: m._upcast_and_reordered_attn(q, k, v, mask)
    return fn


def fp8ptq_eager_attention(module, query, key, value, attention_mask, *args, **kwargs):
    """The registered ``fp8ptq_eager`` attention: the model's eager attention with taps."""
    eager = model_eager_attention(module)
    owner = ATTENTION_OWNERS.get(module)
    if owner is None:
        return eager(module, query, key, value, attention_mask, *args, **kwargs)
    taps, name = owner
    return taps._attention(name, eager, module, query, key, value, attention_mask, *args,
                           **kwargs)


_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm,
            torch.Tensor.bmm, torch.baddbmm, torch.Tensor.baddbmm}


class ProbabilityTap(TorchFunctionMode):
    """Counts the batched matmuls run under it; the first operand of the second one (``P`` in
    ``P V``; for ``baddbmm`` the second positional operand) goes through ``fn``."""

    def __init__(self, fn):
        super().__init__()
        self.fn, self.calls = fn, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MATMULS:
            self.calls += 1
            if self.calls == 2 and args:
                i = 1 if func in (torch.baddbmm, torch.Tensor.baddbmm) else 0
                args = (*args[:i], self.fn(args[i]), *args[i + 1:])
        return func(*args, **kwargs)


_REGISTERED = False


def register_attention_function() -> None:
    """Register ``fp8ptq_eager`` (attention function + eager mask builder) with transformers."""
    global _REGISTERED
    if _REGISTERED:
        return
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, eager_mask
    except ImportError as e:  # pragma: no cover - transformers is a dependency
        raise UsageError(f"--quantize-attention needs transformers' AttentionInterface "
                         f"({e})") from None
    AttentionInterface.register(ATTN_IMPLEMENTATION, fp8ptq_eager_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, eager_mask)
    _REGISTERED = True


def is_attention_module(module: nn.Module) -> bool:
    """Does ``module``'s forward dispatch through transformers' ``ALL_ATTENTION_FUNCTIONS``?"""
    cls = type(module)
    if cls not in _IS_ATTENTION_CACHE:
        try:
            src = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            src = ""
        _IS_ATTENTION_CACHE[cls] = "ALL_ATTENTION_FUNCTIONS" in src and hasattr(module, "config")
    return _IS_ATTENTION_CACHE[cls]


def attention_configs(model: nn.Module) -> list:
    """Every transformers config object reachable from ``model``'s modules (and sub-configs)."""
    seen, out = set(), []
    todo = [getattr(m, "config", None) for m in model.modules()]
    while todo:
        cfg = todo.pop()
        if cfg is None or id(cfg) in seen or not hasattr(cfg, "_attn_implementation"):
            continue
        seen.add(id(cfg))
        out.append(cfg)
        todo += [getattr(cfg, k, None) for k in getattr(cfg, "sub_configs", {}) or {}]
    return out


# ---------------------------------------------------------------------------------------------
# Residual layout
# ---------------------------------------------------------------------------------------------

def find_layer_lists(model: nn.Module, attention: list[str]) -> list[tuple[str, nn.ModuleList]]:
    """``ModuleList``s of transformer layers: every element contains an attention module."""
    out = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        if any(name.startswith(p + ".") for p, _ in out):
            continue
        prefix = f"{name}." if name else ""
        if all(any(a.startswith(f"{prefix}{i}.") for a in attention) for i in range(len(mod))):
            out.append((name, mod))
    return out


def residual_branches(layer: nn.Module) -> tuple[str, list[str]]:
    """(architecture, relative names of the modules whose outputs feed the residual stream)."""
    names = {n for n, _ in layer.named_modules()}
    for spec in RESIDUAL_SPECS:
        if all(r in names for r in spec["required"]):
            branch = list(spec["required"]) + [o for o in spec["optional"] if o in names]
            mid = [m for m in spec.get("mid", ()) if m in names]
            if spec["arch"] == "opt" and getattr(layer, "do_layer_norm_before", True) is False:
                mid.append("self_attn_layer_norm")
            return spec["arch"], branch + mid
    raise UsageError(f"--quantize-residual: don't know the residual branches of "
                     f"{type(layer).__name__} (known: "
                     f"{', '.join(s['arch'] for s in RESIDUAL_SPECS)})")
