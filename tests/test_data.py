import hashlib
import json
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from fp8ptq.config.recipe import Recipe
from fp8ptq.errors import DataError, UsageError
from fp8ptq.evals.harness import prefix_token_id
from fp8ptq.io.data import (
    DEFAULT_CALIB,
    CalibrationSet,
    build_calibration_set,
    load_texts,
    resolve_calib_spec,
    start_ids,
    token_sha256,
)

ASSETS = Path(__file__).resolve().parents[1].parent / "shared" / "assets"
MINILM = ASSETS / "models" / "minilm-squad"
needs_assets = pytest.mark.skipif(not ASSETS.is_dir(), reason="shared assets not present")

DOCS = ["the quick brown fox", "jumps over the lazy dog", "hello world"]


def write(path: Path, text: str) -> str:
    path.write_bytes(text.encode("utf-8"))
    return str(path)


# --- load_texts ----------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".txt", ".raw"])
def test_line_files_strip_and_skip_blank_lines(tmp_path, suffix):
    spec = write(tmp_path / f"c{suffix}",
                 "  the quick brown fox \r\n\r\njumps over the lazy dog\r\n   \nhello world")
    assert load_texts(spec) == DOCS


def test_json_list_of_strings(tmp_path):
    assert load_texts(write(tmp_path / "c.json", json.dumps(DOCS + ["  "]))) == DOCS


def test_json_records_default_and_custom_field(tmp_path):
    spec = write(tmp_path / "c.json", json.dumps([{"text": d, "body": d.upper()} for d in DOCS]))
    assert load_texts(spec) == DOCS
    assert load_texts(spec, text_field="body") == [d.upper() for d in DOCS]


def test_json_data_object(tmp_path):
    spec = write(tmp_path / "c.json",
                 json.dumps({"version": 2, "data": [{"text": d} for d in DOCS]}))
    assert load_texts(spec) == DOCS


def test_json_squad_uses_contexts(tmp_path):
    squad = {
        "version": "1.1",
        "data": [
            {"title": "A", "paragraphs": [{"context": DOCS[0], "qas": []},
                                          {"context": DOCS[1], "qas": []}]},
            {"title": "B", "paragraphs": [{"context": DOCS[2], "qas": [{"question": "q?"}]}]},
        ],
    }
    assert load_texts(write(tmp_path / "squad.json", json.dumps(squad))) == DOCS


@needs_assets
def test_squad_asset():
    texts = load_texts(str(ASSETS / "squad-v1.1" / "dev-train.json"))
    assert len(texts) > 100
    assert texts[0].startswith("Super Bowl 50 was an American football game")


def test_jsonl(tmp_path):
    lines = [json.dumps({"id": i, "text": d}) for i, d in enumerate(DOCS)]
    spec = write(tmp_path / "c.jsonl", "\n".join(lines[:2]) + "\n\n" + lines[2] + "\n")
    assert load_texts(spec) == DOCS


def test_jsonl_custom_field(tmp_path):
    spec = write(tmp_path / "c.jsonl", "\n".join(json.dumps({"content": d}) for d in DOCS))
    assert load_texts(spec, text_field="content") == DOCS


def test_parquet(tmp_path):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    path = tmp_path / "c.parquet"
    pd.DataFrame({"text": DOCS + [None], "label": [0, 1, 2, 3]}).to_parquet(path)
    assert load_texts(str(path)) == DOCS
    with pytest.raises(DataError, match=r"no text column 'body'; available columns: text, label"):
        load_texts(str(path), text_field="body")


def test_missing_field_lists_available_fields(tmp_path):
    spec = write(tmp_path / "c.jsonl", json.dumps({"id": 1, "content": "x"}))
    with pytest.raises(DataError, match=r"no text field 'text'; available fields: id, content"):
        load_texts(spec)
    spec = write(tmp_path / "c.json", json.dumps([{"body": "x"}]))
    with pytest.raises(DataError, match=r"no text field 'text'; available fields: body"):
        load_texts(spec)


def test_non_text_field(tmp_path):
    spec = write(tmp_path / "c.jsonl", json.dumps({"text": 3}))
    with pytest.raises(DataError, match="holds int, not text"):
        load_texts(spec)


def test_bad_json_line(tmp_path):
    spec = write(tmp_path / "c.jsonl", json.dumps({"text": "ok"}) + "\n{oops\n")
    with pytest.raises(DataError, match=r"c.jsonl:2: not valid JSON"):
        load_texts(spec)


