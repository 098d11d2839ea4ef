"""bf16 / fp16 GEMMs of calibration and evaluation forwards computed in float32, on CPUs
without native low-precision matrix instructions.

Calibration runs the model in its ``--dtype`` (bf16 by default) so that every observer sees the
activations the deployed model produces. On a CPU without AVX-512 BF16 / AMX (oneDNN's
``_is_mkldnn_bf16_supported()`` is False: AVX2-only machines such as this project's 2-core
AMD EPYC), torch's bf16 GEMM has no fast kernel and runs several times slower than float32
(docs/results/memory.md, "Big models: figures behind docs/big-models.md"). A
calibration forward is almost all GEMM, so the whole statistics pass (and sequential mode's
carrying of activations from block to block) runs several times slower than it needs to.

``float32_gemms()`` is a ``TorchFunctionMode`` that computes each bf16 / fp16 ``F.linear`` in
float32 instead and rounds the result back to the input's dtype: the input is upcast once,
the weight in row chunks of at most ``CHUNK_BYTES`` (so no whole-weight float32 copy is ever
resident: a 13824 x 5120 weight is 283 MB in float32), and each output chunk is rounded into
the bf16 output. The result is a correctly rounded bf16 value of a float32-accumulated dot
product - what a bf16 GEMM with float32 accumulation computes too, up to the summation
order, so a few outputs in 10,000 differ by one bf16 ulp (docs/results/memory.md);
it is not bit-identical to torch's bf16 kernel. Every path of a job (in-memory,
sequential, each rank under torchrun) runs under the same mode, so they stay bit-identical to
each other. The extra memory (``extra_bytes``: the float32 input, one float32 weight chunk and
one float32 output chunk, so at most 2 x ``CHUNK_BYTES`` beyond the input) lies within the
float32 activations of a calibration batch that ``fp8ptq.execution.strategy``'s estimate counts (4
bytes x tokens x (6 hidden + 2 intermediate + vocabulary)). These float32 copies, and attention's
upcast query / key / value, live in per-thread scratch buffers of at most ``CHUNK_BYTES`` each
while the mode is active (``_scratch``): allocated afresh at every call they would be mapped
and faulted in again each time (``fp8ptq.runtime.usage.bound_heap``), which is kernel time.

The same mode runs ``F.scaled_dot_product_attention`` on bf16 / fp16 CPU tensors in float32
(``attention32``: query, key, value and a floating mask upcast, the output rounded back once):
torch's CPU flash-attention kernel is also several times slower in bf16 than in float32 there,
and it became a large share of a bf16 forward at long context once the linear layers ran in
float32. Evaluation (``fp8ptq.evals.run_tasks``: every lm-eval forward, baseline or simulated
quantized) runs under the mode as well as calibration; its log-likelihoods then differ from a
pure-bf16 forward by the same rounding effect (a small fraction of a percent of a bf16
SmolLM2's word perplexity), never by more than that (``tests/test_gemm32.py`` bounds it on
a tiny bf16 model).

Where the CPU has native bf16 / fp16 GEMMs, or the tensors are on an accelerator, nothing
changes. ``FP8PTQ_FLOAT32_GEMMS=0`` / ``1`` turns it off / forces it (tests force it).
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

CHUNK_BYTES = 32 * 2**20  # float32 bytes of one weight chunk, and of one output chunk
_LOW = (torch.bfloat16, torch.float16)
_active = threading.local()


def cpu_lacks_fast_lowp(dtype: torch.dtype) -> bool:
    """True when this CPU has no fast ``dtype`` GEMM (oneDNN's own capability check)."""
    try:
        if dtype == torch.bfloat16:
            return not torch.ops.mkldnn._is_mkldnn_bf16_supported()
        return not torch.ops.mkldnn._is_mkldnn_fp16_supported()
    except (AttributeError, RuntimeError):  # no oneDNN in this build: no fast kernel either
        return True


def wanted(dtype: torch.dtype, force: bool | None = None) -> bool:
    """Whether ``dtype`` GEMMs on the CPU run in float32 (``force`` or the environment
    decide first)."""
    if dtype not in _LOW:
        return False
    env = os.environ.get("FP8PTQ_FLOAT32_GEMMS")
    if force is None and env in ("0", "1"):
        force = env == "1"
    return cpu_lacks_fast_lowp(dtype) if force is None else force


def rows_per_chunk(tokens: int, in_features: int, out_features: int) -> int:
    """Weight rows per chunk: its float32 copy and its float32 output both within
    ``CHUNK_BYTES``."""
    rows = min(CHUNK_BYTES // (4 * max(1, in_features)), CHUNK_BYTES // (4 * max(1, tokens)))
    return max(1, min(out_features, rows))


def linear32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
             ) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed in float32, rounded to ``x.dtype``."""
    x32 = _upcast(x, "input")
    tokens = x32.numel() // max(1, x32.shape[-1])
    n, k = weight.shape
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    step = rows_per_chunk(tokens, k, n)
    wbuf, obuf = _scratch("weight", step * k), _scratch("output", tokens * step)
    for i in range(0, n, step):
        rows = min(step, n - i)
        w32 = wbuf[:rows * k].view(rows, k)
        w32.copy_(weight[i:i + rows])
        o32 = obuf[:tokens * rows].view(*x.shape[:-1], rows)
        torch.matmul(x32, w32.t(), out=o32)
        if bias is not None:
            o32.add_(bias[i:i + rows].float())
        out[..., i:i + rows] = o32
    return out


def _scratch(name: str, elems: int) -> torch.Tensor:
    """This thread's float32 buffer ``name`` (a weight chunk, an output chunk, an upcast
    input: at most ``CHUNK_BYTES`` each), kept between calls. Allocated afresh, every GEMM of
    every forward would map and fault in its float32 pages again (large tensors are mmapped,
    ``fp8ptq.runtime.usage.bound_heap``): the weight and output chunks alone were most of the kernel
    time of a SmolLM2 statistics pass. Freed when the mode exits."""
    bufs = getattr(_active, "scratch", None)
    if bufs is None:
        bufs = _active.scratch = {}
    buf = bufs.get(name)
    if buf is None or buf.numel() < elems:
        bufs.pop(name, None)  # the old one goes before the larger one comes
        buf = bufs[name] = torch.empty(elems, dtype=torch.float32)
    return buf


def _upcast(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t.float()``: the same values in the same memory layout (strides), written into this
    thread's scratch buffer ``name`` when ``t`` is dense and its float32 copy fits in
    ``CHUNK_BYTES`` (a calibration micro-batch's GEMM inputs and attention operands), else a
    new tensor. The upcast inputs of every GEMM and attention of a forward would otherwise be
    mapped and faulted in afresh each time: a bf16 SmolLM2 layer upcasts ~30 MB per
    1024-token micro-batch."""
    if 4 * t.numel() > CHUNK_BYTES or t.device.type != "cpu":
        return t.float()
    # the dims from the outermost to the innermost in memory: t is dense when, permuted so,
    # it is contiguous; the scratch view then gets t's own strides (size-1 dims aside)
    order = sorted(range(t.dim()), key=t.stride, reverse=True)
    if not t.permute(order).is_contiguous():
        return t.float()
    view = _scratch(name, t.numel())[:t.numel()].view([t.shape[d] for d in order])
    return view.permute(sorted(range(t.dim()), key=order.__getitem__)).copy_(t)


