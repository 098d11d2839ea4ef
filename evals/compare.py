"""Comparing model variants, as a library: what ``fp8ptq eval --compare`` runs.

``plan_variants`` turns a model and ``--compare`` items into ``Variant``s (baseline, other
dtypes, formats quantized on the fly, checkpoint folders); ``calibration_files`` /
``check_calib_overlap`` apply the policy that calibrating on evaluation text is refused unless
allowed (it flatters the numbers); ``evaluate_variants`` loads, quantizes (through
``fp8ptq.execution.job``, exactly as ``quantize`` would), evaluates and frees each variant in turn.
"""

from __future__ import annotations

import gc
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import try_to_load_from_cache

from fp8ptq.checkpoint.reader import check_checkpoint
from fp8ptq.config.plan import needs_calibration
from fp8ptq.config.recipe import Recipe
from fp8ptq.config.schemes import get_scheme
from fp8ptq.errors import UsageError
from fp8ptq.execution import job
from fp8ptq.formats import get_format
from fp8ptq.io.loading import hub_offline
from fp8ptq.model.gemm32 import float32_gemms
from fp8ptq.nn.quant_gemm import gemm_paths

from . import wikitext
from .extractive_qa import is_extractive_qa
from .harness import float32_logits, make_lm
from .runner import run_tasks

# ``ITEM+SUFFIX`` on a format or scheme: the variant with its attention in FP8 as vLLM serves
# it (``attn``: --kv-cache fp8 --quantize-attention; ``kv``: the KV cache alone), per tensor
# or per head, so one run scores it next to the plain ITEM with paired intervals
ATTENTION_SUFFIXES = {
    "attn": dict(kv_cache="fp8", quantize_attention=True, kv_granularity="tensor"),
    "attn-head": dict(kv_cache="fp8", quantize_attention=True, kv_granularity="head"),
    "kv": dict(kv_cache="fp8", quantize_attention=False, kv_granularity="tensor"),
    "kv-head": dict(kv_cache="fp8", quantize_attention=False, kv_granularity="head"),
}
DTYPE_VARIANTS = {"baseline": None, "bf16": "bfloat16", "bfloat16": "bfloat16",
                  "fp16": "float16", "float16": "float16", "fp32": "float32", "float32": "float32"}

@dataclass
class Variant:
    name: str
    kind: str  # "baseline" | "dtype" | "quantized" | "checkpoint"
    spec: str  # what job.load loads: a model spec or a checkpoint folder
    recipe: Recipe  # dtype to load in; for "quantized" also how to quantize
    meta: dict | None = None  # a checkpoint's fp8ptq.json


# --- variants ----------------------------------------------------------------------------------


def checkpoint_meta(spec: str) -> dict | None:
    """fp8ptq.json of checkpoint folder ``spec`` (None when it is not one), verified before
    any variant is evaluated: a broken checkpoint fails the run up front, not after the
    baseline has been evaluated."""
    path = Path(spec).expanduser()
    return check_checkpoint(path) if (path / "fp8ptq.json").is_file() else None


def base_model_of(meta: dict) -> str | None:
    """The model an fp8ptq checkpoint was quantized from, if it can still be loaded: the path the
    user gave or its resolved copy if either exists, else a hub id that is cached or reachable."""
    source = meta.get("source") or {}
    for spec in (source.get("model"), source.get("path")):
        if spec and Path(spec).expanduser().exists():
            return spec
    hub_id = source.get("model") if source.get("kind") == "hub" else None
    if hub_id and (_in_hf_cache(hub_id) or not hub_offline()):
        return hub_id
    return None


def _in_hf_cache(repo_id: str) -> bool:
    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # not a valid repo id
        return False


