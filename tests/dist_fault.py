"""Runs ``fp8ptq`` under torchrun with a calibration failure injected on rank 1 only (used by
tests/test_distributed.py; not a test module itself)."""

import os

from fp8ptq import pipeline
from fp8ptq.cli.main import main
from fp8ptq.errors import NumericsError

if os.environ.get("RANK") == "1":
    def _fail(model, batch, **kwargs):
        raise NumericsError("injected failure on this rank")

    pipeline.run_batch = _fail

if __name__ == "__main__":
    main()
