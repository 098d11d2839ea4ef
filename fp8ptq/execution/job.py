"""The quantize job as a library call: load -> calibration data -> quantize -> (write).

The CLI's ``quantize`` and ``eval --compare`` both run through here so that a variant evaluated
on the fly is quantized exactly as a written checkpoint would be.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from ..config.plan import QuantPlan, build_plan
from ..config.recipe import Recipe
from ..errors import DataError, UsageError
from ..io.data import build_calibration_set, corpus_tokens, load_texts, resolve_calib_spec
from ..io.loading import is_torch_module_file, load_model, resolve_safetensors
from ..io.weights import build_empty
from ..model.forward import token_batches
from ..observe import distributed
from ..runtime.usage import peak_rss_mb, timed
from ..sensitivity import eval_windows
from ..sensitivity.budget import choose as choose_target
from ..sensitivity.budget import measure as measure_target
from ..sensitivity.budget import perplexity, split_heldout
from ..sensitivity.budget import verify as verify_target
from ..vision import ImageCalibrationSet, build_image_calibration_set, image_batches, is_image_spec
from .budget import gb, gpu_free_bytes
from .in_memory import QuantizeResult, quantize_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class JobTimings:
    seconds: dict[str, float] = field(default_factory=dict)

    def timed(self, key):
        """``with timings.timed("load"): ...`` adds the body's wall time to ``seconds``."""
        return timed(self.seconds, key)


class NoProgress:
    """The progress interface ``quantize`` reports through, doing nothing: ``step(desc)`` is a
    context manager around one phase, ``counter(desc)(total)`` returns a per-item tick. The CLI
    passes rich progress bars with the same two methods."""

    def step(self, description: str):
        return nullcontext()

    def counter(self, description: str) -> Callable[[int], Callable[[], None]]:
        return lambda total: (lambda: None)


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        torch.device(device)
    except (RuntimeError, ValueError):
        raise UsageError(f"unknown device {device!r}; use cpu, cuda, cuda:N or auto") from None
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda requested but no CUDA device is available")
    return device


def load(model_spec: str, recipe: Recipe, *, device="cpu", device_map=None,
         trust_pickle: bool = False, trust_remote_code: bool = False, as_served: bool = False):
    device = resolve_device(device)
    if device_map is None:
        check_fits_gpu(model_spec, recipe, device)
    return load_model(model_spec, dtype=DTYPES[recipe.dtype], device=device,
                      device_map=device_map, trust_pickle=trust_pickle,
                      trust_remote_code=trust_remote_code, as_served=as_served)


def check_fits_gpu(model_spec: str, recipe: Recipe, device: str) -> None:
    """Loading a model whole onto a GPU whose free memory its weights exceed stops here with
    one line naming the budget, not with a CUDA out-of-memory error part way through the
    load; sized from the safetensors headers (a source without them is loaded as asked)."""
    if torch.device(device).type != "cuda":
        return
    free = gpu_free_bytes(device)
    found = resolve_safetensors(model_spec)
    if free is None or isinstance(found, str):
        return
    size = torch.empty(0, dtype=DTYPES[recipe.dtype]).element_size()
    need = sum(p.numel() for p in build_empty(found[0], DTYPES[recipe.dtype]).parameters()) \
        * size
    if need > free:
        raise UsageError(f"{model_spec}: its weights need {gb(need)} on {device}, more than "
                         f"the GPU budget {gb(free)} (what it has free); quantize works one "
                         "block at a time there (--device cuda); to evaluate, let accelerate "
                         "offload what does not fit (--device-map auto) or use --device cpu")


def calibration_texts(recipe: Recipe, model_spec: str | None = None
                      ) -> list[str] | ImageCalibrationSet:
    """The calibration documents; readable before the model loads, so that missing or empty
    data fails in seconds rather than after a long model load. For image data (CNNs), the
    calibration images themselves; a ``.pt`` ``model_spec`` (a CNN) requires image data."""
    if is_image_spec(recipe.calib_data) or is_torch_module_file(model_spec):
        return _image_set(recipe)
    return load_texts(resolve_calib_spec(recipe.calib_data), text_field=recipe.text_field)