@pytest.mark.parametrize("spec", ["missing.txt", "data/missing.jsonl", "./missing",
                                  "a/b/missing.csv"])
def test_missing_file_names_the_path(spec):
    with pytest.raises(DataError, match="not found") as excinfo:
        load_texts(spec)
    assert spec in str(excinfo.value)


@pytest.mark.parametrize("suffix, content", [(".txt", "\r\n  \n"), (".json", "[]"), (".jsonl", "")])
def test_empty_file(tmp_path, suffix, content):
    with pytest.raises(DataError, match="no text"):
        load_texts(write(tmp_path / f"empty{suffix}", content))


def test_unsupported_suffix(tmp_path):
    with pytest.raises(DataError, match="unsupported calibration file type '.csv'"):
        load_texts(write(tmp_path / "c.csv", "text\nhello\n"))


def test_hub_dataset_offline_is_one_clear_error():
    start = time.perf_counter()
    with pytest.raises(UsageError) as excinfo:
        load_texts("no-such-dataset-xyz:cfg:train")
    assert time.perf_counter() - start < 30
    assert excinfo.type is UsageError
    message = str(excinfo.value)
    assert "hub is unreachable" in message and "local" in message
    assert "\n" not in message


def test_resolve_calib_spec():
    assert resolve_calib_spec(None) == DEFAULT_CALIB == "wikitext:wikitext-2-raw-v1:train"
    assert resolve_calib_spec("") == DEFAULT_CALIB
    assert resolve_calib_spec("my.txt") == "my.txt"


@needs_assets
def test_wikitext_raw_asset():
    texts = load_texts(str(ASSETS / "wikitext-2-raw" / "wiki.test.raw"))
    assert texts[0] == "= Robert Boulter ="
    assert not any("\r" in t for t in texts)


# --- build_calibration_set -----------------------------------------------------------------


@pytest.fixture
def corpus():
    return [" ".join(["the quick brown fox jumps over the lazy dog"] * 3),
            "hello world and hello again"] * 20


def test_shape_and_metadata(corpus, word_tokenizer):
    calib = build_calibration_set(corpus, word_tokenizer, num_samples=8, seq_len=16, seed=3,
                                  source="mem")
    assert isinstance(calib, CalibrationSet)
    assert calib.input_ids.shape == (8, 16) and calib.input_ids.dtype == torch.long
    assert (calib.num_samples, calib.seq_len, calib.seed, calib.source) == (8, 16, 3, "mem")
    per_doc = [len(word_tokenizer(d, add_special_tokens=False)["input_ids"]) for d in corpus]
    assert calib.num_tokens == sum(per_doc) + len(corpus) - 1  # one eos between documents


def test_windows_are_slices_of_the_eos_joined_corpus(corpus, word_tokenizer):
    calib = build_calibration_set(corpus, word_tokenizer, num_samples=4, seq_len=20)
    eos = word_tokenizer.eos_token_id
    joined = []
    for i, doc in enumerate(corpus):
        joined += ([eos] if i else []) + word_tokenizer(doc, add_special_tokens=False)["input_ids"]
    assert len(joined) == calib.num_tokens
    for row in calib.input_ids.tolist():
        assert any(joined[s : s + 20] == row for s in range(len(joined) - 19))


def test_seeded_sampling_is_deterministic(corpus, word_tokenizer):
    a = build_calibration_set(corpus, word_tokenizer, num_samples=6, seq_len=12, seed=7)
    b = build_calibration_set(corpus, word_tokenizer, num_samples=6, seq_len=12, seed=7)
    c = build_calibration_set(corpus, word_tokenizer, num_samples=6, seq_len=12, seed=8)
    assert torch.equal(a.input_ids, b.input_ids) and a.sha256 == b.sha256
    assert not torch.equal(a.input_ids, c.input_ids) and a.sha256 != c.sha256


def test_hash_is_sha256_of_int64_token_bytes():
    ids = torch.arange(6).reshape(2, 3)
    assert token_sha256(ids) == hashlib.sha256(np.arange(6, dtype="<i8").tobytes()).hexdigest()
    # A fixed value, so a change of hashing scheme cannot go unnoticed.
    assert token_sha256(ids) == "f190072c5052f4f440d4a607c25f5bced487c420806c9aab4ca5b0653e72da61"
    assert token_sha256(ids.to(torch.int32)) == token_sha256(ids)


