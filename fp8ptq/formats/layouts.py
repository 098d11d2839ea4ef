"""Code <-> value layouts of the encoding families, derived from a ``FormatSpec``.

A ``Layout`` holds the decoded value of every code and the rounding grid: for each binade
``2^e <= |x| < 2^(e+1)`` between ``e_lo`` and ``e_hi`` the log2 of the spacing of representable
values. One grid-based quantizer (``codec.quantize_values``) then serves every float format:
IEEE-style subnormals are binade ``e_lo`` with the normal spacing, flush-to-zero is a lowest binade
whose spacing is the smallest normal, and HiFloat8's tapered precision is a spacing per binade.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import _disable_current_modes


@dataclass(frozen=True)
class Layout:
    values: torch.Tensor  # float64 [num_codes]: decoded value of each code (nan / +-inf included)
    max: float
    min_normal: float
    min_positive: float
    has_inf: bool
    has_nan: bool
    has_negative_zero: bool
    nan_code: int | None
    inf_code: int | None  # code of +inf; -inf is inf_code | sign_bit
    sign_bit: int
    e_lo: int
    e_hi: int
    step_log2: torch.Tensor  # int32 [e_hi - e_lo + 1]: log2 of the grid spacing in binade e
    magnitudes: torch.Tensor  # float32, ascending: every non-negative finite value
    magnitude_codes: torch.Tensor  # int64: the code of each of ``magnitudes``


def plain_tensors(fn):
    """``fn`` run outside inference mode: its tensors are cached for the process (a format's
    tables), and one made first inside ``torch.inference_mode()`` (a calibration forward) would
    be an inference tensor, which autograd and tracing modes (``FakeTensorMode``) refuse to
    take afterwards."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.inference_mode(False):
            return fn(*args, **kwargs)
    return wrapper


