"""Numbers for people and for strict JSON: how fp8ptq prints a value in a table or a message,
and how it writes one that may be NaN or infinite. One place, so that the quantize report, the
sensitivity and eval tables, the checkpoint metadata and the benchmark pages agree.

Printing: ``fmt_num`` (a format spec; None and NaN as "-", infinities as "inf" / "-inf"),
``fmt_short`` (the shorter of fixed and exponent notation: ``7.46e-4``), ``fmt_pct``,
``fmt_bytes``. JSON: ``json_safe`` / ``dumps`` (NaN -> null, +-inf -> "inf" / "-inf", tensors,
dtypes, paths, enums, dataclasses -> plain values), ``finite_or_none``, ``finite_or_nan``,
``float_from_json`` (the inverse for one field), ``json_number`` (the formats table: exact
integers, "nan" / "inf" / "-inf" strings).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import re
from pathlib import Path

import torch

# --- printing ----------------------------------------------------------------------------------


def fmt_num(v, spec: str = "{:.3g}", *, none: str = "-", nan: str = "-") -> str:
    """``spec.format(v)``; ``none`` for None, ``nan`` for NaN, "inf" / "-inf" for infinities."""
    if v is None:
        return none
    if isinstance(v, float) and math.isnan(v):
        return nan
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return spec.format(v)


def fmt_short(v, digits: int = 3) -> str:
    """The shorter of fixed and exponent notation, exponent unpadded: ``7.46e-4``; "-" for
    None."""
    if v is None:
        return "-"
    fixed, sci = (re.sub(r"e\+?(-?)0*(?=\d)", r"e\1", t)
                  for t in (f"{v:.{digits}g}", f"{v:.{digits - 1}e}"))
    return fixed if len(fixed) <= len(sci) else sci


def fmt_pct(fraction: float, spec: str = "{:.1f}") -> str:
    """``fraction`` as a percentage: ``fmt_pct(0.1234) == "12.3%"``."""
    return spec.format(100 * fraction) + "%"


def fmt_bytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


# --- strict JSON -------------------------------------------------------------------------------


def finite_or_none(v):
    """``v``, or None for a NaN / infinite float (strict JSON has neither)."""
    return None if isinstance(v, float) and not math.isfinite(v) else v


def finite_or_nan(v) -> float:
    """``float(v)``, NaN for None or a non-finite value (plots mask NaN)."""
    return float(v) if v is not None and math.isfinite(v) else math.nan


def json_safe(obj):
    """A copy of ``obj`` with only dict/list/str/int/float/bool/None: NaN -> None,
    +-inf -> the strings "inf" / "-inf", tensors/dtypes/paths/enums -> plain values."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        if math.isnan(obj):
            return None
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, enum.Enum):
        return json_safe(obj.value)
    if isinstance(obj, torch.Tensor):
        return json_safe(obj.tolist())
    if isinstance(obj, (torch.dtype, torch.device, Path)):
        return str(obj).removeprefix("torch.")
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return json_safe(dataclasses.asdict(obj))
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [json_safe(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalars
        return json_safe(obj.item())
    return str(obj)


def dumps(obj, **kwargs) -> str:
    """``json.dumps`` of ``json_safe(obj)`` that refuses NaN/inf outright."""
    return json.dumps(json_safe(obj), allow_nan=False, **kwargs)


def float_from_json(value) -> float | None:
    """Inverse of ``json_safe`` for one float field."""
    if value is None:
        return None
    if value == "inf":
        return math.inf
    if value == "-inf":
        return -math.inf
    return float(value)


def json_number(v: float):
    """A format-table value for JSON: an exact integer as an int, "nan" / "inf" / "-inf" as
    strings (``fp8ptq formats --json``: every code's value, specials included)."""
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return int(v) if v == int(v) and abs(v) < 2**53 and not (v == 0 and math.copysign(1, v) < 0) \
        else v
