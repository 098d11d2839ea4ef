"""fp8ptq on a GPU, one command: an 8B-shaped Llama with ``--layers`` blocks, quantized per recipe
and run with real FP8 GEMMs against the simulation and against bfloat16.

On CUDA it builds a Llama with Llama-3-8B's widths (hidden 4096, intermediate 14336, 32 heads,
8 key-value heads; vocabulary from ``--tokenizer``'s tokenizer, else 32000 with a word-level
tokenizer trained on the calibration text), random weights, saved as safetensors to a cache
folder outside the repository (``--cache``), once per shape. Then per recipe (``default``:
sequential GPTQ, ``fp8-static``, ``fp8-dynamic``) it reports:

- the ``fp8ptq quantize`` command's wall time, its peak GPU memory and peak RSS (its ``--json``);
- real FP8 GEMMs (``torch._scaled_mm``) against fp8ptq's simulation of them on the same device
  and inputs: relative difference of the logits, perplexity of each on WikiText-2 tokens;
- prefill tokens/s of the checkpoint loaded with ``fp8ptq.load(..., device=...)`` against the
  bfloat16 model in transformers (``--batch`` x ``--prefill-len`` tokens, the decoder stack
  without the LM head, the median of ``--repeat`` timed passes after a warm-up);
- llm-compressor's ``oneshot`` (GPTQ + FP8_DYNAMIC) on the same model and device where it is
  importable, else a note that it was skipped.

``--device cpu`` runs the same report on a small shape (hidden 256, 2 layers by default): every
GEMM is simulated there, so the real-vs-simulated columns compare the simulation with itself.
``--json PATH`` writes the rows.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import CALIB, WIKITEXT, emit

RECIPES = {"default": [], "fp8-static": ["--scheme", "fp8-static"],
           "fp8-dynamic": ["--scheme", "fp8-dynamic"], "streaming": ["--sequential"],
           # the default recipe one block at a time on the GPU (forced; a cap below adds the
           # budget and enforces it as a hard limit on the process's GPU memory)
           "one-block": ["--sequential"]}
CUDA_SHAPE = {"hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8}
CPU_SHAPE = {"hidden": 256, "intermediate": 896, "heads": 4, "kv_heads": 2}
DEFAULT_CACHE = Path.home() / ".cache/fp8ptq-bench/gpu"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=None, help="blocks (default: 4 on CUDA, 2 on "
                   "CPU; 32 is the full 8B depth)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default: 4096 on "
                   "CUDA, 256 on CPU; intermediate = 3.5x, as Llama-3-8B)")
    p.add_argument("--tokenizer", default=None, help="a local tokenizer folder")
    p.add_argument("--recipes", default=",".join(RECIPES), help="of: " + ", ".join(RECIPES)
                   + " (streaming: the default recipe with --sequential, for its peak memory)")
    p.add_argument("--calib", default=CALIB)
    p.add_argument("--wikitext", default=WIKITEXT)
    p.add_argument("--num-samples", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--eval-tokens", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--prefill-len", type=int, default=None)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--json", default=None)
    p.add_argument("--llmc-path", default=None, help="PYTHONPATH for the llm-compressor run "
                   "alone (its pins, e.g. compressed-tensors, differ from fp8ptq's)")
    p.add_argument("--llmc-first", action="store_true", help="run llm-compressor before "
                   "fp8ptq's recipes as well as after them (a fresh machine's first process "
                   "pays its cold start: this shows which tool it was)")
    p.add_argument("--llmc-modes", default="gpu", help="llm-compressor runs, of: gpu (the "
                   "model loaded on the GPU), cpu (loaded on the CPU, its sequential pipeline "
                   "onloading one layer at a time: its docs' way for big models), none")
    p.add_argument("--caps", default="", help="GPU caps in GiB, e.g. 6,10: one 'one-block' "
                   "row per cap, quantized with --max-memory 0=CAP and the process's GPU "
                   "memory capped there (torch.cuda.set_per_process_memory_fraction)")
    p.add_argument("--quantize-only", action="store_true", help="skip each checkpoint's "
                   "real-vs-simulated, prefill and GEMM timings (what the memory rows need)")
    p.add_argument("--intermediate", type=int, default=None, help="intermediate size "
                   "(default: 3.5x hidden, as Llama-3-8B)")
    p.add_argument("--heads", type=int, default=None)
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    defaults = dict(layers=4 if cuda else 2, num_samples=128 if cuda else 8,
                    seq_len=512 if cuda else 64, eval_tokens=2048 if cuda else 256,
                    batch=4 if cuda else 1, prefill_len=2048 if cuda else 128)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    shape = dict(CUDA_SHAPE if cuda else CPU_SHAPE)
    if args.hidden:
        shape.update(hidden=args.hidden, intermediate=args.hidden * 7 // 2)
    if args.intermediate:
        shape.update(intermediate=args.intermediate)
    if args.heads:
        shape.update(heads=args.heads)
    args.shape = shape
    return args


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def tokenizer_for(args):
    """``--tokenizer``'s tokenizer, or a word-level one trained on the calibration text."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    if args.tokenizer:
        return AutoTokenizer.from_pretrained(args.tokenizer)
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=32000, special_tokens=["<unk>", "<eos>"])
    tok.train([args.calib], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def build_model(args) -> Path:
    """The random 8B-shaped (or ``--hidden``) Llama with ``--layers`` blocks, saved once."""
    from transformers import LlamaConfig, LlamaForCausalLM
    s = args.shape
    tag = "tok" if args.tokenizer else "words"
    folder = args.cache / f"llama-h{s['hidden']}-i{s['intermediate']}-l{args.layers}-{tag}"
    if (folder / "config.json").is_file():
        return folder
    tok = tokenizer_for(args)
    vocab = max(32000, len(tok)) if not args.tokenizer else len(tok)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=s["hidden"],
                      intermediate_size=s["intermediate"], num_hidden_layers=args.layers,
                      num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                      max_position_embeddings=8192, rope_theta=500000.0,
                      tie_word_embeddings=False, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    args.cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=args.cache))  # then renamed:
    model.save_pretrained(tmp)                                             # never half-written
    tok.save_pretrained(tmp)
    tmp.rename(folder)
    return folder


