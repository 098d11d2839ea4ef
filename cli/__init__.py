"""``python -m fp8ptq.cli``: the same command as the ``fp8ptq`` console script.

Imported by the ``fp8ptq`` command (the console script or ``python -m fp8ptq.cli``), this package
first re-executes the process with glibc's huge-page tunable (``fp8ptq.usage.
exec_with_hugepages``: fewer page faults under ``bound_heap``), before ``.main`` imports torch.
It binds no ``main`` itself: ``fp8ptq.cli.main`` stays the module (the console script's
``fp8ptq.cli.main:main``).
Imported by any other program (tests, a user's script) it changes nothing."""

import os
import sys

from fp8ptq.usage import exec_with_hugepages

if os.path.basename(sys.argv[0]) == "fp8ptq" or sys.orig_argv[1:3] == ["-m", "fp8ptq.cli"]:
    exec_with_hugepages()
