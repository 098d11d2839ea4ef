"""``python -m fp8ptq.cli``: the same command as the ``fp8ptq`` console script."""

from .main import main

if __name__ == "__main__":
    main(prog_name="fp8ptq")
