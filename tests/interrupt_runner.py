"""Runs ``fp8ptq`` and sends this process a signal in one phase (load, calibrate or write):
used by tests/test_bad_inputs.py, not a test module itself.

    python interrupt_runner.py PHASE SIGNUM fp8ptq-args...
"""

import os
import sys

import safetensors.torch

from fp8ptq.cli.main import main
from fp8ptq.execution import job
from fp8ptq.steps import calibrate

PHASE, SIGNUM = sys.argv[1], int(sys.argv[2])


def _signal():
    os.kill(os.getpid(), SIGNUM)


if PHASE == "load":
    _load = job.load

    def load(*args, **kwargs):
        _signal()
        return _load(*args, **kwargs)

    job.load = load
elif PHASE == "calibrate":
    _run = calibrate.run_batch

    def run_batch(model, batch, **kwargs):
        _signal()
        return _run(model, batch, **kwargs)

    calibrate.run_batch = run_batch
else:  # write: the temporary output folder exists by now
    _save = safetensors.torch.save_file

    def save_file(*args, **kwargs):
        _save(*args, **kwargs)
        _signal()

    safetensors.torch.save_file = save_file

if __name__ == "__main__":
    sys.argv = ["fp8ptq", *sys.argv[3:]]
    main()
