"""The README's Python example runs as written: extracted from README.md and executed on a tiny
Llama, it writes a checkpoint that reloads to the model it quantized."""

import re
from pathlib import Path

import pytest
import torch

from tiny_models import IDS, tiny, word_documents

ROOT = Path(__file__).resolve().parent.parent


def readme_python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


@pytest.mark.slow  # the example's own 128 x 512 calibration tokens and GPTQ
def test_readme_python_example_quantizes_saves_and_reloads(tmp_path, monkeypatch,
                                                          word_tokenizer):
    blocks = readme_python_blocks()
    assert len(blocks) == 1, "the README has one Python example; this test runs it"
    monkeypatch.chdir(tmp_path)  # the example writes out/ckpt and reads calib.txt
    word_documents(tmp_path / "calib.txt", 400, words=200)
    model = tiny("llama", dtype=torch.float32)
    namespace = {"model": model, "tokenizer": word_tokenizer}
    exec(compile(blocks[0], "README.md", "exec"), namespace)  # noqa: S102 - our own README

    assert (tmp_path / "out" / "ckpt" / "fp8ptq.json").is_file()
    quantized, loaded = namespace["result"].model, namespace["loaded"].model
    assert quantized is model  # quantized in place, as the example says
    assert any(type(m).__name__ == "QuantGemm" for m in loaded.modules())
    with torch.no_grad():
        expected = quantized(input_ids=IDS).logits
        got = loaded(input_ids=IDS).logits
    assert torch.equal(got, expected)
