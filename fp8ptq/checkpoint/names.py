"""Checkpoint names and the compressed-tensors type of a format: a leaf module that the writer,
the reader and the tensors of taps / experts share without importing each other."""

from __future__ import annotations

from ..formats import FormatSpec

LAYOUT_CT = "compressed-tensors"
LAYOUT_NATIVE = "fp8ptq-native"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
META_NAME = "fp8ptq.json"

# compressed-tensors CompressionFormat values
CT_FLOAT, CT_INT, CT_NAIVE, CT_MIXED = ("float-quantized", "int-quantized", "naive-quantized",
                                        "mixed-precision")
CT_MXFP8 = "mxfp8-quantized"  # E4M3 codes + E8M0 uint8 scales (compressed-tensors >= 0.20)


def ct_type(spec: FormatSpec | None) -> str | None:
    """compressed-tensors ``type`` of a format, or None where compressed-tensors has none (the
    format says so: ``FormatSpec.compressed_tensors_type``)."""
    return None if spec is None else spec.compressed_tensors_type
