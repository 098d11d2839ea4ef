"""GPTQ's column loop over one block of columns as ONE GPU kernel (Triton).

The sweep (``sweep._sweep``) quantizes the columns of a block of 128 one after the other, each
column's rounding error spread onto the block's later columns before the next is rounded. Run
as torch operations that is about ten small kernels per column: 155,648 columns for four
Llama-3-8B-shaped blocks, and on a GPU their launches, not their arithmetic, are the sweep's
cost (about 0.5 ms a column on an H200 with the generic codec, docs/results/gpu.md "On a GPU").
Here one program holds ``BLOCK_R`` output rows of the whole block in registers and runs the
128 steps itself: one launch per block instead of ~1,300. llm-compressor's GPTQ does the same
with its own Triton kernel for its FP8 and int schemes.

The rounding is the codec's own arithmetic (``codec._quantize_dense`` with round-half-to-even):
the float32 exponent field of ``|w / s|`` picks the grid spacing from the format's 256-entry
``step`` / ``inv_step`` tables (``binades``), the magnitude is scaled by a power of two (exact),
split into whole and fraction, rounded half to even, saturated at the format's max. So every
format the tables describe runs here (OCP FP8, FNUZ, HFP8, HiFloat8's tapered grid, int8), and
the values are the codec's bit for bit; the codes are then taken from those grid values with
``encode`` (exact: a grid value is its own rounding). Divisions are IEEE round-to-nearest
(``div_rn``), the error term ``w - q s`` is rounded after the product as the loop's two kernels
do (``enable_fp_fusion=False``), and the rank-one update is rounded once as ``addr_``'s fused
multiply-add is (computed in float64, where the float32 product is exact). So each step is the
torch loop's float32 arithmetic, in its order, and the codes are the loop's bit for bit (the
interpreter tests check it on every format and scale layout).

A float64 column loop (``gptq_sweep_dtype`` float64, or mixed: float32 storage) is the same
kernel with the tile in float64 (``LOOP64``): ``w / s`` in float64 (IEEE division), rounded to
float32 for the codec's arithmetic as the CPU's float64 loop does (``fp8ptq_gptq_block64``),
the error and the rank-one update in float64. There the product is not exact, so the kernel
rounds it and the difference apart (``enable_fp_fusion=False``) where the CPU loop fuses some:
the codes agree with the CPU's float64 loop except at rounding boundaries (tested).

Triton is imported only when a CUDA sweep asks for it; without it (or with
``FP8PTQ_GPTQ_TRITON=0``) the torch loop runs. Tests run the kernel on a CPU through Triton's
interpreter (``TRITON_INTERPRET=1``) against the torch loop.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings

import torch

from fp8ptq.formats import FormatSpec, encode
from fp8ptq.formats.binades import binade_tables

BLOCK_R = 32  # output rows per program: a 128 x 32 float32 tile is 32 registers a thread
BLOCK_R64 = 16  # a float64 loop's: its 128 x 16 tile the same registers


def wanted(fmt: FormatSpec, kw: dict, weight: torch.Tensor) -> bool:
    """Does the sweep of ``weight`` take the fused kernel? A plain tensor on CUDA (or on the
    CPU under Triton's interpreter, for tests), round-half-to-even, Triton importable, not
    switched off."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if weight.device.type != "cuda" and not interpret:
        return False
    if not launchable(weight):
        return False
    if os.environ.get("FP8PTQ_GPTQ_TRITON", "1") == "0" or _FAILED:
        return False
    if (kw.get("rounding") or fmt.rounding) != "nearest_even":
        return False
    return _kernel() is not None


def launchable(t: torch.Tensor) -> bool:
    """A raw kernel takes plain tensors only: a tensor subclass (a tracing mode's fake tensor,
    a distributed tensor) has no memory of its own to hand over, so it goes the torch way."""
    return type(t) is torch.Tensor


class BlockSweep:
    """``run(W1, U1, S1, err, code_rows)``: one block of the sweep: ``W1`` [width, rows] the
    block's columns of the transposed weight (read, not updated: only ``err`` leaves the
    block), ``U1`` [width, width] its part of the inverse Hessian's Cholesky factor, ``S1``
    [width, rows] the scales (any strides, broadcast views included), ``err`` [width, rows]
    filled with each column's error divided by its pivot, ``code_rows`` [width, rows] uint8
    filled with the codes. ``loop_dtype``: the column loop's arithmetic (float64: the tile in
    float64 whatever ``W1``'s and ``U1``'s dtype; ``S1`` and ``err`` then float64)."""

    def __init__(self, fmt: FormatSpec, device: torch.device,
                 loop_dtype: torch.dtype = torch.float32):
        self.fmt = fmt
        self.loop64 = loop_dtype == torch.float64
        tables = binade_tables(fmt).to(device) if fmt.is_float else None
        ones = torch.ones(256, dtype=torch.float32, device=device)
        # integer formats: spacing 1 everywhere, so the same rounding is round-half-to-even
        self.step = ones if tables is None else tables.step.float().contiguous()
        self.inv_step = ones if tables is None else tables.inv_step.float().contiguous()
        self.qmax = float(fmt.layout.max)
        self.values = None  # [width, rows] float32 grid values, reused block to block

    def run(self, W1, U1, S1, err, code_rows) -> None:
        width, rows = W1.shape
        if self.values is None or self.values.shape[1] != rows or len(self.values) < width:
            self.values = torch.empty(W1.shape, dtype=torch.float32, device=W1.device)
        values = self.values[:width]
        kernel = _kernel()
        block_r = BLOCK_R64 if self.loop64 else BLOCK_R
        grid = (-(-rows // block_r),)
        try:
            # Triton launches on the current CUDA device: a weight placed on another GPU (a
            # device map over several) is swept where it lives
            with _on(W1.device):
                kernel[grid](W1, U1, S1, values, err, self.step, self.inv_step, rows, width,
                             W1.stride(0), U1.stride(0), S1.stride(0), S1.stride(1),
                             values.stride(0), err.stride(0), self.qmax, WIDTH=_pow2(width),
                             BLOCK_R=block_r, LOOP64=self.loop64, num_warps=4,
                             enable_fp_fusion=False)
        except Exception as e:  # noqa: BLE001 - a kernel Triton cannot build here
            _FAILED.append(e)
            warnings.warn(f"GPTQ's fused Triton sweep failed to run ({type(e).__name__}: "
                          f"{str(e)[:200]}); GPTQ goes on with the torch column loop: the "
                          "same algorithm, slower", RuntimeWarning, stacklevel=2)
            raise Unavailable from e
        encode(values, self.fmt, out=code_rows)


class Unavailable(RuntimeError):
    """The kernel could not be built or launched: the sweep goes on with the torch loop (the
    block's inputs are untouched: the kernel only reads ``W1``)."""


_FAILED: list[Exception] = []  # once the kernel failed in this process, it is not tried again


def _on(device: torch.device):
    """The CUDA device context of ``device`` (nothing to enter for the interpreter's CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@functools.cache
def _kernel():
    """The Triton kernel, compiled lazily; None where Triton is not importable."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def block_sweep(w_ptr, u_ptr, s_ptr, v_ptr, e_ptr, step_ptr, inv_ptr, rows, width,
                    sw, su, ss_c, ss_r, sv, se, qmax,
                    WIDTH: tl.constexpr, BLOCK_R: tl.constexpr, LOOP64: tl.constexpr):
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.arange(0, WIDTH)
        rmask = r < rows
        tile = tl.load(w_ptr + c[:, None] * sw + r[None, :],
                       mask=(c[:, None] < width) & rmask[None, :], other=0.0)
        tile = tile.to(tl.float64) if LOOP64 else tile.to(tl.float32)
        for i in range(0, WIDTH):  # a constant trip count; columns past ``width`` are masked
            live = rmask & (i < width)
            w = tl.sum(tl.where(c[:, None] == i, tile, 0.0), axis=0)  # column i, [BLOCK_R]
            s = tl.load(s_ptr + i * ss_c + r * ss_r, mask=live, other=1.0).to(tile.dtype)
            if LOOP64:  # the codec's float32 input, rounded once from the float64 quotient
                v = (w / s).to(tl.float32)
            else:
                v = tl.div_rn(w, s)
            a = tl.minimum(tl.abs(v), qmax)  # saturate (max is on the grid: stays there)
            field = (a.to(tl.int32, bitcast=True) >> 23) & 0xFF
            y = a * tl.load(inv_ptr + field)  # exact: a power of two
            whole = tl.floor(y)
            frac = y - whole
            odd = (whole - 2.0 * tl.floor(whole * 0.5)) == 1.0
            up = (frac > 0.5) | ((frac == 0.5) & odd)
            qa = (whole + up.to(tl.float32)) * tl.load(step_ptr + field)
            q = tl.where(v.to(tl.int32, bitcast=True) < 0, -qa, qa)  # the sign, -0 included
            pivot = tl.load(u_ptr + i * su + i + r * 0, mask=live, other=1.0).to(tile.dtype)
            h = tl.load(u_ptr + i * su + c, mask=(c > i) & (c < width), other=0.0)
            tl.store(v_ptr + i * sv + r, q, mask=live)
            if LOOP64:
                e = (w - q.to(tl.float64) * s) / pivot
                tile = tile - h.to(tl.float64)[:, None] * e[None, :]
            else:
                e = tl.div_rn(w - q * s, pivot)
                # as ``addr_`` does (a fused multiply-add: one rounding), the same in Triton's
                # interpreter, whose ``fma`` rounds twice: the float32 product is exact in
                # float64
                tile = (tile.to(tl.float64) - h[:, None].to(tl.float64)
                        * e[None, :].to(tl.float64)).to(tl.float32)
            tl.store(e_ptr + i * se + r, e.to(e_ptr.dtype.element_ty), mask=live)

    return block_sweep