# ``fp8ptq quantize`` with the process's GPU memory capped first (a hard limit: an allocation
# past it fails as on a smaller GPU); argv: the cap in bytes, then the command's arguments
CAPPED = ("import sys, torch; cap = int(sys.argv.pop(1)); "
          "torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0)"
          ".total_memory); from fp8ptq.cli.entry import main; sys.argv[0] = 'fp8ptq'; main()")


def quantize(args, src: Path, out: Path, flags: list[str], cap_gib: float | None = None
             ) -> dict:
    """``fp8ptq quantize`` in a fresh process (``cap_gib``: with ``--max-memory 0=CAP`` and
    the process's GPU memory capped there); its ``--json`` report plus the wall time."""
    launch = [sys.executable, "-m", "fp8ptq.cli"]
    if cap_gib is not None and args.device.startswith("cuda"):
        flags = [*flags, "--max-memory", f"0={cap_gib}GiB"]
        launch = [sys.executable, "-c", CAPPED, str(int(cap_gib * 2**30))]
    elif cap_gib is not None:  # a CPU dry run: the same row with a host budget
        flags = [*flags, "--max-memory", f"{cap_gib}GiB"]
    cmd = [*launch, "quantize", str(src), "-o", str(out),
           "--format", "e4m3", "--calib-data", args.calib, "--num-samples",
           str(args.num_samples), "--seq-len", str(args.seq_len), "--device", args.device,
           "--dtype", "bfloat16", "--json", *flags]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        return {"wall_s": wall, "error": done.stderr.strip()[-500:]}
    report = json.loads(done.stdout[done.stdout.index("{"):])
    seconds = report.get("seconds", {})
    return {"wall_s": wall, "calibrate_quantize_s": seconds.get("calibrate+quantize"),
            "stage_s": seconds, "path": report.get("path"),
            "peak_gpu_mb": report.get("peak_gpu_mb"),
            "predicted_gpu_mb": report.get("predicted_gpu_mb"),
            "gpu_cap_mb": None if cap_gib is None else cap_gib * 1024,
            "peak_rss_mb": report.get("peak_rss_mb"),
            "predicted_rss_mb": report.get("predicted_rss_mb"),
            "gpu_factor_limit": report.get("gpu_factor_limit")}


