"""Which path ``quantize`` takes - model-free, sequential or in-memory - and why, decided once.

Three paths produce the same checkpoint layouts and fp8ptq.json:

* **model-free** (``fp8ptq.execution.model_free``): the recipe reads no calibration data
(weight-only,
  dynamic per-token activations), so each weight is quantized from the safetensors files alone;
  memory is a few tensors in flight plus the writer's open shard;
* **sequential** (``fp8ptq.execution.streaming``): one repeated block resident at a time,
inter-block
  activations in memory up to a budget and spilled to disk beyond it;
* **in-memory** (``fp8ptq.execution.in_memory``): the whole model loaded, every calibrator
available.

``choose`` is the one place that decides, before anything is loaded: ``--sequential`` and
``--model-free`` / ``--no-model-free`` are obeyed (or refused with the reason); otherwise a
recipe that needs no calibration goes model-free when the source is a safetensors checkpoint;
otherwise, with a process budget (``--max-memory SIZE``), the weights read from the safetensors
headers plus the in-memory path's working memory (``estimate``) are compared with SIZE, and a
model that does not fit runs sequential with an activation budget of what SIZE leaves after the
sequential path's own fixed memory; else in-memory. The ``Selection`` says which path and why;
the CLI prints it, puts it in ``--json`` and in fp8ptq.json's ``extras`` (``record``).

The estimates are deliberately simple and err high (docs/big-models.md, "Memory budget"): they
count the weights in ``--dtype``, temporaries of the largest quantized module while it is quantized,
one calibration batch's activations and float32 logits, GPTQ's float64 Hessians (one per distinct
input; diagonals only for ``hmse``) and its sweep's working memory (``hessian_bytes``), and a fixed
runtime (Python, torch, transformers and a tokenizer after imports, ``RUNTIME_BYTES``).
The largest planned module's weights (a GEMM, or a layer's fused experts) are counted again at 5
bytes an element while quantized: a float32 copy some calibrators make, and its uint8 codes. The
sequential path counts what it holds (checked against the 44-layer synthetic Llama's measured
peak, docs/results/memory.md): the modules outside
the blocks, ONE block (the next is loaded after the last is written and freed), one micro-batch's
block forward (logits only when a GEMM outside the blocks is quantized, since the head runs on the
calibration batches only then), one group's Hessian (in-order GPTQ; a block's otherwise), and the
output shard its writer holds until it is full (``shard_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..checkpoint.shards import SHARD_BYTES
from ..config.plan import (
    Planner,
    QuantPlan,
    build_plan,
    needs_full_hessian,
    reads_data,
    run_facts,
)
from ..config.recipe import Recipe
from ..errors import UsageError
from ..io.loading import resolve_safetensors
from ..io.weights import build_empty
from ..model.blocks import block_prefix, find_blocks
from ..model.forward import MICRO_TOKENS
from ..model.gemm import weight_2d
from ..nn.fused import fused_groups
from ..observe import distributed
from .budget import (  # noqa: F401 - parse_size, process_budget re-exported
    Budget,
    activations_fit,
    factor_limit_for,
    gb,
    gpu_free_bytes,
    gpu_need,
    host_need,
    parse_size,
    process_budget,
)
from .model_free import ModelFreeJob, NotModelFree, refusal

RUNTIME_BYTES = 640 * 2**20  # Python + torch + transformers + tokenizer, after imports


@dataclass
class Estimate:
    """Bytes each path needs beyond the runtime, from the model's structure alone."""

    weights: int  # every parameter in --dtype
    in_memory: int  # peak estimate of the in-memory path (runtime included)
    sequential_fixed: int  # sequential without its activation store (runtime included)
    activations: int  # the inter-block activations of every calibration batch (one block)
    parts: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"weights_bytes": self.weights, "in_memory_bytes": self.in_memory,
                "sequential_fixed_bytes": self.sequential_fixed,
                "activation_bytes": self.activations, **self.parts}


