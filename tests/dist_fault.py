"""Runs ``fp8ptq`` under torchrun with a fault or a spy injected on one rank (used by
tests/test_distributed.py; not a test module itself). ``FP8PTQ_TEST_FAULT`` says which:

- ``calibrate`` (default): rank 1's calibration forwards fail;
- ``propagate``: rank 1 fails carrying the second block's inputs on (streaming mode: after
  rank 0 has written the first block into its temporary folder);
- ``write``: rank 0 fails writing the second block (streaming mode);
- ``spy``: ranks other than 0 fail if they ever open a checkpoint writer or move a folder
  into place, so a clean exit shows that rank 0 alone wrote.
"""

import os

from fp8ptq.checkpoint.writer import CheckpointWriter
from fp8ptq.cli.main import main
from fp8ptq.errors import NumericsError
from fp8ptq.execution import streaming
from fp8ptq.files import atomic
from fp8ptq.steps import calibrate

FAULT = os.environ.get("FP8PTQ_TEST_FAULT", "calibrate")
RANK = os.environ.get("RANK")


def _nth_call_fails(real, n: int, message: str):
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] >= n:
            raise NumericsError(message)
        return real(*args, **kwargs)

    return wrapped


def _forbidden(what: str):
    def fail(*args, **kwargs):
        raise AssertionError(f"rank {RANK} {what}")

    return fail


if FAULT == "calibrate" and RANK == "1":
    calibrate.run_batch = _nth_call_fails(calibrate.run_batch, 1, "injected failure on this rank")
elif FAULT == "propagate" and RANK == "1":
    streaming.run_block = _nth_call_fails(streaming.run_block, 2,
                                           "injected failure on this rank")
elif FAULT == "write" and RANK == "0":
    CheckpointWriter.add_block = _nth_call_fails(CheckpointWriter.add_block, 2,
                                                 "injected write failure")
elif FAULT == "spy" and RANK != "0":
    CheckpointWriter.open = classmethod(_forbidden("opened a checkpoint writer"))
    atomic._move_into_place = _forbidden("moved a folder into place")

if __name__ == "__main__":
    main()
