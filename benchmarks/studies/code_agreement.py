"""Where two checkpoints of one model differ, GEMM by GEMM: the share of FP8 codes that differ,
in run order, from ``benchmarks/llmc_vs_default.py``'s cached folders (any two variants of the
same model and seed, e.g. the GPTQ sweep in float32, float64 and mixed).

    python benchmarks/studies/code_agreement.py out/llmc-vs-default/smollm2-5 --seeds 0,1,2,3,4
        --base fp8ptq-s64-n64 --variants fp8ptq-n64,fp8ptq-m64-n64 [--json OUT]

The yardstick printed last: the base against itself at the next seed (other calibration
windows), what a change of calibration seed moves.

Why: sequential GPTQ takes each group's Hessian from the model quantized so far, so a code that
flips in one GEMM changes the inputs, Hessians and codes of every GEMM after it. Only the first
group (block 0's q/k/v, whose Hessian is the float embeddings' in every variant) compares the
sweeps' arithmetic alone; the later GEMMs show how far the flips spread. Prints per variant the
first group's share, block 0's and the whole model's, each averaged over the seeds.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

FIRST_GROUP = re.compile(r"layers\.0\.self_attn\.[qkv]_proj\.weight$")
BLOCK0 = re.compile(r"layers\.0\.")


def codes(folder: Path) -> dict[str, torch.Tensor]:
    """The quantized GEMMs' weights (those with a ``weight_scale`` beside them), as stored."""
    out = {}
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        for k in keys:
            if k.endswith(".weight") and k[:-len("weight")] + "weight_scale" in keys:
                out[k] = f.get_tensor(k)
    return out


def shares(a: dict, b: dict) -> dict[str, float]:
    """Share of differing codes: the first group, block 0, every quantized GEMM."""
    def share(pick):
        keys = [k for k in a if pick(k)]
        diff = sum(int((a[k].view(torch.uint8) != b[k].view(torch.uint8)).sum())
                   if a[k].element_size() == 1 else int((a[k] != b[k]).sum()) for k in keys)
        return diff / max(1, sum(a[k].numel() for k in keys))
    return {"first_group": share(FIRST_GROUP.search), "block0": share(BLOCK0.search),
            "all": share(lambda k: True)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--seeds", default="0")
    p.add_argument("--base", required=True)
    p.add_argument("--variants", required=True)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    report = {"folder": str(args.folder), "base": args.base, "variants": {}}
    bases = {s: codes(args.folder / f"{args.base}-seed{s}") for s in seeds}  # read once
    for variant in args.variants.split(","):
        rows = {s: shares(bases[s], codes(args.folder / f"{variant}-seed{s}")) for s in seeds}
        mean = {k: sum(r[k] for r in rows.values()) / len(rows) for k in next(iter(rows.values()))}
        report["variants"][variant] = {"seeds": rows, "mean": mean}
        print(f"{variant} vs {args.base}, seeds {args.seeds}: codes differ in the first group "
              f"{mean['first_group']:.2e}, block 0 {mean['block0']:.2e}, all GEMMs "
              f"{mean['all']:.2e}")
    rows = {f"{a}-{b}": shares(bases[a], bases[b]) for a, b in zip(seeds[::2], seeds[1::2])}
    if rows:
        mean = {k: sum(r[k] for r in rows.values()) / len(rows) for k in next(iter(rows.values()))}
        report["across_seeds"] = {"pairs": rows, "mean": mean}
        print(f"{args.base} at another seed (pairs {', '.join(rows)}): codes differ in the first "
              f"group {mean['first_group']:.2e}, block 0 {mean['block0']:.2e}, all GEMMs "
              f"{mean['all']:.2e}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
