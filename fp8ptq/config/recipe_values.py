"""A recipe's values as given: a recipe file read (YAML, JSON, or an ``fp8ptq.json``'s
``recipe``) and every value checked against its field's type, each problem one line naming the
file and place or the field."""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path
from typing import Union

import yaml

from ..errors import UsageError

# Keys a per-pattern override may set: a partial tensor plan for the matching modules (like
# compressed-tensors' ``config_groups``); what it leaves out comes from the recipe. The short
# form ``GLOB: FORMAT`` (``--override GLOB=FORMAT``) sets both formats; ``none`` skips.
OVERRIDE_KEYS = ("format", "weight_format", "act_format", "weight_calib", "weight_granularity",
                 "act_granularity")


def load_recipe_dict(path: str | Path) -> dict:
    p = Path(path)
    if p.is_dir() and (p / "fp8ptq.json").exists():
        p = p / "fp8ptq.json"
    if not p.is_file():
        raise UsageError(f"recipe file not found: {path}")
    try:
        text = p.read_text(encoding="utf-8")
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}:{e.lineno}:{e.colno}: {e.msg}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UsageError(f"{where}: {what}") from None
    if not isinstance(data, dict):
        raise UsageError(f"recipe {path} must be a mapping of option: value")
    if "recipe" in data and isinstance(data["recipe"], dict):  # an fp8ptq.json
        data = data["recipe"]
    named = [k for k in data if not isinstance(k, str)]  # YAML "?" or "1: 2" give None / 1
    if named:
        raise UsageError(f"recipe {path}: option names must be strings, got {named[0]!r}")
    return data


_WHAT = {int: "an integer", bool: "true or false", str: "a string", float: "a number"}


def _check_type(key: str, value, annotation):
    """``value`` checked against a field's annotation, normalized (int -> float, a string ->
    a one-element list, a list -> a tuple); a ``UsageError`` with a plain message otherwise."""
    if isinstance(annotation, str):
        annotation = eval(annotation, vars(typing), {})  # noqa: S307 - our own annotations
    if key == "smoothquant":
        return _smoothquant(value)
    if key == "overrides":
        return _overrides(value)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        annotation = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise UsageError(f"{key} must be a list of module-name globs, got {value!r}")
        return list(value)
    if origin is tuple:
        try:
            value = tuple(int(v) for v in value)
        except (TypeError, ValueError):
            raise UsageError(f"{key} must be two integers LOW, HIGH, got {value!r}") from None
        if len(value) != len(args):
            raise UsageError(f"{key} must be LOW,HIGH with LOW <= HIGH, got {value}")
        return value
    if annotation is float:
        _typed(key, value, (int, float))
        return float(value)
    if annotation in (int, bool, str):
        _typed(key, value, annotation)
    return value


def _smoothquant(value):
    if value is None or value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise UsageError(f"smoothquant must be an alpha in [0, 1] or 'auto', got {value!r}")
    try:
        return float(value)
    except ValueError:
        raise UsageError(f"smoothquant must be an alpha in [0, 1] or 'auto', got "
                         f"{value!r}") from None


def _overrides(value):
    ok = isinstance(value, dict) and all(
        isinstance(k, str) and (isinstance(v, str) or (
            isinstance(v, dict) and v and set(v) <= set(OVERRIDE_KEYS)
            and all(isinstance(x, str) for x in v.values())))
        for k, v in value.items())
    if not ok:
        raise UsageError("overrides must map module-name globs to format names or 'none' (or "
                         f"partial plans with keys {', '.join(OVERRIDE_KEYS)}), got {value!r}")
    return dict(value)


def _typed(key, value, types_) -> None:
    # bool is an int subclass: ``num_samples: true`` must not pass as 1
    if not isinstance(value, types_) or (isinstance(value, bool) and types_ is not bool):
        what = _WHAT.get(types_, "a number")
        raise UsageError(f"{key} must be {what}, got {value!r}")


def _choice(key, value, valid):
    if value not in valid:
        raise UsageError(f"{key} must be one of {', '.join(valid)}, got {value!r}")