def calibration_set(loaded, recipe: Recipe, texts=None, start: str | None = None):
    """Token windows for a transformers model; images for any other module (a CNN).
    ``texts``: what ``calibration_texts`` returned, if it was called already; ``start``: the
    token document windows open with (``fp8ptq.io.data.start_ids``; None: the recipe's
    ``calib_prefix_token``; evaluation's ``--prefix-token`` where an evaluation quantizes)."""
    start = recipe.calib_prefix_token if start is None else start
    if not isinstance(loaded.model, PreTrainedModel):
        return texts if isinstance(texts, ImageCalibrationSet) else _image_set(recipe)
    spec = resolve_calib_spec(recipe.calib_data)
    if is_image_spec(spec):
        raise DataError(f"calibration data {spec!r} is images, but {loaded.source!r} is a "
                        "text model")
    texts = calibration_texts(recipe) if texts is None else texts
    return build_calibration_set(texts, loaded.tokenizer, num_samples=recipe.num_samples,
                                 seq_len=recipe.seq_len, seed=recipe.seed, source=spec,
                                 windows=recipe.calib_windows, start=start)


def quantize_loaded(loaded, recipe: Recipe, calib=None, *, progress=None,
                    timings: JobTimings | None = None,
                    plan: QuantPlan | None = None) -> QuantizeResult:
    """Quantize ``loaded.model`` in place. ``progress(total)`` returns a per-batch callback;
    ``plan``: the run's plan of ``loaded.model`` (made here for a call outside a run)."""
    timings = timings or JobTimings()
    if plan is None:
        plan = build_plan(loaded.model, recipe)
    batches, tick = None, None
    if calib is not None:
        batches = _batches(loaded.model, calib, recipe.batch_size)
        n = len(distributed.shard(batches)) * plan.passes
        tick = progress(n) if progress else None
    with timings.timed("calibrate+quantize"):
        result = quantize_model(loaded.model, recipe, batches, progress=tick, plan=plan)
    timings.seconds.update(result.seconds)
    return result


@dataclass
class TargetRequest:
    """``quantize --target-delta``: what to meet and how to measure it
    (``fp8ptq.sensitivity.budget``)."""

    target: str  # "1%" (of the held-out perplexity) or an absolute delta "0.5"
    fallback: str = "bf16"  # the last rung: high precision, or a format
    level: str = "module"  # units: each GEMM, or each decoder block
    tokens: int = 4096  # held-out tokens the deltas are measured on
    seq_len: int = 512
    data: str | None = None  # held-out text; None: every 10th calibration document
    eval_batch_size: int = 4
    # How the held-out windows are cut (``fp8ptq.io.data``): "documents" opens each at a held-out
    # document after the BOS, where SmolLM2-like models keep their massive activations and
    # where every evaluated article starts; random offsets miss that position.
    windows: str = "documents"
    # The final model is checked again on this many held-out tokens in windows of
    # ``verify_seq_len`` (0: not): a slice the choices were not made on.
    verify_tokens: int = 16384
    verify_seq_len: int = 2048
    # a unit's sensitivity: "kl" (KL against the unquantized model) or "ppl"
    # (fp8ptq.sensitivity.budget)
    metric: str = "kl"


def selection_and_verify(heldout: list[str], verify: bool) -> tuple[list[str], list[str]]:
    """(documents the choices are made on, documents the result is verified on): alternate
    held-out documents, so the verification measures tokens the choice never saw (choosing
    on noisy per-unit deltas and measuring on the same tokens reports the winner's luck).
    Without verification, or with a single document, everything selects."""
    if not verify or len(heldout) < 2:
        return heldout, []
    return heldout[0::2], heldout[1::2]


def target_texts(recipe: Recipe, request: TargetRequest, texts: list[str]
                 ) -> tuple[list[str], list[str]]:
    """(calibration documents, held-out documents) for a --target-delta run."""
    if request.data is None:
        return split_heldout(texts)
    return texts, load_texts(resolve_calib_spec(request.data))