def estimate(model: nn.Module, recipe: Recipe, budget: int | None = None,
             plan: QuantPlan | None = None) -> Estimate:
    """Peak-memory estimates for ``model`` (built on the meta device, ``weights.build_empty``)
    quantized with ``recipe``; ``budget``: the ``--max-memory`` bytes, which size the output
    shard the sequential path's writer holds open (``shard_bytes``); ``plan``: the run's plan
    of ``model`` (made here for a call outside a run)."""
    size = torch.empty(0, dtype=getattr(torch, recipe.dtype)).element_size()
    weights = sum(p.numel() for p in model.parameters()) * size
    if plan is None:
        plan = build_plan(model, recipe)
    largest = max((sum(p.numel() for p in m.module.parameters()) for m in plan.modules),
                  default=0)
    temporaries = 5 * largest  # a float32 copy (a calibrator's) and the uint8 codes
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    inter = int(getattr(text, "intermediate_size", 0) or 4 * hidden)
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    heads = int(getattr(text, "num_attention_heads", 0) or 1)
    facts = run_facts(recipe)
    calib = facts.needs_calibration
    tokens = recipe.batch_size * recipe.seq_len if calib else 0
    batch = 4 * (tokens * (6 * hidden + 2 * inter + vocab)
                 + recipe.batch_size * heads * recipe.seq_len ** 2 * int(calib))
    activations = (recipe.num_samples * recipe.seq_len * hidden * size) if calib else 0
    found = find_blocks(model)
    block = outside = weights
    coded = sum(p.numel() for p in model.parameters())  # the quantized blocks: 1 byte a weight
    head_runs = True
    if found is not None:
        name, blocks = found
        coded = sum(p.numel() for p in blocks.parameters())
        block = max(sum(p.numel() for p in b.parameters()) for b in blocks) * size
        outside = sum(p.numel() for n, p in model.named_parameters()
                      if not n.startswith(f"{name}.")) * size
        head_runs = any(not m.name.startswith(f"{name}.") for m in plan.modules)
    # sequential writes each block as it is done, but the writer keeps the open shard's
    # tensors (the blocks' codes) until the shard is full (the peak RSS grows block by block
    # until the shard is written); in memory the shard holds the model's
    # own tensors
    shard = min(shard_bytes(budget) or SHARD_BYTES, coded)
    block_batch = _block_forward_bytes(recipe, facts.gptq, hidden, inter, heads, size,
                                       vocab if head_runs else 0) if calib else 0
    hessians, gptq_work = hessian_bytes(plan.gemms)
    if facts.gptq_in_order:
        whole = per_block = max(hessians.values(), default=0)
    else:
        whole = per_block = sum(hessians.values())
        if found is not None:
            per_block = max(sum(v for n, v in hessians.items()
                                if n.startswith(block_prefix(found[0], i)))
                            for i in range(len(found[1])))
    return Estimate(
        weights=weights,
        in_memory=RUNTIME_BYTES + weights + temporaries + batch + activations + whole
        + gptq_work,
        sequential_fixed=(RUNTIME_BYTES + outside + block + temporaries + block_batch + shard
                          + per_block + gptq_work),
        activations=2 * activations,  # a block's inputs and its outputs
        parts={"quantize_temporaries_bytes": temporaries, "calibration_batch_bytes": batch,
               "block_forward_bytes": block_batch, "block_bytes": block,
               "outside_blocks_bytes": outside, "open_shard_bytes": shard,
               "hessian_bytes": whole, "block_hessian_bytes": per_block,
               "gptq_work_bytes": gptq_work})


def hessian_bytes(gemms: list) -> tuple[dict[str, int], int]:
    """``({first GEMM of each distinct input: its Hessian sums' bytes}, the GPTQ sweep's working
    bytes for the largest GEMM)``. The sums are float64, one per distinct input (the GEMMs a
    runtime fuses, q/k/v and gate/up, read the same tensor and share one: ``fused_groups``),
    ``in^2`` elements, or ``in`` where only the diagonal is read (``hmse`` rounding to nearest:
    ``fp8ptq.observe.hessian``). The sweep (``fp8ptq.algorithms.gptq.sweep``) holds, besides
    the sums, two float64 ``in x in`` matrices (3 counted: the two it keeps plus LAPACK's
    copy, rounded up) and the float64 transposed weight it updates (with the float32 gather
    before it and the codes; ``16 out in`` bytes counted, two weights' worth, rounded up from
    what ``tests/test_gptq.py`` measures)."""
    reading = {m.name: m for m in gemms if reads_data(m)}
    shared = {n: g[0] for g in fused_groups(list(reading)) for n in g}
    sums: dict[str, int] = {}
    work = 0
    for name, m in reading.items():
        out, k = weight_2d(m.module).shape
        full = needs_full_hessian(m)
        owner = shared.get(name, name)
        sums[owner] = max(sums.get(owner, 0), 8 * k * (k if full else 1))
        if full:
            work = max(work, 3 * 8 * k * k + 16 * out * k)
    return sums, work


