"""Number formats: specs as data, one registry, bit-exact vectorised codecs."""

from .codec import (
                    decode,
                    dequantize,
                    encode,
                    encode_scaled,
                    fake_quantize,
                    quantize_values,
)
from .registry import PRESETS, get_format, preset_names
from .spec import ROUNDINGS, FormatSpec, scaled_mm_pair
from .torch_float8 import codes_as_torch_float8, to_torch_float8, torch_dtype

__all__ = [
    "FormatSpec", "PRESETS", "ROUNDINGS", "get_format", "preset_names", "quantize_values",
    "encode", "encode_scaled", "decode", "dequantize", "fake_quantize", "to_torch_float8",
    "codes_as_torch_float8", "torch_dtype", "scaled_mm_pair",
]
