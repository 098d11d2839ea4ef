"""JSON that strict parsers accept: no NaN / Infinity, only plain types."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from pathlib import Path

import torch


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