def eval_ids(args, tokenizer) -> torch.Tensor:
    text = Path(args.wikitext).read_text(encoding="utf-8")[: 40 * args.eval_tokens]
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.eval_tokens]
    return ids.to(args.device)


def logits_and_ppl(model, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    nll = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    return logits, math.exp(float(nll))


def real_vs_simulated(model, ids: torch.Tensor) -> dict:
    """Logits and perplexity with the GEMMs as they run on the device (real FP8 where
    ``gemm_paths`` says so), then with every GEMM simulated, same device and inputs."""
    from fp8ptq.nn import quant_gemm
    paths = quant_gemm.gemm_paths(model)
    real, ppl_real = logits_and_ppl(model, ids)
    with quant_gemm.simulated_gemms():
        simulated, ppl_sim = logits_and_ppl(model, ids)
    return {"gemms_real": f"{paths['real_fp8']}/{paths['gemms']}",
            "logits_rel_diff": float((real - simulated).norm() / simulated.norm()),
            "ppl_real": ppl_real, "ppl_simulated": ppl_sim}


def prefill_seconds(model, args, vocab: int) -> float:
    """The median wall time of one prefill of ``--batch`` x ``--prefill-len`` tokens through
    the decoder stack (no LM head), after a warm-up pass."""
    ids = torch.randint(0, vocab, (args.batch, args.prefill_len),
                        generator=torch.Generator().manual_seed(0)).to(args.device)
    times = []
    with torch.no_grad():
        for i in range(args.repeat + 1):
            sync(args.device)
            t0 = time.perf_counter()
            model.model(input_ids=ids)
            sync(args.device)
            if i:
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bf16_prefill(args, src: Path, vocab: int) -> float:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).to(args.device)
    seconds = prefill_seconds(model.eval(), args, vocab)
    del model
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return seconds


LLMC_CHILD = r'''
import json, sys, tempfile, time, torch
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier
from transformers import AutoModelForCausalLM, AutoTokenizer
from datasets import Dataset
src, calib, n, seq, device, mode = sys.argv[1:7]
n, seq = int(n), int(seq)
tok = AutoTokenizer.from_pretrained(src)
ids = tok(open(calib).read(), return_tensors="pt").input_ids[0]
rows = [ids[i * seq:(i + 1) * seq].tolist() for i in range(min(n, len(ids) // seq))]
ds = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * seq for _ in rows]})
t = [time.perf_counter()]
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16,
                                             device_map=None if mode == "cpu" else device)
t.append(time.perf_counter())
oneshot(model=model, dataset=ds, recipe=GPTQModifier(targets="Linear", scheme="FP8_DYNAMIC",
        ignore=["lm_head"]), max_seq_length=seq, num_calibration_samples=len(rows))
if device.startswith("cuda"):
    torch.cuda.synchronize()
t.append(time.perf_counter())
with tempfile.TemporaryDirectory() as out:
    model.save_pretrained(out, save_compressed=True)
t.append(time.perf_counter())
cuda = device.startswith("cuda")
peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
print("LLMC_SECONDS", json.dumps({"load": t[1] - t[0], "oneshot": t[2] - t[1],
                                  "save": t[3] - t[2], "peak_gpu_mb": peak}))
'''


