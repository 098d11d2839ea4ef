"""GPTQ for fused MoE experts against round to nearest (and llm-compressor's GPTQ).

    python benchmarks/moe_gptq.py [--archs mixtral,qwen3_moe] [--llmc] [--out out/moe-gptq]
        [--doc docs/results/llm-compressor.md]

Models: transformers' ``MixtralConfig`` / ``Qwen3MoeConfig`` made small (2 layers, hidden 128, 8
experts of width 64, top-2, vocabulary 512), random weights (seed 0). Tokens: random ids, 32
calibration windows of 128 (seed 0) and 16 held-out windows of 128 (seed 1).

fp8ptq quantizes each model three times with the default recipe (FP8_DYNAMIC: channel weights,
dynamic per-token inputs; sequential GPTQ, act-order, sink-aware): round to nearest
(``--weight-calib max``), GPTQ with each expert's Hessians from its routed tokens (the
default) and from every token (``--gptq-all-experts``).
On the held-out tokens the FLOAT model routes, each expert's own output (router weight 1) is
compared with the float expert's: ``w8a8`` through the quantized module (its dynamic input
rounding included), ``weights`` with the dequantized weights alone (GPTQ's objective). A row
gives, per variant, the summed squared error over every expert of both layers relative to round
to nearest, the worst expert's ratio and how many experts beat round to nearest.

``--llmc``: llm-compressor's ``GPTQModifier(scheme="FP8_DYNAMIC")`` (``oneshot``, its
``moe_calibrate_all_experts`` default, routers and lm_head ignored) on the same model folder and
calibration windows in its own venv (``compare_llmcompressor.py --setup-only``); its experts'
dequantized weights are read back and scored the same way (``weights`` only: its act-order off,
its own rounding of each linearized expert). Times: fp8ptq's ``quantize_model`` seconds in this
process, llm-compressor's ``oneshot`` seconds in its child (one run each, on a shared machine).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_llmcompressor import VENV, llmc_version  # noqa: E402
from results_page import md_table, page_of, splice  # noqa: E402

from fp8ptq.algorithms.gptq.experts import expert_output_errors  # noqa: E402
from fp8ptq.config.recipe import Recipe  # noqa: E402
from fp8ptq.execution.in_memory import quantize_model, token_batches  # noqa: E402
from fp8ptq.formats import decode, encode, get_format  # noqa: E402
from fp8ptq.model.experts import expert_weight, find_experts  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHAPE = dict(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, num_experts_per_tok=2)
ARCHS = {"mixtral": (MixtralConfig, MixtralForCausalLM,
                     dict(SHAPE, intermediate_size=64, num_local_experts=8)),
         "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                       dict(SHAPE, intermediate_size=256, moe_intermediate_size=64,
                            num_experts=8))}
CALIB = torch.randint(0, 512, (32, 128), generator=torch.Generator().manual_seed(0))
HELD_OUT = torch.randint(0, 512, (16, 128), generator=torch.Generator().manual_seed(1))
VARIANTS = {"round to nearest": dict(weight_calib="max"),
            "GPTQ, routed tokens": dict(),
            "GPTQ, every token": dict(gptq_all_experts=True)}

CHILD = r'''
import json, sys, time
import torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
src, windows, out = sys.argv[1:4]
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
ids = json.load(open(windows))
ds = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(r) for r in ids]})
recipe = GPTQModifier(targets="Linear", scheme="FP8_DYNAMIC",
                      ignore=["lm_head", "re:.*mlp.gate$"])
t0 = time.perf_counter()
oneshot(model=model, processor=AutoTokenizer.from_pretrained(src), recipe=recipe, dataset=ds,
        num_calibration_samples=len(ids), max_seq_length=len(ids[0]))
seconds = time.perf_counter() - t0
tensors = {}
for name, m in model.named_modules():
    if ".experts." in name and isinstance(m, torch.nn.Linear):
        tensors[name + ".weight"] = m.weight.detach().float().contiguous()
        if hasattr(m, "weight_scale"):
            tensors[name + ".weight_scale"] = m.weight_scale.detach().float().contiguous()
save_file(tensors, out + "/experts.safetensors")
json.dump({"oneshot_seconds": seconds}, open(out + "/llmc_run.json", "w"))
'''
GATE, UP, DOWN = ("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")
INTRO = """## GPTQ for MoE experts

