import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    BertConfig,
    GPT2Config,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
)

from fp8ptq.errors import UsageError
from fp8ptq.io import loading
from fp8ptq.io.loading import LoadedModel, gguf_cache_dir, load_model, model_class
from tiny_gguf import tiny_llama_gguf
from tiny_models import tiny

ASSETS = Path(__file__).resolve().parents[1].parent / "shared" / "assets"
MINILM = ASSETS / "models" / "minilm-squad"
SMOLLM_GGUF = ASSETS / "models" / "smollm2-135m" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def tiny_llama(tokenizer):
    return tiny("llama", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                eos_token_id=tokenizer.eos_token_id)


@pytest.fixture
def tiny_llama_dir(tmp_path, word_tokenizer):
    folder = tmp_path / "tiny-llama"
    tiny_llama(word_tokenizer).save_pretrained(folder)
    word_tokenizer.save_pretrained(folder)
    return folder


def test_local_folder(tiny_llama_dir):
    loaded = load_model(str(tiny_llama_dir))
    assert isinstance(loaded, LoadedModel)
    assert isinstance(loaded.model, LlamaForCausalLM)
    assert loaded.kind == "local"
    assert loaded.source == str(tiny_llama_dir)
    assert loaded.resolved_path == str(tiny_llama_dir.resolve())
    assert not loaded.model.training
    assert loaded.model.dtype == torch.float32
    # The tokenizer had no pad token: it borrows eos.
    assert loaded.tokenizer.pad_token == loaded.tokenizer.eos_token == "</s>"
    with torch.no_grad():
        ids = loaded.tokenizer("the quick fox", return_tensors="pt").input_ids
        logits = loaded.model(ids).logits
    assert logits.shape[-1] == len(loaded.tokenizer)


def test_local_folder_dtype_and_relative_path(tiny_llama_dir, monkeypatch):
    monkeypatch.chdir(tiny_llama_dir.parent)
    loaded = load_model("./tiny-llama", dtype=torch.bfloat16)
    assert loaded.model.dtype == torch.bfloat16
    assert loaded.source == "./tiny-llama"
    assert loaded.resolved_path == str(tiny_llama_dir.resolve())


def test_task_overrides_architecture(tiny_llama_dir):
    loaded = load_model(str(tiny_llama_dir), task="base")
    assert type(loaded.model) is LlamaModel


def test_unknown_task(tiny_llama_dir):
    with pytest.raises(UsageError, match="unknown task 'translate'"):
        load_model(str(tiny_llama_dir), task="translate")


@pytest.mark.parametrize(
    "config, task, expected",
    [
        (BertConfig(architectures=["BertForQuestionAnswering"]), None,
         AutoModelForQuestionAnswering),
        (BertConfig(architectures=["BertForSequenceClassification"]), None,
         AutoModelForSequenceClassification),
        (LlamaConfig(architectures=["LlamaForCausalLM"]), None, AutoModelForCausalLM),
        (GPT2Config(architectures=["GPT2LMHeadModel"]), None, AutoModelForCausalLM),
        (BertConfig(architectures=["BertModel"]), None, AutoModel),
        (BertConfig(), None, AutoModel),
        (BertConfig(architectures=["BertForQuestionAnswering"]), "causal-lm", AutoModelForCausalLM),
        (LlamaConfig(architectures=["LlamaForCausalLM"]), "qa", AutoModelForQuestionAnswering),
    ],
)
def test_model_class(config, task, expected):
    assert model_class(config, task) is expected


@pytest.mark.skipif(not MINILM.is_dir(), reason="shared assets not present")
def test_question_answering_asset():
    loaded = load_model(str(MINILM))
    assert type(loaded.model).__name__ == "BertForQuestionAnswering"
    assert loaded.model.dtype == torch.float32  # stored as fp16, loaded as asked
    assert loaded.tokenizer.pad_token == "[PAD]"
    assert loaded.kind == "local"


def test_hub_id_offline_is_one_clear_error():
    start = time.perf_counter()
    with pytest.raises(UsageError) as excinfo:
        load_model("nobody-here/no-such-model")
    assert time.perf_counter() - start < 10
    message = str(excinfo.value)
    assert "cannot load model 'nobody-here/no-such-model'" in message
    assert "hub is unreachable" in message
    assert "\n" not in message


def test_hub_id_unreachable_without_offline_mode(monkeypatch):
    # Not in offline mode but no connection: fail at once instead of the hub client's retries.
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(loading, "hub_reachable", lambda timeout=2.0: False)
    start = time.perf_counter()
    with pytest.raises(UsageError, match="hub is unreachable"):
        load_model("gpt2")
    assert time.perf_counter() - start < 10


