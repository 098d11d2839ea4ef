"""Where a default's loss comes from on the slice it is judged on: one checkpoint with only its
weights or only its input rounding, and every seed's checkpoint against the input rounding alone.

    python benchmarks/studies/loss_parts.py out/gemma-bos1 --checkpoint DIR
        [--rows fp8ptq-s64-n64,fp8ptq-m64-n64] [--seeds 0,1,2,3,4] [--source FLOAT_FOLDER]
        [--articles 2] [--threads 1] [--window-start first|every] [--doc docs/results/studies.md]
        [--assets ../shared/assets]

``FOLDER``: ``benchmarks/llmc_vs_default.py``'s evaluation rows of one model (``baseline.json``,
``NAME-seedS.json``: per-article log-likelihoods; WikiText-2 test, context 2048, word
perplexity). ``--checkpoint``: an fp8ptq checkpoint of the default recipe (channel weights,
dynamic per-token e4m3 inputs), evaluated through the same harness twice more and cached in
``FOLDER``: ``parts-weights`` (its FP8 weights, inputs unrounded) and ``parts-acts`` (the float
weights, every quantized GEMM's input rounded per token as the runtime does: amax / 448,
round to nearest even). No fp8ptq option serves either; they split the loss.

Why the input rounding alone is the reference: FP8_DYNAMIC fixes it, so it is what a recipe
that rounded no weight at all would cost. A checkpoint below it on a slice has weights that
offset part of the input rounding there (or that fit the slice's text better than the float
model's), which the per-seed and pooled rows show.

Prints, and writes as the ``loss-parts`` block of ``--doc``: the parts against the baseline
(paired bootstrap 95%, articles resampled); per row and seed the delta against the baseline
and the difference from the input rounding alone; the same pooled over the seeds (each
article's log-likelihood averaged over them) with the t interval over the seeds themselves.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "studies"))

from llmc_vs_default import paired_diff, pooled  # noqa: E402
from results_page import md_table, page_of, splice  # noqa: E402
from seed_pairs import seed_interval  # noqa: E402

METRIC = "wikitext.word_perplexity"
BLOCK = "loss-parts"  # "loss-parts-every" for rows evaluated with --window-start every
PARTS = ("weights", "acts")


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _pct(doc: dict, base: float) -> float:
    return 100 * (doc["metrics"][METRIC] / base - 1)


def keep_only(model, part: str, float_model=None) -> None:
    """Leave ``model``'s quantized GEMMs with only ``part`` of their quantization: ``weights``
    (inputs unrounded) or ``acts`` (``float_model``'s weights put back, inputs still rounded)."""
    import torch

    from fp8ptq.nn.quant_gemm import QuantGemm

    gemms = {n: m for n, m in model.named_modules() if isinstance(m, QuantGemm)}
    if part == "weights":
        for m in gemms.values():
            m.act_format = None
        return
    floats = {n: m.weight for n, m in float_model.named_modules()
              if isinstance(m, torch.nn.Linear)}
    with torch.no_grad():
        for name, m in gemms.items():
            m.inner.weight.copy_(floats[name])


@contextmanager
def only(part: str, source: str):
    """While active, a checkpoint the harness loads keeps only ``part`` of its quantization
    (``keep_only``; ``source``: the float model whose weights ``acts`` puts back)."""
    import fp8ptq.evals.compare as cmp

    original = cmp.load_variant

    def patched(v, *args, **kwargs):
        loaded = original(v, *args, **kwargs)
        if v.kind == "checkpoint":
            ref = None if part == "weights" else original(
                cmp.Variant("float", "baseline", source, v.recipe)).model
            keep_only(loaded.model, part, ref)
        return loaded

    cmp.load_variant = patched
    try:
        yield
    finally:
        cmp.load_variant = original


def evaluate_parts(folder: Path, checkpoint: Path, source: str, assets: Path,
                   articles: int, window_start: str = "first") -> dict[str, dict]:
    """``parts-weights`` and ``parts-acts`` of ``checkpoint`` through the harness's own
    evaluation (cached in ``folder``)."""
    from recipe_study import run_one

    from fp8ptq.config.recipe import Recipe

    base = Recipe(calib_data=str(assets / "calib/wiki-paragraphs.txt"), dtype="float32")
    kwargs = {"data": {"wikitext": str(assets / "wikitext-2-raw/wiki.test.raw")},
              "limit": articles, "seq_len": 2048, "batch_size": None,
              "window_start": window_start}
    out = {}
    for part in PARTS:
        with only(part, source):
            out[part] = run_one(f"parts-{part}", {}, source, base, [], "wikitext", kwargs,
                                folder, checkpoint=str(checkpoint))
    return out


def floor_report(folder: Path, floor: dict, rows: list[str], seeds: list[int]) -> dict:
    """The floor (the input rounding alone) against the baseline; each row per seed and pooled
    against the floor."""
    base = _load(folder / "baseline.json")
    b0 = base["metrics"][METRIC]
    d, ci = paired_diff(floor, base)
    out = {"folder": str(folder), "baseline": b0,
           "floor": {"pct": _pct(floor, b0), "minus_baseline": d, "ci95": ci}, "rows": {}}
    for name in rows:
        docs, per = [], {}
        for s in seeds:
            path = folder / f"{name}-seed{s}.json"
            if not path.exists():
                per[s] = {"missing": path.name}
                continue
            doc = _load(path)
            d, ci = paired_diff(doc, floor)
            per[s] = {"pct": _pct(doc, b0), "minus_floor": d, "ci95": ci}
            docs.append(doc)
        entry = {"seeds": per}
        if len(docs) >= 2:
            pool = pooled(docs)
            d, ci = paired_diff(pool, floor)
            diffs = [p["minus_floor"] for p in per.values() if "minus_floor" in p]
            entry["pooled"] = {"pct": _pct(pool, b0), "minus_floor": d, "ci95": ci,
                               "below": sum(x < 0 for x in diffs), "n": len(diffs),
                               "over_seeds": seed_interval(diffs)}
        out["rows"][name] = entry
    return out


def _span(d: float, ci) -> str:
    return f"{d:+.2f}%" + (f" ({ci[0]:+.2f}..{ci[1]:+.2f})" if ci else "")


def lines(res: dict) -> list[str]:
    f = res["floor"]
    text = [f"{res['folder']}: baseline {res['baseline']:.3f}; activations alone (float "
            f"weights) {_span(f['minus_baseline'], f['ci95'])}"]
    for name, entry in res["rows"].items():
        text.append(f"  {name}:")
        for s, r in entry["seeds"].items():
            text.append(f"    seed {s}: {r['missing']} missing" if "missing" in r else
                        f"    seed {s}: {r['pct']:+.2f}%, minus the floor "
                        f"{_span(r['minus_floor'], r['ci95'])}")
        if "pooled" in entry:
            p = entry["pooled"]
            text.append(f"    pooled: {p['pct']:+.2f}%, minus the floor "
                        f"{_span(p['minus_floor'], p['ci95'])}; below it at {p['below']} of "
                        f"{p['n']} seeds; over the seeds (t) {_span(*p['over_seeds'])}")
    return text


def section(res: dict, parts: dict[str, dict], full: dict, checkpoint: str, argv: list[str]
            ) -> str:
    """The ``loss-parts`` block: the parts table, then the rows against the input rounding."""
    base = _load(Path(res["folder"]) / "baseline.json")
    proto = base["protocol"]["wikitext"]
    table = []
    for label, doc in (("everything (the checkpoint as served)", full),
                       ("its FP8 weights only (inputs unrounded)", parts["weights"]),
                       ("the input rounding only (float weights)", parts["acts"])):
        d, ci = paired_diff(doc, base)
        table.append([label, f"{doc['metrics'][METRIC]:.3f}", _span(d, ci)])
    once = " once (the tokenizer's own BOS taken off)" if proto.get("own_start_dropped") else ""
    out = [f"Generated by `python benchmarks/studies/loss_parts.py {' '.join(argv)}` "
           f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}). WikiText-2 test, "
           f"{proto['documents']} articles, context {proto['context_length']}, "
           f"{proto['tokens']} scored tokens, prefix token {proto['prefix_token']}{once}, "
           f"opening {'every window' if proto.get('window_start') == 'every' else 'a document'}; "
           f"word perplexity against the unquantized model ({res['baseline']:.3f}), paired "
           f"bootstrap 95% over the articles. Parts of `{checkpoint}`:", "",
           md_table(["what is quantized", "word ppl", "delta"], table), "",
           "Each calibration seed's checkpoint against the input rounding alone:", ""]
    rows = []
    for name, entry in res["rows"].items():
        per = [f"{r['pct']:+.2f}% ({r['minus_floor']:+.2f})" for r in entry["seeds"].values()
               if "pct" in r]
        p = entry.get("pooled")
        rows.append([f"`{name}`", ", ".join(per),
                     f"{p['pct']:+.2f}%" if p else "-",
                     f"{_span(p['minus_floor'], p['ci95'])}; t {_span(*p['over_seeds'])}"
                     if p else "-"])
    out += [md_table(["rows", "per seed: delta (minus the input rounding alone)",
                      "pooled delta", "pooled minus the input rounding alone"], rows)]
    return "\n".join(out) + "\n"


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--rows", default="fp8ptq-s64-n64")
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--source", help="the float model (default: the checkpoint's source)")
    ap.add_argument("--articles", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--window-start", default="first", choices=("first", "every"),
                    help="the rows' windows (``fp8ptq eval --window-start``)")
    ap.add_argument("--assets", default=str(ROOT.parent / "shared/assets"))
    ap.add_argument("--doc", default=str(page_of(BLOCK)))
    ap.add_argument("--block", help="the block of --doc to write (default: loss-parts, "
                    "loss-parts-every under --window-start every)")
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    meta = _load(args.checkpoint / "fp8ptq.json")
    source = args.source or meta["source"]["path"]
    parts = evaluate_parts(args.folder, args.checkpoint, source, Path(args.assets),
                           args.articles, args.window_start)
    full = _load(args.folder / f"{args.checkpoint.name}.json")
    res = floor_report(args.folder, parts["acts"], [r for r in args.rows.split(",") if r],
                       [int(x) for x in args.seeds.split(",")])
    print("\n".join(lines(res)))
    text = section(res, parts, full, args.checkpoint.name, argv)
    (args.folder / "loss-parts.json").write_text(json.dumps(res, indent=1) + "\n")
    if args.doc:
        block = args.block or (BLOCK if args.window_start == "first" else f"{BLOCK}-every")
        Path(args.doc).write_text(splice(Path(args.doc).read_text(), text, block))
    return res


if __name__ == "__main__":
    main()
