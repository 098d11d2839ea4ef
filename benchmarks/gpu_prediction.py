"""The one-block GPU path's predicted peak for large Llama shapes, by part, without a GPU.

    python benchmarks/gpu_prediction.py [--caps 0,10] [--num-samples 128] [--seq-len 512]

Each shape is a two-block Llama config built on the meta device (nothing is allocated), planned
with the default recipe (bfloat16, sequential GPTQ with the sink-aware first token) and sized by
``fp8ptq.execution.budget.gpu_need`` as ``fp8ptq quantize --device cuda --sequential`` sizes it
on a CUDA machine: the activations on the host, the Hessian sums in float32 and the sweep's
storage dtype as on a GPU. A cap (GiB; 0: none) factors the Hessians wider than
``factor_limit_for`` on the host. Prints one markdown row per shape and cap (GiB); these are the
figures docs/big-models.md quotes. They are predictions: ``benchmarks/bench_gpu.py --recipes
one-block`` measures them on a GPU.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

SHAPES = {  # name: (hidden, intermediate, heads, key-value heads)
    "8B-shaped (Llama-3-8B's block)": (4096, 14336, 32, 8),
    "70B-wide (Llama-3-70B's block)": (8192, 28672, 64, 8),
}
PARTS = ("block", "calibration", "sweep", "forward", "replay", "total")


def predict(hidden: int, inter: int, heads: int, kv: int, cap_gib: float, samples: int,
            seq_len: int) -> tuple[dict, int | None]:
    """(``gpu_need``'s parts in bytes, the host-factoring limit) for one shape under a cap."""
    from transformers import LlamaConfig

    from fp8ptq.config.plan import build_plan
    from fp8ptq.config.recipe import Recipe
    from fp8ptq.execution import budget
    from fp8ptq.io.weights import build_empty

    with tempfile.TemporaryDirectory() as tmp:
        cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                          num_key_value_heads=kv, num_hidden_layers=2, vocab_size=128256,
                          architectures=["LlamaForCausalLM"])
        cfg.save_pretrained(tmp)
        meta = build_empty(Path(tmp), torch.bfloat16, None)
    recipe = Recipe(calib_data="-", dtype="bfloat16", num_samples=samples, seq_len=seq_len)
    plan = build_plan(meta, recipe)
    cap = int(cap_gib * 2**30) if cap_gib else None
    limit = None if cap is None else budget.factor_limit_for(meta, recipe, plan, False, cap,
                                                             "cuda")
    return budget.gpu_need(meta, recipe, plan, False, "cuda", cap, limit), limit


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--caps", default="0,10", help="GPU budgets in GiB, 0 for none [0,10]")
    ap.add_argument("--num-samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    args = ap.parse_args(argv)
    print(f"{args.num_samples} x {args.seq_len} calibration tokens, bfloat16, activations on "
          "the host; GiB")
    print("| shape | cap | factored on the host | " + " | ".join(PARTS) + " |")
    print("|---|---|---|" + "---|" * len(PARTS))
    for name, dims in SHAPES.items():
        for cap in (float(c) for c in args.caps.split(",")):
            parts, limit = predict(*dims, cap, args.num_samples, args.seq_len)
            host = ("none" if limit is None else "every GEMM" if limit == 0
                    else f"more than {limit} inputs")
            print(f"| {name} | {f'{cap:g} GiB' if cap else 'none'} | {host} | "
                  + " | ".join(f"{parts[p] / 2**30:.2f}" for p in PARTS) + " |")


if __name__ == "__main__":
    main()
