"""fp8ptq: FP8 post-training quantization for PyTorch / Hugging Face models."""

__version__ = "0.1.0"
