"""fp8ptq.evals.report: deltas, table, markdown, JSON, plot and CI gates (pure functions)."""

import json
import math

import pytest
from rich.console import Console

from fp8ptq.errors import UsageError
from fp8ptq.evals.report import (
    check_gates,
    deltas,
    higher_is_better,
    plot_deltas,
    render_table,
    to_json,
    to_markdown,
)

VARIANTS = [
    {"name": "baseline", "metrics": {"wikitext.word_perplexity": 20.0, "squad.f1": 80.0},
     "seconds": 10.0},
    {"name": "int8", "metrics": {"wikitext.word_perplexity": 20.5, "squad.f1": 79.0},
     "seconds": 12.0,
     "recipe": {"format": "int8"}},
    {"name": "e4m3", "metrics": {"wikitext.word_perplexity": 21.0, "squad.f1": 81.0},
     "seconds": 11.0,
     "recipe": {"format": "e4m3"}},
]


def test_direction():
    assert not higher_is_better("wikitext.word_perplexity")
    assert not higher_is_better("wikitext.bits_per_byte")
    assert higher_is_better("squad.exact_match") and higher_is_better("squad.f1")
    assert higher_is_better("hellaswag.acc_norm")
    with pytest.raises(UsageError):
        higher_is_better("task.mystery")


def test_deltas_against_first_variant():
    assert deltas(VARIANTS) == [
        {"wikitext.word_perplexity": 0.0, "squad.f1": 0.0},
        {"wikitext.word_perplexity": 0.5, "squad.f1": -1.0},
        {"wikitext.word_perplexity": 1.0, "squad.f1": 1.0},
    ]


def test_table_and_markdown_show_value_and_delta():
    console = Console(width=200, record=True)
    console.print(render_table(VARIANTS, "abs"))
    text = console.export_text()
    assert "20.5 (+0.5)" in text and "79 (-1)" in text and "baseline" in text
    markdown = to_markdown(VARIANTS, "abs")
    lines = markdown.strip().splitlines()
    assert lines[0] == "| variant | wikitext.word_perplexity | squad.f1 | seconds |"
    assert len(lines) == 2 + len(VARIANTS)
    assert "| e4m3 | 21 (+1) | 81 (+1) | 11.0 |" in lines
    # relative deltas are the default (issue: people and release gates think in percent)
    assert "| e4m3 | 21 (+5.0%) | 81 (+1.2%) | 11.0 |" in to_markdown(VARIANTS).splitlines()


def test_json_schema_is_strict_json():
    broken = VARIANTS + [
        {"name": "broken", "metrics": {"wikitext.word_perplexity": math.inf}, "seconds": 1.0}
    ]
    doc = to_json(broken, {"wikitext": {"context_length": 2048}}, {"calibration": "max"})
    assert doc["schema_version"] == 1
    assert doc["protocol"] == {"wikitext": {"context_length": 2048}}
    assert [v["name"] for v in doc["variants"]] == ["baseline", "int8", "e4m3", "broken"]
    assert doc["variants"][1]["deltas"] == {"wikitext.word_perplexity": 0.5, "squad.f1": -1.0}
    assert doc["variants"][3]["metrics"] == {"wikitext.word_perplexity": None}
    json.dumps(doc, allow_nan=False)


def test_plot_writes_png(tmp_path):
    path = plot_deltas(VARIANTS, tmp_path / "deltas.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gates_absolute_and_percent_are_direction_aware():
    # perplexity rose by 0.5 (int8) and 1.0 (e4m3) = 2.5 % and 5 %
    assert check_gates(VARIANTS, ["wikitext.word_perplexity=1.0"]) == []
    failures = check_gates(VARIANTS, ["wikitext.word_perplexity=0.6"])
    assert len(failures) == 1 and failures[0].startswith("e4m3: wikitext.word_perplexity")
    assert len(check_gates(VARIANTS, ["word_perplexity=2%"])) == 2  # bare metric name
    assert check_gates(VARIANTS, ["word_perplexity=5%"]) == []
    # f1 fell by 1 for int8 only; e4m3's rise is an improvement
    failures = check_gates(VARIANTS, ["squad.f1=0.5"])
    assert len(failures) == 1 and failures[0].startswith("int8:")
    assert check_gates(VARIANTS, ["squad.f1=1.25%"]) == []
    assert check_gates(VARIANTS, ["squad.f1=0"]) != []


def test_gate_missing_or_nan_metric_fails():
    variants = VARIANTS[:1] + [{"name": "nan", "metrics": {"squad.f1": math.nan}, "seconds": 1.0}]
    assert len(check_gates(variants, ["squad.f1=100", "wikitext.word_perplexity=100"])) == 2


@pytest.mark.parametrize(
    "gate",
    [
        "wikitext.word_perplexity", "word_perplexity=abc", "word_perplexity=-1", "=1", "f1=1%%",
        "acc=1", "squad.f2=1",
    ],
)
def test_bad_gates_are_usage_errors(gate):
    with pytest.raises(UsageError):
        check_gates(VARIANTS, [gate])
