"""fp8ptq against llm-compressor on the same model, calibration text and evaluation harness.

    python benchmarks/compare_llmcompressor.py [--assets ../shared/assets] [--out out/llmc]
        [--schemes FP8,FP8_DYNAMIC,FP8_BLOCK,GPTQ-FP8] [--quick] [--setup-only]

llm-compressor lives in its own virtual environment, ``~/.cache/fp8ptq-bench/llmc-venv``
(``--system-site-packages``, so it reuses the machine's CPU torch): llmcompressor 0.14.0.1 pins
``transformers<=5.17`` and ``compressed-tensors==0.19``, which the venv installs for itself, while
``-c constraints.txt`` keeps torch at the CPU wheel (an unpinned resolve pulls GBs of CUDA). The
venv is checked to import a ``+cpu`` torch before anything runs; other benchmarks (quantize wall
time) reuse the same path.

Steps: (1) the SmolLM2 GGUF is dequantized into a Hugging Face folder (llm-compressor needs
one); (2) each llm-compressor recipe runs ``oneshot`` in a child process of that venv on the
same calibration paragraphs fp8ptq uses, timing itself and reporting its peak RSS; (3) every
checkpoint folder, theirs and fp8ptq's, goes through one ``fp8ptq eval`` call (first 5 WikiText
articles, context 2048). Wall times are from a machine shared by other jobs: noisy; the
accuracy columns are what matter.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
VENV = Path.home() / ".cache/fp8ptq-bench/llmc-venv"
LLMC_VERSION = "0.14.0.1"
SCHEMES = ("FP8", "FP8_DYNAMIC", "FP8_BLOCK", "GPTQ-FP8")

# Runs inside the llm-compressor venv: argv = hf_dir, scheme, out_dir, calib_file, n, seq_len,
# wikitext file, articles. After oneshot the model simulates its scheme (compressed-tensors'
# fake-quantized weights *and* activations in forward), and fp8ptq's own evaluation code
# (imported from this checkout through PYTHONPATH) scores it: the same harness as fp8ptq's rows.
# Reloading the saved folder instead would go through transformers' compressed-tensors loader,
# which on CPU decompresses the weights and drops activation quantization.
CHILD = r'''
import json, resource, sys, time
t0 = time.perf_counter()
from evals import run_tasks
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
from transformers import AutoModelForCausalLM, AutoTokenizer
hf, scheme, out, calib, n, seq, wiki, articles = sys.argv[1:9]
n, seq = int(n), int(seq)
model = AutoModelForCausalLM.from_pretrained(hf, dtype="auto")
tok = AutoTokenizer.from_pretrained(hf)
lines = [l.strip() for l in open(calib, encoding="utf-8") if l.strip()][:n]
ds = Dataset.from_dict({"text": lines}).map(
    lambda b: tok(b["text"], truncation=True, max_length=seq), batched=True,
    remove_columns=["text"])
if scheme == "GPTQ-FP8":
    recipe = GPTQModifier(targets="Linear", scheme="FP8", ignore=["lm_head"])
else:
    recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
kw = {} if scheme in ("FP8_DYNAMIC", "FP8_BLOCK") else dict(
    dataset=ds, num_calibration_samples=n, max_seq_length=seq)
oneshot(model=model, recipe=recipe, **kw)
seconds = time.perf_counter() - t0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
res = run_tasks(model, tok, ["wikitext"], data={"wikitext": wiki}, limit=int(articles),
                seq_len=2048)
model.save_pretrained(out, save_compressed=True)
tok.save_pretrained(out)
json.dump({"seconds": seconds, "peak_rss_mb": rss, "metrics": res.metrics},
          open(out + "/llmc_run.json", "w"))
'''


def ensure_venv() -> Path:
    """Create/complete the llm-compressor venv; refuse if its torch is not the CPU wheel."""
    py = VENV / "bin/python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(VENV)],
                       check=True)
    probe = [str(py), "-c", "import llmcompressor, torch; print(torch.__version__)"]
    got = subprocess.run(probe, capture_output=True, text=True)
    if got.returncode != 0:
        subprocess.run([str(py), "-m", "pip", "install", "-q", "-c",
                        str(ROOT / "constraints.txt"), f"llmcompressor=={LLMC_VERSION}"],
                       check=True)
        got = subprocess.run(probe, capture_output=True, text=True, check=True)
    if "+cpu" not in got.stdout:
        raise SystemExit(f"llm-compressor venv has torch {got.stdout.strip()}, not the CPU wheel")
    return py


def hf_folder(gguf: Path, out: Path) -> Path:
    """The GGUF dequantized to a float32 safetensors folder (once)."""
    if (out / "config.json").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 (script)

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype="float32")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers refuses to save a GGUF-loaded model; rebuild a plain one from its config.
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def run_llmc(py: Path, hf: Path, scheme: str, out: Path, calib: Path, n: int, seq: int,
             wiki: Path, articles: int) -> dict:
    dest = out / f"llmc-{scheme}"
    if not (dest / "llmc_run.json").exists():
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
        subprocess.run([str(py), "-c", CHILD, str(hf), scheme, str(dest), str(calib), str(n),
                        str(seq), str(wiki), str(articles)], check=True, env=env)
    return {"scheme": scheme, "path": str(dest),
            **json.loads((dest / "llmc_run.json").read_text())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--assets", default=str(ROOT.parent / "shared/assets"))
    ap.add_argument("--out", default=str(ROOT / "out/llmc"))
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--quick", action="store_true", help="1 article, 8 calibration samples")
    ap.add_argument("--setup-only", action="store_true", help="build the venv and stop")
    ap.add_argument("--json", help="write the eval report here")
    args = ap.parse_args()
    py = ensure_venv()
    if args.setup_only:
        print(f"llm-compressor {LLMC_VERSION} venv ready: {py}")
        return
    assets, out = Path(args.assets).resolve(), Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    calib = assets / "calib/wiki-paragraphs.txt"
    n = 8 if args.quick else 32
    hf = hf_folder(assets / "models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf",
                   out / "smollm2-hf")
    wiki, articles = assets / "wikitext-2-raw/wiki.test.raw", 1 if args.quick else 5
    runs = [run_llmc(py, hf, s, out, calib, n, 512, wiki, articles)
            for s in args.schemes.split(",")]
    for r in runs:
        print(f"llm-compressor {r['scheme']}: quantize {r['seconds']:.1f} s, peak RSS "
              f"{r['peak_rss_mb']:.0f} MB (shared machine: noisy), {r['metrics']}")
    report = Path(args.json) if args.json else out / "compare.json"
    cmd = [sys.executable, "-m", "fp8ptq.cli", "eval", str(hf), "--tasks", "wikitext",
           "--data", f"wikitext={wiki}", "--limit", str(articles), "--seq-len", "2048",
           "--compare", "e4m3",
           "--calib-data", str(calib), "--num-samples", str(n), "--calib-seq-len", "512",
           "--act-calib", "best", "--json", str(report)]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    data = json.loads(report.read_text())
    data["llmcompressor"] = {"version": LLMC_VERSION, "runs": runs,
                             "eval_seconds": time.perf_counter() - t0}
    report.write_text(json.dumps(data, indent=2))
    print(f"wrote {report}")


if __name__ == "__main__":
    main()
