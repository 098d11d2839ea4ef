"""A quantization recipe: everything the ``quantize`` flags can say, as data.

Recipes load from YAML/JSON (``--recipe``; an ``fp8ptq.json`` works too: its ``recipe`` key is
used), flags override them, and the merged recipe is recorded in ``fp8ptq.json``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .calibrators import registry as calibrators
from .errors import UsageError
from .formats import ROUNDINGS, get_format
from .granularity import ACT_GRANULARITIES, WEIGHT_GRANULARITIES


@dataclass
class Recipe:
    format: str = "e4m3"
    weight_format: str | None = None  # default: ``format``
    act_format: str | None = None  # default: ``format``; "none" = weight-only
    weight_granularity: str = "channel"
    block_size: int = 128
    act_granularity: str = "tensor"
    weight_calib: str = "max"
    act_calib: str = "max"
    percentile: float = 99.99
    rounding: str | None = None  # default: the format's own
    scale_pow2: bool = False
    skip: list[str] = field(default_factory=list)
    quantize_lm_head: bool = False
    overrides: dict[str, str] = field(default_factory=dict)  # glob -> format name or "none"
    smoothquant: float | str | None = None  # alpha in [0, 1], or "auto" (searched per layer)
    pow2_range: tuple[int, int] = (-4, 5)  # exponents searched by --act-calib pow2-search
    bn_retune: bool = False
    keep_depthwise: bool = False
    keep_first_last: bool = False
    quantize_attention: bool = False
    quantize_residual: bool = False
    calibrate_all_experts: bool = True  # MoE: every token also observed through every expert
    quantize_router: bool = False  # MoE: router / shared-expert gate GEMMs quantized too
    unify_fused_scales: bool | None = None  # None: on for e4m3 / int8 (compressed-tensors)
    calib_data: str | None = None
    text_field: str | None = None
    num_samples: int = 128
    seq_len: int = 512
    batch_size: int = 8
    seed: int = 0
    dtype: str = "bfloat16"

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        self._check_types()
        for name in (self.format, self.weight_format):
            if name is not None:
                get_format(name)
        if self.act_format not in (None, "none"):
            get_format(self.act_format)
        for pattern, fmt in self.overrides.items():
            if fmt != "none":
                try:
                    get_format(fmt)
                except UsageError as e:
                    raise UsageError(f"override {pattern}={fmt}: {e}") from None
        _choice("weight_granularity", self.weight_granularity, WEIGHT_GRANULARITIES)
        _choice("act_granularity", self.act_granularity, ACT_GRANULARITIES)
        _choice("dtype", self.dtype, ("float32", "bfloat16", "float16"))
        _choice("act_calib", self.act_calib, calibrators.names("activation"))
        _choice("weight_calib", self.weight_calib, calibrators.names("weight"))
        if self.rounding is not None:
            _choice("rounding", self.rounding, ROUNDINGS)
        for key in ("block_size", "num_samples", "seq_len", "batch_size"):
            if getattr(self, key) < 1:
                raise UsageError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.smoothquant is not None and self.smoothquant != "auto":
            try:
                self.smoothquant = float(self.smoothquant)
            except ValueError:
                raise UsageError(f"smoothquant must be an alpha in [0, 1] or 'auto', got "
                                 f"{self.smoothquant!r}") from None
            if not 0 <= self.smoothquant <= 1:
                raise UsageError(f"smoothquant alpha must be in [0, 1], got {self.smoothquant}")
        if len(self.pow2_range) != 2 or self.pow2_range[0] > self.pow2_range[1]:
            raise UsageError(f"pow2_range must be LOW,HIGH with LOW <= HIGH, got {self.pow2_range}")
        if not 0 < self.percentile <= 100:
            raise UsageError(f"percentile must be in (0, 100], got {self.percentile}")

    def _check_types(self) -> None:
        """Recipe files are hand-written YAML: catch wrong types with a clear message (a bare
        string for ``skip`` would otherwise be split into one-character globs)."""
        for key in STR_FIELDS:
            _typed(key, getattr(self, key), str)
        for key in OPTIONAL_STR_FIELDS:
            if getattr(self, key) is not None:
                _typed(key, getattr(self, key), str)
        if self.smoothquant is not None and not isinstance(self.smoothquant, (str, int, float)) \
                or isinstance(self.smoothquant, bool):
            raise UsageError(f"smoothquant must be an alpha in [0, 1] or 'auto', got "
                             f"{self.smoothquant!r}")
        for key in INT_FIELDS:
            _typed(key, getattr(self, key), int)
        for key in BOOL_FIELDS:
            _typed(key, getattr(self, key), bool)
        if self.unify_fused_scales is not None:
            _typed("unify_fused_scales", self.unify_fused_scales, bool)
        _typed("percentile", self.percentile, (int, float))
        self.percentile = float(self.percentile)
        if isinstance(self.skip, str):
            self.skip = [self.skip]
        if not isinstance(self.skip, (list, tuple)) or not all(isinstance(p, str)
                                                              for p in self.skip):
            raise UsageError(f"skip must be a list of module-name globs, got {self.skip!r}")
        self.skip = list(self.skip)
        if not isinstance(self.overrides, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.overrides.items()):
            raise UsageError("overrides must map module-name globs to format names or 'none', "
                             f"got {self.overrides!r}")
        try:
            self.pow2_range = tuple(int(v) for v in self.pow2_range)
        except (TypeError, ValueError):
            raise UsageError(f"pow2_range must be two integers LOW, HIGH, got "
                             f"{self.pow2_range!r}") from None

    @property
    def skip_patterns(self) -> list[str]:
        return list(self.skip) + ([] if self.quantize_lm_head else ["lm_head"])

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["pow2_range"] = list(self.pow2_range)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "Recipe":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UsageError(f"unknown recipe key(s): {', '.join(unknown)}; valid: "
                             f"{', '.join(sorted(known))}")
        return cls(**data)

    @classmethod
    def load(cls, path: str | Path) -> "Recipe":
        return cls.from_dict(load_recipe_dict(path))

    def replace(self, **changes) -> "Recipe":
        """A validated copy with ``changes``."""
        return Recipe.from_dict({**self.to_dict(), **changes})

    def merged(self, **flags) -> "Recipe":
        """A copy with the given (non-None) flag values on top."""
        data = self.to_dict()
        data.update({k: v for k, v in flags.items() if v is not None})
        return Recipe.from_dict(data)


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
    return data


STR_FIELDS = ("format", "weight_granularity", "act_granularity", "weight_calib", "act_calib",
              "dtype")
OPTIONAL_STR_FIELDS = ("weight_format", "act_format", "rounding", "calib_data", "text_field")
INT_FIELDS = ("block_size", "num_samples", "seq_len", "batch_size", "seed")
BOOL_FIELDS = ("scale_pow2", "quantize_lm_head", "bn_retune", "keep_depthwise", "keep_first_last",
               "quantize_attention", "quantize_residual", "calibrate_all_experts",
               "quantize_router")


def _typed(key, value, types) -> None:
    # bool is an int subclass: ``num_samples: true`` must not pass as 1
    if not isinstance(value, types) or (isinstance(value, bool) and types is not bool):
        what = {int: "an integer", bool: "true or false", str: "a string"}.get(types, "a number")
        raise UsageError(f"{key} must be {what}, got {value!r}")


def _choice(key, value, valid):
    if value not in valid:
        raise UsageError(f"{key} must be one of {', '.join(valid)}, got {value!r}")
