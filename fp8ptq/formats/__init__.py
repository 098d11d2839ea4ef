"""Number formats: specs as data, one registry, bit-exact vectorised codecs."""

from .codec import (
                    codes_as_torch_float8,
                    decode,
                    dequantize,
                    encode,
                    encode_scaled,
                    fake_quantize,
                    quantize_values,
                    to_torch_float8,
                    torch_dtype,
)
from .registry import PRESETS, get_format, preset_names
from .spec import ROUNDINGS, FormatSpec, scaled_mm_pair

__all__ = [
    "FormatSpec", "PRESETS", "ROUNDINGS", "get_format", "preset_names", "quantize_values",
    "encode", "encode_scaled", "decode", "dequantize", "fake_quantize", "to_torch_float8",
    "codes_as_torch_float8", "torch_dtype", "scaled_mm_pair",
]
