"""Write a quantized model to disk, atomically, at once or piece by piece.

``save_quantized(result, out_dir)`` writes a whole in-memory quantized model. It is a thin use
of ``CheckpointWriter``, the session object that streaming writers use directly:

    choice = choose_layout(describe_plan(plan), model_type=model_type_of(model))
    with CheckpointWriter.open(out_dir, choice, force=force) as ckpt:
        for prefix, block in blocks:            # e.g. "model.layers.3."
            ...quantize the block...
            ckpt.add_block(block, prefix, reports)   # its tensors are written (buffered) now
            ...free the block...
        ckpt.add_tensors(other_tensors)         # embeddings, final norm, lm_head, ...
        ckpt.close(model, recipe, result=...)   # config.json, fp8ptq.json, card; rename

* ``open`` checks the output up front and makes a temporary sibling (``fp8ptq.files.atomic``).
* ``add_modules(model_or_block, names, reports, prefix=)`` writes the quantized modules'
  tensors in the layout's form and records their fp8ptq.json entries; ``add_block`` also adds
  the block's other tensors. A model-free writer that holds no module calls ``add_gemm`` /
  ``add_experts`` with a ``ModuleDesc`` and the codes and scales it computed, and
  ``add_tensors`` for tensors it copies unchanged.
* Tensors go to ``ShardWriter`` (``shards.py``): a shard is written as soon as it is full, so
  the writer holds at most one shard; the last one and the index are written by ``close``.
* ``close(model, recipe, ...)`` needs the model's *structure* only (config, module names, the
  meta device is fine): it writes config.json with the layout's ``quantization_config``,
  fp8ptq.json with the entries accumulated along the way, tokenizer, generation config and
  model card, runs ``check`` on the complete folder, and renames it into place.
* An exception (an interruption included) in any call, or leaving the ``with`` block without
  ``close``, removes the temporary folder: nothing half-written is left.
"""

from __future__ import annotations

import datetime as _dt
import os
import sys
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path

from torch import nn

from ..config.moot import moot_options
from ..config.recipe import Recipe
from ..errors import Fp8ptqError, UsageError
from ..files.atomic import atomic_dir
from ..model.gemm import CONV_TYPES
from ..nn.quant_experts import ProjectionQuant, QuantExperts
from ..nn.quant_gemm import QuantGemm
from ..numbers import dumps, json_safe
from ..version import __version__
from .card import command_line
from .card import write as write_card
from .contents import (
    check_scales,
    config_dict,
    experts_entry,
    experts_quant,
    experts_scales,
    gemm_entry,
    gemm_quant,
    gemm_scales,
    module_scales,
    original_bytes,
    plain_tensors,
    tied_quantized,
)
from .layouts import (
    GemmQuant,
    LayoutChoice,
    ModuleDesc,
    choose_layout,
    describe_model,
    describe_quantized,
    get_layout,
    model_type_of,
    quantized_modules,
)
from .names import (  # noqa: F401 - re-exported
    CT_FLOAT,
    CT_INT,
    CT_MIXED,
    CT_NAIVE,
    INDEX_NAME,
    LAYOUT_CT,
    LAYOUT_NATIVE,
    META_NAME,
    WEIGHTS_NAME,
)
from .shards import SHARD_BYTES, ShardWriter
from .skeleton import SKELETON_NAME
from .taps_io import attention_targets, kv_cache_export, taps_report


