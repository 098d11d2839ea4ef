"""What a rolling window's first token does to a model that is always served after its BOS:
lm-eval's windows (a document's first opens with the prefix token, each later one with a
token of the text) against windows that all open with the BOS, for one checkpoint and its
parts.

    python benchmarks/studies/window_starts.py CHECKPOINT [--source FLOAT_FOLDER]
        [--articles 2] [--context 2048] [--json OUT] [--assets ../shared/assets]

Scores the first ``--articles`` WikiText-2 test articles (lm-eval's detokenizer, the
tokenizer's own BOS taken off) with the float model, the checkpoint as served, its FP8 weights
only (inputs unrounded) and its input rounding only (float weights), each way:

- ``rolling``: lm-eval's ``loglikelihood_rolling`` windows (context_len 1): the first of a
  document is ``[BOS] + tokens``, every later one opens with the text's token before its
  first scored one;
- ``bos-each``: the same tokens scored in windows of ``context - 1`` that each open with
  ``[BOS, previous token]``, as every request reaches a server.

Prints token perplexity per window kind and each variant's delta against the float model.
One forward per window and variant (no batching), float32 logits.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "studies"))

from loss_parts import keep_only  # noqa: E402


def windows(ids: list[int], bos: int, length: int) -> list[tuple[str, list[int], list[int]]]:
    """(kind, inputs, scored targets) for one document's tokens ``ids``, both ways."""
    out = []
    first = min(length, len(ids))
    out.append(("rolling-first", [bos] + ids[:first - 1], ids[:first]))
    p = first
    while p < len(ids):
        e = min(len(ids), p + length)
        out.append(("rolling-later", ids[e - length - 1:e - 1], ids[p:e]))
        p = e
    p = 0
    while p < len(ids):
        e = min(len(ids), p + length - 1)
        ctx = [bos] + ids[:e - 1] if p == 0 else [bos] + ids[p - 1:e - 1]
        out.append(("bos-each", ctx, ids[p:e]))
        p = e
    return out


def nlls(model, wins) -> list[float]:
    """Summed negative log-likelihood of each window's targets (the last positions)."""
    out = []
    for _, x, y in wins:
        with torch.no_grad():
            logits = model(torch.tensor([x])).logits.float()[0]
        logp = torch.log_softmax(logits[-len(y):], -1)
        out.append(-float(logp.gather(1, torch.tensor(y)[:, None]).double().sum()))
    return out


def deltas(wins, res: dict[str, list[float]]) -> dict[str, dict]:
    """Per window kind (and per way, all its windows): tokens, the float model's token
    perplexity and each variant's delta in percent."""
    groups = {k: [i for i, w in enumerate(wins) if w[0] == k] for k in dict.fromkeys(
        w[0] for w in wins)}
    groups["rolling (all)"] = [i for i, w in enumerate(wins) if w[0].startswith("rolling")]
    out = {}
    for kind, idx in groups.items():
        n = sum(len(wins[i][2]) for i in idx)
        base = sum(res["float"][i] for i in idx)
        out[kind] = {"windows": len(idx), "tokens": n, "float_ppl": math.exp(base / n),
                     **{k: 100 * (math.exp((sum(v[i] for i in idx) - base) / n) - 1)
                        for k, v in res.items() if k != "float"}}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--source")
    ap.add_argument("--articles", type=int, default=2)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--assets", default=str(ROOT.parent / "shared/assets"))
    args = ap.parse_args(argv)
    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer

    from fp8ptq.config.recipe import Recipe
    from fp8ptq.evals.compare import Variant, load_variant
    from fp8ptq.evals.wikitext import read_articles
    from fp8ptq.nn.quant_gemm import QuantGemm

    source = args.source or json.loads((args.checkpoint / "fp8ptq.json").read_text())[
        "source"]["path"]
    recipe = Recipe(dtype="float32")
    q = load_variant(Variant("q", "checkpoint", str(args.checkpoint), recipe))
    f = load_variant(Variant("f", "baseline", source, recipe))
    tok, bos = q.tokenizer, q.tokenizer.bos_token_id
    wins = []
    for doc in read_articles(Path(args.assets) / "wikitext-2-raw/wiki.test.raw")[:args.articles]:
        wins += windows(tok(wikitext_detokenizer(doc), add_special_tokens=False).input_ids,
                        bos, args.context)
    res = {"float": nlls(f.model, wins), "served": nlls(q.model, wins)}
    formats = {n: m.act_format for n, m in q.model.named_modules() if isinstance(m, QuantGemm)}
    keep_only(q.model, "weights")
    res["weights only"] = nlls(q.model, wins)
    for n, m in q.model.named_modules():
        if n in formats:
            m.act_format = formats[n]
    keep_only(q.model, "acts", f.model)
    res["input rounding only"] = nlls(q.model, wins)
    table = deltas(wins, res)
    for kind, r in table.items():
        print(f"{kind}: {r['windows']} windows, {r['tokens']} tokens, float token ppl "
              f"{r['float_ppl']:.3f}; " + ", ".join(
                  f"{k} {v:+.2f}%" for k, v in r.items()
                  if k not in ("windows", "tokens", "float_ppl")))
    report = {"checkpoint": str(args.checkpoint), "source": source, "context": args.context,
              "articles": args.articles, "table": table}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