def _block_forward_bytes(recipe: Recipe, gptq: bool, hidden: int, inter: int, heads: int,
                         size: int, vocab: int) -> int:
    """Sequential mode's working memory for one calibration batch through one block: the
    float32 intermediates of one micro-batch (``MICRO_TOKENS`` tokens of whole sequences; the
    whole batch while GPTQ's Hessians are collected), plus the batch's output hidden states
    as they are stored, plus float32 logits only when a GEMM outside the blocks is quantized
    (the head then runs on the calibration batches; otherwise it never runs)."""
    seq, tokens = recipe.seq_len, recipe.batch_size * recipe.seq_len
    rows = recipe.batch_size if gptq else min(recipe.batch_size, max(1, MICRO_TOKENS // seq))
    return (4 * (rows * seq * (6 * hidden + 2 * inter) + rows * heads * seq ** 2)
            + tokens * hidden * size + 4 * tokens * vocab)


@dataclass
class Selection:
    """Which path ``quantize`` takes, and why."""

    path: str  # "model-free" | "sequential" | "in-memory"
    reason: str
    folder: Path | None = None  # the safetensors checkpoint (model-free, sequential)
    kind: str | None = None  # local | hub | gguf
    activation_budget: int | None = None  # sequential: bytes of activations kept in memory
    budget: int | None = None  # --max-memory SIZE in bytes
    estimate: Estimate | None = None
    job: ModelFreeJob | None = None  # model-free: the planned job
    # the one-block GPU path (``budget``): where blocks compute, where the inter-block
    # activations live, the GPU budget and both predicted peaks by part
    device: str = "cpu"
    activations_on: str = "host"
    gpu_budget: int | None = None
    predicted_gpu: dict | None = None
    predicted_host: dict | None = None
    gpu_factor_limit: int | None = None  # wider Hessians factored on the host

    def facts(self) -> dict:
        """What ``--json`` and fp8ptq.json's extras record."""
        out: dict = {"path": self.path, "path_reason": self.reason}
        if self.budget is not None:
            out["max_memory_bytes"] = self.budget
        if self.activation_budget is not None:
            out["activation_budget_bytes"] = self.activation_budget
        if self.estimate is not None:
            out["memory_estimate"] = self.estimate.as_dict()
        if self.gpu_budget is not None:
            out["gpu_budget_bytes"] = self.gpu_budget
        if self.path == "sequential" and self.device != "cpu":
            out["compute_device"] = self.device
            out["activations_on"] = self.activations_on
            if self.gpu_factor_limit is not None:
                out["gpu_factor_limit"] = self.gpu_factor_limit
        for key, parts in (("predicted_gpu_mb", self.predicted_gpu),
                           ("predicted_rss_mb", self.predicted_host)):
            if parts is not None:
                out[key] = round(parts["total"] / 2**20, 1)
                out[key.replace("_mb", "_parts_mb")] = {
                    k: round(v / 2**20, 1) for k, v in parts.items() if k != "total"}
        return out

    def sequential_options(self) -> dict:
        """Keyword arguments for ``sequential.quantize_folder``: the activation budget,
        under ``--max-memory`` the output shard size (the writer holds one shard), and the
        compute device with where the activations live."""
        out: dict = {} if self.device == "cpu" else {
            "device": self.device, "activations_on": self.activations_on}
        if self.predicted_gpu is not None and "replay" in self.predicted_gpu:
            out["replay_budget"] = self.predicted_gpu["replay"]
        if self.gpu_factor_limit is not None:
            out["gpu_factor_limit"] = self.gpu_factor_limit
        if self.activation_budget is not None:
            out["activation_budget"] = self.activation_budget
        if self.budget is not None:
            out["max_shard_bytes"] = shard_bytes(self.budget)
        return out


def choose(spec: str, recipe: Recipe, *, sequential: bool = False, model_free: bool | None = None,
           max_memory: int | None = None, trust_remote_code: bool = False,
           task: str | None = None, whole_model: str | None = None,
           planner: Planner | None = None, device: str = "cpu",
           gpu_budget: int | None = None) -> Selection:
    """The path for quantizing MODEL ``spec`` with ``recipe``. ``model_free``: True insists
    (``UsageError`` naming what stands in the way), False forbids, None decides; ``max_memory``:
    the process budget in bytes (``--max-memory SIZE``); ``whole_model``: why this job needs the
    whole model in memory whatever the recipe (``--target-delta`` measures it); ``planner``:
    the run's plan, asked for the meta-device model a path is sized or planned on (the
    model-free job, the memory estimate), so that the run plans once. ``device``: where the
    run computes; on a GPU, ``gpu_budget`` (bytes; None: what the GPU has free) decides
    between the whole model on it and one block at a time (``by_gpu_budget``)."""
    if torch.device(device).type == "cuda" and not (trust_remote_code or whole_model
                                                    or (sequential and model_free)):
        if not sequential and model_free is not False:
            chosen = _model_free(spec, recipe, model_free, task, planner)
            if chosen.path == "model-free":
                chosen.budget = max_memory
                return chosen
        return by_gpu_budget(spec, recipe, Budget(max_memory, gpu_budget), device, task,
                             forced=sequential, planner=planner)
    if sequential:
        if model_free:
            raise UsageError("--model-free and --sequential are two different paths; use one")
        if max_memory is None:
            folder, kind = _sequential_source(spec, task)
            return Selection("sequential", "--sequential", folder, kind)
        return by_budget(spec, recipe, max_memory, task, forced_sequential=True,
                         planner=planner)
    if trust_remote_code:
        if model_free:
            raise UsageError("--model-free builds the model from transformers' own classes; "
                             "drop --trust-remote-code or --model-free")
        return Selection("in-memory", "--trust-remote-code loads the model's own code",
                         budget=max_memory)
    if whole_model:
        if model_free:
            raise UsageError(f"--model-free: {whole_model}")
        return Selection("in-memory", whole_model, budget=max_memory)
    if model_free is not False:
        chosen = _model_free(spec, recipe, model_free, task, planner)
        if chosen.path == "model-free" or max_memory is None:
            chosen.budget = max_memory
            return chosen
    elif max_memory is None:
        return Selection("in-memory", "--no-model-free")
    return by_budget(spec, recipe, max_memory, task, planner=planner)


def _model_free(spec: str, recipe: Recipe, forced: bool | None, task: str | None,
                planner: Planner | None = None) -> Selection:
    problem = refusal(recipe)
    if problem:
        if forced:
            raise UsageError(f"--model-free: {problem}")
        return Selection("in-memory", f"the recipe needs the model: {problem}")
    found = resolve_safetensors(spec, task=task)
    if isinstance(found, str):
        if forced:
            raise UsageError(f"--model-free reads safetensors checkpoints: {found}")
        return Selection("in-memory", found)
    folder, kind = found
    try:  # plans it: config, headers, key mapping (no tensor read)
        job = ModelFreeJob(folder, recipe, task=task, planner=planner)
    except NotModelFree as e:
        if forced:
            raise UsageError(f"--model-free: {e}") from None
        return Selection("in-memory", f"model-free was not possible: {e}")
    why = "forced by --model-free" if forced else (
        "the recipe reads no calibration data and the source is a safetensors checkpoint")
    if distributed.active():
        why += f"; rank 0 of {distributed.world()} writes it alone"
    return Selection("model-free", why, folder, kind, job=job)


def by_budget(spec: str, recipe: Recipe, budget: int, task: str | None = None, *,
              forced_sequential: bool = False, planner: Planner | None = None) -> Selection:
    """In-memory when its estimate fits ``budget`` bytes, else (or with ``forced_sequential``)
    sequential with the activation budget the rest of ``budget`` leaves (the source must be a
    safetensors checkpoint). ``planner``: the run's plan (``choose``)."""
    found = _sequential_source(spec, task) if forced_sequential else resolve_safetensors(
        spec, task=task)
    if isinstance(found, str):
        return Selection("in-memory", f"--max-memory {gb(budget)} cannot be planned: {found}; "
                         "loaded whole", budget=budget)
    folder, kind = found
    meta = build_empty(folder, getattr(torch, recipe.dtype), task)
    est = estimate(meta, recipe, budget, plan=planner(meta) if planner is not None else None)
    need = (f"weights {gb(est.weights)} + working memory {gb(est.in_memory - est.weights)}")
    if est.in_memory <= budget and not forced_sequential:
        return Selection("in-memory", f"{need} fit --max-memory {gb(budget)}",
                         folder, kind, budget=budget, estimate=est)
    left = budget - est.sequential_fixed
    why = ("--sequential" if forced_sequential else
           f"{need} exceed --max-memory {gb(budget)}: one block at a time")
    if left < 0:
        why += (f" (even so, about {gb(est.sequential_fixed)} is needed: "
                "the budget may be exceeded)")
    elif est.activations > left:
        why += f", calibration activations beyond {gb(left)} spilled to disk"
    return Selection("sequential", why, folder, kind, activation_budget=max(0, left),
                     budget=budget, estimate=est)


def by_gpu_budget(spec: str, recipe: Recipe, budget: Budget, device: str,
                  task: str | None = None, *, forced: bool = False,
                  planner: Planner | None = None) -> Selection:
    """On a GPU: the whole model loaded onto it when the in-memory estimate (weights and
    working memory) fits ``budget.gpu`` (None: what the GPU has free), else (or ``forced``,
    ``--sequential``) one block at a time on it (``fp8ptq.execution.budget``), the
    activations on the GPU when every batch's fit beside the block, else on the host. The
    source must be a safetensors checkpoint (or a .gguf, converted) to stream from; another
    is loaded whole."""
    found = _sequential_source(spec, task) if forced else resolve_safetensors(spec, task=task)
    if isinstance(found, str):
        return Selection("in-memory", f"the GPU budget cannot be planned: {found}; loaded "
                         f"whole onto {device}", budget=budget.host, device=device)
    folder, kind = found
    meta = build_empty(folder, getattr(torch, recipe.dtype), task)
    plan = planner(meta) if planner is not None else build_plan(meta, recipe)
    est = estimate(meta, recipe, budget.host, plan=plan)
    gpu_budget = budget.gpu if budget.gpu is not None else gpu_free_bytes(device)
    whole = est.in_memory - RUNTIME_BYTES  # weights and working memory, on the GPU
    where = "the GPU budget" if gpu_budget is None else f"the GPU budget {gb(gpu_budget)}"
    if not forced and (gpu_budget is None or whole <= gpu_budget):
        return Selection("in-memory", f"weights {gb(est.weights)} + working memory "
                         f"{gb(whole - est.weights)} fit {where}", folder, kind,
                         budget=budget.host, estimate=est, device=device,
                         gpu_budget=gpu_budget, predicted_gpu={"total": whole})
    on_gpu = gpu_budget is not None and activations_fit(meta, recipe, plan, gpu_budget, device)
    limit = None if gpu_budget is None else factor_limit_for(meta, recipe, plan, on_gpu,
                                                             gpu_budget, device)
    gpu = gpu_need(meta, recipe, plan, on_gpu, device, gpu_budget, limit)
    left = est.activations if budget.host is None else max(
        0, budget.host - est.sequential_fixed)
    host = host_need(est, on_gpu, left)
    why = ("--sequential" if forced else f"weights {gb(est.weights)} + working memory "
           f"{gb(whole - est.weights)} exceed {where}")
    why += (f": one block at a time on {device}, about {gb(gpu['total'])} there, the "
            f"activations on the {'GPU' if on_gpu else 'host'}")
    if limit is not None:
        why += f", Hessians of more than {limit} inputs factored on the host"
    if gpu_budget is not None and gpu["total"] > gpu_budget:
        why += " (more than the GPU budget: it may be exceeded)"
    if not on_gpu and est.activations > left:
        why += f", beyond {gb(left)} spilled to disk"
    return Selection("sequential", why, folder, kind, activation_budget=est.activations
                     if on_gpu else left, budget=budget.host, estimate=est, device=device,
                     activations_on="device" if on_gpu else "host", gpu_budget=gpu_budget,
                     predicted_gpu=gpu, predicted_host=host, gpu_factor_limit=limit)


def _sequential_source(spec: str, task: str | None) -> tuple[Path, str]:
    """The safetensors folder sequential mode streams blocks from: MODEL's own, its hub
    snapshot, or a ``.gguf``'s converted copy (converted once, block by block, into the cache
    the in-memory loader reads too); a ``UsageError`` saying why when there is none."""
    found = resolve_safetensors(spec, task=task)
    if isinstance(found, str):
        raise UsageError(f"--sequential reads a safetensors checkpoint or a .gguf file: {found}")
    return found


def shard_bytes(budget: int | None) -> int | None:
    """The output shard size under ``budget`` for the model-free and sequential writers (they
    hold the open shard in memory): a quarter of what the runtime leaves, at most the default,
    at least 64 MiB."""
    if budget is None:
        return None
    return max(64 * 2**20, min(SHARD_BYTES, (budget - RUNTIME_BYTES) // 4))


def record(result, selection: Selection) -> None:
    """Write the selection into ``result.extras`` (fp8ptq.json's ``extras``)."""
    result.extras.update(selection.facts())


__all__ = ["Estimate", "Selection", "by_budget", "choose", "estimate", "gb", "parse_size",
           "process_budget", "record", "shard_bytes", "RUNTIME_BYTES"]
