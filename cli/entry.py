"""The ``fp8ptq`` console script and ``python -m fp8ptq.cli``: the process set-up a command
owns, then the click group (``fp8ptq.cli.main``).

``quantize`` re-executes the interpreter once with glibc's huge-page tunable before torch is
imported (``fp8ptq.runtime.usage.exec_with_hugepages``: fewer page faults once the group's
callback has bounded the heap, ``bound_heap``). That is a change to the whole process, so only
these two entry points make it: importing ``fp8ptq`` or ``fp8ptq.cli`` from a program changes
nothing."""

import importlib
import sys

from fp8ptq.runtime.usage import hugepages_for

# The group's options that take a value (none today: --verbose, --debug, --version, --help are
# flags); tests/test_usage.py checks this set against the click group, so a new one cannot
# silently make the subcommand unfindable.
GROUP_VALUE_OPTIONS: frozenset[str] = frozenset()


def main() -> None:
    hugepages_for(sys.argv, GROUP_VALUE_OPTIONS)
    importlib.import_module("fp8ptq.cli.main").main(prog_name="fp8ptq")
