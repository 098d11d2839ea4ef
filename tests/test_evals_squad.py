"""SQuAD v1.1 metric (official normalisation, EM, F1), data loading, and the real MiniLM QA
model."""

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from fp8ptq.errors import DataError
from fp8ptq.evals.squad import exact_match, f1, load_examples, normalize_answer, score, score_all

ASSETS = Path(__file__).resolve().parents[1] / ".." / "shared" / "assets"
HELDOUT = ASSETS / "squad-v1.1" / "dev-heldout.json"
MINILM = ASSETS / "models" / "minilm-squad"


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("The Denver Broncos", "denver broncos"),
        ("  New \t York\n", "new york"),
        ("U.S. (1945)!", "us 1945"),
        ("An apple a day", "apple day"),
        ("another theatre", "another theatre"),  # articles only as whole words
        ("the-the", "thethe"),  # punctuation goes first, so no article is left to remove
    ],
)
def test_normalize_answer(raw, normal):
    assert normalize_answer(raw) == normal


def test_exact_match_and_f1_by_hand():
    assert exact_match("the Denver Broncos.", "Denver Broncos") == 1.0
    assert exact_match("Broncos", "Denver Broncos") == 0.0
    # "blue river" vs "blue river flows": P = 2/2, R = 2/3 -> F1 = 0.8
    assert f1("the Blue River", "Blue River flows") == pytest.approx(0.8)
    # duplicates count once per gold occurrence: P = 1/2, R = 1/1 -> 2/3
    assert f1("the cat cat", "cat") == pytest.approx(2 / 3)
    assert f1("dog", "cat") == 0.0
    assert f1("", "cat") == 0.0


def test_score_takes_best_gold_answer():
    golds = ["Paris", "the city of Paris"]
    assert score("city of Paris", golds) == {"exact_match": 100.0, "f1": 100.0}
    # vs "Paris": P = 1/3, R = 1 -> 50; vs "city of paris": P = 2/3 (city, paris), R = 2/3 -> 66.7
    assert score("in Paris city", golds)["f1"] == pytest.approx(200 / 3)
    assert score_all(["Paris", "Rome"], [{"answers": golds}, {"answers": ["Milan"]}]) == {
        "exact_match": 50.0,
        "f1": 50.0,
    }


def test_load_examples_order_limit_and_errors(tmp_path):
    squad = {"data": [{"title": "T", "paragraphs": [{"context": "c", "qas": [
        {"id": str(i), "question": f"q{i}", "answers": [{"text": f"a{i}", "answer_start": 0}]}
        for i in range(5)
    ]}]}]}
    path = tmp_path / "dev.json"
    path.write_text(json.dumps(squad))
    examples = load_examples(path, limit=3)
    assert [e["question"] for e in examples] == ["q0", "q1", "q2"]
    assert examples[0] == {"id": "0", "title": "T", "context": "c", "question": "q0",
                           "answers": ["a0"]}
    with pytest.raises(DataError):
        load_examples(tmp_path / "missing.json")
    path.write_text('{"data": [{"paragraphs": [{"qas": []}]}]}')
    with pytest.raises(DataError):
        load_examples(path)


@pytest.mark.slow
@pytest.mark.skipif(not MINILM.is_dir() or not HELDOUT.is_file(), reason="needs ../shared/assets")
def test_minilm_extractive_squad(monkeypatch, tmp_path):
    import torch
    from transformers import AutoModelForQuestionAnswering, AutoTokenizer

    from fp8ptq.evals.runner import run_tasks

    monkeypatch.setenv("HF_HOME", str(tmp_path))
    tokenizer = AutoTokenizer.from_pretrained(MINILM)
    model = AutoModelForQuestionAnswering.from_pretrained(MINILM, dtype=torch.float32).eval()
    result = run_tasks(model, tokenizer, ["squad"], data={"squad": str(HELDOUT)}, limit=40,
                       batch_size=20)
    assert 30 <= result.metrics["squad.exact_match"] <= 90
    assert result.metrics["squad.exact_match"] <= result.metrics["squad.f1"] <= 95
    protocol = result.protocol["squad"]
    assert protocol["mode"] == "extractive" and protocol["questions"] == 40
    assert protocol["max_length"] == 384 and protocol["stride"] == 128