def plan_variants(model: str, model_meta: dict | None, compare: list[str],
                  recipe: Recipe) -> tuple[list[Variant], list[str]]:
    """The variants to evaluate, baseline first (if there is one), and notes for the report."""
    notes: list[str] = []
    variants: list[Variant] = []
    base = model
    if model_meta is not None:
        base = base_model_of(model_meta)
        if base is None:
            source = model_meta.get("source") or {}
            notes.append(f"no baseline: the base model of {model} "
                         f"({source.get('model') or source.get('path') or 'not recorded'}) is "
                         f"not reachable; deltas are relative to {_folder_name(model)}")
        else:
            variants.append(Variant("baseline", "baseline", base, recipe))
        variants.append(Variant(_folder_name(model), "checkpoint", model, recipe, model_meta))
    else:
        variants.append(Variant("baseline", "baseline", model, recipe))

    def need_base(item):
        if base is None:
            raise UsageError(f"--compare {item}: needs the base model of {model}, which is not "
                             f"reachable")
        return base

    for given in compare:
        item, fields = _attention_suffix(given)
        if fields:
            variant = _quantized_variant(item, recipe, need_base)
            variant.name, variant.recipe = given, variant.recipe.merged(**fields)
            variants.append(variant)
        elif item.lower() in DTYPE_VARIANTS:
            dtype = DTYPE_VARIANTS[item.lower()] or recipe.dtype
            if dtype != recipe.dtype:
                variants.append(Variant(item.lower(), "dtype", need_base(item),
                                        recipe.merged(dtype=dtype)))
            elif base is None:
                need_base(item)
        elif Path(item).expanduser().is_dir():
            variants.append(Variant(_folder_name(item), "checkpoint", item, recipe,
                                    _folder_meta(item)))
        else:
            variants.append(_quantized_variant(item, recipe, need_base))
    return _unique_names(variants), notes


def _quantized_variant(item: str, recipe: Recipe, need_base) -> Variant:
    """A format or a named scheme (a preset on top of the eval's recipe flags), quantized on
    the fly."""
    if _is_scheme(item):
        name = get_scheme(item).name
        return Variant(name, "quantized", need_base(item), _scheme_recipe(recipe, name))
    fmt = _format_name(item)
    return Variant(fmt, "quantized", need_base(item), recipe.merged(format=fmt))


def _attention_suffix(item: str) -> tuple[str, dict]:
    """``(ITEM, recipe fields)`` of ``ITEM+attn`` / ``+attn-head`` / ``+kv`` / ``+kv-head``;
    ``(item, {})`` without one. A suffix on a dtype or a checkpoint folder is refused: a folder
    carries its own recipe, a dtype quantizes nothing."""
    base, plus, suffix = item.rpartition("+")
    if not plus or suffix.lower() not in ATTENTION_SUFFIXES:
        return item, {}
    if base.lower() in DTYPE_VARIANTS or Path(base).expanduser().is_dir():
        raise UsageError(f"--compare {item}: +{suffix} goes on a format or a scheme "
                         "(e.g. e4m3+attn), not on a dtype or a checkpoint folder")
    return base, ATTENTION_SUFFIXES[suffix.lower()]


def _is_scheme(item: str) -> bool:
    try:
        get_scheme(item)
    except UsageError:
        return False
    return True


def _scheme_recipe(recipe: Recipe, name: str) -> Recipe:
    """``recipe`` with scheme ``name`` expanded over it; the eval's explicit recipe flags are
    already in ``recipe`` and a scheme names its own fields, so a compared scheme is exactly
    the preset (with the eval's calibration, dtype and other fields)."""
    return recipe.merged(scheme=name)


def _folder_meta(item: str) -> dict | None:
    """An fp8ptq checkpoint's verified fp8ptq.json; None for another tool's quantized model
    folder (e.g. llm-compressor's compressed-tensors output: transformers loads it with its
    quantization applied, so a peer's checkpoint is scored by the same harness)."""
    folder = Path(item).expanduser()
    if (folder / "fp8ptq.json").is_file() or not (folder / "config.json").is_file():
        return check_checkpoint(item)  # verified, or a one-line error naming what is missing
    return None


def _format_name(item: str) -> str:
    try:
        return get_format(item).name
    except UsageError as e:
        raise UsageError(f"--compare {item!r} is neither a format, a scheme (fp8ptq schemes), a "
                         f"dtype (bf16, fp16, fp32, baseline) nor an fp8ptq checkpoint folder "
                         f"({e})") from None


def _folder_name(path: str) -> str:
    return Path(path).expanduser().resolve().name


def _unique_names(variants: list[Variant]) -> list[Variant]:
    seen, out = set(), []
    for v in variants:
        key = (v.kind, v.spec, json.dumps(v.recipe.to_dict(), sort_keys=True, default=str)
               if v.kind == "quantized" else None, v.recipe.dtype)
        if key in seen:  # the same variant twice (e4m3 and fp8, a folder given twice)
            continue
        seen.add(key)
        names = {u.name for u in out}
        name, k = v.name, 2
        while name in names:
            name, k = f"{v.name}#{k}", k + 1
        v.name = name
        out.append(v)
    return out


# --- calibration vs evaluation data ------------------------------------------------------------


