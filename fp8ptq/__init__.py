"""fp8ptq: FP8 post-training quantization for PyTorch / Hugging Face models."""

from .checkpoint import load_quantized
from .version import __version__


def load(path, **kwargs):
    """Load an fp8ptq checkpoint folder (``fp8ptq.checkpoint.load_quantized``)."""
    return load_quantized(path, **kwargs)


__all__ = ["load", "__version__"]