def table_builder(fn):
    """``plain_tensors`` for a function that BUILDS a process-wide table from a format's
    numbers, also outside any tensor-dispatch mode: a table built first inside a tracing mode
    (``FakeTensorMode``: a fake device's sweep, torch.compile's tracing) would otherwise be that
    mode's fake tensor, with no values, and stay cached for the process."""
    inner = plain_tensors(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _disable_current_modes():
            return inner(*args, **kwargs)
    return wrapper


@table_builder
def build_layout(spec) -> Layout:
    if spec.specials == "int":
        return _int_layout(spec)
    if spec.specials == "hif8":
        return _finish(spec, _hif8_values(), e_lo=-22, e_hi=15, step_log2=_hif8_steps(),
                       min_normal=2.0**-15)
    return _ieee_like_layout(spec)


def _ieee_like_layout(spec) -> Layout:
    E, M, bias = spec.exponent_bits, spec.mantissa_bits, spec.bias
    e_min = 1 - bias
    values = []
    for code in range(spec.num_codes):
        sign = -1.0 if code >> (E + M) else 1.0
        ef, mf = (code >> M) & ((1 << E) - 1), code & ((1 << M) - 1)
        if ef == 0:
            magnitude = math.ldexp(mf, e_min - M) if spec.subnormals else 0.0
        else:
            magnitude = math.ldexp(1.0 + mf / (1 << M), ef - bias)
        all_ones = ef == (1 << E) - 1
        if spec.specials == "ieee" and all_ones:
            magnitude = math.inf if mf == 0 else math.nan
        elif spec.specials == "fn" and all_ones and mf == (1 << M) - 1:
            magnitude = math.nan
        values.append(sign * magnitude)
    if spec.specials == "fnuz":
        values = [0.0 if v == 0 else v for v in values]  # no -0 (flushed codes included)
        values[1 << (E + M)] = math.nan  # the "-0" pattern is the only NaN
    finite_max = max(abs(v) for v in values if math.isfinite(v))
    e_hi = math.floor(math.log2(finite_max))
    if spec.subnormals:
        e_lo, steps = e_min, [e - M for e in range(e_min, e_hi + 1)]
    else:  # flush to zero: below the smallest normal the only neighbours are 0 and 2^e_min
        e_lo, steps = e_min - 1, [e_min] + [e - M for e in range(e_min, e_hi + 1)]
    quiet_nan = ((1 << E) - 1) << M | (1 << max(M - 1, 0))  # what ml_dtypes/torch write for NaN
    return _finish(spec, values, e_lo=e_lo, e_hi=e_hi, step_log2=steps, min_normal=2.0**e_min,
                   nan_code=quiet_nan if spec.specials == "ieee" and M > 0 else None)


def _hif8_values() -> list[float]:
    """Luo et al. 2024 Tables 1-3: sign | dot (prefix code) | exponent (sign-magnitude,
    implicit 1) | mantissa."""
    values = []
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        r = code & 0x7F
        if r >> 5 == 0b11:  # D=4: 4 exponent bits, 1 mantissa bit, |E| in [8, 15]
            em, width, mant, mbits = (r >> 1) & 0xF, 4, r & 0x1, 1
        elif r >> 5 == 0b10:  # D=3: |E| in [4, 7], 2 mantissa bits
            em, width, mant, mbits = (r >> 2) & 0x7, 3, r & 0x3, 2
        elif r >> 5 == 0b01:  # D=2: |E| in [2, 3], 3 mantissa bits
            em, width, mant, mbits = (r >> 3) & 0x3, 2, r & 0x7, 3
        elif r >> 4 == 0b001:  # D=1: |E| = 1
            em, width, mant, mbits = (r >> 3) & 0x1, 1, r & 0x7, 3
        elif r >> 3 == 0b0001:  # D=0: E = 0
            em, width, mant, mbits = 0, 0, r & 0x7, 3
        else:  # dot 0000: denormal 2^(M-23); M=0 is zero (sign 0) or NaN (sign 1)
            m = r & 0x7
            values.append((math.nan if sign < 0 else 0.0) if m == 0 else sign * 2.0 ** (m - 23))
            continue
        if width == 0:
            exponent = 0
        else:
            exp_sign = -1 if em >> (width - 1) else 1
            magnitude_bits = em & ((1 << (width - 1)) - 1)
            exponent = exp_sign * ((1 << (width - 1)) | magnitude_bits)
        value = math.ldexp(1.0 + mant / (1 << mbits), exponent)
        if exponent == 15 and mant == 1:  # 2^15 x 1.5 is reserved for +-inf
            value = math.inf
        values.append(sign * value)
    return values


def _hif8_mantissa_bits(e: int) -> int:
    if e <= -16:
        return 0  # denormals: one value per binade
    return 3 if abs(e) <= 3 else 2 if abs(e) <= 7 else 1


def _hif8_steps() -> list[int]:
    return [e - _hif8_mantissa_bits(e) for e in range(-22, 16)]


def _finish(spec, values, *, e_lo, e_hi, step_log2, min_normal, nan_code=None) -> Layout:
    vals = torch.tensor(values, dtype=torch.float64)
    sign_bit = 1 << (spec.bits - 1)
    nonneg = [(v, c) for c, v in enumerate(values) if math.isfinite(v) and v >= 0 and not (
        v == 0 and math.copysign(1.0, v) < 0)]
    nonneg.sort()
    # one code per magnitude (flush-to-zero formats have several codes that decode to 0)
    seen, mags, codes = set(), [], []
    for v, c in nonneg:
        if v not in seen:
            seen.add(v), mags.append(v), codes.append(c)
    nan_codes = [c for c, v in enumerate(values) if math.isnan(v)]
    inf_codes = [c for c, v in enumerate(values) if v == math.inf]
    return Layout(
        values=vals,
        max=mags[-1],
        min_normal=min_normal,
        min_positive=mags[1],
        has_inf=bool(inf_codes),
        has_nan=bool(nan_codes),
        has_negative_zero=any(v == 0 and math.copysign(1.0, v) < 0 for v in values),
        nan_code=nan_code if nan_code is not None else (
            min(nan_codes, key=lambda c: (c & sign_bit, -c)) if nan_codes else None),
        inf_code=inf_codes[0] if inf_codes else None,
        sign_bit=sign_bit,
        e_lo=e_lo,
        e_hi=e_hi,
        step_log2=torch.tensor(step_log2, dtype=torch.int32),
        magnitudes=torch.tensor(mags, dtype=torch.float32),
        magnitude_codes=torch.tensor(codes, dtype=torch.int64),
    )


def _int_layout(spec) -> Layout:
    qmax = (1 << (spec.bits - 1)) - 1
    values = torch.tensor([c - (1 << spec.bits) if c & (1 << (spec.bits - 1)) else c
                           for c in range(spec.num_codes)], dtype=torch.float64)
    mags = torch.arange(qmax + 1, dtype=torch.float32)
    return Layout(values=values, max=float(qmax), min_normal=1.0, min_positive=1.0,
                  has_inf=False, has_nan=False, has_negative_zero=False, nan_code=None,
                  inf_code=None, sign_bit=1 << (spec.bits - 1), e_lo=0, e_hi=0,
                  step_log2=torch.zeros(1, dtype=torch.int32), magnitudes=mags,
                  magnitude_codes=torch.arange(qmax + 1))