def test_too_short(word_tokenizer):
    with pytest.raises(DataError, match=r"calibration data too short: 4 tokens, need at least 9"):
        build_calibration_set(["the quick brown fox"], word_tokenizer, num_samples=2, seq_len=8)


def test_overlap_warns(word_tokenizer):
    docs = ["the quick brown fox jumps over the lazy dog"] * 4  # 39 tokens
    with pytest.warns(UserWarning, match="windows will overlap"):
        calib = build_calibration_set(docs, word_tokenizer, num_samples=8, seq_len=16)
    assert calib.input_ids.shape == (8, 16)


def test_no_warning_when_corpus_is_large(corpus, word_tokenizer):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_calibration_set(corpus, word_tokenizer, num_samples=4, seq_len=16)


def test_invalid_sizes(corpus, word_tokenizer):
    with pytest.raises(UsageError, match="must be positive"):
        build_calibration_set(corpus, word_tokenizer, num_samples=0, seq_len=16)


@pytest.mark.skipif(not MINILM.is_dir(), reason="shared assets not present")
def test_bert_tokenizer_uses_sep_and_no_length_warning(capfd):
    tokenizer = AutoTokenizer.from_pretrained(MINILM)
    long_doc = "the quick brown fox jumps over the lazy dog " * 100  # > 512 tokens
    calib = build_calibration_set([long_doc, long_doc], tokenizer, num_samples=1, seq_len=1800)
    assert calib.num_tokens == 2 * 900 + 1
    # Either window position covers the [SEP] between the two documents.
    assert tokenizer.sep_token_id in calib.input_ids[0].tolist()
    assert "longer than the specified maximum" not in capfd.readouterr().err


# --- windows="documents" --------------------------------------------------------------------


def _joined(docs, tokenizer):
    """The eos-joined corpus and where each document starts in it."""
    eos = tokenizer.eos_token_id
    joined, starts = [], []
    for i, doc in enumerate(docs):
        joined += [eos] if i else []
        starts.append(len(joined))
        joined += tokenizer(doc, add_special_tokens=False)["input_ids"]
    return joined, starts


def test_document_windows_open_documents_after_the_start_token(word_tokenizer):
    # document i opens with i + 1 "hello"s: every window start tells its document apart
    docs = [" ".join(["hello"] * (i + 1)) + " world and the lazy dog" for i in range(8)]
    calib = build_calibration_set(docs, word_tokenizer, num_samples=6, seq_len=10, seed=1,
                                  windows="documents")
    joined, starts = _joined(docs, word_tokenizer)
    assert calib.windows == "documents" and calib.input_ids.shape == (6, 10)
    eos = word_tokenizer.eos_token_id  # no BOS in this tokenizer: EOS opens every window
    opened = []
    for row in calib.input_ids.tolist():
        assert row[0] == eos
        matches = [s for s in starts if joined[s : s + 9] == row[1:]]
        assert len(matches) == 1  # the rest of the window is the text from a document start
        opened.append(matches[0])
    assert len(set(opened)) == 6  # without replacement while documents last
    again = build_calibration_set(docs, word_tokenizer, num_samples=6, seq_len=10, seed=1,
                                  windows="documents")
    assert torch.equal(again.input_ids, calib.input_ids)
    other = build_calibration_set(docs, word_tokenizer, num_samples=6, seq_len=10, seed=2,
                                  windows="documents")
    assert not torch.equal(other.input_ids, calib.input_ids)
    # the random windows of the same seed are different tokens (and a different hash)
    assert build_calibration_set(docs, word_tokenizer, num_samples=6, seq_len=10,
                                 seed=1).sha256 != calib.sha256


def test_document_windows_run_on_past_short_documents_and_reuse_when_few(word_tokenizer):
    docs = ["hello world", "the quick brown fox", "a small model reads"]  # 2-4 tokens each
    with pytest.warns(UserWarning, match="windows will overlap"):
        calib = build_calibration_set(docs, word_tokenizer, num_samples=5, seq_len=6, seed=0,
                                      windows="documents")
    joined, starts = _joined(docs, word_tokenizer)
    # only documents with 5 tokens of text after their start can open a window: 0 and 1
    eligible = [s for s in starts if s + 5 <= len(joined)]
    assert eligible == starts[:2]
    rows = [row[1:] for row in calib.input_ids.tolist()]
    assert all(row in [joined[s : s + 5] for s in eligible] for row in rows)
    # the window crosses the eos into the next document; both documents used before any twice
    assert word_tokenizer.eos_token_id in rows[0]
    assert {tuple(r) for r in rows[:2]} == {tuple(joined[s : s + 5]) for s in eligible}


