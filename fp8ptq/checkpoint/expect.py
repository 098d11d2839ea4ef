"""What a checkpoint's tensors must be: ``Expect`` (one tensor an fp8ptq.json entry implies) and
the validity rule of a scale per storage dtype (``SCALE_CHECKS``).

A leaf shared by the layouts (each lists the tensors it stores for a module) and by
``verify`` (which checks a folder against those lists); rules are data, so a new tensor kind
(group scales, MX blocks, ...) is a new entry, not a new branch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

FLOAT_SCALES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class Expect:
    """One tensor an fp8ptq.json entry implies."""

    key: str
    role: str  # "codes" or "scale": scales get their values checked
    dtypes: tuple[torch.dtype, ...]
    shape: list[int] | None = None  # None: any
    required: bool = True
    source: str = ""  # the fp8ptq.json entry that implies it (for the message)


def _float_scale_problem(t: torch.Tensor) -> str | None:
    t = t.float()
    bad = ~torch.isfinite(t) | (t <= 0)
    if t.numel() == 0:
        return "is empty; every scale must be finite and > 0"
    if bool(bad.any()):
        return (f"has {int(bad.sum())} scale value(s) that are NaN, inf, zero or negative; every "
                "scale must be finite and > 0")
    return None


def _e8m0_scale_problem(t: torch.Tensor) -> str | None:
    bad = t == 255  # E8M0's NaN code (OCP MX v1.0, section 5.4.1)
    if bool(bad.any()):
        return f"has {int(bad.sum())} E8M0 scale code(s) 255 (NaN); every scale must be finite"
    return None


SCALE_CHECKS: dict[torch.dtype, Callable[[torch.Tensor], str | None]] = {
    **{d: _float_scale_problem for d in FLOAT_SCALES}, torch.uint8: _e8m0_scale_problem}
SCALE_DTYPES = tuple(SCALE_CHECKS)  # the dtypes a scale tensor may be stored in


def scale_problem(t: torch.Tensor) -> str | None:
    """Why scale tensor ``t`` would decode to NaN / inf / 0, or None when it is valid."""
    check = SCALE_CHECKS.get(t.dtype)
    return None if check is None else check(t)


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.") if dtype is not None else "an unknown dtype"
