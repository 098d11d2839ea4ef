"""fp8ptq: FP8 post-training quantization for PyTorch / Hugging Face models.

The package itself imports nothing heavy (no torch): the ``fp8ptq`` command re-executes itself
with glibc's huge-page tunable before torch is imported
(``fp8ptq.runtime.usage.exec_with_hugepages``, from ``fp8ptq.cli.entry``),
which only pays off if importing ``fp8ptq.cli`` has not imported torch yet."""

import importlib

from .version import __version__


def load(path, **kwargs):
    """Load an fp8ptq checkpoint folder (``fp8ptq.checkpoint.load_quantized``)."""
    return importlib.import_module(".checkpoint", __name__).load_quantized(path, **kwargs)


def quantize(model, recipe=None, output=None, **kwargs):
    """Quantize a model and write its checkpoint: everything ``fp8ptq quantize`` does
    (``fp8ptq.execution.quantize.quantize``); returns the run's report."""
    run = importlib.import_module(".execution.quantize", __name__)
    return run.quantize(model, recipe, output, **kwargs)


def evaluate(model, tasks, compare=None, **kwargs):
    """Evaluate a model and its variants on tasks: everything ``fp8ptq eval`` computes
    (``fp8ptq.evals.evaluate.evaluate``); returns rows, protocol, notes."""
    return importlib.import_module(".evals.evaluate", __name__).evaluate(
        model, tasks, compare, **kwargs)


__all__ = ["evaluate", "load", "quantize", "__version__"]
