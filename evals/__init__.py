"""Evaluation: WikiText perplexity and SQuAD EM/F1 through lm-eval, variant comparison reports.

``run_tasks``/``EvalResult`` live in :mod:`.runner` (imports lm-eval, ~1 s); the report functions
in :mod:`.report` (light). Both are re-exported here lazily.
"""

import importlib

_EXPORTS = {
    "run_tasks": "runner",
    "EvalResult": "runner",
    "deltas": "report",
    "render_table": "report",
    "to_markdown": "report",
    "to_json": "report",
    "plot_deltas": "report",
    "check_gates": "report",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
