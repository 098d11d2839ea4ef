"""Where FP8_DYNAMIC's WikiText-2 perplexity loss comes from, GEMM kind by kind (SmolLM2, gemma).

Weights or activations, which GEMMs, and the first token.

    python benchmarks/studies/error_budget.py CHECKPOINT [CHECKPOINT ...] [--source FLOAT_FOLDER]
        [--windows 4] [--out out/error-budget] [--doc docs/results/llm-compressor.md]
        [--assets ../shared/assets]

``CHECKPOINT``: fp8ptq e4m3 checkpoints with channel weight scales and dynamic per-token
activations (the default recipe; ``benchmarks/llmc_vs_default.py`` makes them), one column
each; ``--source``: the float model they were made from (default: the first one's recorded
source). The float model
is run with parts of the quantization switched on, each GEMM's weight replaced by the
checkpoint's dequantized one and/or its input rounded per token to e4m3 as the runtime does
(``torch.float8_e4m3fn`` cast of ``x / (amax / 448)``, round to nearest even: the codes
fp8ptq's ``encode`` gives), and scored on ``--windows`` windows of 2048 tokens of WikiText-2
test (BOS first, token perplexity, one forward each). Rows:

- everything quantized; weights only; activations only; the activations of one GEMM kind only;
- the first position's GEMM outputs made exact (the float weight on the unrounded input) with
  everything else quantized, and the first position's inputs left unrounded with activations
  only: what the first token, the attention sink, costs.

Written to ``--out/report.json`` / ``section.md`` and the ``error-budget`` block of ``--doc``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from results_page import study_args, write_section  # noqa: E402

KINDS = {"q/k/v": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
         "gate/up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


class Switches:
    """Per GEMM: dequantized weight or float weight, input rounded or not; and whether the first
    position's outputs are replaced by the exact ones / its inputs left unrounded."""

    def __init__(self, model, weights: dict[str, torch.Tensor]):
        self.mods = {n: model.get_submodule(n) for n in weights}
        self.float = {n: m.weight.data.clone() for n, m in self.mods.items()}
        self.quant = weights
        self.round: set[str] = set()
        self.exact_first = self.unrounded_first = False
        self._inputs: dict = {}
        self._handles = [h for n, m in self.mods.items()
                         for h in (m.register_forward_pre_hook(self._pre(n)),
                                   m.register_forward_hook(self._post(n)))]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def set_float(self) -> None:
        for n, m in self.mods.items():
            m.weight.data = self.float[n]

    def set(self, weights: set[str], inputs: set[str], exact_first=False, unrounded_first=False):
        for n, m in self.mods.items():
            m.weight.data = self.quant[n] if n in weights else self.float[n]
        self.round = inputs
        self.exact_first, self.unrounded_first = exact_first, unrounded_first

    def _pre(self, name):
        def hook(_m, args):
            x = args[0]
            self._inputs[name] = x
            if name not in self.round:
                return None
            s = (x.abs().amax(-1, keepdim=True) / 448.0).clamp_min(1e-12)
            q = (x / s).to(torch.float8_e4m3fn).float() * s
            if self.unrounded_first:
                q[:, :1] = x[:, :1]
            return (q, *args[1:])
        return hook

    def _post(self, name):
        def hook(_m, _args, out):
            if not self.exact_first:
                return None
            out = out.clone()
            out[:, :1] = torch.nn.functional.linear(self._inputs[name][:, :1], self.float[name])
            return out
        return hook


def perplexity(model, windows) -> float:
    nll, count = 0.0, 0
    with torch.inference_mode():
        for w in windows:
            logits = model(w[None], use_cache=False).logits[0, :-1].float()
            nll += float(torch.nn.functional.cross_entropy(logits, w[1:], reduction="sum"))
            count += len(w) - 1
    return math.exp(nll / count)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", nargs="+")
    ap.add_argument("--source")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    study_args(ap, "error-budget", "error-budget")
    return ap


