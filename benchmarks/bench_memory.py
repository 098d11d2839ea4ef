"""Peak RSS of quantization: sequential (block-by-block) vs in-memory, on a synthetic Llama.

The checkpoint (random bf16 weights) is generated once, streaming one layer per shard so that
generation never holds the model, into ``~/.cache/fp8ptq-bench/`` (never the repo, never CI).
Each mode runs in its own process; its peak RSS is read from ``getrusage``.

    python benchmarks/bench_memory.py --layers 16 --hidden 2048 --inter 5632   # ~1.9 GB bf16
    python benchmarks/bench_memory.py --layers 32 --hidden 5120 --inter 13824 --only sequential
                                                                         # ~28 GB: > this RAM
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

CACHE = Path.home() / ".cache" / "fp8ptq-bench"


def generate(layers: int, hidden: int, inter: int, vocab: int = 32000) -> Path:
    folder = CACHE / f"llama-l{layers}-h{hidden}-i{inter}-v{vocab}"
    if (folder / "model.safetensors.index.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=layers, num_attention_heads=max(1, hidden // 128),
                      num_key_value_heads=max(1, hidden // 128), architectures=["LlamaForCausalLM"])
    cfg.save_pretrained(folder)
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    weight_map, total = {}, 0
    files = [{"model.embed_tokens.weight": None, "model.norm.weight": None,
              "lm_head.weight": None}]
    for i in range(layers):
        p = f"model.layers.{i}."
        files.append({p + "self_attn.q_proj.weight": (hidden, hidden),
                      p + "self_attn.k_proj.weight": (hidden, hidden),
                      p + "self_attn.v_proj.weight": (hidden, hidden),
                      p + "self_attn.o_proj.weight": (hidden, hidden),
                      p + "mlp.gate_proj.weight": (inter, hidden),
                      p + "mlp.up_proj.weight": (inter, hidden),
                      p + "mlp.down_proj.weight": (hidden, inter),
                      p + "input_layernorm.weight": "norm",
                      p + "post_attention_layernorm.weight": "norm"})
    n = len(files)
    for k, spec in enumerate(files):
        name = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        tensors = {}
        for t, shape in spec.items():
            if shape is None:
                tensors[t] = torch.ones(hidden, dtype=torch.bfloat16) if t.endswith(
                    "norm.weight") else rnd(vocab, hidden)
            elif shape == "norm":
                tensors[t] = torch.ones(hidden, dtype=torch.bfloat16)
            else:
                tensors[t] = rnd(*shape)
        save_file(tensors, folder / name, metadata={"format": "pt"})
        total += sum(v.numel() * 2 for v in tensors.values())
        weight_map.update({t: name for t in tensors})
        del tensors
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    return folder


def run_one(mode: str, folder: str, samples: int, seq: int) -> dict:
    from fp8ptq.pipeline import quantize_model, token_batches
    from fp8ptq.recipe import Recipe
    from fp8ptq.sequential import write_sequential

    recipe = Recipe(dtype="bfloat16", batch_size=4)
    ids = torch.randint(10, 30000, (samples, seq), generator=torch.Generator().manual_seed(1))
    batches = list(token_batches(ids, 4))
    t0 = time.perf_counter()
    extra = {}
    if mode == "sequential":  # each block written as quantized, then freed (write_sequential)
        out = CACHE / "bench-memory-out"
        try:
            _, sizes = write_sequential(folder, recipe, batches, out, force=True)
        finally:
            shutil.rmtree(out, ignore_errors=True)
        source = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))
        seconds = time.perf_counter() - t0
        extra = {"checkpoint_gb": round(sizes["checkpoint_bytes"] / 1e9, 2),
                 "source_gb_per_s": round(source / 1e9 / seconds, 3)}
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
        quantize_model(model, recipe, batches)
    return {"mode": mode, "seconds": round(time.perf_counter() - t0, 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            **extra}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=2816)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--only", choices=["sequential", "memory"], default=None)
    ap.add_argument("--child", default=None)
    a = ap.parse_args()
    if a.child:
        mode, folder = a.child.split(":", 1)
        print(json.dumps(run_one(mode, folder, a.samples, a.seq)))
        return
    folder = generate(a.layers, a.hidden, a.inter)
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    print(f"model {folder.name}: {size / 2**30:.2f} GiB on disk; calib {a.samples}x{a.seq}")
    for mode in ([a.only] if a.only else ["sequential", "memory"]):
        out = subprocess.run([sys.executable, __file__, "--child", f"{mode}:{folder}",
                              "--samples", str(a.samples), "--seq", str(a.seq)],
                             capture_output=True, text=True)
        print(out.stdout.strip().splitlines()[-1] if out.returncode == 0 else
              f"{mode}: failed: {out.stderr.strip().splitlines()[-1:]}")


if __name__ == "__main__":
    main()