@pytest.mark.parametrize("spec", ["./missing-model", "/nonexistent/dir/model", "a/b/c",
                                  "missing.gguf"])
def test_missing_path(spec):
    with pytest.raises(UsageError, match="no such file or folder"):
        load_model(spec)


def test_folder_without_config(tmp_path):
    with pytest.raises(UsageError, match="no config.json"):
        load_model(str(tmp_path))


def test_missing_tokenizer(tmp_path, word_tokenizer):
    tiny_llama(word_tokenizer).save_pretrained(tmp_path)
    with pytest.raises(UsageError, match="tokenizer"):
        load_model(str(tmp_path))


def test_gguf_cache_roundtrip(tmp_path, monkeypatch):
    """A real (tiny) GGUF converted once into the cache, loaded from it every time after."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("FP8PTQ_CACHE", str(cache))
    gguf = tiny_llama_gguf(tmp_path / "tiny.gguf")
    conversions = []
    real = loading.convert_gguf

    def counted(path, target, task=None):
        conversions.append(path)
        return real(path, target, task)

    monkeypatch.setattr(loading, "convert_gguf", counted)
    first = load_model(str(gguf))
    second = load_model(str(gguf))
    assert conversions == [gguf.resolve()]
    assert first.kind == second.kind == "gguf"
    assert first.source == str(gguf)
    entry = gguf_cache_dir(gguf.resolve())
    assert first.resolved_path == str(entry)
    assert entry.parent == cache / "gguf" and entry.name.startswith("tiny-")
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]  # no temp dirs left behind
    for a, b in zip(first.model.state_dict().values(), second.model.state_dict().values()):
        assert torch.equal(a, b)
    assert first.tokenizer("the cat").input_ids == second.tokenizer("the cat").input_ids

    # A changed file is a new cache entry.
    tiny_llama_gguf(gguf, seed=1)
    load_model(str(gguf))
    assert len(conversions) == 2


def test_gguf_converted_once_by_runs_started_together(tmp_path, monkeypatch):
    """Two loads of a GGUF not yet in the cache, the second starting while the first is still
    converting: one conversion, and the second reads the first one's folder."""
    monkeypatch.setenv("FP8PTQ_CACHE", str(tmp_path / "cache"))
    gguf = tiny_llama_gguf(tmp_path / "tiny.gguf")
    started, release, conversions = threading.Event(), threading.Event(), []
    real = loading.convert_gguf

    def slow(path, target, task=None):
        conversions.append(path)
        started.set()
        assert release.wait(30)  # the second load starts while this one converts
        return real(path, target, task)

    monkeypatch.setattr(loading, "convert_gguf", slow)
    folders = []
    first = threading.Thread(target=lambda: folders.append(loading.gguf_folder(gguf.resolve())))
    first.start()
    assert started.wait(30)
    second = threading.Thread(target=lambda: folders.append(loading.gguf_folder(gguf.resolve())))
    second.start()
    time.sleep(0.2)  # the second reaches the cache check and waits on the first
    release.set()
    first.join(30)
    second.join(30)
    assert conversions == [gguf.resolve()]
    assert folders == [gguf_cache_dir(gguf.resolve())] * 2
    assert (folders[0] / "config.json").is_file()
    assert [p.name for p in folders[0].parent.iterdir()] == [folders[0].name]


@pytest.mark.slow
@pytest.mark.skipif(not SMOLLM_GGUF.is_file(), reason="shared assets not present")
def test_real_gguf_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("FP8PTQ_CACHE", str(tmp_path))
    start = time.perf_counter()
    first = load_model(str(SMOLLM_GGUF))
    uncached_s = time.perf_counter() - start
    start = time.perf_counter()
    second = load_model(str(SMOLLM_GGUF))
    cached_s = time.perf_counter() - start
    print(f"\nGGUF load: uncached {uncached_s:.1f} s, cached {cached_s:.1f} s")

    for loaded in (first, second):
        assert isinstance(loaded.model, LlamaForCausalLM)
        assert loaded.kind == "gguf"
        assert loaded.model.config.num_hidden_layers == 30
        assert all(type(m) is torch.nn.Linear for m in loaded.model.modules()
                   if "Linear" in type(m).__name__)
    assert cached_s < uncached_s / 3

    ids = second.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        next_id = second.model(ids).logits[0, -1].argmax()
    assert second.tokenizer.decode(next_id).strip() == "Paris"
