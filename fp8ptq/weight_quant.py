"""Round-to-nearest weight quantization in one sweep over cache-sized row chunks.

Every weight rounded to nearest - a ``QuantGemm``'s, each fused expert's, and the model-free
path's (``fp8ptq.model_free``) - goes through ``quantize_weight``: after the calibrator has
chosen the scale on the whole matrix (a calibrator may need all of it, e.g. MSE), one walk over
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

from .errors import NumericsError
from .formats import FormatSpec, decode, encode, torch_dtype
from .scales import amax_to_scale

# Elements per chunk: float32 temporaries of this size stay in L2 (512 KiB)
CHUNK_ELEMENTS = 1 << 17


@dataclass
class QuantizedWeight:
    codes: torch.Tensor  # uint8 [out, in]
    scale: torch.Tensor  # float32, the granularity's scale shape
    amax: float  # max |w|
    sqnr_db: float  # 10 log10(sum w^2 / sum (w - dequantized)^2); inf when exact


def choose_scale(w2d: torch.Tensor, fmt: FormatSpec, gran, w_calib, *, pow2: bool = False,
                 what: str = "weight", warnings: list[str] | None = None) -> torch.Tensor:
    """The weight scale the calibrator's clip range gives (finite, > 0; ``fp8ptq.scales``)."""
    return amax_to_scale(w_calib.amax(w2d, gran, fmt), fmt, pow2=pow2, what=what,
                         warnings=warnings)


def quantize_weight(w2d: torch.Tensor, scale: torch.Tensor, fmt: FormatSpec, gran, *,
                    rounding: str | None = None, name: str = "weight") -> QuantizedWeight:
    """Codes of the ``[out, in]`` matrix ``w2d`` (any float dtype) with ``scale`` (the shape
    ``gran`` gives), plus its amax and SQNR. NaN / inf anywhere is a ``NumericsError``."""
    rows, cols = w2d.shape
    codes = torch.empty((rows, cols), dtype=torch.uint8, device=w2d.device)
    kw = {"rounding": rounding} if rounding else {}
    step = gran.row_step
    chunk = max(step, (CHUNK_ELEMENTS // max(cols, 1)) // step * step)
    if (rounding or fmt.rounding) == "stochastic":  # one random stream, as one encode call
        chunk = max(rows, 1)
    signal = noise = 0.0
    amax = 0.0
    native = torch_dtype(fmt)  # decode by torch's own float8 cast where it has the format
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        x = w2d[start:stop].float()
        flat = x.reshape(-1)
        top = float(flat.abs().max()) if flat.numel() else 0.0
        if not math.isfinite(top):  # max propagates NaN
            raise NumericsError(f"weight of {name} contains NaN or inf; refusing to quantize it")
        amax = max(amax, top)
        s = gran.expand(gran.rows(scale, start, stop), x)
        c = encode(x / s, fmt, **kw)
        codes[start:stop] = c
        deq = c.view(native).float() if native is not None else decode(c, fmt)
        d = x - deq.mul_(s)
        noise += _sum_squares(d)
        signal += _sum_squares(x)
    if noise == 0:
        sqnr = math.inf
    else:
        sqnr = 10 * math.log10(signal / noise) if signal > 0 else -math.inf
    return QuantizedWeight(codes, scale, amax, sqnr)


def _sum_squares(x: torch.Tensor) -> float:
    """Sum of squares, the same whatever the number of threads: each row is reduced by one
    thread (float64 accumulation), then the few row sums in order."""
    return float(x.square().sum(dim=1, dtype=torch.float64).sum()) if x.numel() else 0.0


__all__ = ["QuantizedWeight", "choose_scale", "quantize_weight", "CHUNK_ELEMENTS"]
