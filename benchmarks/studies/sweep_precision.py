"""GPTQ's column sweep in float32, float64 or float32 with float64 error feedback: the layer output
error each leaves, per GEMM, against the GEMM's input width.

    python benchmarks/studies/sweep_precision.py MODEL [--num-samples 32] [--seeds 0]
        [--heldout-tokens 4096] [--sink 1] [--out out/sweep-precision] [--assets ../shared/assets]

The mechanism check behind the sweep's precision (``fp8ptq.algorithms.gptq.sweep``): the float
model's one-pass Hessians of every GEMM inside the blocks (``H = 2 X^T X`` of the calibration
windows, the default's document windows) and the Gram matrix ``G = X^T X`` of held-out inputs
(the first WikiText-2 test articles, windows of 512 opened as evaluation opens them); for each
GEMM the default's channel max scales and act-order GPTQ with each sweep, and the relative output
error on the held-out rows ``tr(D G D^T) / tr(W G W^T)``, ``D = W - Q``, exactly (no sampling).
Precisions:

- ``float32``: the library's float32 sweep (a GPU's; float64 Cholesky factor, float32 column
  loop and block updates);
- ``float64``: the same loop with the weight, the factor and the errors in float64 (the CPU's
  default from 2026-11-29);
- ``mixed``: the float32 column loop inside each 128-column block, the weight master copy and the
  block-to-block error feedback (``W[i2:] -= U^T E``) in float64.

If float32 loses because of accumulated rounding, its excess error over float64 grows with the
input width (more columns fed back into each weight); if not, the two differ by codes flipped at
rounding boundaries, a perturbation of either sign. ``--sink W``: the sweeps run on sink-aware
GPTQ's Hessian ``H + 2 W mean(x1 x1^T)`` (``x1``: each window's first-token input), the one the
default recipe sweeps on. Written to ``--out/report.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from fp8ptq.algorithms.gptq import sweep  # noqa: E402
from fp8ptq.formats import decode, encode, get_format  # noqa: E402
from fp8ptq.io.data import build_calibration_set, load_texts, start_ids  # noqa: E402
from fp8ptq.io.loading import load_model  # noqa: E402
from fp8ptq.model.blocks import find_blocks  # noqa: E402

PRECISIONS = ("float32", "float64", "mixed")


def gram_hooks(model, grams: dict, key: str, keep: set[int]):
    """Forward pre-hooks adding ``x^T x`` (float64) of each block GEMM's input into
    ``grams[name][key]``; GEMMs fed the same tensor share one entry (``alias``). ``keep``: the
    blocks hooked (empty: all)."""
    list_name, blocks = find_blocks(model)
    last = {}
    handles = []
    for i, block in enumerate(blocks):
        if keep and i not in keep:
            continue
        for name, mod in block.named_modules():
            if not isinstance(mod, torch.nn.Linear):
                continue
            full = f"{list_name}.{i}.{name}"

            def hook(_m, args, full=full):
                x = args[0]
                if last.get("x") is x:
                    grams.setdefault(full, {"alias": last["name"]})
                    return
                last.update(x=x, name=full)
                x2 = x.detach().reshape(-1, x.shape[-1]).double()
                entry = grams.setdefault(full, {})
                entry[key] = entry.get(key, 0) + x2.T @ x2
                entry[key + "_rows"] = entry.get(key + "_rows", 0) + x2.shape[0]
                first = x.detach()[:, 0].double()  # each window's first token (the sink)
                entry[key + "_first"] = entry.get(key + "_first", 0) + first.T @ first
                entry[key + "_seqs"] = entry.get(key + "_seqs", 0) + first.shape[0]
            handles.append(mod.register_forward_pre_hook(hook))
    return handles


def run(model, ids: torch.Tensor, batch: int = 4) -> None:
    """The model's body on ``ids`` (no output layer: a 262k vocabulary's logits are 4 GB)."""
    body = getattr(model, "model", model)
    with torch.inference_mode():
        for i in range(0, ids.shape[0], batch):
            body(input_ids=ids[i:i + batch], use_cache=False)


def heldout_windows(tokenizer, path: Path, tokens: int, start: list[int]) -> torch.Tensor:
    """Windows of 512 from the first WikiText-2 test articles, each opened with ``start``."""
    text = path.read_text(encoding="utf-8")
    ids = tokenizer(text[:tokens * 8], add_special_tokens=False)["input_ids"][:tokens]
    body = 512 - len(start)
    rows = [start + ids[i:i + body] for i in range(0, len(ids) - body + 1, body)]
    return torch.tensor(rows, dtype=torch.long)


def sweep_codes(W, H, S, fmt, precision: str, damp=0.01, block=sweep.BLOCK):
    """Codes of ``W`` (act-order GPTQ) with the sweep in ``precision``."""
    if precision == "float32":
        return sweep.gptq_codes(W, H, S, fmt, damp=damp, act_order=True, block=block)
    hdiag = torch.diagonal(H).double()
    perm = torch.argsort(hdiag, descending=True)
    U = sweep._inverse_cholesky(H, damp, perm)  # float64
    Wt = W.T.index_select(0, perm).double().contiguous()
    Wt.masked_fill_((hdiag == 0).index_select(0, perm).unsqueeze(1), 0.0)
    St = S.T.index_select(0, perm).float()
    cols, rows = Wt.shape
    codes = torch.empty(cols, rows, dtype=torch.uint8)
    step = sweep._column_step(fmt, {}, W.device)
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        if precision == "float64":
            W1, U1 = Wt[i1:i2], U[i1:i2, i1:i2]
            err = torch.empty(i2 - i1, rows, dtype=torch.float64)
            d = torch.diagonal(U1)
            for i in range(W1.shape[0]):
                w = W1[i]
                c = codes[i1 + i]
                c.copy_(_encode(w, St[i1 + i], fmt))
                torch.sub(w, decode(c, fmt).double().mul_(St[i1 + i].double()), out=err[i])
                err[i].div_(d[i])
                W1[i + 1:].addr_(U1[i, i + 1:], err[i], alpha=-1)
        else:  # mixed: float32 inside the block, float64 master and block feedback
            W1 = Wt[i1:i2].float()
            err = torch.empty(i2 - i1, rows, dtype=torch.float32)
            sweep._column_loop(W1, U[i1:i2, i1:i2].float(), St[i1:i2], err, codes[i1:i2], step)
            err = err.double()
        Wt[i2:].addmm_(U[i1:i2, i2:].T, err, alpha=-1)
    return codes.T.index_select(1, torch.argsort(perm)).contiguous()


def _encode(w64: torch.Tensor, s: torch.Tensor, fmt) -> torch.Tensor:
    """The format's codes of ``w / s`` computed in float64, rounded once to float32 first (the
    codec's input dtype; a float32 value rounds to the same e4m3 code as the float64 one except
    at an exact tie, which float64's extra bits do not create)."""
    return encode((w64 / s.double()).float(), fmt)