def test_document_windows_start_with_bos_when_the_tokenizer_has_one():
    backend = Tokenizer(models.WordLevel(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.train_from_iterator(["hello world and the quick brown fox"],
                                trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>",
                                        eos_token="</s>", unk_token="<unk>")
    docs = ["hello world and the quick brown fox"] * 4
    calib = build_calibration_set(docs, tokenizer, num_samples=3, seq_len=5, windows="documents")
    bos = tokenizer.convert_tokens_to_ids("<s>")
    assert calib.input_ids[:, 0].tolist() == [bos] * 3
    assert calib.input_ids[0, 1:].tolist() == tokenizer("hello world and the")["input_ids"]


def _chat_tokenizer(template: str):
    """No BOS added on encoding, a BOS ``<s>``, and a chat template (Qwen2.5 / SmolLM2-Instruct
    style: ``<|im_start|>`` a special token that is not the BOS)."""
    text = "hello world and the quick brown fox user assistant"
    backend = Tokenizer(models.WordLevel(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.train_from_iterator([text], trainers.WordLevelTrainer(
        special_tokens=["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tokenizer.chat_template = template
    return tokenizer


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>"
          "{% endfor %}")


def test_windows_and_evaluation_open_with_the_chat_templates_first_token():
    tokenizer = _chat_tokenizer(CHATML)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert im_start != tokenizer.bos_token_id
    assert tokenizer("hello")["input_ids"][0] != tokenizer.bos_token_id  # no BOS added
    docs = ["hello world and the quick brown fox"] * 4
    calib = build_calibration_set(docs, tokenizer, num_samples=3, seq_len=5, windows="documents")
    # what a server opens every chat request with, not the BOS the tokenizer never adds
    assert calib.input_ids[:, 0].tolist() == [im_start] * 3
    assert calib.start_ids == (im_start,)
    # evaluation's rolling log-likelihood takes the same first token
    assert start_ids(tokenizer) == [im_start] and prefix_token_id(tokenizer, "auto") == im_start
    # an explicit choice is followed by both
    for choice, want in (("eos", [tokenizer.eos_token_id]), ("bos", [tokenizer.bos_token_id]),
                         ("none", [])):
        c = build_calibration_set(docs, tokenizer, num_samples=2, seq_len=5,
                                  windows="documents", start=choice)
        assert c.input_ids[0, :len(want)].tolist() == want and c.start_ids == tuple(want)
        assert c.input_ids[0, len(want):].tolist() == \
            tokenizer("hello world and the quick", add_special_tokens=False)["input_ids"][
                :5 - len(want)]
        assert prefix_token_id(tokenizer, choice) == (want[0] if want else None)


def test_a_template_opening_with_text_or_failing_leaves_the_bos():
    bos = None
    for template in ("user: {{ messages[0]['content'] }}", "{{ raise_exception('no') }}"):
        tokenizer = _chat_tokenizer(template)
        bos = tokenizer.bos_token_id
        assert start_ids(tokenizer) == [bos]
        assert prefix_token_id(tokenizer, "auto") == bos
    with pytest.raises(UsageError, match="start token must be one of"):
        start_ids(tokenizer, "cls")


def test_unknown_window_kind(corpus, word_tokenizer):
    with pytest.raises(UsageError, match="calibration windows must be one of random, documents"):
        build_calibration_set(corpus, word_tokenizer, num_samples=2, seq_len=8, windows="chunks")
    with pytest.raises(UsageError, match="calib_windows"):
        Recipe(calib_windows="chunks")


@pytest.mark.skipif(not MINILM.is_dir(), reason="shared assets not present")
def test_document_windows_of_an_encoder_open_with_cls():
    tokenizer = AutoTokenizer.from_pretrained(MINILM)
    docs = ["the quick brown fox jumps over the lazy dog " * 3] * 4
    calib = build_calibration_set(docs, tokenizer, num_samples=2, seq_len=8, windows="documents")
    assert calib.input_ids[:, 0].tolist() == [tokenizer.cls_token_id] * 2
    assert calib.input_ids[0, 1:].tolist() == tokenizer(docs[0], add_special_tokens=False)[
        "input_ids"][:7]
