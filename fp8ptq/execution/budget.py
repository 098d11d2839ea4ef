"""Memory budgets per device, and what the one-block GPU path needs of each.

``--max-memory`` gives the process a host budget (``4GB``) or, without ``--device-map``, a
budget per device (``0=20GiB,cpu=64GiB``: GPU 0 and the host). With ``--device cuda`` the GPU's
budget (given, else what the GPU has free when the run starts) decides the path: a model whose
in-memory estimate fits it is loaded whole onto the GPU; one that does not is quantized one
block at a time (``fp8ptq.execution.streaming`` with ``device``): the block's weights are read
from the safetensors files straight onto the GPU, calibrated, quantized with GPTQ, run for the
next block's inputs, written and dropped, while everything else stays on the host.

``gpu_need`` predicts that path's peak GPU memory (torch's allocator: what
``torch.cuda.max_memory_allocated`` measures) before anything is loaded, from the model's
structure alone:

* ``block``: the largest block's weights in ``--dtype``, plus its quantized codes (one byte a
  weight, the scales aside) and dequantized copies the simulated forward reads;
* ``kwargs``: every batch's recorded keyword arguments (rotary tables), moved there once;
* ``activations``: every batch's inter-block hidden states (inputs and outputs) when they stay
  on the GPU, else none (host memory, one batch at a time on the GPU);
* then the largest of three phases that do not overlap: ``calibration``, a group's Hessian
  forward of one whole batch (its intermediates in ``--dtype`` and the simulated input rounding
  of the groups already quantized) beside the group's Hessian sums (in-order GPTQ holds one
  group's at a time: q/k/v share one, gate/up one; float32 on a GPU,
  ``Recipe.hessian_dtype_on``, added into by the GEMM itself; float64 sums take a float32
  product per batch);
  ``sweep``, the widest GEMM's GPTQ: its group's sums, the scaled Hessian, its reordered copy
  and Cholesky factor (``in x in`` each, in the factor's dtype), then ``W*``, the float32
  transposed weight, the codes, their dequantized values and the report's SQNR sums;
  ``forward``, the quantized block run in micro-batches for the next block's inputs, every
  input rounded (``down_proj``'s the widest);
* ``replay``: sequential GPTQ's kept partial-forward outputs (``fp8ptq.algorithms.gptq.replay``),
  held beside the first two phases: what the GPU budget leaves, at most ``REPLAY_BYTES``.

The figures were checked against a fake CUDA allocator (every storage of a ``device="cuda"``
tensor counted from the op that makes it until it dies, ``tests/fake_cuda.py``) on small Llama
shapes; attention is counted as a fused kernel's (its output only), as on a GPU.

The host side (``host_need``) is the sequential path's fixed memory without the block and its
GPU working memory, plus the CUDA runtime's own resident memory and the activations kept on the
host (pinned) up to the host budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from accelerate.utils import convert_file_size_to_int

from ..algorithms.gptq.aim import Aim
from ..config.plan import QuantPlan, needs_full_hessian, reads_data
from ..config.recipe import Recipe
from ..errors import UsageError
from ..formats.scales import SQNR_ELEMENTS
from ..model.blocks import find_blocks
from ..model.forward import MICRO_TOKENS
from ..model.gemm import weight_2d
from ..nn.fused import fused_groups

# the CUDA runtime's resident host memory once a context exists (cuBLAS, cuDNN and the
# driver's mappings), beside ``strategy.RUNTIME_BYTES``; a round figure, not measured here
CUDA_HOST_BYTES = 1 << 30
# what the budget keeps free on the GPU beyond the prediction (the caching allocator's
# rounding and fragmentation, kernels' workspaces)
GPU_MARGIN = 0.9
# the most of a block's partial-forward outputs sequential GPTQ keeps on the GPU for replay
REPLAY_BYTES = 1 << 30


def parse_size(text: str) -> int:
    """``4GB`` (10^9), ``4GiB`` (2^30), ``512MB`` (accelerate's own parser, as the device map's
    budgets use it; case-insensitive) or a plain byte count. A ``UsageError`` when it is not a
    size."""
    text = str(text).strip()
    try:
        value = int(text) if text.isdigit() else convert_file_size_to_int(
            text.replace(" ", "").upper().replace("IB", "iB"))
    except (ValueError, TypeError):
        raise UsageError(f"--max-memory: {text!r} is not a size like 4GB, 4GiB or 512MB"
                         ) from None
    if value <= 0:
        raise UsageError(f"--max-memory: {text!r} must be more than 0 bytes")
    return int(value)


def gb(n: int | float) -> str:
    return f"{n / 1e9:.2f} GB"


def process_budget(text: str | None) -> int | None:
    """``--max-memory``'s process budget in bytes: a plain SIZE; None for accelerate's
    per-device form (``0=20GiB,cpu=64GiB`` or JSON) or no flag."""
    if text is None or "=" in text or text.strip().startswith("{"):
        return None
    return parse_size(text)


@dataclass(frozen=True)
class Budget:
    """Bytes a run may use: ``host`` (the process's resident memory), ``gpu`` (torch's
    allocations on the compute GPU); None where no budget was given."""

    host: int | None = None
    gpu: int | None = None

    @classmethod
    def of(cls, value) -> Budget:
        """A ``Budget`` from what ``fp8ptq.quantize`` takes: a host byte count, a Budget or
        None."""
        if value is None or isinstance(value, Budget):
            return value or cls()
        return cls(host=int(value))


def parse_budget(text: str | None, device: str) -> Budget:
    """``--max-memory`` without ``--device-map``: ``SIZE`` (the host), or ``DEVICE=SIZE,...``
    with devices ``cpu`` and GPU indices (``0`` or ``cuda:0``); the GPU entry read is the
    compute device's own (``--device cuda`` is GPU 0). A GPU budget with ``--device cpu`` is a
    usage error: nothing would run there."""
    if text is None:
        return Budget()
    if "=" not in text:
        return Budget(host=parse_size(text))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    host = gpu = None
    index = torch.device(device).index or 0
    gpus = []
    for part in text.split(","):
        key, _, size = (p.strip() for p in part.partition("="))
        if not size:
            raise UsageError(f"--max-memory expects SIZE or DEVICE=SIZE[,...], got {text!r}")
        key = key.removeprefix("cuda:")
        if key == "cpu":
            host = parse_size(size)
        elif key.isdigit():
            gpus.append(int(key))
            if int(key) == index:
                gpu = parse_size(size)
        else:
            raise UsageError(f"--max-memory: unknown device {key!r} (cpu, or a GPU index "
                             "such as 0)")
    if gpus and not device.startswith("cuda"):
        raise UsageError("--max-memory gives a GPU budget but the run is on the CPU; add "
                         "--device cuda (or --device-map to place the model with accelerate)")
    if gpus and gpu is None:
        raise UsageError(f"--max-memory names GPU {gpus[0]} but the run computes on GPU "
                         f"{index}; give GPU {index}'s budget")
    return Budget(host=host, gpu=gpu)


def gpu_free_bytes(device: torch.device | str) -> int | None:
    """What the GPU has free now, less a margin (``GPU_MARGIN``); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free * GPU_MARGIN)


