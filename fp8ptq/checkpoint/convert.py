"""OCP (FN / IEEE) FP8 codes -> FNUZ codes without re-rounding.

E4M3FN (bias 7) and E4M3FNUZ (bias 8) share sign/exponent/mantissa fields, so a bit pattern
read as FNUZ is worth exactly half its FN value (normals and subnormals alike). Re-reading the
codes as FNUZ and doubling the scale therefore keeps every product ``value * scale`` exact. The
only pattern whose meaning changes otherwise is 0x80: -0 in FN, NaN in FNUZ; it becomes 0x00.
E5M2 (bias 15) -> E5M2FNUZ (bias 16) follows the same rule. Source NaN/inf patterns have no
counterpart (in FNUZ those bits are finite numbers) and are refused.
"""

from __future__ import annotations

import torch

from ..errors import NumericsError, UsageError
from ..formats import decode, get_format

_PAIRS = {"e4m3": "e4m3fnuz", "e5m2": "e5m2fnuz"}


def fn_to_fnuz(codes: torch.Tensor, scale: torch.Tensor | float, fmt: str = "e4m3"):
    """(codes, scale) in ``fmt`` (e4m3 / e5m2) -> (codes, scale) in its FNUZ twin: same bits
    except 0x80 -> 0x00, scale x 2. ``codes`` is uint8 (or a float8 tensor, viewed as uint8)."""
    src = get_format(fmt)
    if src.name not in _PAIRS:
        raise UsageError(f"fn_to_fnuz converts {', '.join(_PAIRS)}, not {fmt!r}")
    if codes.dtype != torch.uint8:
        if codes.element_size() != 1:
            raise UsageError(f"codes must be uint8 or an 8-bit float dtype, got {codes.dtype}")
        codes = codes.view(torch.uint8)
    if not bool(torch.isfinite(decode(codes, src)).all()):
        raise NumericsError(f"{src.name} codes hold NaN/inf patterns, which have no "
                            f"{_PAIRS[src.name]} counterpart with the same bits")
    out = torch.where(codes == 0x80, torch.zeros_like(codes), codes)
    scale = scale * 2 if isinstance(scale, torch.Tensor) else float(scale) * 2.0
    return out, scale
