"""``fp8ptq formats``: the table, --json, --codes, errors; and one real subprocess run."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from fp8ptq.formats import preset_names
from tiny_models import invoke

WIDE = {"COLUMNS": "200"}
KEYS = ("name", "exponent_bits", "mantissa_bits", "bias", "max", "min_normal", "min_subnormal",
        "has_inf", "has_negative_zero")


def run(*args, env=None):
    return invoke(list(args), env=env)


def test_table_lists_every_preset():
    res = run("formats", env=WIDE)
    assert res.exit_code == 0, res.output
    for name in preset_names():
        assert f" {name} " in res.stdout, name
    for header in ("name", "bias", "max finite", "min subnormal", "binades", "rounding"):
        assert header in res.stdout
    assert "57344" in res.stdout and "32768" in res.stdout and "448" in res.stdout
    assert res.stderr == ""


def test_table_lists_every_preset_at_80_columns():
    res = run("formats", env={"COLUMNS": "80"})
    assert res.exit_code == 0
    assert "…" not in res.stdout
    assert max(len(line) for line in res.stdout.splitlines()) <= 80
    for name in preset_names():
        assert f" {name} " in res.stdout, name
    assert "2^-9" in res.stdout and "57344" in res.stdout  # e4m3 min subnormal, e5m2 max
    assert "not shown at this width" in res.stdout  # the columns left out are named


def test_json_table():
    res = run("formats", "--json")
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    assert [r["name"] for r in rows] == preset_names()
    for r in rows:
        for k in KEYS:
            assert k in r, (r["name"], k)
    by = {r["name"]: r for r in rows}
    assert by["e4m3"]["max"] == 448
    assert by["e5m2"]["max"] == 57344
    assert by["hif8"]["max"] == 32768
    assert by["hfp8"]["max"] == 30
    assert by["e4m3fnuz"]["max"] == 240 and by["e5m2fnuz"]["max"] == 57344
    assert by["int8"]["max"] == 127
    assert (by["e4m3"]["exponent_bits"], by["e4m3"]["mantissa_bits"], by["e4m3"]["bias"]) == (
        4, 3, 7)
    assert (by["e5m2"]["exponent_bits"], by["e5m2"]["mantissa_bits"], by["e5m2"]["bias"]) == (
        5, 2, 15)
    assert by["hfp8"]["bias"] == 11 and by["e4m3fnuz"]["bias"] == 8
    assert by["e4m3"]["min_normal"] == 2.0**-6 and by["e4m3"]["min_subnormal"] == 2.0**-9
    assert by["e5m2"]["min_normal"] == 2.0**-14 and by["e5m2"]["min_subnormal"] == 2.0**-16
    assert by["hif8"]["min_normal"] == 2.0**-15 and by["hif8"]["min_subnormal"] == 2.0**-22
    assert by["hfp8"]["min_normal"] == by["hfp8"]["min_subnormal"] == 2.0**-10
    # the MX formats' elements are OCP e4m3 / e5m2 (OCP MX v1.0 sec. 5.3)
    assert {n for n, r in by.items() if r["has_inf"]} == {"e5m2", "hif8", "mxfp8-e5m2"}
    assert {n for n, r in by.items() if r["has_negative_zero"]} == {"e4m3", "e5m2", "mxfp8",
                                                                   "mxfp8-ceil", "mxfp8-e5m2"}
    assert by["hif8"]["binades"] == 38


@pytest.mark.parametrize("name,expect", [
    ("e4m3", "e4m3"), ("E4M3-FN", "e4m3"), ("fp8", "e4m3"), ("e3m4", "e3m4"),
    ("e4m3b11fnuz", "e4m3b11fnuz"),
])
def test_json_single_format(name, expect):
    res = run("formats", name, "--json")
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    assert len(rows) == 1 and rows[0]["name"] == expect


def test_codes_e5m2_json():
    res = run("formats", "e5m2", "--codes", "--json")
    assert res.exit_code == 0, res.output
    codes = json.loads(res.stdout)
    assert len(codes) == 256
    assert codes[0x7C] == "inf" and codes[0xFC] == "-inf"
    assert codes[0x7D] == codes[0x7E] == codes[0x7F] == "nan"
    assert codes[0xFD] == codes[0xFE] == codes[0xFF] == "nan"
    assert codes[0x7B] == 57344 and codes[0xFB] == -57344
    assert codes[0x00] == 0 and codes[0x01] == 2.0**-16
    assert codes[0x80] == 0 and math.copysign(1, codes[0x80]) == -1  # -0.0 kept
    assert codes[0x3C] == 1 and isinstance(codes[0x3C], int)


def test_codes_e4m3_and_hif8_json():
    codes = json.loads(run("formats", "e4m3", "--codes", "--json").stdout)
    assert codes[0x7E] == 448 and codes[0x7F] == "nan" and codes[0xFF] == "nan"
    assert "inf" not in codes and "-inf" not in codes
    codes = json.loads(run("formats", "hif8", "--codes", "--json").stdout)
    assert len(codes) == 256
    assert codes[0x6F] == "inf" and codes[0xEF] == "-inf" and codes[0x80] == "nan"
    assert codes[0x6E] == 32768 and codes[0x01] == 2.0**-22 and codes[0x00] == 0
    assert codes.count("nan") == 1


def test_codes_int8_json():
    res = run("formats", "int8", "--codes", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == list(range(128)) + list(range(-128, 0))


def test_codes_table():
    res = run("formats", "e4m3", "--codes", env=WIDE)
    assert res.exit_code == 0, res.output
    assert "0x7E" in res.stdout and "01111110" in res.stdout and "448" in res.stdout
    assert "256 codes" in res.stdout


@pytest.mark.parametrize("bad", ["nope", "e9m9", "e0m7"])
def test_unknown_format(bad):
    res = run("formats", bad)
    assert res.exit_code == 2
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: ")
    assert repr(bad) in lines[0]
    if bad == "nope":
        assert "unknown format" in lines[0]
        for name in preset_names():
            assert name in lines[0]


def test_unknown_format_with_codes_and_json():
    res = run("formats", "nope", "--codes", "--json")
    assert res.exit_code == 2 and res.stdout == ""
    assert "unknown format" in res.stderr and len(res.stderr.splitlines()) == 1


def test_codes_needs_a_name():
    res = run("formats", "--codes")
    assert res.exit_code == 2
    assert "--codes needs a format NAME" in res.output


@pytest.mark.slow
def test_subprocess_entry_point():
    """The real process: ``python -m fp8ptq.cli`` (the ``fp8ptq`` script's ``main``). One run only:
    importing torch in a fresh interpreter costs seconds."""
    out = subprocess.run([sys.executable, "-m", "fp8ptq.cli", "formats", "e4m3fnuz", "--codes",
                          "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    codes = json.loads(out.stdout)
    assert len(codes) == 256 and codes[0x80] == "nan" and codes[0x7F] == 240