def hessian_elem(recipe: Recipe, device: str) -> int:
    """Bytes per element of the Hessian sums on ``device`` (``Recipe.hessian_dtype_on``)."""
    return torch.empty(0, dtype=recipe.hessian_dtype_on(device)).element_size()


def gpu_need(model: torch.nn.Module, recipe: Recipe, plan: QuantPlan,
             activations_on_gpu: bool, device: str = "cuda",
             gpu_budget: int | None = None, factor_limit: int | None = None) -> dict:
    """The one-block path's GPU peak, by part (bytes; ``total``), for ``model`` built on the
    meta device and planned (see the module docstring). ``gpu_budget``: what is left of it
    beyond the rest sizes ``replay`` (sequential GPTQ's kept partial-forward outputs, at most
    ``REPLAY_BYTES``); None: the most they could take, capped so. ``factor_limit``: Hessians
    of more inputs are factored on the host (``fp8ptq.algorithms.gptq.sweep.host_factoring``):
    only their float32 inverse factor comes to the GPU for the sweep."""
    size = torch.empty(0, dtype=getattr(torch, recipe.dtype)).element_size()
    found = find_blocks(model)
    if found is None:
        raise UsageError("the one-block GPU path needs a model of repeated blocks")
    block_params = max(sum(p.numel() for p in b.parameters()) for b in found[1])
    largest = max((weight_2d(m.module).numel() for m in plan.gemms), default=0)
    shape = _shape(model)
    h, i, kv = shape["hidden"], shape["intermediate"], shape["kv"]
    calib = plan.needs_calibration
    tokens = recipe.batch_size * recipe.seq_len if calib else 0
    batches = -(-recipe.num_samples // max(recipe.batch_size, 1)) if calib else 0
    elem = hessian_elem(recipe, device)
    factor = 4 if elem == 4 else 8  # the Cholesky's dtype follows the sums' on a GPU
    sums, (out, k) = group_hessians(plan, elem)
    # the sweep's weight copy and inverse factor (``Recipe.sweep_dtype_on``: float32 or mixed 4,
    # float64 8)
    store, loop = (torch.empty(0, dtype=d).element_size() for d in recipe.sweep_dtype_on(device))
    sink = Aim.of(plan.recipe, plan.facts.causal_lm) is not None
    # one forward's intermediates (residual, q/k/v, attention, o, gate, up and their product)
    forward = size * (4 * h + 2 * kv + 3 * i)
    micro = min(tokens, max(1, MICRO_TOKENS // max(recipe.seq_len, 1)) * recipe.seq_len)
    parts = {
        # the block's weights, the codes and dequantized copies its quantized GEMMs keep
        # (the simulated forward reads the latter), the float weight of the one in hand
        "block": block_params * (size + 1) + largest * size,
        "kwargs": batches * 2 * tokens * shape["head_dim"] * size,
        "activations": (2 * recipe.num_samples * recipe.seq_len * h * size
                        if activations_on_gpu and calib else 0),
        # a group's Hessian forward (a whole batch, stopped at the group: the quantized
        # groups before it round their inputs, h wide), its sums and the per-batch float32
        # product they are summed from
        "calibration": (tokens * forward + activation_rounding(tokens * h) + sums
                        + (0 if elem == 4 else 4 * k * k)) if sums else 0,
        # the widest GEMM's sweep beside its group's sums: the reordered copy and the Cholesky
        # factor (and plain GPTQ's scaled copy of the sums; sink-aware GPTQ adjusts them in
        # place), then the inverse factor beside W* (float64), the transposed weight (both
        # in the sweep's storage dtype) and the codes
        "sweep": sweep_bytes(out, k, elem, factor, sink, store=store, loop=loop) if sums else 0,
        # the quantized block's forward for the next block's inputs: micro-batches, every
        # GEMM's input rounded (down_proj's, intermediate wide, the largest), into the
        # whole batch's output
        "forward": (micro * size * (2 * h + i) + activation_rounding(micro * i)
                    + 2 * tokens * h * size) if calib else 0,
    }
    if sums and factor_limit is not None:  # the GEMMs wider than the limit: on the host
        parts["sweep"] = max(sweep_bytes(o, n, elem, factor, sink, n > factor_limit, store, loop)
                             for o, n in gemm_shapes(plan))
    records = recipe.num_samples * recipe.seq_len * size * (3 * h + 2 * kv + 2 * i) \
        if sums else 0
    if sums and plan.experts:  # one MoE layer's expert Hessians, collected together
        # ... and one expert's sweep beside them (its own sums counted among them; experts
        # get plain GPTQ, so its scaled copy of the sums too)
        swept = max((sweep_bytes(o, n, elem, factor, False, store=store, loop=loop) - elem * n * n
                     for o, n in expert_shapes(plan)), default=0)
        parts["calibration"] = max(parts["calibration"],
                                   tokens * forward + expert_hessians(plan, elem) + swept)
    steady = parts["block"] + parts["kwargs"] + parts["activations"]
    working = max(parts["calibration"], parts["sweep"])  # replay records held beside these
    room = REPLAY_BYTES if gpu_budget is None else max(0, gpu_budget - steady - working)
    parts["replay"] = min(records, room, REPLAY_BYTES)
    base = steady + max(working + parts["replay"], parts["forward"])
    parts["total"] = base
    return parts


def sweep_bytes(out: int, k: int, elem: int, factor: int, sink: bool,
                on_host: bool = False, store: int = 4, loop: int = 4) -> int:
    """GPU bytes of one ``out x k`` GEMM's sweep: its group's sums (``elem`` bytes each), the
    reordered copy and the Cholesky factor (``factor`` bytes; plain GPTQ also a scaled copy
    of the sums; sink-aware GPTQ adjusts them in place); then the inverse factor beside
    ``W*``, the transposed weight (``store`` bytes each: the sweep's storage dtype), the
    codes and their dequantized values, and one 128-column block's buffers (its scales and
    errors in the loop's dtype, ``loop`` bytes, the errors cast back for the block update; a
    wider loop than storage, ``mixed``, copies the block's columns and factor block where the
    torch loop runs it); then the report's SQNR sums. ``on_host``: factored on the host, only
    the inverse factor here."""
    cols = min(128, k)
    block = cols * out * (2 * loop + 4)
    if loop != store:
        block += cols * out * loop + cols * cols * loop
    weights = (13 + store) * out * k + block
    if on_host:
        return max(store * k * k + weights, weights + 24 * min(out * k, SQNR_ELEMENTS))
    return elem * k * k + max(2 * factor * k * k + (0 if sink else elem * k * k),
                              store * k * k + weights,
                              weights + 24 * min(out * k, SQNR_ELEMENTS))


def expert_shapes(plan: QuantPlan) -> set[tuple[int, int]]:
    """``(out, in)`` of every expert's matrix (fused 3-D weights ``[experts, out, in]``)."""
    return {(int(p.shape[1]), int(p.shape[2])) for e in plan.experts
            for p in e.module.parameters() if p.dim() == 3}


def gemm_shapes(plan: QuantPlan) -> set[tuple[int, int]]:
    """``(out, in)`` of every GEMM that GPTQ sweeps with a full Hessian."""
    return {tuple(weight_2d(m.module).shape) for m in plan.gemms
            if reads_data(m) and needs_full_hessian(m)}


def factor_limit_for(model: torch.nn.Module, recipe: Recipe, plan: QuantPlan, on_gpu: bool,
                     gpu_budget: int, device: str = "cuda") -> int | None:
    """The widest Hessian (inputs) the GPU can factor itself within ``gpu_budget``, when the
    widest GEMM's would not fit: those wider are factored on the host. None: all fit."""
    need = gpu_need(model, recipe, plan, on_gpu, device, gpu_budget=0)
    if need["total"] <= gpu_budget:
        return None
    widths = sorted({k for _, k in gemm_shapes(plan)})
    for limit in reversed(widths[:-1]):
        if gpu_need(model, recipe, plan, on_gpu, device, 0, limit)["total"] <= gpu_budget:
            return limit
    return 0 if widths else None


def expert_hessians(plan: QuantPlan, elem: int) -> int:
    """The most bytes of one fused-experts module's per-expert Hessians at once: for every
    expert, one per distinct input width of its 3-D weights (gate and up share theirs), as
    expert GPTQ holds them for one MoE layer (``fp8ptq.algorithms.gptq.experts``; an upper
    bound: only experts the router sent tokens get one)."""
    most = 0
    for e in plan.experts:
        widths = {p.shape[0]: set() for p in e.module.parameters() if p.dim() == 3}
        for p in e.module.parameters():
            if p.dim() == 3:
                widths[p.shape[0]].add(int(p.shape[2]))
        most = max(most, sum(n * sum(k * k for k in ks) for n, ks in widths.items()) * elem)
    return most


def activation_rounding(elements: int) -> int:
    """The simulated per-token rounding's float32 temporaries for ``elements`` values: about
    five at once, measured, on a GPU in one piece up to 2^25 values and in 2^24-value chunks beyond
    (``fp8ptq.formats.codec``)."""
    return 21 * (elements if elements < 2 ** 25 else 2 ** 24)


def _shape(model: torch.nn.Module) -> dict:
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    heads = int(getattr(text, "num_attention_heads", 0) or 1)
    head_dim = int(getattr(text, "head_dim", 0) or hidden // heads)
    kv_heads = int(getattr(text, "num_key_value_heads", 0) or heads)
    return {"hidden": hidden, "intermediate": int(getattr(text, "intermediate_size", 0)
                                                  or 4 * hidden),
            "kv": kv_heads * head_dim, "head_dim": head_dim}


def group_hessians(plan: QuantPlan, elem: int) -> tuple[int, tuple[int, int]]:
    """(bytes of the largest one group's Hessian sums, ``(out, in)`` of the widest GEMM that
    GPTQ sweeps); (0, (0, 0)) where no GEMM reads a full Hessian."""
    reading = {m.name: m for m in plan.gemms if reads_data(m) and needs_full_hessian(m)}
    fused = {n for g in fused_groups(list(reading)) for n in g[1:]}  # share the first's sums
    largest, widest = 0, (0, 0)
    for name, m in reading.items():
        out, k = weight_2d(m.module).shape
        widest = max(widest, (out, k), key=lambda s: (s[1], s[0]))
        if name not in fused:
            largest = max(largest, elem * k * k)
    return largest, widest


def host_need(est, activations_on_gpu: bool, activation_budget: int) -> dict:
    """The one-block GPU path's host peak, by part (``total`` their sum), from the
    sequential path's estimate ``est`` (``strategy.Estimate``): the runtime and the CUDA
    runtime, the modules outside the blocks, the writer's open shard, one block's largest
    tensor in flight to the GPU, and the activations kept on the host (pinned) up to
    ``activation_budget`` (the rest on disk)."""
    parts = est.parts
    parts_out = {
        "runtime": est.sequential_fixed - parts["outside_blocks_bytes"] - parts["block_bytes"]
        - parts["quantize_temporaries_bytes"] - parts["block_forward_bytes"]
        - parts["open_shard_bytes"] - parts["block_hessian_bytes"] - parts["gptq_work_bytes"]
        + CUDA_HOST_BYTES,
        "outside_blocks": parts["outside_blocks_bytes"],
        "open_shard": parts["open_shard_bytes"],
        "in_flight": parts["quantize_temporaries_bytes"] // 5 * 2,
        "activations": 0 if activations_on_gpu else min(est.activations, activation_budget),
    }
    parts_out["total"] = sum(parts_out.values())
    return parts_out


def activations_fit(model: torch.nn.Module, recipe: Recipe, plan: QuantPlan,
                    gpu_budget: int, device: str = "cuda") -> bool:
    """Whether every batch's inter-block hidden states fit on the GPU beside the block (and
    its working memory, without replay records)."""
    need = gpu_need(model, recipe, plan, True, device, gpu_budget=0)
    return need["total"] <= gpu_budget


__all__ = ["Budget", "CUDA_HOST_BYTES", "GPU_MARGIN", "REPLAY_BYTES", "activation_rounding",
           "activations_fit", "expert_hessians", "factor_limit_for", "gb", "gemm_shapes",
           "gpu_free_bytes", "gpu_need", "group_hessians", "hessian_elem", "host_need",
           "parse_budget", "parse_size", "process_budget", "sweep_bytes"]