def llm_compressor(args, src: Path, mode: str = "gpu") -> tuple[dict | None, str | None]:
    """llm-compressor's GPTQ + FP8_DYNAMIC on the same ``--num-samples`` x ``--seq-len``
    calibration tokens, the row's fields as ``quantize`` gives fp8ptq's: ``wall_s`` the whole
    process (start and imports included, as fp8ptq's ``wall_s``), ``calibrate_quantize_s`` its
    ``oneshot`` (calibration forwards and GPTQ: fp8ptq's ``calibrate+quantize`` stage), the
    load and save beside them; or a note why not. ``mode``: ``gpu`` loads the model onto the
    GPU; ``cpu`` loads it on the CPU and lets oneshot's sequential pipeline onload one layer
    at a time (its docs' way for models larger than the GPU)."""
    if args.llmc_path is None and importlib.util.find_spec("llmcompressor") is None:
        return None, "llm-compressor is not importable here: its oneshot was skipped"
    env = dict(os.environ)
    if args.llmc_path:
        env["PYTHONPATH"] = args.llmc_path
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", LLMC_CHILD, str(src), args.calib,
                           str(args.num_samples), str(args.seq_len), args.device, mode],
                          capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    for line in done.stdout.splitlines():
        if line.startswith("LLMC_SECONDS"):
            stages = json.loads(line.split(maxsplit=1)[1])
            peak = stages.pop("peak_gpu_mb")
            return {"wall_s": wall, "calibrate_quantize_s": stages["oneshot"],
                    "stage_s": stages, "peak_gpu_mb": peak, "loaded_on": mode}, None
    return None, f"llm-compressor's oneshot ({mode}) failed: {done.stderr.strip()[-300:]}"


def gemm_times(q, args) -> dict:
    """One quantized GEMM (the first block's ``up_proj``) on ``--batch`` x ``--prefill-len``
    tokens: the bfloat16 GEMM of its dequantized weight, the module's forward (real FP8 where
    it runs so), its activation quantization alone; milliseconds, the median of ``--repeat``."""
    x = torch.randn(args.batch * args.prefill_len, q.inner.weight.shape[1],
                    device=args.device, dtype=torch.bfloat16)
    w = q.inner.weight.detach()
    calls = {"gemm_bf16_ms": lambda: torch.nn.functional.linear(x, w),
             "gemm_module_ms": lambda: q(x)}
    plan = q.scaled_mm_plan(x.device) if x.is_cuda else None
    if plan is not None:
        calls["act_quant_ms"] = lambda: plan.quantize(x, q.input_scale)
    out = {}
    with torch.no_grad():
        for key, call in calls.items():
            call()
            times = []
            for _ in range(args.repeat):
                sync(args.device)
                t0 = time.perf_counter()
                call()
                sync(args.device)
                times.append(time.perf_counter() - t0)
            out[key] = 1000 * statistics.median(times)
    return out


def measure(args, src: Path, out: Path, name: str, ids, vocab: int, bf16_s: float,
            cap_gib: float | None = None) -> dict:
    """One recipe's row: quantize, then (unless ``--quantize-only``) real vs simulated,
    prefill, one GEMM's times."""
    import fp8ptq
    label = name if cap_gib is None else f"{name} (GPU capped at {cap_gib} GiB)"
    row = {"recipe": label, **quantize(args, src, out, RECIPES[name], cap_gib)}
    if "error" in row or args.quantize_only:
        return row
    loaded = fp8ptq.load(out, device=args.device, dtype=torch.bfloat16)
    row.update(real_vs_simulated(loaded.model, ids))
    seconds = prefill_seconds(loaded.model, args, vocab)
    tokens = args.batch * args.prefill_len
    row.update(prefill_tok_s=tokens / seconds, vs_bf16=bf16_s / seconds)
    row.update(gemm_times(loaded.model.model.layers[0].mlp.up_proj, args))
    del loaded
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return row


