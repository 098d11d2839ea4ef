"""Activation taps beyond the GEMM inputs: the attention batched matmuls and the residual adds.

Micikevicius et al. 2022 (sec 4.2-4.3) quantizes the inputs of *every* GEMM at inference, the two
attention batched matmuls included (Q, K for ``Q K^T``; the softmax probabilities P and V for
``P V``), and in one study the inputs of the residual additions too. ``QuantGemm`` only covers
the weight GEMMs, so these taps add the rest, with static per-tensor scales calibrated in the
same single pass:

    taps = ActivationTaps(model, recipe)      # switches attention to "fp8ptq_eager"
    with taps.observing():                    # one calibration pass: TensorStats per tap
        for batch in batches: model(**batch)
    report = taps.freeze(recipe)              # scales; from now on the taps fake-quantize
    taps.kv_scales()                          # {attn module: {"k_scale", "v_scale"}}
    taps.restore(report)                      # (a fresh taps object) same scales, no pass
    taps.remove()                             # original attention implementation, no hooks

Attention (``--quantize-attention``)
    An attention function ``fp8ptq_eager`` is registered with transformers' ``AttentionInterface``
    (and the eager mask builder under the same key in ``AttentionMaskInterface``, so the model
    builds the same additive masks as for ``"eager"``); the model is switched to it with
    ``model.set_attn_implementation``. The function calls the model's *own*
    ``eager_attention_forward`` (from the attention class's ``modeling_*`` module; a generic
    Llama-style one if there is none) on fake-quantized query / key / value, and quantizes the
    probabilities where they enter ``P V``: while the eager function runs, a ``TorchFunctionMode``
    replaces the first operand of its second batched matmul (``matmul`` / ``bmm`` / ``baddbmm``).
    Taps, per attention module ``A`` (the ``module`` argument, named via ``named_modules``):
    ``A:q``, ``A:k``, ``A:v`` (as the model hands them over: after RoPE, K/V before
    ``repeat_kv``, i.e. exactly the KV-cache contents) and ``A:p`` (after softmax / dropout).
    With nothing frozen the function is bit-identical to ``"eager"``. The ``attn_weights`` it
    returns (``output_attentions``) are the unquantized probabilities.

Residual (``--quantize-residual``)
    Residual adds are inline code in the HF layers, so their inputs are quantized where they
    are produced: ``L:input``, the hidden states entering each transformer layer ``L`` (forward
    pre-hook; it is both the first residual addend and the input of the layer's first norm /
    GEMM), and ``M:output`` for each module ``M`` whose output is added to the stream (forward
    hook): ``self_attn.o_proj`` + ``mlp.down_proj`` (Llama family), ``attn.c_proj`` +
    ``mlp.c_proj`` (GPT-2), ``self_attn.out_proj`` + ``fc2`` (OPT), ``attention.output.dense`` +
    ``output.dense`` (BERT; ``crossattention.*`` too when present). For post-LN layers the
    stream between the two sub-blocks is a norm output, tapped as such: BERT
    ``attention.output.LayerNorm``, OPT ``self_attn_layer_norm`` when
    ``do_layer_norm_before=False``. Not covered: the pre-LN mid-layer stream ``h + attn(h)`` (a
    local variable, quantized only through its two addends); the final layer's output (it feeds
    the final norm / head, not a residual add); dropout between a branch and its add is
    identity at inference. Layers whose branch modules are not in the table raise
    ``UsageError``.

Scales: ``recipe.act_calib`` (layer-output-aware calibrators, ``best`` / ``pow2-search``, have
no GEMM to measure here and fall back to ``max``), ``recipe.act_format`` (``recipe.format`` when
unset or ``"none"``), ``recipe.scale_pow2``; every scale goes through ``amax_to_scale`` (finite,
> 0). Hooks resolve modules by name when installed, so residual taps keep working after the
pipeline has swapped a branch projection for its ``QuantGemm``.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from ..calibrators.registry import activation_entry
from ..config.plan import as_plan_parts, taps_plan
from ..config.recipe import KV_CACHE_FORMATS
from ..errors import Fp8ptqError, NumericsError, UsageError
from ..formats import fake_quantize, get_format
from ..formats.scales import amax_to_scale, histogram_sqnr_db
from ..observe.observers import TensorStats
from .tap_report import (
    CACHE_KINDS,
    KV_OBSERVER,
    KV_ROLES,
    attention_scales_from_report,
    kv_granularity_from_report,
    kv_scales_from_report,
    number,
    served_query_scale,
)
from .tap_sites import (
    ATTENTION_OWNERS,
    ATTENTION_ROLES,
    ATTN_IMPLEMENTATION,
    ProbabilityTap,
    attention_configs,
    find_layer_lists,
    fp8ptq_eager_attention,
    is_attention_module,
    register_attention_function,
    residual_branches,
)

# ---------------------------------------------------------------------------------------------
# ActivationTaps
# ---------------------------------------------------------------------------------------------

def _first(x):
    return x[0] if isinstance(x, (tuple, list)) and x and torch.is_tensor(x[0]) else x


class ActivationTaps:
    """Observe, then fake-quantize, the attention matmul inputs and / or the residual-add inputs
    of ``model`` with static per-tensor scales (see the module docstring)."""

    def __init__(self, model: nn.Module, recipe=None, *, attention: bool | None = None,
                 residual: bool | None = None, kv: str | None = None,
                 query: bool | None = None):
        self.model = model
        self.attention = bool(recipe.quantize_attention if attention is None and recipe
                              else attention)
        self.residual = bool(recipe.quantize_residual if residual is None and recipe
                             else residual)
        # the KV cache (``--kv-cache``): "tensor" / "head" scales of K and V
        self.kv = (recipe.kv_granularity if recipe is not None and kv is None
                   and getattr(recipe, "kv_cache", None) else kv)
        # FP8 attention (``--kv-cache fp8 --quantize-attention``): Q beside K / V, the same
        # arguments, written for the runtime; the simulation-only Q/K/V/P taps step aside
        self.query = bool(query if query is not None else self.attention and self.kv)
        if self.query:
            self.attention = False
        if not (self.attention or self.residual or self.kv):
            raise UsageError("ActivationTaps: no attention, residual or KV-cache taps requested")
        self.mode = "pass"  # "pass" | "observe" | "quantize"
        self.stats: dict[str, TensorStats] = {}
        self.kinds: dict[str, str] = {}
        self.report: dict[str, dict] | None = None
        self.warnings: list[str] = []
        self._scales: dict[str, torch.Tensor] = {}
        self._scale_cache: dict[tuple[str, torch.device], torch.Tensor] = {}
        self._fmts: dict[str, object] = {}  # tap -> FormatSpec (KV taps: the KV format)
        self._handles: list = []
        self._saved_impl: list[tuple] = []
        self._owned: list[nn.Module] = []
        self._structure_warned: set[str] = set()
        self.calls: dict[str, int] = {}  # attention module -> fp8ptq_eager calls seen
        self.kv_heads: dict[str, int] = {}  # attention module -> its KV heads (query groups)

        candidates = [(n, m) for n, m in model.named_modules() if is_attention_module(m)]
        self.attention_modules = [n for n, _ in candidates]
        # residual layout: layer module names -> branch module names
        self.layers: list[str] = []
        self.residual_arch: dict[str, str] = {}
        self.branch_modules: list[str] = []
        if self.residual:
            lists = find_layer_lists(model, self.attention_modules)
            if not lists:
                raise UsageError("--quantize-residual: found no transformer layers (a ModuleList "
                                 "of blocks that use transformers' attention interface)")
            for list_name, layers in lists:
                for i, layer in enumerate(layers):
                    lname = f"{list_name}.{i}" if list_name else str(i)
                    arch, rel = residual_branches(layer)
                    self.layers.append(lname)
                    self.residual_arch[lname] = arch
                    self._add_tap(f"{lname}:input", "residual")
                    for r in rel:
                        self.branch_modules.append(f"{lname}.{r}")
                        self._add_tap(f"{lname}.{r}:output", "residual")
        if self.attention or self.kv:
            if not candidates:
                what = "--quantize-attention" if self.attention or self.query else "--kv-cache"
                raise UsageError(f"{what}: no attention module of this model goes through "
                                 "transformers' attention interface (fp8ptq finds attention "
                                 "by it)")
            self._install_attention(candidates)

    # -- setup / teardown ---------------------------------------------------------------------

    def _add_tap(self, name: str, kind: str) -> None:
        self.stats[name] = TensorStats()
        self.kinds[name] = kind

    def _install_attention(self, candidates) -> None:
        register_attention_function()
        for name, mod in candidates:
            if mod in ATTENTION_OWNERS:
                raise UsageError(f"{name} already has activation taps (remove() them first)")
        for cfg in attention_configs(self.model):
            self._saved_impl.append((cfg, cfg.__dict__.get("_attn_implementation_internal")))
        try:
            if hasattr(self.model, "set_attn_implementation"):
                self.model.set_attn_implementation(ATTN_IMPLEMENTATION)
            for _, mod in candidates:  # anything set_attn_implementation did not reach
                if mod.config._attn_implementation != ATTN_IMPLEMENTATION:
                    mod.config._attn_implementation_internal = ATTN_IMPLEMENTATION
        except Exception:
            self._restore_attention()
            raise
        for name, mod in candidates:
            ATTENTION_OWNERS[mod] = (self, name)
            self._owned.append(mod)
            self.calls[name] = 0
            self.kv_heads[name] = _kv_heads(mod)
            if self.query:
                self._add_tap(f"{name}:q", "query")
            for role in ATTENTION_ROLES if self.attention else KV_ROLES:
                self._add_tap(f"{name}:{role}", "attention" if self.attention else "kv")

    def _restore_attention(self) -> None:
        for cfg, value in reversed(self._saved_impl):
            cfg._attn_implementation_internal = value
        self._saved_impl = []

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def remove(self) -> None:
        """Undo everything: hooks off, the original attention implementation back."""
        self._remove_hooks()
        for mod in self._owned:
            if ATTENTION_OWNERS.get(mod, (None,))[0] is self:
                del ATTENTION_OWNERS[mod]
        self._owned = []
        self._restore_attention()
        self.mode = "pass"

    def _install_residual_hooks(self) -> None:
        self._remove_hooks()
        if not self.residual:
            return
        for lname in self.layers:
            layer = self.model.get_submodule(lname)
            self._handles.append(layer.register_forward_pre_hook(
                self._input_hook(f"{lname}:input"), with_kwargs=True))
        for bname in self.branch_modules:
            mod = self.model.get_submodule(bname)  # a QuantGemm by now, possibly
            self._handles.append(mod.register_forward_hook(self._output_hook(f"{bname}:output")))

    # -- the taps -----------------------------------------------------------------------------

    def _tap(self, name: str, x):
        if not torch.is_tensor(x) or not x.is_floating_point() or self.mode == "pass" \
                or name not in self.stats:
            return x
        if self.mode == "observe":
            st = self.stats[name]
            if self.kinds[name] in CACHE_KINDS:  # [batch, heads, seq, head_dim]: per head
                st.update(x, channel_dim=1)
            else:  # P's last dim (key length) varies between batches: no per-channel amax
                st.update(x.reshape(-1, 1) if name.endswith(":p") else x)
            return x
        key = (name, x.device)
        scale = self._scale_cache.get(key)
        if scale is None:
            scale = self._scale_cache[key] = self._scales[name].to(x.device)
        return fake_quantize(x, scale, self._fmts[name])

    def _input_hook(self, name):
        def hook(_module, args, kwargs):
            if args and torch.is_tensor(args[0]):
                return (self._tap(name, args[0]), *args[1:]), kwargs
            if torch.is_tensor(kwargs.get("hidden_states")):
                return args, {**kwargs, "hidden_states": self._tap(name, kwargs["hidden_states"])}
            return None

        return hook

    def _output_hook(self, name):
        def hook(_module, _args, output):
            if torch.is_tensor(output):
                return self._tap(name, output)
            if isinstance(output, tuple) and output and torch.is_tensor(output[0]):
                return (self._tap(name, output[0]), *output[1:])
            return None

        return hook

    def _attention(self, name, eager, module, query, key, value, attention_mask, *args,
                   **kwargs):
        if self.mode == "pass":
            return eager(module, query, key, value, attention_mask, *args, **kwargs)
        self.calls[name] = self.calls.get(name, 0) + 1
        query = self._tap(f"{name}:q", query)
        key = self._tap(f"{name}:k", key)
        value = self._tap(f"{name}:v", value)
        if not self.attention:  # the KV cache / FP8 attention: P stays as it is
            return eager(module, query, key, value, attention_mask, *args, **kwargs)
        mode = ProbabilityTap(lambda p: self._tap(f"{name}:p", p))
        with mode:
            out = eager(module, query, key, value, attention_mask, *args, **kwargs)
        if mode.calls != 2 and name not in self._structure_warned:
            self._structure_warned.add(name)
            self.warnings.append(f"{name}: eager attention ran {mode.calls} batched matmuls, "
                                 "expected 2 (Q K^T, P V); the P tap may be wrong")
        return out

    # -- phases -------------------------------------------------------------------------------

    @contextmanager
    def observing(self):
        """Collect ``TensorStats`` of every tap while the block runs the calibration data."""
        previous = self.mode
        self.mode = "observe"
        self._install_residual_hooks()
        try:
            yield self
        finally:
            self._remove_hooks()
            self.mode = previous
            if previous == "quantize":
                self._install_residual_hooks()

    def freeze(self, plan) -> dict[str, dict]:
        """Scales from the collected statistics; the taps quantize from now on. ``plan``: the
        run's ``QuantPlan`` (its ``taps`` entry), or a recipe.

        Returns ``{tap: {"kind", "amax", "scale", "format", "calib", "sqnr_db", "count",
        "warnings"}}``."""
        recipe, tap_plan = as_plan_parts(plan)
        if tap_plan is None:  # a recipe without --quantize-attention/-residual: its act format
            tap_plan = taps_plan(recipe, always=True)
        calib_name = tap_plan.calibrator
        entry = activation_entry(calib_name)
        calib = entry.build(**entry.options_from(recipe))
        kv_fmt = get_format(KV_CACHE_FORMATS.get(getattr(recipe, "kv_cache", None), "e4m3"))
        report = {}
        self._scales, self._scale_cache, self._fmts = {}, {}, {}
        for name, st in self.stats.items():
            kv = self.kinds[name] in CACHE_KINDS
            fmt = kv_fmt if kv else tap_plan.format
            warnings: list[str] = []
            if not st.seen:
                warnings.append("saw no calibration data")
                amax = 0.0
            elif st.nonfinite:
                warnings.append(f"{st.nonfinite} non-finite values ignored")
            if st.seen and kv:  # the runtime's observer: min-max, per tensor or per KV head
                amax = st.channel_amax if self.kv == "head" else st.amax
            elif st.seen:
                amax = float(calib.amax(st, fmt))
            scale = amax_to_scale(amax, fmt, pow2=recipe.scale_pow2 and not kv, what=name,
                                  warnings=warnings)
            self._scales[name], self._fmts[name] = self._served(name, scale), fmt
            report[name] = {
                "kind": self.kinds[name], "amax": number(amax), "scale": number(scale),
                "format": fmt.name, "calib": KV_OBSERVER if kv else calib_name,
                "sqnr_db": histogram_sqnr_db(st, float(scale.max()), fmt) if st.seen else None,
                "count": st.count, "warnings": warnings,
                **({"granularity": self.kv} if kv else {}),
            }
            self.warnings += [f"{name}: {w}" for w in warnings]
        self.report = report
        self.mode = "quantize"
        self._install_residual_hooks()
        return report

    def restore(self, report: dict[str, dict]) -> None:
        """Quantize with the scales of an earlier ``freeze`` report (e.g. the one a checkpoint's
        fp8ptq.json holds) instead of calibrating: the same taps compute the same numbers."""
        missing, extra = set(self.stats) - set(report), set(report) - set(self.stats)
        if missing or extra:
            raise Fp8ptqError(f"activation taps of the model and of the report differ: missing "
                              f"{sorted(missing)[:3]}, unknown {sorted(extra)[:3]}")
        scales = {n: torch.tensor(e["scale"], dtype=torch.float32) for n, e in report.items()}
        bad = [n for n, s in scales.items() if not (bool(torch.isfinite(s).all())
                                                     and bool((s > 0).all()))]
        if bad:
            raise NumericsError(f"activation tap scale of {bad[0]} is not finite and > 0")
        self._scales = {n: self._served(n, s) for n, s in scales.items()}
        self._fmts = {n: get_format(e["format"]) for n, e in report.items()}
        self._scale_cache = {}
        self.report = report
        self.mode = "quantize"
        self._install_residual_hooks()

    @contextmanager
    def paused(self):
        """Every tap passes its tensor through unchanged while the block runs (e.g. to compare
        with a runtime that does not quantize the KV cache)."""
        previous, self.mode = self.mode, "pass"
        try:
            yield self
        finally:
            self.mode = previous

    def _served(self, name: str, scale: torch.Tensor) -> torch.Tensor:
        """The scale a tap quantizes with, as the runtime serves it: a per-head query scale
        per KV head (``served_query_scale``), every other one as calibrated."""
        if self.kinds.get(name) == "query":
            scale = served_query_scale(scale, self.kv_heads.get(name.rpartition(":")[0], 0))
        return _broadcast(scale)

    # -- export -------------------------------------------------------------------------------

    def attention_scales(self) -> dict[str, dict[str, float]]:
        """``{attention module: {"q_scale", "k_scale", "v_scale", "p_scale"}}`` (after freeze)."""
        if self.report is None:
            raise Fp8ptqError("ActivationTaps: call freeze() before asking for scales")
        return attention_scales_from_report(self.report)

    def kv_scales(self) -> dict[str, dict[str, float]]:
        """``{attention module: {"k_scale", "v_scale"}}``, the compressed-tensors KV-cache
        scales (written as ``<module>.k_scale`` / ``<module>.v_scale``)."""
        return {a: {"k_scale": s["k_scale"], "v_scale": s["v_scale"]}
                for a, s in self.attention_scales().items()}


def model_taps(model: nn.Module) -> ActivationTaps | None:
    """The ``ActivationTaps`` installed on ``model``'s attention modules, if any."""
    return next((ATTENTION_OWNERS[m][0] for m in model.modules() if m in ATTENTION_OWNERS),
                None)


def _broadcast(scale: torch.Tensor) -> torch.Tensor:
    """A tap's scale as it multiplies its tensor: a scalar, or per head ``[1, H, 1, 1]``
    against ``[batch, H, seq, head_dim]``."""
    return scale.reshape(()) if scale.numel() == 1 else scale.reshape(1, -1, 1, 1)


def _kv_heads(module: nn.Module) -> int:
    """The KV heads of an attention module (0: unknown): its config's ``num_key_value_heads``
    (``num_attention_heads`` without GQA), as compressed-tensors' ``get_num_kv_heads`` reads
    it."""
    cfg = getattr(module, "config", None)
    heads = getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "num_attention_heads", 0)
    return int(heads or 0)


__all__ = ["ActivationTaps", "attention_scales_from_report", "kv_scales_from_report",
           "kv_granularity_from_report", "model_taps", "KV_OBSERVER", "KV_ROLES",
           "ATTN_IMPLEMENTATION", "fp8ptq_eager_attention", "register_attention_function"]
