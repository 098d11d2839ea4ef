"""The README's Python example runs as written: extracted from README.md and executed on a tiny
Llama folder, it writes a checkpoint, evaluates it beside the baseline and reloads it."""

import re
from pathlib import Path

import pytest
import torch

from tiny_models import tiny, word_documents

ROOT = Path(__file__).resolve().parent.parent


def readme_python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


@pytest.mark.slow  # the example's own 64 x 512 (default) calibration tokens and GPTQ, and an eval
def test_readme_python_example_quantizes_evaluates_and_reloads(tmp_path, monkeypatch,
                                                               word_tokenizer):
    blocks = readme_python_blocks()
    assert len(blocks) == 1, "the README has one Python example; this test runs it"
    monkeypatch.chdir(tmp_path)  # the example reads model_dir, calib.txt, wiki.test.raw
    tiny("llama", dtype=torch.float32).save_pretrained(tmp_path / "model_dir")
    word_tokenizer.save_pretrained(tmp_path / "model_dir")
    word_documents(tmp_path / "calib.txt", 400, words=200)
    word_documents(tmp_path / "wiki.test.raw", 4, words=60, seed=1)
    namespace = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)  # noqa: S102 - our own README

    assert (tmp_path / "out" / "ckpt" / "fp8ptq.json").is_file()
    assert namespace["report"]["path"] == "in-memory"
    rows = namespace["result"].rows
    assert [r["kind"] for r in rows] == ["baseline", "checkpoint"]
    assert all(r["metrics"]["wikitext.word_perplexity"] > 1 for r in rows)
    loaded = namespace["loaded"].model
    assert any(type(m).__name__ == "QuantGemm" for m in loaded.modules())