def attention32(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args,
                **kwargs) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` computed in float32, rounded to ``query.dtype``
    (a floating ``attn_mask`` is upcast too; a boolean one is used as it is). Query, key and
    value are upcast into scratch buffers (``_upcast``)."""
    args = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for a in args]
    mask = kwargs.get("attn_mask")
    if isinstance(mask, torch.Tensor) and mask.is_floating_point():
        kwargs = {**kwargs, "attn_mask": mask.float()}
    out = F.scaled_dot_product_attention(_upcast(query, "query"), _upcast(key, "key"),
                                         _upcast(value, "value"), *args, **kwargs)
    return out.to(query.dtype)


def extra_bytes(tokens: int, in_features: int, out_features: int) -> int:
    """Memory ``linear32`` holds beyond the bf16 output: the float32 input, one float32 weight
    chunk and one float32 output chunk."""
    rows = rows_per_chunk(tokens, in_features, out_features)
    return 4 * (tokens * in_features + rows * in_features + tokens * rows)


class _Float32Linear(TorchFunctionMode):
    def __init__(self, force: bool | None):
        super().__init__()
        self.force = force

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0] if args else kwargs.get("input")
            w = args[1] if len(args) > 1 else kwargs.get("weight")
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if _applies(x, w, b) and wanted(x.dtype, self.force):
                return linear32(x, w, b)
        elif func is F.scaled_dot_product_attention and len(args) >= 3:
            q, k, v = args[:3]
            if _attention_applies(q, k, v, args[3:], kwargs) and wanted(q.dtype, self.force):
                return attention32(*args, **kwargs)
        return func(*args, **kwargs)


def _applies(x, w, b) -> bool:
    return (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and x.dtype in _LOW
            and w.dtype == x.dtype and x.device.type == "cpu" and w.device.type == "cpu"
            and w.dim() == 2 and (b is None or (isinstance(b, torch.Tensor)
                                                and b.dtype == x.dtype))
            and not torch.is_grad_enabled() and x.numel() > 0)  # no autograd through it


def _attention_applies(q, k, v, rest, kwargs) -> bool:
    tensors = (q, k, v)
    dropout = rest[1] if len(rest) > 1 else kwargs.get("dropout_p", 0.0)
    return (all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in tensors)
            and q.dtype in _LOW and k.dtype == q.dtype and v.dtype == q.dtype
            and not dropout and not torch.is_grad_enabled() and q.numel() > 0)


def float_dtype(module: torch.nn.Module) -> torch.dtype | None:
    """The dtype of the module's first floating-point parameter (None if it has none)."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), None)


@contextmanager
def float32_gemms(force: bool | None = None, model: torch.nn.Module | None = None):
    """Within the block, bf16 / fp16 ``F.linear`` and ``F.scaled_dot_product_attention`` on
    the CPU run in float32 where the CPU lacks a fast kernel for it (``force``: True / False
    overrides the check). ``model``: the module the block runs, when known; if its dtype is
    one that never runs in float32 here (a float32 model, or bf16 on a CPU with fast bf16), no
    mode is entered at all, sparing every torch call of the block the mode's Python dispatch
    (a measurable share of a simulated per-token forward of a float32 model). Re-entrant: an
    inner use inside an outer one adds nothing."""
    dtype = None if model is None else float_dtype(model)
    if getattr(_active, "on", False) or (dtype is not None and not wanted(dtype, force)):
        yield
        return
    _active.on = True
    try:
        with _Float32Linear(force):
            yield
    finally:
        _active.on = False
        _active.scratch = None  # the chunk buffers live as long as the mode


__all__ = ["CHUNK_BYTES", "attention32", "extra_bytes", "float32_gemms", "float_dtype",
           "linear32", "rows_per_chunk", "wanted"]
