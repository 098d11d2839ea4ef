"""The library owns the flow: ``fp8ptq.quantize`` and ``fp8ptq.evaluate`` do what the
``quantize`` and ``eval`` commands do (the CLI only parses and prints), and importing the
package or its CLI sets nothing up in the process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from safetensors.torch import load_file

import fp8ptq
from tiny_models import STATIC, STATIC_RECIPE, invoke, tiny

DOCS = ["the quick brown fox jumps over the lazy dog", "a small model reads a few words of text",
        "hello world and hello again"] * 10


@pytest.fixture(scope="module")
def assets(tmp_path_factory, word_tokenizer):
    root = tmp_path_factory.mktemp("library-api")
    tiny("llama").save_pretrained(root / "llama")
    word_tokenizer.save_pretrained(root / "llama")
    (root / "calib.txt").write_text("\n".join(DOCS) + "\n")
    return root


def _tensors(folder):
    return load_file(str(folder / "model.safetensors"))


def test_quantize_call_writes_the_checkpoint_the_command_writes(assets, tmp_path):
    recipe = dict(calib_data=str(assets / "calib.txt"), num_samples=4, seq_len=16,
                  **STATIC_RECIPE)
    report = fp8ptq.quantize(str(assets / "llama"), recipe, tmp_path / "lib")
    res = invoke(["quantize", str(assets / "llama"), "-o", str(tmp_path / "cli"),
                  "--calib-data", str(assets / "calib.txt"), "--num-samples", "4",
                  "--seq-len", "16", *STATIC, "--json"])
    assert res.exit_code == 0, res.output
    cli = json.loads(res.stdout)
    assert report["path"] == cli["path"] == "in-memory"
    assert [m["name"] for m in report["modules"]] == [m["name"] for m in cli["modules"]]
    ours, theirs = _tensors(tmp_path / "lib"), _tensors(tmp_path / "cli")
    assert ours.keys() == theirs.keys() and len(ours) > 0
    assert all(ours[k].equal(theirs[k]) for k in ours)


def test_quantize_call_takes_the_model_free_path_when_the_recipe_allows(assets, tmp_path):
    """Weight-only max calibration reads no data: the strategy is chosen by the library."""
    report = fp8ptq.quantize(str(assets / "llama"), {"act_format": "none",
                                                     "weight_calib": "max"}, tmp_path / "out")
    assert report["path"] == "model-free"
    assert (tmp_path / "out" / "fp8ptq.json").is_file()


def test_evaluate_call_returns_the_rows_the_command_prints(assets, tmp_path):
    text = tmp_path / "wiki.txt"
    text.write_text(" = Title = \n\n" + " ".join(DOCS) + "\n")
    result = fp8ptq.evaluate(str(assets / "llama"), ["wikitext"], ["fp32"],
                             data={"wikitext": str(text)}, limit=1, seq_len=32)
    assert [r["name"] for r in result.rows][0] == "baseline" and len(result.rows) == 2
    assert result.stage_seconds["eval"] > 0


@pytest.mark.parametrize("module", ["fp8ptq", "fp8ptq.cli", "fp8ptq.cli.main"])
def test_importing_changes_nothing_in_the_process(module):
    """No re-exec (one interpreter start), no glibc tunable in the environment."""
    code = (f"import os, sys; import {module}; "
            "print(os.environ.get('GLIBC_TUNABLES', '-'), 'torch' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={k: v for k, v in __import__("os").environ.items()
                              if k != "GLIBC_TUNABLES"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[0] == "-"
