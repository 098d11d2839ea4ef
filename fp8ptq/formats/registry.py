"""The one registry of named formats, plus generic ``ExMy[bBIAS][fn|fnuz]`` names."""

from __future__ import annotations

import re

from ..errors import UsageError
from .spec import FormatSpec

PRESETS: tuple[FormatSpec, ...] = (
    FormatSpec("e4m3", 4, 3, 7, "fn", torch_dtype="float8_e4m3fn", aliases=("e4m3fn", "fp8"),
               compressed_tensors_type="float",
               description="OCP FP8 E4M3 (FN): no inf, NaN S.1111.111, max 448"),
    FormatSpec("e5m2", 5, 2, 15, "ieee", torch_dtype="float8_e5m2",
               description="OCP FP8 E5M2: IEEE-style inf/NaN, max 57344"),
    FormatSpec("e4m3fnuz", 4, 3, 8, "fnuz", torch_dtype="float8_e4m3fnuz",
               description="E4M3 FNUZ (bias 8): one NaN 0x80, no -0, no inf, max 240"),
    FormatSpec("e5m2fnuz", 5, 2, 16, "fnuz", torch_dtype="float8_e5m2fnuz",
               description="E5M2 FNUZ (bias 16): one NaN 0x80, no -0, no inf, max 57344"),
    # IBM HFP8 forward format (Sun et al. 2019 sec 2.1): 1-4-3 with an extra exponent bias of 4 on
    # top of the IEEE bias 7 (bias 11). The paper names no special values; the FNUZ convention is
    # the one that yields its stated max of 30 (= 1.875 * 2^4). It quotes 2^-11 as the truncation
    # threshold, i.e. no subnormals: magnitudes below 2^-11 flush to 0, the smallest non-zero
    # value is the smallest normal 2^-10. Codes with exponent field 0 decode to 0.
    FormatSpec("hfp8", 4, 3, 11, "fnuz", subnormals=False,
               description="IBM HFP8 1-4-3, exponent bias 4 (+7): max 30, flush below 2^-11"),
    # HiF8 fields are tapered (exponent 0-4 bits, mantissa 3-1 bits): the widest are listed.
    FormatSpec("hif8", 4, 3, 0, "hif8", rounding="half_away",
               description="Huawei HiFloat8: tapered 3/2/1-bit mantissa, denormals to 2^-22"),
    FormatSpec("int8", 0, 7, 0, "int", description="symmetric int8 [-127, 127] (baseline)",
               compressed_tensors_type="int"),
    # OCP Microscaling Formats (MX) Specification v1.0, 2023, sec. 5 / 6.3: E4M3 / E5M2 elements,
    # one E8M0 scale per 32 values along the reduction dimension (weights and dynamic
    # activations). compressed-tensors stores MXFP8 (E4M3 elements, ``group_size: 32``,
    # ``scale_dtype: uint8``); E5M2 elements only in the fp8ptq-native layout.
    FormatSpec("mxfp8", 4, 3, 7, "fn", torch_dtype="float8_e4m3fn", mx_block=32,
               aliases=("mxfp8e4m3",), compressed_tensors_type="float",
               description="OCP MXFP8 E4M3: E8M0 scale per 32 values along K (max 448)"),
    # the same elements and layout with the E8M0 exponent rounded up (NVIDIA's kernels: what
    # vLLM's MXFP8 path computes for activations at run time)
    FormatSpec("mxfp8-ceil", 4, 3, 7, "fn", torch_dtype="float8_e4m3fn", mx_block=32,
               mx_scale_rounding="ceil", aliases=("mxfp8ceil",), compressed_tensors_type="float",
               description="OCP MXFP8 E4M3, E8M0 exponent rounded up (NVIDIA kernels / vLLM)"),
    FormatSpec("mxfp8-e5m2", 5, 2, 15, "ieee", torch_dtype="float8_e5m2", mx_block=32,
               aliases=("mxfp8e5m2",),
               description="OCP MXFP8 E5M2: E8M0 scale per 32 values along K (max 57344)"),
)

_BY_NAME = {n: s for s in PRESETS for n in (s.name, *s.aliases)}
_GENERIC = re.compile(r"^e(\d)m(\d)(?:b(-?\d+))?(fn|fnuz)?$")


def preset_names() -> list[str]:
    return [s.name for s in PRESETS]


def get_format(name: str | FormatSpec) -> FormatSpec:
    """A preset by name or alias, or a generic ``ExMy`` (IEEE bias unless ``bN``; ``fn`` /
    ``fnuz`` suffix picks the special-value convention, IEEE inf/NaN otherwise)."""
    if isinstance(name, FormatSpec):
        return name
    key = re.sub(r"(?<!b)-", "", name.strip().lower().replace("_", ""))  # keep a bias's sign
    if key in _BY_NAME:
        return _BY_NAME[key]
    m = _GENERIC.match(key)
    if m:
        e, mant = int(m.group(1)), int(m.group(2))
        specials = m.group(4) or "ieee"
        if e < 1 or 1 + e + mant > 8 or (specials == "ieee" and e < 2):
            raise UsageError(f"format {name!r}: need 1 + E + M <= 8 bits and E >= 1 (E >= 2 "
                             "with IEEE inf/NaN)")
        bias = int(m.group(3)) if m.group(3) is not None else (1 << (e - 1)) - 1
        return FormatSpec(key, e, mant, bias, specials)
    raise UsageError(f"unknown format {name!r}; valid: {', '.join(preset_names())} "
                     "(aliases: e4m3fn, fp8, mxfp8-e4m3) or a generic name like e3m4, e4m3b11fnuz, "
                     "e5m2fn")
