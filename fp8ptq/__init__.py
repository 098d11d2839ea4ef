"""fp8ptq: FP8 post-training quantization for PyTorch / Hugging Face models."""

__version__ = "0.1.0"


def load(path, **kwargs):
    """Load an fp8ptq checkpoint folder (``fp8ptq.checkpoint.load_quantized``)."""
    from .checkpoint import load_quantized

    return load_quantized(path, **kwargs)
