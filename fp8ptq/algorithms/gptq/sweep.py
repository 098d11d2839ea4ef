"""GPTQ for every fp8ptq format and granularity (``--weight-calib gptq`` / ``gptq-mse``).

Frantar, Ashkboos, Hoefler, Alistarh, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers", 2022, Algorithm 1: the columns of ``W`` [out, in] are quantized one
at a time in order; the error each column's rounding leaves, divided by the pivot of the
Cholesky factor of ``H^-1`` (H = 2 X^T X of the layer's calibration inputs), is spread onto the
columns not yet quantized, so that the layer OUTPUT error ``||X W^T - X Q^T||`` is what the
rounding minimises rather than each weight's own error. Lazy batch updates (blocks of 128
columns), dampening (``--gptq-damp`` times the mean diagonal) and optional activation order
(``--gptq-act-order``: columns with the largest input energy first) are the paper's.

What is fp8ptq's own: the rounding of a column is the FORMAT's (``encode`` / ``decode`` of
e4m3, e5m2, FNUZ, HFP8, HiF8's tapered grid, generic ExMy, int8) with the recipe's rounding
mode, and the scales are chosen BEFORE the sweep by the weight calibrator (max or MSE) at the
recipe's granularity (tensor, channel or block; a column's scale is looked up per row block),
so the codes and scales are exactly what the checkpoint layouts store.
"""

from __future__ import annotations

import contextvars
import math
from contextlib import contextmanager
from typing import NamedTuple

import torch

from fp8ptq.formats import FormatSpec, decode, encode, torch_dtype
from fp8ptq.formats.binades import native_tables
from fp8ptq.runtime import native

from . import fused

BLOCK = 128


class Precision(NamedTuple):
    """The sweep's two dtypes. ``storage``: the weight copy and the inverse factor, the sweep's
    memory (weight-sized and ``in x in``) and the block-to-block error feedback (``W[i2:] -=
    U^T E``). ``loop``: each block's column loop, its copy of the block's columns, factor
    block, scales and errors (at most 128 x 128 plus 128 rows: registers on a GPU). float64 /
    float64 is the CPU default (``gptq_sweep_dtype`` auto), float32 / float32 the reference
    code's, and float32 / float64 (``mixed``) float64's rounding inside the block at float32's
    memory."""
    storage: torch.dtype
    loop: torch.dtype

    @classmethod
    def of(cls, dtype: torch.dtype | Precision) -> Precision:
        """``dtype`` as a precision: one dtype is both."""
        return dtype if isinstance(dtype, Precision) else cls(dtype, dtype)


