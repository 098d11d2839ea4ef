"""fp8ptq.numbers: the one place numbers are printed and made strict-JSON safe."""

import json
import math
from pathlib import Path

import torch

from fp8ptq.numbers import (
    dumps,
    finite_or_nan,
    finite_or_none,
    float_from_json,
    fmt_bytes,
    fmt_num,
    fmt_pct,
    fmt_short,
    json_number,
    json_safe,
)


def test_printing():
    assert fmt_num(None) == "-" and fmt_num(math.nan) == "-"
    assert fmt_num(math.nan, nan="nan") == "nan"
    assert (fmt_num(math.inf), fmt_num(-math.inf)) == ("inf", "-inf")
    assert fmt_num(3.14159, "{:.4g}") == "3.142" and fmt_num(12, "{:+d}") == "+12"
    assert fmt_short(0.000746) == "7.46e-4"  # shorter than 0.000746
    assert fmt_short(12.345) == "12.3" and fmt_short(123456.0) == "1.23e5"
    assert fmt_short(None) == "-"
    assert fmt_pct(0.1234) == "12.3%" and fmt_pct(-0.5, "{:+.0f}") == "-50%"
    assert fmt_bytes(3 * 2**20) == "3.0 MiB" and fmt_bytes(1536) == "1.5 KiB"


def test_strict_json():
    obj = {"a": math.nan, "b": [math.inf, -math.inf, 1.5], "t": torch.tensor([1, 2]),
           "d": torch.bfloat16, "p": Path("/x"), 3: (1, 2)}
    assert json_safe(obj) == {"a": None, "b": ["inf", "-inf", 1.5], "t": [1, 2],
                              "d": "bfloat16", "p": "/x", "3": [1, 2]}
    assert json.loads(dumps(obj))["b"] == ["inf", "-inf", 1.5]
    assert [float_from_json(v) for v in ("inf", "-inf", None, 2)] == [math.inf, -math.inf,
                                                                       None, 2.0]
    assert finite_or_none(math.nan) is None and finite_or_none(2.0) == 2.0
    assert finite_or_none("text") == "text"
    assert math.isnan(finite_or_nan(None)) and finite_or_nan(1) == 1.0
    assert [json_number(v) for v in (2.0, 0.5, -0.0, math.nan, -math.inf)] == \
        [2, 0.5, -0.0, "nan", "-inf"]
    assert dumps(math.nan) == "null"
