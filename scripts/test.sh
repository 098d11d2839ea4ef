#!/usr/bin/env bash
# Installs fp8ptq with its test extras (torch pinned to the local CPU wheel), lints (ruff: style,
# pyflakes, import order, bugbear, pyupgrade; configured in pyproject.toml) and runs the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -c constraints.txt -e ".[test]"
python3 -m ruff check .
python3 -m pytest -q "$@"
