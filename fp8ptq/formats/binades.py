"""Per-exponent tables that let the codecs round and encode with integer ops on float32 bits.

A float32's biased exponent field (bits 23..30) names its binade. For every one of the 256
possible fields these tables hold what the format does in that binade: the grid spacing (as
the power of two and its inverse), the smallest grid magnitude of the binade and its rank among
all non-negative magnitudes. Rounding is then ``floor(|x| * 2^-step)`` plus a rounding decision,
and encoding a grid value is ``magnitude_codes[first_rank + (|q| - first) * 2^-step]`` -- one
gather on a small table instead of a binary search over the whole grid (which was the slow
path for HiFloat8 and generic ExMy). Binades outside ``[e_lo, e_hi]`` take the nearest end's entry,
exactly like the ``clamp`` of the frexp-based reference.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from functools import cache

import torch

from ..runtime import native
from .layouts import table_builder


@dataclass(frozen=True)
class BinadeTables:
    step: torch.Tensor  # float32 [256]: 2^step_log2 of the binade
    inv_step: torch.Tensor  # float32 [256]: 2^-step_log2
    first: torch.Tensor  # float32 [256]: smallest grid magnitude in the binade (0 for the lowest)
    first_rank: torch.Tensor  # float32 [256]: its index in ``layout.magnitudes``
    codes: torch.Tensor  # int64: ``layout.magnitude_codes``

    def to(self, device) -> BinadeTables:
        device = torch.device(device)
        if self.step.device == device:
            return self
        return BinadeTables(*(t.to(device) for t in (self.step, self.inv_step, self.first,
                                                     self.first_rank, self.codes)))


def _per_field(lay) -> list[tuple[int, float, int]]:
    """For each float32 exponent field 0..255: (log2 of the grid spacing, smallest grid
    magnitude, its rank among the non-negative magnitudes) of the clamped binade."""
    steps = lay.step_log2.tolist()
    mags = lay.magnitudes.double()
    out = []
    for field in range(256):
        e = min(max(field - 127, lay.e_lo), lay.e_hi)
        lo = 0.0 if e == lay.e_lo else 2.0 ** e
        r = int(torch.searchsorted(mags, torch.tensor([lo], dtype=torch.float64)))
        out.append((steps[e - lay.e_lo], lo, r))
    return out


@cache
@table_builder
def binade_tables(spec) -> BinadeTables:
    lay = spec.layout
    step, inv, first, rank = [], [], [], []
    for s, lo, r in _per_field(lay):
        step.append(2.0 ** s), inv.append(2.0 ** -s), first.append(lo), rank.append(float(r))
    f32 = dict(dtype=torch.float32)
    return BinadeTables(torch.tensor(step, **f32), torch.tensor(inv, **f32),
                        torch.tensor(first, **f32), torch.tensor(rank, **f32),
                        lay.magnitude_codes.clone())


def exponent_field(a: torch.Tensor) -> torch.Tensor:
    """The biased exponent field (0..255) of float32 ``a`` as int64 indices (for gathers)."""
    return ((a.view(torch.int32) >> 23) & 0xFF).long()


@cache
@table_builder
def native_tables(spec, rounding: str, saturate: bool = True,
                  nan_to_zero: bool = False) -> native.FormatTables | None:
    """``spec`` as the C kernels' integer tables (``fp8ptq.runtime.native``), or None where they
    cannot hold it exactly (a spacing whose power of two is not a normal float32; an integer format
    rounded other than half-to-even), in which case the torch path runs."""
    lay = spec.layout
    t = native.FormatTables()
    t.rounding = native.ROUNDING[rounding]
    t.nan_to_zero = int(nan_to_zero)
    t.sign_bit = lay.sign_bit
    t.code_mask = spec.num_codes - 1
    if not spec.is_float:
        if rounding != "nearest_even":
            return None
        t.is_int, t.int_max, t.max = 1, lay.max, lay.max
        return t
    for field, (s, lo, r) in enumerate(_per_field(lay)):
        if not -126 <= s <= 126:  # 2^s and 2^-s built from exponent bits in the kernels
            return None
        t.step_log2[field], t.first_rank[field] = s, r
        t.first_bits[field] = torch.tensor(lo, dtype=torch.float32).view(torch.int32).item()
    for rank, code in enumerate(lay.magnitude_codes.tolist()):
        t.codes[rank] = code
    _linear_description(spec, t)
    if not t.lin_codes:
        _packed_codes(lay, t)
    if not t.linear:
        _taper_description(lay, t)
    t.max = lay.max
    t.overflow = lay.max if saturate else (float("inf") if lay.has_inf else float("nan"))
    t.negzero = int(lay.has_negative_zero)
    t.has_inf, t.has_nan = int(lay.has_inf), int(lay.has_nan)
    t.inf_code = lay.inf_code if lay.has_inf else 0
    t.nan_code = lay.nan_code if lay.has_nan else 0
    if not t.linear and not nan_to_zero and rounding in ("nearest_even", "half_away"):
        _code_lut(lay, t, sticky=rounding == "nearest_even")
    return t


LUT_MAX_ENTRIES = 1 << 14  # 16 KB: the table stays in the L1 cache beside the data streams


def _bits_as_float(bits: torch.Tensor) -> torch.Tensor:
    """int64 tensor of 32-bit patterns -> the float32 values with those bits."""
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(
        torch.float32)


def _code_lut(lay, t, sticky: bool) -> None:
    """Fill ``t.code_lut`` (csrc/common.h's ``fmt_t``: encode by one byte load per value) for
    a format whose codes the kernels otherwise compute with per-binade lookups (HiFloat8), when
    the table fits ``LUT_MAX_ENTRIES``.

    Rounding to the nearest grid point is decided by the bits down to the first one the widest
    binade drops (half away), plus whether any lower bit is set (half even: the tie), so one
    code per such key holds for every value with it. The table is filled from the kernels' own
    arithmetic path, and for each key its smallest and largest member must get the same code:
    the quantized magnitude is monotone in |x| and codes are one-to-one on magnitudes, so then
    every member does (NaN, the one exception, is blended in by the kernel)."""
    # the widest binade's kept mantissa bits (outside the binades: saturated, or coarser)
    width = max(f - 127 - t.step_log2[f] for f in range(lay.e_lo + 127, lay.e_hi + 128))
    shift = 22 - width  # keep sign, exponent, ``width`` mantissa bits and the first dropped
    entries = 1 << (32 - shift + sticky)
    if shift < 1 or entries > LUT_MAX_ENTRIES:
        return
    top = torch.arange(1 << (32 - shift), dtype=torch.int64) << shift
    low = (1 << shift) - 1
    if sticky:  # key = top << 1 | (any lower bit): [top, top] and [top + 1, top + low]
        first = torch.stack([top, top + 1], 1).flatten()
        last = torch.stack([top, top + low], 1).flatten()
    else:
        first, last = top, top + low
    first, last = _bits_as_float(first), _bits_as_float(last)
    lo = native.quantize(t, first, native.OUT_CODES)
    hi = native.quantize(t, last, native.OUT_CODES)
    # a key whose largest member is NaN holds +-inf (its only non-NaN member) or only NaNs
    if not bool(((lo == hi) | torch.isnan(last)).all()):
        return
    nans = _bits_as_float(torch.tensor([0x7FC00000, 0x7F800001, 0x7FFFFFFF]))
    nan_codes = native.quantize(t, torch.cat([nans, -nans]), native.OUT_CODES).tolist()
    if len(set(nan_codes[:3])) != 1 or len(set(nan_codes[3:])) != 1:
        return
    table = (ctypes.c_uint8 * entries).from_buffer_copy(lo.numpy().tobytes())
    t._code_lut_buffer = table  # alive as long as ``t`` (native_tables caches both)
    t.code_lut = ctypes.addressof(table)
    t.lut_shift, t.lut_sticky = shift, int(sticky)
    t.lut_nan[0], t.lut_nan[1] = nan_codes[0], nan_codes[3]


def _taper_description(lay, t) -> None:
    """Fill ``t``'s arithmetic description of a symmetric tapered grid (see csrc/common.h's
    ``fmt_t``) where it reproduces ``step_log2`` for every field: the mantissa width at
    exponent E (clamped to the layout's binades) is the width at 0 less one per threshold
    reached by |E|."""
    widths = [e - s for e, s in zip(range(lay.e_lo, lay.e_hi + 1), lay.step_log2.tolist())]
    w0 = max(widths)
    # each threshold: the smallest |E| at which the width has dropped by one more step
    thresholds = [min((abs(e) for e, w in zip(range(lay.e_lo, lay.e_hi + 1), widths)
                       if w0 - w >= k), default=None) for k in range(1, w0 + 1)]
    if None in thresholds or len(thresholds) > 4:
        return
    thresholds += [1 << 20] * (4 - len(thresholds))

    def step(field: int) -> int:
        e = min(max(field - 127, lay.e_lo), lay.e_hi)
        return e - (w0 - sum(abs(e) >= th for th in thresholds))

    if any(step(f) != t.step_log2[f] for f in range(256)):
        return
    t.tapered, t.taper_lo, t.taper_hi, t.taper_w0 = 1, lay.e_lo, lay.e_hi, w0
    for k, th in enumerate(thresholds):
        t.taper_t[k] = th


def _packed_codes(lay, t) -> None:
    """Fill ``t.code_pack`` (see csrc/common.h's ``fmt_t``) where codes run consecutively within
    each binade: the code of a grid magnitude with float32 exponent field f and significand M
    (implicit bit included) is then ``base[f] + (M >> shift[f])``, with ``shift = 23 + step - e``
    (M >> shift counts grid steps from 0) and ``base = code of the binade's first magnitude -
    first / 2^step``. Kept only if that formula gives every magnitude's code."""
    pack = []
    for field in range(256):
        e = max(field, 1) - 127  # field 0 (float32 subnormals): M carries no implicit bit
        shift = min(23 + t.step_log2[field] - e, 31)  # >= 24 gives 0 steps, as 31 does
        first = t.first_bits[field]
        steps_to_first = torch.tensor(first, dtype=torch.int32).view(torch.float32).item() * \
            2.0 ** -t.step_log2[field]
        base = t.codes[t.first_rank[field]] - int(steps_to_first) if \
            t.first_rank[field] < lay.magnitudes.numel() else 0
        if not 0 <= shift <= 31 or not -256 <= base < 768 or steps_to_first != int(steps_to_first):
            pack.append(None)
            continue
        pack.append(((base + 256) << 5) | shift)
    for bits, code in zip(lay.magnitudes.view(torch.int32).tolist(),
                          lay.magnitude_codes.tolist()):
        field = bits >> 23
        p = pack[field]
        m = (bits & 0x7FFFFF) | (0x800000 if field else 0)
        if p is None or (p >> 5) - 256 + (m >> (p & 31)) != code:
            return
    t.packed = 1
    for field, p in enumerate(pack):
        t.code_pack[field] = 0 if p is None else p


def _linear_description(spec, t) -> None:
    """Fill ``t``'s arithmetic description of an IEEE-like grid where it reproduces the tables
    exactly (every preset but HiFloat8): the kernels then skip the lookups."""
    lay, m = spec.layout, spec.mantissa_bits
    lo = round(math.log2(lay.min_normal))
    slo = t.step_log2[0]
    if any(t.step_log2[f] != (slo if f - 127 < lo else min(f - 127, lay.e_hi) - m)
           for f in range(256)):
        return
    t.linear, t.lin_lo, t.lin_slo, t.lin_hi, t.mbits = 1, lo, slo, lay.e_hi, m
    off = (127 - spec.bias) << m
    mags = lay.magnitudes.tolist()
    bits = lay.magnitudes.view(torch.int32).tolist()
    want = lay.magnitude_codes.tolist()
    got = [(b >> (23 - m)) - off if v >= 2.0 ** lo else int(v * 2.0 ** (m - lo))
           for v, b in zip(mags, bits)]
    if got == want:
        t.lin_codes, t.lin_code_off = 1, off