def calibration_files(variants: list[Variant], recipe: Recipe) -> list[tuple[str, str]]:
    """(who, path) of the calibration text behind each variant that has one."""
    out = []
    if recipe.calib_data and any(v.kind == "quantized" and needs_calibration(v.recipe)
                                 for v in variants):
        out.append(("calibration data", recipe.calib_data))
    for v in variants:
        source = ((v.meta or {}).get("calibration") or {}).get("source")
        if v.kind == "checkpoint" and source:
            out.append((f"the calibration data of {v.name}", source))
    return out


def check_calib_overlap(calib_files, data: dict[str, str], allow: bool) -> list[str]:
    notes = []
    for who, calib_path in calib_files:
        calib = Path(calib_path).expanduser()
        for task, path in data.items():
            if calib.is_file() and os.path.samefile(calib, path):
                what = f"{who} {calib_path} is also the {task} evaluation data"
                if not allow:
                    raise UsageError(f"{what}; calibrate on other text (e.g. wiki.train.raw) "
                                     f"or pass --allow-calib-overlap")
                notes.append(f"{what} (--allow-calib-overlap): its numbers are optimistic")
    return notes


# --- evaluation --------------------------------------------------------------------------------


def load_variant(v: Variant, device: str = "cpu", load_options: dict | None = None):
    """``v``'s model; another tool's checkpoint (no fp8ptq.json) as transformers serves it,
    its quantization applied, rather than dequantized as a source to quantize would be."""
    return job.load(v.spec, v.recipe, device=device, **(load_options or {}),
                    as_served=v.kind == "checkpoint" and v.meta is None)


def evaluate_variants(variants: list[Variant], recipe: Recipe, calib_texts, tasks: list[str],
                      notes: list[str], *, device: str, load_options=None,
                      prefix_token: str = "auto", progress=None, **eval_kwargs):
    """Load (and quantize) each variant, run the tasks, free it. Returns the report rows, the
    protocol (the first variant's) and the first quantized variant's calibration set, or None.
    The sets are cut from ``calib_texts`` (what ``job.calibration_texts`` read) once per
    distinct cut (samples, length, seed, ``calib_windows`` of the variant's recipe): variants
    that cut alike share one.
    ``progress``: an object with ``step(description)`` (a context manager) and
    ``counter(description)`` (``start(total) -> tick``), e.g. the CLI's progress bars."""
    rows, protocol, tokenizer = [], None, None
    calibs: dict[tuple, object] = {}
    bars = progress if progress is not None else job.NoProgress()
    for v in variants:
        timings = job.JobTimings()
        with bars.step(f"{v.name}: loading {v.spec}"), timings.timed("load"):
            loaded = load_variant(v, device, load_options)
        if v.kind == "quantized":
            calib = None
            if needs_calibration(v.recipe):
                r = v.recipe
                key = (r.num_samples, r.seq_len, r.seed, r.calib_windows)
                if key not in calibs:
                    with bars.step("tokenizing calibration data"), \
                            timings.timed("calibration data"):
                        # windows open as the evaluation opens documents
                        calibs[key] = job.calibration_set(loaded, r, calib_texts,
                                                          start=prefix_token)
                calib = calibs[key]
            job.quantize_loaded(loaded, v.recipe, calib,
                                timings=timings,
                                progress=bars.counter(f"{v.name}: calibrating"))
        tokenizer = loaded.tokenizer or tokenizer
        if tokenizer is None:
            raise UsageError(f"{v.spec} has no tokenizer files and no other variant gave one")
        with bars.step(f"{v.name}: evaluating {', '.join(tasks)}"):
            result = run_tasks(loaded.model, tokenizer, tasks, device=device,
                               prefix_token=prefix_token, **eval_kwargs)
        if not rows and "wikitext" in tasks:
            notes += prefix_notes(loaded.model, tokenizer, prefix_token, eval_kwargs)
        paths = gemm_paths(loaded.model)
        del loaded
        _free_memory(device)
        if protocol is None:
            protocol = result.protocol
        elif result.protocol != protocol:
            notes.append(f"{v.name} was measured differently from {rows[0]['name']}: "
                         f"{_protocol_diff(protocol, result.protocol)}")
        rows.append(_row(v, result, timings) | {"gemm_paths": paths})
    return rows, protocol, next(iter(calibs.values()), None)