Fused 3-D experts swept by GPTQ expert by expert in sequential GPTQ's order
([recipes](../recipes.md#gptq-for-moe-experts)), against round to nearest (RTN) with the same
scales, and llm-compressor's GPTQ (its linearized experts) on the same model and calibration
windows.
Transformers' Mixtral and Qwen3-MoE configurations made small, random weights, random token
ids: an error ratio below 1 is GPTQ's gain on held-out tokens; whether it carries over to a
trained model's perplexity is not measured here. `weights`: each expert's output with its
dequantized weights and exact inputs (GPTQ's objective); `W8A8`: through the quantized module
with the recipe's dynamic per-token input rounding. Every expert received calibration tokens.
Routed Hessians are the default (`--gptq-all-experts`: every token). Seconds: fp8ptq's
`quantize_model` (calibration and every GEMM's and expert's GPTQ) in the script's process,
llm-compressor's `oneshot` in its child (its experts linearized first); one run each.
"""


def tokenizer(size: int):
    """A word-level tokenizer of ``size`` made-up words (the windows are token ids already)."""
    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(size)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", eos_token="w1")


def build(arch: str):
    config_cls, model_cls, fields = ARCHS[arch]
    torch.manual_seed(0)
    model = model_cls(config_cls(**fields)).eval()
    return model


def held_out_inputs(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each experts module's (hidden states, top-k indices) on the held-out tokens."""
    seen, handles = {}, []
    for name, module, _ in find_experts(model):
        def hook(_m, args, _kw, name=name):
            x, idx = seen.get(name, ([], []))
            seen[name] = (x + [args[0].detach().clone()], idx + [args[1].clone()])
        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    with torch.no_grad():
        for b in token_batches(HELD_OUT, 4):
            model(**b)
    for h in handles:
        h.remove()
    return {n: (torch.cat(x), torch.cat(i)) for n, (x, i) in seen.items()}


def with_weights(module, info, weights: dict[str, torch.Tensor]):
    """A float copy of the experts ``module`` holding ``weights`` ({proj: [E, out, in]})."""
    out = copy.deepcopy(module)
    with torch.no_grad():
        for proj, w in weights.items():
            expert_weight(out, info, proj).copy_(w)
    return out


def score(floats, held, quantized: dict[str, object], weights: dict[str, dict]) -> dict:
    """Per experts module and expert: the w8a8 error (``quantized`` modules, None: not
    scored) and the weights-only error (``weights``: {proj: [E, out, in]})."""
    out = {}
    for name, (module, info) in floats.items():
        x, idx = held[name]
        q = quantized.get(name)
        out[name] = {
            "w8a8": None if q is None else expert_output_errors(module, q, x, idx),
            "weights": expert_output_errors(module, with_weights(module, info, weights[name]),
                                            x, idx)}
    return out


def fp8ptq_variant(model, extra: dict) -> tuple[dict, dict, float]:
    recipe = Recipe(format="e4m3", calib_data="random ids", batch_size=4, **extra)
    t0 = time.perf_counter()
    quantize_model(model, recipe, list(token_batches(CALIB, 4)))
    seconds = time.perf_counter() - t0
    quantized = {n: m for n, m in model.named_modules() if hasattr(m, "dequantized_weight")}
    weights = {n: {p: torch.stack([q.dequantized_weight(p, e) for e in range(q.num_experts)])
                   for p in q.info.projections} for n, q in quantized.items()}
    return quantized, weights, seconds


def llmc_variant(model, arch: str, out: Path) -> tuple[dict, float]:
    """llm-compressor's GPTQ FP8_DYNAMIC weights of every expert, fused back per layer."""
    folder = out / f"{arch}-float"
    model.save_pretrained(folder)
    tokenizer(model.config.vocab_size).save_pretrained(folder)  # oneshot wants a processor
    windows = out / "windows.json"
    windows.write_text(json.dumps(CALIB.tolist()))
    dest = out / f"{arch}-llmc"
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(VENV / "bin/python"), "-c", CHILD, str(folder), str(windows),
                    str(dest)], check=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    tensors = load_file(dest / "experts.safetensors")
    fmt = get_format("e4m3")
    weights = {}
    for name, _module, info in find_experts(model):
        num = info.num_experts

        def proj(names, e, name=name):
            key = next(f"{name}.{e}.{n}.weight" for n in names
                       if f"{name}.{e}.{n}.weight" in tensors)
            w, s = tensors[key], tensors[key.replace(".weight", ".weight_scale")]
            # on the e4m3 grid of its scale: what llm-compressor writes
            assert torch.equal(decode(encode(w / s, fmt), fmt) * s, w), key
            return w
        first = info.projections[0]
        weights[name] = {
            first: torch.stack([torch.cat([proj(GATE, e), proj(UP, e)]) for e in range(num)]),
            "down_proj": torch.stack([proj(DOWN, e) for e in range(num)])}
    return weights, json.loads((dest / "llmc_run.json").read_text())["oneshot_seconds"]


def summary(errors: dict, base: dict, kind: str) -> tuple[float, float, int, int]:
    """(summed error / round to nearest's, worst expert's ratio, experts below, experts)."""
    mine = [errors[n][kind][e] for n in errors for e in errors[n][kind]]
    theirs = [base[n][kind][e] for n in errors for e in errors[n][kind]]
    ratios = [a / b for a, b in zip(mine, theirs)]
    return sum(mine) / sum(theirs), max(ratios), sum(r < 1 for r in ratios), len(ratios)


def run_arch(arch: str, llmc: bool, out: Path) -> list[list]:
    model = build(arch)
    held = held_out_inputs(model)
    floats = {n: (copy.deepcopy(m), i) for n, m, i in find_experts(model)}
    scores, seconds = {}, {}
    for label, extra in VARIANTS.items():
        quantized, weights, seconds[label] = fp8ptq_variant(copy.deepcopy(model), extra)
        scores[label] = score(floats, held, quantized, weights)
    if llmc:
        weights, seconds["llm-compressor GPTQ"] = llmc_variant(model, arch, out)
        scores["llm-compressor GPTQ"] = score(floats, held, {}, weights)
    base = scores["round to nearest"]
    rows = []
    for label, errors in scores.items():
        w = summary(errors, base, "weights")
        a = summary(errors, base, "w8a8") if errors[next(iter(errors))]["w8a8"] else None
        rows.append([arch, label, f"{w[0]:.3f}", f"{w[1]:.3f}", f"{w[2]}/{w[3]}",
                     "-" if a is None else f"{a[0]:.3f}", "-" if a is None else f"{a[1]:.3f}",
                     "-" if a is None else f"{a[2]}/{a[3]}", f"{seconds[label]:.1f}"])
    (out / f"{arch}.json").write_text(json.dumps({"scores": {
        k: {n: {kind: {str(e): v for e, v in d.items()} if d else None
                for kind, d in per.items()} for n, per in s.items()} for k, s in scores.items()},
        "seconds": seconds}, indent=1))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default="mixtral,qwen3_moe")
    ap.add_argument("--llmc", action="store_true", help="llm-compressor's GPTQ side by side")
    ap.add_argument("--out", default=str(ROOT / "out/moe-gptq"))
    ap.add_argument("--doc", default=str(page_of("moe-gptq")))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [r for arch in args.archs.split(",") for r in run_arch(arch, args.llmc, out)]
    header = ["model", "variant", "weights: error vs RTN", "worst expert", "experts below RTN",
              "W8A8: error vs RTN", "worst expert", "experts below RTN", "seconds"]
    who = llmc_version(VENV / "bin/python") if args.llmc else "not run"
    text = (INTRO + f"\nMeasured {date.today()} on {platform.machine()} CPU "
            f"({os.cpu_count()} cores, shared, one thread), `python benchmarks/moe_gptq.py"
            f"{' --llmc' if args.llmc else ''}`: {len(CALIB)} x {CALIB.shape[1]} calibration "
            f"tokens, {len(HELD_OUT)} x {HELD_OUT.shape[1]} held-out tokens (random ids), "
            f"2 layers x 8 experts, hidden 128, expert width 64, top-2; llm-compressor: {who}."
            "\n\n" + md_table(header, rows) + "\n")
    (out / "section.md").write_text(text)
    if args.doc:
        Path(args.doc).write_text(splice(Path(args.doc).read_text(), text, "moe-gptq"))
    print(text)


if __name__ == "__main__":
    main()
