"""Per-exponent tables that let the codecs round and encode with integer ops on float32 bits.

A float32's biased exponent field (bits 23..30) names its binade. For every one of the 256
possible fields these tables hold what the format does in that binade: the grid spacing (as
the power of two and its inverse), the smallest grid magnitude of the binade and its rank among
all non-negative magnitudes. Rounding is then ``floor(|x| * 2^-step)`` plus a rounding decision,
and encoding a grid value is ``magnitude_codes[first_rank + (|q| - first) * 2^-step]`` -- one
gather on a small table instead of a binary search over the whole grid (which ran at ~0.05 GB/s
for HiFloat8 and generic ExMy). Binades outside ``[e_lo, e_hi]`` take the nearest end's entry,
exactly like the ``clamp`` of the frexp-based reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch


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


@cache
def binade_tables(spec) -> BinadeTables:
    lay = spec.layout
    steps = lay.step_log2.tolist()
    mags = lay.magnitudes.double()
    step, inv, first, rank = [], [], [], []
    for field in range(256):
        e = min(max(field - 127, lay.e_lo), lay.e_hi)
        s = steps[e - lay.e_lo]
        lo = 0.0 if e == lay.e_lo else 2.0 ** e
        r = int(torch.searchsorted(mags, torch.tensor([lo], dtype=torch.float64)))
        step.append(2.0 ** s), inv.append(2.0 ** -s), first.append(lo), rank.append(float(r))
    f32 = dict(dtype=torch.float32)
    return BinadeTables(torch.tensor(step, **f32), torch.tensor(inv, **f32),
                        torch.tensor(first, **f32), torch.tensor(rank, **f32),
                        lay.magnitude_codes.clone())


def exponent_field(a: torch.Tensor) -> torch.Tensor:
    """The biased exponent field (0..255) of float32 ``a`` as int64 indices (for gathers)."""
    return ((a.view(torch.int32) >> 23) & 0xFF).long()