def _inverse_cholesky(H: torch.Tensor, damp: float, order: torch.Tensor | None = None,
                      dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Upper Cholesky factor ``U`` of ``(A + damp * mean(diag A) * I)^-1`` (``U^T U`` is that
    inverse; float64 for stability), ``A`` the Hessian ``H`` with its rows and columns taken in
    ``order`` (the sweep's column order; None: as they are) and a 1 on the diagonal of inputs
    that were always zero; with more dampening if ``A`` is still not positive definite. ``H``
    is not modified.

    Computed without forming the inverse: with ``P`` the order-reversing permutation and
    ``P A P = L L^T``, ``A^-1 = (P L^-T P)(P L^-1 P)`` and ``P L^-1 P`` is upper triangular with a
    positive diagonal, so it IS the Cholesky factor (unique). One Cholesky and one triangular
    solve, against the reference code's Cholesky, ``cholesky_inverse`` and second Cholesky:
    LAPACK's ``potri`` behind ``cholesky_inverse`` scales badly with threads on a loaded CPU,
    and this path needs no inverse at all (docs/results/speed.md, "GPTQ sweep").

    Memory: at most two ``in x in`` float64 matrices at once besides ``H``: ``P A P`` is
    gathered in one step (order and reversal together), dampened on its diagonal in place and
    freed once factored; the triangular solve overwrites the identity it starts from. Written
    the plain way (a damped copy, an identity, a flipped copy, a separate solve output) it held
    five or six, which for a 70B model's 28,672-input ``down_proj`` is the difference between
    about 12 GiB (plus its 6 GiB Hessian) and over 30 GiB.

    ``dtype``: the factor's (float64 by default; float32 halves those matrices where the sums
    were float32 on a GPU, as llm-compressor factors them). A float32 factorization that fails
    at every dampening is done again in float64 before giving up."""
    n = H.shape[0]
    rev = (order if order is not None else torch.arange(n, device=H.device)).flip(0)
    base = torch.diagonal(H).to(dtype).index_select(0, rev)
    base.masked_fill_(base == 0, 1.0)  # inputs that were always zero: any weight is free there
    mean = base.mean()  # >= 1 / n: never zero after the fill above; kept on the device
    for factor in (damp, damp * 10, damp * 100, 1.0):
        F = H.detach().index_select(0, rev).to(dtype).index_select(1, rev)  # P A P
        torch.add(base, mean * factor, out=F.diagonal())
        L, info = torch.linalg.cholesky_ex(F)
        del F
        if int(info) != 0:  # one host sync per try, never per column
            continue
        U = torch.eye(n, dtype=dtype, device=H.device)
        torch.linalg.solve_triangular(L, U, upper=False, out=U)  # L^-1, in place
        del L
        U = U.flip(0, 1)
        # max |U| in one pass with no n x n bool temporary (NaN propagates, inf stays inf)
        if math.isfinite(float(torch.linalg.vector_norm(U, float("inf")))):
            return U
    if dtype != torch.float64:
        return _inverse_cholesky(H, damp, order, torch.float64)
    raise ValueError("the Hessian is not positive definite even with heavy dampening")


def gptq_codes(W: torch.Tensor, H: torch.Tensor, scale_matrix: torch.Tensor, fmt: FormatSpec,
               *, damp: float = 0.01, act_order: bool = False, block: int = BLOCK,
               rounding: str | None = None,
               sweep_dtype: torch.dtype | Precision = torch.float32) -> torch.Tensor:
    """Codes (uint8, [out, in]) of ``W`` quantized column by column with error compensation.

    ``scale_matrix`` [out, in]: the scale of every weight (the granularity's scales expanded);
    ``H`` [in, in]: sum of x x^T over the calibration rows (any positive multiple works; not
    modified). Everything runs on ``W``'s device: the Hessian (kept on the CPU by the collector,
    where host memory is cheap) and the scales are moved there, so a GPU weight is swept on the
    GPU. The Cholesky factor is float64 (float32 for float32 sums: ``factor_dtype``).
    ``sweep_dtype``: the dtype of the weight copy, the inverse factor, the scales and the
    errors, or a ``Precision`` (``Recipe.sweep_dtype_on``: float64 on the CPU, through the C
    block loop; mixed on a GPU, the Triton kernel's float64 tile). A sweep on a GPU and on a
    CPU agree on the codes except where a value sits within rounding of a code boundary and
    the two devices' GEMMs summed in another order (rare; the GPU tier bounds it)."""
    dev = W.device
    precision = Precision.of(sweep_dtype)
    hdiag, perm, U = _factor(H, damp, act_order, dev, precision.storage)
    # the one weight-sized copy the sweep updates: W TRANSPOSED (a column of W is a
    # contiguous row), its rows in the sweep's order (act-order: the columns with the largest
    # input energy first). The scales stay the caller's (an expanded view: no copy), gathered
    # one block of columns at a time.
    src = W.detach().T if perm is None else W.detach().T.index_select(0, perm)
    Wt = torch.empty(src.shape, dtype=precision.storage, device=dev).copy_(src)
    del src
    dead = hdiag == 0  # inputs that were always zero: any weight is free there
    Wt.masked_fill_((dead if perm is None else dead.index_select(0, perm)).unsqueeze(1), 0.0)
    St = scale_matrix.detach().to(dev).expand_as(W).T  # [in, out], a view
    kw = {"rounding": rounding} if rounding else {}
    with _sweep_threads(dev):
        # plain tensor math: a torch-function mode around the caller (the quantize stage's
        # float32 GEMM mode) has nothing to do here, and its Python dispatch on each of the
        # sweep's ~10 small ops per column is a measurable share of the sweep
        with torch._C.DisableTorchFunction():
            codes = _sweep(Wt, St, U, fmt, block, kw, perm, precision.loop)
    if perm is not None:
        codes = codes.index_select(1, torch.argsort(perm))
    return codes.contiguous()


def _factor(H: torch.Tensor, damp: float, act_order: bool, dev: torch.device,
            dtype: torch.dtype = torch.float32):
    """``(diag H, the sweep's column order or None, U)`` on ``dev``, U the inverse Cholesky
    factor in ``dtype`` (the sweep's: float32 unless ``gptq_sweep_dtype`` says float64); the
    same objects again for the same ``H`` inside ``shared_factors``."""
    cache = _FACTORS.get()
    # (inference tensors keep no version counter; the collectors never modify a Hessian)
    key = (id(H), 0 if H.is_inference() else H._version, damp, act_order, str(dev), dtype)
    hit = None if cache is None else cache.get(key)
    if hit is not None and hit[0] is H:
        return hit[1:]
    h = H
    # a Hessian too large for the GPU's budget (``host_factoring``) is factored where it is,
    # on the host; the inverse factor alone comes to the GPU
    H = H.detach() if factored_on_host(H.shape[0], dev) else H.detach().to(dev)
    hdiag = torch.diagonal(H).double()
    perm = torch.argsort(hdiag, descending=True) if act_order else None
    # the factor in float64 (the Cholesky of a badly conditioned Hessian needs it), but in
    # float32 where the sums are float32 (``gptq_hessian_dtype`` auto on a GPU: its memory
    # first); U in the sweep's storage dtype: float64 on the CPU by default, float32 on a GPU
    # (``gptq_sweep_dtype`` auto: mixed there, float32's memory)
    U = _inverse_cholesky(H, damp, perm, factor_dtype(H)).to(dtype).to(dev)
    got = (hdiag.to(dev), None if perm is None else perm.to(dev), U)
    if cache is not None:
        cache.clear()  # one factor kept at a time: a group's targets come in turn
        cache[key] = (h, *got)
    return got


# the factors ``shared_factors`` keeps (None: outside it)
_FACTORS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("gptq_factors",
                                                                       default=None)


@contextmanager
def shared_factors():
    """Within: ``gptq_codes`` called again with the very Hessian tensor (same object, not
    modified since) and the same dampening and order reuses its inverse Cholesky factor
    instead of factoring again: the same bits. Sequential GPTQ holds it around a group of
    GEMMs fed one input (q/k/v, gate/up), whose collector hands each the same ``H~``: 4
    factorizations per Llama block instead of 7. The one factor kept is one the sweep holds
    anyway; it is dropped on leaving."""
    token = _FACTORS.set({})
    try:
        yield
    finally:
        _FACTORS.reset(token)


# inputs of the widest Hessian a GPU factors itself (None: every one); wider ones are factored
# on the host (``host_factoring``)
_GPU_FACTOR_LIMIT: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "gptq_gpu_factor_limit", default=None)


@contextmanager
def host_factoring(limit: int | None):
    """Within: a GPU sweep whose Hessian has more than ``limit`` inputs factors it on the host
    (the collector hands it over there, ``factored_on_host``) and moves only the float32
    inverse factor to the GPU: what the one-block GPU path does for a GEMM whose Hessian,
    its copy and its factor together do not fit the GPU budget (a 405B ``down_proj``'s 53,248
    inputs: 10.6 GB for one float32 matrix). None: every Hessian on the GPU."""
    token = _GPU_FACTOR_LIMIT.set(limit)
    try:
        yield
    finally:
        _GPU_FACTOR_LIMIT.reset(token)


def factored_on_host(inputs: int, device: torch.device | str) -> bool:
    """Whether a Hessian of ``inputs`` inputs for a sweep on ``device`` is factored on the
    host (``host_factoring``)."""
    limit = _GPU_FACTOR_LIMIT.get()
    return limit is not None and inputs > limit and torch.device(device).type != "cpu"


def factor_dtype(H: torch.Tensor) -> torch.dtype:
    """The Cholesky factor's dtype: the sums' where they are float32 (``gptq_hessian_dtype``
    float32, or auto on a GPU: llm-compressor's arithmetic, half the memory), else float64."""
    return torch.float32 if H.dtype == torch.float32 else torch.float64


@contextmanager
def _sweep_threads(device: torch.device):
    """One intra-op thread for a CPU sweep (its per-column ops are tiny: threads only add sync
    cost, 15x on a loaded 2-core box, measured), the caller's count restored after; a GPU
    sweep leaves the CPU threads alone."""
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _sweep(Wt, St, U, fmt, block, kw, order, loop_dtype=None) -> torch.Tensor:
    """The column loop of Algorithm 1 with lazy block updates, on the TRANSPOSED weight ``Wt``
    [in, out] (updated in place), so each step reads, encodes and updates contiguous memory
    (several times faster on a CPU than strided columns). ``St`` [in, out]: the scales in the
    weight's own column order; ``order``: the sweep's column order (a tensor on ``Wt``'s
    device; None: as they are), applied to the scales one block at a time so that no step of
    the column loop reads a value back to the host (a GPU sweep then queues its kernels without
    a sync). ``loop_dtype``: the column loop's (None: ``Wt``'s); a wider one than ``Wt``'s
    runs each block on a copy of its columns in that dtype, and only the errors, rounded to
    ``Wt``'s dtype, leave the block (``Precision``: mixed)."""
    cols, rows = Wt.shape
    loop_dtype = loop_dtype or Wt.dtype
    codes = torch.empty(cols, rows, dtype=torch.uint8, device=Wt.device)
    kernel = fused_block(fmt, kw, Wt, block, loop_dtype)
    loop = None if kernel is not None else native_loop(fmt, kw, Wt, St, loop_dtype)
    step = None if kernel is not None or loop is not None else \
        _column_step(fmt, kw, Wt.device)
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        W1, U1 = Wt[i1:i2], U[i1:i2, i1:i2]  # W1: a view, updated in place
        S1 = St[i1:i2] if order is None else St.index_select(0, order[i1:i2])
        if loop_dtype == torch.float64:  # a float64 loop's scales, a block at a time
            S1 = S1.double()
        err = torch.empty(i2 - i1, rows, dtype=loop_dtype, device=Wt.device)
        if kernel is not None:  # the block's column loop as one kernel (``fused``)
            try:
                kernel.run(W1, U1, S1, err, codes[i1:i2])
            except fused.Unavailable:
                kernel, step = None, _column_step(fmt, kw, Wt.device)
        if kernel is None:
            if loop_dtype != Wt.dtype:  # mixed: the block's columns in the wider dtype
                W1, U1 = W1.to(loop_dtype), U1.to(loop_dtype)
            if loop is not None:
                loop(W1, U1, S1, err, codes[i1:i2])
            else:
                _column_loop(W1, U1, S1, err, codes[i1:i2], step)
        Wt[i2:].addmm_(U[i1:i2, i2:].T, err.to(Wt.dtype), alpha=-1)
    return codes.T


def _column_loop(W1, U1, S1, err, code_rows, step) -> None:
    """One block's columns in order, as torch operations: each column rounded (``step``), its
    error divided by its pivot and spread onto the block's later columns."""
    d = torch.diagonal(U1)
    for i in range(W1.shape[0]):
        w, e = W1[i], err[i]
        step(w, S1[i], code_rows[i], e)
        e.div_(d[i])
        W1[i + 1:].addr_(U1[i, i + 1:], e, alpha=-1)  # rank-1, no outer-product temporary


def native_loop(fmt: FormatSpec, kw: dict, Wt: torch.Tensor, St: torch.Tensor,
                dtype: torch.dtype | None = None):
    """``loop(W1, U1, S1, err, code_rows)``: a block's column loop as one call of the C kernel
    (``native.gptq_block``), the same bits as ``_column_loop`` with ``_column_step``'s generic
    step (tested), where it runs: a float32 CPU sweep with float32 scales ``St`` (its torch
    step divides by float64 ones in float64) or a float64 one (``fp8ptq_gptq_block64``), the C
    kernels built, an 8-bit format
    the kernels hold exactly, any rounding but stochastic (its draws are the torch path's).
    ``dtype``: the column loop's (None: ``Wt``'s; float64 over a float32 ``Wt``: mixed).
    None: the torch loop. Why: ~10 small torch ops per column, and their dispatch, were
    most of a CPU sweep's time (SmolLM2's 150,000 columns: ~28 s of a 5-minute quantize,
    docs/results/speed.md, "Main job: work removed (2026-11-28)")."""
    # (a float64 loop takes its scales to float64 block by block, exactly: any float dtype)
    dtype = dtype or Wt.dtype
    if Wt.device.type != "cpu" or dtype not in (torch.float32, torch.float64) \
            or (dtype == torch.float32 and St.dtype != torch.float32) \
            or not native.supports(Wt.new_empty(0, dtype=torch.float32)):
        return None
    rounding = kw.get("rounding") or fmt.rounding
    values = fmt.layout.values
    tables = native_tables(fmt, rounding) if rounding != "stochastic" else None
    if tables is None or values.numel() != 256:
        return None
    values = values.to(dtype).contiguous()
    scratch = torch.empty(Wt.shape[1], dtype=torch.float32)

    def loop(W1, U1, S1, err, code_rows):
        if U1.stride(1) != 1:
            U1 = U1.contiguous()
        native.gptq_block(tables, values, W1, U1, S1.contiguous(), err, code_rows, scratch)
    return loop


def fused_block(fmt: FormatSpec, kw: dict, Wt: torch.Tensor, block: int,
                loop_dtype: torch.dtype | None = None) -> fused.BlockSweep | None:
    """The one-kernel block sweep (``fused``) where it runs: a CUDA weight with Triton,
    round-half-to-even, blocks of at most 256 columns (the tile lives in registers; 128 for a
    float64 loop, whose tile takes twice the registers)."""
    loop_dtype = loop_dtype or Wt.dtype
    widest = 256 if loop_dtype == torch.float32 else 128
    if block > widest or Wt.dtype not in (torch.float32, torch.float64) \
            or loop_dtype not in (torch.float32, torch.float64) \
            or not fused.wanted(fmt, kw, Wt):
        return None
    return fused.BlockSweep(fmt, Wt.device, loop_dtype)


def _column_step(fmt: FormatSpec, kw: dict, device: torch.device):
    """``step(w, s, code_row, err_row)``: one column's codes (written into ``code_row``) and its
    rounding error ``w - decode(code) * s`` (into ``err_row``).

    The torch loop's step, for what the one-kernel block sweep (``fused``) does not take: a
    GPU without Triton, another rounding mode, a CPU. On a GPU, for a format torch has a float8
    dtype of and round-to-nearest-even, the step is the saturating cast itself: divide, clamp,
    cast, and the cast back, six small kernels and no Python in between. The sweep issues one
    step per column (155,648 columns for four 8B-shaped blocks), so on a GPU its cost is the
    launches: the generic ``encode`` / ``decode`` path (chunking, table lookups, NaN handling a
    finite column never needs) took about 0.5 ms a column there, several times what the GEMM
    work of the step costs. The codes are the same: ``encode`` takes this very cast for these
    formats (``codec._native_round``). On a CPU the C kernels behind ``encode`` / ``decode``
    are faster than either."""
    dt = torch_dtype(fmt)
    fast = (device.type != "cpu" and dt is not None and fmt.rounding == "nearest_even"
            and kw.get("rounding") in (None, "nearest_even"))
    if fast:
        m = fmt.layout.max

        def step(w, s, code_row, err_row):
            q = torch.div(w, s).clamp_(-m, m).to(dt)
            code_row.copy_(q.view(torch.uint8))
            torch.sub(w, q.to(w.dtype).mul_(s), out=err_row)
        return step

    def generic(w, s, code_row, err_row):
        c = encode((w / s).float(), fmt, **kw)
        code_row.copy_(c)
        torch.sub(w, decode(c, fmt).to(w.dtype).mul_(s), out=err_row)
    return generic


def output_error(W: torch.Tensor, Wq: torch.Tensor, X: torch.Tensor) -> float:
    """Mean squared error of the layer output on rows ``X`` [n, in]."""
    return float(((X.double() @ (W.double() - Wq.double()).T) ** 2).mean())