class CheckpointWriter:
    """One checkpoint being written (see the module docstring). Make it with ``open``."""

    def __init__(self, out: Path, tmp: Path, choice: LayoutChoice, stack: ExitStack,
                 max_shard_bytes: int):
        self.out, self.tmp, self.choice, self._stack = out, tmp, choice, stack
        self.layout = choice.layout
        self._shards = ShardWriter(tmp, max_shard_bytes)
        self._descs: list[ModuleDesc] = []
        self._modules: dict[str, dict] = {}  # fp8ptq.json "modules"
        self._experts: dict[str, dict] = {}  # fp8ptq.json "experts"
        self._done = False

    @classmethod
    def open(cls, output, layout, *, force: bool = False, model_type: str | None = None,
             max_shard_bytes: int | None = None) -> CheckpointWriter:
        """Start writing checkpoint folder ``output`` in ``layout`` (a ``LayoutChoice`` from
        ``choose_layout``, or a layout name / ``Layout``). An existing ``output`` is refused
        unless ``force`` (then replaced only once the new folder is complete)."""
        out = Path(output).expanduser().absolute()
        if out.exists() or out.is_symlink():
            if not force:
                raise UsageError(f"output directory {out} already exists (use --force to "
                                 "replace it)")
            if not out.is_dir() or out.is_symlink():
                raise UsageError(f"{out} exists and is not a directory; refusing to replace it")
        if not isinstance(layout, LayoutChoice):
            chosen = get_layout(layout)
            layout = LayoutChoice(chosen, f"{chosen.name} layout chosen by the caller",
                                  model_type=model_type)
        stack = ExitStack()
        tmp = stack.enter_context(atomic_dir(out, if_exists="replace" if force else "fail"))
        return cls(out, tmp, layout, stack, max_shard_bytes or SHARD_BYTES)  # read at call time

    # -- the session: any exception removes the temporary folder -------------------------------

    @contextmanager
    def _guard(self):
        if self._done:
            raise UsageError("this checkpoint writer is closed")
        try:
            yield
        except BaseException:
            self._done = True
            if not self._stack.__exit__(*sys.exc_info()):
                raise

    def abort(self) -> None:
        """Give up: remove the temporary folder (``output`` is left as it was)."""
        if not self._done:
            self._done = True
            self._stack.__exit__(Fp8ptqError, Fp8ptqError("aborted"), None)

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._done:
            return False
        self._done = True
        if exc_type is not None:
            return bool(self._stack.__exit__(exc_type, exc, tb))
        self._stack.__exit__(Fp8ptqError, Fp8ptqError("not closed"), None)
        raise Fp8ptqError(f"the checkpoint writer of {self.out} was left without close(); "
                          "nothing was written")

    # -- adding -------------------------------------------------------------------------------

    def add_modules(self, model_or_block: nn.Module, names=None, reports=None, *,
                    prefix: str = "") -> list[str]:
        """Write the quantized modules (``QuantGemm`` / ``QuantExperts``) of ``model_or_block``
        (all, or those ``names`` relative to it) now; returns their full names. ``prefix`` is
        the block's name in the model; ``reports`` (``ModuleReport`` s, or a dict by full
        name) give the SQNR / amax facts of fp8ptq.json. The caller may free them after."""
        prefix = _dotted(prefix)
        with self._guard():
            found = quantized_modules(model_or_block)
            if names is not None:
                wanted = set(names)
                missing = wanted - {n for n, _ in found}
                if missing:
                    raise UsageError(f"no quantized module {sorted(missing)[0]!r} to add")
                found = [(n, m) for n, m in found if n in wanted]
            if reports is not None and not isinstance(reports, dict):
                reports = {r.name: r for r in reports}
            added = []
            for name, module in found:
                desc = replace(describe_quantized(name, module), name=prefix + name)
                if isinstance(module, QuantExperts):
                    self.add_experts(desc, experts_quant(module),
                                     module_class=type(module.inner).__name__)
                else:
                    self.add_gemm(desc, gemm_quant(module),
                                  module_class=type(module.inner).__name__,
                                  weight_shape=module.inner.weight.shape,
                                  report=(reports or {}).get(desc.name))
                added.append(desc.name)
        return added

    def add_gemm(self, desc: ModuleDesc, q: GemmQuant, *, module_class: str, weight_shape,
                 report=None) -> None:
        """Write one quantized GEMM given as codes and scales (no module needed)."""
        with self._guard():
            self._new(desc)
            check_scales(desc.name, gemm_scales(q))
            self._shards.add(self.layout.gemm_tensors(desc, q))
            self._modules[desc.name] = gemm_entry(
                desc, q, module_class=module_class, weight_shape=weight_shape,
                stored_as=self.layout.gemm_stored_as(desc), report=report)
            self._descs.append(desc)

    def add_experts(self, desc: ModuleDesc, projections: dict[str, ProjectionQuant], *,
                    module_class: str) -> None:
        """Write one fused-experts module given as per-projection codes and scales."""
        with self._guard():
            self._new(desc)
            check_scales(desc.name, experts_scales(projections))
            mt = self.choice.model_type
            self._shards.add(self.layout.experts_tensors(desc, projections, model_type=mt))
            self._experts[desc.name] = experts_entry(
                desc, projections, module_class=module_class,
                extra=self.layout.experts_facts(desc, model_type=mt))
            self._descs.append(desc)

    def add_tensors(self, tensors: dict) -> None:
        """Write tensors as they are (embeddings, norms, biases, modules left unquantized)."""
        with self._guard():
            self._shards.add(tensors)

    def add_block(self, block: nn.Module, prefix: str = "", reports=None) -> None:
        """Everything of ``block`` (named ``prefix`` in the model): its quantized modules and
        its other tensors."""
        prefix = _dotted(prefix)
        with self._guard():
            quantized = {n for n, _ in quantized_modules(block)}
            self.add_modules(block, None, reports, prefix=prefix)
            self.add_tensors(plain_tensors(block, quantized, prefix))

    def _new(self, desc: ModuleDesc) -> None:
        if desc.name in self._modules or desc.name in self._experts:
            raise UsageError(f"module {desc.name} is added twice")
        problem = self.layout.module_problem(desc, model_type=self.choice.model_type)
        if problem:
            raise Fp8ptqError(f"the {self.layout.name} layout cannot store {problem}")

    @property
    def names(self) -> list[str]:
        """The quantized modules written so far."""
        return [*self._modules, *self._experts]

    # -- closing ------------------------------------------------------------------------------

    def close(self, model: nn.Module, recipe, *, result=None, tokenizer=None,
              source: dict | None = None, calib: dict | None = None,
              tool_version: str | None = None, check=None, config: dict | None = None,
              original: int | None = None) -> dict:
        """Finish the checkpoint and rename it into place; returns size facts.

        ``model``: the model's structure (config, module names; tensors may be on the meta
        device). ``result`` (optional): anything with ``skipped``, ``warnings``, ``extras``
        (a ``QuantizeResult``); ``config``: config.json to write instead of the model's;
        ``original``: the unquantized model's bytes when ``model`` cannot tell;
        ``check(tmp)``: runs on the complete temporary folder, raising there writes nothing.
        """
        with self._guard():
            facts = self._finish(model, recipe, result, tokenizer, source, calib,
                                 tool_version or __version__, check, config, original)
            self._done = True
            self._stack.__exit__(None, None, None)  # the rename
        facts["path"] = str(self.out)
        return facts

    def _finish(self, model, recipe, result, tokenizer, source, calib, tool_version, check,
                config, original) -> dict:
        if not self._descs:
            raise UsageError("no quantized module was written; nothing to save")
        refusal = self.layout.accepts(self._descs, model_type=self.choice.model_type)
        if refusal is not None:
            raise Fp8ptqError(f"the {self.layout.name} layout cannot store these modules: "
                              f"{refusal}")  # a set rule (one 8-bit type, one scheme, ...)
        tmp = self.tmp
        taps = taps_report(result)
        kv_tensors, kv_scheme, kv_note = kv_cache_export(model, taps, self.layout)
        self._shards.add(kv_tensors)
        files = self._shards.finish()

        if config is not None:
            cfg = {k: v for k, v in config.items() if k != "quantization_config"}
        else:
            cfg = config_dict(model, self.names, tmp)
        if (tmp / SKELETON_NAME).is_file():
            files.append(SKELETON_NAME)
        tied = tied_quantized(model, [(n, m) for n, m in model.named_modules()
                                      if isinstance(m, QuantGemm) and n in self._modules])
        if tied and cfg.get("tie_word_embeddings"):
            # The shared tensor now holds the dequantized weight and the quantized module keeps
            # its own codes: stored separately, loaded untied (same numbers, no re-tying).
            cfg["tie_word_embeddings"] = False
        cfg["quantization_config"] = self.layout.quantization_config(
            model, self._descs, kv_scheme=kv_scheme,
            attention_targets=attention_targets(model, taps) if kv_scheme else (),
            tool_version=tool_version)
        (tmp / "config.json").write_text(dumps(cfg, indent=2, sort_keys=True) + "\n")
        gen = getattr(model, "generation_config", None)
        if gen is not None:
            try:
                gen.save_pretrained(str(tmp))
            except Exception:  # an invalid generation config must not sink the checkpoint
                pass
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))

        weight_bytes = sum((tmp / f).stat().st_size for f in files if f.endswith(".safetensors"))
        original = original_bytes(model) if original is None else original
        sizes = {"checkpoint_bytes": weight_bytes, "original_bytes": original,
                 "compression_ratio": (original / weight_bytes) if weight_bytes else None}
        warnings = list(getattr(result, "warnings", []) or [])
        if self.choice.warning and self.choice.warning not in warnings:
            warnings.append(self.choice.warning)
        meta = {
            "tool": "fp8ptq",
            "version": tool_version,
            "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "layout": self.layout.name,
            "layout_reason": self.choice.reason,
            "files": files,
            "dtype": cfg["dtype"],
            "architectures": cfg.get("architectures"),
            "source": source or {},
            "recipe": recipe.to_dict() if hasattr(recipe, "to_dict") else recipe,
            "moot_options": _moot(recipe, model),
            "calibration": calib,
            "modules": self._modules,
            "experts": self._experts,
            "skipped": list(getattr(result, "skipped", []) or []),
            "untied": tied,
            "warnings": warnings,
            "sizes": sizes,
            "taps": taps,
            "kv_cache_scales": kv_note,
            "command": command_line(),
            "extras": {k: v for k, v in (getattr(result, "extras", None) or {}).items()
                       if k != "taps"},
        }
        (tmp / META_NAME).write_text(dumps(meta, indent=2) + "\n")
        write_card(tmp, json_safe(meta), cfg)
        if check is not None:
            check(tmp)
        return json_safe({"layout": self.layout.name, "files": files, **sizes})


