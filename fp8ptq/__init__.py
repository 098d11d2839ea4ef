"""fp8ptq: FP8 post-training quantization for PyTorch / Hugging Face models.

The package itself imports nothing heavy (no torch): the ``fp8ptq`` command re-executes itself
with glibc's huge-page tunable before torch is imported
(``fp8ptq.runtime.usage.exec_with_hugepages``),
which only pays off if importing ``fp8ptq.cli`` has not imported torch yet."""

import importlib

from .version import __version__


def load(path, **kwargs):
    """Load an fp8ptq checkpoint folder (``fp8ptq.checkpoint.load_quantized``)."""
    return importlib.import_module(".checkpoint", __name__).load_quantized(path, **kwargs)


__all__ = ["load", "__version__"]
