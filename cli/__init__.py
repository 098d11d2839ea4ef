"""``python -m fp8ptq.cli``: the same command as the ``fp8ptq`` console script.

Imported by ``fp8ptq quantize`` (the console script or ``python -m fp8ptq.cli``), this package
first re-executes the process with glibc's huge-page tunable (``fp8ptq.usage.
exec_with_hugepages``: fewer page faults under ``bound_heap``), before ``.main`` imports torch.
It binds no ``main`` itself: ``fp8ptq.cli.main`` stays the module (the console script's
``fp8ptq.cli.main:main``).
Imported by any other program (tests, a user's script) it changes nothing."""

import os
import sys

from fp8ptq.usage import exec_with_hugepages

# Only ``quantize``: measured there (fewer page faults, same peak RSS: SmolLM2 128 x 512 844 MiB,
# the 28.6 GB Llama's sequential run 2,803 MiB either way), while ``eval``'s peak on the
# 262k-vocabulary bench rose 1.47 -> 2.13 GB with huge pages for no measured speed-up.
HUGEPAGE_COMMANDS = frozenset({"quantize"})


def _subcommand(argv: list[str]) -> str | None:
    """The subcommand's name: the first argument that is not an option (the group's own
    options are flags)."""
    return next((a for a in argv[1:] if not a.startswith("-")), None)


if (os.path.basename(sys.argv[0]) == "fp8ptq" or sys.orig_argv[1:3] == ["-m", "fp8ptq.cli"]) \
        and _subcommand(sys.argv) in HUGEPAGE_COMMANDS:
    exec_with_hugepages()
