"""Peak GPU memory of a Qwen3-MoE-shaped model quantized one block at a time on the GPU, against
the prediction: random weights from a real config, every expert quantized.

    python benchmarks/bench_moe_gpu.py [--device cuda] [--layers 2] [--experts 32]
        [--json PATH]

On CUDA the shape is Qwen3-30B-A3B's layer (hidden 2048, 32 heads, 4 key-value heads, expert
width 768, top-8) with ``--experts`` experts (128 in the real model); on the CPU (a dry run of
the plumbing) a small one. The default recipe runs with ``--sequential`` (one block on the GPU)
in a fresh ``fp8ptq quantize`` process; the row gives its ``--json`` facts: the path, peak GPU
memory against ``predicted_gpu_mb``, peak RSS, how many expert modules were quantized and how
many experts GPTQ swept.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import CALIB

DEFAULT_CACHE = Path.home() / ".cache/fp8ptq-bench/moe"


def build(args) -> Path:
    """The random Qwen3-MoE-shaped model, saved once per shape with a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM
    cuda = args.device.startswith("cuda")
    hidden, inter, heads, kv = (2048, 768, 32, 4) if cuda else (128, 64, 4, 2)
    folder = args.cache / f"qwen3moe-h{hidden}-e{args.experts}-l{args.layers}"
    if (folder / "config.json").is_file():
        return folder
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([args.calib], trainers.WordLevelTrainer(vocab_size=32000,
                                                      special_tokens=["<unk>", "<eos>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                        eos_token="<eos>")
    cfg = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=hidden,
                         num_hidden_layers=args.layers, num_attention_heads=heads,
                         num_key_value_heads=kv, head_dim=128 if cuda else 32,
                         moe_intermediate_size=inter, intermediate_size=4 * inter,
                         num_experts=args.experts, num_experts_per_tok=min(8, args.experts),
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=args.cache))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)
    return folder


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=None, help="[32 on CUDA, 8 on the CPU]")
    p.add_argument("--calib", default=CALIB)
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.experts = args.experts or (32 if cuda else 8)
    args.cache.mkdir(parents=True, exist_ok=True)
    src = build(args)
    samples, seq = (64, 512) if cuda else (8, 64)
    with tempfile.TemporaryDirectory(prefix="fp8ptq-bench-moe-") as tmp:
        cmd = [sys.executable, "-m", "fp8ptq.cli", "quantize", str(src), "-o", f"{tmp}/out",
               "--calib-data", args.calib, "--num-samples", str(samples), "--seq-len", str(seq),
               "--device", args.device, "--dtype", "bfloat16", "--sequential", "--json"]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    row = {"model": src.name, "experts": args.experts, "layers": args.layers,
           "device": torch.cuda.get_device_name() if cuda else "cpu", "wall_s": wall}
    if done.returncode != 0:
        row["error"] = done.stderr.strip()[-600:]
    else:
        report = json.loads(done.stdout[done.stdout.index("{"):])
        experts = report.get("experts") or {}
        row.update({k: report.get(k) for k in ("path", "path_reason", "peak_gpu_mb",
                                                "predicted_gpu_mb", "peak_rss_mb",
                                                "predicted_rss_mb", "predicted_gpu_parts_mb")})
        row["expert_modules"] = len(experts)
        row["experts_swept"] = sum(len((e.get("gptq") or {}).get("swept") or [])
                                   for e in experts.values())
    print(json.dumps(row, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