def main(argv=None) -> str:
    args = parser().parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    cks = [Path(c) for c in args.checkpoint]
    metas = [json.loads((ck / "fp8ptq.json").read_text()) for ck in cks]
    src = args.source or metas[0]["source"]["path"]
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(src)
    text = (Path(args.assets) / "wikitext-2-raw/wiki.test.raw").read_text()
    # the windows' own BOS below: none from the tokenizer (gemma's adds one, SmolLM2's not)
    ids = tok(text[:400_000], return_tensors="pt", add_special_tokens=False).input_ids[0]
    bos = tok.bos_token_id if tok.bos_token_id is not None else 1
    windows = [torch.cat([torch.tensor([bos]), ids[i * 2047:(i + 1) * 2047]])
               for i in range(args.windows)]
    columns = [budget(model, dequantized(ck), windows) for ck in cks]
    text_out = section(columns, args, cks, src, windows, metas)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return write_section(out, {"columns": columns, "checkpoints": [str(c) for c in cks],
                               "source": src}, text_out, args.doc, "error-budget")


def dequantized(ck: Path) -> dict[str, torch.Tensor]:
    """GEMM name -> the checkpoint's dequantized weight (codes x channel scales)."""
    from safetensors.torch import load_file
    sd = load_file(str(ck / "model.safetensors"))
    return {n[:-len(".weight_scale")]: sd[n[:-len("_scale")]].float() * sd[n]
            for n in sd if n.endswith(".weight_scale")}


def budget(model, weights: dict, windows) -> list[dict]:
    """The rows (label, ppl, delta_pct, seconds) of one checkpoint."""
    sw = Switches(model, weights)
    every = set(weights)
    rows = []

    def row(label, w, a, **kw):
        sw.set(w, a, **kw)
        t0 = time.perf_counter()
        rows.append({"label": label, "ppl": perplexity(model, windows),
                     "seconds": time.perf_counter() - t0})
        print(f"{label}: {rows[-1]['ppl']:.4f}", flush=True)

    row("float", set(), set())
    row("everything quantized", every, every)
    row("weights only", every, set())
    row("activations only", set(), every)
    for kind, names in KINDS.items():
        row(f"activations of {kind} only", set(),
            {n for n in every if n.rsplit(".", 1)[1] in names})
    row("everything, first position's GEMM outputs exact", every, every, exact_first=True)
    row("activations only, first position's inputs unrounded", set(), every,
        unrounded_first=True)
    sw.remove()
    sw.set_float()
    base = rows[0]["ppl"]
    for r in rows:
        r["delta_pct"] = 100 * (r["ppl"] / base - 1)
    return rows


def section(columns, args, cks, src, windows, metas) -> str:
    names = [f"`{ck.name}`" for ck in cks]
    lines = [
        "## Where the FP8_DYNAMIC loss comes from (error budget)", "",
        "Generated by `python benchmarks/studies/error_budget.py "
        + " ".join(c.name for c in cks) + f" --windows {args.windows}` (folders of "
        f"`{cks[0].parent.name}`) on {time.strftime('%Y-%m-%d', time.gmtime())}, "
        f"{platform.machine()} {os.cpu_count()} cores. Checkpoints: fp8ptq e4m3 of "
        f"the float32 folder `{Path(src).name}`, channel weight scales, dynamic "
        "per-token activations, sequential GPTQ with act-order, gptq_sink "
        + ", ".join(f"{n} {m['recipe'].get('gptq_sink')}" for n, m in zip(names, metas))
        + " (None: the recipe's default of its day: sink-aware with weight 1 for a causal LM "
        "from 2026-11-27, plain GPTQ before). The float model with parts of the "
        "quantization switched on: each GEMM's weight the checkpoint's dequantized one and/or "
        "its input rounded per token to e4m3 as the runtime does. WikiText-2 test, first "
        f"{len(windows)} windows of 2,048 tokens (BOS first), token perplexity (not the word "
        "perplexity of the comparison above); one evaluation each, no interval.", "",
        "| what is quantized | " + " | ".join(f"{n} token ppl (delta)" for n in names) + " |",
        "|---|" + "---|" * len(names)]
    for i, r in enumerate(columns[0]):
        cells = [f"{c[i]['ppl']:.3f} ({c[i]['delta_pct']:+.2f}%)" for c in columns]
        lines.append(f"| {r['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
