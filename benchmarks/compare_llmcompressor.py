"""fp8ptq vs llm-compressor on SmolLM2-135M WikiText-2 / MiniLM SQuAD: one harness, same windows.

    python benchmarks/compare_llmcompressor.py smollm2|minilm [--assets ../shared/assets]
        [--out out/recipes] [--schemes FP8,FP8_DYNAMIC,FP8_BLOCK,GPTQ-FP8,GPTQ-FP8_DYNAMIC]
        (also MXFP8, GPTQ-MXFP8)
        [--fp8ptq NAME,...] [--timings] [--prefix CMD] [--setup-only]
    python benchmarks/compare_llmcompressor.py --study
        [--steps accuracy,minilm,budget,squad-budget,speed]

``--study`` is the whole head-to-head against llm-compressor's best recipe (GPTQ with
``FP8_DYNAMIC``, and ``FP8_BLOCK`` where the widths allow) in one command, each step a run of
the script that owns it (``STUDY``: the arguments ``docs/results/``'s sections were generated
with; every row cached, so a stopped study resumes where it stopped):

- ``accuracy``: ``llmc_vs_default.py``, SmolLM2 WikiText, 10 calibration seeds, the default
  and its factors one at a time (windows, samples x length, dampening, act-order, one-pass
  Hessians and their accumulation dtype, weight-scale rule, asymmetric and sink-aware GPTQ,
  rotation, what stays in high precision), both tools'
  calibrate + quantize seconds and peak RSS;
- ``minilm``: the same for MiniLM SQuAD, ``FP8_DYNAMIC`` and ``FP8_BLOCK``, 5 seeds;
- ``budget``: ``error_budget.py`` on the seed-0 checkpoints: which share of the loss is the
  weights', the activations', each GEMM kind's and the first token's;
- ``squad-budget``: ``squad_budget.py`` on the ``minilm`` step's ``FP8_DYNAMIC`` checkpoints
  of both tools: the same split on MiniLM SQuAD, and how far each checkpoint sits from the
  float model (KL of the answer distributions, which F1 differences this small cannot show);
- ``speed``: the default's calibrate + quantize against ``oneshot`` at 64 x 512, back to back
  in a fresh folder (``out/timing``; run it on a quiet machine).

Hours on a 2-core CPU: the ``minilm`` step takes about 2.5 h here (20 quantizations, 21
evaluations of 3,335 questions), ``accuracy`` (42 checkpoints) most of a working day.

llm-compressor runs in its own virtual environment, ``~/.cache/fp8ptq-bench/llmc-venv``
(``--system-site-packages``: it reuses the machine's CPU torch), built by ``--setup-only`` (the
only step that installs anything; without the venv the comparison stops with that command) with
``pip install -c constraints.txt llmcompressor==0.14.0.1`` so that torch stays the CPU wheel
(an unpinned resolve pulls GBs of CUDA); llm-compressor pins its own transformers (<= 5.17) and
compressed-tensors (0.19) inside it. The venv must import a ``+cpu`` torch before anything runs.

Steps:

1. The model as a float32 Hugging Face folder (the SmolLM2 GGUF dequantized once; MiniLM's folder
   as it is) and the calibration windows. ``--windows fp8ptq`` (default): llm-compressor gets
   fp8ptq's own token windows (``fp8ptq.io.data.build_calibration_set`` on
   ``calib/wiki-paragraphs.txt``: ``--num-samples`` windows of 512 tokens, seed 0) as a
   pre-tokenized dataset, so both tools calibrate on the same tokens (their sha256 is written
   to ``llmc_run.json``). ``--windows paragraphs``: the first ``--num-samples`` paragraphs cut
   to 512 tokens (what ``oneshot`` does with a dataset of documents: ~150 tokens each here, a
   third of fp8ptq's tokens); those folders are named ``llmc-SCHEME-paragraphs``. Recipes
   with dynamic activations and no GPTQ read no data and are shared by both.
2. Each llm-compressor recipe (``QuantizationModifier`` with ``FP8`` / ``FP8_DYNAMIC`` /
   ``FP8_BLOCK``, ``GPTQModifier`` with ``FP8`` / ``FP8_DYNAMIC``; lm_head / qa_outputs
   ignored) runs ``oneshot`` in a child process of that venv and saves its compressed-tensors
   folder; with ``--timings`` each fp8ptq equivalent also runs ``fp8ptq quantize`` as a child
   process. Wall time is the parent's clock around the child, peak RSS the child's own
   ``ru_maxrss``. ``--prefix /work/bin/cpu-quiet`` runs every quantize child through that
   command (timings taken on a quiet machine).
3. Evaluation (``benchmarks/studies/recipe_study.py``'s cached rows, one baseline): llm-compressor's
   folders are ``fp8ptq eval --compare DIR`` checkpoint variants (transformers loads them with
   their quantization applied: FP8 weights, activations quantized in forward); fp8ptq's rows are
   the same recipes quantized in memory (bit-identical to their written checkpoints, tested).
   Every delta gets its paired bootstrap 95% interval against the one baseline.

``benchmarks/llmc_vs_default.py`` is the head-to-head of fp8ptq's default recipe (64 x 512
document windows, sequential GPTQ act-order) against ``GPTQ-FP8_DYNAMIC`` per calibration seed,
both checkpoints scored as folders, with the paired interval of their difference; it uses this
venv (``--setup-only`` builds it) and installs nothing itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks/studies"))  # recipe_study's harness, the budgets

import recipe_study as study  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from fp8ptq.io.data import build_calibration_set, load_texts  # noqa: E402

VENV = Path.home() / ".cache/fp8ptq-bench/llmc-venv"
LLMC_VERSION = "0.14.0.1"
SCHEMES = ("FP8", "FP8_DYNAMIC", "FP8_BLOCK", "GPTQ-FP8", "GPTQ-FP8_DYNAMIC")
# also runnable (--schemes): compressed-tensors 0.19's MXFP8 preset (E4M3 elements, uint8 E8M0
# scales per 32 values along K, weights and dynamic activations), round to nearest and GPTQ
MX_SCHEMES = ("MXFP8", "GPTQ-MXFP8")
# llm-compressor recipe -> fp8ptq's equivalent (a recipe_study name)
EQUIVALENT = {"FP8": "fp8-static", "FP8_DYNAMIC": "fp8-dynamic", "FP8_BLOCK": "fp8-block",
              "GPTQ-FP8": "fp8-static-gptq", "GPTQ-FP8_DYNAMIC": "fp8-dynamic-gptq",
              "MXFP8": "mxfp8", "GPTQ-MXFP8": "mxfp8-gptq"}
QUANTIZE_FLAGS = {  # fp8ptq quantize flags of the recipe_study rows timed with --timings
    "fp8-static": ["--scheme", "fp8-static"],
    "fp8-dynamic": ["--scheme", "fp8-dynamic"],
    "fp8-block": ["--scheme", "fp8-block"],
    "fp8-static-gptq": ["--scheme", "fp8-static", "--weight-calib", "gptq"],
    "fp8-dynamic-gptq": ["--scheme", "fp8-dynamic", "--weight-calib", "gptq"],
    "mxfp8": ["--format", "mxfp8"],
    "mxfp8-gptq": ["--format", "mxfp8", "--weight-calib", "gptq"],
}

# Runs inside the llm-compressor venv: argv = model dir, scheme, out dir, calib file, n,
# seq_len, task ("causal-lm" | "qa"). Saves the compressed-tensors folder and llmc_run.json.
CHILD = r'''
import json, resource, sys, time
t0 = time.perf_counter()
import torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
from transformers import AutoModelForCausalLM, AutoModelForQuestionAnswering, AutoTokenizer
src, scheme, out, calib, n, seq, task = sys.argv[1:8]
n, seq = int(n), int(seq)
cls = AutoModelForQuestionAnswering if task == "qa" else AutoModelForCausalLM
model = cls.from_pretrained(src, dtype=torch.float32)
tok = AutoTokenizer.from_pretrained(src)
ignore = ["qa_outputs"] if task == "qa" else ["lm_head"]
if calib.endswith(".json"):  # fp8ptq's token windows, pre-tokenized
    ids = json.load(open(calib))["input_ids"]
    ds = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(r) for r in ids]})
else:  # documents: the first n paragraphs, each cut to seq tokens
    lines = [l.strip() for l in open(calib, encoding="utf-8") if l.strip()][:n]
    ds = Dataset.from_dict({"text": lines}).map(
        lambda b: tok(b["text"], truncation=True, max_length=seq), batched=True,
        remove_columns=["text"])
base = scheme.removeprefix("GPTQ-")
Modifier = GPTQModifier if scheme.startswith("GPTQ-") else QuantizationModifier
recipe = Modifier(targets="Linear", scheme=base, ignore=ignore)
static = base == "FP8" or scheme.startswith("GPTQ-")
kw = dict(dataset=ds, num_calibration_samples=n, max_seq_length=seq) if static else {}
t1 = time.perf_counter()
oneshot(model=model, recipe=recipe, **kw)
t1 = time.perf_counter() - t1
model.save_pretrained(out, save_compressed=True)
tok.save_pretrained(out)
json.dump({"scheme": scheme, "seconds_in_process": time.perf_counter() - t0,
           "oneshot_seconds": t1,
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "llmcompressor": __import__("llmcompressor").__version__},
          open(out + "/llmc_run.json", "w"))
'''


# --study: (step, what it answers, script, argv). The SmolLM2 argv is the one of the
# llmc-compare section; the error budget reads that run's seed-0 checkpoints.
_BUDGET = ROOT / "out/llmc-vs-default/smollm2-5"
_MINILM = ROOT / "out/llmc-vs-default/minilm-3335"  # the minilm step's checkpoints
STUDY = (
    ("accuracy", "the default against GPTQ FP8_DYNAMIC on SmolLM2, factor by factor",
     "llmc_vs_default",
     ["--seeds", "0,1,2,3,4,5,6,7,8,9", "--num-samples", "64", "--articles", "5",
      "--variant", "nosink@0,1,2,3,4=--gptq-sink 0", "--variant", "sink0.1=--gptq-sink 0.1",
      "--variant", "sink2@0,1,2,3,4=--gptq-sink 2",
      "--variant", "nosink-noao=--gptq-sink 0 --no-gptq-act-order",
      "--variant", "onepass=--no-gptq-sequential",
      "--variant", "nosink-random=--gptq-sink 0 --calib-windows random",
      "--variant", "nosink-gmse=--gptq-sink 0 --weight-calib gptq-mse",
      "--variant", "nosink-n128x256=--gptq-sink 0 --num-samples 128 --seq-len 256",
      "--variant", "nosink-damp10=--gptq-sink 0 --gptq-damp 0.1",
      "--variant", "nosink-hmse=--gptq-sink 0 --weight-calib gptq-hmse",
      "--variant", "asym@0,1=--gptq-asym",
      "--variant", "nosink-rotate@0,1=--gptq-sink 0 --rotate hadamard",
      "--variant", "nosink-keepdown=--gptq-sink 0 --skip *down_proj",
      "--variant", "nosink-keepends=--gptq-sink 0 --skip model.layers.0.* "
      "--skip model.layers.29.*",
      "--variant", "nosink-h32=--gptq-sink 0 --gptq-hessian-dtype float32"]),
    ("minilm", "the default against GPTQ FP8_DYNAMIC and FP8_BLOCK on MiniLM SQuAD",
     "llmc_vs_default", ["minilm", "--schemes", "FP8_DYNAMIC,FP8_BLOCK",
                         "--seeds", "0,1,2,3,4"]),
    ("budget", "where the loss comes from", "error_budget",
     [str(_BUDGET / "fp8ptq-nosink-n64-seed0"), str(_BUDGET / "fp8ptq-n64-seed0"),
      "--windows", "4"]),
    ("squad-budget", "where MiniLM's loss comes from, and each checkpoint's distance from float",
     "squad_budget",
     [*(str(_MINILM / f"{tool}-n64-seed{s}") for tool in ("fp8ptq", "llmc") for s in range(5)),
      *(x for tool, label in (("fp8ptq", "fp8ptq default"), ("llmc", "llm-compressor"))
        for x in ("--against", label + "=" + ",".join(
            str(_MINILM / f"{tool}-n64-seed{s}.json") for s in range(5))))]),
    ("speed", "GPTQ's calibrate + quantize seconds, the two tools back to back",
     "llmc_vs_default",
     ["--out", str(ROOT / "out/timing"), "--seeds", "0", "--num-samples", "64",
      "--steps", "quantize"]),
)


def run_study(steps: list[str], assets: str) -> None:
    """The ``STUDY`` steps named, in order, each through its script's ``main``."""
    import importlib
    unknown = [x for x in steps if x not in {name for name, *_ in STUDY}]
    if unknown:
        raise SystemExit(f"error: unknown study step(s) {', '.join(unknown)}; known: "
                         + ", ".join(name for name, *_ in STUDY))
    for name, what, script, argv in STUDY:
        if name in steps:
            module = importlib.import_module(script)
            print(f"== {name}: {what} ({Path(module.__file__).relative_to(ROOT)})", flush=True)
            module.main([*argv, "--assets", assets])


