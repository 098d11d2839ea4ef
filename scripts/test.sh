#!/usr/bin/env bash
# Installs fp8ptq with its test extras (torch pinned to the local CPU wheel), lints (ruff: style,
# pyflakes, import order, bugbear, pyupgrade; configured in pyproject.toml) and runs the tests.
#   bash scripts/test.sh            the full suite (what CI runs)
#   bash scripts/test.sh --quick    the tests not marked slow (-m "not slow"): minutes, not a
#                                   quarter of an hour, for the edit-test loop
# Further arguments go to pytest. Every run ends with its 15 slowest tests; the exit code is
# pytest's (or pip's / ruff's when those fail first).
set -euo pipefail
cd "$(dirname "$0")/.."
select=()
if [[ "${1:-}" == "--quick" ]]; then
    select=(-m "not slow")
    shift
fi
python3 -m pip install -q -c constraints.txt -e ".[test]"
python3 -m ruff check .
exec python3 -m pytest -q --durations=15 ${select[@]+"${select[@]}"} "$@"
