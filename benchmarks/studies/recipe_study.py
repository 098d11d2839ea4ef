"""Which e4m3 recipe: SmolLM2-135M perplexity / MiniLM SQuAD F1 of many recipes, one harness.

Which recipe should ``fp8ptq quantize MODEL --format e4m3`` use?

    python benchmarks/studies/recipe_study.py smollm2|minilm [--assets ../shared/assets]
        [--out out/recipes] [--only NAME[,NAME]] [--articles 5] [--questions 1000]
        [--num-samples 32] [--quick]

Every recipe is a ``Recipe`` (the same object ``quantize`` builds from its flags); each is
quantized in memory through ``fp8ptq.execution.job`` and scored by ``fp8ptq.evals.compare`` exactly
as
``fp8ptq eval --compare`` would, against one baseline evaluated once. One row per recipe is
cached under ``--out/MODEL/NAME.json`` (metrics, timings and the per-sample records the paired
bootstrap intervals need), so an interrupted study resumes and new recipes add rows without
re-running the old ones; the combined report (``--out/MODEL/report.json``, the schema of
``fp8ptq eval --json``) gets every delta's 95% interval against the cached baseline.

Wall times in the rows come from whatever ran beside the study: accuracy is the point here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from fp8ptq.config.recipe import Recipe  # noqa: E402
from fp8ptq.evals import report  # noqa: E402
from fp8ptq.evals.compare import Variant, evaluate_variants  # noqa: E402
from fp8ptq.evals.stats import Records  # noqa: E402
from fp8ptq.execution import job  # noqa: E402

# name -> recipe fields on top of the study's base recipe (format e4m3, calibration flags)
E4M3 = {
    "w-only": dict(act_format="none"),
    "w-only-gptq": dict(act_format="none", weight_calib="gptq"),
    "static": dict(),  # channel weights + static per-tensor activations (max)
    "static-best": dict(act_calib="best"),
    "static-gptq": dict(weight_calib="gptq"),
    "static-best-gptq": dict(act_calib="best", weight_calib="gptq"),
    "fp8-static": dict(scheme="fp8-static"),  # llm-compressor FP8: tensor W, static tensor A
    "fp8-static-gptq": dict(scheme="fp8-static", weight_calib="gptq"),
    "fp8-static-best": dict(scheme="fp8-static", act_calib="best"),
    "fp8-dynamic": dict(scheme="fp8-dynamic"),  # channel W, dynamic per-token A
    "fp8-dynamic-gptq": dict(scheme="fp8-dynamic", weight_calib="gptq"),
    "fp8-dynamic-gptq-mse": dict(act_granularity="token", weight_calib="gptq-mse"),
    "fp8-dynamic-gptq-ao": dict(act_granularity="token", weight_calib="gptq",
                                gptq_act_order=True),
    # sequential GPTQ (each Hessian from the model quantized so far, group by group)
    "w-only-gptq-seq": dict(act_format="none", weight_calib="gptq", gptq_sequential=True),
    "w-only-gptq-seq-ao": dict(act_format="none", weight_calib="gptq", gptq_sequential=True,
                               gptq_act_order=True),
    "fp8-dynamic-gptq-seq": dict(scheme="fp8-dynamic", weight_calib="gptq",
                                 gptq_sequential=True),
    "fp8-dynamic-gptq-seq-ao": dict(scheme="fp8-dynamic", weight_calib="gptq",
                                    gptq_sequential=True, gptq_act_order=True),
    # samples that open a document after the BOS (llm-compressor's and the evaluation's way)
    "fp8-dynamic-gptq-seq-ao-docs": dict(scheme="fp8-dynamic", weight_calib="gptq",
                                         gptq_sequential=True, gptq_act_order=True,
                                         calib_windows="documents"),
    # weight scales by the Hessian-diagonal-weighted rounding error (calibrators/hmse.py)
    "fp8-dynamic-gptq-seq-ao-docs-hmse": dict(scheme="fp8-dynamic", weight_calib="gptq-hmse",
                                              gptq_sequential=True, gptq_act_order=True,
                                              calib_windows="documents"),
    "fp8-dynamic-hmse": dict(scheme="fp8-dynamic", weight_calib="hmse"),
    "hif8-dynamic-gptq-seq-ao-docs-hmse": dict(format="hif8", act_granularity="token",
                                               weight_calib="gptq-hmse", gptq_sequential=True,
                                               gptq_act_order=True, calib_windows="documents"),
    "fp8-dynamic-sqa5-gptq-seq-ao-docs": dict(scheme="fp8-dynamic", smoothquant=0.5,
                                              smoothquant_into="all", weight_calib="gptq",
                                              gptq_sequential=True, gptq_act_order=True,
                                              calib_windows="documents"),
    "fp8-dynamic-sqa5-gptq-seq-ao-docs-hmse": dict(scheme="fp8-dynamic", smoothquant=0.5,
                                                   smoothquant_into="all",
                                                   weight_calib="gptq-hmse",
                                                   gptq_sequential=True, gptq_act_order=True,
                                                   calib_windows="documents"),
    # asymmetric GPTQ (GPTAQ): each GEMM aims at the float model's output
    # (fp8ptq.algorithms.gptq.asym)
    "fp8-dynamic-gptq-seq-ao-docs-asym": dict(scheme="fp8-dynamic", weight_calib="gptq",
                                              gptq_sequential=True, gptq_act_order=True,
                                              calib_windows="documents", gptq_asym=True),
    "w-only-gptq-seq-ao-docs": dict(act_format="none", weight_calib="gptq",
                                    gptq_sequential=True, gptq_act_order=True,
                                    calib_windows="documents"),
    "fp8-dynamic-gptq-seq-ao-mse": dict(scheme="fp8-dynamic", weight_calib="gptq-mse",
                                        gptq_sequential=True, gptq_act_order=True),
    "fp8-dynamic-gptq-seq-ao-damp1": dict(scheme="fp8-dynamic", weight_calib="gptq",
                                          gptq_sequential=True, gptq_act_order=True,
                                          gptq_damp=0.1),
    "fp8-dynamic-rot-gptq-seq-ao": dict(act_granularity="token", rotate="hadamard",
                                        weight_calib="gptq", gptq_sequential=True,
                                        gptq_act_order=True),
    "fp8-dynamic-sq-gptq-seq-ao": dict(act_granularity="token", smoothquant=0.5,
                                       weight_calib="gptq", gptq_sequential=True,
                                       gptq_act_order=True),
    "hif8-dynamic-gptq-seq-ao": dict(format="hif8", act_granularity="token",
                                     weight_calib="gptq", gptq_sequential=True,
                                     gptq_act_order=True),
    "hfp8-dynamic-gptq-seq-ao": dict(format="hfp8", act_granularity="token",
                                     weight_calib="gptq", gptq_sequential=True,
                                     gptq_act_order=True),
    "fp8-dynamic-rot": dict(act_granularity="token", rotate="hadamard"),
    "fp8-dynamic-rot-gptq": dict(act_granularity="token", rotate="hadamard",
                                 weight_calib="gptq"),
    # SmoothQuant into the GEMM -> GEMM pairs (up -> down, v -> o; --smoothquant-into)
    "fp8-dynamic-sq5": dict(scheme="fp8-dynamic", smoothquant=0.5),  # norms only
    "fp8-dynamic-sqg5": dict(scheme="fp8-dynamic", smoothquant=0.5, smoothquant_into="gemms"),
    "fp8-dynamic-sqg8": dict(scheme="fp8-dynamic", smoothquant=0.8, smoothquant_into="gemms"),
    "fp8-dynamic-sqa5": dict(scheme="fp8-dynamic", smoothquant=0.5, smoothquant_into="all"),
    "fp8-dynamic-sqg-auto": dict(scheme="fp8-dynamic", smoothquant="auto",
                                 smoothquant_into="gemms"),
    "fp8-dynamic-sqg5-gptq-seq-ao-docs": dict(scheme="fp8-dynamic", smoothquant=0.5,
                                              smoothquant_into="gemms", weight_calib="gptq",
                                              gptq_sequential=True, gptq_act_order=True,
                                              calib_windows="documents"),
    "fp8-dynamic-sqg8-gptq-seq-ao-docs": dict(scheme="fp8-dynamic", smoothquant=0.8,
                                              smoothquant_into="gemms", weight_calib="gptq",
                                              gptq_sequential=True, gptq_act_order=True,
                                              calib_windows="documents"),
    "hif8-dynamic-gptq-seq-ao-docs": dict(format="hif8", act_granularity="token",
                                          weight_calib="gptq", gptq_sequential=True,
                                          gptq_act_order=True, calib_windows="documents"),
    "fp8-dynamic-sq-gptq": dict(act_granularity="token", smoothquant=0.5, weight_calib="gptq"),
    "fp8-block": dict(scheme="fp8-block"),  # 128x128 W blocks, dynamic 1x128 A groups
    "fp8-block-gptq-seq-ao-docs": dict(scheme="fp8-block", weight_calib="gptq",
                                       gptq_sequential=True, gptq_act_order=True,
                                       calib_windows="documents"),
    # analysis rows (FLOAT_WEIGHTS): activations quantized, weights left in float
    "a-only-fp8-dynamic": dict(scheme="fp8-dynamic"),
    "a-only-fp8-group": dict(scheme="fp8-dynamic", act_granularity="group"),
    "fp8-block-gptq": dict(scheme="fp8-block", weight_calib="gptq"),
    "fp8-group-channel": dict(act_granularity="group"),
    "fp8-group-channel-gptq": dict(act_granularity="group", weight_calib="gptq"),
    "mxfp8": dict(format="mxfp8"),
    "mxfp8-gptq": dict(format="mxfp8", weight_calib="gptq"),
    "mxfp8-gptq-seq-ao-docs": dict(format="mxfp8", weight_calib="gptq", gptq_sequential=True,
                                   gptq_act_order=True, calib_windows="documents"),
    "a-only-mxfp8": dict(format="mxfp8"),  # FLOAT_WEIGHTS: MX's 1x32 E8M0 activation floor
    # the same with the E8M0 exponent NVIDIA's kernels pick (no saturation): --format mxfp8-ceil
    "a-only-mxfp8-ru": dict(format="mxfp8-ceil"),
    "mxfp8-ru": dict(format="mxfp8-ceil"),
    "mxfp8-ru-gptq-seq-ao-docs": dict(format="mxfp8-ceil", weight_calib="gptq",
                                      gptq_sequential=True, gptq_act_order=True,
                                      calib_windows="documents"),
    "mxfp8-e5m2": dict(format="mxfp8-e5m2"),
    # the other formats' best recipes next to e4m3
    "hfp8-static": dict(format="hfp8"),
    "hfp8-dynamic": dict(format="hfp8", act_granularity="token"),
    "hfp8-dynamic-gptq": dict(format="hfp8", act_granularity="token", weight_calib="gptq"),
    "hif8-static": dict(format="hif8"),
    "hif8-pow2": dict(format="hif8", act_calib="pow2-search"),
    "hif8-dynamic": dict(format="hif8", act_granularity="token"),
    "hif8-dynamic-gptq": dict(format="hif8", act_granularity="token", weight_calib="gptq"),
    "e5m2-dynamic-gptq": dict(format="e5m2", act_granularity="token", weight_calib="gptq"),
    # FP8 (e4m3) KV cache (--kv-cache fp8) and FP8 attention (--kv-cache fp8
    # --quantize-attention: Q, K and V in e4m3 with the scales a checkpoint's q_scale / k_scale /
    # v_scale carry, Q per KV head as vLLM serves a per-head q_scale): alone (no GEMM
    # quantized), on top of FP8_DYNAMIC rounded to nearest (the default without calibration
    # data) and on top of the default W8A8 recipe, one scale per layer or per head
    **{f"{stem}{what}-{g}": dict(fields, kv_cache="fp8", kv_granularity=g,
                                 quantize_attention=what == "attn")
       for what in ("kv", "attn") for g in ("tensor", "head") for stem, fields in (
           ("", dict(skip=["*"], calib_windows="documents")),
           ("fp8-dynamic-", dict(scheme="fp8-dynamic", calib_windows="documents")),
           ("fp8-dynamic-gptq-seq-ao-docs-", dict(scheme="fp8-dynamic", weight_calib="gptq",
                                                 gptq_sequential=True, gptq_act_order=True,
                                                 calib_windows="documents")))},
}


# Rows whose weights are put back to float after quantization: what the activations' rounding
# alone costs (the floor an activation scheme puts under any weight method). Analysis only:
# no fp8ptq option does this.
FLOAT_WEIGHTS = {"a-only-fp8-dynamic", "a-only-fp8-group", "a-only-mxfp8", "a-only-mxfp8-ru"}


@contextmanager
def float_weights(enabled: bool):
    """While active, every ``QuantGemm`` built keeps its float weight (inputs still quantized)."""
    if not enabled:
        yield
        return
    from fp8ptq.nn.quant_gemm import QuantGemm
    original = QuantGemm.__init__

    def keep_float(self, inner, **kwargs):
        w = inner.weight.detach().clone()
        original(self, inner, **kwargs)
        with torch.no_grad():
            self.inner.weight.copy_(w)

    QuantGemm.__init__ = keep_float
    try:
        yield
    finally:
        QuantGemm.__init__ = original


MODELS = {
    "smollm2": {"spec": "models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf",
                "task": "wikitext", "data": "wikitext-2-raw/wiki.test.raw", "seq_len": 2048},
    "minilm": {"spec": "models/minilm-squad", "task": "squad",
               "data": "squad-v1.1/dev-heldout.json", "seq_len": None},
    # the second causal LM family, outside the assets: ``bash ../shared/assets/
    # fetch-gemma-270m.sh`` prints where it put the GGUF (FP8PTQ_GEMMA overrides)
    "gemma": {"spec": os.environ.get("FP8PTQ_GEMMA", str(
                  Path("~/.cache/fp8ptq-assets/gemma-3-270m-q4_k_m.gguf").expanduser())),
              "task": "wikitext", "data": "wikitext-2-raw/wiki.test.raw", "seq_len": 2048},

}


def records_to_json(records: dict[str, Records]) -> dict:
    return {task: {"ids": [r if isinstance(r, (int, str)) else str(r) for r in rec.ids],
                   "columns": {k: v.tolist() for k, v in rec.columns.items()},
                   "formulas": {k: list(v) for k, v in rec.formulas.items()},
                   "scale": rec.scale} for task, rec in records.items()}


def records_from_json(data: dict) -> dict[str, Records]:
    return {task: Records(d["ids"], {k: np.array(v) for k, v in d["columns"].items()},
                          {k: tuple(v) for k, v in d["formulas"].items()}, d["scale"])
            for task, d in data.items()}


def run_one(name: str, fields: dict | None, spec: str, base: Recipe, texts, task: str,
            eval_kwargs: dict, out: Path, checkpoint: str | None = None) -> dict:
    """Evaluate one recipe (``fields`` None: the unquantized baseline) or a checkpoint folder
    (``fp8ptq eval --compare DIR``'s variant: fp8ptq's, or another tool's loaded by
    transformers); cached as JSON."""
    path = out / f"{name}.json"
    if path.exists():
        return json.loads(path.read_text())
    recipe = base if fields is None else base.merged(**fields)
    kind = "checkpoint" if checkpoint else "baseline" if fields is None else "quantized"
    variant = Variant(name, kind, checkpoint or spec, recipe)
    t0 = time.perf_counter()
    with float_weights(name in FLOAT_WEIGHTS):
        rows, protocol, _ = evaluate_variants([variant], base, texts, [task], [], device="cpu",
                                              **eval_kwargs)
    row = rows[0]
    doc = {"name": name, "kind": kind, "fields": fields, "metrics": row["metrics"],
           "seconds": row["seconds"], "timings": row["timings"], "recipe": row["recipe"],
           "protocol": protocol, "wall_seconds": time.perf_counter() - t0,
           "peak_rss_mb": job.peak_rss_mb(), "records": records_to_json(row["records"])}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=sorted(MODELS))
    ap.add_argument("--assets", default=os.environ.get("FP8PTQ_ASSETS",
                                                       str(ROOT.parent / "shared/assets")))
    ap.add_argument("--out", default=str(ROOT / "out/recipes"))
    ap.add_argument("--only", help="comma-separated recipe names (default: all)")
    ap.add_argument("--articles", type=int, default=5)
    ap.add_argument("--questions", type=int, default=1000)
    ap.add_argument("--num-samples", type=int, default=32)
    ap.add_argument("--dtype", default="float32",
                    help="model dtype (float32: CPUs without bf16 GEMMs run bf16 ~50x slower)")
    ap.add_argument("--quick", action="store_true", help="1 article / 50 questions, 8 samples")
    ap.add_argument("--checkpoints", default="",
                    help="NAME=FOLDER,... checkpoint folders evaluated beside the recipes")
    args = ap.parse_args(argv)
    m = MODELS[args.model]
    assets = Path(args.assets).resolve()
    spec = str(assets / m["spec"])
    limit = (1 if args.quick else args.articles) if m["task"] == "wikitext" else (
        50 if args.quick else args.questions)
    out = Path(args.out).resolve() / (args.model + ("-quick" if args.quick else "") +
                                      f"-{limit}")
    out.mkdir(parents=True, exist_ok=True)
    # the rows are relative to this base; its recipe fields are pinned so that a change of
    # fp8ptq's defaults does not change what a cached row name means
    base = Recipe(calib_data=str(assets / "calib/wiki-paragraphs.txt"),
                  num_samples=8 if args.quick else args.num_samples, seq_len=512,
                  dtype=args.dtype, format="e4m3", weight_granularity="channel",
                  act_granularity="tensor", weight_calib="max", act_calib="max",
                  gptq_sequential=False, calib_windows="random")
    eval_kwargs = {"data": {m["task"]: str(assets / m["data"])}, "limit": limit,
                   "seq_len": m["seq_len"], "batch_size": None}
    names = [n for n in args.only.split(",") if n] if args.only is not None else list(E4M3)
    unknown = [n for n in names if n not in E4M3]
    if unknown:
        raise SystemExit(f"unknown recipe(s) {unknown}; known: {', '.join(E4M3)}")
    texts = job.calibration_texts(base, spec)
    docs = [run_one("baseline", None, spec, base, texts, m["task"], eval_kwargs, out)]
    for name in names:
        docs.append(run_one(name, E4M3[name], spec, base, texts, m["task"], eval_kwargs, out))
        print(f"{name}: {docs[-1]['metrics']} ({docs[-1]['wall_seconds']:.0f} s)", flush=True)
    for item in filter(None, args.checkpoints.split(",")):
        name, _, folder = item.partition("=")
        docs.append(run_one(name, {}, spec, base, texts, m["task"], eval_kwargs, out,
                            checkpoint=folder))
        print(f"{name}: {docs[-1]['metrics']} ({docs[-1]['wall_seconds']:.0f} s)", flush=True)
    rows = [{**d, "records": records_from_json(d["records"])} for d in docs]
    report.attach_intervals(rows)
    doc = report.to_json(rows, docs[0]["protocol"], base.to_dict())
    for entry, d in zip(doc["variants"], docs):
        entry.update({"fields": d["fields"], "timings": d["timings"],
                      "peak_rss_mb": d["peak_rss_mb"]})
    (out / "report.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(report.to_markdown(rows))
    return doc


if __name__ == "__main__":
    main()