def build_venv() -> Path:
    """Create / complete the llm-compressor venv (``--setup-only``: the one step that installs
    anything); refuse if its torch is not the CPU wheel."""
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


def llmc_version(py: Path) -> str:
    """What ``py`` imports: ``llm-compressor X (compressed-tensors Y, torch Z, transformers W)``;
    exits with the command that builds the venv when llm-compressor does not import there (the
    comparison installs nothing unless asked to: ``--setup-only``)."""
    got = subprocess.run([str(py), "-c", "import llmcompressor, compressed_tensors, torch, "
                          "transformers as t; print(llmcompressor.__version__, "
                          "compressed_tensors.__version__, torch.__version__, t.__version__)"],
                         capture_output=True, text=True) if Path(py).exists() else None
    if got is None or got.returncode != 0:
        raise SystemExit(f"error: llm-compressor does not import with {py}; this comparison "
                         "installs nothing by itself: run `python benchmarks/"
                         "compare_llmcompressor.py --setup-only` (pip install -c constraints.txt "
                         f"llmcompressor=={LLMC_VERSION} into {VENV}) first")
    llmc, ct, torch_v, tf = got.stdout.split()[-4:]
    if "+cpu" not in torch_v:
        raise SystemExit(f"error: the llm-compressor venv has torch {torch_v}, not the CPU wheel")
    return f"llm-compressor {llmc} (compressed-tensors {ct}, torch {torch_v}, transformers {tf})"


