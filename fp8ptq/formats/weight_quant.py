"""Round-to-nearest weight quantization in one sweep over cache-sized row chunks.

Every weight rounded to nearest - a ``QuantGemm``'s, each fused expert's, and the model-free
path's (``fp8ptq.execution.model_free``) - goes through ``quantize_weight``: after the calibrator
has chosen the scale on the whole matrix (a calibrator may need all of it, e.g. MSE), one walk over
chunks of rows does the finiteness check, the encoding, the decoding and the error sums that the
report needs (SQNR, amax). Whole-matrix code made a dozen float32 / float64 temporaries the size
of the weight, each a trip through main memory; here they stay in cache. The codes are the same
bit for bit (every step is elementwise); the SQNR sums are float64 over float32 chunk sums.

The model-free path is bandwidth-bound: this sweep is what lets quantizing keep up with reading
and writing the checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import NumericsError
from ..runtime import native
from . import FormatSpec, decode, encode
from .binades import native_tables
from .codec import chunk_elements
from .scales import amax_to_scale

# Elements per chunk: float32 temporaries of this size stay in L2 (512 KiB)
CHUNK_ELEMENTS = 1 << 17
# Elements per chunk of ``by_rows`` (decoding / re-encoding a ``QuantGemm``'s whole weight):
# each chunk runs several torch ops, and on a busy machine every op's fork-join over the
# intra-op threads costs milliseconds whatever its size, so chunks are large: 17 per
# 13824 x 5120 weight at 2^22 elements instead of 553 at 2^17, an order of magnitude faster
# under load. Temporaries: int64 indices and two float32 copies of one chunk.
BY_ROWS_ELEMENTS = 1 << 22


@dataclass
class QuantizedWeight:
    codes: torch.Tensor  # uint8 [out, in]
    scale: torch.Tensor  # float32, the granularity's scale shape
    amax: float  # max |w|
    sqnr_db: float  # 10 log10(sum w^2 / sum (w - dequantized)^2); inf when exact


def choose_scale(w2d: torch.Tensor, fmt: FormatSpec, gran, w_calib, *, pow2: bool = False,
                 what: str = "weight", warnings: list[str] | None = None,
                 hessian: torch.Tensor | None = None) -> torch.Tensor:
    """The weight scale the calibrator's clip range gives (finite, > 0; ``fp8ptq.formats.scales``).
    ``hessian`` [in, in]: the layer inputs' GPTQ Hessian (or only its diagonal, [in]), whose
    diagonal (the input energies) a Hessian-aware calibrator (``uses_hessian``: ``hmse``)
    weights the rounding error by."""
    if getattr(w_calib, "uses_hessian", False):
        hdiag = hessian if hessian is None or hessian.dim() == 1 else torch.diagonal(hessian)
        amax = w_calib.amax(w2d, gran, fmt, hdiag)
    else:
        amax = w_calib.amax(w2d, gran, fmt)
    return amax_to_scale(amax, fmt, pow2=pow2, what=what, warnings=warnings)


def quantize_weight(w2d: torch.Tensor, scale: torch.Tensor, fmt: FormatSpec, gran, *,
                    rounding: str | None = None, name: str = "weight") -> QuantizedWeight:
    """Codes of the ``[out, in]`` matrix ``w2d`` (any float dtype) with ``scale`` (the shape
    ``gran`` gives), plus its amax and SQNR. NaN / inf anywhere is a ``NumericsError``."""
    swept = _native_sweep(w2d, scale, fmt, gran, rounding, name)
    if swept is not None:
        return swept
    rows, cols = w2d.shape
    codes = torch.empty((rows, cols), dtype=torch.uint8, device=w2d.device)
    kw = {"rounding": rounding} if rounding else {}
    # stochastic rounding: one random stream, as one encode call
    whole = (rounding or fmt.rounding) == "stochastic"
    signal = noise = 0.0
    amax = 0.0
    dequantize = _decoder(fmt)
    for start, stop in row_chunks(rows, cols, gran, whole=whole, device=w2d.device):
        x = w2d[start:stop].float()
        flat = x.reshape(-1)
        top = float(flat.abs().max()) if flat.numel() else 0.0
        if not math.isfinite(top):  # max propagates NaN
            raise NumericsError(f"weight of {name} contains NaN or inf; refusing to quantize it")
        amax = max(amax, top)
        s = gran.expand(gran.rows(scale, start, stop), x)
        c = encode(x / s, fmt, **kw)
        codes[start:stop] = c
        d = x - dequantize(c).mul_(s)
        noise += _sum_squares(d)
        signal += _sum_squares(x)
    return QuantizedWeight(codes, scale, amax, _sqnr(signal, noise))


def _sqnr(signal: float, noise: float) -> float:
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


def _native_sweep(w2d, scale, fmt, gran, rounding, name) -> QuantizedWeight | None:
    """``quantize_weight`` by the C kernel (``fp8ptq.runtime.native.weight_sweep``: one pass reading
    the weight once, instead of a memory trip per op of the chunked torch sweep): per-tensor or
    per-channel float32 scales, round-half-even / half-away, a float32 or bfloat16 weight.
    Same codes bit for bit; the same SQNR terms summed in another order. None: not here."""
    rounding = rounding or fmt.rounding
    per_row = gran.name == "channel"
    if not (per_row or gran.name == "tensor") or scale.dtype != torch.float32 or \
            rounding not in ("nearest_even", "half_away") or not native.supports(w2d) or \
            w2d.dtype not in (torch.float32, torch.bfloat16) or w2d.dim() != 2 or \
            scale.numel() != (w2d.shape[0] if per_row else 1):
        return None
    tables = native_tables(fmt, rounding)
    if tables is None:
        return None
    out = native.weight_sweep(tables, w2d.contiguous(), scale.contiguous(), per_row)
    if out is None:
        return None
    codes, signal, noise, amax, nonfinite = out
    if nonfinite:
        raise NumericsError(f"weight of {name} contains NaN or inf; refusing to quantize it")
    top = float(amax.max()) if amax.numel() else 0.0
    return QuantizedWeight(codes, scale, top, _sqnr(float(signal.sum()), float(noise.sum())))


def row_chunks(rows: int, cols: int, gran, *, whole: bool = False,
               elements: int = CHUNK_ELEMENTS,
               device: torch.device | None = None) -> list[tuple[int, int]]:
    """``(start, stop)`` row ranges of chunks of about ``elements`` (default: cache-sized) of a
    ``[rows, cols]`` weight, each starting at a multiple of the granularity's ``row_step`` (so
    ``gran.rows`` gives its scales); one range with ``whole``. On a GPU ``device``, chunks of
    ``chunk_elements`` (launches, not cache, are what a chunk costs there)."""
    if device is not None:
        elements = chunk_elements(device, elements)
    step = gran.row_step
    chunk = max(rows, 1) if whole else max(step, (elements // max(cols, 1)) // step * step)
    return [(start, min(rows, start + chunk)) for start in range(0, rows, chunk)]


def by_rows(src: torch.Tensor, scale: torch.Tensor, gran, fn, dtype: torch.dtype, *,
            whole: bool = False) -> torch.Tensor:
    """``fn(rows, their scale expanded to them)`` over the row chunks of the 2-D ``src``, into a
    new ``dtype`` tensor: elementwise work on a whole weight (decoding codes, re-encoding
    values) with chunk-sized temporaries (``BY_ROWS_ELEMENTS``) instead of float32 copies of
    the whole matrix (several times the weight's own bf16 bytes). The
    same values as the whole-matrix expression, element for element. ``whole``: ``fn`` makes
    no temporaries (a C kernel), so it runs once on all of ``src`` and its result is returned
    as is."""
    if whole:
        return fn(src, gran.expand(scale, src))
    out = torch.empty(src.shape, dtype=dtype, device=src.device)
    for start, stop in row_chunks(*src.shape, gran, elements=BY_ROWS_ELEMENTS,
                                  device=src.device):
        part = src[start:stop]
        out[start:stop] = fn(part, gran.expand(gran.rows(scale, start, stop), part))
    return out


_HALF: dict[str, tuple[int, float] | None] = {}


def half_layout(fmt: FormatSpec) -> tuple[int, float] | None:
    """``(shift, factor)`` when every finite value of the 8-bit float format ``fmt`` is the
    float16 whose bits are ``sign << 15 | magnitude << shift``, times ``factor`` (a power of
    two): true of e4m3 (7, 2^8), e5m2 (8, 1), e4m3fnuz (7, 2^7) and small IEEE-like ExMy formats,
    whose exponent and mantissa fields sit inside float16's and whose subnormals are float16
    subnormals too. Found by trying
    the shifts and verified on all 256 codes against the format's own table, so a format it does
    not hold for (HiF8, HFP8, e5m2fnuz, int8) gets None, never a wrong value."""
    if fmt.name in _HALF:
        return _HALF[fmt.name]
    found = None
    if fmt.bits == 8 and fmt.is_float:
        codes = torch.arange(256, dtype=torch.int16)
        table = decode(codes.to(torch.uint8), fmt)
        finite = torch.isfinite(table)
        nonzero = finite & (table != 0)
        for shift in range(9):
            half = (((codes & 0x80) << 8) | ((codes & 0x7F) << shift)).view(torch.float16).float()
            if not bool((half[nonzero] != 0).all()):
                continue
            factor = float(table[nonzero][0] / half[nonzero][0])
            if factor > 0 and math.log2(factor).is_integer() and \
                    torch.equal(half[finite] * factor, table[finite]):
                found = (shift, factor)
                break
    _HALF[fmt.name] = found
    return found


def _decoder(fmt: FormatSpec):
    """Codes -> float32 values for the SQNR sums: through float16 bits where ``half_layout``
    holds (a few integer ops and the hardware half -> float conversion: much faster on CPU than
    torch's float8 -> float32 cast, and the same values), else the format's table."""
    layout = half_layout(fmt)
    if layout is None:
        return lambda c: decode(c, fmt)
    shift, factor = layout

    def dequantize(c: torch.Tensor) -> torch.Tensor:
        i = c.to(torch.int16)
        half = ((i & 0x80) << 8) | ((i & 0x7F) << shift)
        return half.view(torch.float16).float().mul_(factor)

    return dequantize


def _sum_squares(x: torch.Tensor) -> float:
    """Sum of squares, the same whatever the number of threads: each row is reduced by one
    thread (float64 accumulation), then the few row sums in order."""
    return float(x.square().sum(dim=1, dtype=torch.float64).sum()) if x.numel() else 0.0


__all__ = ["QuantizedWeight", "by_rows", "choose_scale", "half_layout", "quantize_weight",
           "row_chunks", "BY_ROWS_ELEMENTS", "CHUNK_ELEMENTS"]
