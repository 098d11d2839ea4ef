"""Exceptions the CLI turns into one clear line and an exit code."""


class Fp8ptqError(Exception):
    """Base class. ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class UsageError(Fp8ptqError):
    """Bad input from the user: unknown name, missing file, conflicting flags (exit 2)."""

    exit_code = 2


class DataError(UsageError):
    """Calibration or evaluation data that is missing, empty or too short (exit 2)."""


class NumericsError(Fp8ptqError):
    """NaN/inf in a tensor that must be finite (exit 1)."""


class GateFailure(Fp8ptqError):
    """A quantized variant missed a ``--max-delta`` gate (exit 3)."""

    exit_code = 3


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (libraries' messages can span a screen), or
    its type name when it has none: what goes after ``error:``."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