def hf_folder(gguf: Path, out: Path) -> Path:
    """The GGUF dequantized to a float32 safetensors folder (once)."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype="float32")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    cfg = model.config  # transformers refuses to save a GGUF-loaded model: rebuild a plain one
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def timed_child(cmd: list[str], prefix: list[str], env=None
                ) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    done = subprocess.run([*prefix, *cmd], check=True, capture_output=True, text=True, env=env)
    return time.perf_counter() - t0, done


def reads_data(scheme: str) -> bool:
    return scheme == "FP8" or scheme.startswith("GPTQ-")


def fp8ptq_windows(src: Path, calib: Path, n: int, out: Path) -> Path:
    """fp8ptq's calibration windows for ``src``'s tokenizer, as the JSON the child reads."""
    windows = build_calibration_set(load_texts(str(calib)), AutoTokenizer.from_pretrained(src),
                                    num_samples=n, seq_len=512, seed=0, source=str(calib))
    path = out / f"fp8ptq-windows-{n}x512.json"
    path.write_text(json.dumps({"sha256": windows.sha256,
                                "input_ids": windows.input_ids.tolist()}))
    return path


def llmc_child(py: Path, src: Path, scheme: str, dest: Path, calib: Path, n: int, task: str,
               *, prefix: list[str] = (), env: dict | None = None, after=None) -> dict:
    """llm-compressor's ``CHILD`` run once into ``dest`` under the llm-compressor venv's
    ``py`` (cached: ``dest/llmc_run.json`` holds its facts), the whole process's wall time
    added, the sha256 of ``calib`` when it is fp8ptq's windows (a JSON from
    ``fp8ptq_windows``), and ``after()``'s facts (read once the child has ended). The one way
    both comparison scripts run llm-compressor."""
    facts_file = dest / "llmc_run.json"
    if not facts_file.exists():
        env = env or {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        wall, _ = timed_child([str(py), "-c", CHILD, str(src), scheme, str(dest), str(calib),
                               str(n), "512", task], list(prefix), env)
        facts = json.loads(facts_file.read_text())
        facts["wall_seconds"] = wall
        if calib.suffix == ".json":
            facts["windows_sha256"] = json.loads(calib.read_text())["sha256"]
        facts.update(after() if after else {})
        facts_file.write_text(json.dumps(facts, indent=1))
    return json.loads(facts_file.read_text())


def run_llmc(py: Path, src: Path, scheme: str, out: Path, calib: Path, n: int, task: str,
             prefix: list[str], windows: Path | None = None) -> dict:
    """One llm-compressor run (cached). ``windows``: fp8ptq's token windows (a JSON from
    ``fp8ptq_windows``) instead of ``calib``'s first ``n`` paragraphs."""
    suffix = "-paragraphs" if windows is None and reads_data(scheme) else ""
    dest = out / f"llmc-{scheme}{suffix}"
    if windows is not None and reads_data(scheme):
        calib = windows
    return {"path": str(dest), **llmc_child(py, src, scheme, dest, calib, n, task,
                                            prefix=prefix)}


