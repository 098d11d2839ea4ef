"""A number format described as data: bits, bias, special values, subnormals, rounding.

Every other part of fp8ptq asks a ``FormatSpec`` for its range and codes; nothing special-cases a
format by name. The code->value table and the rounding grid are derived from the spec once
(``layout(spec)``) by the encoding family named in ``specials``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

from .layouts import build_layout, table_builder

ROUNDINGS = ("nearest_even", "half_away", "stochastic", "hybrid")

# How the special values are encoded:
#   ieee: exponent field all ones = inf (mantissa 0) / NaN (otherwise); +0 and -0.
#   fn:   no inf; only the all-ones exponent+mantissa pattern is NaN (OCP E4M3FN); +0 and -0.
#   fnuz: no inf, no -0; the sign-only pattern 0x80 is the single NaN (Graphcore/AMD FNUZ).
#   hif8: HiFloat8's own layout (dot field); one zero, NaN 0x80, +-inf at 2^15 x 1.5.
#   int:  two's-complement integer, symmetric range [-(2^(b-1)-1), 2^(b-1)-1].
SPECIALS = ("ieee", "fn", "fnuz", "hif8", "int")


@dataclass(frozen=True)
class FormatSpec:
    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    specials: str = "ieee"
    subnormals: bool = True
    rounding: str = "nearest_even"
    torch_dtype: str | None = None
    aliases: tuple[str, ...] = ()
    description: str = field(default="", compare=False)
    # compressed-tensors ``QuantizationArgs.type`` when the format is one it stores ("float":
    # OCP E4M3, "int": symmetric int8), else None: the checkpoint layouts ask this, not the name
    compressed_tensors_type: str | None = field(default=None, compare=False)
    # OCP Microscaling (MX) v1.0: the format is an MX format whose elements (the fields above)
    # share one E8M0 power-of-two scale per ``mx_block`` consecutive values along the GEMM's
    # reduction dimension, for weights and (dynamic) activations alike; the scale follows the
    # spec's rule, not a calibrator's (``fp8ptq.formats.mx``). None: an ordinary scaled format.
    mx_block: int | None = None
    # how the E8M0 exponent is taken from a block's amax: "floor", the OCP MX v1.0 rule
    # (``floor(log2 amax) - emax_elem``: a block's top values in (max, 2^(emax+1)) x scale
    # saturate), or "ceil", NVIDIA's kernels' rule (the smallest power of two >= amax / max:
    # nothing saturates; TensorRT-LLM / FlashInfer ``mxfp8_quantize``, which vLLM's MXFP8 path
    # calls for the activations)
    mx_scale_rounding: str = "floor"

    def __post_init__(self):
        if self.specials not in SPECIALS:
            raise ValueError(f"specials must be one of {SPECIALS}, got {self.specials!r}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {self.rounding!r}")
        if not 1 <= self.bits <= 8:
            raise ValueError(f"{self.name}: {self.bits} bits; fp8ptq codes hold 1 to 8 bits")
        if self.is_float and self.exponent_bits < 1:
            raise ValueError(f"{self.name}: a float format needs at least one exponent bit")
        if self.mx_block is not None and (self.mx_block < 1 or not self.is_float):
            raise ValueError(f"{self.name}: MX blocks need float elements and a size >= 1")
        if self.mx_scale_rounding not in ("floor", "ceil"):
            raise ValueError(f"{self.name}: mx_scale_rounding must be floor or ceil, got "
                             f"{self.mx_scale_rounding!r}")

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def is_float(self) -> bool:
        return self.specials != "int"

    @property
    def scaled_mm_operand(self) -> bool:
        """Can ``torch._scaled_mm`` take codes of this format (the OCP FP8 dtypes)?"""
        return self.torch_dtype in ("float8_e4m3fn", "float8_e5m2")

    @property
    def num_codes(self) -> int:
        return 1 << self.bits

    @cached_property
    def layout(self):
        return build_layout(self)

    # Range facts, read off the layout so they are right by construction.
    @property
    def max(self) -> float:
        return self.layout.max

    @property
    def min_normal(self) -> float:
        return self.layout.min_normal

    @property
    def min_subnormal(self) -> float:
        return self.layout.min_positive

    @property
    def has_inf(self) -> bool:
        return self.layout.has_inf

    @property
    def has_nan(self) -> bool:
        return self.layout.has_nan

    @property
    def has_negative_zero(self) -> bool:
        return self.layout.has_negative_zero

    @cached_property
    def tapered(self) -> bool:
        """Precision varies across binades (HiFloat8), so mapping amax onto ``max`` is not
        automatically the best scale. Cached, as ``calibration_max``: a dynamic scale reads it
        at every forward of every GEMM."""
        widths = set(_binade_widths(self.layout))
        return self.is_float and len(widths - {min(widths)}) > 1

    @cached_property
    def calibration_max(self) -> float:
        """The value a calibrated amax is mapped onto. For uniform formats their max; for
        tapered ones the top of the full-precision range (2^4 for HiF8, whose 3-bit mantissa
        ends there), since mapping amax onto 2^15 would leave 1 mantissa bit for large values
        and push the bulk of a tensor towards the low-precision bottom."""
        if not self.tapered:
            return self.max
        lay = self.layout
        widths = _binade_widths(lay)
        top = max(e for e, w in zip(range(lay.e_lo, lay.e_hi + 1), widths) if w == max(widths))
        return 2.0 ** (top + 1)

    @property
    def binades(self) -> int:
        """Powers of two covered from the smallest non-zero magnitude to the largest finite."""
        return math.floor(math.log2(self.max)) - math.floor(math.log2(self.min_subnormal)) + 1

    def describe(self) -> dict:
        return {
            "name": self.name,
            "aliases": list(self.aliases),
            "kind": "int" if not self.is_float else "float",
            "bits": self.bits,
            "exponent_bits": self.exponent_bits,
            "mantissa_bits": self.mantissa_bits,
            "bias": self.bias,
            "specials": self.specials,
            "subnormals": self.subnormals,
            "rounding": self.rounding,
            "max": self.max,
            "min_normal": self.min_normal,
            "min_subnormal": self.min_subnormal,
            "has_inf": self.has_inf,
            "has_nan": self.has_nan,
            "has_negative_zero": self.has_negative_zero,
            "binades": self.binades,
            "calibration_max": self.calibration_max,
            "torch_dtype": self.torch_dtype,
            "mx_block": self.mx_block,
            "mx_scale_rounding": self.mx_scale_rounding if self.mx_block else None,
            "description": self.description,
        }


def scaled_mm_pair(weight: FormatSpec, act: FormatSpec | None) -> bool:
    """Does ``torch._scaled_mm`` run this weight x activation pair (both OCP FP8, at least one
    E4M3: E5M2 x E5M2 is not supported)?"""
    return (act is not None and weight.scaled_mm_operand and act.scaled_mm_operand
            and "float8_e4m3fn" in (weight.torch_dtype, act.torch_dtype))


@table_builder
def _binade_widths(lay) -> list[int]:
    """Mantissa bits of each binade ``e_lo..e_hi`` (``e - log2 spacing``), read from the
    layout's table outside any tracing mode (``table_builder``): a format's range facts are
    cached on first use, which may come inside one."""
    return [e - s for e, s in zip(range(lay.e_lo, lay.e_hi + 1), lay.step_log2.tolist())]
