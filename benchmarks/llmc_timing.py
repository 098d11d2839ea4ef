"""Wall time of ``fp8ptq quantize`` vs llm-compressor's ``oneshot``, SmolLM2-135M, same job.

Two fresh processes (the speed row of ``bench_all.py``).

The job: SmolLM2-135M as a Hugging Face folder, e4m3 per-channel weights rounded to
nearest (``--weight-calib max``: llm-compressor's ``QuantizationModifier`` runs no GPTQ), static
per-tensor input scales, lm_head kept, batch 8, the same ``N`` token windows of ``seq_len`` tokens
for both tools. The windows are fp8ptq's own (``fp8ptq.io.data.build_calibration_set`` over
calib/wiki-paragraphs.txt with the folder's tokenizer); llm-compressor gets them as a
pre-tokenized data set, so it runs exactly the same tokens (given the paragraphs themselves it
would truncate each to ``seq_len`` and run ~3x fewer tokens: most paragraphs are ~150 tokens).

llm-compressor's time is cached in ``~/.cache/fp8ptq-bench/llmc-times.json`` (key: dtype,
windows, scheme, its version) with when and at which load it was measured, so that
``bench_all.py --quick`` does not rerun a minute of somebody else's tool on every call;
``--remeasure-llmc`` refreshes it.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from fp8ptq.io.data import build_calibration_set, load_texts

BENCH_CACHE = Path.home() / ".cache/fp8ptq-bench"
LLMC_PY = BENCH_CACHE / "llmc-venv/bin/python"
HF_DIR = BENCH_CACHE / "smollm2-135m-hf"
TIMES = BENCH_CACHE / "llmc-times.json"
SCHEME = "e4m3 channel W, static tensor A, lm_head kept"

# Runs inside the llm-compressor venv: argv = hf_dir, out_dir, windows.pt, dtype.
CHILD = r'''
import sys
import torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from transformers import AutoModelForCausalLM, AutoTokenizer
hf, out, windows, dtype = sys.argv[1:5]
ids = torch.load(windows)
model = AutoModelForCausalLM.from_pretrained(hf, dtype=dtype)
tok = AutoTokenizer.from_pretrained(hf)
ds = Dataset.from_dict({"input_ids": ids.tolist(),
                        "attention_mask": torch.ones_like(ids).tolist()})
args = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
recipe = QuantizationModifier(ignore=["lm_head"], config_groups={"group_0": {
    "targets": ["Linear"], "weights": {**args, "strategy": "channel"},
    "input_activations": {**args, "strategy": "tensor"}}})
oneshot(model=model, recipe=recipe, dataset=ds, num_calibration_samples=ids.shape[0],
        max_seq_length=ids.shape[1], batch_size=8, shuffle_calibration_samples=False)
model.save_pretrained(out, save_compressed=True)
tok.save_pretrained(out)
'''


def available() -> bool:
    return LLMC_PY.exists()


def llmc_version() -> str:
    """The installed llmcompressor's version from its package metadata. Importing the package
    instead would run its import-time logging (``No accelerator available`` on a CPU goes to
    stdout) into the answer, and with it into the cache key."""
    done = subprocess.run([str(LLMC_PY), "-c", "from importlib.metadata import version; "
                           "print(version('llmcompressor'))"], capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    return lines[-1].strip() if done.returncode == 0 and lines else "unknown"


def hf_folder(gguf: str) -> Path:
    """SmolLM2 as a float32 Hugging Face folder, made once; both tools read it in ``dtype``."""
    if not (HF_DIR / "config.json").exists():
        from compare_llmcompressor import hf_folder as convert  # noqa: PLC0415 (a script)

        convert(Path(gguf), HF_DIR)
    return HF_DIR


def _wall(cmd: list[str], env: dict | None = None) -> tuple[float, str]:
    """(wall seconds of the process, its stdout)."""
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    if done.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - t0, done.stdout


def _cached(key: str) -> dict | None:
    try:
        return json.loads(TIMES.read_text()).get(key)
    except (OSError, ValueError):
        return None


def _store(key: str, entry: dict) -> None:
    try:
        table = json.loads(TIMES.read_text())
    except (OSError, ValueError):
        table = {}
    table[key] = entry
    TIMES.parent.mkdir(parents=True, exist_ok=True)
    tmp = TIMES.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, indent=1) + "\n")
    os.replace(tmp, TIMES)


def quantize_walls(gguf: str, calib: str, samples: int, seq_len: int, dtype: str,
                   remeasure: bool = False, repeat: int = 1) -> tuple[list[float], dict, dict]:
    """(fp8ptq's wall seconds, one per fresh process, ``repeat`` of them; the stages' seconds
    of the fastest from its ``time:`` line; llm-compressor's cache entry: seconds,
    measured_at, load). fp8ptq runs first, then llm-compressor (if not cached), then fp8ptq's
    further repeats, so that a load change over the window hits both tools."""
    hf = hf_folder(gguf)
    tok = AutoTokenizer.from_pretrained(hf)
    windows = build_calibration_set(load_texts(calib), tok, num_samples=samples,
                                    seq_len=seq_len).input_ids
    key = f"{dtype}/{samples}x{seq_len}/bs8/{SCHEME}/llmcompressor-{llmc_version()}"
    fp8ptq = Path(sys.executable).with_name("fp8ptq")
    with tempfile.TemporaryDirectory(prefix="fp8ptq-bench-") as tmp:
        def ours(i: int) -> tuple[float, str]:
            return _wall([str(fp8ptq), "quantize", str(hf), "--format", "e4m3",
                          "--weight-granularity", "channel", "--weight-calib", "max",
                          "--act-granularity", "tensor",
                          "--calib-data", calib, "--num-samples", str(samples), "--seq-len",
                          str(seq_len), "--batch-size", "8", "--dtype", dtype, "-o",
                          f"{tmp}/ours{i}"])

        runs = [ours(0)]
        entry = None if remeasure else _cached(key)
        if entry is None:
            torch.save(windows, f"{tmp}/windows.pt")
            before = os.getloadavg()
            seconds, _ = _wall([str(LLMC_PY), "-c", CHILD, str(hf), f"{tmp}/llmc",
                             f"{tmp}/windows.pt", dtype], env={"TOKENIZERS_PARALLELISM": "false"})
            entry = {"seconds": seconds, "load_before": before, "load_after": os.getloadavg(),
                     "measured_at": datetime.datetime.now().isoformat(timespec="minutes"),
                     "cached": False}
            _store(key, {**entry, "cached": True})
        runs += [ours(i) for i in range(1, repeat)]
    walls = [wall for wall, _ in runs]
    return walls, stage_seconds(min(runs)[1]), entry


def stage_seconds(report: str) -> dict[str, float]:
    """The stages of the ``time:`` line that ``fp8ptq quantize`` prints (wrapped or not)."""
    line = " ".join(report.partition("time:")[2].partition("peak RSS")[0].split())
    return {name: float(sec) for name, sec in re.findall(r"([a-z][a-z +]*?) (\d+(?:\.\d+)?)s",
                                                          line)}
