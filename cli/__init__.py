"""``python -m fp8ptq.cli``: the same command as the ``fp8ptq`` console script.

Imported by ``fp8ptq quantize`` (the console script or ``python -m fp8ptq.cli``), this package
first re-executes the process with glibc's huge-page tunable (``fp8ptq.runtime.usage.
exec_with_hugepages``: fewer page faults under ``bound_heap``), before ``.main`` imports torch.
It binds no ``main`` itself: ``fp8ptq.cli.main`` stays the module (the console script's
``fp8ptq.cli.main:main``).
Imported by any other program (tests, a user's script) it changes nothing."""

import os
import sys

from fp8ptq.runtime.usage import hugepages_for

# The group's options that take a value (none today: --verbose, --debug, --version, --help are
# flags); tests/test_usage.py checks this set against the click group, so a new one cannot
# silently make the subcommand unfindable.
GROUP_VALUE_OPTIONS: frozenset[str] = frozenset()

if os.path.basename(sys.argv[0]) == "fp8ptq" or sys.orig_argv[1:3] == ["-m", "fp8ptq.cli"]:
    hugepages_for(sys.argv, GROUP_VALUE_OPTIONS)