def quantize_to_target(loaded, recipe: Recipe, calib, heldout: list[str],
                       request: TargetRequest, *, progress=None,
                       timings: JobTimings | None = None, spill_dir=None,
                       planner=None) -> QuantizeResult:
    """Choose per module the cheapest rung that meets ``request.target``
    (``fp8ptq.sensitivity.budget``),
    quantize with the decisions, and measure the result on the held-out documents; the
    decisions, predicted and measured deltas are in ``result.extras["target_delta"]`` and the
    recorded recipe carries the decisions as overrides. ``spill_dir``: where the sweep's GPTQ
    Hessians wait on disk (default: the system's temporary folder). ``planner(model,
    recipe)``: the run's plan for the recipe with the decisions (made here for a call outside
    a run)."""
    timings = timings or JobTimings()
    if not isinstance(loaded.model, PreTrainedModel) or calib is None:
        raise UsageError("--target-delta needs a causal language model and calibration text")
    source = request.data or "held-out calibration documents"
    selection, verification = selection_and_verify(heldout, bool(request.verify_tokens))
    need = min(request.tokens, request.seq_len) + 1
    if verification and min(corpus_tokens(selection, loaded.tokenizer),
                            corpus_tokens(verification, loaded.tokenizer)) < need:
        selection = verification = heldout  # too little text to halve: both read it all
    windows = eval_windows(selection, loaded.tokenizer, tokens=request.tokens,
                           seq_len=request.seq_len, seed=recipe.seed, source=source,
                           windows=request.windows)
    verify_ids = _verify_windows(verification, loaded.tokenizer, recipe, request, source) \
        if verification else None
    batches = _batches(loaded.model, calib, recipe.batch_size)
    with timings.timed("target: sensitivity"):
        decision = choose_target(loaded.model, recipe, batches, windows.input_ids,
                                 target=request.target, fallback=request.fallback,
                                 level=request.level, eval_batch_size=request.eval_batch_size,
                                 progress=progress, spill_dir=spill_dir,
                                 metric=request.metric)
    if verify_ids is not None:
        with timings.timed("target: verify baseline"):
            verify_baseline = perplexity(loaded.model, verify_ids, request.eval_batch_size)
    final = decision.recipe(recipe)
    with timings.timed("calibrate+quantize"):
        result = quantize_model(loaded.model, final, batches,
                                plan=planner(loaded.model, final) if planner is not None
                                else None)
    timings.seconds.update(result.seconds)
    with timings.timed("target: verify"):
        measure_target(loaded.model, windows.input_ids, decision, request.eval_batch_size)
        if verify_ids is not None:
            verify_target(loaded.model, verify_ids, verify_baseline, decision,
                          request.eval_batch_size)
            decision.verify["disjoint"] = verification is not heldout
    result.extras["target_delta"] = decision.to_dict()
    return result


def _verify_windows(heldout: list[str], tokenizer, recipe: Recipe, request: TargetRequest,
                    source: str) -> torch.Tensor | None:
    """The larger verification slice: ``request.verify_tokens`` in windows of
    ``request.verify_seq_len``, both shrunk to what the held-out documents hold (no window
    repeats tokens); None when not asked for."""
    if not request.verify_tokens:
        return None
    total = corpus_tokens(heldout, tokenizer)
    seq_len = max(min(request.verify_seq_len, total - 1), 2)
    tokens = min(request.verify_tokens, max(total // seq_len, 1) * seq_len)
    return eval_windows(heldout, tokenizer, tokens=tokens, seq_len=seq_len, seed=recipe.seed,
                        source=source, windows=request.windows).input_ids


def _image_set(recipe: Recipe) -> ImageCalibrationSet:
    return build_image_calibration_set(recipe.calib_data, num_samples=recipe.num_samples,
                                       seed=recipe.seed)


def _batches(model, calib, batch_size: int) -> list:
    param = next(model.parameters())
    if isinstance(calib, ImageCalibrationSet):
        return image_batches(calib.images.to(param.device, param.dtype), batch_size)
    return list(token_batches(calib.input_ids, batch_size, param.device))


__all__ = ["JobTimings", "load", "calibration_texts", "calibration_set", "quantize_loaded",
           "peak_rss_mb", "resolve_device", "DTYPES", "TargetRequest",
           "target_texts", "quantize_to_target", "selection_and_verify"]