def _moot(recipe, model) -> dict[str, str]:
    """The recipe fields this run ignored (``fp8ptq.config.moot.moot_options``): field -> why."""
    if not isinstance(recipe, Recipe):
        return {}
    convolutions = any(isinstance(m, CONV_TYPES) for m in model.modules())
    return {m.field: m.reason for m in moot_options(recipe, convolutions=convolutions)}


def _dotted(prefix: str) -> str:
    return f"{prefix}." if prefix and not prefix.endswith(".") else prefix


def save_quantized(result, recipe=None, out_dir=None, *, tokenizer=None,
                   source: dict | None = None, calib: dict | None = None, force: bool = False,
                   tool_version: str | None = None, check=None) -> dict:
    """Write ``result.model`` (its ``QuantGemm`` / ``QuantExperts`` modules) to ``out_dir`` and
    return size facts.

    The recorded recipe is ``result.recipe`` (the one the model was quantized with) unless one
    is passed; ``save_quantized(result, out_dir)`` is the short form.

    Everything is written into a temporary sibling directory first and renamed into place only
    when complete; an existing ``out_dir`` is refused unless ``force`` (then it is replaced only
    after the new checkpoint is complete). Nothing partial is ever left behind. ``check``
    (a callable taking the complete temporary folder) runs before the rename: raising there
    writes nothing (``quantize --runtime vllm``).
    """
    if out_dir is None and isinstance(recipe, (str, os.PathLike)):
        recipe, out_dir = None, recipe
    if out_dir is None:
        raise UsageError("save_quantized needs an output directory")
    recipe = recipe if recipe is not None else getattr(result, "recipe", None)
    if recipe is None:
        raise UsageError("save_quantized needs the recipe the model was quantized with")
    model = result.model
    found = quantized_modules(model)
    if not found:
        raise UsageError("the model has no quantized (QuantGemm) module to save")
    for name, module in found:  # before any file: a bad scale writes nothing
        check_scales(name, module_scales(module))
    choice = choose_layout(describe_model(model), model_type=model_type_of(model))
    if choice.warning and hasattr(result, "warnings"):
        result.warnings.append(choice.warning)
    quantized = {n for n, _ in found}
    tie_targets = getattr(model, "all_tied_weights_keys", None) or {}
    with CheckpointWriter.open(out_dir, choice, force=force) as ckpt:
        ckpt.add_tensors(plain_tensors(model, quantized, tie_targets=tie_targets))
        ckpt.add_modules(model, reports=getattr(result, "modules", None) or [])
        return ckpt.close(model, recipe, result=result, tokenizer=tokenizer, source=source,
                          calib=calib, tool_version=tool_version, check=check)


__all__ = ["CheckpointWriter", "save_quantized", "choose_layout", "SHARD_BYTES", "LAYOUT_CT",
           "LAYOUT_NATIVE"]
