"""Every speed target of the project in one table: the regression check for a change.

    python benchmarks/bench_all.py [--quick] [--json PATH] [--no-llmc]

Rows (each a measured figure, the reference it is divided by, the ratio and the target):

- codecs: ``encode`` and ``fake_quantize`` GB/s of a 4096 x 4096 float32 tensor against the same
  run's memory copy, for e4m3, e5m2, e4m3fnuz, e5m2fnuz, hfp8, hif8, a generic ExMy (e3m4) and
  int8. Targets: >= 50% of the copy for OCP / FNUZ, >= 25% for the others.
- the C kernels' first-call build (``fp8ptq.native``, a fresh cache folder): seconds.
- calibration: the statistics pass of ``quantize`` (SmolLM2-135M, e4m3, channel weights, static
  per-tensor activations, batch 8, N x 512 tokens of calib/wiki-paragraphs.txt, bf16) against the
  faster of two plain forward passes over the same batches. Target <= 1.15x.
- simulated eval: lm-eval WikiText perplexity of the quantized model (e4m3 and hif8, static
  per-tensor activations) against the bf16 eval of the same model and tokens. Target <= 1.15x.
- quantize wall time (a fresh ``fp8ptq quantize`` process, load to written checkpoint) against
  llm-compressor's ``oneshot`` + save of the same scheme on the same Hugging Face folder and
  paragraphs, in its own venv (``compare_llmcompressor.py``), when that venv exists. Target
  <= 0.5x.

``--quick`` (< 3 minutes on 2 cores): 32 x 512 calibration tokens instead of 128 x 512, one
WikiText article, one timing per codec. Report timings taken on a quiet machine.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import ASSETS, CALIB, SMOLLM2, WIKITEXT, best_seconds, emit

from fp8ptq import job, native
from fp8ptq.evals import run_tasks
from fp8ptq.formats import encode, fake_quantize, get_format
from fp8ptq.pipeline import run_batch, token_batches
from fp8ptq.recipe import Recipe

CODEC_FORMATS = {"e4m3": 0.5, "e5m2": 0.5, "e4m3fnuz": 0.5, "e5m2fnuz": 0.5, "hfp8": 0.25,
                 "hif8": 0.25, "e3m4": 0.25, "int8": 0.25}
LLMC_PY = Path.home() / ".cache/fp8ptq-bench/llmc-venv/bin/python"
HF_DIR = Path.home() / ".cache/fp8ptq-bench/smollm2-135m-hf"

# llm-compressor, same job as fp8ptq's: e4m3 channel weights, static per-tensor activations,
# lm_head kept, bf16 model; argv = hf_dir, out_dir, calib_file, n, seq_len.
LLMC_CHILD = r'''
import sys
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from transformers import AutoModelForCausalLM, AutoTokenizer
hf, out, calib, n, seq = sys.argv[1:6]
n, seq = int(n), int(seq)
model = AutoModelForCausalLM.from_pretrained(hf, dtype="bfloat16")
tok = AutoTokenizer.from_pretrained(hf)
lines = [l.strip() for l in open(calib, encoding="utf-8") if l.strip()][:n]
ds = Dataset.from_dict({"text": lines}).map(
    lambda b: tok(b["text"], truncation=True, max_length=seq), batched=True,
    remove_columns=["text"])
args = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
recipe = QuantizationModifier(ignore=["lm_head"], config_groups={"group_0": {
    "targets": ["Linear"], "weights": {**args, "strategy": "channel"},
    "input_activations": {**args, "strategy": "tensor"}}})
oneshot(model=model, recipe=recipe, dataset=ds, num_calibration_samples=n, max_seq_length=seq,
        batch_size=8)
model.save_pretrained(out, save_compressed=True)
tok.save_pretrained(out)
'''


def row(what: str, value: float, unit: str, reference: float | None = None, ref_unit: str = "",
        target: str = "", met: bool | None = None) -> dict:
    return {"what": what, "value": value, "unit": unit, "reference": reference,
            "ref unit": ref_unit, "ratio": None if reference is None else value / reference,
            "target": target, "met": None if met is None else ("yes" if met else "NO")}


def codec_rows(repeat: int) -> list[dict]:
    torch.manual_seed(0)
    x = torch.randn(4096, 4096)
    gb = x.numel() * 4 / 1e9
    dst = torch.empty_like(x)
    copy_gbs = gb / best_seconds(lambda: dst.copy_(x), max(repeat, 3))
    scale = torch.tensor(x.abs().max().item() / 400.0)
    y = x / scale
    rows = [row("memory copy 4096x4096 fp32", copy_gbs, "GB/s")]
    for name, target in CODEC_FORMATS.items():
        spec = get_format(name)
        for op, fn in (("encode", lambda s=spec: encode(y, s)),
                       ("fake-quant", lambda s=spec: fake_quantize(x, scale, s))):
            gbs = gb / best_seconds(fn, repeat)
            rows.append(row(f"{op} {name}", gbs, "GB/s", copy_gbs, "GB/s copy",
                            f">= {target:.0%} of copy", gbs / copy_gbs >= target))
    return rows


def build_row() -> dict:
    """The C kernels built from scratch into a temporary cache folder (the first-call cost on a
    fresh machine; later processes load the cached library)."""
    with tempfile.TemporaryDirectory() as tmp:
        old = os.environ.get("FP8PTQ_CACHE")
        os.environ["FP8PTQ_CACHE"] = tmp
        try:
            cc = os.environ.get("CC") or "cc"
            flags = native.FLAGS + native.ARCH_FLAGS
            t0 = time.perf_counter()
            ok = native.build(cc, native.library_path(cc, flags), flags)
            seconds = time.perf_counter() - t0
        finally:
            if old is None:
                os.environ.pop("FP8PTQ_CACHE")
            else:
                os.environ["FP8PTQ_CACHE"] = old
    return row("C kernels first-call build" + ("" if ok else " (FAILED)"), seconds, "s",
               target="once per machine")


def plain_forward(model, batches) -> float:
    t0 = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            run_batch(model, batch)
    return time.perf_counter() - t0


def eval_seconds(model, tokenizer, articles: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        run_tasks(model, tokenizer, ["wikitext"], data={"wikitext": WIKITEXT}, limit=articles,
                  batch_size=8)
        best = min(best, time.perf_counter() - t0)
    return best


def model_rows(samples: int, articles: int, repeat: int) -> list[dict]:
    recipe = Recipe(format="e4m3", weight_granularity="channel", act_granularity="tensor",
                    calib_data=CALIB, num_samples=samples, seq_len=512, batch_size=8)
    loaded = job.load(SMOLLM2, recipe)
    calib = job.calibration_set(loaded, recipe)
    batches = list(token_batches(calib.input_ids, recipe.batch_size))
    pristine = copy.deepcopy(loaded.model)
    forward = min(plain_forward(loaded.model, batches) for _ in range(2))
    base_eval = eval_seconds(loaded.model, loaded.tokenizer, articles, repeat)
    rows = []
    for fmt in ("e4m3", "hif8"):
        loaded.model = copy.deepcopy(pristine)
        timings = job.JobTimings()
        job.quantize_loaded(loaded, recipe.merged(format=fmt), calib, timings=timings)
        if fmt == "e4m3":
            cal = timings.seconds["calibrate"]
            rows.append(row(f"calibrate e4m3, {samples}x512 tokens", cal, "s", forward,
                            "s bf16 forward", "<= 1.15x", cal / forward <= 1.15))
        seconds = eval_seconds(loaded.model, loaded.tokenizer, articles, repeat)
        rows.append(row(f"simulated eval {fmt} (static A), {articles} article(s)", seconds, "s",
                        base_eval, "s bf16 eval", "<= 1.15x", seconds / base_eval <= 1.15))
    return rows


def hf_folder() -> Path:
    """SmolLM2 as a float32 Hugging Face folder, made once; both tools read it as bf16."""
    if not (HF_DIR / "config.json").exists():
        from compare_llmcompressor import hf_folder as convert  # noqa: PLC0415 (script)

        convert(Path(SMOLLM2), HF_DIR)
    return HF_DIR


def wall(cmd: list[str], env: dict | None = None) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, **(env or {})})
    return time.perf_counter() - t0


def llmc_rows(samples: int) -> list[dict]:
    hf = hf_folder()
    fp8ptq = Path(sys.executable).with_name("fp8ptq")
    with tempfile.TemporaryDirectory() as tmp:
        ours = wall([str(fp8ptq), "quantize", str(hf), "--format", "e4m3",
                     "--weight-granularity", "channel", "--act-granularity", "tensor",
                     "--calib-data", CALIB, "--num-samples", str(samples), "--seq-len", "512",
                     "--batch-size", "8", "--dtype", "bfloat16", "-o", f"{tmp}/ours"])
        theirs = wall([str(LLMC_PY), "-c", LLMC_CHILD, str(hf), f"{tmp}/llmc", CALIB,
                       str(samples), "512"], env={"TOKENIZERS_PARALLELISM": "false"})
    return [row(f"quantize wall, {samples}x512 (fp8ptq process)", ours, "s", theirs,
                "s llm-compressor", "<= 0.5x", ours / theirs <= 0.5)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="< 3 minutes: 32 samples, 1 article")
    ap.add_argument("--json")
    ap.add_argument("--no-llmc", action="store_true", help="skip the llm-compressor row")
    args = ap.parse_args()
    samples, articles, repeat = (32, 1, 1) if args.quick else (128, 2, 2)
    t0 = time.perf_counter()
    rows = codec_rows(repeat) + [build_row()]
    if not Path(SMOLLM2).is_file():
        print(f"SmolLM2 not found under {ASSETS} (set FP8PTQ_ASSETS): model rows skipped")
    else:
        rows += model_rows(samples, articles, repeat)
        if not args.no_llmc and LLMC_PY.exists():
            rows += llmc_rows(samples)
    load = os.getloadavg()
    emit(f"fp8ptq speed targets ({torch.get_num_threads()} threads, native kernels "
         f"{'on' if native.available() else 'OFF'}, load {load[0]:.2f}, "
         f"{time.perf_counter() - t0:.0f} s)", rows, args.json,
         {"quick": args.quick, "load": load, "native": native.available()})
    if args.json:
        print(json.dumps({"missed": [r["what"] for r in rows if r["met"] == "NO"]}))


if __name__ == "__main__":
    main()