def prefix_notes(model, tokenizer, prefix_token, eval_kwargs) -> list[str]:
    """A note when the rolling log-likelihood's prefix token changes the baseline's perplexity
    on the first document by more than 10% against no prefix at all."""
    if is_extractive_qa(model):
        return []
    data = (eval_kwargs.get("data") or {}).get("wikitext")
    if data is None:
        return []
    lm = make_lm(model, tokenizer, batch_size=2, seq_len=eval_kwargs.get("seq_len"),
                 prefix_token=prefix_token)
    # the float32 GEMMs the evaluation itself runs (``run_tasks``): torch's own bf16 GEMMs made
    # this one check of two windows 40% of a SmolLM2 three-model comparison's time
    with float32_logits(model), float32_gemms(model=model):
        ratio = wikitext.prefix_effect(lm, wikitext.read_articles(data)[0]["page"])
    if abs(ratio - 1) <= 0.10:
        return []
    return [f"the prefix token changes the baseline's perplexity on the first document by "
            f"{100 * (ratio - 1):+.0f}% against no prefix: a context the model does not expect "
            "inflates perplexity and the size of every delta (try --prefix-token bos/eos)"]


def _row(v: Variant, result, timings: job.JobTimings) -> dict:
    meta_recipe = (v.meta or {}).get("recipe")
    return {
        "name": v.name,
        "kind": v.kind,
        "source": v.spec,
        "dtype": (v.meta or {}).get("dtype") or v.recipe.dtype,
        "metrics": result.metrics,
        "records": result.records,  # per-sample columns: paired confidence intervals
        "samples": result.samples,  # per-sample records for --samples
        "seconds": round(sum(result.seconds.values()), 3),  # evaluation only, comparable
        "recipe": v.recipe.to_dict() if v.kind == "quantized" else meta_recipe,
        "timings": {**{k: round(s, 3) for k, s in timings.seconds.items()},
                    "eval": {task: round(s, 3) for task, s in result.seconds.items()}},
    }


def how_made(v: Variant) -> str:
    """One line under the table saying how variant ``v`` was produced: the baseline's model and
    dtype, a checkpoint's folder and recorded recipe, or the recipe it was quantized with in
    this run."""
    if v.kind == "checkpoint":
        recipe = (v.meta or {}).get("recipe")
        made = f"checkpoint {v.spec}, " + (recipe_line(recipe) if recipe else
                                           "another tool's (loaded by transformers)")
    elif v.kind == "quantized":
        made = f"{v.spec} quantized in this run, {recipe_line(v.recipe.to_dict())}"
    else:
        made = f"{v.spec} unquantized, {v.recipe.dtype}"
    return f"{v.name}: {made}"


def recipe_line(r: dict) -> str:
    """The fields of a recipe (``Recipe.to_dict``) that say what a quantized variant is."""
    acts = "weight-only" if r.get("act_format") == "none" else \
        f"{r.get('act_granularity')} activations"
    text = (f"{r.get('scheme') or r.get('format')}, {r.get('weight_calib')} "
            f"{r.get('weight_granularity')} weights, {acts}")
    if r.get("weight_calib", "").startswith("gptq") and r.get("gptq_sequential"):
        text += " (sequential GPTQ)"
    if r.get("calib_data"):
        text += f", {r.get('num_samples')} x {r.get('seq_len')} calibration tokens"
    return text


def _free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _protocol_diff(a: dict, b: dict) -> str:
    diffs = [f"{task}.{key} {a.get(task, {}).get(key)!r} vs {b.get(task, {}).get(key)!r}"
             for task in dict.fromkeys([*a, *b])
             for key in dict.fromkeys([*a.get(task, {}), *b.get(task, {})])
             if a.get(task, {}).get(key) != b.get(task, {}).get(key)]
    return ", ".join(diffs)


def protocol_lines(protocol: dict, rows: list[dict] | None = None) -> list[str]:
    """One line per task's protocol, and (``rows``: the report's variants) one saying how each
    variant's quantized GEMMs ran (``gemm_paths_text``)."""
    def show(value):
        return value if isinstance(value, (int, float, bool)) or value is None or \
            (isinstance(value, str) and "\n" not in value) else json.dumps(value)

    lines = [f"protocol {task}: " + ", ".join(f"{k}={show(v)}" for k, v in facts.items())
             for task, facts in protocol.items()]
    ran = [f"{r['name']} {gemm_paths_text(r['gemm_paths'])}" for r in rows or ()
           if r.get("gemm_paths", {}).get("gemms")]
    return lines + ([f"protocol gemms: {'; '.join(ran)}"] if ran else [])


def gemm_paths_text(paths: dict) -> str:
    """``real FP8 kernels 210 of 210, simulated 0`` (``fp8ptq.nn.quant_gemm.gemm_paths``)."""
    return (f"real FP8 kernels {paths['real_fp8']} of {paths['gemms']}, "
            f"simulated {paths['simulated']}")