def rel_error(W, deq, G) -> float:
    D = (W.double() - deq.double())
    return float(((D @ G) * D).sum() / ((W.double() @ G) * W.double()).sum())


def synthetic_rows(widths: list[int], seeds: list[int], out_features: int = 512) -> list[dict]:
    """The same comparison on synthetic GEMMs of any input width: ``H`` the expected Gram
    matrix of inputs with log-normal channel scales (sigma 1), eight 30x outlier channels and a
    rank-16 shared component (what makes real Hessians ill-conditioned), ``W`` Gaussian; the
    error is GPTQ's own objective ``tr(D H D^T) / tr(W H W^T)`` (no held-out rows)."""
    fmt = get_format("e4m3")
    rows = []
    for width in widths:
        for seed in seeds:
            g = torch.Generator().manual_seed(1000 * seed + width)
            scale = torch.exp(torch.randn(width, generator=g, dtype=torch.float64))
            scale[torch.randperm(width, generator=g)[:8]] *= 30
            V = torch.randn(16, width, generator=g, dtype=torch.float64) * scale
            H = torch.diag(scale ** 2) + V.T @ V / 16
            W = (torch.randn(out_features, width, generator=g) / math.sqrt(width))
            S = (W.abs().amax(1, keepdim=True) / fmt.layout.max).expand_as(W)
            row = {"seed": seed, "name": f"synthetic-{width}", "in": width, "out": out_features}
            codes = {}
            for p in PRECISIONS:
                t0 = time.perf_counter()
                codes[p] = sweep_codes(W, H, S, fmt, p)
                row[p] = rel_error(W, decode(codes[p], fmt) * S, H)
                row[p + "_s"] = time.perf_counter() - t0
            for p in ("float32", "mixed"):
                row[p + "_codes_differ"] = float((codes[p] != codes["float64"]).float().mean())
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--num-samples", type=int, default=32)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--heldout-tokens", type=int, default=4096)
    ap.add_argument("--layers", default="", help="block indices (comma list); default all")
    ap.add_argument("--out", default="out/sweep-precision")
    ap.add_argument("--assets", default=str(ROOT.parent / "shared" / "assets"))
    ap.add_argument("--synthetic", default="",
                    help="input widths of synthetic GEMMs (comma list) instead of MODEL's")
    ap.add_argument("--sink", type=float, default=0.0,
                    help="sweep on sink-aware GPTQ's H~ = H + 2 SINK mean(x1 x1^T) (x1: each "
                         "window's first-token input, unrounded) instead of H")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.synthetic:
        rows = synthetic_rows([int(w) for w in args.synthetic.split(",")],
                              [int(s) for s in args.seeds.split(",")])
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        report = {"model": "synthetic", "seeds": args.seeds, "rows": rows,
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  "torch": torch.__version__, "summary": summarise(rows)}
        (out / "report.json").write_text(json.dumps(report, indent=1))
        print(json.dumps(report["summary"], indent=1))
        return
    assets = Path(args.assets)
    loaded = load_model(args.model, dtype=torch.float32)
    model, tok = loaded.model, loaded.tokenizer
    start = start_ids(tok)  # the rule calibration and evaluation use
    fmt = get_format("e4m3")
    texts = load_texts(str(assets / "calib" / "wiki-paragraphs.txt"))
    held = heldout_windows(tok, assets / "wikitext-2-raw" / "wiki.test.raw",
                           args.heldout_tokens, start)
    keep = {int(x) for x in args.layers.split(",") if x}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        calib = build_calibration_set(texts, tok, num_samples=args.num_samples, seq_len=512,
                                      seed=seed, windows="documents")
        grams: dict = {}
        handles = gram_hooks(model, grams, "H", keep)
        run(model, calib.input_ids)
        for h in handles:
            h.remove()
        handles = gram_hooks(model, grams, "G", keep)
        run(model, held)
        for h in handles:
            h.remove()
        for name, entry in grams.items():
            src = grams[entry["alias"]] if "alias" in entry else entry
            H = 2 * src["H"] / src["H_rows"]
            if args.sink:  # sink-aware GPTQ's Hessian (``fp8ptq.algorithms.gptq.sink``)
                H = H + 2 * args.sink * src["H_first"] / src["H_seqs"]
            G = src["G"] / src["G_rows"]
            W = model.get_submodule(name).weight.detach().float()
            S = (W.abs().amax(1, keepdim=True) / fmt.layout.max).clamp_min(1e-12).expand_as(W)
            row = {"seed": seed, "name": name, "in": W.shape[1], "out": W.shape[0]}
            codes = {}
            for p in PRECISIONS:
                t0 = time.perf_counter()
                codes[p] = sweep_codes(W, H, S, fmt, p)
                deq = decode(codes[p], fmt) * S
                row[p] = rel_error(W, deq, G)
                row[p + "_cal"] = rel_error(W, deq, H)
                row[p + "_s"] = time.perf_counter() - t0
            for p in ("float32", "mixed"):
                row[p + "_codes_differ"] = float((codes[p] != codes["float64"]).float().mean())
            rows.append(row)
            print(json.dumps(row), flush=True)
    report = {"model": args.model, "num_samples": args.num_samples, "seeds": args.seeds,
              "sink": args.sink,
              "heldout_tokens": int(held.numel()), "start_ids": start,
              "machine": f"{platform.machine()} {platform.processor()}",
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "torch": torch.__version__, "rows": rows, "summary": summarise(rows)}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report["summary"], indent=1))


def summarise(rows: list[dict]) -> dict:
    """Per input width: the mean relative excess error of float32 and mixed over float64
    (held-out), with a normal 95% interval over the GEMMs, and how many of them are positive."""
    out = {}
    for width in sorted({r["in"] for r in rows}):
        sel = [r for r in rows if r["in"] == width]
        for p in ("float32", "mixed"):
            d = [(r[p] - r["float64"]) / r["float64"] * 100 for r in sel]
            m = sum(d) / len(d)
            sd = math.sqrt(sum((x - m) ** 2 for x in d) / max(len(d) - 1, 1))
            half = 1.96 * sd / math.sqrt(len(d))
            out[f"{width} {p}"] = {"gemms": len(d), "excess_pct": round(m, 4),
                                   "ci": [round(m - half, 4), round(m + half, 4)],
                                   "positive": sum(x > 0 for x in d),
                                   "codes_differ": sum(r[p + "_codes_differ"] for r in sel)
                                   / len(sel)}
    return out


if __name__ == "__main__":
    main()
