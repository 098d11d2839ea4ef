"""A recipe variant against the default, paired per calibration seed and pooled over seeds, from
``benchmarks/llmc_vs_default.py``'s cached rows (any model it runs: SmolLM2, gemma-3-270m).

    python benchmarks/studies/seed_pairs.py out/llmc-vs-default/smollm2-5
        --variant fp8ptq-n32-n64 [--base fp8ptq-n64] [--seeds 0,1,2,3,4] [--json OUT]

Reads ``BASE-seedS.json`` and ``VARIANT-seedS.json`` (the rows ``--steps eval`` wrote: per-article
log-likelihoods and word counts) and ``baseline.json``. Prints, per seed, each side's word
perplexity against the unquantized baseline and the variant minus the default in percent of
the default's perplexity with its paired bootstrap 95% interval (articles resampled); then the
same pooled over the seeds (each side's per-article columns averaged over seeds, as the
llm-compressor comparison pools). The two-families rule reads the pooled line: a default
changes only where the alternative's interval ends at or below +0.1% on both families and the
alternative is better on one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from llmc_vs_default import paired_diff, pooled  # noqa: E402


def _load(folder: Path, name: str) -> dict:
    return json.loads((folder / f"{name}.json").read_text())


def compare(folder: Path, base: str, variant: str, seeds: list[int]) -> dict:
    """Per seed and pooled: each side's delta against the baseline and variant minus base."""
    ref = _load(folder, "baseline")
    metric = "wikitext.word_perplexity"
    b0 = ref["metrics"][metric]
    out = {"folder": str(folder), "base": base, "variant": variant, "baseline": b0,
           "seeds": {}}
    bases, variants = [], []
    for s in seeds:
        try:
            b, v = _load(folder, f"{base}-seed{s}"), _load(folder, f"{variant}-seed{s}")
        except FileNotFoundError as e:
            out["seeds"][s] = {"missing": Path(e.filename).name}
            continue
        d, ci = paired_diff(v, b)
        out["seeds"][s] = {"base_pct": 100 * (b["metrics"][metric] / b0 - 1),
                           "variant_pct": 100 * (v["metrics"][metric] / b0 - 1),
                           "minus": d, "ci95": ci}
        bases.append(b)
        variants.append(v)
    if len(bases) >= 2:
        d, ci = paired_diff(pooled(variants), pooled(bases))
        per_seed = [x["minus"] for x in out["seeds"].values() if "minus" in x]
        out["pooled"] = {"seeds": [s for s in seeds if "minus" in out["seeds"][s]],
                         "minus": d, "ci95": ci,
                         "base_pct": sum(x["base_pct"] for x in out["seeds"].values()
                                         if "base_pct" in x) / len(bases),
                         "variant_pct": sum(x["variant_pct"] for x in out["seeds"].values()
                                            if "variant_pct" in x) / len(bases),
                         "over_seeds": seed_interval(per_seed)}
    return out


# two-sided 95% Student t quantiles by degrees of freedom
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228}


def seed_interval(values: list[float]) -> tuple[float, list[float]]:
    """Mean of the per-seed differences with its t interval over the seeds: the uncertainty
    a change that moves codes the way another calibration seed does (sequential GPTQ spreads
    any flipped code through the layers after it, ``code_agreement.py``) leaves, which the
    pooled interval (articles resampled, seeds fixed) does not hold."""
    n = len(values)
    mean = sum(values) / n
    sd = (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5
    half = T975.get(n - 1, 1.96) * sd / n ** 0.5
    return mean, [mean - half, mean + half]


def _span(d: float, ci) -> str:
    return f"{d:+.2f}%" + (f" ({ci[0]:+.2f}..{ci[1]:+.2f})" if ci else "")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--variant", required=True)
    ap.add_argument("--base", default="fp8ptq-n64")
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    seeds = [int(x) for x in args.seeds.split(",")]
    res = compare(args.folder, args.base, args.variant, seeds)
    print(f"{args.folder}: baseline {res['baseline']:.3f}; {args.variant} minus {args.base}")
    for s, r in res["seeds"].items():
        if "missing" in r:
            print(f"  seed {s}: {r['missing']} missing")
        else:
            print(f"  seed {s}: base {r['base_pct']:+.2f}%, variant {r['variant_pct']:+.2f}%, "
                  f"minus {_span(r['minus'], r['ci95'])}")
    if "pooled" in res:
        p = res["pooled"]
        print(f"  pooled over seeds {p['seeds']}: base {p['base_pct']:+.2f}%, variant "
              f"{p['variant_pct']:+.2f}% (means), minus {_span(p['minus'], p['ci95'])}; "
              f"over the seeds (t) {_span(*p['over_seeds'])}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
