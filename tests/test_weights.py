"""``fp8ptq.io.weights``: the model filled from its safetensors tensor by tensor, through the one
reader (``fp8ptq.io.source.SafetensorsSource``) and the one key map (``fp8ptq.io.weight_map``) that
the model-free path uses: every parameter equal to ``from_pretrained``'s, each checkpoint tensor
read once, tied copies not read at all."""

import pytest
import torch

from fp8ptq.errors import DataError
from fp8ptq.io.source import SafetensorsSource
from fp8ptq.io.weights import WeightLoader, build_empty, empty_model, load_config, load_streaming
from fp8ptq.model.auto import model_class
from tiny_models import tiny


@pytest.fixture
def reads(monkeypatch):
    """Every tensor name read through the one reader, in order."""
    seen: list[str] = []
    original = SafetensorsSource.read_one

    def read_one(self, name):
        seen.append(name)
        return original(self, name)

    monkeypatch.setattr(SafetensorsSource, "read_one", read_one)
    return seen


@pytest.mark.parametrize("arch,dtype,config", [
    ("llama", torch.float32, {}), ("llama", torch.bfloat16, {"tie_word_embeddings": True}),
    ("gpt2", torch.bfloat16, {}), ("mixtral", torch.bfloat16, {}),
    ("qwen3_moe", torch.float32, {}), ("bert", torch.float32, {})])
def test_loaded_model_is_from_pretrained_bit_for_bit(arch, dtype, config, tmp_path, reads):
    model = tiny(arch, **config)
    folder = tmp_path / arch
    model.save_pretrained(folder, max_shard_size="50KB")
    cfg = load_config(str(folder), folder)
    got = load_streaming(folder, cfg, model_class(cfg), dtype)
    ref = type(model).from_pretrained(folder, dtype=dtype).eval()
    want = ref.state_dict()
    assert set(got.state_dict()) == set(want)
    for k, v in got.state_dict().items():
        assert v.dtype == want[k].dtype and torch.equal(v, want[k]), k
    names = SafetensorsSource(folder).names()
    assert sorted(reads) == sorted(set(reads)) and set(reads) <= set(names)  # each read once
    tied = set(getattr(ref, "all_tied_weights_keys", None) or {})
    assert not tied & set(reads)  # a tied copy comes from tie_weights, not from the file
    if tied:
        head, emb = next(iter(ref.all_tied_weights_keys.items()))
        assert got.get_parameter(head) is got.get_parameter(emb)


def test_block_by_block_loads_only_that_block(tmp_path, reads):
    folder = tmp_path / "m"
    tiny("llama").save_pretrained(folder, max_shard_size="50KB")
    model = build_empty(folder, torch.float32)
    loader = WeightLoader(model, SafetensorsSource(folder), torch.float32)
    loader.load(loader.under("model.layers.1."))
    assert reads and all(n.startswith("model.layers.1.") for n in reads)
    real = {n for n, p in model.named_parameters() if not p.is_meta}
    assert real == set(reads)
    assert not loader.uncovered()  # the checkpoint provides every parameter


def test_a_tensor_of_the_wrong_shape_is_one_line(tmp_path):
    folder = tmp_path / "m"
    tiny("llama").save_pretrained(folder)
    config = load_config(str(folder), folder)
    config.intermediate_size += 1  # the model now expects other MLP shapes than the file has
    model = empty_model(model_class(config), config, torch.float32)
    loader = WeightLoader(model, SafetensorsSource(folder), torch.float32)
    with pytest.raises(DataError, match=r"mlp\.\w+_proj\.weight has shape .* the model expects"):
        loader.load(loader.loads)
