"""``python -m fp8ptq.cli``: the same command as the ``fp8ptq`` console script."""

from .entry import main

if __name__ == "__main__":
    main()
