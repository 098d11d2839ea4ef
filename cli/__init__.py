"""The ``fp8ptq`` command line: click commands over the public library, one module each.

Importing this package sets nothing up in the process; the console script and
``python -m fp8ptq.cli`` enter through ``fp8ptq.cli.entry``."""