def compare_codes(a: Path, b: Path) -> dict:
    """Two checkpoints of one model: the share of weight codes (uint8 / float8 tensors) that
    are equal, and whether ``b`` passes ``fp8ptq validate``'s static rules."""
    from safetensors import safe_open

    from fp8ptq.checkpoint.validate import static_violations
    same = total = 0
    for fa in sorted(a.glob("*.safetensors")):
        with safe_open(fa, "pt") as x, safe_open(b / fa.name, "pt") as y:
            for key in x.keys():
                ta = x.get_tensor(key)
                if ta.element_size() != 1:
                    continue
                tb = y.get_tensor(key)
                same += int((ta.view(torch.uint8) == tb.view(torch.uint8)).sum())
                total += ta.numel()
    errors = [v.line() for v in static_violations(b, "vllm") if v.severity == "error"]
    return {"codes_equal_to_uncapped": same / total if total else None,
            "validate_errors": errors}


def block_mb(args) -> float:
    """One decoder block's bfloat16 weights plus its calibration activations (hidden states
    of every sample), in MB: what block streaming must hold at once."""
    s = args.shape
    h, i, kv = s["hidden"], s["intermediate"], s["hidden"] * s["kv_heads"] // s["heads"]
    weights = 2 * (2 * h * h + 2 * h * kv + 3 * h * i)
    acts = 2 * args.num_samples * args.seq_len * h
    return (weights + acts) / 1e6


def main(argv=None) -> None:
    args = parse_args(argv)
    src = build_model(args)
    first = llm_compressor(args, src) if args.llmc_first else None
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(src)
    vocab = len(tokenizer)
    ids = eval_ids(args, tokenizer)
    bf16_s = bf16_prefill(args, src, vocab)
    tokens = args.batch * args.prefill_len
    rows = [{"recipe": "bf16 (transformers)", "prefill_tok_s": tokens / bf16_s}]
    if first is not None and first[0] is not None:
        rows.append({"recipe": "llm-compressor GPTQ+FP8_DYNAMIC (run first)", **first[0]})
    s = args.shape
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    extra = {"device": device, "torch": torch.__version__, "layers": args.layers, **s,
             "calibration": f"{args.num_samples} x {args.seq_len}",
             "eval_tokens": int(ids.shape[1]), "prefill": f"{args.batch} x {args.prefill_len}",
             "repeat": args.repeat,
             "block_mb": block_mb(args), "notes": []}
    runs = [(name, None) for name in args.recipes.split(",") if name] + [
        ("one-block", float(c)) for c in args.caps.split(",") if c]
    with tempfile.TemporaryDirectory(prefix="fp8ptq-bench-gpu-") as tmp:
        outs = {}
        for name, cap in runs:
            outs[(name, cap)] = Path(tmp) / f"{name}-{cap}"
            rows.append(measure(args, src, outs[(name, cap)], name, ids, vocab, bf16_s, cap))
            if cap is not None and ("one-block", None) in outs:
                rows[-1].update(compare_codes(outs[("one-block", None)], outs[(name, cap)]))
            if args.json:  # each row as it comes: a run stopped midway keeps what it measured
                Path(args.json).write_text(json.dumps({"rows": rows, **extra}, indent=1))
    notes = [first and first[1]]
    for mode in [m for m in args.llmc_modes.split(",") if m not in ("", "none")]:
        llmc, note = llm_compressor(args, src, mode)
        rows.append({"recipe": f"llm-compressor GPTQ+FP8_DYNAMIC (loaded on {mode})",
                     **(llmc or {})})
        notes.append(note)
    extra["notes"] = list(dict.fromkeys(n for n in notes if n))
    title = (f"fp8ptq on {device}: Llama h{s['hidden']}/i{s['intermediate']} x {args.layers} "
             "layers")
    emit(title, rows, args.json, extra)
    for row in rows:
        if row.get("stage_s"):
            stages = ", ".join(f"{k} {v:.1f}" for k, v in row["stage_s"].items())
            print(f"{row['recipe']} seconds: {stages}")
    for n in extra["notes"]:
        print(f"note: {n}")


if __name__ == "__main__":
    main()