def time_fp8ptq(src: Path, name: str, out: Path, calib: Path, n: int, prefix: list[str]
                ) -> dict:
    dest = out / f"fp8ptq-{name}"
    facts_file = out / f"fp8ptq-{name}.json"
    if not facts_file.exists():
        cmd = [str(Path(sys.executable).parent / "fp8ptq"), "quantize", str(src), "-o",
               str(dest), "--force", "--calib-data", str(calib), "--num-samples", str(n),
               "--seq-len", "512", "--dtype", "float32", *QUANTIZE_FLAGS[name], "--json"]
        wall, done = timed_child(cmd, prefix)
        report = json.loads(done.stdout)
        facts_file.write_text(json.dumps({"name": name, "wall_seconds": wall,
                                          "peak_rss_mb": report["peak_rss_mb"],
                                          "seconds": report["seconds"]}, indent=1))
    return json.loads(facts_file.read_text())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=sorted(study.MODELS), nargs="?", default="smollm2")
    ap.add_argument("--assets", default=os.environ.get("FP8PTQ_ASSETS",
                                                       str(ROOT.parent / "shared/assets")))
    ap.add_argument("--out", default=str(ROOT / "out/recipes"))
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--fp8ptq", default="", help="extra recipe_study rows (fp8ptq's best)")
    ap.add_argument("--num-samples", type=int, default=32)
    ap.add_argument("--articles", type=int, default=5)
    ap.add_argument("--questions", type=int, default=1000)
    ap.add_argument("--windows", choices=("fp8ptq", "paragraphs"), default="fp8ptq",
                    help="llm-compressor's calibration data: fp8ptq's token windows (the same "
                         "tokens as fp8ptq) or the first paragraphs of the file")
    ap.add_argument("--timings", action="store_true",
                    help="also time fp8ptq quantize of each equivalent (child processes)")
    ap.add_argument("--prefix", default="", help="command the quantize children run under")
    ap.add_argument("--setup-only", action="store_true", help="build the venv and stop")
    ap.add_argument("--no-eval", action="store_true", help="quantize (and time) only")
    ap.add_argument("--study", action="store_true",
                    help="the whole study against llm-compressor's GPTQ recipes (STUDY)")
    ap.add_argument("--steps", default=",".join(name for name, *_ in STUDY),
                    help="--study's steps")
    args = ap.parse_args(argv)
    if args.setup_only:
        py = build_venv()
        print(f"{llmc_version(py)} venv ready: {py}")
        return
    py = VENV / "bin/python"
    ran = llmc_version(py)
    print(f"running {ran} from {py}", flush=True)
    if args.study:
        run_study([x for x in args.steps.split(",") if x], args.assets)
        return
    assets = Path(args.assets).resolve()
    m = study.MODELS[args.model]
    limit = args.articles if m["task"] == "wikitext" else args.questions
    cache = Path(args.out).resolve() / f"{args.model}-{limit}"
    cache.mkdir(parents=True, exist_ok=True)
    calib = assets / "calib/wiki-paragraphs.txt"
    if args.model == "smollm2":
        src = hf_folder(assets / m["spec"], Path(args.out).resolve() / "smollm2-hf")
    else:
        src = assets / m["spec"]
    prefix = args.prefix.split() if args.prefix else []
    schemes = [s for s in args.schemes.split(",") if s]
    unknown = [s for s in schemes if s not in EQUIVALENT]
    if unknown:
        raise SystemExit(f"error: unknown scheme(s) {unknown}; known: {', '.join(EQUIVALENT)}")
    task = "qa" if m["task"] == "squad" else "causal-lm"
    windows = fp8ptq_windows(src, calib, args.num_samples, cache) \
        if args.windows == "fp8ptq" else None
    llmc = {s: run_llmc(py, src, s, cache, calib, args.num_samples, task, prefix, windows)
            for s in schemes}
    timings = {n: time_fp8ptq(src, n, cache, calib, args.num_samples, prefix)
               for n in dict.fromkeys(EQUIVALENT[s] for s in schemes)} if args.timings else {}
    if args.no_eval:
        path = cache / "compare_llmcompressor_timings.json"
        path.write_text(json.dumps({"llmcompressor": llmc, "fp8ptq": timings}, indent=1) + "\n")
        print(f"wrote {path}")
        return
    extra = [n for n in args.fp8ptq.split(",") if n]
    # evaluation: the study's harness and cache (one baseline, paired intervals)
    rows = study.main([args.model, "--out", args.out, "--assets", str(assets),
                       "--num-samples", str(args.num_samples), "--articles", str(args.articles),
                       "--questions", str(args.questions),
                       "--only", ",".join(dict.fromkeys([EQUIVALENT[s] for s in schemes]
                                                        + extra)),
                       "--checkpoints", ",".join(f"{Path(llmc[s]['path']).name}="
                                                 f"{llmc[s]['path']}" for s in schemes)])
    report = {"llmcompressor": {"version": ran, "runs": llmc},
              "fp8ptq_timings": timings, "equivalent": EQUIVALENT, "report": rows}
    path = cache / "compare_llmcompressor.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
