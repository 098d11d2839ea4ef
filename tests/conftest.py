"""Shared test setup: the hub is never contacted and no test writes to the user's caches."""

import atexit
import os
import shutil
import tempfile

import pytest

# huggingface_hub and datasets read these at import time, so set them before any test module
# imports transformers; the autouse fixture keeps them in place for every test.
_SANDBOX = tempfile.mkdtemp(prefix="fp8ptq-tests-")
atexit.register(shutil.rmtree, _SANDBOX, ignore_errors=True)
_ENV = {
    "HF_HOME": os.path.join(_SANDBOX, "hf"),
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "FP8PTQ_CACHE": os.path.join(_SANDBOX, "fp8ptq-cache"),
}
os.environ.update(_ENV)


@pytest.fixture(autouse=True)
def _offline_sandbox(monkeypatch):
    for name, value in _ENV.items():
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="session")
def word_tokenizer():
    """A tiny GPT-style (eos, no pad) word-level tokenizer, built locally."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        "the quick brown fox jumps over the lazy dog",
        "a small model reads a few words of text",
        "hello world and hello again",
    ]
    backend = Tokenizer(models.WordLevel(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>")


@pytest.fixture
def calib(tmp_path):
    """A calibration text file of the ``word_tokenizer``'s words, for CLI quantize runs."""
    path = tmp_path / "calib.txt"
    path.write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    return path
